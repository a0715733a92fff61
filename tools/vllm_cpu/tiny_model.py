"""Build a tiny random-weight causal LM plus a byte-level BPE tokenizer, fully offline.

The output directory loads in vLLM (and transformers) like any Hugging Face checkpoint.
Nothing is downloaded: the tokenizer is trained on a synthetic in-script corpus and the
weights are drawn from a seeded generator, so the same spec gives the same model.
Shapes supported: llama and qwen3 (grouped-query attention) and deepseek_v3 (MLA).

    python -m pegaflow.tools.vllm_cpu.tiny_model OUT_DIR --arch qwen3 --layers 4
    ensure_tiny_model(cache_dir, TinyModelSpec(arch="llama"))  # builds once, then reuses

vllm-cpu constraints the defaults respect: attention head size in {32, 64, 80, 96, 112,
128, 160, 192, 224, 256, 512}; MLA needs kv_lora_rank + qk_rope_head_dim == 576.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import random
import shutil
import sys
import tempfile

SPEC_FILE = "pegaflow_tiny_model.json"
ARCHES = ("llama", "qwen3", "deepseek_v3")
# The CPU MLA backend of vllm-cpu 0.32 accepts only a 576-wide latent (512 + 64).
MLA_LATENT_WIDTH = 576
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    arch: str = "qwen3"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 4096
    max_pos: int = 4096
    dtype: str = "bfloat16"
    seed: int = 0
    # MLA (deepseek_v3) only
    kv_lora_rank: int = 512
    q_lora_rank: int = 0  # 0: no query compression (q_proj)
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64
    moe_layers: int = 0  # the last N layers are mixture-of-experts; 0: all dense
    experts: int = 4

    def validate(self) -> None:
        if self.arch not in ARCHES:
            raise ValueError(f"arch must be one of {ARCHES}, got {self.arch!r}")
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "max_pos"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.vocab < 300:
            raise ValueError("vocab must be at least 300 (256 byte tokens + specials + merges)")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.arch == "deepseek_v3":
            if self.kv_lora_rank + self.qk_rope_head_dim != MLA_LATENT_WIDTH:
                raise ValueError(
                    f"kv_lora_rank + qk_rope_head_dim must be {MLA_LATENT_WIDTH} for vllm-cpu's MLA "
                    f"backend, got {self.kv_lora_rank} + {self.qk_rope_head_dim}"
                )
            if not 0 <= self.moe_layers <= self.layers:
                raise ValueError(f"moe_layers must be in [0, layers], got {self.moe_layers}")

    def digest(self) -> str:
        """A short name for this spec: the cache directory of ensure_tiny_model."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return f"{self.arch}-{hashlib.sha256(blob).hexdigest()[:12]}"


def _synthetic_corpus(seed: int) -> list[str]:
    """Deterministic pseudo-words: enough distinct pairs for BPE to learn thousands of merges."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + list("aeiou")
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(4000)]
    sentences = [" ".join(rng.choice(words) for _ in range(20)) + "." for _ in range(4000)]
    fixed = [
        "The quick brown fox jumps over the lazy dog.",
        "A KV cache keeps the attention keys and values of earlier tokens.",
        "Hello world! 0123456789 + - * / = ( ) [ ] { } < > , . ; : ' \" ? !",
        "def main():\n    print('hello')\n    return 0\n",
    ]
    return fixed * 50 + sentences


def build_tokenizer(out_dir: pathlib.Path, vocab_size: int) -> int:
    """Train and save a byte-level BPE tokenizer; returns its length (the model's vocab)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(_SPECIAL_TOKENS),
        # every byte is a token, so any text encodes
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(0), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=_SPECIAL_TOKENS[0],
        pad_token=_SPECIAL_TOKENS[0],
        unk_token=None,
        model_max_length=1 << 20,
    )
    # a minimal chat template so /v1/chat/completions works too
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(str(out_dir))
    return len(fast)


def _hf_config(spec: TinyModelSpec, vocab: int):
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config

    common = dict(
        # the model's vocab equals the tokenizer's: every sampled id decodes to text
        vocab_size=vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_pos,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=0,  # <|endoftext|>, the first special token
        pad_token_id=0,
        torch_dtype=spec.dtype,
    )
    if spec.arch == "llama":
        return LlamaConfig(**common, head_dim=spec.head_dim, tie_word_embeddings=True)
    if spec.arch == "qwen3":
        return Qwen3Config(**common, head_dim=spec.head_dim, tie_word_embeddings=True)
    # MLA: every head reads the same latent, so kv heads == heads in the HF config.
    common["num_key_value_heads"] = spec.heads
    return DeepseekV3Config(
        **common,
        # vLLM's DeepSeek model never ties lm_head to the embedding: a tied checkpoint
        # (no lm_head.weight) would leave lm_head uninitialised there.
        tie_word_embeddings=False,
        kv_lora_rank=spec.kv_lora_rank,
        q_lora_rank=spec.q_lora_rank or None,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        v_head_dim=spec.v_head_dim,
        first_k_dense_replace=spec.layers - spec.moe_layers,
        n_routed_experts=spec.experts,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=max(spec.intermediate // 2, 1),
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        # what real DeepSeek-V3 configs carry; vLLM creates gate.e_score_correction_bias
        # (which the checkpoint holds) only for noaux_tc
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )


def build_tiny_model(out_dir: str | os.PathLike, spec: TinyModelSpec) -> pathlib.Path:
    """Write tokenizer + config + safetensors weights + the spec into out_dir (replaced whole)."""
    spec.validate()
    import torch
    from transformers import AutoModelForCausalLM

    out = pathlib.Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    # build next to the destination and rename: a half-written model is never visible
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
    try:
        vocab = build_tokenizer(staging, spec.vocab)
        config = _hf_config(spec, vocab)
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, torch_dtype=getattr(torch, spec.dtype))
        model.save_pretrained(str(staging), safe_serialization=True)
        (staging / "generation_config.json").write_text(
            json.dumps({"bos_token_id": 0, "eos_token_id": 0, "do_sample": False})
        )
        (staging / SPEC_FILE).write_text(json.dumps(dataclasses.asdict(spec), sort_keys=True, indent=1))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def read_spec(model_dir: str | os.PathLike) -> TinyModelSpec | None:
    """The spec a directory was built from, or None when it is not a complete tiny model."""
    path = pathlib.Path(model_dir) / SPEC_FILE
    try:
        return TinyModelSpec(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def ensure_tiny_model(cache_dir: str | os.PathLike, spec: TinyModelSpec | None = None) -> pathlib.Path:
    """The model for `spec` under cache_dir, built on first use and reused after."""
    spec = spec or TinyModelSpec()
    out = pathlib.Path(cache_dir) / spec.digest()
    if read_spec(out) == spec:
        return out
    return build_tiny_model(out, spec)


def _parse_args(argv: list[str] | None) -> tuple[pathlib.Path, TinyModelSpec]:
    defaults = TinyModelSpec()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=pathlib.Path)
    ap.add_argument("--arch", choices=ARCHES, default=defaults.arch)
    for field in dataclasses.fields(TinyModelSpec):
        if field.name == "arch":
            continue
        flag = "--" + field.name.replace("_", "-")
        ap.add_argument(flag, type=type(getattr(defaults, field.name)), default=getattr(defaults, field.name))
    ns = ap.parse_args(argv)
    out_dir = ns.out_dir
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(TinyModelSpec)}
    return out_dir, TinyModelSpec(**values)


def main(argv: list[str] | None = None) -> int:
    out_dir, spec = _parse_args(argv)
    try:
        spec.validate()
    except ValueError as e:
        print(f"tiny_model: {e}", file=sys.stderr)
        return 2
    path = build_tiny_model(out_dir, spec)
    print(f"wrote {path}: {spec}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
