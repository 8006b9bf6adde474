"""The command line of the vLLM training runs (imports no vLLM): the quickstart on the tiny Qwen2 of
``conftest.tiny_model_dir`` with vLLM as the rollout engine, 4 prompts x n=2, 8-token responses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# vLLM's engine core inside the process that owns the engine; 1 GiB of KV cache (CPU)
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def tiny_run_args(model_dir: Path, out_dir: Path) -> list[str]:
    """``jaxrl.train`` arguments (after ``-m jaxrl.train``) of a vLLM run of the tiny model into ``out_dir``."""
    return [
        "--config", "configs/quickstart.yaml",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "data.train_batch_size=4", "data.max_response_length=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=['jsonl']",
        f"trainer.default_local_dir={out_dir}",
    ]


def run_tiny(model_dir: Path, out_dir: Path, *extra: str, devices: int = 1) -> subprocess.CompletedProcess:
    """``python -m jaxrl.train`` of :func:`tiny_run_args` plus ``extra`` on ``devices`` CPU devices (output
    captured)."""
    env = dict(os.environ, **VLLM_ENV, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    cmd = [sys.executable, "-m", "jaxrl.train", *tiny_run_args(model_dir, out_dir), *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def metric_rows(out_dir: Path) -> list[dict]:
    """The run's ``metrics.jsonl`` rows."""
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
