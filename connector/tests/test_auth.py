"""The connector's credentials: kv_connector_extra_config keys over the PEGAFLOW_AUTH_* /
PEGAFLOW_TLS_* environment, the token itself refused in the config (it is on vLLM's command line),
and a worker against a real token-protected pegaflow-server: with the token it saves and loads,
without it it serves without the cache, says so once, and never raises into vLLM."""

from __future__ import annotations

import logging

import pytest

from pegaflow.common.auth import ClientAuth
from pegaflow.common.testing.tls import write_token_file
from pegaflow.connector.config import load_config
from pegaflow.connector.tests.support import (
    config,
    hashes,
    kv_caches,
    layout,
    load_meta,
    save_and_wait,
    step,
    wait_for,
    worker,
)
from pegaflow.server.testing import ServerProcess

pytestmark = pytest.mark.timeout(120)

TOKEN = "engine-" + "3" * 32


def test_the_keys_set_the_client_credentials_over_the_environment():
    env = {"PEGAFLOW_AUTH_TOKEN": TOKEN, "PEGAFLOW_TLS_CA": "/env/ca.pem"}
    assert load_config({}, env=env).auth == ClientAuth(token=TOKEN, tls_ca_file="/env/ca.pem")
    got = load_config(
        {
            "server_addr": "cache:50055",
            "auth_token_file": "/run/secrets/token",
            "tls_cert_file": "/c.pem",
            "tls_key_file": "/c.key",
            "tls_server_name": "cache.internal",
        },
        env=env,
    ).auth
    assert got == ClientAuth(
        token_file="/run/secrets/token",  # the key's file replaces the environment's token
        tls_ca_file="/env/ca.pem",
        tls_cert_file="/c.pem",
        tls_key_file="/c.key",
        tls_server_name="cache.internal",
    )
    assert not load_config({}, env={}).auth.configured  # nothing set: plaintext, as before


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"auth_token": TOKEN}, "does not belong in this config"),
        ({"auth_token_file": ""}, "non-empty string"),
        ({"tls_cert_file": "/c.pem"}, "go together"),
        ({"tls_cert_file": "/c.pem", "tls_key_file": "/c.key"}, "needs tls_ca_file"),
    ],
)
def test_bad_credential_settings_are_refused_at_start_up(extra, message):
    with pytest.raises(ValueError, match=message):
        load_config(extra, env={})


def test_a_worker_with_the_token_uses_a_protected_server_and_one_without_runs_without_the_cache(
    tmp_path, caplog
):
    token_file = write_token_file(tmp_path / "token", TOKEN)
    with ServerProcess(
        tmp_path / "server", pool_size="64mb", extra_args=["--auth-token-file", token_file]
    ) as srv:
        good = worker(config(srv.addr, auth=ClientAuth(token_file=token_file)), layout(), kv_caches(1), "a")
        reader = worker(
            config(srv.addr, auth=ClientAuth(token_file=token_file)), layout(), kv_caches(None), "b"
        )
        with caplog.at_level(logging.ERROR, logger="pegaflow"):
            refused = worker(config(srv.addr, auth=ClientAuth()), layout(), kv_caches(None), "c")
            try:
                wait_for(lambda: good.link.usable() and reader.link.usable())
                hs = hashes("auth", 4)
                save_and_wait(good, "r1", [1, 2, 3, 4], hs)
                assert good.stats["saved_blocks"] == 4
                _, failed = step(reader, load_meta("r2", [5, 6, 7, 8], hs))
                assert failed == set()
                wait_for(lambda: "refuses this engine" in caplog.text)
                assert refused.link.usable() is None
                # Its steps run, without the cache: a load of those blocks fails (vLLM recomputes).
                _, failed = step(refused, load_meta("r3", [5, 6, 7, 8], hs))
                assert failed == {5, 6, 7, 8}
            finally:
                for w in (good, reader, refused):
                    w.shutdown()
        assert caplog.text.count("refuses this engine") == 1
