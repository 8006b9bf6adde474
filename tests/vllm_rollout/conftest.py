"""Fixtures of the vLLM training runs (imports nothing of vLLM: the modules that need it skip without it)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, shared) -> Path:
    """A tiny random Qwen2 (head_dim 32, vLLM's CPU minimum) with the stories260K tokenizer, as a Hugging Face
    directory."""
    from flax import nnx

    from jaxrl.models.config import ModelConfig
    from jaxrl.models.decoder import Decoder
    from jaxrl.models.hf import save_hf
    from jaxrl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(shared / "models" / "stories260K"))
    cfg = ModelConfig(
        model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, attention_bias=True, qk_norm=False,
        bos_token_id=1, eos_token_id=(2,), pad_token_id=0, max_position_embeddings=256, rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("tiny_qwen2")
    save_hf(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, out, tokenizer=tok)
    return out


@pytest.fixture(scope="session")
def colocated_vllm_run(tiny_model_dir, tmp_path_factory) -> Path:
    """2 steps of the tiny model with vLLM in the trainer's process, a checkpoint after each: the run folder (read it,
    or copy it before resuming). The reference of the hybrid vLLM test and the start of the sync-timeout test."""
    from vllm_runs import run_tiny

    out = tmp_path_factory.mktemp("colocated") / "run"
    first = run_tiny(tiny_model_dir, out, "trainer.total_training_steps=2", "trainer.save_freq=1")
    assert first.returncode == 0, first.stderr[-3000:]
    return out
