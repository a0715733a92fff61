"""The DRAM pool's journal: which sealed block each slot of a persistent pool holds.

With ``--pool-dir`` the pool is a named file in a tmpfs or hugetlbfs mount, which outlives the
server process (a crash, an upgrade). The journal beside it lets the next server re-adopt the
sealed blocks instead of starting empty: PegaFlow, LMCache and vLLM all lose their DRAM cache on
restart.

One append-only file of checksummed records (the LevelDB log's idea: a record is only believed
if its own checksum matches, so a torn tail is detected and dropped):

    file header   magic "PGFDJNL1" | u32 version | u64 pool bytes | u64 slab bytes | u32 slot align
                  | u64 xxh3 of the preceding fields
    record        u32 type | u32 payload length | payload | u64 xxh3(type | length | payload)
      SEALED (1)  u64 offset | u32 block bytes | u64 block checksum (xxh3 of the block's bytes)
                  | u16 tag length | tag (namespace id + hash, store/namespace.py)
      DROPPED (2) u64 offset

A block is journaled once its checksum is known (the block store hashes each sealed block off
the engine lock and pins its slot until then), so recovery re-adopts a slot only if the pool's
bytes there still hash to the journaled checksum: a block half-overwritten when the old server
died, or scribbled on by a client, is a miss, never wrong bytes. Appends are queued under the
engine lock (a deque append) and written by the journal's own thread; the file lives in memory
(tmpfs), so no fsync: what it must survive is the server process, not the machine. The writer
keeps the live map it writes and rewrites the file compactly when it holds mostly dead records.
"""

from __future__ import annotations

import collections
import logging
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from pegaflow.common.wire.checksum import checksum

log = logging.getLogger(__name__)

MAGIC = b"PGFDJNL1"
VERSION = 1
_HEADER = struct.Struct("<8sIQQI")
_RECORD = struct.Struct("<II")
_SUM = struct.Struct("<Q")
_SEALED = struct.Struct("<QIQH")
_DROPPED = struct.Struct("<Q")
SEALED, DROPPED = 1, 2
MAX_PAYLOAD = 4096
FILE_NAME = "pegaflow-pool.journal"


@dataclass(frozen=True, slots=True)
class JournaledBlock:
    offset: int
    length: int
    checksum: int
    tag: bytes


@dataclass(frozen=True, slots=True)
class JournalLayout:
    pool_bytes: int
    slab_bytes: int
    slot_align: int


def _header(layout: JournalLayout) -> bytes:
    body = _HEADER.pack(MAGIC, VERSION, layout.pool_bytes, layout.slab_bytes, layout.slot_align)
    return body + _SUM.pack(checksum(body))


def _record(kind: int, payload: bytes) -> bytes:
    head = _RECORD.pack(kind, len(payload))
    return head + payload + _SUM.pack(checksum(head + payload))


def sealed_record(block: JournaledBlock) -> bytes:
    return _record(
        SEALED, _SEALED.pack(block.offset, block.length, block.checksum, len(block.tag)) + block.tag
    )


def dropped_record(offset: int) -> bytes:
    return _record(DROPPED, _DROPPED.pack(offset))


def replay(path: str, layout: JournalLayout) -> tuple[dict[int, JournaledBlock], list[str]]:
    """The live blocks a journal names (offset -> block) and what it skipped (a torn tail, a layout
    that is not this pool's). A missing file is an empty journal."""
    problems: list[str] = []
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {}, []
    head_len = _HEADER.size + _SUM.size
    if data[: _HEADER.size + _SUM.size] != _header(layout):
        return {}, [f"{path}: header does not match this pool (size, slab or alignment changed): ignored"]
    live: dict[int, JournaledBlock] = {}
    pos = head_len
    while pos < len(data):
        if pos + _RECORD.size > len(data):
            problems.append(f"{path}@{pos}: torn record header")
            break
        kind, length = _RECORD.unpack_from(data, pos)
        end = pos + _RECORD.size + length + _SUM.size
        if length > MAX_PAYLOAD or end > len(data):
            problems.append(f"{path}@{pos}: torn or oversized record")
            break
        (want,) = _SUM.unpack_from(data, end - _SUM.size)
        if checksum(data[pos : end - _SUM.size]) != want:
            problems.append(f"{path}@{pos}: record checksum mismatch")
            break
        payload = data[pos + _RECORD.size : end - _SUM.size]
        if kind == SEALED and len(payload) >= _SEALED.size:
            offset, blen, bsum, tlen = _SEALED.unpack_from(payload)
            tag = bytes(payload[_SEALED.size : _SEALED.size + tlen])
            live[offset] = JournaledBlock(offset, blen, bsum, tag)
        elif kind == DROPPED and len(payload) == _DROPPED.size:
            live.pop(_DROPPED.unpack(payload)[0], None)
        else:
            problems.append(f"{path}@{pos}: unknown record type {kind}")
            break
        pos = end
    return live, problems


class DramJournal:
    """Appends SEALED / DROPPED records on its own thread; ``sealed`` and ``dropped`` only queue."""

    def __init__(self, path: str, layout: JournalLayout, live: dict[int, JournaledBlock] | None = None):
        self.path = path
        self.layout = layout
        self._live: dict[int, JournaledBlock] = dict(live or {})
        self._records = len(self._live)
        self._queue: collections.deque[bytes | int | None] = collections.deque()
        self._wake = threading.Event()
        self._closed = False
        self.failed = False
        self.appended = 0
        self._fd = -1
        self._rewrite()  # start from a compact file holding exactly the live blocks
        self._thread = threading.Thread(target=self._run, name="pegaflow-dram-journal", daemon=True)
        self._thread.start()

    # ------------------------------------------------------- engine side (under its lock)

    def sealed(self, block: JournaledBlock) -> None:
        self._queue.append(block)
        self._wake.set()

    def dropped(self, offset: int) -> None:
        self._queue.append(offset)
        self._wake.set()

    def close(self) -> None:
        """Writes what is queued, then stops."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Waits until everything queued so far is written (tests, shutdown)."""
        done = threading.Event()
        self._queue.append(done)
        self._wake.set()
        return done.wait(timeout_s)

    # ------------------------------------------------------------------- writer

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            self._drain()
            if self._closed and not self._queue:
                return

    def _drain(self) -> None:
        out: list[bytes] = []
        waiters = []
        while self._queue:
            item = self._queue.popleft()
            if isinstance(item, JournaledBlock):
                self._live[item.offset] = item
                out.append(sealed_record(item))
            elif isinstance(item, int):
                if self._live.pop(item, None) is not None:
                    out.append(dropped_record(item))
            else:
                waiters.append(item)
        if out and not self.failed:
            try:
                os.write(self._fd, b"".join(out))
                self._records += len(out)
                self.appended += len(out)
                if self._records > 2 * len(self._live) + 4096:
                    self._rewrite()
            except OSError as exc:
                # The pool keeps serving; only restart survival is lost. One line, then stop writing.
                self.failed = True
                log.error(
                    "dram journal %s: write failed (%s); blocks will not survive a restart", self.path, exc
                )
        for w in waiters:
            w.set()

    def _rewrite(self) -> None:
        tmp = f"{self.path}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, _header(self.layout) + b"".join(sealed_record(b) for b in self._live.values()))
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.replace(tmp, self.path)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        os.lseek(self._fd, 0, os.SEEK_END)
        self._records = len(self._live)


def verified(view, blocks: dict[int, JournaledBlock]) -> Iterator[tuple[JournaledBlock, bool]]:
    """Each journaled block with whether the pool's bytes at its slot still hash to its checksum."""
    for block in sorted(blocks.values(), key=lambda b: b.offset):
        if block.offset + block.length > len(view):
            yield block, False
            continue
        yield block, checksum(view[block.offset : block.offset + block.length]) == block.checksum
