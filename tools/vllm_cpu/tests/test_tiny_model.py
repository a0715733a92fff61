"""The offline tiny-model builder: deterministic, reusable, valid for vLLM's CPU backends."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pegaflow.tools.vllm_cpu.tiny_model import (
    SPEC_FILE,
    TinyModelSpec,
    build_tiny_model,
    ensure_tiny_model,
    read_spec,
)

pytestmark = pytest.mark.timeout(300)


def test_same_spec_same_bytes_and_reused(tmp_path):
    spec = TinyModelSpec(arch="llama", layers=2, hidden=128, heads=2, kv_heads=1, intermediate=256, vocab=512)
    a = build_tiny_model(tmp_path / "a", spec)
    b = build_tiny_model(tmp_path / "b", spec)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert read_spec(a) == spec
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["vocab_size"] <= 512 and cfg["num_key_value_heads"] == 1
    cached = ensure_tiny_model(tmp_path / "cache", spec)
    mtime = (cached / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path / "cache", spec) == cached
    assert (cached / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    other = ensure_tiny_model(
        tmp_path / "cache",
        TinyModelSpec(
            arch="llama", layers=2, hidden=128, heads=2, kv_heads=1, intermediate=256, vocab=512, seed=1
        ),
    )
    assert other != cached
    assert (other / "model.safetensors").read_bytes() != (cached / "model.safetensors").read_bytes()


def test_mla_shape(tmp_path):
    path = build_tiny_model(tmp_path / "ds", TinyModelSpec(arch="deepseek_v3", layers=2, vocab=512))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576
    assert cfg["tie_word_embeddings"] is False


def test_a_half_built_directory_is_not_taken_for_a_model(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / SPEC_FILE).write_text("{not json")
    assert read_spec(tmp_path / "broken") is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(arch="gpt2"), "arch"),
        (dict(heads=4, kv_heads=3), "multiple"),
        (dict(arch="deepseek_v3", kv_lora_rank=256), "576"),
        (dict(layers=0), "positive"),
        (dict(vocab=100), "vocab"),
    ],
)
def test_bad_specs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TinyModelSpec(**kwargs).validate()


def test_command_line(tmp_path):
    out = tmp_path / "cli-model"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pegaflow.tools.vllm_cpu.tiny_model",
            str(out),
            "--arch",
            "qwen3",
            "--layers",
            "1",
            "--hidden",
            "128",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--vocab",
            "400",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_spec(out) == TinyModelSpec(arch="qwen3", layers=1, hidden=128, heads=2, kv_heads=1, vocab=400)
    bad = subprocess.run(
        [sys.executable, "-m", "pegaflow.tools.vllm_cpu.tiny_model", str(tmp_path / "x"), "--kv-heads", "3"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert bad.returncode == 2 and "kv_heads" in bad.stderr
