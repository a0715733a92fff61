"""Metrics of an in-process server: the HLL ceiling beside the measured hit rate, /health, own registries;
each with the lookup sketches on the feeder thread and in their own process, and that process killed."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from pegaflow.client import KvLayout, PegaClient, errors
from pegaflow.server.config import MIB, ServerConfig
from pegaflow.server.runtime import start_server


@pytest.fixture(params=["thread", "process"])
def servers(tmp_path, request):
    started = []
    for k in range(2):  # two servers in one process: their registries must not clash
        started.append(
            start_server(
                ServerConfig(
                    pool_size_bytes=16 * MIB,
                    addr="127.0.0.1:0",
                    http_addr="127.0.0.1:0",
                    fd_socket_path=str(tmp_path / f"pool{k}.sock"),
                    lookup_sketches=request.param,
                )
            )
        )
    yield started
    for srv in started:
        srv.stop()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def series(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_hll_ceiling_and_measured_hit_rate_per_window(servers):
    srv = servers[0]
    with PegaClient(srv.address, timeout_s=10.0) as c:
        inst = c.register_instance(KvLayout(model_id="m", block_bytes=4096))
        stored = [f"s-{i}".encode() for i in range(100)]
        c.seal(c.allocate(inst, stored).save_id)
        # 1000 distinct blocks, each requested 4 times: N = 4000, U = 1000, ceiling 0.75.
        for _ in range(4):
            for start in range(0, 900, 100):
                c.query_prefix(inst, [f"u-{i}".encode() for i in range(start, start + 100)])
            c.query_prefix(inst, stored)
        stats = c.stats()
    assert set(stats.hll_ceiling) == {"15m", "1h", "24h"}
    for window in ("15m", "1h", "24h"):
        assert stats.hll_ceiling[window] == pytest.approx(0.75, abs=0.02)
        assert stats.measured_hit_rate[window] == pytest.approx(400 / 4000)
    status, text = get(f"http://{srv.http_address}/metrics")
    assert status == 200
    ceiling = series(text, "pegaflow_hll_estimated_hit_rate")
    measured = series(text, "pegaflow_measured_hit_rate")
    assert set(ceiling) == {f'pegaflow_hll_estimated_hit_rate{{window="{w}"}}' for w in ("15m", "1h", "24h")}
    assert all(v == pytest.approx(0.75, abs=0.02) for v in ceiling.values())
    assert all(v == pytest.approx(0.1) for v in measured.values())
    assert series(text, "pegaflow_block_hits_total") == {
        'pegaflow_block_hits_total{tier="dram"}': 400.0,
        'pegaflow_block_hits_total{tier="ssd"}': 0.0,  # no SSD tier here
        'pegaflow_block_hits_total{tier="remote"}': 0.0,
    }
    assert series(text, "pegaflow_block_misses_total") == {"pegaflow_block_misses_total": 3600.0}


def test_health_and_unknown_paths_and_separate_registries(servers):
    a, b = servers
    status, body = get(f"http://{a.http_address}/health")
    assert status == 200 and json.loads(body)["epoch"] == a.epoch
    assert get(f"http://{a.http_address}/nope")[0] == 404
    with PegaClient(a.address, timeout_s=10.0) as c:
        c.register_instance(KvLayout(model_id="m", block_bytes=4096))
        _, text_a = get(f"http://{a.http_address}/metrics")
        _, text_b = get(f"http://{b.http_address}/metrics")
    assert series(text_a, "pegaflow_live_instances") == {"pegaflow_live_instances": 1.0}
    assert series(text_b, "pegaflow_live_instances") == {"pegaflow_live_instances": 0.0}
    a.stop()
    assert get(f"http://{b.http_address}/health")[0] == 200


def test_the_engines_reported_prefill_cost_prices_the_tokens_its_hits_spared(servers):
    """Issue 15, item 5: the connector reports its engine's measured prefill cost (ReportPrefill);
    the server prices the prompt tokens its hits spared that namespace with it."""
    from pegaflow.server.testing import wait_for

    srv = servers[1]
    with PegaClient(srv.address, timeout_s=10.0) as c:
        inst = c.register_instance(KvLayout(model_id="priced", block_bytes=4096, block_tokens=16))
        stored = [f"p-{i}".encode() for i in range(10)]
        c.seal(c.allocate(inst, stored).save_id)
        c.report_prefill(inst, 16_000, 4.0)  # 0.25 ms per prompt token, as the engine measured
        c.query_prefix(inst, stored)  # 10 blocks of 16 tokens spared
        with pytest.raises(errors.InvalidArgument):
            c.report_prefill(inst, 10, -1.0)  # not a measurement: INVALID_ARGUMENT

        def priced() -> dict:
            _, text = get(f"http://{srv.http_address}/metrics")
            return series(text, "pegaflow_prefill_seconds_avoided_total")

        wait_for(lambda: any(v > 0 for v in priced().values()), 10, what="priced savings")
        (value,) = [v for k, v in priced().items() if 'model="priced"' in k]
        assert value == pytest.approx(160 * 0.25e-3)


def sketch_process_server(tmp_path, http_addr: str | None = None):
    """A server whose lookup sketches run in their own process."""
    return start_server(
        ServerConfig(
            pool_size_bytes=16 * MIB,
            addr="127.0.0.1:0",
            http_addr=http_addr,
            fd_socket_path=str(tmp_path / "pool.sock"),
            lookup_sketches="process",
        )
    )


def saved_and_looked_up_four_times(c: PegaClient):
    """100 blocks saved, then looked up 4 times: (instance, hashes); a 15-minute ceiling of 0.75."""
    inst = c.register_instance(KvLayout(model_id="m", block_bytes=4096))
    stored = [f"s-{i}".encode() for i in range(100)]
    c.seal(c.allocate(inst, stored).save_id)
    for _ in range(4):
        c.query_prefix(inst, stored)
    return inst, stored


def test_a_killed_sketch_process_costs_its_windows_not_the_server(tmp_path):
    srv = sketch_process_server(tmp_path, http_addr="127.0.0.1:0")
    try:
        with PegaClient(srv.address, timeout_s=10.0) as c:
            inst, stored = saved_and_looked_up_four_times(c)
            assert c.stats().hll_ceiling["15m"] == pytest.approx(0.75, abs=0.02)
            sketches = srv.metrics.sketches
            os.kill(sketches.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while True:  # lookups and stats go on; a new child counts the lookups after it
                assert c.query_prefix(inst, stored).num_hits == 100
                stats = c.stats()
                if sketches.restarts == 1 and "15m" in stats.hll_ceiling:
                    break
                assert time.monotonic() < deadline, stats
                time.sleep(0.2)
            assert stats.measured_hit_rate["15m"] > 0.99  # the server's own count is not the child's
        status, text = get(f"http://{srv.http_address}/metrics")
        assert status == 200
        restarts = series(text, "pegaflow_lookup_sketch_restarts_total")
        assert restarts == {"pegaflow_lookup_sketch_restarts_total": 1.0}
    finally:
        srv.stop()


def test_get_stats_answers_in_time_while_the_sketch_process_is_behind(tmp_path):
    """A stopped child stands for one that is seconds behind at nice +10 on a busy host (CI saw a 10 s
    GetStats time out): a GetStats and a scrape wait for a fresh snapshot only FRESH_WAIT_S, then
    answer with the recent one the child delivered (the ceiling of the four lookups before the stop,
    not the fifth), and a scrape says how old it is; the child is neither blamed nor replaced; once
    it catches up the ceiling counts the fifth lookup.

    Changed with that: the GetStats used to wait until its deadline and answer without the ceiling,
    so a 2 s client proved "in time". A 5 s client now proves the answer does not wait for its
    deadline at all, and the ceiling is expected, not absent."""
    from pegaflow.server.metrics.sketch_process import FRESH_WAIT_S
    from pegaflow.server.testing import wait_for

    srv = sketch_process_server(tmp_path, http_addr="127.0.0.1:0")
    try:
        with PegaClient(srv.address, timeout_s=10.0) as c, PegaClient(srv.address, timeout_s=5.0) as hurried:
            inst, stored = saved_and_looked_up_four_times(c)
            assert "15m" in c.stats().hll_ceiling  # the first: nothing to stand in, waited for
            sketches = srv.metrics.sketches
            behind = sketches.pid
            os.kill(behind, signal.SIGSTOP)
            try:
                c.query_prefix(inst, stored)
                started = time.monotonic()
                stats = hurried.stats()
                assert time.monotonic() - started < FRESH_WAIT_S + 1.5  # not its 5 s deadline
                assert stats.hll_ceiling["15m"] == pytest.approx(0.75, abs=0.02)  # the last snapshot
                assert stats.measured_hit_rate["15m"] > 0.7
                started = time.monotonic()
                status, text = get(f"http://{srv.http_address}/metrics")
                # Two asks (the windows, the miss-ratio families), each FRESH_WAIT_S at most.
                assert time.monotonic() - started < 2 * FRESH_WAIT_S + 2.0
                assert status == 200
                (age,) = series(text, "pegaflow_lookup_sketch_snapshot_age_seconds").values()
                assert age >= FRESH_WAIT_S
                ceiling = series(text, "pegaflow_hll_estimated_hit_rate")
                assert ceiling['pegaflow_hll_estimated_hit_rate{window="15m"}'] == pytest.approx(0.75, 0.03)
                assert series(text, "pegaflow_mrc_sampling_rate")  # the miss-ratio families too
            finally:
                os.kill(behind, signal.SIGCONT)
            wait_for(
                lambda: c.stats().hll_ceiling["15m"] == pytest.approx(0.8, abs=0.02),  # 5 lookups, 4 repeats
                30,
                what="a snapshot counting the fifth lookup",
            )
            assert sketches.pid == behind and sketches.restarts == 0
            _, text = get(f"http://{srv.http_address}/metrics")
            (age,) = series(text, "pegaflow_lookup_sketch_snapshot_age_seconds").values()
            assert age < 5.0
    finally:
        srv.stop()
