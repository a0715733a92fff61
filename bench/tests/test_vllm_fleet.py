"""What the fleet hands to `vllm serve` (no process is started here)."""

import json
import pathlib

import pytest

from pegaflow.bench.harness import connector_config
from pegaflow.bench.harness.vllm_fleet import CpuPlacement, VllmConfig, check_socket_room


def test_every_instance_gets_the_same_explicit_cpu_placement():
    assert CpuPlacement().env() == {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
    }
    pinned = CpuPlacement(bind="1", reserved_cpus=0).env()
    assert pinned == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "1"}


def test_server_command_carries_model_name_usage_details_and_connector_config(tmp_path):
    kv = connector_config.embedded_pool(64 << 20, {"lookup_timeout_ms": 5000}, "127.0.0.1:5000")
    cfg = VllmConfig(
        model="/models/tiny", kv_cache_bytes=256 << 20, max_num_batched_tokens=4096, kv_transfer_config=kv
    )
    server = cfg.server(tmp_path / "v0")
    cmd = server.cmd
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny"
    assert "--enable-prompt-tokens-details" in cmd and "--no-enable-prefix-caching" in cmd
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(256 << 20)
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "4096"
    extra = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra == {
        "embedded_pool_size": f"{64 << 20}b",
        "lookup_timeout_ms": 5000,
        "embedded_addr": "127.0.0.1:5000",
    }
    assert server.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and "VLLM_CPU_KVCACHE_SPACE" not in server.env


def test_shared_and_embedded_configs_name_the_connector():
    shared = connector_config.shared_pool("127.0.0.1:1234")
    assert shared["kv_connector"] == "PegaKVConnector"
    assert shared["kv_connector_module_path"] == "pegaflow.connector"
    assert shared["kv_connector_extra_config"] == {"server_addr": "127.0.0.1:1234"}
    with pytest.raises(ValueError):
        connector_config.embedded_pool(0)


def test_a_work_dir_too_deep_for_vllm_sockets_is_refused_early():
    # only the path's length is checked: nothing is created
    check_socket_room(pathlib.Path("/tmp/pfb-mi-abcdefgh/isolated-servers/vllm0"))
    with pytest.raises(ValueError, match="too deep"):
        check_socket_room(pathlib.Path("/tmp") / ("x" * 80) / "vllm0")


def test_an_embedded_pool_can_name_its_engine_so_its_published_address_can_be_found():
    kv = connector_config.embedded_pool(64 << 20, None, "127.0.0.1:0", engine_id="mi-isolated-0")
    assert kv["engine_id"] == "mi-isolated-0"
    assert kv["kv_connector_extra_config"]["embedded_addr"] == "127.0.0.1:0"
    assert "engine_id" not in connector_config.embedded_pool(64 << 20)
