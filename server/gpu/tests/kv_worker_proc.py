"""A stand-in vLLM GPU worker for the CUDA tests: a separate process that owns KV tensors.

Run as ``python kv_worker_proc.py ADDRESS AUTHKEY_HEX``. It allocates KV
tensors in three vLLM layouts, sends their ``DeviceRegistration``s over a
``multiprocessing.connection``, then answers requests for the bytes a stored
block must hold (computed with plain torch indexing, independent of the copy
planner) until told to exit. Needs torch with CUDA.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Client

import torch

from pegaflow.client.device import export_torch_kv

LAYERS = 4
BLOCKS = 64
BLOCK_TOKENS = 16


def make_tensors():
    g = torch.Generator(device="cuda").manual_seed(1234)

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device="cuda", generator=g)

    return {
        "kv_first": ([rand(2, BLOCKS, BLOCK_TOKENS, 2, 64) for _ in range(LAYERS)], [1] * LAYERS),
        "blocks_first": ([rand(BLOCKS, 2, BLOCK_TOKENS, 2, 64) for _ in range(LAYERS)], [0] * LAYERS),
        "cross_layer": ([rand(BLOCKS, LAYERS, 2, BLOCK_TOKENS, 2, 64)], [0]),
        "mla": ([rand(BLOCKS, BLOCK_TOKENS, 576) for _ in range(LAYERS)], [0] * LAYERS),
    }


def stored_blocks(name: str, tensors, ids: list[int]) -> bytes:
    """The stored bytes of blocks ``ids``, one after the other, by plain indexing."""
    idx = torch.tensor(ids, device="cuda", dtype=torch.long)
    if name == "kv_first":
        out = torch.stack([t.index_select(1, idx) for t in tensors])  # (L, 2, n, ...)
        out = out.movedim(2, 0)
    elif name == "cross_layer":
        out = tensors[0].index_select(0, idx)
    else:
        out = torch.stack([t.index_select(0, idx) for t in tensors]).movedim(1, 0)  # (n, L, ...)
    return out.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def main(address: str, authkey_hex: str) -> None:
    conn = Client(address, authkey=bytes.fromhex(authkey_hex))
    layouts = make_tensors()
    regs = {name: export_torch_kv(ts, dims, BLOCKS) for name, (ts, dims) in layouts.items()}
    torch.cuda.synchronize()
    conn.send(regs)
    while True:
        cmd, *args = conn.recv()
        if cmd == "blocks":
            name, ids = args
            torch.cuda.synchronize()
            conn.send(stored_blocks(name, layouts[name][0], ids))
        elif cmd == "zero":
            name, ids = args
            idx = torch.tensor(ids, device="cuda", dtype=torch.long)
            for t, dim in zip(*layouts[name], strict=True):
                t.index_fill_(dim, idx, 0)
            torch.cuda.synchronize()
            conn.send("ok")
        elif cmd == "exit":
            conn.send("bye")
            return


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
