"""Embedded mode: rank 0's worker runs the whole pegaflow server in-process; the other
ranks and the scheduler find it by the engine id and use it like an external server."""

from __future__ import annotations

import uuid

import pytest

from pegaflow.connector.config import load_config
from pegaflow.connector.embedded import address_file, published_address
from pegaflow.connector.scheduler import ServerPrefixLookup
from pegaflow.connector.server_link import ServerLink
from pegaflow.connector.tests.support import (
    LAYER_NAMES,
    NUM_BLOCKS,
    hashes,
    kv_caches,
    layout,
    load_meta,
    ready_blocks,
    save_and_wait,
    step,
    wait_for,
)
from pegaflow.connector.worker import WorkerConnector

pytestmark = pytest.mark.timeout(120)


def test_embedded_config_keys():
    cfg = load_config({"embedded_pool_size": "64mb", "embedded_http_addr": "127.0.0.1:0"}, env={})
    assert cfg.embedded and cfg.embedded_pool_size == 64 << 20 and cfg.server_addr == ""
    assert cfg.embedded_addr == "127.0.0.1:0" and cfg.embedded_http_addr == "127.0.0.1:0"
    assert load_config({"embedded_pool_size": f"{1 << 26}b"}, env={}).embedded_pool_size == 1 << 26
    with pytest.raises(ValueError, match="not both"):
        load_config({"embedded_pool_size": "64mb", "server_addr": "h:1"}, env={})
    with pytest.raises(ValueError, match="embedded_pool_size"):
        load_config({"embedded_pool_size": "64 potatoes"}, env={})
    with pytest.raises(ValueError, match="need embedded_pool_size"):
        load_config({"embedded_addr": "127.0.0.1:0"}, env={})


def test_rank0_runs_the_server_the_others_find_it_and_it_stops_with_the_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the address is published
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    engine_id = str(uuid.uuid4())
    cfg = load_config(
        {"embedded_pool_size": "64mb", "lookup_timeout_ms": 1000, "load_timeout_ms": 2000}, env={}
    )
    resolve = lambda: published_address(engine_id)  # noqa: E731 - what the connector passes
    # non-MLA TP=2: rank 1 starts first and waits for rank 0's server
    rank1_caches = kv_caches(seed=None)
    rank1 = WorkerConnector(
        cfg,
        layout(tp_size=2, tp_rank=1),
        num_blocks=NUM_BLOCKS,
        layer_names=list(LAYER_NAMES),
        instance_name="r1",
        tp_rank=1,
        server_addr=resolve,
        engine_id=engine_id,
    )
    rank1.register_kv_caches(rank1_caches)
    assert rank1.embedded is None and published_address(engine_id) is None
    src = kv_caches(seed=11)
    rank0 = WorkerConnector(
        cfg,
        layout(tp_size=2, tp_rank=0),
        num_blocks=NUM_BLOCKS,
        layer_names=list(LAYER_NAMES),
        instance_name="r0",
        tp_rank=0,
        server_addr=resolve,
        engine_id=engine_id,
    )
    rank0.register_kv_caches(src)  # starts the server: the pool is allocated and pre-faulted now
    link = ServerLink(
        resolve,
        [layout(tp_size=2, tp_rank=0)],
        client_name="sched",
        instance_name="sched",
        rpc_timeout_s=5.0,
        retry_interval_s=0.2,
        map_pool=False,
    )
    link.start()
    lookup = ready_blocks(ServerPrefixLookup(link, 1.0))
    try:
        assert rank0.embedded is not None
        assert published_address(engine_id) == rank0.embedded.address
        wait_for(lambda: all(x.usable() is not None for x in (rank0.link, rank1.link, link)))
        hs = hashes("embedded", 3)
        save_and_wait(rank0, "r", [1, 2, 3], hs)
        assert lookup(hs) == 3
        # rank 1 has its own namespace (another shard of the heads): nothing there yet
        _, failed = step(rank1, load_meta("r", [4, 5, 6], hs))
        assert failed == {4, 5, 6}
        assert rank0.embedded.server.engine.stats().resident_blocks == 3
    finally:
        link.close()
        rank1.shutdown()
        rank0.shutdown()
    assert not address_file(engine_id).exists()
