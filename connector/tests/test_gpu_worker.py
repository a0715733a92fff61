"""The connector's CUDA path: layout detection on CPU; the registration itself on a GPU (skipped without)."""

from __future__ import annotations

import pytest
import torch

from pegaflow.connector.gpu_worker import GpuKvTransfer, GpuLayoutError, _layout_tag, block_dim_of, is_cuda_kv

NB = 10


def _views(kind: str, device: str = "cpu", layers: int = 3):
    if kind == "flash_attn":  # [2, blocks, 16, 8, 128]
        return [torch.zeros(2, NB, 16, 8, 128, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    if kind == "flashinfer":  # [blocks, 2, 16, 8, 128]
        return [torch.zeros(NB, 2, 16, 8, 128, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    if kind == "cross_layer":  # every layer a view into one [blocks, layers, 2, ...] allocation
        whole = torch.zeros(NB, layers, 2, 16, 8, 128, dtype=torch.bfloat16, device=device)
        return [whole[:, i] for i in range(layers)]
    if kind == "hnd":  # physical [blocks, 2, heads, tokens, dim] seen as [blocks, 2, tokens, heads, dim]
        return [
            torch.zeros(NB, 2, 8, 16, 128, dtype=torch.bfloat16, device=device).permute(0, 1, 3, 2, 4)
            for _ in range(layers)
        ]
    if kind == "mla":
        return [torch.zeros(NB, 16, 576, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    raise AssertionError(kind)


def _tag(kind: str) -> str:
    ts = _views(kind)
    return _layout_tag(ts, [block_dim_of(t.shape, NB) for t in ts])


def test_block_dimension_follows_vllm_layouts():
    assert block_dim_of((2, NB, 16, 8, 128), NB) == 1
    assert block_dim_of((NB, 2, 16, 8, 128), NB) == 0
    assert block_dim_of((NB, 16, 576), NB) == 0
    with pytest.raises(GpuLayoutError, match="no block dimension"):
        block_dim_of((16, 8, NB), NB)


def test_layouts_storing_the_same_bytes_share_a_tag_and_others_do_not():
    assert _tag("flash_attn") == _tag("flashinfer") == _tag("cross_layer")
    assert _tag("hnd") != _tag("flashinfer")
    assert _tag("mla") != _tag("flashinfer")
    f16 = [t.to(torch.float16) for t in _views("flashinfer")]
    assert _layout_tag(f16, [0] * len(f16)) != _tag("flashinfer")


def test_cpu_tensors_do_not_take_the_cuda_path():
    kv = {f"layer.{i}": t for i, t in enumerate(_views("flash_attn"))}
    assert not is_cuda_kv(kv)
    assert not is_cuda_kv({})
    with pytest.raises(GpuLayoutError, match="only CUDA tensors"):
        GpuKvTransfer(kv, NB, list(kv))
    with pytest.raises(GpuLayoutError, match="no KV tensor for layers"):
        GpuKvTransfer(kv, NB, ["layer.9"])


@pytest.mark.parametrize("kind", ["flash_attn", "flashinfer", "cross_layer", "mla"])
def test_the_registration_is_described_on_cpu_with_stand_in_ipc_handles(kind, monkeypatch):
    """Everything of GpuKvTransfer's set-up but the CUDA calls (IPC export, device UUID), on CPU
    tensors: a CUDA-only test let a wrong use of the registration's check (its block bytes taken as
    an object's field) ship in the CUDA path until the lent GPU ran it."""
    from pegaflow.client import device
    from pegaflow.common.wire.device_registration import CUDA_IPC_HANDLE_BYTES, ExportedTensor

    def export(t):
        storage = t.untyped_storage()
        start = t.storage_offset() * t.element_size()
        handle = storage.data_ptr().to_bytes(8, "little").ljust(CUDA_IPC_HANDLE_BYTES, b"\0")
        return ExportedTensor(ipc_handle=handle, offset=start, size=storage.nbytes() - start)

    monkeypatch.setattr(device, "export_torch_tensor", export)
    monkeypatch.setattr(device, "torch_device_uuid", lambda _device: "0" * 32)
    views = _views(kind)
    gpu = GpuKvTransfer({f"layer.{i}": t for i, t in enumerate(views)}, NB, [f"layer.{i}" for i in range(3)])
    per_layer = views[0][0].numel() * 2 if kind != "flash_attn" else 2 * views[0][0, 0].numel() * 2
    assert gpu.block_bytes == per_layer * len(views)
    assert gpu.num_layers == len(views) and gpu.registration.num_blocks == NB
    assert gpu.layout_tag == _tag(kind)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["flash_attn", "flashinfer", "cross_layer", "mla"])
def test_cuda_tensors_register_with_the_block_size_the_namespace_expects(kind):
    views = _views(kind, device="cuda")
    kv = {f"layer.{i}": t for i, t in enumerate(views)}
    assert is_cuda_kv(kv)
    gpu = GpuKvTransfer(kv, NB, list(kv))
    per_layer = views[0][0].numel() * 2 if kind != "flash_attn" else 2 * views[0][0, 0].numel() * 2
    assert gpu.block_bytes == per_layer * len(views)
    reg = gpu.registration
    assert len(reg.tensors) == len(views) and reg.num_blocks == NB
    if kind == "cross_layer":  # all layers in one cudaMalloc block: one IPC handle
        assert len({t.ipc_handle for t in reg.tensors}) == 1
