"""PrefillSavings: tokens served per namespace, priced with the engine's reported prefill rate;
LookupInsights through a real in-process server's /metrics (MRC and savings families)."""

from __future__ import annotations

import math
import time
import urllib.request

import pytest

from pegaflow.client import KvLayout, PegaClient
from pegaflow.server.config import MIB, ServerConfig
from pegaflow.server.metrics import savings as savings_mod
from pegaflow.server.metrics.savings import OVERFLOW, PrefillSavings
from pegaflow.server.runtime import start_server


class FakeClock:
    def __init__(self, now: float = 5000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def by_namespace(s: PrefillSavings):
    return {x.namespace_id: x for x in s.snapshot()}


def test_tokens_before_a_rate_are_unpriced_then_priced_at_the_reported_rate():
    clock = FakeClock()
    s = PrefillSavings(clock)
    s.add_hits("ns-a", "m", block_tokens=16, hit_blocks=10)
    a = by_namespace(s)["ns-a"]
    assert (a.hit_blocks, a.tokens_served, a.unpriced_tokens, a.seconds_avoided) == (10, 160, 160, 0.0)
    assert a.seconds_per_token is None
    s.report_prefill("ns-a", "m", computed_tokens=2000, prefill_seconds=1.0)  # 0.5 ms per token
    s.add_hits("ns-a", "m", 16, 100)
    a = by_namespace(s)["ns-a"]
    assert a.tokens_served == 1760 and a.unpriced_tokens == 160
    assert a.seconds_avoided == pytest.approx(1600 * 0.0005)
    assert a.seconds_per_token == pytest.approx(0.0005)


def test_rate_is_a_rolling_ratio_and_the_last_known_one_outlives_the_window():
    clock = FakeClock()
    s = PrefillSavings(clock)
    s.report_prefill("ns-a", "m", 1000, 1.0)
    s.report_prefill("ns-a", "m", 3000, 1.0)
    assert by_namespace(s)["ns-a"].seconds_per_token == pytest.approx(2.0 / 4000)
    clock.now += savings_mod.RATE_WINDOW_S * 2  # no report for two windows: the last ratio stays
    assert by_namespace(s)["ns-a"].seconds_per_token == pytest.approx(2.0 / 4000)
    s.report_prefill("ns-a", "m", 1000, 2.0)  # the engine got slower: the new window speaks
    assert by_namespace(s)["ns-a"].seconds_per_token == pytest.approx(0.002)


def test_namespaces_are_separate_and_bounded():
    s = PrefillSavings(FakeClock())
    s.report_prefill("ns-a", "m1", 100, 1.0)
    s.add_hits("ns-a", "m1", 16, 1)
    s.add_hits("ns-b", "m2", 32, 1)
    got = by_namespace(s)
    assert got["ns-a"].seconds_avoided == pytest.approx(0.16) and got["ns-b"].unpriced_tokens == 32
    for i in range(savings_mod.MAX_NAMESPACES + 10):
        s.add_hits(f"ns-{i}", "m", 1, 1)
    got = by_namespace(s)
    assert len(got) == savings_mod.MAX_NAMESPACES + 1 and got[OVERFLOW].hit_blocks >= 10


@pytest.mark.parametrize(
    "tokens, seconds",
    [(-1, 1.0), (1.5, 1.0), (True, 1.0), (10, -0.1), (10, math.nan), (10, math.inf), (0, 1.0), (1, 11.0)],
)
def test_bad_reports_are_refused_and_record_nothing(tokens, seconds):
    s = PrefillSavings(FakeClock())
    with pytest.raises(ValueError):
        s.report_prefill("ns-a", "m", tokens, seconds)
    assert s.snapshot() == []


def series(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


@pytest.mark.parametrize("sketches", ["thread", "process"])
def test_insights_are_exported_by_a_running_server(tmp_path, sketches):
    srv = start_server(
        ServerConfig(
            pool_size_bytes=16 * MIB,
            addr="127.0.0.1:0",
            http_addr="127.0.0.1:0",
            fd_socket_path=str(tmp_path / "pool.sock"),
            lookup_sketches=sketches,
        )
    )
    try:
        with PegaClient(srv.address, timeout_s=10.0) as c:
            inst = c.register_instance(KvLayout(model_id="m", block_bytes=4096, block_tokens=16))
            hashes = [b"b%03d" % i for i in range(50)]
            c.seal(c.allocate(inst, hashes).save_id)
            namespace = srv.engine.namespace_at(0).id
            srv.metrics.insights.report_prefill(namespace, "m", 1000, 0.25)
            for _ in range(4):
                assert c.query_prefix(inst, hashes + [b"missing"]).num_hits == 50
        labels = f'{{model="m",namespace="{namespace}"}}'
        deadline = time.monotonic() + 10
        while True:  # the feeder accounts lookups asynchronously (every 0.1 s)
            with urllib.request.urlopen(f"http://{srv.http_address}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            served = series(text, "pegaflow_prefill_tokens_served_total")
            if served.get("pegaflow_prefill_tokens_served_total" + labels) == 4 * 50 * 16:
                break
            assert time.monotonic() < deadline, served
            time.sleep(0.05)
        assert series(text, "pegaflow_prefill_seconds_avoided_total")[
            "pegaflow_prefill_seconds_avoided_total" + labels
        ] == pytest.approx(3200 * 0.25 / 1000)
        assert series(text, "pegaflow_prefill_seconds_per_token")[
            "pegaflow_prefill_seconds_per_token" + labels
        ] == pytest.approx(0.00025)
        predicted = series(text, "pegaflow_mrc_predicted_hit_rate")
        factors = {"0.25", "0.5", "1", "2", "4"}
        assert {k for k in predicted if 'window="15m"' in k} == {
            f'pegaflow_mrc_predicted_hit_rate{{pool_factor="{f}",window="15m"}}' for f in factors
        }
        assert all(0.0 <= v <= 1.0 for v in predicted.values())
        assert 0 < series(text, "pegaflow_mrc_sampling_rate")["pegaflow_mrc_sampling_rate"] <= 1
        assert series(text, "pegaflow_mrc_memory_bytes")["pegaflow_mrc_memory_bytes"] < 8 * MIB
    finally:
        srv.stop()
