"""Real peers for tests and benchmarks: a small TransferSource over a memfd, and two agents.

``MemfdTransferSource`` is a real ``TransferSource`` (base.py) without the block store: N blocks
of known bytes in a memfd (block i's 8-byte words are ``i << 40 | word``, so a misplaced, torn or
shifted block never matches), held hashes, transfer leases that expire by themselves.

The agents are processes driven by JSON lines on stdin (one answer line per command on stdout),
so a test can run each in its own network namespace (common/testing/netns.py)::

    python -m pegaflow.server.peers.testing serve --host 10.1.1.1 --blocks 64 --block-bytes 1048576
        -> {"control": "10.1.1.1:PORT", "data_port": PORT}; then stats / scribble / evict / quit
    python -m pegaflow.server.peers.testing requester --streams 4
        -> {"ready": true}; then connect / fetch / result / bench / stats / raw / grpc / stall

``PeerAgent`` is the test side's handle on either (``agent.call({"cmd": ...})``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import resource
import secrets
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from pegaflow.common.wire import peer_frames as frames
from pegaflow.common.wire.checksum import checksum
from pegaflow.server.peers.base import (
    BlockStatus,
    PeerAddress,
    PeerError,
    SourceBlock,
)
from pegaflow.server.tiers.base import IO_ALIGN, io_bytes

NAMESPACE = "peer-test-ns"
CANARY = 0xA5


def block_hash(index: int) -> bytes:
    return b"peer-test-block:" + struct.pack("<Q", index)


def pattern(index: int, block_bytes: int) -> np.ndarray:
    """Block ``index``'s bytes: 8-byte words ``index << 40 | word``, the tail cut to length."""
    words = np.arange(-(-block_bytes // 8), dtype=np.uint64)
    words |= np.uint64(index) << np.uint64(40)
    return words.view(np.uint8)[:block_bytes]


class MemfdTransferSource:
    """A TransferSource over a memfd of ``num_blocks`` blocks (see the module docstring)."""

    def __init__(
        self, num_blocks: int, block_bytes: int, namespace: str = NAMESPACE, keep_checksums: bool = False
    ):
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        self.slot_bytes = io_bytes(block_bytes)
        size = self.slot_bytes * num_blocks
        self.pool_fd = os.memfd_create("peer-test-pool", os.MFD_CLOEXEC)
        os.ftruncate(self.pool_fd, size)
        self._map = mmap.mmap(self.pool_fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self.pool_view = memoryview(self._map)
        pool = np.frombuffer(self._map, dtype=np.uint8)
        self._sums = []
        for i in range(num_blocks):
            slot = pool[i * self.slot_bytes : i * self.slot_bytes + block_bytes]
            slot[:] = pattern(i, block_bytes)
            self._sums.append(checksum(slot) if keep_checksums else None)
        del pool, slot
        self._index = {block_hash(i): i for i in range(num_blocks)}
        self._held = set(range(num_blocks))
        self._leases: dict[str, tuple[float, list[int]]] = {}
        self._lock = threading.Lock()
        self.opened = 0

    def pool_file(self, offset: int) -> tuple[int, int]:
        return self.pool_fd, offset

    def _expire(self) -> None:
        now = time.monotonic()
        for lease_id in [k for k, (exp, _) in self._leases.items() if now >= exp]:
            del self._leases[lease_id]

    def open_transfer(self, namespace_id: str, hashes: Sequence[bytes], ttl_s: float):
        if namespace_id != self.namespace:
            raise LookupError(namespace_id)
        with self._lock:
            self._expire()
            indices = []
            for h in hashes:
                i = self._index.get(bytes(h))
                if i is None or i not in self._held:
                    break
                indices.append(i)
            if not indices:
                return "", []
            lease_id = secrets.token_hex(8)
            self._leases[lease_id] = (time.monotonic() + ttl_s, indices)
            self.opened += 1
        blocks = [SourceBlock(i * self.slot_bytes, self.block_bytes, self._sums[i]) for i in indices]
        return lease_id, blocks

    def renew_transfer(self, transfer_id: str, ttl_s: float) -> bool:
        with self._lock:
            self._expire()
            lease = self._leases.get(transfer_id)
            if lease is None:
                return False
            self._leases[transfer_id] = (time.monotonic() + ttl_s, lease[1])
            return True

    def close_transfer(self, transfer_id: str) -> None:
        with self._lock:
            self._leases.pop(transfer_id, None)

    def pinned_leases(self) -> int:
        with self._lock:
            self._expire()
            return len(self._leases)

    def evict(self, index: int) -> None:
        with self._lock:
            self._held.discard(index)

    def scribble(self, index: int) -> None:
        """Flips one byte of block ``index`` in the pool (a memory fault after its checksum was taken)."""
        pos = index * self.slot_bytes + self.block_bytes // 2
        self._map[pos] = self._map[pos] ^ 0xFF

    def close(self) -> None:
        self.pool_view.release()
        self._map.close()
        os.close(self.pool_fd)


class FlipProxy:
    """A TCP relay in front of a data port that flips chosen bytes of chosen connections in the
    peer -> requester direction: corruption in flight, on a real stream. Connections are numbered
    in accept order (a link's streams connect in order: stream i is connection i of that link)."""

    def __init__(self, host: str):
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self.upstream: tuple[str, int] | None = None
        self.flips: dict[int, list[int]] = {}
        self.accepted = 0
        self.flipped = 0

    def start(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self._listener.accept()
            number, self.accepted = self.accepted, self.accepted + 1
            up = socket.create_connection(self.upstream)
            offsets = sorted(self.flips.pop(number, []))
            threading.Thread(target=self._pump, args=(conn, up, []), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, conn, offsets), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, offsets: list[int]) -> None:
        buf = bytearray(1 << 20)
        seen = 0
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                while offsets and offsets[0] < seen + n:
                    buf[offsets.pop(0) - seen] ^= 0xFF
                    self.flipped += 1
                dst.sendall(memoryview(buf)[:n])
                seen += n
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


# ------------------------------------------------------------------ the test side's handle


class AgentError(RuntimeError):
    pass


class PeerAgent:
    """A running agent process: ``call`` sends one command and waits (with a deadline) for its answer."""

    def __init__(self, proc: subprocess.Popen, timeout_s: float = 60.0):
        self.proc = proc
        self.hello = self._read(time.monotonic() + timeout_s)

    @classmethod
    def start(cls, node, args: Sequence[str], timeout_s: float = 60.0) -> PeerAgent:
        """Starts ``python -m pegaflow.server.peers.testing ARGS`` in netns ``node`` (netns.Node)."""
        cmd = [sys.executable, "-m", "pegaflow.server.peers.testing", *args]
        proc = node.popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        return cls(proc, timeout_s)

    def _read(self, deadline: float) -> dict:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentError("agent did not answer in time")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise AgentError(f"agent exited (code {self.proc.poll()})")
                return json.loads(line)

    def call(self, command: dict, timeout_s: float = 60.0) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        answer = self._read(time.monotonic() + timeout_s)
        if "exception" in answer:
            raise AgentError(answer["exception"])
        return answer

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(10)

    @property
    def control(self) -> str:
        return self.hello["control"]


def wait_until(predicate, timeout_s: float, interval_s: float = 0.02, what: str = "condition"):
    """Polls ``predicate`` until it returns a true value (returned); AssertionError at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {value!r})")
        time.sleep(interval_s)


# ------------------------------------------------------------------ agents


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _command_loop(handlers: dict) -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            command = json.loads(line)
            handler = handlers.get(command.get("cmd"))
            if handler is None:
                answer = {"exception": f"unknown command {command.get('cmd')!r}"}
            else:
                answer = handler(command)
        except Exception as exc:  # report, keep serving: the test decides
            answer = {"exception": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
        if answer.get("quit"):
            return


def serve_main(args) -> None:
    import dataclasses

    from pegaflow.common.grpc_server import listen, new_grpc_server
    from pegaflow.server.peers.serve import PeerServeConfig, PeerServer

    source = MemfdTransferSource(args.blocks, args.block_bytes, keep_checksums=args.keep_checksums)
    proxy = FlipProxy(args.host) if args.flip_proxy else None
    config = PeerServeConfig(
        data_host=args.host,
        advertise_port=proxy.port if proxy else 0,
        ttl_grace_s=args.ttl_grace,
        send_mode=args.send_mode,
        idle_timeout_s=args.idle_timeout,
        frame_timeout_s=args.frame_timeout,
        max_connections=args.max_connections,
    )
    peers = PeerServer(source, config)
    grpc_server = new_grpc_server(8, "peer-grpc", 64 << 20)
    peers.add_to(grpc_server)
    control = listen(grpc_server, f"{args.host}:0", args.host)
    grpc_server.start()
    peers.start()
    if proxy is not None:
        proxy.start((args.host, peers.data_port))
    print(json.dumps({"control": control, "data_port": config.advertise_port or peers.data_port}), flush=True)
    cpu0 = _cpu_s()

    def stats(_):
        return {
            "serve": dataclasses.asdict(peers.stats()),
            "pinned": source.pinned_leases(),
            "opened": source.opened,
            "cpu_s": _cpu_s() - cpu0,
        }

    def scribble(c):
        source.scribble(int(c["index"]))
        return {"ok": True}

    def evict(c):
        source.evict(int(c["index"]))
        return {"ok": True}

    def flip(c):
        proxy.flips[int(c["conn"])] = [int(o) for o in c["offsets"]]
        return {"ok": True, "accepted": proxy.accepted}

    def flipped(_):
        return {"flipped": proxy.flipped, "accepted": proxy.accepted}

    handlers = {"stats": stats, "scribble": scribble, "evict": evict, "flip": flip, "flipped": flipped}
    handlers["quit"] = lambda _: {"quit": True}
    _command_loop(handlers)
    peers.stop()
    grpc_server.stop(0)


class _Requester:
    """The requester agent: one TcpTransport, links by name, local slots in an anonymous mapping."""

    def __init__(self, args):
        from pegaflow.server.peers.tcp import TcpTransport

        self.transport = TcpTransport(streams=args.streams, node_id=args.node_id)
        self.links: dict[str, object] = {}
        self.background: dict[str, tuple] = {}
        self.arenas: dict[str, mmap.mmap] = {}
        self._held_sockets: list[socket.socket] = []

    def slots(self, tag: str, count: int, block_bytes: int) -> list[memoryview]:
        """``count`` IO_ALIGN-aligned slots in the tag's own anonymous mapping (kept while big enough)."""
        slot = io_bytes(block_bytes)
        size = max(slot * count, IO_ALIGN)
        arena = self.arenas.get(tag)
        if arena is None or len(arena) < size:
            arena = self.arenas[tag] = mmap.mmap(
                -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
            )
        view = memoryview(arena)
        return [view[i * slot : i * slot + slot] for i in range(count)]

    def _arena(self, tag: str) -> np.ndarray:
        return np.frombuffer(self.arenas[tag], dtype=np.uint8)

    # -------------------------------------------------------------- commands

    def connect(self, c):
        old = self.links.pop(c["name"], None)
        if old is not None:
            old.close()
        try:
            self.links[c["name"]] = self.transport.connect(
                PeerAddress(c["peer"], c["name"]), time.monotonic() + c.get("timeout", 5.0)
            )
            return {"ok": True, "streams": self.links[c["name"]].streams}
        except PeerError as exc:
            return {"ok": False, "cause": exc.cause.label, "error": str(exc)}

    def _open(self, c):
        link = self.links[c["peer"]]
        first, count = c.get("first", 0), c["count"]
        hashes = [block_hash(i) for i in range(first, first + count)]
        return link, link.open_transfer(
            c.get("namespace", NAMESPACE),
            hashes,
            c.get("ttl", 30.0),
            time.monotonic() + c.get("rpc_timeout", 5.0),
        )

    def fetch(self, c):
        link = self.links[c["peer"]]
        try:
            link, transfer = self._open(c)
        except PeerError as exc:
            return {"ok": False, "cause": exc.cause.label, "error": str(exc)}
        block_bytes = c["block_bytes"]
        tag = c.get("tag", "default")
        slots = self.slots(tag, max(transfer.num_blocks, 1), block_bytes)[: transfer.num_blocks]
        self._arena(tag)[:] = CANARY
        extents = transfer.extents
        if "tamper" in c:  # a requester bug or attack: ask for what the transfer does not have
            extents = [e._replace(**{k: v for k, v in c["tamper"].items()}) for e in extents]
        start = time.monotonic()
        future = link.fetch(extents, slots, start + c.get("deadline", 10.0))
        job = (future, transfer, slots, c, start, link)
        if c.get("background"):
            self.background[tag] = job
            return {"started": True, "num_blocks": transfer.num_blocks}
        return self._finish(job)

    def result(self, c):
        future, transfer, slots, fetch_c, start, link = self.background.pop(c.get("tag", "default"))
        return self._finish((future, transfer, slots, {**fetch_c, **c}, start, link))

    def _canary_intact(self, tag: str) -> bool:
        return bool((self._arena(tag) == CANARY).all())

    def canary(self, c):
        """Whether the tag's slots still hold the paint put there after its fetch resolved."""
        return {"intact": self._canary_intact(c.get("tag", "default"))}

    def _finish(self, job):
        future, transfer, slots, c, start, link = job
        result = future.result()
        resolved = time.monotonic()
        first = c.get("first", 0)
        block_bytes = c["block_bytes"]
        verified = all(
            np.array_equal(np.frombuffer(slot, np.uint8, block_bytes), pattern(first + i, block_bytes))
            for i, (slot, status) in enumerate(zip(slots, result.statuses, strict=True))
            if status is BlockStatus.OK
        )
        canary_intact = None
        tag = c.get("tag", "default")
        if c.get("paint") or c.get("canary_wait"):
            # After resolution nothing may write into the slots: paint them (and look again later).
            self._arena(tag)[:] = CANARY
        if c.get("canary_wait"):
            time.sleep(c["canary_wait"])
            canary_intact = self._canary_intact(tag)
        if c.get("close", True) and transfer.transfer_id:
            link.close_transfer(transfer.transfer_id, time.monotonic() + 2.0)
        return {
            "num_blocks": transfer.num_blocks,
            "statuses": [s.label for s in result.statuses],
            "leading_ok": result.leading_ok,
            "bytes_ok": result.bytes_ok,
            "seconds": result.seconds,
            "resolved_after_s": resolved - start,
            "error": result.error,
            "verified": verified,
            "canary_intact": canary_intact,
        }

    def bench(self, c):
        """Repeated pulls of the same blocks: per pull seconds (open + fetch) and fetch only, and
        this process's CPU seconds over the timed pulls (the warm-up and its check excluded)."""
        link = self.links[c["peer"]]
        block_bytes = c["block_bytes"]
        warmup = c.get("warmup", 1)
        runs = []
        cpu = 0.0
        for r in range(c["repeats"] + warmup):
            cpu0 = _cpu_s()
            t0 = time.monotonic()
            link, transfer = self._open(c)
            slots = self.slots("bench", transfer.num_blocks, block_bytes)
            t1 = time.monotonic()
            result = link.fetch(transfer.extents, slots, t1 + c.get("deadline", 60.0)).result()
            t2 = time.monotonic()
            link.close_transfer(transfer.transfer_id, t2 + 2.0, wait=False)
            if r >= warmup:
                cpu += _cpu_s() - cpu0
                runs.append({"bytes": result.bytes_ok, "fetch_s": t2 - t1, "pull_s": t2 - t0})
            if not result.ok:
                return {"ok": False, "error": result.error, "statuses": [s.label for s in result.statuses]}
            if r == 0 and c.get("verify", True):
                for i, slot in enumerate(slots):
                    if not np.array_equal(
                        np.frombuffer(slot, np.uint8, block_bytes), pattern(i, block_bytes)
                    ):
                        return {"ok": False, "error": f"block {i} differs"}
        return {"ok": True, "runs": runs, "cpu_s": cpu}

    def stats(self, _):
        import dataclasses

        snap = self.transport.stats()
        out = dataclasses.asdict(snap)
        out["links"] = {name: link.connected_streams for name, link in self.links.items()}
        return out

    # -------------------------------------------------------------- bad input, from the requester's side

    def raw(self, c):
        """Connects to a data port, sends ``send_hex`` (or a READ built from the fields), and reports
        the first frame answered, or that the peer closed the connection."""
        host, port = c["host"], c["port"]
        sock = socket.create_connection((host, port), timeout=5)
        try:
            if "send_hex" in c:
                payload = bytes.fromhex(c["send_hex"])
            else:
                tid = bytes.fromhex(c["transfer_id"]) if c.get("transfer_id") else frames.NULL_TRANSFER
                payload = frames.encode_read(tid, c["indices"], c.get("read_timeout", 5.0))
            sock.sendall(payload)
            return self._read_answer(sock, c.get("timeout", 5.0))
        finally:
            sock.close()

    @staticmethod
    def _read_answer(sock: socket.socket, timeout: float) -> dict:
        sock.settimeout(timeout)
        buf = b""
        try:
            while len(buf) < frames.HEADER_BYTES:
                chunk = sock.recv(frames.HEADER_BYTES - len(buf))
                if not chunk:
                    return {"closed": True, "got": len(buf)}
                buf += chunk
        except TimeoutError:
            return {"timeout": True}
        head = frames.decode_header(buf)
        answer = {"type": head.type.name, "fatal": head.fatal, "block_index": head.block_index}
        if head.type is frames.FrameType.ERROR:
            body = b""
            while len(body) < head.length:
                body += sock.recv(head.length - len(body))
            status, message = frames.decode_error(head, body)
            answer.update(status=status.name, message=message)
        if head.fatal:  # the peer closes after a fatal error: show it did
            sock.settimeout(timeout)
            try:
                answer["closed_after"] = sock.recv(1) == b""
            except (TimeoutError, ConnectionResetError):
                answer["closed_after"] = False
        return answer

    def stall(self, c):
        """Opens a data connection that sends only ``send_hex`` (maybe nothing) and holds it open."""
        sock = socket.create_connection((c["host"], c["port"]), timeout=5)
        if c.get("send_hex"):
            sock.sendall(bytes.fromhex(c["send_hex"]))
        self._held_sockets.append(sock)
        return {"ok": True, "held": len(self._held_sockets)}

    def stall_closed(self, c):
        """Whether the peer has closed each held connection (reads EOF within ``timeout``)."""
        out = []
        for sock in self._held_sockets:
            sock.settimeout(c.get("timeout", 0.1))
            try:
                while sock.recv(1 << 16):  # an ERROR frame may come first, then EOF
                    pass
                out.append(True)
            except TimeoutError:
                out.append(False)
            except ConnectionResetError:
                out.append(True)
        return {"closed": out}

    def grpc(self, c):
        """One control-plane call with a request given as JSON (protobuf's JSON mapping)."""
        import grpc
        from google.protobuf import json_format

        from pegaflow.proto import peer_pb2, peer_pb2_grpc

        method = c["method"]
        request = json_format.ParseDict(c.get("request", {}), getattr(peer_pb2, f"{method}Request")())
        with grpc.insecure_channel(c["peer"]) as channel:
            stub = peer_pb2_grpc.PeerTransferStub(channel)
            try:
                response = getattr(stub, method)(request, timeout=c.get("timeout", 5.0))
            except grpc.RpcError as exc:
                return {"code": exc.code().name, "details": exc.details()}
        return {"code": "OK", "response": json_format.MessageToDict(response)}


def requester_main(args) -> None:
    agent = _Requester(args)
    print(json.dumps({"ready": True}), flush=True)
    names = ("connect", "fetch", "result", "canary", "bench", "stats", "raw", "stall", "stall_closed", "grpc")
    handlers = {name: getattr(agent, name) for name in names}
    handlers["quit"] = lambda _: {"quit": True}
    _command_loop(handlers)
    agent.transport.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pegaflow.server.peers.testing")
    sub = parser.add_subparsers(dest="role", required=True)
    serve = sub.add_parser("serve", help="a serving peer over a MemfdTransferSource")
    serve.add_argument("--host", required=True)
    serve.add_argument("--blocks", type=int, default=64)
    serve.add_argument("--block-bytes", type=int, default=1 << 20)
    serve.add_argument("--keep-checksums", action="store_true")
    serve.add_argument("--flip-proxy", action="store_true", help="serve the data plane through a FlipProxy")
    serve.add_argument("--ttl-grace", type=float, default=5.0)
    serve.add_argument("--send-mode", default="auto")
    serve.add_argument("--idle-timeout", type=float, default=300.0)
    serve.add_argument("--frame-timeout", type=float, default=5.0)
    serve.add_argument("--max-connections", type=int, default=64)
    req = sub.add_parser("requester", help="a requester holding a TcpTransport")
    req.add_argument("--streams", type=int, default=4)
    req.add_argument("--node-id", default="requester")
    args = parser.parse_args(argv)
    if args.role == "serve":
        serve_main(args)
    else:
        requester_main(args)


if __name__ == "__main__":
    main()
