"""The batched block-copy kernel: one launch moves every byte of a batch of blocks.

The launch gets the registration's item table (device memory, built once, see
``copy_plan.ItemTable``) and the request's block ids and host offsets (one
small upload). Thread blocks walk the ``blocks x items`` work list (thread
block ``w`` takes items ``w, w + grid, ...``), compute both addresses of their
piece and move it with 16-byte vectors, ``unroll`` loads in flight per thread
before the stores, so many reads are outstanding -- what keeps the host link
busy when one side is pinned host memory reached over PCIe (UVA). Pieces that
are not 16-byte aligned fall back to byte copies (correct, slow; vLLM's bf16
layouts and the pool's 256-byte slots are aligned).

The same kernel gathers into and scatters out of device staging slots in the
staged mode (host_base = the slot, host offsets = places in the slot).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from pegaflow.server.gpu import cuda_runtime

KERNEL_NAME = "pf_block_copy"

KERNEL_SOURCE = r"""
typedef unsigned long long u64;

#ifndef PF_UNROLL
#define PF_UNROLL 4
#endif
// 0: plain loads; 1: read-only path (ld.global.nc); 2: nc + 256-byte L2 prefetch hint.
#ifndef PF_LOAD_MODE
#define PF_LOAD_MODE 0
#endif
// 0: plain stores; 1: streaming stores (st.global.cs), the line is not kept in cache.
#ifndef PF_STORE_MODE
#define PF_STORE_MODE 0
#endif

__device__ __forceinline__ int4 pf_load(const int4* p) {
#if PF_LOAD_MODE == 2
    int4 v;
    asm("ld.global.nc.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#elif PF_LOAD_MODE == 1
    return __ldg(p);
#else
    return *p;
#endif
}

__device__ __forceinline__ void pf_store(int4* p, const int4& v) {
#if PF_STORE_MODE == 1
    __stcs(p, v);
#else
    *p = v;
#endif
}

__device__ __forceinline__ void pf_copy_piece(u64 src, u64 dst, u64 len) {
    if (((src | dst | len) & 15ull) == 0) {
        const int4* __restrict__ s = reinterpret_cast<const int4*>(src);
        int4* __restrict__ d = reinterpret_cast<int4*>(dst);
        const u64 n16 = len >> 4;
        const u64 tpb = blockDim.x;
        u64 i = threadIdx.x;
        for (; i + (PF_UNROLL - 1) * tpb < n16; i += PF_UNROLL * tpb) {
            int4 v[PF_UNROLL];
#pragma unroll
            for (int u = 0; u < PF_UNROLL; ++u) v[u] = pf_load(s + i + u * tpb);
#pragma unroll
            for (int u = 0; u < PF_UNROLL; ++u) pf_store(d + i + u * tpb, v[u]);
        }
        for (; i < n16; i += tpb) pf_store(d + i, pf_load(s + i));
    } else {
        const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
        unsigned char* d = reinterpret_cast<unsigned char*>(dst);
        for (u64 i = threadIdx.x; i < len; i += blockDim.x) d[i] = s[i];
    }
}

// items_addr: (4, items) u64 = device base, block stride, offset in the stored block, bytes.
// ids_addr / offs_addr: n u64 block ids and byte offsets from host_base.
extern "C" __global__ void pf_block_copy(u64 items_addr, unsigned int items, u64 ids_addr, u64 offs_addr,
                                         u64 host_base, unsigned int n, int to_host) {
    const u64* __restrict__ it = reinterpret_cast<const u64*>(items_addr);
    const u64* __restrict__ ids = reinterpret_cast<const u64*>(ids_addr);
    const u64* __restrict__ offs = reinterpret_cast<const u64*>(offs_addr);
    const u64 total = (u64)n * items;
    for (u64 w = blockIdx.x; w < total; w += gridDim.x) {
        const u64 b = w / items;
        const u64 j = w - b * items;
        const u64 dev = it[j] + ids[b] * it[items + j];
        const u64 host = host_base + offs[b] + it[2ull * items + j];
        const u64 len = it[3ull * items + j];
        if (to_host) {
            pf_copy_piece(dev, host, len);
        } else {
            pf_copy_piece(host, dev, len);
        }
    }
}
"""

# A grid this large is walked by fewer thread blocks (grid-stride), never launched as is.
MAX_GRID = 1 << 20


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the copy kernel; the defaults are the ones measured best on an H200."""

    threads: int = 256
    unroll: int = 4
    load_mode: int = 0
    store_mode: int = 0
    # Grid = min(pieces, ctas_per_sm * multiprocessors); 0 = one thread block per piece.
    ctas_per_sm: int = 0

    def options(self) -> tuple[str, ...]:
        return (
            "-std=c++17",
            f"-DPF_UNROLL={self.unroll}",
            f"-DPF_LOAD_MODE={self.load_mode}",
            f"-DPF_STORE_MODE={self.store_mode}",
        )


class BatchedCopyKernel:
    """The compiled kernel for one configuration; compiled per device on first launch (NVRTC)."""

    def __init__(self, config: KernelConfig | None = None):
        self.config = config or KernelConfig()
        if self.config.threads % 32 or not 32 <= self.config.threads <= 1024:
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {self.config.threads}")
        if self.config.unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {self.config.unroll}")
        self._lock = threading.Lock()
        self._kernel = None
        self._functions: dict[int, object] = {}  # device -> compiled Function
        self._sm_count: dict[int, int] = {}

    def _raw_kernel(self):
        with self._lock:
            if self._kernel is None:
                cupy = cuda_runtime.cupy_module()
                self._kernel = cupy.RawKernel(KERNEL_SOURCE, KERNEL_NAME, options=self.config.options())
            return self._kernel

    def grid(self, work: int, device: int) -> int:
        if self.config.ctas_per_sm <= 0:
            return max(1, min(work, MAX_GRID))
        if device not in self._sm_count:
            props = cuda_runtime.runtime().getDeviceProperties(device)
            self._sm_count[device] = int(props["multiProcessorCount"])
        return max(1, min(work, self.config.ctas_per_sm * self._sm_count[device]))

    def compile(self, device: int):
        """Compiles and loads the kernel for ``device`` now (so the first request does not pay
        NVRTC's time); returns its compiled Function (``.ptr`` is the CUfunction)."""
        with self._lock:
            fn = self._functions.get(device)
        if fn is not None:
            return fn
        cupy = cuda_runtime.cupy_module()
        kernel = self._raw_kernel()
        with self._lock, cupy.cuda.Device(device):  # both lanes of a GPU compile at start-up
            fn = self._functions.get(device)
            if fn is None:
                kernel.compile()
                fn = self._functions[device] = kernel.kernel
        return fn

    def launch(
        self,
        calls,
        stream: int,
        device: int,
        items_ptr: int,
        items: int,
        ids_ptr: int,
        offs_ptr: int,
        host_base: int,
        blocks: int,
        to_host: bool,
    ) -> None:
        """Enqueues one launch moving ``blocks`` blocks on ``stream`` (a CUstream of ``device``).

        ``calls`` is a ``cuda_runtime.StreamCalls`` (or its CuPy fallback). The caller has made
        ``device`` current on this thread. ``ids_ptr`` and ``offs_ptr`` point at ``blocks``
        uint64 each in device memory.
        """
        if blocks <= 0 or items <= 0:
            return
        if blocks >= 1 << 32 or items >= 1 << 32:
            raise ValueError(f"{blocks} blocks x {items} items is more than one launch indexes")
        fn = self._functions.get(device)
        if fn is None:
            fn = self.compile(device)
        calls.launch(
            fn,
            self.grid(blocks * items, device),
            self.config.threads,
            stream,
            (
                np.uint64(items_ptr),
                np.uint32(items),
                np.uint64(ids_ptr),
                np.uint64(offs_ptr),
                np.uint64(host_base),
                np.uint32(blocks),
                np.int32(1 if to_host else 0),
            ),
        )
