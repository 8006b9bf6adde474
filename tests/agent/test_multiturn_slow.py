"""End to end: GRPO on GSM8K prompts with the real SmolLM2-135M-Instruct (ChatML template) and the sandboxed
Python tool (configs/tools/python_tool.yaml) runs 2 multi-turn steps and logs the tool metrics."""

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


def _run(args, timeout=1800):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_smollm2_python_tool_two_steps(shared, bwrap_sandbox, tmp_path):
    data = tmp_path / "gsm8k"
    _run(["-m", "jaxrl.data.prepare", "gsm8k", "--input", str(shared / "data" / "gsm8k"), "--output", str(data)])
    out = tmp_path / "run"
    _run([
        "-m", "jaxrl.train", "--config", "configs/gsm8k_grpo_smollm2_135m.yaml", "trainer.total_training_steps=2",
        f"data.train_files={data}/train.parquet", f"data.val_files={data}/test.parquet",
        f"trainer.default_local_dir={out}", "data.train_batch_size=2", "data.max_prompt_length=512",
        "data.max_response_length=96", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
        "trainer.val_before_train=true", "data.val_max_samples=2", "trainer.test_freq=-1",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=configs/tools/python_tool.yaml",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
    ])
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    val = [r for r in records if "val-core/openai/gsm8k/reward/mean@1" in r]
    assert len(val) == 1 and val[0]["step"] == 0  # validation ran the multi-turn loop before training
    train = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        for key in ("multi_turn/num_turns/mean", "multi_turn/tool_calls", "multi_turn/tool_errors",
                    "multi_turn/tool_time_s", "multi_turn/prefill_tokens", "multi_turn/gen_calls"):
            assert key in r, key
        assert 1 <= r["multi_turn/num_turns/mean"] <= 3
        assert r["multi_turn/gen_calls"] >= 1 and r["multi_turn/prefill_tokens"] > 0
        assert np.isfinite(r["actor/pg_loss"])
        print({k: v for k, v in r.items() if k.startswith("multi_turn/") or k.startswith("timing_s/gen")})
