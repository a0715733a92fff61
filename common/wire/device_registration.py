"""What a GPU worker hands the server so the server can copy its KV blocks itself (RegisterDeviceMemory).

Both ends need these: the worker builds a ``DeviceRegistration`` from its torch tensors
(``pegaflow.client.device.export_torch_kv``) and the client puts its fields on the wire
(``client.device.registration_request``); the server rebuilds it from the request
(``server/gpu/registration.py``), checks it and opens it. Pure Python and numpy, no CUDA, no
torch: both ends import it on any machine.

A stored block is the concatenation, in a fixed order, of *segments*. A segment is one
contiguous run of bytes per block inside one of the worker's KV tensors: block ``b``'s bytes of
segment ``s`` start at ``tensor_addr[s.tensor] + s.offset + b * s.stride`` and are ``s.nbytes``
long. Every vLLM GPU layout is a list of segments (see ``segments_from_strides``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

CUDA_IPC_HANDLE_BYTES = 64  # a raw cudaIpcMemHandle_t
# Limits that keep a registration's planning arrays and RPC message small and sane.
MAX_TENSORS = 4096
MAX_SEGMENTS = 16384
MAX_UUID_CHARS = 64
# torch's shareable-handle header: a version byte, then a type byte ('c' = cudaMalloc block).
_TORCH_TYPE_CUDA_MALLOC = ord("c")
_TORCH_TYPE_EXPANDABLE = ord("e")


class LayoutError(ValueError):
    """A KV tensor layout the copy planner cannot describe or that does not fit its tensors."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """One contiguous run of bytes per block inside one KV tensor."""

    tensor: int  # index into the registration's tensor list
    offset: int  # bytes from the tensor's start to block 0's bytes of this segment
    stride: int  # bytes between the same segment of consecutive blocks
    nbytes: int  # contiguous bytes per block


@dataclasses.dataclass(frozen=True)
class ExportedTensor:
    """One KV tensor: the cudaMalloc block that holds it and where in that block it starts."""

    ipc_handle: bytes  # raw cudaIpcMemHandle (64 bytes)
    offset: int  # bytes from the block's base to the tensor's first byte
    size: int  # bytes usable from the tensor's first byte (to the end of its storage)


@dataclasses.dataclass(frozen=True)
class DeviceRegistration:
    """All KV tensors of one worker rank on one GPU, and how a block spreads over them."""

    device_uuid: str
    tensors: tuple[ExportedTensor, ...]
    segments: tuple[Segment, ...]
    num_blocks: int

    def validate(self) -> int:
        """Checks the description; returns the stored block's bytes. Raises ValueError (LayoutError
        for a layout that does not fit its tensors) on anything malformed."""
        if not self.tensors or len(self.tensors) > MAX_TENSORS:
            raise ValueError(f"a registration needs 1..{MAX_TENSORS} tensors, got {len(self.tensors)}")
        if len(self.segments) > MAX_SEGMENTS:
            raise ValueError(
                f"a registration may have at most {MAX_SEGMENTS} segments, got {len(self.segments)}"
            )
        for i, t in enumerate(self.tensors):
            if len(t.ipc_handle) != CUDA_IPC_HANDLE_BYTES:
                raise ValueError(f"tensor {i}: an IPC handle has {CUDA_IPC_HANDLE_BYTES} bytes")
            if t.offset < 0 or t.size <= 0:
                raise ValueError(f"tensor {i}: offset must be >= 0 and size > 0")
        return check_segments(self.segments, [t.size for t in self.tensors], self.num_blocks)


def check_segments(segments: Sequence[Segment], tensor_sizes: Sequence[int], num_blocks: int) -> int:
    """Every segment of every block inside its tensor, blocks not overlapping; returns the block's bytes."""
    if not segments:
        raise LayoutError("a layout needs at least one segment")
    if num_blocks <= 0:
        raise LayoutError(f"num_blocks must be positive, got {num_blocks}")
    block_bytes = 0
    for i, seg in enumerate(segments):
        if not 0 <= seg.tensor < len(tensor_sizes):
            raise LayoutError(f"segment {i} names tensor {seg.tensor}; there are {len(tensor_sizes)}")
        if seg.nbytes <= 0 or seg.offset < 0 or seg.stride < 0:
            raise LayoutError(f"segment {i} has a negative offset/stride or no bytes: {seg}")
        if num_blocks > 1 and seg.stride < seg.nbytes:
            raise LayoutError(f"segment {i}: stride {seg.stride} < {seg.nbytes} bytes, blocks would overlap")
        end = seg.offset + (num_blocks - 1) * seg.stride + seg.nbytes
        if end > tensor_sizes[seg.tensor]:
            raise LayoutError(
                f"segment {i} reaches byte {end} of tensor {seg.tensor}, "
                f"which has {tensor_sizes[seg.tensor]} bytes"
            )
        block_bytes += seg.nbytes
    return block_bytes


def segments_from_strides(
    tensor: int, shape: Sequence[int], strides: Sequence[int], itemsize: int, block_dim: int
) -> list[Segment]:
    """The segments of one strided tensor whose dimension ``block_dim`` indexes KV blocks.

    ``strides`` are in elements (as torch reports them). Dimensions with a larger
    stride than the block dimension (e.g. the K/V dimension of ``[2, blocks, ...]``)
    become separate segments, in index order; the remaining dimensions must cover
    one dense byte range per block (any physical order: the bytes are opaque).

    * per-layer tensors with K and V separate, ``[2, num_blocks, ...]`` per layer:
      two segments per layer (K at offset 0, V at offset ``num_blocks * stride``);
    * per-layer blocks-first, ``[num_blocks, 2, ...]``: one segment per layer;
    * cross-layer blocks, ``[num_blocks, num_layers, 2, ...]``: one segment;
    * MLA, ``[num_blocks, block_size, latent]`` per layer: one segment per layer.

    The first three all store "layer-major, K before V" and so produce identical stored bytes
    for the same model; a namespace is free to share them.
    """
    shape = [int(s) for s in shape]
    strides = [int(s) for s in strides]
    if len(shape) != len(strides) or not shape:
        raise LayoutError(f"shape {shape} and strides {strides} do not describe a tensor")
    if not 0 <= block_dim < len(shape):
        raise LayoutError(f"block dimension {block_dim} is outside a {len(shape)}-d tensor")
    if itemsize <= 0:
        raise LayoutError(f"itemsize must be positive, got {itemsize}")
    if any(s <= 0 for s in shape):
        raise LayoutError(f"every dimension must be non-empty, got shape {shape}")
    if any(st < 0 for st in strides):
        raise LayoutError(f"negative strides are not supported: {strides}")
    block_stride = strides[block_dim]
    outer = [d for d in range(len(shape)) if d != block_dim and shape[d] > 1 and strides[d] > block_stride]
    inner = [d for d in range(len(shape)) if d != block_dim and shape[d] > 1 and strides[d] <= block_stride]
    # The inner dimensions, innermost first, must tile one dense range per block.
    expected = 1
    for d in sorted(inner, key=lambda d: strides[d]):
        if strides[d] != expected:
            raise LayoutError(
                f"tensor {tensor}: the bytes of one block are not contiguous "
                f"(shape {shape}, strides {strides})"
            )
        expected *= shape[d]
    piece_elems = expected
    if shape[block_dim] > 1 and block_stride < piece_elems:
        raise LayoutError(f"tensor {tensor}: blocks overlap (shape {shape}, strides {strides})")
    offsets = np.zeros(1, dtype=np.int64)
    for d in outer:
        offsets = (offsets[:, None] + np.arange(shape[d], dtype=np.int64)[None, :] * strides[d]).reshape(-1)
    return [
        Segment(
            tensor=tensor,
            offset=int(o) * itemsize,
            stride=block_stride * itemsize,
            nbytes=piece_elems * itemsize,
        )
        for o in offsets
    ]


def normalize_uuid(value: str | bytes | list[int]) -> str:
    """A GPU UUID as the wire spells it, 32 lowercase hex digits, whatever the source's spelling.

    torch prints ``"GPU-xxxxxxxx-xxxx-..."`` or plain dashed hex, CUDA's
    device properties give 16 raw bytes, nvidia-smi prints ``GPU-...``.
    """
    if isinstance(value, list | tuple):  # some bindings hand back the 16 bytes as ints
        value = bytes(b & 0xFF for b in value)
    if isinstance(value, bytes | bytearray):
        if len(value) != 16:
            raise ValueError(f"a raw GPU UUID has 16 bytes, got {len(value)}")
        return bytes(value).hex()
    text = value.strip().lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    digits = text.replace("-", "")
    if len(digits) != 32 or any(c not in "0123456789abcdef" for c in digits):
        raise ValueError(f"not a GPU UUID: {value!r}")
    return digits


def raw_ipc_handle(torch_handle: bytes) -> bytes:
    """The raw 64-byte cudaIpcMemHandle inside the handle torch's ``storage._share_cuda_()`` returns.

    torch <= 2.0 returned the raw handle; later versions prefix a version byte and a type byte.
    Tensors from torch's expandable segments carry a different kind of handle, which the server
    cannot open (ValueError).
    """
    handle = bytes(torch_handle)
    if len(handle) == CUDA_IPC_HANDLE_BYTES:
        return handle
    if len(handle) == CUDA_IPC_HANDLE_BYTES + 2 and handle[1] == _TORCH_TYPE_CUDA_MALLOC:
        return handle[2:]
    if len(handle) >= 2 and handle[1] == _TORCH_TYPE_EXPANDABLE:
        raise ValueError(
            "KV tensors allocated with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cannot be "
            "shared with pegaflow-server; run the worker with expandable_segments:False"
        )
    raise ValueError(f"unrecognised CUDA IPC handle ({len(handle)} bytes)")
