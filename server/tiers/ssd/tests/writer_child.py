"""A process that writes blocks into an SsdTier like the block store would, for crash tests.

    python -m pegaflow.server.tiers.ssd.tests.writer_child DIR... --engine E --block B --count N
        [--capacity C] [--segment S] [--in-flight K] [--then hang|exit]

Prints one line per event, so the parent knows what was acknowledged before it SIGKILLs us:
``W <tag> <address>`` when a write's future said OK (flushed once per batch: a line lost to the kill
only hides an acknowledgement), ``F <tag>`` flushed just before a block is freed (FIFO, oldest
first, when allocate returned nothing: what the store does), ``READY`` after recovery, ``DONE``
after the last write. Block bytes are support.payload(tag), so any process
can check what it reads. With ``--then hang`` it waits after DONE to be killed.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

from pegaflow.server.tiers.base import IoStatus, WriteRequest
from pegaflow.server.tiers.ssd.config import MIB
from pegaflow.server.tiers.ssd.tests.support import Arena, open_tier


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("paths", nargs="+")
    p.add_argument("--engine", default="threads")
    p.add_argument("--block", type=int, default=100_003)
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--capacity", type=int, default=6 * MIB)
    p.add_argument("--segment", type=int, default=1 * MIB)
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--then", choices=["hang", "exit"], default="exit")
    a = p.parse_args()

    tier, recovered = open_tier(a.paths, a.capacity, a.engine, segment_bytes=a.segment)
    live = collections.deque((b.tag, b.extent) for b in recovered)
    out = sys.stdout
    out.write("READY\n")
    out.flush()
    arena = Arena(a.block, a.in_flight)
    n = a.first
    while n < a.first + a.count:
        k = min(a.in_flight, a.first + a.count - n)
        ext = tier.allocate(a.block, k)
        while len(ext) < k and live:
            tag, victim = live.popleft()
            # Said (and flushed) before the free: the tier writes the emptied segment's next header
            # at once, so a kill right after the free must not leave the parent thinking the
            # block is still live.
            out.write(f"F {tag.decode()}\n")
            out.flush()
            tier.free([victim])
            ext += tier.allocate(a.block, k - len(ext))
        if not ext:
            raise SystemExit("writer_child: the tier has no space and nothing to free")
        tags = [b"k%06d" % (n + i) for i in range(len(ext))]
        for i, t in enumerate(tags):
            arena.fill(i, t)
        reqs = [WriteRequest(e, t, arena.slot(i)) for i, (e, t) in enumerate(zip(ext, tags, strict=True))]
        statuses = tier.write(reqs).result(30)
        for t, e, s in zip(tags, ext, statuses, strict=True):
            if s == IoStatus.OK:
                live.append((t, e))
                out.write(f"W {t.decode()} {e.address}\n")
            else:
                tier.free([e])
        out.flush()
        n += len(ext)
    if a.then == "hang":
        tier.flush(30)  # summaries of sealed segments on disk: the crash hits only the open ones
    out.write("DONE\n")
    out.flush()
    if a.then == "hang":
        while True:
            time.sleep(3600)
    tier.close()


if __name__ == "__main__":
    main()
