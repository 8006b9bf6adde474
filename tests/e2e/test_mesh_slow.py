"""Slow end-to-end runs on a device mesh (``pytest -m slow``): the quickstart (real stories260K, built-in prompts,
sentiment reward) trains and learns on 8 simulated CPU devices in both placements.

- colocated: train mesh data=2 x fsdp=2 x tensor=2 on all 8 devices; the sampler on the same devices,
  tensor-parallel 2 x 4 data-parallel replicas;
- split: train mesh fsdp=2 x tensor=2 on devices 0-3; the sampler on devices 4-7 (tensor-parallel 2 x 2 replicas).

``*_micro_batch_size_per_gpu`` count rows per data-parallel device (``data x fsdp``), as in verl: each run sets
them to the quickstart's single-device micro-batch rows / its batch shards, so the micro-batches stay the same.

Each run: 15 steps at lr 3e-4 (the full quickstart uses 1e-4 and 40 steps), no validation. Asserted: the mean
``critic/score/mean`` of the last 5 steps clearly exceeds the first 5, every step logs ``sync/bytes > 0`` (weights
really moved between layouts), and the sampler's token probabilities match the trainer's recompute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

STEPS = 15
COMMON = [
    f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=false", "trainer.test_freq=-1",
    "actor_rollout_ref.actor.optim.lr=3e-4", "trainer.logger=[jsonl]",
]
PLACEMENTS = {
    "colocated": ["trainer.mesh.data=2", "trainer.mesh.fsdp=2", "trainer.mesh.tensor=2"],
    "split": ["trainer.placement=split", "trainer.rollout_devices=4", "trainer.mesh.fsdp=2", "trainer.mesh.tensor=2"],
}
BATCH_SHARDS = {"colocated": 4, "split": 2}  # data x fsdp: the data-parallel devices


def per_device(rows: dict[str, int], placement: str) -> list[str]:
    """``*_micro_batch_size_per_gpu`` overrides that keep ``rows`` (global rows per micro-batch, as on one device) on
    ``placement``'s mesh: the keys count rows per data-parallel device, as in verl."""
    return [f"{key}={n // BATCH_SHARDS[placement]}" for key, n in rows.items()]


QUICKSTART_MICRO = {  # configs/quickstart.yaml's micro-batches on one device: 2 update micro-batches of 64 rows
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 64,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 64,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 64,
}
EXPECTED_LOG = {
    "colocated": "placement colocated: train data=2 x fsdp=2 x tensor=2 on devices [0, 1, 2, 3, 4, 5, 6, 7]; "
                 "rollout data=4 x fsdp=1 x tensor=2 on devices [0, 1, 2, 3, 4, 5, 6, 7]",
    "split": "placement split: train data=1 x fsdp=2 x tensor=2 on devices [0, 1, 2, 3]; "
             "rollout data=2 x fsdp=1 x tensor=2 on devices [4, 5, 6, 7]",
}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_quickstart_learns_on_eight_devices(shared, tmp_path, placement):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    args = [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml", *COMMON,
            *PLACEMENTS[placement], *per_device(QUICKSTART_MICRO, placement), f"trainer.default_local_dir={tmp_path}"]
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert EXPECTED_LOG[placement] in proc.stderr

    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in steps if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["sync/bytes"] > 0 and r["timing_s/sync"] > 0 for r in steps)
    # The sampler (rollout layout) and the trainer's recompute (train layout) see the same weights.
    assert max(r["training/rollout_probs_diff_max"] for r in steps) < 1e-3
    scores = np.array([r["critic/score/mean"] for r in steps])
    first, last = scores[:5].mean(), scores[-5:].mean()
    print(f"{placement}: {STEPS} steps in {wall:.0f} s wall; critic/score/mean first5={first:.3f} "
          f"last5={last:.3f}; sync/bytes={steps[-1]['sync/bytes']}")
    assert last > first + 0.15, (first, last)
    assert (tmp_path / "hf_model" / "model.safetensors").exists()


TINY = [  # a small, fast run: 4 prompts x 2 responses, 12 new tokens; a high lr so the weights move a lot per step
    "data.train_batch_size=4", "data.max_response_length=12", "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.optim.lr=3e-3",
    "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=1", "trainer.logger=[jsonl]",
]


def test_resume_on_a_split_mesh_syncs_the_sampler_to_the_restored_params(shared, tmp_path):
    """Stop after step 2 (checkpointed), rerun to step 3: the restored params land on the train shardings and the
    sampler on the other devices is synced to them, so its probabilities match the trainer's recompute (a sampler
    left on the initial weights differs by ~1 at this lr)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    micro = per_device({"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,  # micro-batches of 4 rows,
                        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 8,  # log-prob calls of 8
                        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 8}, "split")
    base = [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml", *TINY, *PLACEMENTS["split"],
            *micro, f"trainer.default_local_dir={tmp_path}"]
    for steps in (2, 3):
        proc = subprocess.run([*base, f"trainer.total_training_steps={steps}"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stderr and "at step 2" in proc.stderr
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["training/rollout_probs_diff_max"] < 1e-3 for r in steps), [
        r["training/rollout_probs_diff_max"] for r in steps]
