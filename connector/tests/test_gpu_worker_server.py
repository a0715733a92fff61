"""The connector's CUDA path end to end: WorkerConnector with KV tensors on a GPU, driven in
vLLM's hook order, against a real pegaflow-server process that copies through CUDA IPC.

vLLM cannot be installed on the GPU host we have, so the engine around the worker is the
test (as in test_worker_server.py for host KV); everything below the worker is real: the
client, the gRPC/doorbell transport, the server's registration, copier and pool. Skipped
without a CUDA GPU (and CuPy, which the server's GPU path uses).
"""

from __future__ import annotations

import hashlib

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
from pegaflow.server.gpu import cuda_runtime  # noqa: E402

if not cuda_runtime.available():
    pytest.skip("the server's GPU path needs CuPy", allow_module_level=True)


def _provide_vllm_marker_classes() -> None:
    """The worker needs two things from vLLM: the two empty marker base classes metadata.py
    derives from, and the connector-stats base classes stats.py derives from (a dataclass holding
    ``data``, a Prometheus base the worker never instantiates). vLLM cannot be installed on our GPU
    host, so there (only) they are defined here, shaped like vLLM's; every line of the worker and
    below is the real one."""
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
        import vllm.distributed.kv_transfer.kv_connector.v1.metrics  # noqa: F401
    except ImportError:
        import dataclasses
        import sys
        import types
        import typing

        def module(name: str) -> types.ModuleType:
            parts = name.split(".")
            for i in range(1, len(parts)):
                sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
            sys.modules[name] = types.ModuleType(name)
            return sys.modules[name]

        base = module("vllm.distributed.kv_transfer.kv_connector.v1.base")
        base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})
        base.KVConnectorHandshakeMetadata = type("KVConnectorHandshakeMetadata", (), {})
        metrics = module("vllm.distributed.kv_transfer.kv_connector.v1.metrics")

        @dataclasses.dataclass
        class KVConnectorStats:
            data: dict = dataclasses.field(default_factory=dict)

        metrics.KVConnectorStats = KVConnectorStats
        metrics.KVConnectorPromMetrics = type("KVConnectorPromMetrics", (), {})
        metrics.PromMetric = typing.Any
        metrics.PromMetricT = typing.TypeVar("PromMetricT")
        module("vllm.v1.metrics.utils").create_metric_per_engine = lambda *a, **k: None


_provide_vllm_marker_classes()

from pegaflow.connector.metadata import BlockTransfer, PegaConnectorMetadata  # noqa: E402
from pegaflow.connector.mla import writer_rank  # noqa: E402
from pegaflow.connector.namespace import KvLayoutSpec  # noqa: E402
from pegaflow.connector.tests.support import (  # noqa: E402
    config,
    hashes,
    load_meta,
    save_and_wait,
    step,
    wait_for,
)
from pegaflow.connector.tests.test_worker_server import attached, lookup_for  # noqa: E402
from pegaflow.connector.worker import WorkerConnector  # noqa: E402
from pegaflow.server.testing import ServerProcess, free_port  # noqa: E402

pytestmark = pytest.mark.timeout(300)

NB, TOKENS, HEADS, DIM, LAYERS, LATENT = 24, 16, 2, 64, 4, 576
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def _kv(kind: str, seed: int | None) -> dict[str, torch.Tensor]:
    """KV tensors shaped and strided as vLLM's CUDA backends allocate them."""
    if kind == "flash_attn":  # [2, blocks, tokens, heads, dim] per layer: K and V apart
        ts = [torch.zeros(2, NB, TOKENS, HEADS, DIM, dtype=torch.bfloat16, device="cuda") for _ in NAMES]
    elif kind == "cross_layer":  # one [blocks, layers, 2, ...] allocation, per-layer views
        whole = torch.zeros(NB, LAYERS, 2, TOKENS, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
        ts = [whole[:, i] for i in range(LAYERS)]
    elif kind == "mla":  # [blocks, tokens, latent] per layer
        ts = [torch.zeros(NB, TOKENS, LATENT, dtype=torch.bfloat16, device="cuda") for _ in NAMES]
    else:
        raise AssertionError(kind)
    if seed is not None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        for t in ts:
            t.copy_(torch.randn(t.shape, dtype=torch.bfloat16, device="cuda", generator=g))
    torch.cuda.synchronize()
    return dict(zip(NAMES, ts, strict=True))


def _block(caches: dict[str, torch.Tensor], block_id: int) -> bytes:
    """One block's bytes as the server stores them: layer after layer, K before V."""
    out = []
    for t in caches.values():
        dim = 1 if t.shape[0] == 2 and t.shape[1] == NB else 0
        out.append(t.select(dim, block_id).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return b"".join(out)


def _layout(kind: str, model: str = "gpu-model", *, tp_size: int = 1, tp_rank: int = 0) -> KvLayoutSpec:
    mla = kind == "mla"
    per_layer = TOKENS * LATENT * 2 if mla else 2 * TOKENS * HEADS * DIM * 2
    return KvLayoutSpec(
        model_id=model,
        model_fingerprint=hashlib.sha256(model.encode()).hexdigest(),
        dtype="bfloat16",
        layout="replaced-by-the-worker",  # the CUDA path names the stored byte order itself
        block_tokens=TOKENS,
        block_bytes=per_layer * LAYERS,
        num_layers=LAYERS,
        tp_size=tp_size,
        tp_rank=tp_rank,
        mla=mla,
    )


def _worker(cfg, lay: KvLayoutSpec, caches, name: str) -> WorkerConnector:
    w = WorkerConnector(cfg, lay, num_blocks=NB, layer_names=list(NAMES), instance_name=name)
    w.register_kv_caches(caches)
    assert w.gpu is not None and w.pages is None, w.disabled_reason  # the CUDA path, not host copies
    return w


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path / "server", pool_size="128mb", extra_args=["--gpu-copy-mode", "auto"]) as srv:
        yield srv


@pytest.mark.parametrize("src_kind,dst_kind", [("flash_attn", "flash_attn"), ("flash_attn", "cross_layer")])
def test_blocks_saved_from_one_gpu_worker_load_byte_identical_into_another(server, src_kind, dst_kind):
    cfg = config(server.addr)
    src, dst = _kv(src_kind, seed=1), _kv(dst_kind, seed=None)
    a = _worker(cfg, _layout(src_kind), src, "a")
    b = _worker(cfg, _layout(dst_kind), dst, "b")
    # K/V-apart and cross-layer tensors store the same bytes: one namespace, shared blocks
    assert a.layout.layout == b.layout.layout and a.layout.layout.startswith("cuda:bfloat16:")
    link, lookup = lookup_for(cfg, a.layout)
    try:
        attached(a, b, link)
        hs = hashes(f"gpu-{src_kind}-{dst_kind}", 6)
        src_ids = [3, 4, 5, 9, 10, 11]
        save_and_wait(a, "r1", src_ids, hs)
        assert a.stats["saved_blocks"] == 6
        assert lookup(hs) == 6
        targets = [20, 21, 22, 1, 2, 0]
        _, failed = step(b, load_meta("r2", targets, hs))
        assert failed == set()
        torch.cuda.synchronize()
        for s, d in zip(src_ids, targets, strict=True):
            assert _block(dst, d) == _block(src, s)
        untouched = set(range(NB)) - set(targets)
        assert all(not any(_block(dst, i)) for i in untouched)
        # a partial hit lands the leading blocks and reports exactly the rest
        _, failed = step(b, load_meta("r3", [12, 13, 14], hs[:2] + hashes("never-stored", 1)))
        assert failed == {14}
        # a step that loads several requests (two LoadToDevice in flight): each lands its own blocks,
        # and a miss fails only its own request's rest
        several = PegaConnectorMetadata(
            loads=[
                BlockTransfer("r5", [15, 16, 17], hs[:3]),
                BlockTransfer("r6", [18, 19], hs[3:5]),
                BlockTransfer("r7", [23, 7], hs[5:] + hashes("never-stored", 1)),
            ]
        )
        _, failed = step(b, several)
        assert failed == {7}
        torch.cuda.synchronize()
        for s, d in zip(src_ids, [15, 16, 17, 18, 19, 23], strict=True):
            assert _block(dst, d) == _block(src, s)
        # the same blocks saved again are deduplicated by the server
        save_and_wait(a, "r4", [3, 4], hs[:2])
        assert a.stats["saved_blocks"] == 6 and a.stats["save_blocks_deduplicated"] == 2
    finally:
        a.shutdown(), b.shutdown(), link.close()


def test_a_save_reads_the_blocks_only_after_the_forward_that_wrote_them(server):
    """The save is queued right after a kernel still writing its blocks is launched: the
    worker's CUDA event makes the server copy what the forward wrote, not what was there."""
    cfg = config(server.addr)
    src, dst = _kv("flash_attn", seed=None), _kv("flash_attn", seed=None)
    a = _worker(cfg, _layout("flash_attn"), src, "a")
    b = _worker(cfg, _layout("flash_attn"), dst, "b")
    try:
        attached(a, b)
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):  # keep the stream busy so the fill below runs late
            big = big @ big
            big = big / big.norm()
        for t in src.values():
            t[:, 7].fill_(3.0)
        hs = hashes("ordered", 1)
        save_and_wait(a, "r1", [7], hs)
        _, failed = step(b, load_meta("r2", [8], hs))
        assert failed == set()
        torch.cuda.synchronize()
        assert all(bool((t[:, 8] == 3.0).all()) for t in dst.values())
    finally:
        a.shutdown(), b.shutdown()


def test_mla_ranks_on_gpus_store_one_copy_and_load_the_same_bytes(server):
    cfg = config(server.addr)
    caches = [_kv("mla", seed=10 + r) for r in range(2)]
    ranks = [_worker(cfg, _layout("mla", tp_size=2, tp_rank=r), caches[r], f"mla{r}") for r in range(2)]
    link, lookup = lookup_for(cfg, ranks[0].layout)
    try:
        attached(*ranks, link)
        hs = hashes("gpu-mla", 8)
        owners = [writer_rank(h, 2) for h in hs]
        assert 0 < owners.count(1) < len(owners)
        src = list(range(8))
        for r in (1, 0):
            save_and_wait(ranks[r], "m1", src, hs)
            assert ranks[r].stats["saved_blocks"] == owners.count(r)
        assert lookup(hs) == len(hs)
        dst = list(range(10, 18))
        for r in range(2):
            _, failed = step(ranks[r], load_meta("m2", dst, hs))
            assert failed == set()
        torch.cuda.synchronize()
        for r in range(2):
            for s, d, owner in zip(src, dst, owners, strict=True):
                assert _block(caches[r], d) == _block(caches[owner], s)
    finally:
        for w in ranks:
            w.shutdown()
        link.close()


def test_gpu_worker_survives_a_server_restart_and_registers_its_memory_again(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    cfg = config(addr)
    src, dst = _kv("flash_attn", seed=20), _kv("flash_attn", seed=None)
    a = _worker(cfg, _layout("flash_attn"), src, "a")
    b = _worker(cfg, _layout("flash_attn"), dst, "b")
    link, lookup = lookup_for(cfg, a.layout)
    srv = ServerProcess(
        tmp_path / "server", pool_size="128mb", addr=addr, extra_args=["--gpu-copy-mode", "auto"]
    )
    try:
        # no server yet: loads are reported failed (vLLM recomputes), saves are skipped
        _, failed = step(b, load_meta("r0", [1, 2], hashes("early", 2)))
        assert failed == {1, 2}
        srv.start()
        attached(a, b, link)
        hs = hashes("before-kill", 3)
        save_and_wait(a, "r1", [0, 1, 2], hs)
        assert lookup(hs) == 3
        srv.kill()
        wait_for(lambda: lookup(hs) is None)
        _, failed = step(b, load_meta("r2", [5, 6, 7], hs))
        assert failed == {5, 6, 7}
        srv.start()  # a new process: the IPC registrations must be made again
        attached(a, b, link)
        save_and_wait(a, "r3", [0, 1, 2], hs)
        assert lookup(hs) == 3
        _, failed = step(b, load_meta("r4", [5, 6, 7], hs))
        assert failed == set()
        torch.cuda.synchronize()
        assert [_block(dst, d) for d in (5, 6, 7)] == [_block(src, s) for s in (0, 1, 2)]
    finally:
        a.shutdown(), b.shutdown(), link.close(), srv.stop()


def test_a_server_without_a_gpu_path_leaves_the_worker_serving_without_the_cache(tmp_path):
    """--gpu-copy-mode off: registration is refused; loads turn into recompute, nothing raises."""
    cfg = config(f"127.0.0.1:{free_port()}")
    with ServerProcess(
        tmp_path / "server", pool_size="64mb", addr=cfg.server_addr, extra_args=["--gpu-copy-mode", "off"]
    ):
        caches = _kv("flash_attn", seed=30)
        a = _worker(cfg, _layout("flash_attn"), caches, "a")
        try:
            attached(a)
            for i in range(3):
                _, failed = step(a, load_meta(f"r{i}", [1, 2], hashes("p", 2)))
                assert failed == {1, 2}
                step(a, PegaConnectorMetadata(saves=[BlockTransfer(f"s{i}", [3], hashes(f"s{i}", 1))]))
            assert a.stats["saved_blocks"] == 0
        finally:
            a.shutdown()
