"""Slow end-to-end run (``pytest -m slow``): the quickstart with ``actor_rollout_ref.rollout.name=jetstream`` learns
like the embedded sampler's (tests/e2e/test_runs_slow.py::test_quickstart_learns): the JetStream engine generates
every step, its weights follow each update through the weight sync, and its log-probs stay on the trainer's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.e2e.test_runs_slow import REPO, _records

pytestmark = pytest.mark.slow


def test_quickstart_with_jetstream_learns(shared, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml",
         "actor_rollout_ref.rollout.name=jetstream", f"trainer.default_local_dir={tmp_path}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rollout engine jetstream: jetstream engine" in proc.stderr  # not the embedded sampler
    steps = [r for r in _records(tmp_path / "metrics.jsonl") if r["step"] > 0 and "critic/score/mean" in r]
    assert len(steps) >= 10
    scores = np.array([r["critic/score/mean"] for r in steps])
    first, last = scores[:5].mean(), scores[-5:].mean()
    gaps = np.array([r["training/rollout_probs_diff_max"] for r in steps])
    print(f"quickstart (jetstream) critic/score/mean first5={first:.3f} last5={last:.3f}; "
          f"rollout vs trainer prob gap max {gaps.max():.1e}")
    assert last > first + 0.15, (first, last)
    # The engine samples under the weights the trainer has just updated (a stale engine would drift apart).
    assert gaps.max() < 1e-4, gaps.max()


SPLIT = ["trainer.placement=split", "trainer.rollout_devices=4", "trainer.mesh.fsdp=2", "trainer.mesh.tensor=2",
         # the quickstart's 64-row micro-batches, as rows per data-parallel device (fsdp=2)
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32"]


def test_split_placement_jetstream_run_equals_the_embedded_samplers(shared, tmp_path):
    """8 simulated devices, the engine on its own 4 (data=2 x tensor=2: slots over data, kv heads over tensor), the
    weights moved there by the weight sync every step: 4 steps give the same scores as the same run with the
    embedded sampler (same per-row random streams, so the same responses)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    runs = {}
    for name in ("jax", "jetstream"):
        out = tmp_path / name
        proc = subprocess.run(
            [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml", *SPLIT,
             f"actor_rollout_ref.rollout.name={name}", "trainer.total_training_steps=4",
             "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
             f"trainer.default_local_dir={out}"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = [r for r in _records(out / "metrics.jsonl") if r["step"] > 0]
    assert "rollout engine jetstream: jetstream engine on mesh data=2 x fsdp=1 x tensor=2" in proc.stderr
    js, ref = runs["jetstream"], runs["jax"]
    assert [r["step"] for r in js] == [1, 2, 3, 4]
    assert all(r["sync/bytes"] > 0 for r in js)
    assert max(r["training/rollout_probs_diff_max"] for r in js) < 1e-4
    print("split placement critic/score/mean jetstream", [r["critic/score/mean"] for r in js], "sampler",
          [r["critic/score/mean"] for r in ref])
    np.testing.assert_allclose([r["critic/score/mean"] for r in js], [r["critic/score/mean"] for r in ref], atol=1e-6)
    np.testing.assert_allclose([r["response_length/mean"] for r in js], [r["response_length/mean"] for r in ref])
