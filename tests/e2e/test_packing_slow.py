"""Packed rows and token-budget micro-batches end to end (``pytest -m slow``).

The quickstart (real stories260K, GRPO) and the PPO quickstart (critic too) run two steps padded and two steps with
``actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.use_dynamic_bsz=True`` (a budget of
several micro-batches per mini-batch), and the quickstart once more with ``actor_rollout_ref.actor.use_prefix_grouper=True``
(each prompt's forward once for its n responses, in the update, the old-log-prob and the reference passes). The
first step sees the same weights and samples, so its metrics must agree:
scores exactly, the old log-prob pass (rollout-vs-trainer gap, entropy), the losses and the gradient norm within
fp32 tolerance. Every step logs verl's memory metrics.
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
SHORT = ["trainer.total_training_steps=2", "trainer.val_before_train=False", "trainer.test_freq=-1"]
PACKED = ["actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.use_dynamic_bsz=True",
          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024", "critic.ppo_max_token_len_per_gpu=1024"]


def _run(config: str, out: Path, extra: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "jaxrl.train", "--config", config, f"trainer.default_local_dir={out}", *SHORT, *extra]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] > 0]


PREFIX_GROUPER = ["actor_rollout_ref.actor.use_prefix_grouper=True"]


@pytest.mark.parametrize("config,losses,extra", [
    ("configs/quickstart.yaml", ["actor/pg_loss", "actor/kl_loss", "actor/grad_norm"], PACKED),
    ("configs/ppo_quickstart.yaml", ["actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm",
                                     "critic/vpred_mean"], PACKED),
    ("configs/quickstart.yaml", ["actor/pg_loss", "actor/kl_loss", "actor/grad_norm"], PREFIX_GROUPER),
], ids=["grpo-packed", "ppo-packed", "grpo-prefix-grouper"])
def test_packed_dynamic_run_matches_padded_first_step(shared, tmp_path, config, losses, extra):
    padded = _run(config, tmp_path / "padded", [])
    packed = _run(config, tmp_path / "packed", extra)
    assert [r["step"] for r in padded] == [r["step"] for r in packed] == [1, 2]
    a, b = padded[0], packed[0]
    for key in ("critic/score/mean", "response_length/mean", "perf/total_num_tokens"):
        assert a[key] == b[key], key  # same weights, same samples
    # |p_trainer - p_rollout| is itself fp32 noise (~1e-6): its packed and padded values agree to that noise
    tolerance = {"training/rollout_probs_diff_mean": 1e-6, "training/rollout_probs_diff_max": 1e-5}
    bad = []
    for key in ["training/rollout_probs_diff_mean", "training/rollout_probs_diff_max", "actor/entropy"] + losses:
        diff = abs(a[key] - b[key])
        print(f"{config} {key}: padded {a[key]!r} packed {b[key]!r} |diff| {diff:.3g}")
        if diff > tolerance.get(key, 1e-6) + 1e-4 * abs(a[key]):
            bad.append(key)
    assert not bad, bad
    for r in padded + packed:
        assert 0.05 < r["perf/cpu_memory_used_gb"] < 64  # the process's resident memory, GiB
        assert np.isfinite(r["actor/pg_loss"])
