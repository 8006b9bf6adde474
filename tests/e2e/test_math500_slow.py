"""Slow end-to-end run (``pytest -m slow``): GRPO on MATH-500 with the real SmolLM2-135M-Instruct GGUF for
2 steps, scored by the built-in MATH scorer in its math-verify mode. Every response is scored without error:
either some rewards differ, or (a model that never boxes an answer) all are 0 with ``reward/num_errors == 0``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(args, timeout=1800):
    path = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_math500_smollm2_two_steps_scores_without_errors(shared, tmp_path):
    pytest.importorskip("math_verify")
    data = tmp_path / "math500"
    _run(["-m", "jaxrl.data.prepare", "math500", "--output", str(data)])
    out = tmp_path / "run"
    _run([
        "-m", "jaxrl.train", "--config", "configs/math500_grpo_smollm2_135m.yaml",
        f"data.train_files={data}/test.parquet", f"data.val_files={data}/test.parquet",
        f"trainer.default_local_dir={out}", "reward_model.math_verifier=math_verify",
    ])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r["step"] > 0 and "critic/score/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["reward/num_errors"] == 0 and r["reward/num_timeouts"] == 0, r
        spread = r["critic/score/max"] - r["critic/score/min"]
        print(f"step {r['step']}: score mean={r['critic/score/mean']:.3f} max-min={spread:.3f}")
        assert spread > 0 or (r["critic/score/max"] == 0.0 and r["critic/score/min"] == 0.0), r
    assert "val-core/HuggingFaceH4/MATH-500/reward/mean@1" in records[-1]
