"""A pegaflow client living on one "node" (inside its network namespace) for the experiments: it saves
prefixes into its node's server, pulls prefixes another node holds through its node's server, and
reads GetStats of servers and the metaserver, on commands from the orchestrator.

The orchestrator cannot reach a namespace's addresses, and a Python process that imports the client
and gRPC costs ~1 s to start, so each node gets one long-lived agent (``NodeAgent.start(node)``)
spoken to in JSON lines over its stdin / stdout::

    agent = NodeAgent.start(lab_node)                    # python -m pegaflow.bench.harness.node_agent
    agent.call({"cmd": "open", "name": "kv", "addr": "10.1.1.2:50055", "layout": {...}})
    sums = agent.call({"cmd": "save", "name": "kv", "prefix": "p0", "blocks": 256})["checksums"]
    pull = agent.call({"cmd": "pull", "name": "kv", "prefix": "p0", "checksums": sums}, timeout_s=120)

A *prefix* is a chain of ``blocks`` block hashes named by a tag (``prefix_hashes``). Saved bytes are a
pure function of (hash, block size): windows of one seeded random buffer, the block's hash stamped in
front, so every block differs and a misplaced or torn block cannot match. The saver answers each
block's XXH3-64; the puller checks the bytes it can read against them.

A pull is what a node B does for a request whose prefix node A holds: a LOOKUP query (the server
misses locally, asks the metaserver and starts pulling: ``searching``), LOAD queries every
``poll_s`` until the blocks are in flight (``pending``) or readable, then a lease on them and
``LoadBlocks``, which waits in the server until every pending block arrived (no polling while bytes
move). Its effective time is from before the LOOKUP to LoadBlocks answering with every block
readable; verifying the bytes (XXH3-64 of each block, straight from the mapped pool) comes after and
is not timed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import select
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np

_PATTERN_BYTES = 64 << 20  # the random buffer saved blocks are windows of
_STRIDE = 4099 * 4096  # distinct windows for consecutive blocks (a prime number of pages apart)


class AgentError(RuntimeError):
    """The agent answered with an exception, exited, or did not answer in time."""


def prefix_hashes(prefix: str, blocks: int) -> list[bytes]:
    """The 32-byte block hashes of the prefix named ``prefix`` (a chain: block i depends on 0..i-1)."""
    out, h = [], hashlib.sha256(prefix.encode()).digest()
    for i in range(blocks):
        h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
        out.append(h)
    return out


def _pattern() -> np.ndarray:
    return np.random.default_rng(20261201).integers(0, 256, size=_PATTERN_BYTES, dtype=np.uint8)


def fill_block(dst: np.ndarray, pattern: np.ndarray, block_hash: bytes) -> None:
    """Writes the block of ``block_hash`` into ``dst`` (its size is the block size)."""
    n = dst.size
    start = (int.from_bytes(block_hash[:8], "little") * _STRIDE) % (pattern.size - n + 1)
    dst[:] = pattern[start : start + n]
    dst[: len(block_hash)] = np.frombuffer(block_hash, dtype=np.uint8)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ------------------------------------------------------------------------------ the agent process


class _Agent:
    def __init__(self):
        self.clients: dict[str, tuple] = {}  # name -> (PegaClient, InstanceHandle)
        self._pattern: np.ndarray | None = None

    @property
    def pattern(self) -> np.ndarray:
        if self._pattern is None:
            self._pattern = _pattern()
        return self._pattern

    def open(self, cmd: dict) -> dict:
        from pegaflow.client import KvLayout, PegaClient

        client = PegaClient(cmd["addr"], timeout_s=cmd.get("timeout_s", 30.0), name=cmd.get("name", "agent"))
        client.connect()
        inst = client.register_instance(KvLayout(**cmd["layout"]))
        self.clients[cmd["name"]] = (client, inst)
        return {"namespace_id": inst.namespace_id, "block_bytes": inst.block_bytes}

    def save(self, cmd: dict) -> dict:
        client, inst = self.clients[cmd["name"]]
        hashes = prefix_hashes(cmd["prefix"], cmd["blocks"])
        batch_blocks = cmd.get("batch_blocks", 256)
        t0 = time.monotonic()
        sums, sealed, statuses = [], 0, {}
        for lo in range(0, len(hashes), batch_blocks):
            chunk = hashes[lo : lo + batch_blocks]
            batch = client.allocate(inst, chunk)
            view = client.pool_view(batch.epoch)
            for h, a in zip(chunk, batch.allocations, strict=True):
                statuses[a.status.name] = statuses.get(a.status.name, 0) + 1
                if a.granted:
                    block = view[a.offset : a.offset + a.length]
                    fill_block(block, self.pattern, h)
                    sums.append(_xxh3(block))
                else:  # stored already (EXISTS): its bytes are the same function of its hash
                    block = np.empty(inst.block_bytes, dtype=np.uint8)
                    fill_block(block, self.pattern, h)
                    sums.append(_xxh3(block))
            if batch.save_id:
                sealed += client.seal(batch.save_id)
        return {
            "sealed": sealed,
            "statuses": statuses,
            "seconds": time.monotonic() - t0,
            "checksums": [f"{s:016x}" for s in sums],
        }

    def pull(self, cmd: dict) -> dict:
        from pegaflow.client import QueryPurpose

        client, inst = self.clients[cmd["name"]]
        hashes = prefix_hashes(cmd["prefix"], cmd["blocks"])
        want = [int(s, 16) for s in cmd["checksums"]] if cmd.get("checksums") else None
        poll_s, deadline_s = cmd.get("poll_s", 0.005), cmd.get("deadline_s", 60.0)
        cpu0 = _cpu_s()
        t0 = time.monotonic()
        end = t0 + deadline_s
        first = client.query_prefix(inst, hashes)
        out: dict = {
            "first": {
                "hits": first.num_hits,
                "pending": first.pending,
                "searching": first.searching,
                "sources": _runs([s.name for s in first.sources]),
            }
        }
        hit, polls, t_pending = first, 0, None
        # the search: the server asks the metaserver, opens a transfer, allocates the slots
        while hit.searching and not hit.pending and hit.num_hits < len(hashes) and time.monotonic() < end:
            time.sleep(poll_s)
            hit = client.query_prefix(inst, hashes, purpose=QueryPurpose.LOAD)
            polls += 1
        if hit.pending:
            t_pending = time.monotonic()
        # the transfer: leases on what is readable or arriving, LoadBlocks waiting in the server for
        # the rest. A session may pin at most half the pool (server config: session_leased_fraction),
        # so a prefix larger than that is leased, waited for and released in parts.
        done = 0
        while done < len(hashes) and time.monotonic() < end:
            part = client.query_prefix(inst, hashes[done:], lease=True, purpose=QueryPurpose.LOAD)
            ready = part.num_hits
            if part.pending:
                ready = len(
                    client.load_blocks(inst, part.lease_id, timeout_s=max(1.0, end - time.monotonic()))
                )
            if part.lease_id:
                client.release(part.lease_id, wait=False)
            done += ready
            if ready < part.num_hits + part.pending or not ready:
                break  # the rest did not arrive (or was never there): a miss from here
        t1 = time.monotonic()
        out.update(
            polls=polls,
            seconds=t1 - t0,
            search_s=None if t_pending is None else t_pending - t0,
            hits=done,
            pulled_blocks=max(done - first.num_hits, 0),
            bytes=done * inst.block_bytes,
            pulled_bytes=max(done - first.num_hits, 0) * inst.block_bytes,
            client_cpu_s=_cpu_s() - cpu0,
        )
        if want is not None:
            out["mismatched"], out["verified_blocks"] = self._verify(client, inst, hashes[:done], want)
            out["verified"] = out["mismatched"] == 0 and out["verified_blocks"] == done
        return out

    @staticmethod
    def _verify(client, inst, hashes: list[bytes], want: list[int]) -> tuple[int, int]:
        """(blocks whose bytes differ from what was saved, blocks checked): each block's XXH3-64
        straight from the mapped pool, under leases (in parts, as above)."""
        from pegaflow.client import QueryPurpose

        checked = mismatched = 0
        while checked < len(hashes):
            part = client.query_prefix(inst, hashes[checked:], lease=True, purpose=QueryPurpose.LOAD)
            view = client.pool_view(part.epoch)
            for i, loc in enumerate(part.locations):
                mismatched += _xxh3(view[loc.offset : loc.offset + loc.length]) != want[checked + i]
            if part.lease_id:
                client.release(part.lease_id, loaded_bytes=sum(loc.length for loc in part.locations))
            if not part.num_hits:
                break
            checked += part.num_hits
        return mismatched, checked

    def sources(self, cmd: dict) -> dict:
        """Where the server finds a prefix now (a LOAD query: not counted as a lookup, starts nothing)."""
        from pegaflow.client import QueryPurpose

        client, inst = self.clients[cmd["name"]]
        hashes = prefix_hashes(cmd["prefix"], cmd["blocks"])
        hit = client.query_prefix(inst, hashes, purpose=QueryPurpose.LOAD)
        return {"hits": hit.num_hits, "pending": hit.pending, "sources": _runs([s.name for s in hit.sources])}

    def stats(self, cmd: dict) -> dict:
        from pegaflow.bench.harness.pegaflow_proc import get_stats

        return get_stats(cmd["addr"])

    def meta_stats(self, cmd: dict) -> dict:
        from pegaflow.metaserver.client import MetaClient

        with MetaClient(cmd["addr"], timeout_s=5.0) as meta:
            s = meta.stats()
        return {"entries": s.entries, "nodes": {n.node_id: n.entries for n in s.nodes}}

    def locate(self, cmd: dict) -> dict:
        """How many leading blocks of a prefix the metaserver says each node holds (a fresh channel)."""
        from pegaflow.metaserver.client import MetaClient

        hashes = prefix_hashes(cmd["prefix"], cmd["blocks"])
        with MetaClient(cmd["addr"], timeout_s=5.0) as meta:
            hits = meta.locate(cmd["namespace_id"], hashes)
        return {"nodes": {h.node_id: h.num_blocks for h in hits}}

    def http_get(self, cmd: dict) -> dict:
        """The body of an HTTP GET from inside this node (a server's /metrics)."""
        import urllib.request

        with urllib.request.urlopen(cmd["url"], timeout=cmd.get("timeout_s", 10.0)) as reply:
            return {"status": reply.status, "text": reply.read().decode()}

    def cpu(self, _cmd: dict) -> dict:
        return {"cpu_s": _cpu_s()}


def _xxh3(block: np.ndarray) -> int:
    from pegaflow.common.wire.checksum import checksum

    return checksum(block)


def _runs(names: Sequence[str]) -> list[list]:
    """["DRAM", "DRAM", "REMOTE"] -> [["DRAM", 2], ["REMOTE", 1]]: where blocks were found, compactly."""
    out: list[list] = []
    for name in names:
        if out and out[-1][0] == name:
            out[-1][1] += 1
        else:
            out.append([name, 1])
    return out


def main() -> None:
    agent = _Agent()
    handlers = {
        "open": agent.open,
        "save": agent.save,
        "pull": agent.pull,
        "sources": agent.sources,
        "stats": agent.stats,
        "meta_stats": agent.meta_stats,
        "locate": agent.locate,
        "http_get": agent.http_get,
        "cpu": agent.cpu,
    }
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            command = json.loads(line)
            handler = handlers.get(command.get("cmd"))
            answer = handler(command) if handler else {"exception": f"unknown command {command.get('cmd')!r}"}
        except Exception as exc:  # reported to the orchestrator, which decides; the agent keeps serving
            answer = {"exception": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


# ------------------------------------------------------------------------------ the orchestrator's end


class NodeAgent:
    """The orchestrator's end of one agent: ``call`` sends a command and waits for its answer."""

    def __init__(self, proc: subprocess.Popen, timeout_s: float = 60.0):
        self.proc = proc
        self.hello = self._read(time.monotonic() + timeout_s)

    @classmethod
    def start(cls, node, timeout_s: float = 60.0) -> NodeAgent:
        """Starts an agent inside ``node`` (a common.testing.netns Node; the lab kills it at close)."""
        cmd = [sys.executable, "-m", "pegaflow.bench.harness.node_agent"]
        proc = node.popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        return cls(proc, timeout_s)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, deadline: float) -> dict:
        assert self.proc.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentError("the node agent did not answer in time")
            ready, _, _ = select.select([self.proc.stdout.fileno()], [], [], left)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise AgentError(f"the node agent exited (code {self.proc.poll()})")
                return json.loads(line)

    def call(self, command: dict, timeout_s: float = 60.0) -> dict:
        self.send(command)
        return self.receive(timeout_s, command.get("cmd", ""))

    def send(self, command: dict) -> None:
        """Sends a command without waiting (``receive`` its answer): something else can happen while
        it runs, e.g. a link cut in the middle of a pull."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout_s: float = 60.0, what: str = "") -> dict:
        answer = self._read(time.monotonic() + timeout_s)
        if "exception" in answer:
            raise AgentError(f"{what}: {answer['exception']}")
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


if __name__ == "__main__":
    main()
