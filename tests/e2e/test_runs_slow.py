"""Slow end-to-end runs (``pytest -m slow``; run by .ci/run after the default suite).

- The quickstart (real stories260K, built-in prompts, sentiment reward) learns: the mean
  ``critic/score/mean`` of its last 5 steps clearly exceeds that of its first 5.
- GRPO on real GSM8K with the real SmolLM2-135M-Instruct GGUF runs end to end for 3 steps:
  generation, scoring, update, validation on a GSM8K test subset, metrics.jsonl written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(args, cwd=REPO, timeout=1800):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_quickstart_learns(shared, tmp_path):
    _run(["-m", "jaxrl.train", "--config", "configs/quickstart.yaml", f"trainer.default_local_dir={tmp_path}"])
    steps = [r for r in _records(tmp_path / "metrics.jsonl") if r["step"] > 0 and "critic/score/mean" in r]
    assert len(steps) >= 10
    scores = np.array([r["critic/score/mean"] for r in steps])
    first, last = scores[:5].mean(), scores[-5:].mean()
    print(f"quickstart critic/score/mean first5={first:.3f} last5={last:.3f}")
    assert last > first + 0.15, (first, last)
    assert (tmp_path / "reward.png").exists()


def test_gsm8k_smollm2_two_steps(shared, tmp_path):
    """The GSM8K config end to end (prepare, 2 steps, validation at the last one). The validation before training
    on GSM8K is covered by tests/agent/test_multiturn_slow.py (the same config with the tool loop)."""
    data = tmp_path / "gsm8k"
    _run(["-m", "jaxrl.data.prepare", "gsm8k", "--input", str(shared / "data" / "gsm8k"), "--output", str(data)])
    out = tmp_path / "run"
    _run([
        "-m", "jaxrl.train", "--config", "configs/gsm8k_grpo_smollm2_135m.yaml", "trainer.total_training_steps=2",
        "trainer.val_before_train=false", "data.val_max_samples=8",  # the config's test_freq=2: the last step
        f"data.train_files={data}/train.parquet", f"data.val_files={data}/test.parquet",
        f"trainer.default_local_dir={out}",
    ])
    records = _records(out / "metrics.jsonl")
    train = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["timing_s/gen"] > 0 and r["timing_s/update_actor"] > 0
        assert np.isfinite(r["actor/pg_loss"]) and "actor/kl_loss" in r
        # the GSM8K scorer's extra outputs, the mean over the step's 16 responses
        assert all(0 <= r[f"reward/{k}/mean"] <= 1 for k in ("acc", "format", "acc_flexible"))
        assert r["reward/format/mean"] >= r["reward/acc/mean"]  # a strict-correct answer is well formed
    val = [r for r in records if "val-core/openai/gsm8k/reward/mean@1" in r]
    assert [r["step"] for r in val] == [2]  # at the last step (trainer.test_freq)
    assert "val-aux/openai/gsm8k/format/mean@1" in val[0] and "val-aux/openai/gsm8k/acc_flexible/mean@1" in val[0]
    assert "val-core/openai/gsm8k/acc/mean@1" in val[0] and not any(k.startswith("val-core/") and "format" in k
                                                                     for k in val[0])
    assert (out / "reward.png").exists()


def test_ppo_quickstart_learns_and_critic_explains_variance(shared, tmp_path):
    _run(["-m", "jaxrl.train", "--config", "configs/ppo_quickstart.yaml", f"trainer.default_local_dir={tmp_path}"])
    steps = [r for r in _records(tmp_path / "metrics.jsonl") if r["step"] > 0]
    scores = np.array([r["critic/score/mean"] for r in steps])
    ev = np.array([r["critic/vf_explained_var"] for r in steps])
    print(f"ppo first5={scores[:5].mean():.3f} last5={scores[-5:].mean():.3f} ev first={ev[0]:.3f} max={ev.max():.3f}")
    assert scores[-5:].mean() > scores[:5].mean() + 0.15
    assert ev[0] < 0.1 and ev[:25].max() > 0.1  # the critic starts uninformed and learns to explain returns


def test_dapo_quickstart_drops_flat_groups(shared, tmp_path):
    _run([
        "-m", "jaxrl.train", "--config", "configs/dapo_quickstart.yaml", "trainer.total_training_steps=20",
        f"trainer.default_local_dir={tmp_path}",
    ])
    steps = [r for r in _records(tmp_path / "metrics.jsonl") if r["step"] > 0]
    dropped = [r["train/num_dropped_groups"] for r in steps]
    rounds = [r["train/num_gen_batches"] for r in steps]
    print(f"dapo dropped groups per step={dropped} generation rounds={rounds}")
    assert sum(dropped) > 0 and max(rounds) > 1  # flat groups dropped, more prompts generated to refill
    assert all(r["critic/advantages/max"] > 0 for r in steps)  # every kept group carries signal


# Every advantage estimator in the real loop, each checked against its closed form (not only that it runs):
# tests/test_algorithms_in_loop.py (slow), which replaced the 3-step smoke run of each estimator that was here.
