"""A client process for the multi-process tests: ``python client_worker.py '<json spec>'``.

spec: {"addr", "layout": {...KvLayout fields}, "action", "hashes": [hex, ...], "tag": str, ...}
actions:
  save             allocate, write the block pattern, seal; prints {"statuses": [...], "sealed": n}
  load             query with a lease, read, compare with the pattern, release; prints {"hits", "match"}
  half-save-hang   allocate, write half the granted blocks, print {"granted": n}, then sleep until killed
  lease-hang       query with a lease, print {"hits": n, "lease_id": ...}, then sleep until killed
  load-wait        a LOOKUP, then LOAD queries until nothing is pending or searched for (blocks arriving
                   from SSD or another node), then a load as above; also prints {"first": {"hits",
                   "pending", "searching", "sources"}, "polls", "wait_s"}
Each block's bytes are a pure function of (tag, hash), so any process can check what another wrote.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

from pegaflow.client import KvLayout, PegaClient, read_blocks, write_blocks


def pattern(tag: str, block_hash: bytes, nbytes: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(tag.encode() + block_hash).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def main(spec: dict) -> None:
    client = PegaClient(spec["addr"], timeout_s=spec.get("timeout_s", 10.0), name=spec.get("name", "worker"))
    client.connect()
    inst = client.register_instance(KvLayout(**spec["layout"]))
    hashes = [bytes.fromhex(h) for h in spec["hashes"]]
    tag = spec.get("tag", "")
    nbytes = inst.block_bytes
    action = spec["action"]
    out: dict = {"namespace_id": inst.namespace_id}
    if action in ("save", "half-save-hang"):
        batch = client.allocate(inst, hashes)
        rows = [pattern(tag, h, nbytes) for h in hashes]
        granted = batch.granted
        out["statuses"] = [a.status.name for a in batch.allocations]
        out["granted"] = len(granted)
        view = client.pool_view(batch.epoch)
        if action == "save":
            write_blocks(view, batch.allocations, rows)
            out["sealed"] = client.seal(batch.save_id) if batch.save_id else 0
        else:
            half = granted[: len(granted) // 2]
            locs = [batch.allocations[i] for i in half]
            write_blocks(view, locs, [rows[i] for i in half])
            print(json.dumps(out), flush=True)
            time.sleep(3600)
    elif action in ("load", "lease-hang", "load-wait"):
        if action == "load-wait":
            from pegaflow.client import QueryPurpose

            t0 = time.monotonic()
            first = client.query_prefix(inst, hashes)
            out["first"] = {
                "hits": first.num_hits,
                "pending": first.pending,
                "searching": first.searching,
                "sources": [s.name for s in first.sources],
            }
            polls, hit = 0, first
            while (hit.pending or hit.searching) and time.monotonic() - t0 < spec.get("wait_s", 20.0):
                time.sleep(0.02)
                hit = client.query_prefix(inst, hashes, purpose=QueryPurpose.LOAD)
                polls += 1
            out["polls"], out["wait_s"] = polls, time.monotonic() - t0
        hit = client.query_prefix(inst, hashes, lease=True)
        out["hits"] = hit.num_hits
        out["lease_id"] = hit.lease_id
        if action == "lease-hang":
            print(json.dumps(out), flush=True)
            time.sleep(3600)
        got = np.empty((hit.num_hits, nbytes), dtype=np.uint8)
        read_blocks(client.pool_view(hit.epoch), hit.locations, got)
        out["match"] = all(
            np.array_equal(got[i], pattern(tag, hashes[i], nbytes)) for i in range(hit.num_hits)
        )
        if hit.lease_id:
            client.release(hit.lease_id, loaded_bytes=got.nbytes)
    else:
        raise SystemExit(f"unknown action {action!r}")
    client.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
