"""The asynchronous pipeline end to end (``pytest -m slow``; jaxrl.async_rollout, ``async_training.staleness``).

- Exact resume of in-flight state, k = 1, and k = 2 with partial rollouts (the buffer of k = 2 without partial
  rollouts, two finished batches, is resumed exactly in tests/test_async_rollout.py with a fake engine; its real run
  was dropped here for CI time): the quickstart (real stories260K, 8 steps, a checkpoint every 2) is
  SIGKILLed right after its step-4 checkpoint, while step 5 trains and batch 4 + k + 1 generates; the rerun resumes
  from step 4 with batches 5 .. 4 + k from the checkpoint, generates batch 4 + k + 1 again, and logs for steps 5-8
  the metrics of the uninterrupted async run (within the resume tests' fp32 tolerance, rel 1e-4: the same programs
  on the same inputs; in practice equal).
- Learning on 8 simulated CPU devices, split 4 / 4 (train mesh fsdp=2 x tensor=2 on devices 0-3, the sampler on 4-7),
  staleness 1: the score rises as in the synchronous split run (tests/e2e/test_mesh_slow.py), every batch after the
  first is exactly one version old, and the generation overlaps the training (reported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.test_mesh_slow import COMMON, PLACEMENTS, QUICKSTART_MICRO, STEPS, per_device
from tests.test_resume import assert_same_metrics, logged_steps, records, start_and_kill_when

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
RESUME_STEPS = 8
RESUME_RUN = [f"trainer.total_training_steps={RESUME_STEPS}", "trainer.save_freq=2", "trainer.test_freq=-1",
              "trainer.val_before_train=false", "trainer.logger=[jsonl]", "actor_rollout_ref.actor.optim.lr=3e-4"]


def command(out_dir: Path, k: int, partial: bool = False) -> list[str]:
    return [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml", *RESUME_RUN,
            f"async_training.staleness={k}", f"async_training.partial_rollout={partial}",
            f"trainer.default_local_dir={out_dir}"]


def run(out_dir: Path, k: int, partial: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run(command(out_dir, k, partial), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("k, partial", [(1, False), (2, True)], ids=["k1", "k2-partial"])
def test_sigkill_while_the_next_batch_generates_resumes_exactly(shared, tmp_path, k, partial):
    """Partial rollouts (k = 2): each batch is generated in two stages of 24 tokens, the first with the weights of
    step b - 3, the second with those of step b - 2, so the trained batch's tokens lag 2 and 1 versions (mean 1.5 once
    the pipeline is full); the checkpoint after step 4 holds batch 5 finished and batch 6 after its first stage."""
    base = tmp_path / "uninterrupted"
    run(base, k, partial)
    baseline = records(base)
    assert sorted(baseline) == list(range(1, RESUME_STEPS + 1))
    for step, r in baseline.items():  # batch b comes from the weights of step max(0, b - 1 - k) (partial: per stage)
        assert r["async/staleness/max"] == min(step - 1, k), (step, r)
        if not partial:
            assert r["async/staleness/mean"] == min(step - 1, k), (step, r)
        elif step > k:
            assert 1 <= r["async/staleness/mean"] < k, (step, r)

    out = tmp_path / "killed"
    start_and_kill_when(out, lambda: 4 in logged_steps(out) and (out / "global_step_4").is_dir(),
                        cmd=command(out, k, partial))
    proc = run(out, k, partial)
    assert f"resumed from {out}/global_step_4 at step 4" in proc.stderr
    buffered = [5] if partial else list(range(5, 5 + k))
    assert (f"async rollout (staleness {k}): batches {buffered} ready from the checkpoint, generating from batch "
            f"{5 + k} with the weights of step 4") in proc.stderr
    resumed = records(out)
    assert sorted(resumed) == list(range(1, RESUME_STEPS + 1))
    assert_same_metrics(baseline, resumed, steps=range(5, RESUME_STEPS + 1))


def test_quickstart_learns_with_staleness_1_on_a_split_mesh(shared, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    args = [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml", *COMMON,
            "trainer.placement=split", "trainer.rollout_devices=4", "trainer.mesh.fsdp=2", "trainer.mesh.tensor=2",
            *per_device(QUICKSTART_MICRO, "split"), "async_training.staleness=1", f"trainer.default_local_dir={tmp_path}"]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "placement split: train data=1 x fsdp=2 x tensor=2 on devices [0, 1, 2, 3]" in proc.stderr
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in steps if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["async/staleness/max"] for r in steps] == [0] + [1] * (STEPS - 1)
    assert all(r["sync/bytes"] > 0 for r in steps)  # weights crossed to the sampler's devices after every update
    overlap = np.array([r["perf/gen_overlap_ratio"] for r in steps[1:-1]])  # steps with a generation in flight
    wait = np.array([r["timing_s/wait_prev_gen"] for r in steps])
    scores = np.array([r["critic/score/mean"] for r in steps])
    first, last = scores[:5].mean(), scores[-5:].mean()
    print(f"async split staleness 1: critic/score/mean first5={first:.3f} last5={last:.3f}; overlap ratio mean "
          f"{overlap.mean():.2f} (min {overlap.min():.2f}); wait_prev_gen mean {wait.mean():.2f} s; step time mean "
          f"{np.mean([r['timing_s/step'] for r in steps[1:]]):.2f} s")
    assert overlap.min() > 0  # the next batch generated while every middle step trained
    assert last > first + 0.15, (first, last)
