"""PRIME end to end (``pytest -m slow``): the PRIME quickstart (configs/prime_quickstart.yaml, the real stories260K
policy and its implicit PRM) learns: the policy's outcome labels rise and the PRM orders a prompt's responses as
their labels better than chance, on responses it has not trained on yet; SIGKILLed after its step-4 checkpoint the
run resumes (actor, PRM and their optimizer states, data position) to the same metrics as the uninterrupted one.

One uninterrupted 10-step run is both the learning check and the resume baseline (CI's time budget)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_resume import assert_same_metrics, logged_steps, records, start_and_kill_when

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
STEPS = 10
RUN = [f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1", "trainer.val_before_train=false",
       "trainer.save_freq=4", "trainer.logger=[jsonl]"]


def command(out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "jaxrl.train", "--config", "configs/prime_quickstart.yaml", *RUN,
            f"trainer.default_local_dir={out_dir}"]


def run(out_dir: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(command(out_dir), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def uninterrupted(shared, tmp_path_factory):
    out = tmp_path_factory.mktemp("prime_uninterrupted")
    run(out)
    return records(out)


def test_prime_quickstart_learns_and_its_prm_beats_chance(uninterrupted):
    rows = [uninterrupted[s] for s in sorted(uninterrupted)]
    assert len(rows) == STEPS
    acc = np.array([r["acc"] for r in rows])  # mean outcome label of every generated response (before the filter)
    prm = np.array([r["reward_model/dpo_acc_before"] for r in rows])  # before the step's PRM update
    print(f"PRIME quickstart acc first3={acc[:3].mean():.3f} last3={acc[-3:].mean():.3f}; "
          f"PRM pairwise accuracy first={prm[0]:.3f} last4={prm[-4:].mean():.3f}")
    assert acc[-3:].mean() > acc[:3].mean() + 0.1, acc
    assert prm[0] == pytest.approx(0.5)  # the PRM starts as its reference: no preference
    assert prm[-4:].mean() > 0.6, prm
    assert all(r["reward_model/nonfinite_grad"] == 0 for r in rows)
    assert all(r["train/num_groups_in_band"] > 0 for r in rows)


def test_sigkill_after_step_4_resumes_the_prm_exactly(uninterrupted, tmp_path):
    start_and_kill_when(tmp_path, lambda: 4 in logged_steps(tmp_path) and (tmp_path / "global_step_4").is_dir(),
                        cmd=command(tmp_path))
    proc = run(tmp_path)
    assert f"resumed from {tmp_path}/global_step_4 at step 4" in proc.stderr
    resumed = records(tmp_path)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert_same_metrics(uninterrupted, resumed, steps=range(5, STEPS + 1))
