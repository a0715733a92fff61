"""The layering: the client never imports server code, and the connector (which every vLLM process
imports) imports only the client and common, its embedded mode excepted. Checked in a fresh
interpreter, after the imports and the calls that load modules lazily."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

import pegaflow.connector

CONNECTOR_DIR = pathlib.Path(pegaflow.connector.__file__).parent
# The embedded mode runs a whole server in the vLLM process: it is the one allowed importer.
EXCEPTED = {"embedded"}


def loaded_server_modules(code: str) -> list[str]:
    report = "print(json.dumps(sorted(m for m in sys.modules if m.startswith('pegaflow.server'))))"
    probe = f"{code}\nimport json, sys\n{report}"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_client_imports_no_server_code():
    code = """
import pegaflow.client
from pegaflow.client import AsyncPegaClient, PegaClient, device, doorbell, frame_link, local_rpc
from pegaflow.client.device import DeviceRegistration, export_torch_kv, registration_request
"""
    assert loaded_server_modules(code) == []


def test_the_connector_imports_only_the_client_and_common():
    modules = sorted(p.stem for p in CONNECTOR_DIR.glob("*.py") if p.stem not in EXCEPTED | {"__init__"})
    vllm = any(p.stem == "connector" for p in CONNECTOR_DIR.glob("*.py"))
    code = "\n".join(f"import pegaflow.connector.{m}" for m in modules)
    # The lazy imports on the way: the connector class, the config of an embedded-mode engine (its
    # flags are parsed in every process; only TP rank 0's worker starts the server).
    code += """
from pegaflow.connector.config import load_config
load_config({"server_addr": "127.0.0.1:1"})
load_config({"embedded_pool_size": "64mb", "embedded_addr": "127.0.0.1:0"})
"""
    if vllm:
        pytest.importorskip("vllm")
        code += "\nfrom pegaflow.connector import PegaKVConnector\n"
    assert loaded_server_modules(code) == []
