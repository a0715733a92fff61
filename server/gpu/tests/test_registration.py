"""CPU checks of the GPU path's wire description, handle parsing and UUID spelling.

These also prove that every GPU module imports on a machine without CUDA.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from pegaflow.server.gpu import cuda_runtime
from pegaflow.server.gpu.copy_plan import LayoutError, Segment
from pegaflow.server.gpu.ipc import IpcError, cuda_ipc_handle_from_torch
from pegaflow.server.gpu.registration import DeviceRegistration, ExportedTensor, layout_of

RAW = bytes(range(64))


@pytest.mark.parametrize(
    "module",
    [
        "copy_plan",
        "cuda_runtime",
        "kernels",
        "ipc",
        "registration",
        "device_copier",
        "service",
        "rpc",
    ],
)
def test_every_gpu_module_imports_without_touching_cuda(module):
    importlib.import_module(f"pegaflow.server.gpu.{module}")


def test_importing_the_gpu_path_loads_neither_cupy_nor_torch():
    modules = "copy_plan cuda_runtime kernels ipc registration device_copier service rpc".split()
    code = (
        "import json, sys\n"
        + "".join(f"import pegaflow.server.gpu.{m}\n" for m in modules)
        + "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'torch'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout) == []


def test_available_answers_without_raising():
    assert isinstance(cuda_runtime.available(), bool)


def test_disable_switch_turns_the_gpu_path_off(monkeypatch):
    monkeypatch.setenv(cuda_runtime.ENV_DISABLE, "1")
    cuda_runtime._load.cache_clear()
    try:
        assert cuda_runtime.available() is False
        with pytest.raises(cuda_runtime.CudaUnavailable, match="disabled"):
            cuda_runtime.runtime()
    finally:
        monkeypatch.delenv(cuda_runtime.ENV_DISABLE)
        cuda_runtime._load.cache_clear()


@pytest.mark.parametrize(
    "spelling",
    [
        "GPU-00112233-4455-6677-8899-aabbccddeeff",
        "00112233-4455-6677-8899-AABBCCDDEEFF",
        "00112233445566778899aabbccddeeff",
        bytes.fromhex("00112233445566778899aabbccddeeff"),
    ],
)
def test_uuid_spellings_agree(spelling):
    assert cuda_runtime.normalize_uuid(spelling) == "00112233445566778899aabbccddeeff"


@pytest.mark.parametrize("bad", ["GPU-1234", "zz112233445566778899aabbccddeeff", b"\x00" * 15])
def test_bad_uuids_are_refused(bad):
    with pytest.raises(ValueError):
        cuda_runtime.normalize_uuid(bad)


def test_torch_handle_formats():
    assert cuda_ipc_handle_from_torch(RAW) == RAW  # torch <= 2.0: the raw handle
    assert cuda_ipc_handle_from_torch(b"\x02c" + RAW) == RAW  # versioned, cudaMalloc block
    assert cuda_ipc_handle_from_torch(b"\x03c" + RAW) == RAW
    with pytest.raises(IpcError, match="expandable_segments"):
        cuda_ipc_handle_from_torch(b"\x02e" + b"\x00" * 40)
    with pytest.raises(IpcError, match="unrecognised"):
        cuda_ipc_handle_from_torch(b"\x02x" + RAW)


def _reg(**over):
    fields = dict(
        device_uuid="00112233445566778899aabbccddeeff",
        tensors=(ExportedTensor(RAW, 0, 64 * 100),),
        segments=(Segment(0, 0, 64, 64),),
        num_blocks=100,
    )
    fields.update(over)
    return DeviceRegistration(**fields)


def test_valid_registration_gives_its_layout():
    assert _reg().validate() == 64
    layout = layout_of(_reg())
    assert layout.block_bytes == 64 and layout.num_blocks == 100


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(tensors=()), ValueError, "1..4096 tensors"),
        (dict(tensors=(ExportedTensor(RAW[:10], 0, 6400),)), ValueError, "64 bytes"),
        (dict(tensors=(ExportedTensor(RAW, -1, 6400),)), ValueError, "offset"),
        (dict(num_blocks=101), LayoutError, "reaches byte"),
        (dict(segments=(Segment(2, 0, 64, 64),)), LayoutError, "names tensor 2"),
    ],
)
def test_malformed_registrations_are_refused(over, exc, match):
    with pytest.raises(exc, match=match):
        layout_of(_reg(**over))
