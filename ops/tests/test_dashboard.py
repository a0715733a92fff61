"""The Grafana dashboard and the Prometheus rules, proved against a real Prometheus scraping a real
pegaflow-server under load.

One scenario (~30 s): a real `pegaflow-server` process (server/testing.py ServerProcess) and a real
Prometheus (Debian's `prometheus`, its own data dir, a free port, 1 s scrape and rule intervals,
ops/prometheus/prometheus.yml with only the target and intervals changed, the rules file as
shipped). A client saves, looks up and loads blocks, scans more blocks than the pool holds (the
measured hit rate falls far below the HLL ceiling) and then pins the whole pool with leases and
asks for more (NO_SPACE). Then, through Prometheus's HTTP API (/api/v1/query):

* every query of every dashboard panel returns series, each carrying the labels its legend
  names ({{label}}), with a finite value (NaN only for a latency quantile of a histogram that
  has no observations, e.g. SSD promotions on a DRAM-only server);
* every recording rule has data; every alert's signal (its expression left of the final
  comparison) has data with the labels its annotations use; the alerts the scenario provokes
  fire (HitRateFarBelowCeiling, PoolExhausted, then ServerDown after a SIGKILL) and the others
  stay silent on this healthy server; Prometheus reports every rule healthy;
* `promtool check rules` / `check config` accept the shipped files.

Panels of metrics the server does not export yet are listed in PENDING_METRICS: such a panel is
skipped while its metric is absent from the server's /metrics and checked as soon as it appears
(nothing to flip). A metric a panel names that is neither exported nor pending fails the test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest
import yaml

from pegaflow.client import AllocStatus, KvLayout, PegaClient, errors, read_blocks, write_blocks
from pegaflow.server.testing import ServerProcess, free_port

OPS = pathlib.Path(__file__).resolve().parents[1]
DASHBOARD = OPS / "grafana" / "dashboards" / "pegaflow.json"
RULES = OPS / "prometheus" / "pegaflow-rules.yml"
EXAMPLE_CONFIG = OPS / "prometheus" / "prometheus.yml"

# Metrics some panels show that the server does not export yet, and who brings them. While absent
# from /metrics their panels are skipped; once exported they are checked like every other.
PENDING_METRICS = {
    "pegaflow_remote_fetches_total": "remote tier (peer fetches)",
    "pegaflow_remote_fetch_bytes_total": "remote tier (peer fetches)",
    "pegaflow_metaserver_publish_queue_depth": "metaserver publishing",
    "pegaflow_metaserver_publish_drops_total": "metaserver publishing",
    "pegaflow_prefill_seconds_per_token": "the connector's prefill report (ReportPrefill RPC)",
    # The per-tier set the lead is adding (most exist already for tier="dram").
    "pegaflow_tier_capacity_bytes": "per-tier metrics",
    "pegaflow_tier_used_bytes": "per-tier metrics",
    "pegaflow_tier_resident_blocks": "per-tier metrics",
    "pegaflow_tier_read_bytes_total": "per-tier metrics",
    "pegaflow_tier_write_bytes_total": "per-tier metrics",
    "pegaflow_tier_queue_depth": "per-tier metrics",
    "pegaflow_tier_queue_full_drops_total": "per-tier metrics",
    "pegaflow_tier_corrupt_records_total": "per-tier metrics",
    "pegaflow_tier_health": "per-tier metrics",
    "pegaflow_promotion_duration_seconds_bucket": "SSD promotions",
}
# The alerts the scenario makes fire (the others must stay silent on a healthy server).
PROVOKED = {"PegaflowHitRateFarBelowCeiling", "PegaflowPoolExhausted", "PegaflowServerDown"}

SUBSTITUTIONS = {"$instance": ".+", "$window": "15m", "$__rate_interval": "1m"}
METRIC = re.compile(r"\b(pegaflow_[a-z0-9_]+)\b")
LEGEND_LABEL = re.compile(r"{{\s*(\w+)\s*}}")
ANNOTATION_LABEL = re.compile(r"\$labels\.(\w+)")
FINAL_COMPARISON = re.compile(r"^(?P<signal>.*\S)\s*(?:==|!=|>=|<=|>|<)\s*-?[0-9.]+(?:e-?[0-9]+)?\s*$", re.S)

BLOCK = 4096
POOL = "16mb"  # 4096 blocks of 4 KiB


def need_prometheus() -> tuple[str, str]:
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if not prometheus or not promtool:
        pytest.fail("prometheus / promtool not found: apt-get install prometheus (ci/apt-packages.txt)")
    return prometheus, promtool


class Prometheus:
    """A real Prometheus on a free port with its own data dir, killed (with its group) on exit."""

    def __init__(self, binary: str, workdir: pathlib.Path, config: dict):
        self.workdir = workdir
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={workdir / 'data'}"]
                + [f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not become ready:\n{self.log_path.read_text()}")
            time.sleep(0.1)

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as err:
            body = json.loads(err.read())
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def wait_for(self, expr: str, timeout_s: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result:
                return result
            assert time.monotonic() < deadline, f"no data for {expr} within {timeout_s} s"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def substitute(expr: str) -> str:
    for var, value in sorted(SUBSTITUTIONS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def dashboard_targets() -> list[tuple[str, dict]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t) for p in board["panels"] for t in p.get("targets", [])]


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def save(client: PegaClient, inst, chain: list[bytes]) -> None:
    batch = client.allocate(inst, chain)
    rows = np.full((len(chain), BLOCK), 7, dtype=np.uint8)
    write_blocks(client.pool_view(batch.epoch), batch.allocations, rows)
    if batch.save_id:
        client.seal(batch.save_id)


def load(client: PegaClient, inst, chain: list[bytes]) -> int:
    hit = client.query_prefix(inst, chain, lease=True)
    out = np.empty((hit.num_hits, BLOCK), dtype=np.uint8)
    if hit.num_hits:
        read_blocks(client.pool_view(hit.epoch), hit.locations, out)
    if hit.lease_id:  # also taken over blocks still arriving from the SSD tier (hit.pending)
        client.release(hit.lease_id, loaded_bytes=out.nbytes)
    return hit.num_hits


def run_load(client: PegaClient, pinners: list[PegaClient]) -> None:
    """Hot chains that hit, a scan bigger than the pool, then the pool pinned and NO_SPACE. A
    session may pin at most half of the pool under leases: ``pinners`` (more sessions) pin it all."""
    inst = client.register_instance(KvLayout(model_id="dash", block_bytes=BLOCK, block_tokens=16))
    client.report_prefill(inst, 16_000, 4.0)  # the engine's measured prefill cost prices the savings
    hot = [[b"hot-%d-%d" % (c, i) for i in range(64)] for c in range(8)]
    for chain in hot:
        save(client, inst, chain)
    for _ in range(5):
        for chain in hot:
            assert load(client, inst, chain) == len(chain)
    scan = [[b"scan-%d-%d" % (c, i) for i in range(100)] for c in range(60)]  # 6000 blocks > 4096
    for _ in range(3):
        for chain in scan:
            load(client, inst, chain)
            save(client, inst, chain)
    leases = []
    sessions = iter(pinners)
    pinner = next(sessions)
    pinned_inst = pinner.register_instance(KvLayout(model_id="dash", block_bytes=BLOCK, block_tokens=16))
    exhausted = False
    for chain in scan:  # pin every block resident in DRAM (SSD ones are promoted into it first)
        while True:
            try:
                hit = pinner.query_prefix(pinned_inst, chain, lease=True)
                break
            except errors.ResourceExhausted:  # this session's lease quota is full: the next one
                pinner = next(sessions, None)
                if pinner is None:
                    exhausted = True  # every pinner holds its half of the pool: it is all pinned
                    break
                pinned_inst = pinner.register_instance(
                    KvLayout(model_id="dash", block_bytes=BLOCK, block_tokens=16)
                )
        if exhausted:
            break
        if hit.lease_id:
            leases.append((pinner, hit.lease_id))
    refused = 0
    for k in range(2):
        batch = client.allocate(inst, [b"more-%d-%d" % (k, i) for i in range(2000)])
        refused += sum(a.status == AllocStatus.NO_SPACE for a in batch.allocations)
        if batch.save_id:
            client.abort(batch.save_id)
    assert refused > 0, "the pinned pool still had room: the scenario did not exhaust it"
    for pinner, lease_id in leases:
        pinner.release(lease_id)


def scraped_names(http_addr: str) -> set[str]:
    with urllib.request.urlopen(f"http://{http_addr}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")
    }


def check_series(what: str, result: list[dict], labels: set[str], allow_nan: bool) -> None:
    assert result, f"{what}: no data"
    for series in result:
        missing = labels - set(series["metric"])
        assert not missing, f"{what}: series {series['metric']} lacks labels {missing}"
    values = [float(s["value"][1]) for s in result]
    assert allow_nan or any(np.isfinite(values)), f"{what}: no finite value in {values}"


def test_promtool_accepts_the_shipped_files():
    _, promtool = need_prometheus()
    for cmd in (["check", "rules", str(RULES)], ["check", "config", str(EXAMPLE_CONFIG)]):
        proc = subprocess.run([promtool, *cmd], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_json_is_generated_and_well_formed():
    spec = importlib.util.spec_from_file_location("pegaflow_ops_dashboard", OPS / "grafana" / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    assert DASHBOARD.read_text() == module.render(), "run python ops/grafana/dashboard.py"
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in board["templating"]["list"]}
    assert names == {"datasource", "instance", "window"}
    for title, target in dashboard_targets():
        assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert 'instance=~"$instance"' in target["expr"], f"{title}: {target['expr']} ignores $instance"
    provisioning = yaml.safe_load(
        (OPS / "grafana" / "provisioning" / "dashboards" / "pegaflow.yml").read_text()
    )
    assert provisioning["providers"][0]["type"] == "file"


def routable_host() -> str | None:
    """This host's address on its default route (a UDP connect sends nothing), None without one:
    a server that publishes to a metaserver must listen on an address peers can dial."""
    import socket

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routed like any remote address, never reached
        host = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if host.startswith("127.") or host == "0.0.0.0" else host


@pytest.mark.timeout(240)
def test_every_panel_and_rule_against_a_real_prometheus(tmp_path):
    """With the SSD tier and a metaserver, so the tier and L2 panels are checked too (the L2 ones
    only where this host has a routable address)."""
    from pegaflow.metaserver.testing import MetaServerProcess

    prometheus_bin, _ = need_prometheus()
    (tmp_path / "ssd").mkdir()
    extra = ["--ssd-cache-path", str(tmp_path / "ssd"), "--ssd-cache-capacity", "64mb"]
    extra += ["--ssd-segment-size", "8mb"]  # second-sighting placement: the scan stays a miss
    host, meta = routable_host(), None
    if host is not None:
        meta = MetaServerProcess(tmp_path / "meta").start()
        extra += ["--metaserver-addr", meta.addr]
    addr = f"{host}:0" if host else "127.0.0.1:0"
    try:
        _check_against_prometheus(tmp_path, prometheus_bin, addr, extra)
    finally:
        if meta is not None:
            meta.kill()


def _check_against_prometheus(tmp_path, prometheus_bin: str, addr: str, extra: list[str]) -> None:
    with ServerProcess(tmp_path / "server", pool_size=POOL, addr=addr, extra_args=extra) as srv:
        config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(RULES)]
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [srv.http_addr]}]
        (tmp_path / "prom").mkdir()
        prom = Prometheus(prometheus_bin, tmp_path / "prom", config)
        try:
            prom.wait_for('up{job="pegaflow"} == 1')
            pinners = [PegaClient(srv.addr, timeout_s=10.0, name=f"dashboard-pin-{k}") for k in range(3)]
            with PegaClient(srv.addr, timeout_s=10.0, name="dashboard-load") as client:
                for pinner in pinners:
                    pinner.connect()
                run_load(client, pinners)
                # Two scrapes after the load's end (every series the load created has two samples,
                # every value is the final one), then the provoked alerts fire on them.
                prom.wait_for(f'timestamp(up{{job="pegaflow"}}) > {time.time() + 2.0}')
                for rule in rules():
                    if rule.get("alert") in PROVOKED - {"PegaflowServerDown"}:
                        prom.wait_for(rule["expr"], timeout_s=20)
                exported = scraped_names(srv.http_addr)
                check_dashboard(prom, exported)
                check_rules(prom, before_kill=True)
            for pinner in pinners:
                pinner.close()
            srv.kill()  # SIGKILL: the server is gone, not stopping
            prom.wait_for('up{job="pegaflow"} == 0', timeout_s=20)
            check_rules(prom, before_kill=False)
        finally:
            prom.stop()


def check_dashboard(prom: Prometheus, exported: set[str]) -> None:
    skipped, checked = [], 0
    for title, target in dashboard_targets():
        names = set(METRIC.findall(target["expr"]))
        unknown = {n for n in names if n not in exported and n not in PENDING_METRICS}
        assert not unknown, f"panel {title!r} names metrics the server does not export: {unknown}"
        if any(n not in exported for n in names):
            skipped.append((title, sorted(n for n in names if n not in exported)))
            continue
        expr = substitute(target["expr"])
        labels = set(LEGEND_LABEL.findall(target["legendFormat"]))
        # A quantile of a histogram without observations is NaN: data, but no number to show yet.
        histograms = re.findall(r"(pegaflow_[a-z0-9_]+)_bucket", expr)
        idle = bool(histograms) and all(not prom.query(f"sum(rate({h}_count[1m])) > 0") for h in histograms)
        result = prom.query(expr)
        check_series(f"panel {title!r} {target['refId']}: {expr}", result, labels, allow_nan=idle)
        checked += 1
        if "$window" in target["expr"]:
            assert {s["metric"].get("window") for s in result} == {"15m"}, title
        if "pegaflow_mrc_predicted_hit_rate" in expr:
            assert {s["metric"]["pool_factor"] for s in result} == {"0.25", "0.5", "1", "2", "4"}
        if "pegaflow_block_hits_total" in expr:
            dram = [float(s["value"][1]) for s in result if s["metric"].get("tier") == "dram"]
            assert dram and dram[0] > 0, f"no DRAM hits in {result}"
    print(f"dashboard: {checked} queries checked; waiting for metrics: {skipped}", file=sys.stderr)
    assert checked >= 35


def check_rules(prom: Prometheus, before_kill: bool) -> None:
    for rule in rules():
        if "record" in rule:
            if before_kill:
                check_series(
                    f"recording rule {rule['record']}", prom.query(rule["record"]), {"instance", "job"}, False
                )
            continue
        name, expr = rule["alert"], rule["expr"].strip()
        labels = set(ANNOTATION_LABEL.findall(json.dumps(rule.get("annotations", {})))) - {"value"}
        signal_expr = FINAL_COMPARISON.match(expr)
        assert signal_expr, f"alert {name}: {expr!r} does not end in a comparison with a number"
        fired = prom.query(expr)
        if before_kill:
            check_series(f"alert {name} signal", prom.query(signal_expr["signal"]), labels, allow_nan=False)
            if name in PROVOKED - {"PegaflowServerDown"}:
                check_series(f"alert {name} (provoked)", fired, labels, allow_nan=False)
            else:
                assert fired == [], f"alert {name} fires on a healthy server: {fired}"
        elif name == "PegaflowServerDown":
            check_series(f"alert {name} (server killed)", fired, labels, allow_nan=False)
    if before_kill:
        groups = prom.api("rules")["groups"]
        loaded = {r.get("name") for g in groups for r in g["rules"]}
        assert loaded == {r.get("alert") or r.get("record") for r in rules()}
        unhealthy = [
            (r["name"], r.get("lastError")) for g in groups for r in g["rules"] if r["health"] != "ok"
        ]
        assert not unhealthy, unhealthy
