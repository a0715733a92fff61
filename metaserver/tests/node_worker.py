"""A node process for the metaserver process tests: ``python node_worker.py '<json spec>'``.

spec: {"addr", "node_id", "address", "namespace", "blocks": n, "lease_ttl_s": float, "offset": int}
Registers (NodeMembership: heartbeats, re-registers and republishes when its lease
is lost), publishes block hashes offset..offset+n-1 (8-byte big-endian), prints
{"event": "published", "lease_id": ...}, then stays alive until stdin closes
(clean exit: unregisters) or it is killed (its lease then expires).
"""

from __future__ import annotations

import json
import sys

from pegaflow.metaserver.client import MetaClient, NodeMembership


def block_hash(i: int) -> bytes:
    return i.to_bytes(8, "big")


def main(spec: dict) -> None:
    hashes = [block_hash(spec.get("offset", 0) + i) for i in range(spec["blocks"])]
    client = MetaClient(spec["addr"], timeout_s=5.0)

    def republish(membership: NodeMembership) -> None:
        membership.publish(spec["namespace"], added=hashes)
        print(json.dumps({"event": "republished", "lease_id": membership.lease_id}), flush=True)

    membership = NodeMembership(
        client, spec["node_id"], spec["address"], lease_ttl_s=spec.get("lease_ttl_s"), on_registered=republish
    )
    membership.start()
    membership.publish(spec["namespace"], added=hashes)
    print(json.dumps({"event": "published", "lease_id": membership.lease_id}), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    membership.close(unregister=True)
    client.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
