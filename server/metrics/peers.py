"""Prometheus families of the L2 parts (server/peers/node.py): pulls from other nodes, the peer
transport, the transfers this node serves, and the metaserver publisher. Read at scrape time from
their plain-number stats; nothing here is on a request path."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


def _counter(name: str, doc: str, value: float, labels: dict | None = None):
    c = CounterMetricFamily(name, doc, labels=list(labels or {}))
    c.add_metric(list((labels or {}).values()), value)
    return c


def _gauge(name: str, doc: str, value: float):
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


def _histogram(name: str, doc: str, snap, labels: tuple[str, ...] = ()):
    h = HistogramMetricFamily(name, doc, labels=["transport"] if labels else None)
    buckets = [(("+Inf" if b == float("inf") else str(b)), n) for b, n in snap.buckets]
    h.add_metric(list(labels), buckets, snap.sum)
    return h


def peer_families(stats: dict):
    remote, transport, serve, pub = stats["remote"], stats["transport"], stats["serve"], stats["publisher"]
    # Pulls from other nodes, by outcome (one per looked-up chain that went to the metaserver).
    pulls = CounterMetricFamily(
        "pegaflow_remote_pulls", "Chains looked up on other nodes, by outcome", labels=["outcome"]
    )
    for outcome, value in (
        ("located", remote.located),
        ("not_located", remote.not_located),
        ("locate_failed", remote.locate_failed),
        ("stale", remote.stale),
        ("dropped", remote.dropped),
        ("joined", remote.joined),
    ):
        pulls.add_metric([outcome], value)
    yield pulls
    fetches = CounterMetricFamily(
        "pegaflow_remote_fetches", "Fetches from peers: ok, or the first failure's cause", labels=["result"]
    )
    fetches.add_metric(["ok"], transport.fetches - transport.fetches_failed)
    for cause, n in sorted(remote.failures.items()):
        fetches.add_metric([cause], n)
    yield fetches
    blocks = CounterMetricFamily(
        "pegaflow_peer_blocks", "Blocks fetched from peers, by result", labels=["transport", "result"]
    )
    blocks.add_metric([transport.transport, "ok"], transport.blocks_ok)
    for cause, n in sorted(transport.blocks_failed.items()):
        blocks.add_metric([transport.transport, cause], n)
    yield blocks
    yield _histogram(
        "pegaflow_peer_fetch_seconds",
        "Duration of one fetch from a peer",
        transport.fetch_seconds,
        (transport.transport,),
    )
    yield _histogram(
        "pegaflow_peer_fetch_gbps",
        "Effective GB/s of fetches of at least 64 MiB",
        transport.fetch_gbps,
        (transport.transport,),
    )
    yield _gauge("pegaflow_peer_open_links", "Links to peers open now", transport.open_links)
    yield _gauge(
        "pegaflow_peer_open_streams",
        "Data streams (or queue pairs) to peers open now",
        transport.open_streams,
    )
    yield _gauge("pegaflow_remote_inflight_bytes", "Bytes being pulled from peers now", remote.inflight_bytes)
    served = CounterMetricFamily(
        "pegaflow_peer_serve_transfers", "Transfers served to peers, by outcome", labels=["outcome"]
    )
    for outcome, value in (
        ("opened", serve.transfers_opened),
        ("missed", serve.transfers_missed),
        ("closed", serve.transfers_closed),
        ("expired", serve.transfers_expired),
    ):
        served.add_metric([outcome], value)
    yield served
    yield _counter("pegaflow_peer_serve_bytes", "Bytes sent to peers", serve.bytes_sent)
    # The metaserver publisher.
    yield _gauge(
        "pegaflow_metaserver_connected", "1 while registered with the metaserver leader", int(pub.connected)
    )
    yield _gauge(
        "pegaflow_metaserver_publish_queue_depth",
        "Block keys queued for the metaserver",
        pub.queue_depth_keys,
    )
    yield _counter(
        "pegaflow_metaserver_publish_drops",
        "Block keys not queued (queue full): a re-publish follows",
        pub.dropped_keys,
    )
    yield _counter(
        "pegaflow_metaserver_published_keys", "Block keys the metaserver accepted", pub.published_keys
    )
    yield _counter(
        "pegaflow_metaserver_republishes",
        "Full re-publications (new leader, restart, lost lease)",
        pub.republishes,
    )
    yield _counter(
        "pegaflow_metaserver_leader_changes", "Metaserver leader changes this node saw", pub.leader_changes
    )
    failures = CounterMetricFamily(
        "pegaflow_metaserver_rpc_failures", "Metaserver calls that failed, by call", labels=["call"]
    )
    failures.add_metric(["publish"], pub.publish_failures)
    failures.add_metric(["locate"], pub.locate_failures)
    yield failures
