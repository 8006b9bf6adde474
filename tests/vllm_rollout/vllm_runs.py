"""The command line of the vLLM training runs (imports no vLLM): the quickstart on the tiny Qwen2 of
``conftest.tiny_model_dir`` with vLLM as the rollout engine, 4 prompts x n=2, 8-token responses."""

from __future__ import annotations

from pathlib import Path

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
