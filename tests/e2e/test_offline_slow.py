"""Slow end-to-end runs of the offline trainers and of online DPO, on the real stories260K in subprocesses:

- SFT (the built-in story pairs' chosen continuations as responses) lowers the validation loss; SIGKILLed after its
  step-3 checkpoint, the same command resumes and logs every later step exactly as the uninterrupted run did.
- Offline DPO (configs/dpo_stories260k.yaml) raises the validation reward accuracy and margin and exports a
  Hugging Face model.
- Online DPO on the quickstart task (configs/online_dpo_quickstart.yaml, shortened) raises the validation score;
  SIGKILLed after its step-2 checkpoint it resumes exactly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_resume import assert_same_metrics, logged_steps, records, start_and_kill_when

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SFT = [
    sys.executable, "-m", "jaxrl.sft", "model.partial_pretrain=stories260K", "model.dtype=float32",
    "model.enable_gradient_checkpointing=false", "data.train_files=jaxrl://story_preferences.jsonl",
    "data.val_files=jaxrl://story_preferences_val.jsonl", "data.prompt_key=prompt", "data.response_key=chosen",
    "data.train_batch_size=16", "data.micro_batch_size_per_gpu=8", "data.max_length=96", "optim.lr=2e-3",
    "trainer.total_training_steps=6", "trainer.test_freq=3", "trainer.save_freq=3", "trainer.logger=[jsonl]",
]
ONLINE_DPO = [
    sys.executable, "-m", "jaxrl.train", "--config", "configs/online_dpo_quickstart.yaml", "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.optim.lr=2e-4", "trainer.total_training_steps=4", "trainer.test_freq=2",
    "trainer.save_freq=2", "trainer.logger=[jsonl]",
]
VAL = "val-core/tinystories/sentiment/reward/mean@1"


def _run(cmd: list[str]):
    import subprocess

    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _killed_then_resumed(cmd: list[str], out: Path, step: int) -> dict:
    """SIGKILL the run once ``step`` is logged and checkpointed, rerun the same command; the resumed records."""
    start_and_kill_when(out, lambda: step in logged_steps(out) and (out / f"global_step_{step}").is_dir(), cmd=cmd)
    proc = _run(cmd)
    assert f"resumed from {out}/global_step_{step} at step {step}" in proc.stderr
    return records(out)


def test_sft_lowers_validation_loss_and_resumes_exactly_after_sigkill(shared, tmp_path):
    base = tmp_path / "base"
    _run(SFT + [f"trainer.default_local_dir={base}"])
    want = records(base)
    val = {s: r["val/loss"] for s, r in want.items() if "val/loss" in r}
    print("sft val/loss", val)
    assert sorted(val) == [0, 3, 6] and val[6] < val[0] - 0.5, val
    assert (base / "hf_model" / "model.safetensors").is_file()

    out = tmp_path / "killed"
    cmd = SFT + [f"trainer.default_local_dir={out}"]
    got = _killed_then_resumed(cmd, out, 3)
    assert sorted(got) == list(range(7))
    assert_same_metrics(want, got, steps=range(4, 7))


def test_offline_dpo_learns_the_preference(shared, tmp_path):
    _run([sys.executable, "-m", "jaxrl.dpo", "--config", "configs/dpo_stories260k.yaml",
          "trainer.total_training_steps=4", "trainer.logger=[jsonl]", f"trainer.default_local_dir={tmp_path}"])
    recs = records(tmp_path)
    first, last = recs[0], recs[max(recs)]
    print("dpo val", {k: (first[k], last[k]) for k in first if k.startswith("val/")})
    assert first["val/loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy is its reference at step 0
    assert last["val/loss"] < 0.6 and last["val/rewards/accuracies"] > 0.9 and last["val/rewards/margins"] > 0.1
    assert all(k in recs[1] for k in ("train/loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                      "rewards/margins", "logps/chosen", "logps/rejected"))
    config = json.loads((tmp_path / "hf_model" / "config.json").read_text())
    assert config["model_type"] == "llama"


def test_online_dpo_raises_the_score_and_resumes_exactly_after_sigkill(shared, tmp_path):
    base = tmp_path / "base"
    _run(ONLINE_DPO + [f"trainer.default_local_dir={base}"])
    want = records(base)
    val = {s: r[VAL] for s, r in want.items() if VAL in r}
    print("online dpo", val, [round(want[s]["critic/score/mean"], 3) for s in range(1, 5)])
    assert sorted(val) == [0, 2, 4] and val[4] > val[0] + 0.15, val
    assert all(want[s]["dpo/pairs"] > 0 and "actor/dpo_loss" in want[s] for s in range(1, 5))

    out = tmp_path / "killed"
    got = _killed_then_resumed(ONLINE_DPO + [f"trainer.default_local_dir={out}"], out, 2)
    assert sorted(got) == list(range(5))
    assert_same_metrics(want, got, steps=range(3, 5))
