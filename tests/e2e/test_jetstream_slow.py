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
