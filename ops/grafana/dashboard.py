"""Writes ops/grafana/dashboards/pegaflow.json, the pegaflow-server dashboard (Grafana 9+ JSON model).

    python ops/grafana/dashboard.py          # rewrite the JSON
    python ops/grafana/dashboard.py --check  # exit 1 if the JSON is not what this file generates

The panels are data here (one ``Panel`` per graph, one ``Target`` per PromQL query) so the JSON
stays consistent (ids, grid, units, datasource) and reviewable; ops/tests/test_dashboard.py
evaluates every query of the generated JSON against a real Prometheus scraping a real server.

Conventions the test relies on:
* every query filters ``instance=~"$instance"``; ``$window`` picks the hit-rate window
  (15m / 1h / 24h, the server's --metric-hll-windows defaults), ``$__rate_interval`` the rate range;
* a target's ``legendFormat`` names, as ``{{label}}``, the labels its series must carry.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

OUT = pathlib.Path(__file__).resolve().parent / "dashboards" / "pegaflow.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
I = 'instance=~"$instance"'  # noqa: E741 - the filter every query carries
RI = "$__rate_interval"


@dataclasses.dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    width: int = 12
    kind: str = "timeseries"
    min: float | None = 0
    max: float | None = None


def rate(metric: str, by: str = "instance", labels: str = "") -> str:
    selector = f"{{{I}{', ' + labels if labels else ''}}}"
    return f"sum by ({by}) (rate({metric}{selector}[{RI}]))"


def quantile(q: float, metric: str, by: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{I}}}[{RI}])))"


ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Hit rate: measured, the HyperLogLog ceiling, and what more memory would buy",
        [
            Panel(
                "Measured hit rate beside the HLL ceiling ($window)",
                "Block hit rate of LOOKUP queries over the window, and r* = (N - U) / N, the most any cache "
                "of any size could have hit on the same requests (U distinct blocks estimated with "
                "HyperLogLog). Far below the ceiling: more capacity or a better policy would pay.",
                (
                    Target(f'pegaflow_measured_hit_rate{{{I}, window="$window"}}', "{{instance}} measured"),
                    Target(
                        f'pegaflow_hll_estimated_hit_rate{{{I}, window="$window"}}', "{{instance}} ceiling"
                    ),
                ),
                unit="percentunit",
                max=1,
            ),
            Panel(
                "Distance to the ceiling, per window",
                "Ceiling minus measured hit rate (points of hit rate a bigger or smarter cache could still "
                "win). The PegaflowHitRateFarBelowCeiling alert fires above 0.2 on the 1h window.",
                (
                    Target(
                        f"pegaflow_hll_estimated_hit_rate{{{I}}} - on (instance, job, window) "
                        f"pegaflow_measured_hit_rate{{{I}}}",
                        "{{instance}} {{window}}",
                    ),
                ),
                unit="percentunit",
                min=None,
            ),
            Panel(
                "What more memory would buy: predicted hit rate at 0.25x .. 4x the pool ($window)",
                "Online miss-ratio curve (SHARDS sampled reuse distances, in bytes): the LRU hit rate a "
                "DRAM pool of pool_factor x this one would reach on the same requests, next to the "
                "measured rate (1x should sit close to it) and the ceiling (what no size can beat).",
                (
                    Target(
                        f'pegaflow_mrc_predicted_hit_rate{{{I}, window="$window"}}',
                        "{{instance}} {{pool_factor}}x pool",
                    ),
                    Target(f'pegaflow_measured_hit_rate{{{I}, window="$window"}}', "{{instance}} measured"),
                    Target(
                        f'pegaflow_hll_estimated_hit_rate{{{I}, window="$window"}}', "{{instance}} ceiling"
                    ),
                ),
                unit="percentunit",
                max=1,
            ),
            Panel(
                "Block lookups: hits by tier, misses",
                "Requested blocks per second: found in DRAM, on SSD, on a remote node, or missed.",
                (
                    Target(rate("pegaflow_block_hits_total", "instance, tier"), "{{instance}} hit {{tier}}"),
                    Target(rate("pegaflow_block_misses_total"), "{{instance}} miss"),
                ),
                unit="ops",
            ),
        ],
    ),
    (
        "Capacity",
        [
            Panel(
                "DRAM pool usage",
                "Bytes holding blocks (sealed or being written) and bytes stranded in slabs of another "
                "block size, over the pool's capacity.",
                (
                    Target(
                        f"pegaflow_pool_used_bytes{{{I}}} / pegaflow_pool_capacity_bytes{{{I}}}",
                        "{{instance}} used",
                    ),
                    Target(
                        f"pegaflow_pool_stranded_bytes{{{I}}} / pegaflow_pool_capacity_bytes{{{I}}}",
                        "{{instance}} stranded",
                    ),
                ),
                unit="percentunit",
                max=1,
            ),
            Panel(
                "Tier usage",
                "Used over capacity bytes of each tier (DRAM, SSD).",
                (
                    Target(
                        f"pegaflow_tier_used_bytes{{{I}}} / pegaflow_tier_capacity_bytes{{{I}}}",
                        "{{instance}} {{tier}}",
                    ),
                ),
                unit="percentunit",
                max=1,
            ),
            Panel(
                "Resident blocks by tier",
                "Sealed blocks readable in each tier.",
                (Target(f"pegaflow_tier_resident_blocks{{{I}}}", "{{instance}} {{tier}}"),),
            ),
            Panel(
                "Pinned and half-written blocks",
                "Blocks pinned by leases (never evicted) and granted but not yet sealed. A pool all pinned "
                "cannot make room: saves get NO_SPACE.",
                (
                    Target(f"pegaflow_pinned_blocks{{{I}}}", "{{instance}} pinned"),
                    Target(f"pegaflow_writing_blocks{{{I}}}", "{{instance}} writing"),
                ),
            ),
            Panel(
                "Evictions, admission rejections, NO_SPACE",
                "Blocks evicted to make room, refused by the admission policy (W-TinyLFU), and allocations "
                "refused because nothing was evictable (the PegaflowPoolExhausted alert).",
                (
                    Target(rate("pegaflow_evictions_total"), "{{instance}} evicted"),
                    Target(rate("pegaflow_admission_rejections_total"), "{{instance}} admission rejected"),
                    Target(rate("pegaflow_no_space_blocks_total"), "{{instance}} NO_SPACE"),
                ),
                unit="ops",
            ),
        ],
    ),
    (
        "Throughput and latency",
        [
            Panel(
                "Save / load GB/s",
                "Bytes sealed into the pool and bytes clients reported loading under leases.",
                (
                    Target(rate("pegaflow_save_bytes_total"), "{{instance}} save"),
                    Target(rate("pegaflow_load_bytes_total"), "{{instance}} load"),
                ),
                unit="Bps",
            ),
            Panel(
                "Tier read / write bytes",
                "Bytes each tier read and wrote (SSD promotions and demotions, DRAM copies).",
                (
                    Target(
                        rate("pegaflow_tier_read_bytes_total", "instance, tier"), "{{instance}} {{tier}} read"
                    ),
                    Target(
                        rate("pegaflow_tier_write_bytes_total", "instance, tier"),
                        "{{instance}} {{tier}} write",
                    ),
                ),
                unit="Bps",
            ),
            Panel(
                "RPC latency p50 / p99 by method",
                "Server-side duration of each RPC (gRPC and the local RPC socket).",
                (
                    Target(quantile(0.5, "pegaflow_rpc_duration_seconds", "method"), "{{method}} p50"),
                    Target(quantile(0.99, "pegaflow_rpc_duration_seconds", "method"), "{{method}} p99"),
                ),
                unit="s",
            ),
            Panel(
                "RPCs by method and status code",
                "Calls per second; a code other than OK is an error the client saw.",
                (Target(rate("pegaflow_rpc_total", "method, code"), "{{method}} {{code}}"),),
                unit="reqps",
            ),
            Panel(
                "Save and load duration p99",
                "AllocateBlocks to the SealBlocks that completed a save; a lease taken by QueryPrefix to "
                "its ReleaseLease (loads that read bytes).",
                (
                    Target(
                        quantile(0.99, "pegaflow_save_duration_seconds", "instance"), "{{instance}} save p99"
                    ),
                    Target(
                        quantile(0.99, "pegaflow_load_duration_seconds", "instance"), "{{instance}} load p99"
                    ),
                ),
                unit="s",
            ),
        ],
    ),
    (
        "Clients",
        [
            Panel(
                "Server up",
                "1 while Prometheus scrapes the server (the PegaflowServerDown alert fires on 0).",
                (Target(f"up{{{I}}}", "{{instance}} {{job}}"),),
                kind="stat",
                max=1,
            ),
            Panel(
                "Live sessions, instances, leases",
                "Client sessions open, instances (engine KV layouts) registered, leases unreleased.",
                (
                    Target(f"pegaflow_live_sessions{{{I}}}", "{{instance}} sessions"),
                    Target(f"pegaflow_live_instances{{{I}}}", "{{instance}} instances"),
                    Target(f"pegaflow_live_leases{{{I}}}", "{{instance}} leases"),
                ),
            ),
            Panel(
                "Sessions ended, by cause",
                "Closed by the client, disconnected (its pool connection dropped: process exit or crash), "
                "or silent past the heartbeat TTL.",
                (Target(rate("pegaflow_sessions_ended_total", "instance, cause"), "{{instance}} {{cause}}"),),
                unit="ops",
            ),
        ],
    ),
    (
        "Tier health: SSD and remote",
        [
            Panel(
                "Tier health (0 ok, 1 degraded, 2 off)",
                "Per tier; the PegaflowTierDegraded alert fires above 0.",
                (Target(f"pegaflow_tier_health{{{I}}}", "{{instance}} {{tier}}"),),
                max=2,
            ),
            Panel(
                "Tier queue depth and full-queue drops",
                "I/Os waiting per tier, and transfers dropped because the queue was full.",
                (
                    Target(f"pegaflow_tier_queue_depth{{{I}}}", "{{instance}} {{tier}} depth"),
                    Target(
                        rate("pegaflow_tier_queue_full_drops_total", "instance, tier"),
                        "{{instance}} {{tier}} drops",
                    ),
                ),
            ),
            Panel(
                "Corrupt records",
                "Records whose checksum did not match (never served); any is worth a look.",
                (
                    Target(
                        rate("pegaflow_tier_corrupt_records_total", "instance, tier"), "{{instance}} {{tier}}"
                    ),
                ),
                unit="ops",
            ),
            Panel(
                "SSD -> DRAM promotion latency p50 / p99",
                "From planning a batch of promotions to its completion.",
                (
                    Target(
                        quantile(0.5, "pegaflow_promotion_duration_seconds", "instance"), "{{instance}} p50"
                    ),
                    Target(
                        quantile(0.99, "pegaflow_promotion_duration_seconds", "instance"), "{{instance}} p99"
                    ),
                ),
                unit="s",
            ),
            Panel(
                "Remote fetches",
                "Blocks fetched from other nodes, by result, and their bytes.",
                (
                    Target(
                        rate("pegaflow_remote_fetches_total", "instance, result"), "{{instance}} {{result}}"
                    ),
                    Target(rate("pegaflow_remote_fetch_bytes_total"), "{{instance}} bytes/s"),
                ),
                unit="ops",
            ),
            Panel(
                "Metaserver publishing",
                "Index updates waiting to be published to the metaserver, and updates dropped.",
                (
                    Target(f"pegaflow_metaserver_publish_queue_depth{{{I}}}", "{{instance}} queued"),
                    Target(rate("pegaflow_metaserver_publish_drops_total"), "{{instance}} dropped/s"),
                ),
            ),
        ],
    ),
    (
        "Savings: prefill the cache spared",
        [
            Panel(
                "Prefill tokens served from the cache, by namespace",
                "Lookup hit blocks x the namespace's block_tokens, per second.",
                (
                    Target(
                        rate("pegaflow_prefill_tokens_served_total", "namespace, model"),
                        "{{model}} {{namespace}}",
                    ),
                ),
                unit="short",
            ),
            Panel(
                "Prefill seconds avoided per second, by namespace",
                "Tokens served x the engine's own measured prefill seconds per token: engine-seconds of "
                "prefill compute the cache spared per wall-clock second.",
                (
                    Target(
                        rate("pegaflow_prefill_seconds_avoided_total", "namespace, model"),
                        "{{model}} {{namespace}}",
                    ),
                ),
                unit="short",
            ),
            Panel(
                "Engine prefill cost (seconds per computed token)",
                "What the engines reported measuring, by namespace; the price of a served token.",
                (Target(f"pegaflow_prefill_seconds_per_token{{{I}}}", "{{model}} {{namespace}}"),),
                unit="s",
            ),
            Panel(
                "Tokens served before the engine reported a prefill rate",
                "Not priced (never priced after the fact with a later rate).",
                (
                    Target(
                        rate("pegaflow_prefill_tokens_unpriced_total", "namespace, model"),
                        "{{model}} {{namespace}}",
                    ),
                ),
            ),
        ],
    ),
    (
        "The metrics' own cost",
        [
            Panel(
                "Miss-ratio curve and HLL state",
                "SHARDS sampling rate, keys tracked (bounded), and memory of the MRC and the HLL windows.",
                (
                    Target(f"pegaflow_mrc_sampling_rate{{{I}}}", "{{instance}} MRC sampling rate"),
                    Target(f"pegaflow_mrc_tracked_keys{{{I}}}", "{{instance}} MRC tracked keys"),
                    Target(f"pegaflow_mrc_memory_bytes{{{I}}}", "{{instance}} MRC bytes"),
                    Target(f"sum by (instance) (pegaflow_hll_memory_bytes{{{I}}})", "{{instance}} HLL bytes"),
                ),
            ),
            Panel(
                "Lookups the metrics dropped",
                "Lookups not fed to the hit-rate windows, the ceiling and the MRC (feeder behind), and "
                "those the lookup sketches' process missed (behind, stalled or restarting; "
                "server/metrics/sketch_process.py).",
                (
                    Target(rate("pegaflow_metrics_dropped_lookups_total"), "{{instance}} feeder"),
                    Target(rate("pegaflow_lookup_sketch_dropped_lookups_total"), "{{instance}} sketches"),
                ),
                unit="ops",
            ),
            Panel(
                "Restarts of the lookup sketches' process",
                "Each restart empties the ceiling's and the MRC's windows (they refill as lookups come).",
                (Target(f"pegaflow_lookup_sketch_restarts_total{{{I}}}", "{{instance}}"),),
            ),
        ],
    ),
]


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict:
    defaults: dict = {"unit": panel.unit}
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    options: dict = {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True}}
    options["tooltip"] = {"mode": "multi", "sort": "desc"}
    if panel.kind == "stat":
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
        }
    return {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DS,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": [
            {
                "refId": chr(ord("A") + k),
                "datasource": DS,
                "expr": t.expr,
                "legendFormat": t.legend,
                "range": True,
            }
            for k, t in enumerate(panel.targets)
        ],
    }


def dashboard() -> dict:
    panels: list[dict] = []
    pid, y = 1, 0
    for title, row in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": title,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            }  # fmt: skip
        )
        pid, y, x = pid + 1, y + 1, 0
        for panel in row:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(_panel_json(panel, pid, x, y))
            pid, x = pid + 1, x + panel.width
        y += 8
    return {
        "uid": "pegaflow-server",
        "title": "pegaflow server",
        "description": "pegaflow-server: hit rate against the HyperLogLog ceiling and the miss-ratio curve, "
        "capacity, throughput, latency, clients, tier health and the prefill the cache spared. "
        "Generated by ops/grafana/dashboard.py.",
        "tags": ["pegaflow", "kv-cache"],
        "timezone": "",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "annotations": {"list": []},
        "templating": {
            "list": [
                {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus"},
                {
                    "name": "instance",
                    "label": "Server",
                    "type": "query",
                    "datasource": DS,
                    "definition": "label_values(pegaflow_pool_capacity_bytes, instance)",
                    "query": {
                        "query": "label_values(pegaflow_pool_capacity_bytes, instance)",
                        "refId": "instance",
                    },
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".+",
                    "refresh": 2,
                    "current": {"text": "All", "value": "$__all"},
                },
                {
                    "name": "window",
                    "label": "Hit-rate window",
                    "type": "custom",
                    "query": "15m,1h,24h",
                    "current": {"text": "1h", "value": "1h"},
                    "options": [{"text": w, "value": w, "selected": w == "1h"} for w in ("15m", "1h", "24h")],
                },
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv[1:] == ["--check"]:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python {pathlib.Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
