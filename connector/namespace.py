"""What makes KV bytes of two engines interchangeable: the KvLayout each rank registers.

vLLM's block hashes cover token ids (plus LoRA / multimodal / cache-salt keys) but not
the model, so the namespace the server derives from this layout must: model identity
(name or path, plus a fingerprint of its config), KV dtype, the byte layout of a page
(device, attention kind, kernel ISA, vLLM's cache layout), tokens per block, bytes per
block, and the TP size and rank. An MLA latent is identical on every TP rank, so MLA
layouts set `mla` and the server leaves the rank out (it keeps the TP size: the bytes
depend on it): the group stores each block once, each block written by one rank and read
by every rank (mla.py). With `mla_store="per_rank"` an MLA model is stored like any
other, one copy per rank.

Both connector roles build the same layouts from the same configs: the scheduler (which
has no KV tensors) queries with them and each worker registers and checks its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from pegaflow.connector.mla import STORE_ONCE, parse_store_mode

# hf config keys that name a file or a library version, not the model's shape
_VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash", "name_or_path"})


@dataclasses.dataclass(frozen=True)
class KvLayoutSpec:
    """The fields of pegaflow's KvLayout (proto/pegaflow.proto), built from vLLM's config."""

    model_id: str
    model_fingerprint: str
    dtype: str
    layout: str
    block_tokens: int
    block_bytes: int
    num_layers: int
    tp_size: int
    tp_rank: int
    mla: bool
    extra: str = ""

    @property
    def page_bytes(self) -> int:
        return self.block_bytes // self.num_layers

    def to_client(self):
        """The client's KvLayout with the same fields."""
        from pegaflow.client import KvLayout

        return KvLayout(**dataclasses.asdict(self))

    def describe(self) -> str:
        who = "all ranks" if self.mla else f"rank {self.tp_rank}/{self.tp_size}"
        return (
            f"{self.model_id} [{self.model_fingerprint[:12]}] {self.dtype} {self.layout} "
            f"{self.block_tokens} tok x {self.num_layers} layers = {self.block_bytes} B/block, {who}"
        )


class UnsupportedLayout(Exception):
    """The engine's KV cache is one the connector cannot store: it runs without a cache."""


def dtype_name(dtype: Any) -> str:
    """torch.bfloat16 -> "bfloat16"; strings pass through."""
    text = str(dtype)
    return text[len("torch.") :] if text.startswith("torch.") else text


def model_fingerprint(model_config: Any) -> str:
    """sha256 of what shapes the model's KV: its HF config (minus file names and library
    versions), revision, quantization and served dtype."""
    hf_config = model_config.hf_config
    cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    cfg = {k: v for k, v in cfg.items() if k not in _VOLATILE_CONFIG_KEYS}
    payload = {
        "hf_config": cfg,
        "revision": getattr(model_config, "revision", None),
        "quantization": getattr(model_config, "quantization", None),
        "dtype": dtype_name(getattr(model_config, "dtype", "")),
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def model_identity(model_config: Any, override: str | None) -> str:
    """The configured model_id, else the served model: a local path is made absolute and
    resolved (two spellings of one directory are one model), a hub name is kept as is."""
    if override:
        return override
    model = str(model_config.model)
    if os.path.isdir(model):
        return os.path.realpath(model)
    return model


def _cpu_attention_isa(spec: Any, cache_dtype: str) -> str:
    """The CPU attention kernel vLLM picks for this spec: it decides the byte order inside
    a page (K is stored transposed by the vec kernels, differently by AMX)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(spec.dtype, spec.block_size, spec.head_size, cache_dtype)


def layout_tag(vllm_config: Any, kv_cache_config: Any, spec: Any) -> str:
    """Opaque tag for the byte layout of one page, e.g. "cpu:attn:vec:LBHNC:auto"."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    device = current_platform.device_type
    kind = "mla" if isinstance(spec, MLAAttentionSpec) else "attn"
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if device == "cpu" and kind == "attn":
        isa = _cpu_attention_isa(spec, cache_dtype)
    else:
        isa = "-"
    # resolved once by the engine core and handed to every worker; the same on both roles
    cache_layout = (
        getattr(kv_cache_config, "kv_cache_layout", None)
        or getattr(vllm_config.cache_config, "kv_cache_layout", None)
        or "-"
    )
    cache_layout = getattr(cache_layout, "name", cache_layout)
    return f"{device}:{kind}:{isa}:{cache_layout}:{cache_dtype}"


def single_group_spec(vllm_config: Any, kv_cache_config: Any) -> Any:
    """The one attention KV cache group's spec; raises UnsupportedLayout for anything else
    (hybrid models, pipeline or context parallelism, sharded or compressed states)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise UnsupportedLayout("pipeline parallelism (each stage holds different layers)")
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        raise UnsupportedLayout("decode context parallelism (tokens sharded across ranks)")
    if getattr(parallel, "prefill_context_parallel_size", 1) > 1:
        raise UnsupportedLayout("prefill context parallelism (tokens sharded across ranks)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedLayout(f"{len(groups)} KV cache groups (one block id must mean one block)")
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, AttentionSpec):
        raise UnsupportedLayout(f"KV cache spec {type(spec).__name__} is not attention")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise UnsupportedLayout("compressed or pooled KV states")
    hash_block = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block not in (None, spec.block_size):
        raise UnsupportedLayout(f"hash block size {hash_block} != KV block size {spec.block_size}")
    if not groups[0].layer_names:
        raise UnsupportedLayout("the KV cache group has no layers")
    return spec


def build_layouts(
    vllm_config: Any, kv_cache_config: Any, model_id: str | None, salt: str, mla_store: str = STORE_ONCE
) -> list[KvLayoutSpec]:
    """One layout per TP rank (MLA stored once: one for the whole group, registered with
    rank 0's number). Index i is rank i's layout, except a shared one, which serves every
    rank."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = single_group_spec(vllm_config, kv_cache_config)
    group = kv_cache_config.kv_cache_groups[0]
    num_layers = len(group.layer_names)
    mla = isinstance(spec, MLAAttentionSpec) and parse_store_mode(mla_store) == STORE_ONCE
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    base = dict(
        model_id=model_identity(vllm_config.model_config, model_id),
        model_fingerprint=model_fingerprint(vllm_config.model_config),
        dtype=dtype_name(spec.dtype),
        layout=layout_tag(vllm_config, kv_cache_config, spec),
        block_tokens=spec.block_size,
        block_bytes=spec.page_size_bytes * num_layers,
        num_layers=num_layers,
        tp_size=tp_size,
        mla=mla,
        extra=_extra(vllm_config, salt),
    )
    if mla:
        return [KvLayoutSpec(tp_rank=0, **base)]
    return [KvLayoutSpec(tp_rank=rank, **base) for rank in range(tp_size)]


def layout_for_rank(layouts: list[KvLayoutSpec], tp_rank: int) -> KvLayoutSpec:
    """The layout a worker of this rank registers (MLA: the shared one, with its own rank)."""
    if layouts[0].mla:
        return dataclasses.replace(layouts[0], tp_rank=tp_rank)
    return layouts[tp_rank]


def _extra(vllm_config: Any, salt: str) -> str:
    """Namespace salt: the block-hash algorithm (hashes from another algorithm never
    match, but must not collide either) plus the user's salt."""
    algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "") or ""
    parts = [f"hash={algo}"]
    if salt:
        parts.append(f"salt={salt}")
    return ";".join(parts)
