"""Slow end-to-end runs of the reward machinery (``pytest -m slow``).

- A reward function that raises on every call stops the run after the first scoring round: exit 1, the one-line
  reason and the scoring process's traceback on stderr, no scoring process left behind.
- verl's DAPO launch-script spelling (``reward_model.reward_manager=dapo`` + ``+reward_model.reward_kwargs.*``)
  runs the DAPO quickstart and applies the overlong penalty it describes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

TINY = [
    "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "data.max_response_length=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "trainer.val_before_train=false", "trainer.test_freq=-1",
]


def _run(args, timeout=1800, tag=""):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAXRL_TEST_TAG": tag}
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


def _scoring_processes(tag: str) -> set[int]:
    """PIDs of live scoring processes (their command line runs jaxrl.rewards.pool) started by the run whose
    environment carried ``JAXRL_TEST_TAG=tag`` (children inherit it; other runs on the machine do not count)."""
    out = set()
    for p in psutil.process_iter(["cmdline"]):
        if "jaxrl.rewards.pool" not in " ".join(p.info["cmdline"] or []):
            continue
        try:
            if p.environ().get("JAXRL_TEST_TAG") == tag:
                out.add(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def test_reward_function_failing_on_every_call_stops_the_run(shared, tmp_path):
    rf = tmp_path / "always_fails.py"
    rf.write_text('def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n'
                  '    raise KeyError("reward backend lost the key")\n')
    tag = uuid.uuid4().hex
    code, _, err = _run(["-m", "jaxrl.train", "--config", "configs/quickstart.yaml", *TINY,
                         f"custom_reward_function.path={rf}", f"trainer.default_local_dir={tmp_path / 'run'}"], tag=tag)
    assert code == 1, err[-3000:]
    assert ("jaxrl: error: the reward function failed on 4 of 4 responses (4 errors, 0 timeouts), all of them: "
            "stopping instead of training on zero rewards; first failure: index 0: KeyError: "
            "'reward backend lost the key'") in err
    assert f'File "{rf}", line 2, in compute_score' in err and "Traceback (most recent call last)" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()
    assert _scoring_processes(tag) == set()  # the run's scoring processes ended with it


def test_dapo_manager_with_verls_reward_kwargs_runs_the_dapo_quickstart(shared, tmp_path):
    code, _, err = _run([
        "-m", "jaxrl.train", "--config", "configs/dapo_quickstart.yaml",
        "reward_model.overlong_buffer.enable=False",  # only verl's spelling below turns the penalty on
        "reward_model.reward_manager=dapo",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=16",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.1",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=True",
        "+reward_model.reward_kwargs.max_resp_len=48",
        "trainer.total_training_steps=3", "trainer.val_before_train=false", "trainer.test_freq=-1",
        f"trainer.default_local_dir={tmp_path}",
    ])
    assert code == 0, err[-4000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in steps if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["reward/num_errors"] == 0 and r["reward/num_timeouts"] == 0
        # stories260K writes past 48 tokens: every response is cut at 48 = max_resp_len, so each takes the
        # full -penalty_factor (verl: min(-(48 - (48 - 16)) / 16 * 0.1, 0) = -0.1)
        assert r["reward/overlong_penalty_mean"] == pytest.approx(-0.1, abs=1e-6)
        assert r["reward/overlong_ratio"] == 1.0
        assert "train/num_dropped_groups" in r  # dynamic sampling filtered groups on the acc extra
