"""Exact resume and faults on real (tiny) quickstart runs in subprocesses.

- SIGKILL during step 5 and SIGKILL during a checkpoint save: rerunning the same command resumes from the last
  complete checkpoint, and every step after it logs the same metrics as an uninterrupted run with the same seed.
- SIGTERM stops after the current step with a checkpoint; resuming at an epoch boundary keeps training;
  non-finite losses abort after ``trainer.max_nonfinite_steps``; a failed save leaves training running;
  a corrupt newest checkpoint is moved aside, the run falls back to the previous one and writes it again.
  (More faults, with their exit codes and messages: tests/faults.)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxrl.checkpoint import latest_complete_step, parse_step_dir

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each case trains in subprocesses (about 7 minutes in all); .ci/run runs them
TINY = [
    "data.train_batch_size=4", "data.max_response_length=12", "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.kl_loss_coef=0.01", "actor_rollout_ref.actor.shuffle=true",
    "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.total_training_steps=6",
    "trainer.save_freq=2", "trainer.logger=['jsonl']",
]
# Same data, rewards, losses: everything but wall-clock measurements.
VOLATILE = ("timing_s/", "perf/")


def command(out_dir: Path, extra=()) -> list[str]:
    return [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml", *TINY,
            f"trainer.default_local_dir={out_dir}", *extra]


def run(out_dir: Path, extra=(), check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(command(out_dir, extra), cwd=REPO, capture_output=True, text=True, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def records(out_dir: Path) -> dict[int, dict]:
    path = out_dir / "metrics.jsonl"
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        assert r["step"] not in out, f"step {r['step']} logged twice"
        out[r["step"]] = r
    return out


def assert_same_metrics(a: dict, b: dict, steps) -> None:
    for step in steps:
        keys = {k for k in a[step] if not k.startswith(VOLATILE)}
        assert keys == {k for k in b[step] if not k.startswith(VOLATILE)}, step
        for k in keys:
            x, y = a[step][k], b[step][k]
            if isinstance(x, float) and math.isfinite(x):
                assert y == pytest.approx(x, rel=1e-4, abs=1e-6), (step, k, x, y)
            else:
                assert x == y, (step, k)


def start_and_kill_when(out_dir: Path, ready, cmd: list[str] | None = None, extra=()) -> None:
    """Start a run (``cmd``, default the tiny quickstart into ``out_dir`` with the ``extra`` overrides,
    ``command(out_dir, extra)``) and SIGKILL it as soon as ``ready()`` is true (polled every 2 ms)."""
    if cmd is not None and extra:
        raise ValueError("start_and_kill_when: pass the overrides inside cmd, or extra= with the default command")
    proc = subprocess.Popen(command(out_dir, extra) if cmd is None else cmd, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while not ready():
            assert proc.poll() is None, "the run ended before the kill point"
            assert time.monotonic() < deadline
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def logged_steps(out_dir: Path) -> list[int]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, shared):
    out = tmp_path_factory.mktemp("uninterrupted")
    run(out)
    return records(out)


def test_sigkill_during_step_5_resumes_exactly(baseline, tmp_path):
    start_and_kill_when(tmp_path, lambda: 4 in logged_steps(tmp_path) and (tmp_path / "global_step_4").is_dir())
    run(tmp_path)
    resumed = records(tmp_path)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert_same_metrics(baseline, resumed, steps=[5, 6])


def test_sigkill_during_a_save_falls_back_to_the_previous_checkpoint(baseline, tmp_path):
    def saving_step_4():  # orbax writes into a temporary folder and renames it when complete
        return any(p.name.startswith("global_step_4") and p.name != "global_step_4" for p in tmp_path.iterdir())

    start_and_kill_when(tmp_path, saving_step_4)
    # Killed mid-save: step 4 is either complete (orbax renamed it before the kill) or only a recognisable
    # temporary folder; no global_step_* entry is anything else.
    complete = latest_complete_step(tmp_path)
    assert complete in (2, 4), complete
    others = [p.name for p in tmp_path.iterdir() if p.name.startswith("global_step") and parse_step_dir(p) is None]
    assert all(".orbax-checkpoint-tmp" in name for name in others), others
    assert complete == 4 or others, "neither a complete step 4 nor its temporary folder"
    proc = run(tmp_path)
    resumed = records(tmp_path)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert f"resumed from {tmp_path}/global_step_{complete} at step {complete}" in proc.stderr
    assert_same_metrics(baseline, resumed, steps=[3, 4, 5, 6])


def test_sigterm_stops_cleanly_with_a_checkpoint_then_resumes(baseline, tmp_path):
    proc = subprocess.Popen(command(tmp_path), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 600
    while 3 not in logged_steps(tmp_path):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert "SIGTERM" in err
    stopped_at = max(logged_steps(tmp_path))
    assert stopped_at < 6 and (tmp_path / f"global_step_{stopped_at}").is_dir()
    run(tmp_path)
    assert_same_metrics(baseline, records(tmp_path), steps=range(stopped_at + 1, 7))


def test_resume_exactly_at_an_epoch_boundary_keeps_training(tmp_path, shared):
    rows = [json.loads(x) for x in (REPO / "jaxrl/data/builtin/story_prompts.jsonl").read_text().splitlines()[:8]]
    data = tmp_path / "eight.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = [f"data.train_files={data}", "data.val_files=null"]
    out = tmp_path / "run"
    run(out, extra + ["trainer.total_training_steps=2"])  # 8 prompts / 4 per step: step 2 ends epoch 0
    proc = run(out, extra + ["trainer.total_training_steps=4"])
    assert "resumed from" in proc.stderr
    recs = records(out)
    assert sorted(recs) == [1, 2, 3, 4]
    assert recs[3]["training/epoch"] == 1 and recs[4]["training/epoch"] == 1


def test_nonfinite_losses_abort_naming_the_step(tmp_path, shared):
    # An absurd learning rate without clipping blows the weights up: later gradients are inf/NaN.
    bad = ["actor_rollout_ref.actor.optim.lr=1e30", "actor_rollout_ref.actor.grad_clip=0",
           "trainer.max_nonfinite_steps=2"]
    proc = run(tmp_path / "run", bad, check=False)
    assert proc.returncode == 1
    assert "jaxrl: error: 2 consecutive steps ending at step 2 had a non-finite loss or gradient" in proc.stderr
    recs = records(tmp_path / "run")
    assert sorted(recs) == [1, 2] and all(recs[s]["actor/nonfinite_grad"] > 0 for s in (1, 2))


def test_failed_save_keeps_training_and_says_so(tmp_path, shared):
    hook = tmp_path / "sitecustomize.py"
    hook.write_text(textwrap.dedent("""
        import errno
        import jaxrl.checkpoint as ck
        _save = ck.CheckpointStore.save
        def save(self, step, **kw):
            if step == 4:
                raise ck.CheckpointSaveError("No space left on device", step=step, directory=self.directory,
                                             cause=OSError(errno.ENOSPC, "No space left on device"))
            return _save(self, step, **kw)
        ck.CheckpointStore.save = save
    """))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(command(tmp_path / "run"), cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint not saved" in proc.stderr and "No space left on device" in proc.stderr
    assert sorted(records(tmp_path / "run")) == [1, 2, 3, 4, 5, 6]
    steps = sorted(p.name for p in (tmp_path / "run").glob("global_step_*"))
    assert steps == ["global_step_2", "global_step_6"]


def test_corrupt_newest_checkpoint_falls_back_and_says_so(baseline, tmp_path):
    run(tmp_path, ["trainer.total_training_steps=4"])
    # Corrupt step 4: truncate every array file in it.
    for f in (tmp_path / "global_step_4").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "meta" not in f.parts:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    proc = run(tmp_path)
    assert f"checkpoint {tmp_path}/global_step_4 is corrupt or partial" in proc.stderr
    assert f"resumed from {tmp_path}/global_step_2 at step 2" in proc.stderr
    assert_same_metrics(baseline, records(tmp_path), steps=[3, 4, 5, 6])
    # the corrupt one was moved aside (kept) and step 4 written again
    assert len(list(tmp_path.glob("global_step_4.corrupt-*"))) == 1
    assert latest_complete_step(tmp_path) == 6 and (tmp_path / "global_step_4").is_dir()
    shutil.rmtree(tmp_path, ignore_errors=True)
