"""pegaflow-server benchmark: local save/load GB/s through the shared pool, and prefix-query latency.

    .venv/bin/python bench/server_bench.py            # writes bench/results/server_bench.{json,png}
    .venv/bin/python bench/server_bench.py --quick    # shorter run, same shape

1. Throughput. A real server process; this process is the client. Save = AllocateBlocks
   -> numpy copies from a source array into the mapped pool -> SealBlocks; load =
   QueryPrefix(lease) -> copies out of the pool -> ReleaseLease sent without waiting for its
   answer (as the connector releases, off the critical path). RPCs are included in the
   time. Compared with a plain numpy memcpy of the same bytes between two ordinary
   (pre-faulted) arrays, measured in the same run, interleaved with the pool rounds.
2. Query latency. QueryPrefix over 128 block hashes (64 hits, then misses), closed loop,
   from 1 client and from 16 client processes; idle, and under background load: a saver
   process churning the pool (every save evicts), extra lookups of fresh keys feeding
   the HLL and sketches, and /metrics scraped continuously.

Targets (issue 3): save and load >= 80% of memcpy; query p99 under load <= 2x idle p99.

The throughput part runs on the default anonymous memfd (4 KiB pages). --use-hugepages adds a run
on hugetlb pages (pegaflow-server --use-hugepages): as root the bench reserves the pages for that
run (/proc/sys/vm/nr_hugepages) and restores the previous value afterwards, also on failure.
--huge-tmpfs adds a run with the pool on a tmpfs mounted huge=always (--pool-dir, 2 MiB THP; the
mount lives only in the server's private mount namespace; root). Every client pre-touches its pool
mapping (see throughput()).

The machine's 1-minute load average is sampled through the run and recorded per part; with
--wait-quiet SECONDS the bench first waits (up to SECONDS) for a quiet minute (load < 2), because
other jobs on a small machine move these numbers by 2x.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

from pegaflow.client import KvLayout, PegaClient, block_checksums, read_blocks, verify_blocks, write_blocks
from pegaflow.client.save_pipeline import save_batches
from pegaflow.common.native import page_copy
from pegaflow.server.config import parse_size
from pegaflow.server.testing import ServerProcess
from pegaflow.server.tiers.dram.region import read_meminfo

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
QUERY_HASHES = 128
QUERY_HITS = 64
PER_ROUND = 2  # batches per thread per round: with 2 in flight, one thread's RPCs overlap the other's copy
# Batches per thread in a pipelined save (client/save_pipeline.py): a stream, as a long prompt's save
# is, where all but the first allocation and the last seal hide behind copies. Its reference is a
# plain memcpy of the same batches, same threads, same round.
PIPELINED_BATCHES = 8


def layout(block_bytes: int, tag: str = "bench") -> KvLayout:
    return KvLayout(model_id=f"bench-{tag}", block_bytes=block_bytes, dtype="bfloat16", block_tokens=16)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# ------------------------------------------------------------------ throughput


def run_threads(fn, n: int) -> float:
    """Runs fn(k) in n threads started together; returns the wall time until all are done."""
    barrier = threading.Barrier(n + 1)
    errors: list[BaseException] = []

    def body(k: int) -> None:
        barrier.wait()
        try:
            fn(k)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def throughput(
    addr: str,
    block_bytes: int,
    batch_blocks: int,
    rounds: int,
    inflight: int,
    pool_bytes: int,
    filled_by: str = "self",
) -> dict:
    """Per round: each of ``inflight`` threads saves PER_ROUND batches, then loads them back.

    The pool is first filled (``pool_bytes`` and a batch more), so that every measured save evicts:
    a server in service is full. ``filled_by="self"``: with this layout's own blocks, the steady state
    of one model; ``"other"``: with another namespace's, so every measured save takes slots another
    namespace held, which the server zeroes before granting them (issue 12's F2: a seal of unwritten
    bytes must not expose another namespace's data), the cost a pool shared by several models pays.

    Each round also saves a stream of PIPELINED_BATCHES batches per thread through the client's
    save pipeline (client/save_pipeline.py), against a plain memcpy of the same stream.

    Two references, copying the same bytes with the same threads in the same round: a plain
    numpy memcpy between ordinary arrays (the issue's bar), and the same numpy copies into /
    out of the pool mapping with no RPC at all (isolates what the protocol costs from what the
    pool's memory costs: 4 KiB shmem pages here vs numpy's THP-backed arrays).
    """
    c = PegaClient(addr, timeout_s=60.0, name="bench-throughput")
    c.connect()
    try:
        inst = c.register_instance(layout(block_bytes, f"tp{block_bytes}-{batch_blocks}-{inflight}"))
        rng = np.random.default_rng(0)
        src = [
            rng.integers(0, 256, size=(batch_blocks, block_bytes), dtype=np.uint8) for _ in range(inflight)
        ]
        out = [np.ones_like(a) for a in src]  # pre-faulted destinations, as a real KV cache would be
        # The plain-memory reference mirrors the pool path's access pattern: every save writes
        # fresh (cache-cold) slots, so the reference writes successive slices of a plain array
        # well beyond the caches, and its "load" reads back the slice it wrote last.
        ring = max(2, (512 * MIB) // (batch_blocks * block_bytes))  # batches per plain ring
        plain_dst = [np.ones((ring, batch_blocks, block_bytes), dtype=np.uint8) for _ in range(inflight)]
        plain_pos = [0] * inflight
        last: list[list[bytes]] = [[] for _ in range(inflight)]
        last_allocs: list[list] = [[] for _ in range(inflight)]
        pipelined_blocks: list[int] = []  # blocks each pipelined save sealed (list.append: thread-safe)
        rpc_s: list[float] = []
        first_rpc_s: list[float] = []  # a thread's first save of a round: after the references ran, cold
        later_rpc_s: list[float] = []  # the saves after it in the round
        c.wait_pool_populated(120)
        # This VM (nested PVM, shadow page tables) charges a hypervisor exit for the first user-space
        # write to each page of a mapping, even after MADV_POPULATE_WRITE filled the guest page tables.
        # The plain reference arrays are pre-touched (np.ones); pre-touch the pool mapping the same way
        # (each page's first byte written back unchanged: safe, nothing else writes the pool now).
        pages = c.pool_view()[::4096]
        pages[:] = pages.copy()
        tag = f"tp{block_bytes}-{batch_blocks}-{inflight}"
        fill_inst = inst if filled_by == "self" else c.register_instance(layout(block_bytes, f"{tag}-other"))
        fill_src = rng.integers(0, 256, size=(batch_blocks, block_bytes), dtype=np.uint8)
        for i in range(pool_bytes // (batch_blocks * block_bytes) + 2):
            batch = c.allocate(fill_inst, [f"fill-{i}-{j}".encode() for j in range(batch_blocks)])
            write_blocks(c.pool_view(batch.epoch), batch.allocations, fill_src)
            c.seal(batch.save_id)
        evictions_before = c.stats().evictions

        def save(k: int, round_ids, summed: bool = False) -> None:
            for i, r in enumerate(round_ids):
                hashes = [f"{k}-{r}-{'s' if summed else ''}{i}".encode() for i in range(batch_blocks)]
                t0 = time.perf_counter()
                batch = c.allocate(inst, hashes)
                t1 = time.perf_counter()
                view = c.pool_view(batch.epoch)
                write_blocks(view, batch.allocations, src[k])
                sums = block_checksums(view, batch.allocations) if summed else ()
                t2 = time.perf_counter()
                c.seal(batch.save_id, checksums=sums)
                rpc_s.append((t1 - t0) + (time.perf_counter() - t2))
                (later_rpc_s if i else first_rpc_s).append(rpc_s[-1])
                if not all(a.granted for a in batch.allocations):
                    raise RuntimeError("benchmark batch was not fully granted")
                last[k], last_allocs[k] = hashes, batch.allocations

        def save_pipelined(k: int, round_ids) -> None:
            # The same batches, through client/save_pipeline.py: the next batch's allocation and the
            # previous one's seal are answered while this one is copied.
            chunks = [[f"{k}-{r}-p{i}".encode() for i in range(batch_blocks)] for r in round_ids]

            def write(i: int, batch) -> tuple:
                write_blocks(c.pool_view(batch.epoch), batch.allocations, src[k])
                return ()

            batches, sealed = save_batches(c, inst, chunks, write)
            granted = sum(a.granted for b in batches for a in b.allocations)
            if sealed != granted:
                raise RuntimeError(f"pipelined save sealed {sealed} of the {granted} blocks granted")
            # Two batches per thread are allocated at once here: where that is more than the
            # session's share of unsealed space (the largest case), the server grants part of the
            # second; the throughput counts the bytes saved.
            pipelined_blocks.append(sealed)

        def load(k: int, n: int, summed: bool = False) -> None:
            for _ in range(n):
                t0 = time.perf_counter()
                hit = c.query_prefix(inst, last[k], lease=True)
                t1 = time.perf_counter()
                view = c.pool_view(hit.epoch)
                if summed and verify_blocks(view, hit.locations) != len(hit.locations):
                    raise RuntimeError("a benchmark block failed its checksum")
                read_blocks(view, hit.locations, out[k])
                # As the connector does: the load is done once the bytes are out; the release goes
                # off the critical path.
                c.release(hit.lease_id, loaded_bytes=out[k].nbytes, wait=False)
                rpc_s.append(t1 - t0)
                if hit.num_hits != batch_blocks:
                    raise RuntimeError("benchmark batch was not fully resident")

        def plain_write(k: int) -> None:
            for _ in range(PER_ROUND):
                plain_pos[k] = (plain_pos[k] + 1) % ring
                np.copyto(plain_dst[k][plain_pos[k]], src[k])

        def plain_write_stream(k: int) -> None:
            for _ in range(PIPELINED_BATCHES):
                plain_pos[k] = (plain_pos[k] + 1) % ring
                np.copyto(plain_dst[k][plain_pos[k]], src[k])

        def plain_read(k: int) -> None:
            for _ in range(PER_ROUND):
                np.copyto(out[k], plain_dst[k][plain_pos[k]])

        # The client's block copies use streaming stores (common/native/page_copy.py) where the native
        # copy is built: the same copy between plain arrays is the like-for-like reference for what the
        # protocol costs (memcpy above stays the bar).
        stream = page_copy.NATIVE.get() if page_copy.is_native() else None

        def stream_write(k: int, n: int = PER_ROUND) -> None:
            for _ in range(n):
                plain_pos[k] = (plain_pos[k] + 1) % ring
                stream(plain_dst[k][plain_pos[k]], src[k].view(np.uint8))

        def stream_read(k: int) -> None:
            for _ in range(PER_ROUND):
                stream(out[k].view(np.uint8), plain_dst[k][plain_pos[k]])

        def pool_write(k: int) -> None:  # rewrites the last saved blocks with the bytes they hold
            for _ in range(PER_ROUND):
                write_blocks(c.pool_view(), last_allocs[k], src[k])

        def pool_read(k: int) -> None:
            for _ in range(PER_ROUND):
                read_blocks(c.pool_view(), last_allocs[k], out[k])

        # Warm-up: first touch of code paths and of the client's page tables for the pool.
        run_threads(lambda k: save(k, ["warm"]), inflight)
        run_threads(lambda k: load(k, 1), inflight)
        run_threads(lambda k: save_pipelined(k, [f"warm.{i}" for i in range(PIPELINED_BATCHES)]), inflight)
        for k in range(inflight):
            if not np.array_equal(out[k], src[k]):
                raise RuntimeError("loaded bytes differ from saved bytes")

        # Interleaved per round, so that a load swing on this shared machine hits the pool path and
        # its references alike; ratios are taken per round, then the median.
        round_bytes = PER_ROUND * inflight * batch_blocks * block_bytes
        rows: dict[str, list[float]] = {
            k: []
            for k in (
                "save_gbps",
                "load_gbps",
                "memcpy_gbps",
                "pool_memcpy_write_gbps",
                "pool_memcpy_read_gbps",
                "save_vs_memcpy",
                "save_pipelined_gbps",
                "save_pipelined_vs_memcpy",
                "load_vs_memcpy",
                "save_vs_pool_memcpy",
                "load_vs_pool_memcpy",
                # block_checksums on (connector key): the writer hashes what it wrote, the reader
                # checks before it copies (client/block_copy.py), same round, same bytes.
                "save_checksummed_gbps",
                "load_checksummed_gbps",
                "save_checksummed_vs_memcpy",
                "load_checksummed_vs_memcpy",
                # the streaming-store copy between plain arrays (only where the native copy is built)
                *(
                    (
                        "stream_copy_write_gbps",
                        "stream_copy_read_gbps",
                        "save_vs_stream_copy",
                        "load_vs_stream_copy",
                        "save_pipelined_vs_stream_copy",
                    )
                    if stream is not None
                    else ()
                ),
            )
        }
        save_rpc, load_rpc, save_rpc_first, save_rpc_later = [], [], [], []
        pipelined_share: list[float] = []
        for r in range(rounds):
            rpc_s.clear()
            first_rpc_s.clear()
            later_rpc_s.clear()
            t_save = run_threads(lambda k, r=r: save(k, [f"{r}.{i}" for i in range(PER_ROUND)]), inflight)
            save_rpc.extend(rpc_s)
            save_rpc_first.extend(first_rpc_s)
            save_rpc_later.extend(later_rpc_s)
            t_plain_a = run_threads(plain_write, inflight)
            t_pool_w = run_threads(pool_write, inflight)
            rpc_s.clear()
            t_load = run_threads(lambda k: load(k, PER_ROUND), inflight)
            load_rpc.extend(rpc_s)
            t_plain_b = run_threads(plain_read, inflight)
            t_pool_r = run_threads(pool_read, inflight)
            pipelined_blocks.clear()
            t_save_pipe = run_threads(
                lambda k, r=r: save_pipelined(k, [f"{r}.{i}" for i in range(PIPELINED_BATCHES)]), inflight
            )
            t_plain_stream = run_threads(plain_write_stream, inflight)
            pipe_share = sum(pipelined_blocks) / (PIPELINED_BATCHES * inflight * batch_blocks)
            if stream is not None:
                t_stream_pipe = run_threads(lambda k: stream_write(k, PIPELINED_BATCHES), inflight)
                rows["save_pipelined_vs_stream_copy"].append(t_stream_pipe * pipe_share / t_save_pipe)
            pipelined_share.append(pipe_share)
            stream_bytes = PIPELINED_BATCHES * inflight * batch_blocks * block_bytes
            rows["save_pipelined_gbps"].append(stream_bytes * pipe_share / t_save_pipe / 1e9)
            rows["save_pipelined_vs_memcpy"].append(t_plain_stream * pipe_share / t_save_pipe)
            rpc_s.clear()
            t_save_sum = run_threads(
                lambda k, r=r: save(k, [f"{r}.{i}" for i in range(PER_ROUND)], summed=True), inflight
            )
            t_load_sum = run_threads(lambda k: load(k, PER_ROUND, summed=True), inflight)
            rows["save_checksummed_gbps"].append(round_bytes / t_save_sum / 1e9)
            rows["load_checksummed_gbps"].append(round_bytes / t_load_sum / 1e9)
            rows["save_checksummed_vs_memcpy"].append(t_plain_a / t_save_sum)
            rows["load_checksummed_vs_memcpy"].append(t_plain_b / t_load_sum)
            for name, t in (("save_gbps", t_save), ("load_gbps", t_load), ("memcpy_gbps", t_plain_a),
                            ("memcpy_gbps", t_plain_b), ("pool_memcpy_write_gbps", t_pool_w),
                            ("pool_memcpy_read_gbps", t_pool_r)):  # fmt: skip
                rows[name].append(round_bytes / t / 1e9)
            rows["save_vs_memcpy"].append(t_plain_a / t_save)
            rows["load_vs_memcpy"].append(t_plain_b / t_load)
            rows["save_vs_pool_memcpy"].append(t_pool_w / t_save)
            rows["load_vs_pool_memcpy"].append(t_pool_r / t_load)
            if stream is not None:
                t_stream_w = run_threads(stream_write, inflight)
                t_stream_r = run_threads(stream_read, inflight)
                rows["stream_copy_write_gbps"].append(round_bytes / t_stream_w / 1e9)
                rows["stream_copy_read_gbps"].append(round_bytes / t_stream_r / 1e9)
                rows["save_vs_stream_copy"].append(t_stream_w / t_save)
                rows["load_vs_stream_copy"].append(t_stream_r / t_load)
        stats = c.stats()
    finally:
        c.close()
    med = statistics.median
    return {
        "block_bytes": block_bytes,
        "batch_blocks": batch_blocks,
        "batch_bytes": batch_blocks * block_bytes,
        "inflight": inflight,
        "rounds": rounds,
        **{name: med(values) for name, values in rows.items()},
        "save_vs_memcpy_per_round": rows["save_vs_memcpy"],
        "load_vs_memcpy_per_round": rows["load_vs_memcpy"],
        "save_checksummed_vs_memcpy_worst": min(rows["save_checksummed_vs_memcpy"]),
        "load_checksummed_vs_memcpy_worst": min(rows["load_checksummed_vs_memcpy"]),
        "save_vs_memcpy_worst": min(rows["save_vs_memcpy"]),
        "save_pipelined_vs_memcpy_worst": min(rows["save_pipelined_vs_memcpy"]),
        "save_pipelined_granted_share_min": min(pipelined_share),
        "load_vs_memcpy_worst": min(rows["load_vs_memcpy"]),
        "client_copy": "native" if stream is not None else "numpy",
        "save_rpc_ms_median": med(save_rpc) * 1e3,
        # Allocate + seal of a thread's first batch in a round (the server idle for the references'
        # milliseconds before it) and of the batches after it: what a wake-up after idle costs.
        "save_rpc_ms_first_median": med(save_rpc_first) * 1e3,
        "save_rpc_ms_later_median": med(save_rpc_later) * 1e3,
        "load_rpc_ms_median": med(load_rpc) * 1e3,
        "pool_filled_by": filled_by,
        "evictions_measured": stats.evictions - evictions_before,
        "reserve_evictions_so_far": stats.reserve_evictions,
    }


# ------------------------------------------------------------------ latency (child roles)


def role_query(addr: str, seconds: float, out_path: str, tag: str) -> None:
    """Closed-loop QueryPrefix; latencies (s) written to out_path as JSON."""
    c = PegaClient(addr, timeout_s=10.0, name="bench-query")
    c.connect()
    inst = c.register_instance(layout(4 * KIB, "query"))
    hits = [f"q-{i}".encode() for i in range(QUERY_HITS)]
    misses = [f"miss-{tag}-{i}".encode() for i in range(QUERY_HASHES - QUERY_HITS)]
    hashes = hits + misses
    lat = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        c.query_prefix(inst, hashes)
        lat.append(time.perf_counter() - t)
    c.close()
    pathlib.Path(out_path).write_text(json.dumps(lat))


def role_lookups(addr: str, stop_path: str) -> None:
    """Background: lookups of ever-new keys (HLL, sketch and windowed-rate work), ~200 queries/s."""
    c = PegaClient(addr, timeout_s=10.0, name="bench-bg-lookups")
    c.connect()
    inst = c.register_instance(layout(4 * KIB, "query"))
    n = 0
    while not os.path.exists(stop_path):
        hashes = [f"fresh-{n}-{i}".encode() for i in range(256)]
        n += 1
        c.query_prefix(inst, hashes)
        time.sleep(0.005)
    c.close()


def role_churn(addr: str, stop_path: str) -> None:
    """Background: saves into a full pool, so every allocation evicts (~20 batches/s of 32 x 256 KiB)."""
    c = PegaClient(addr, timeout_s=10.0, name="bench-bg-churn")
    c.connect()
    inst = c.register_instance(layout(256 * KIB, "churn"))
    data = np.zeros((32, 256 * KIB), dtype=np.uint8)
    n = 0
    while not os.path.exists(stop_path):
        hashes = [f"churn-{n}-{i}".encode() for i in range(32)]
        n += 1
        batch = c.allocate(inst, hashes)
        write_blocks(c.pool_view(batch.epoch), batch.allocations, data)
        if batch.save_id:
            c.seal(batch.save_id)
        time.sleep(0.05)
    c.close()


def spawn_role(role: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--role", role, *args], start_new_session=True, stdout=subprocess.DEVNULL
    )


def scrape_loop(http_addr: str, stop: threading.Event, counter: list[int]) -> None:
    while not stop.is_set():
        with urllib.request.urlopen(f"http://{http_addr}/metrics", timeout=10) as resp:
            resp.read()
        counter[0] += 1
        stop.wait(0.1)


def latency_case(srv: ServerProcess, clients: int, loaded: bool, seconds: float, tmp: pathlib.Path) -> dict:
    stop_path = tmp / f"stop-{clients}-{loaded}"
    background: list[subprocess.Popen] = []
    scrapes = [0]
    stop_scrape = threading.Event()
    scraper = None
    if loaded:
        background = [
            spawn_role("churn", srv.addr, str(stop_path)),
            spawn_role("lookups", srv.addr, str(stop_path)),
        ]
        scraper = threading.Thread(target=scrape_loop, args=(srv.http_addr, stop_scrape, scrapes))
        scraper.start()
        time.sleep(2.0)  # let the background reach steady state (pool full, evicting)
    before = PegaClient(srv.addr, timeout_s=10.0)
    before.connect()
    ev0 = before.stats().evictions
    outs = [tmp / f"lat-{clients}-{loaded}-{k}.json" for k in range(clients)]
    procs = [
        spawn_role("query", srv.addr, str(seconds), str(o), f"{clients}-{loaded}-{k}")
        for k, o in enumerate(outs)
    ]
    try:
        for p in procs:
            if p.wait(timeout=seconds + 120) != 0:
                raise RuntimeError("a query client failed")
    finally:
        stop_path.write_text("stop")
        stop_scrape.set()
        for p in background:
            p.wait(timeout=60)
        if scraper is not None:
            scraper.join()
    evictions = before.stats().evictions - ev0
    before.close()
    lat = [x for o in outs for x in json.loads(o.read_text())]
    return {
        "clients": clients,
        "background_load": loaded,
        "queries": len(lat),
        "qps": len(lat) / seconds,
        "p50_ms": pct(lat, 50) * 1e3,
        "p90_ms": pct(lat, 90) * 1e3,
        "p99_ms": pct(lat, 99) * 1e3,
        "evictions_during": evictions,
        "metric_scrapes": scrapes[0],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and shorter latency runs")
    ap.add_argument(
        "--part",
        choices=["all", "throughput", "latency"],
        default="all",
        help="run one part only (prints; writes only with --part-out)",
    )
    ap.add_argument(
        "--part-out",
        type=pathlib.Path,
        default=None,
        metavar="JSON",
        help="with --part throughput: write that part's results here, and a plot beside it (.png)",
    )
    ap.add_argument(
        "--use-hugepages",
        action="store_true",
        help="also measure throughput with --use-hugepages (hugetlb, 3 GiB of 2 MiB pages: reserved for the "
        "run as root, the previous reservation restored afterwards)",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="first wait up to SECONDS for the 1-minute load average to stay below 2 for a minute",
    )
    ap.add_argument(
        "--huge-tmpfs",
        action="store_true",
        help="also measure throughput with the pool on a huge=always tmpfs (--pool-dir), mounted in the "
        "server's private mount namespace (needs root; 2 MiB page allocation can take minutes on a "
        "fragmented machine)",
    )
    ap.add_argument(
        "--reserve-ab",
        action="store_const",
        const="no_reserve",
        dest="ab",
        help="throughput on two servers side by side: as shipped, and with --free-reserve 0 (saves evict "
        "for themselves), case by case in alternating order",
    )
    ap.add_argument(
        "--lane-ab",
        action="store_const",
        const="no_lane",
        dest="ab",
        help="the same A/B with --read-lane off (queries and releases served by the engine)",
    )
    ap.add_argument(
        "--client-copy",
        choices=["native", "numpy"],
        default="native",
        help="the client's block copies: streaming stores (common/native/page_copy.py, as shipped) or "
        "numpy's copyto (as before 2026-12-06's fifth session)",
    )
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("role_args", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "query":
        role_query(args.role_args[0], float(args.role_args[1]), args.role_args[2], args.role_args[3])
        return 0
    if args.role == "lookups":
        role_lookups(*args.role_args)
        return 0
    if args.role == "churn":
        role_churn(*args.role_args)
        return 0

    rounds = 4 if args.quick else 12
    seconds = 4.0 if args.quick else 10.0
    page_copy.start()
    if not page_copy.use(args.client_copy == "native") and args.client_copy == "native":
        raise SystemExit(f"the native copy is unavailable: {page_copy.EXTENSION.probe()}")
    results: dict = {
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "client_copy": args.client_copy,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }
    if args.wait_quiet:
        results["quiet_wait"] = wait_quiet(args.wait_quiet)
    results["load_average_at_start"] = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = pathlib.Path(tmpdir)
        if args.part in ("all", "throughput"):
            results["throughput"] = run_throughput(tmp, rounds, "memfd", args.ab)
            if args.huge_tmpfs:
                if not huge_tmpfs_available():
                    raise SystemExit("--huge-tmpfs needs root and unshare(1)")
                results["throughput_huge_tmpfs"] = run_throughput(tmp, rounds, "huge-tmpfs")
            if args.use_hugepages:
                results["throughput_hugetlb"] = run_throughput(tmp, rounds, "hugetlb")
        if args.part in ("all", "latency"):
            results["query_latency"] = run_latency(tmp, seconds)
    results["load_average_at_end"] = os.getloadavg()
    if args.part != "all":
        if args.part_out is not None and "throughput" in results:
            args.part_out.parent.mkdir(parents=True, exist_ok=True)
            args.part_out.write_text(json.dumps(results, indent=2) + "\n")
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            part = results["throughput"]
            panels = [("rows", "save / load vs same-run memcpy (pegaflow-server as shipped)")]
            for arm, what in ARM_TITLES.items():
                if f"rows_{arm}" in part:
                    panels.append((f"rows_{arm}", f"the same, {what}"))
            fig, axes = plt.subplots(len(panels), 1, figsize=(13, 4.5 * len(panels)), squeeze=False)
            for ax, (key, title) in zip(axes[:, 0], panels, strict=True):
                _throughput_panel(ax, part[key], title)
            fig.tight_layout()
            fig.savefig(args.part_out.with_suffix(".png"), dpi=110)
            plt.close(fig)
        return 0
    ratios = {}
    cases = results["query_latency"]["cases"]
    for clients in (1, 16):
        idle = next(c for c in cases if c["clients"] == clients and not c["background_load"])
        busy = next(c for c in cases if c["clients"] == clients and c["background_load"])
        ratios[f"{clients}_clients_p99_loaded_over_idle"] = busy["p99_ms"] / idle["p99_ms"]
    results["query_p99_ratios"] = ratios
    results["targets"] = {
        "save_load_vs_memcpy_min": 0.8,
        "query_p99_loaded_over_idle_max": 2.0,
        "met_throughput": {
            part: {
                f"{r['block_bytes'] // KIB}KiBx{r['batch_blocks']}_inflight{r['inflight']}": (
                    r["save_vs_memcpy"] >= 0.8 and r["load_vs_memcpy"] >= 0.8
                )
                for r in results[part]["rows"]
            }
            for part in ("throughput", "throughput_huge_tmpfs", "throughput_hugetlb")
            if part in results
        },
        "met_latency": {name: v <= 2.0 for name, v in ratios.items()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "server_bench.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / "server_bench.png")
    print(json.dumps(results["targets"], indent=2))
    return 0


BACKINGS = {
    "memfd": "anonymous memfd, 4 KiB pages (default)",
    "huge-tmpfs": "--pool-dir on a tmpfs mounted huge=always (2 MiB THP), private mount namespace",
    "hugetlb": "--use-hugepages (hugetlb 2 MiB pages)",
}


def huge_tmpfs_available() -> bool:
    """A private huge=always tmpfs needs root and unshare (nothing is mounted outside the server)."""
    return os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("mount") is not None


THROUGHPUT_POOL = "3gb"
HUGEPAGE_BYTES = 2 * MIB
NR_HUGEPAGES = pathlib.Path("/proc/sys/vm/nr_hugepages")


@contextlib.contextmanager
def reserved_hugepages(pool_bytes: int):
    """Makes sure ``pool_bytes`` of 2 MiB huge pages are free (reserving more as root while inside);
    the previous reservation is restored on the way out, whatever happens inside."""
    meminfo = read_meminfo()
    free = meminfo.get("HugePages_Free", 0) - meminfo.get("HugePages_Rsvd", 0)
    need = -(-pool_bytes // HUGEPAGE_BYTES)
    if free >= need:
        yield {"reserved_by_bench": 0, "previous_nr_hugepages": int(NR_HUGEPAGES.read_text())}
        return
    if os.geteuid() != 0:
        raise SystemExit(f"--use-hugepages needs {need} free 2 MiB pages, {free} are free (run as root)")
    previous = int(NR_HUGEPAGES.read_text())
    try:
        NR_HUGEPAGES.write_text(str(previous + need - free))
        meminfo = read_meminfo()
        got = meminfo.get("HugePages_Free", 0) - meminfo.get("HugePages_Rsvd", 0)
        if got < need:
            raise SystemExit(f"--use-hugepages: the kernel reserved only {got} of {need} huge pages")
        yield {"reserved_by_bench": need - free, "previous_nr_hugepages": previous}
    finally:
        NR_HUGEPAGES.write_text(str(previous))


class LoadSampler:
    """Samples the 1-minute load average every few seconds in a thread; summarised per part."""

    def __init__(self, interval_s: float = 5.0):
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), os.getloadavg()[0]))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        values = [v for _, v in self.samples]
        return {
            "load1_min": min(values),
            "load1_median": statistics.median(values),
            "load1_max": max(values),
            "samples": len(values),
        }


def wait_quiet(max_wait_s: float, threshold: float = 2.0, quiet_for_s: float = 60.0) -> dict:
    """Waits until the 1-minute load average stays below ``threshold`` for ``quiet_for_s``."""
    start = time.monotonic()
    quiet_since = None
    while True:
        now = time.monotonic()
        load = os.getloadavg()[0]
        quiet_since = (quiet_since or now) if load < threshold else None
        if quiet_since is not None and now - quiet_since >= quiet_for_s:
            return {"quiet": True, "waited_s": round(now - start), "load1": load}
        if now - start >= max_wait_s:
            print(f"machine not quiet after {max_wait_s:.0f} s (load {load:.1f}); running anyway", flush=True)
            return {"quiet": False, "waited_s": round(now - start), "load1": load}
        time.sleep(5)


def run_throughput(tmp: pathlib.Path, rounds: int, backing: str, ab: str | None = None) -> dict:
    if backing == "hugetlb":
        with reserved_hugepages(parse_size(THROUGHPUT_POOL) * (2 if ab else 1)) as reservation:
            out = _run_throughput(tmp, rounds, backing, ab)
        out["hugepages"] = reservation
        return out
    return _run_throughput(tmp, rounds, backing, ab)


# (block bytes, blocks per batch, batches in flight, what filled the pool first); the 16 MiB rows
# (256 KiB x 64) are issue 16's target rows.
THROUGHPUT_CASES = [
    (256 * KIB, 64, 1, "self"),
    (256 * KIB, 256, 1, "self"),
    (2 * MIB, 64, 1, "self"),
    (2 * MIB, 256, 1, "self"),
    (256 * KIB, 64, 2, "self"),
    (256 * KIB, 256, 2, "self"),
    (2 * MIB, 64, 2, "self"),
    (2 * MIB, 256, 2, "self"),
    (256 * KIB, 64, 1, "other"),
    (256 * KIB, 64, 2, "other"),
]
# Server arms. "default": pegaflow-server as shipped; with --reserve-ab also "no_reserve": the same
# server with --free-reserve 0 (every save evicts for itself, as before store/free_reserve.py); with
# --lane-ab "no_lane": --read-lane off (queries and releases in the engine, as before server/read_lane/).
# The second arm runs case by case beside the first, the arms' order alternating, each against its own
# same-round memcpy.
ARMS = {"default": [], "no_reserve": ["--free-reserve", "0"], "no_lane": ["--read-lane", "off"]}
ARM_TITLES = {
    "no_reserve": "--free-reserve 0 (saves evict for themselves)",
    "no_lane": "--read-lane off (queries and releases served by the engine)",
}


def _run_throughput(tmp: pathlib.Path, rounds: int, backing: str, ab: str | None) -> dict:
    print(f"throughput, pool backed by {BACKINGS[backing]} ...", flush=True)
    arms = ["default", ab] if ab else ["default"]
    rows: dict[str, list[dict]] = {arm: [] for arm in arms}
    pool_bytes = parse_size(THROUGHPUT_POOL)
    with contextlib.ExitStack() as stack:
        servers = {}
        for arm in arms:
            extra, launcher = list(ARMS[arm]), []
            if backing == "hugetlb":
                extra.append("--use-hugepages")
            elif backing == "huge-tmpfs":
                mount_dir = tmp / f"huge-tmpfs-{arm}"
                mount_dir.mkdir()
                # The mount exists only in this server's own mount namespace and vanishes with it.
                script = 'mount -t tmpfs -o huge=always,size=4g pegaflow-bench "$0" && exec "$@"'
                launcher = ["unshare", "-m", "--", "sh", "-c", script, str(mount_dir)]
                extra += ["--pool-dir", str(mount_dir)]
            servers[arm] = stack.enter_context(
                ServerProcess(
                    tmp / f"tp-{backing}-{arm}",
                    pool_size=THROUGHPUT_POOL,
                    http_addr=None,
                    extra_args=extra,
                    launcher=launcher,
                    start_timeout_s=600,  # a huge-page pool may need minutes of compaction
                )
            )
        load = stack.enter_context(LoadSampler())
        for n, (block, batch, inflight, filled_by) in enumerate(THROUGHPUT_CASES):
            for arm in arms if n % 2 == 0 else arms[::-1]:
                row = throughput(servers[arm].addr, block, batch, rounds, inflight, pool_bytes, filled_by)
                row["backing"] = BACKINGS[backing]
                row["arm"] = arm
                rows[arm].append(row)
                print(f"  [{arm}] {_row_line(row)}", flush=True)
    out = {"backing": BACKINGS[backing], "rows": rows["default"], "load_average": load.summary()}
    if ab:
        out[f"rows_{ab}"] = rows[ab]
    return out


def _row_line(row: dict) -> str:
    filled = "" if row["pool_filled_by"] == "self" else ", pool last held by another namespace"
    size = f"{row['block_bytes'] // KIB} KiB x {row['batch_blocks']}, {row['inflight']} in flight{filled}"
    save, load = (
        f"{op} {row[f'{op}_gbps']:.1f} GB/s ({row[f'{op}_vs_memcpy']:.0%}, "
        f"worst {row[f'{op}_vs_memcpy_worst']:.0%})"
        for op in ("save", "load")
    )
    pipe = (
        f"pipelined save {row['save_pipelined_gbps']:.1f} GB/s ({row['save_pipelined_vs_memcpy']:.0%}, "
        f"worst {row['save_pipelined_vs_memcpy_worst']:.0%})"
    )
    refs = f"memcpy {row['memcpy_gbps']:.1f} GB/s, pool memcpy {row['pool_memcpy_write_gbps']:.1f}"
    if "stream_copy_write_gbps" in row:
        refs += (
            f", streaming copy {row['stream_copy_write_gbps']:.1f} (save / load / pipelined vs it "
            f"{row['save_vs_stream_copy']:.0%} / {row['load_vs_stream_copy']:.0%} / "
            f"{row['save_pipelined_vs_stream_copy']:.0%})"
        )
    rpc = (
        f"rpc ms/batch {row['save_rpc_ms_median']:.2f}/{row['load_rpc_ms_median']:.2f} "
        f"(save: first of a round {row['save_rpc_ms_first_median']:.2f}, "
        f"later {row['save_rpc_ms_later_median']:.2f})"
    )
    summed = f"checksummed {row['save_checksummed_vs_memcpy']:.0%}/{row['load_checksummed_vs_memcpy']:.0%}"
    return f"{size}: {save}, {pipe}, {load}; {refs}; {rpc}; {summed}"


def run_latency(tmp: pathlib.Path, seconds: float) -> dict:
    print("query latency ...", flush=True)
    cases = []
    with ServerProcess(tmp / "lat", pool_size="256mb") as srv, LoadSampler() as load:
        holder = PegaClient(srv.addr, timeout_s=10.0, name="bench-holder")
        holder.connect()
        inst = holder.register_instance(layout(4 * KIB, "query"))
        hashes = [f"q-{i}".encode() for i in range(QUERY_HITS)]
        batch = holder.allocate(inst, hashes)
        holder.seal(batch.save_id)
        # Pinned for the whole run, so the churn cannot evict the queried prefix.
        lease = holder.query_prefix(inst, hashes, lease=True, lease_ttl_s=600)
        for clients in (1, 16):
            for loaded in (False, True):
                case = latency_case(srv, clients, loaded, seconds, tmp)
                cases.append(case)
                where = f"clients={clients:2d} load={'yes' if loaded else 'no '}"
                lat = f"p50 {case['p50_ms']:.2f} ms, p99 {case['p99_ms']:.2f} ms, {case['qps']:.0f} q/s"
                bg = f"{case['evictions_during']} evictions, {case['metric_scrapes']} scrapes"
                print(f"  {where}: {lat}, {bg}", flush=True)
        holder.release(lease.lease_id)
        holder.close()
    return {"cases": cases, "load_average": load.summary()}


def _throughput_panel(ax, rows: list[dict], title: str) -> None:
    labels = [
        f"{r['block_bytes'] // KIB}K x{r['batch_blocks']}\n{r['inflight']} in fl."
        + ("\nother ns" if r.get("pool_filled_by") == "other" else "")
        for r in rows
    ]
    x = np.arange(len(rows))
    bars = [
        ("memcpy_gbps", "numpy memcpy, plain arrays", "#999999", None),
        ("pool_memcpy_write_gbps", "client's block copy into pool, no RPC", "#cccccc", None),
        ("save_gbps", "save via pool (incl. RPCs)", "#1f77b4", "save_vs_memcpy"),
        ("load_gbps", "load via pool (incl. RPCs)", "#2ca02c", "load_vs_memcpy"),
    ]
    if rows and "stream_copy_write_gbps" in rows[0]:
        bars.insert(1, ("stream_copy_write_gbps", "streaming-store copy, plain arrays", "#666666", None))
        bars.append(("save_pipelined_gbps", "save, pipelined", "#6baed6", "save_pipelined_vs_memcpy"))
    if rows and "save_checksummed_gbps" in rows[0]:
        bars += [
            ("save_checksummed_gbps", "save + writer's checksums", "#9ecae1", "save_checksummed_vs_memcpy"),
            ("load_checksummed_gbps", "load + checked before copy", "#a1d99b", "load_checksummed_vs_memcpy"),
        ]
    w = 0.8 / len(bars)
    for i, (key, label, color, ratio) in enumerate(bars):
        pos = x + (i - (len(bars) - 1) / 2) * w
        ax.bar(pos, [r[key] for r in rows], w, label=label, color=color)
        if ratio is not None:
            for p, r in zip(pos, rows, strict=True):
                ax.text(p, r[key], f"{r[ratio]:.0%}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("GB/s (median of rounds)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("throughput", "Save / load via the pool: memfd, 4 KiB pages")]
    if "throughput_huge_tmpfs" in results:
        panels.append(("throughput_huge_tmpfs", "... pool on a huge=always tmpfs (2 MiB THP)"))
    if "throughput_hugetlb" in results:
        panels.append(("throughput_hugetlb", "... pool on hugetlb 2 MiB pages"))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(8.5 * len(panels) + 6, 5))
    for ax, (key, title) in zip(axes, panels, strict=False):
        _throughput_panel(ax, results[key]["rows"], title)
    ax2 = axes[-1]
    cases = results["query_latency"]["cases"]
    names = [f"{c['clients']} cl.\n{'loaded' if c['background_load'] else 'idle'}" for c in cases]
    x = np.arange(len(cases))
    ax2.bar(x - 0.2, [c["p50_ms"] for c in cases], 0.4, label="p50", color="#1f77b4")
    ax2.bar(x + 0.2, [c["p99_ms"] for c in cases], 0.4, label="p99", color="#d62728")
    ax2.set_xticks(x, names)
    ax2.set_ylabel("ms (log scale)")
    ax2.set_yscale("log")
    ax2.set_title(f"QueryPrefix latency ({QUERY_HASHES} hashes, {QUERY_HITS} hits)", fontsize=10)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
