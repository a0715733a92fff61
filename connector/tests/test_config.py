"""kv_connector_extra_config keys and PEGAFLOW_HOST / PEGAFLOW_PORT."""

import pytest

from pegaflow.connector.config import load_config, server_addr_from_env


@pytest.mark.parametrize(
    ("env", "addr"),
    [
        ({}, "127.0.0.1:50055"),
        ({"PEGAFLOW_HOST": "http://10.1.2.3"}, "10.1.2.3:50055"),
        ({"PEGAFLOW_HOST": "https://node-7/", "PEGAFLOW_PORT": "6000"}, "node-7:6000"),
        ({"PEGAFLOW_HOST": "10.1.2.3:7000"}, "10.1.2.3:7000"),
        ({"PEGAFLOW_HOST": "http://10.1.2.3:7000", "PEGAFLOW_PORT": "7001"}, "10.1.2.3:7001"),
        ({"PEGAFLOW_HOST": "[::1]", "PEGAFLOW_PORT": "50056"}, "[::1]:50056"),
        ({"PEGAFLOW_HOST": "[::1]:9"}, "[::1]:9"),
        ({"PEGAFLOW_PORT": "50099"}, "127.0.0.1:50099"),
    ],
)
def test_server_addr_from_env(env, addr):
    assert server_addr_from_env(env) == addr


@pytest.mark.parametrize(
    "env",
    [
        {"PEGAFLOW_PORT": "0"},
        {"PEGAFLOW_PORT": "70000"},
        {"PEGAFLOW_PORT": "abc"},
        {"PEGAFLOW_HOST": "http://"},
        {"PEGAFLOW_HOST": "host/path"},
    ],
)
def test_bad_env_is_a_clear_error(env):
    with pytest.raises(ValueError, match="PEGAFLOW_"):
        server_addr_from_env(env)


def test_defaults():
    cfg = load_config({}, env={})
    assert cfg.server_addr == "127.0.0.1:50055"
    assert cfg.lookup_timeout_s == pytest.approx(0.2)
    assert cfg.load_timeout_s == pytest.approx(0.5)
    assert cfg.worst_step_stall_s == pytest.approx(0.7)
    assert not cfg.honor_kv_load_failure_policy


def test_extra_config_overrides_env_and_converts_units():
    cfg = load_config(
        {
            "server_addr": "http://10.0.0.9:1234",
            "lookup_timeout_ms": 50,
            "load_timeout_ms": "250",
            "rpc_timeout_ms": 1000,
            "retry_interval_s": 0.5,
            "max_pending_saves": 3,
            "model_id": "org/model",
            "namespace_salt": "blue",
            "honor_kv_load_failure_policy": "true",
        },
        env={"PEGAFLOW_HOST": "elsewhere", "PEGAFLOW_PORT": "1"},
    )
    assert cfg.server_addr == "10.0.0.9:1234"
    assert cfg.lookup_timeout_s == pytest.approx(0.05)
    assert cfg.load_timeout_s == pytest.approx(0.25)
    assert cfg.rpc_timeout_s == pytest.approx(1.0)
    assert cfg.retry_interval_s == 0.5
    assert cfg.max_pending_saves == 3
    assert cfg.model_id == "org/model"
    assert cfg.namespace_salt == "blue"
    assert cfg.honor_kv_load_failure_policy


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"lookup_timeout": 5}, "unknown"),
        ({"lookup_timeout_ms": 0}, "> 0"),
        ({"load_timeout_ms": "soon"}, "number"),
        ({"server_addr": "no-port"}, "host:port"),
        ({"max_pending_saves": 0}, ">= 1"),
        ({"max_pending_saves": True}, ">= 1"),
        ({"model_id": ""}, "string"),
        ({"honor_kv_load_failure_policy": "maybe"}, "true or false"),
    ],
)
def test_bad_extra_config_is_a_clear_error(extra, match):
    with pytest.raises(ValueError, match=match):
        load_config(extra, env={})
