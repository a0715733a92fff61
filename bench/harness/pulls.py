"""Pulls between two pegaflow nodes (bench/harness/netns_cluster.py), measured: timed rounds against
iperf3 between the same namespaces, pulls cut by failures, and the numbers made of them.

A *pull*: a client on node B asks B's server for a prefix node A holds and waits until every block
is readable on B (bench/harness/node_agent.py, "pull"), then checks every block's XXH3-64 against
what A's client wrote. Its effective throughput is the bytes it pulled over that whole wait.

    raw = timed_pulls(workdir, pull_bytes=1 << 30, block_bytes=4 << 20, streams=4, rounds=4,
                      pulls_per_round=3, iperf_seconds=3.0, deadline_s=60.0)
    stats = pull_stats(raw)            # mean / P99 / peak, round ratios to iperf3, CPU per GB, load
    table = scaled_table(stats, line_gbps=400.0, seed={"mean": 194, "p99": 250, "peak": 261.6})
    cuts = pulls_cut_by_failures(workdir, pull_bytes=128 << 20, block_bytes=4 << 20, streams=4,
                                 rate="400mbit", deadline_s=6.0)

Why every timed pull moves the whole prefix: A holds PREFIXES_ON_A prefixes and B's pool exactly
one (`exact_pools` refuses sizes the slab allocator would not fill exactly), pulled in turn, so each
pull evicts the one before and nothing of it is left on B.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from pegaflow.bench.harness import models, results
from pegaflow.bench.harness.netns_cluster import NODES, NetnsCluster, load_average
from pegaflow.server.testing import wait_for

GB = 1e9
PREFIXES_ON_A = 2
_FETCH_COUNTERS = (
    "fetches_started",
    "fetched_blocks",
    "fetched_bytes",
    "fetch_failures",
    "remote_hits",
    "resident_blocks",
)


def _quiet(_msg: str) -> None:
    pass


def pull_layout(block_bytes: int) -> dict:
    """The KvLayout both nodes' clients register (one namespace, the same on every node)."""
    return dict(
        model_id="remote-read",
        model_fingerprint="bench",
        dtype="bf16",
        layout="blocks",
        block_tokens=128,
        block_bytes=block_bytes,
        num_layers=1,
        tp_size=1,
        tp_rank=0,
        mla=False,
        extra="",
    )


def exact_pools(pull_bytes: int, block_bytes: int) -> dict[str, int]:
    """Pool sizes: A holds PREFIXES_ON_A prefixes, B exactly one; ValueError for a size the server's
    slab allocator would not fill with exactly that many blocks."""
    blocks = pull_bytes // block_bytes
    pools = {"a": PREFIXES_ON_A * pull_bytes, "b": pull_bytes}
    for name, size in pools.items():
        want = blocks * (PREFIXES_ON_A if name == "a" else 1)
        if blocks * block_bytes != pull_bytes or models.pool_capacity_blocks(size, block_bytes) != want:
            raise ValueError(
                f"a pool of {size} bytes does not hold exactly {want} blocks of {block_bytes} bytes"
            )
    return pools


def fetch_counters(stats: dict) -> dict:
    """The L2 counters of one GetStats."""
    return {k: stats.get(k) for k in _FETCH_COUNTERS}


def _open(cluster: NetnsCluster, name: str, block_bytes: int, client: str = "kv") -> str:
    """A client of node ``name``'s server in its agent; returns the namespace id."""
    opened = cluster.agent(name).call(
        {"cmd": "open", "name": client, "addr": cluster.addr(name), "layout": pull_layout(block_bytes)}
    )
    return opened["namespace_id"]


def _save(cluster: NetnsCluster, prefix: str, blocks: int, client: str = "kv") -> list[str]:
    saved = cluster.agent("a").call(
        {"cmd": "save", "name": client, "prefix": prefix, "blocks": blocks}, timeout_s=600
    )
    if saved["sealed"] != blocks:
        raise RuntimeError(
            f"node A sealed {saved['sealed']} of {blocks} blocks of {prefix}: {saved['statuses']}"
        )
    return saved["checksums"]


def _pull(cluster: NetnsCluster, prefix: str, blocks: int, sums: list[str], deadline_s: float) -> dict:
    return {
        "cmd": "pull",
        "name": "kv",
        "prefix": prefix,
        "blocks": blocks,
        "checksums": sums,
        "deadline_s": deadline_s,
    }


def timed_pulls(
    workdir,
    pull_bytes: int,
    block_bytes: int,
    streams: int,
    rounds: int,
    pulls_per_round: int,
    iperf_seconds: float,
    deadline_s: float,
    log: Callable[[str], None] = _quiet,
) -> dict:
    """A fresh pair of nodes (``--peer-streams streams``), A warmed with PREFIXES_ON_A prefixes, then
    ``rounds`` x (iperf3 -P streams for ``iperf_seconds`` unless 0, ``pulls_per_round`` pulls). Raw
    numbers per round and pull: the load average, iperf3's GB/s and CPU, each pull's timings,
    verification and both servers' CPU seconds over it."""
    blocks = pull_bytes // block_bytes
    pools = exact_pools(pull_bytes, block_bytes)
    out: dict = {"streams": streams, "pools": pools, "blocks_per_pull": blocks, "rounds": []}
    with NetnsCluster(workdir / f"pulls-{streams}", pools, streams, deadline_s) as cluster:
        out["server_ready_s"] = dict(cluster.server_ready_s)
        for name in NODES:
            _open(cluster, name, block_bytes)
        prefixes = [f"s{streams}-p{k}" for k in range(PREFIXES_ON_A)]
        sums = {p: _save(cluster, p, blocks) for p in prefixes}
        out["published_after_s"] = cluster.wait_published("a", blocks * PREFIXES_ON_A)
        log(f"pulls, {streams} stream(s): A holds {PREFIXES_ON_A} x {pull_bytes / 2**30:g} GiB, published")
        k = 0
        for r in range(rounds):
            entry: dict = {"round": r, "load": load_average(), "iperf3": None, "pulls": []}
            if iperf_seconds > 0:
                entry["iperf3"] = cluster.iperf3(streams, iperf_seconds)
            for _ in range(pulls_per_round):
                prefix = prefixes[k % len(prefixes)]
                k += 1
                cpu0 = cluster.server_cpu_s()
                pull = cluster.agent("b").call(
                    _pull(cluster, prefix, blocks, sums[prefix], deadline_s + 30), timeout_s=deadline_s + 60
                )
                cpu1 = cluster.server_cpu_s()
                pull.update(
                    prefix=prefix,
                    gbps=pull["pulled_bytes"] / pull["seconds"] / GB if pull["pulled_bytes"] else None,
                    server_cpu_s={n: cpu1[n] - cpu0[n] for n in cpu0},
                )
                entry["pulls"].append(pull)
            entry["load_after"] = load_average()
            out["rounds"].append(entry)
            log(_round_line(streams, entry))
        out["server_stats"] = {n: fetch_counters(cluster.stats(n)) for n in NODES}
    return out


def _round_line(streams: int, entry: dict) -> str:
    pulls = entry["pulls"]
    rates = ", ".join(f"{p['gbps']:.2f}" if p["gbps"] else "miss" for p in pulls)
    base = f"iperf3 {entry['iperf3']['gbps']:.2f} GB/s; " if entry["iperf3"] else ""
    ok = all(p.get("verified") for p in pulls)
    return (
        f"pulls, {streams} stream(s), round {entry['round']} (load1 {entry['load']['load1']:.1f}): {base}"
        f"pulls {rates} GB/s; bytes {'verified' if ok else 'NOT VERIFIED'}"
    )


PROBES = 60  # one-block prefixes on A, pulled until pulls work again
FAILURE_CASES = ("slow link, left alone", "holder SIGKILLed mid-way", "link down mid-way")


def pulls_cut_by_failures(
    workdir,
    pull_bytes: int,
    block_bytes: int,
    streams: int,
    rate: str,
    deadline_s: float,
    cut_after_s: float = 0.5,
    log: Callable[[str], None] = _quiet,
) -> dict:
    """Pulls over A's link slowed to ``rate`` (so one lasts long enough to be cut), with the servers'
    fetch deadline at ``deadline_s``: one left alone (it completes), one whose holder is SIGKILLed
    ``cut_after_s`` into its transfer (A is restarted and warmed again after it), one whose link goes
    down then. Per case: seconds until the pull ended, blocks readable on B, blocks whose bytes are
    wrong (must be 0). Then, with the link back up, how long until a pull works again, and whether B
    still serves its own blocks."""
    blocks = pull_bytes // block_bytes
    pools = {"a": 4 * pull_bytes, "b": 4 * pull_bytes}
    out: dict = {"pull_bytes": pull_bytes, "rate": rate, "deadline_s": deadline_s, "cases": {}}
    with NetnsCluster(workdir / "failures", pools, streams, deadline_s) as cluster:
        for name in NODES:
            _open(cluster, name, block_bytes)
        sums = {i: _save(cluster, f"f{i}", blocks) for i in range(2)}
        cluster.wait_published("a", 2 * blocks)
        cluster.link.a.limit_rate(rate)
        for i, case in enumerate(FAILURE_CASES):
            if i == 2:  # A died in case 1: a new server process, warmed with this case's prefix
                cluster.start_server("a")
                namespace = _open(cluster, "a", block_bytes, client="kv")
                sums[i] = _save(cluster, f"f{i}", blocks)
                probes = {j: _save(cluster, f"probe{j}", 1) for j in range(PROBES)}
                cluster.wait_located("a", namespace, f"f{i}", blocks)
                cluster.wait_located("a", namespace, f"probe{PROBES - 1}", 1)
                out["after_the_holder_restarted"] = _until_a_pull_works(cluster, probes, deadline_s)
            out["cases"][case] = _cut_pull(cluster, i, blocks, sums[i], deadline_s, cut_after_s)
            got = out["cases"][case]
            log(
                f"failures: {case}: {got['readable_blocks']}/{blocks} blocks readable after "
                f"{got['seconds']:.2f} s (deadline {deadline_s:g} s), {got['wrong_blocks']} wrong"
            )
        cluster.link.set_up()
        cluster.link.a.unlimit()
        out["after_the_link_came_back"] = _until_a_pull_works(cluster, probes, deadline_s)
        for when in ("after_the_holder_restarted", "after_the_link_came_back"):
            w = out[when]
            log(f"failures: pulls work again {when.replace('_', ' ')}: after {w['seconds']:.2f} s, "
                f"{w['attempts']} attempt(s)")  # fmt: skip
        b = cluster.agent("b")
        b.call({"cmd": "save", "name": "kv", "prefix": "after", "blocks": 4})
        out["b_serves_own_blocks_after"] = b.call(
            {"cmd": "sources", "name": "kv", "prefix": "after", "blocks": 4}
        )
        out["b_stats"] = fetch_counters(cluster.stats("b"))
    return out


def _cut_pull(
    cluster: NetnsCluster, case: int, blocks: int, sums: list[str], deadline_s: float, cut_after_s: float
):
    b = cluster.agent("b")
    started = cluster.stats("b")["fetches_started"]
    t0 = time.monotonic()
    b.send(_pull(cluster, f"f{case}", blocks, sums, deadline_s + 30))
    cut_at = None
    if case > 0:
        wait_for(
            lambda: cluster.stats("b")["fetches_started"] > started, 10, what="the pull's transfer to start"
        )
        time.sleep(cut_after_s)  # some bytes arrive, then the cut (an uncut pull lasts seconds)
        cut_at = time.monotonic() - t0
        if case == 1:
            cluster.servers["a"].kill()  # SIGKILL, the process group
        else:
            cluster.link.set_down()
    got = b.receive(deadline_s + 60, "pull")
    return {
        "cut_at_s": cut_at,
        "seconds": got["seconds"],
        "blocks": blocks,
        "readable_blocks": got["hits"],
        "wrong_blocks": got["mismatched"],
        "verified_blocks": got["verified_blocks"],
        "ended_by_the_deadline": got["seconds"] <= deadline_s + 1.0,
    }


def _until_a_pull_works(cluster: NetnsCluster, probes: dict[int, list[str]], deadline_s: float) -> dict:
    """Pulls of fresh one-block probe prefixes, every 0.2 s, until one arrives whole: the seconds
    until then, and how many pulls it took (a pull that missed is a miss, never an error)."""
    t0 = time.monotonic()
    for attempt, j in enumerate(list(probes), start=1):
        cmd = _pull(cluster, f"probe{j}", 1, probes.pop(j), deadline_s + 5)
        got = cluster.agent("b").call(cmd, timeout_s=deadline_s + 30)
        if got["hits"] == 1 and got["verified"]:
            return {"seconds": time.monotonic() - t0, "attempts": attempt}
        time.sleep(0.2)
    return {"seconds": None, "attempts": None}


# ------------------------------------------------------------------------------------ the numbers


def rate_stats(values: list[float]) -> dict | None:
    """Mean, P50, P99 (the 99th percentile of per-pull values, as in the seed's figure 5), peak, worst."""
    if not values:
        return None
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "p50": results.percentile(values, 50),
        "p99": results.percentile(values, 99),
        "peak": max(values),
        "worst": min(values),
    }


def pull_stats(raw: dict, target_ratio: float) -> dict:
    """One stream count's numbers from its raw rounds: per-pull GB/s, iperf3's, each round's ratio
    (its pulls' mean / its iperf3) median and worst, per-pull ratios, CPU seconds per GB pulled of each
    server and of B's client, iperf3's, the load average over the rounds."""
    pulls = [p for r in raw["rounds"] for p in r["pulls"]]
    with_base = [r for r in raw["rounds"] if r["iperf3"]]
    round_ratios = [
        statistics.fmean(p["gbps"] or 0.0 for p in r["pulls"]) / r["iperf3"]["gbps"] for r in with_base
    ]
    gb = sum(p["pulled_bytes"] for p in pulls) / GB
    out = {
        "pulls": len(pulls),
        "complete": sum(p["pulled_blocks"] == raw["blocks_per_pull"] for p in pulls),
        "verified": sum(bool(p.get("verified")) for p in pulls),
        "wrong_blocks": sum(p.get("mismatched", 0) for p in pulls),
        "pull_gbps": rate_stats([p["gbps"] for p in pulls if p["gbps"]]),
        "search_s": rate_stats([p["search_s"] for p in pulls if p["search_s"] is not None]),
        "iperf3_gbps": rate_stats([r["iperf3"]["gbps"] for r in with_base]),
        "round_ratio": {"median": statistics.median(round_ratios), "worst": min(round_ratios)}
        if round_ratios
        else None,
        "per_pull_ratio": rate_stats(
            [(p["gbps"] or 0.0) / r["iperf3"]["gbps"] for r in with_base for p in r["pulls"]]
        ),
        "cpu_s_per_gb": {
            "sender (A's server)": sum(p["server_cpu_s"]["a"] for p in pulls) / gb,
            "receiver (B's server)": sum(p["server_cpu_s"]["b"] for p in pulls) / gb,
            "B's client (queries, waiting)": sum(p["client_cpu_s"] for p in pulls) / gb,
        }
        if gb
        else None,
        "iperf3_cpu_s_per_gb": {
            side: statistics.median(r["iperf3"]["cpu_s_per_gb"][side] for r in with_base)
            for side in with_base[0]["iperf3"]["cpu_s_per_gb"]
        }
        if with_base
        else None,
        "load1": {
            "median": statistics.median(r["load"]["load1"] for r in raw["rounds"]),
            "worst": max(max(r["load"]["load1"], r["load_after"]["load1"]) for r in raw["rounds"]),
        }
        if raw["rounds"]
        else None,
        "target_ratio": target_ratio,
    }
    out["target_met"] = None if not round_ratios else out["round_ratio"]["median"] >= target_ratio
    return out


def scaled_table(stats: dict, nics: str, line_gbps: float, seed: dict[str, float]) -> dict | None:
    """The measured pull / iperf3 ratios on other NICs: if the transport kept its ratio to what TCP
    moves on the wire, and TCP filled a link of ``line_gbps``, a pull would move ratio x line_gbps.

    Rows: the per-pull mean, P99 and peak, each pull over its own round's iperf3; a ratio above 1
    (the baseline moved within a round on this shared machine) is capped at the line rate. And the
    catch: what this transport's CPU seconds per GB would cost at line rate, in cores."""
    ratio = stats.get("per_pull_ratio")
    if not ratio:
        return None
    rows = {
        key: {
            "measured_gbps": stats["pull_gbps"][key],
            "ratio_to_iperf3": ratio[key],
            "scaled_gbps": min(ratio[key], 1.0) * line_gbps,
            "capped_at_line_rate": ratio[key] > 1.0,
            "seed_gbps": seed[key],
        }
        for key in ("mean", "p99", "peak")
    }
    rounds = stats.get("round_ratio") or {}
    return {
        "nics": nics,
        "line_gbps": line_gbps,
        "rows": rows,
        "round_ratio_scaled_gbps": {k: min(v, 1.0) * line_gbps for k, v in rounds.items()},
        "cores_needed_at_line_rate": {
            side: s * line_gbps for side, s in (stats["cpu_s_per_gb"] or {}).items()
        },
        "seconds_for_24_gib_at_scaled_mean": 24 * 2**30 / (rows["mean"]["scaled_gbps"] * GB),
    }
