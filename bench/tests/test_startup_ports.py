"""The startup experiment's embedded runs bind the embedded server's ports at 0 and read its /metrics
address where the server published it (connector/embedded.py), instead of picking a port beforehand
that another process could take first; a run whose embedded server published none fails naming its
log, instead of timing a vLLM that ran without the pool."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from pegaflow.bench.experiments import startup
from pegaflow.bench.harness import connector_config
from pegaflow.bench.harness.vllm_fleet import VllmConfig
from pegaflow.connector.embedded import (
    EmbeddedServer,
    address_file,
    metrics_address_file,
    published_address,
    published_metrics_address,
)


@dataclasses.dataclass
class StandInVllm:
    workdir: pathlib.Path
    log_path: pathlib.Path


def stand_in(run_dir: pathlib.Path) -> StandInVllm:
    """A vLLM of a VllmFleet in ``run_dir`` (its workdir vllm0, TMPDIR workdir/tmp) after its start."""
    vllm = StandInVllm(run_dir / "vllm0", run_dir / "vllm0" / "vllm.log")
    (vllm.workdir / "tmp").mkdir(parents=True, exist_ok=True)
    return vllm


def test_the_embedded_run_binds_port_0_and_reads_the_published_metrics_address(tmp_path, monkeypatch):
    seen = {}

    def time_vllm(config, run_dir, timeout_s, pool_metrics):
        extra = config.kv_transfer_config["kv_connector_extra_config"]
        engine_id = config.kv_transfer_config["engine_id"]
        vllm = stand_in(run_dir)
        metrics_address_file(engine_id, vllm.workdir / "tmp").write_text("127.0.0.1:41001\n")
        seen.update(http=extra["embedded_http_addr"], metrics=pool_metrics(vllm))
        return {"ready_s": 1.0}

    monkeypatch.setattr(startup, "time_vllm", time_vllm)
    assert startup.time_embedded_vllm(VllmConfig(model="m"), 1 << 30, tmp_path / "e", 60.0) == {
        "ready_s": 1.0
    }
    assert seen == {"http": "127.0.0.1:0", "metrics": "127.0.0.1:41001"}


def test_a_run_whose_embedded_server_published_nothing_fails_naming_its_log(tmp_path):
    vllm = stand_in(tmp_path)
    with pytest.raises(
        RuntimeError, match=r"published no metrics address.*without the cache.*vllm0/vllm\.log"
    ):
        connector_config.embedded_address("e1", vllm, metrics=True)


def test_an_embedded_server_on_port_0_publishes_both_addresses_and_removes_them_when_it_stops(
    tmp_path, monkeypatch
):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    server = EmbeddedServer("e2", 16 << 20, "127.0.0.1:0", "127.0.0.1:0")
    try:
        grpc_addr, http_addr = published_address("e2"), published_metrics_address("e2")
        assert grpc_addr == server.address and not grpc_addr.endswith(":0")
        assert http_addr == server.server.http_address and not http_addr.endswith(":0")
    finally:
        server.stop()
    assert not address_file("e2").exists() and not metrics_address_file("e2").exists()
