"""Fault: a reward function that fails on every call (issue 13 "no silent zero").

A call that raises still scores 0 and is counted; when a batch's failures pass
``reward_model.max_error_fraction`` (default: all calls) the run stops with exit 1 and the first traceback.
The real end-to-end stop is in tests/e2e/test_rewards_slow.py; here the CLI's mapping of the error."""

from __future__ import annotations

import pytest

import jaxrl.trainer
from jaxrl.rewards.manager import RewardError
from jaxrl.rewards.pool import WorkerStartError
from jaxrl.train import main

TB = 'Traceback (most recent call last):\n  File "/x/r.py", line 2, in compute_score\nKeyError: \'k\'\n'


@pytest.mark.parametrize("error", [
    RewardError("the reward function failed on 4 of 4 responses (4 errors, 0 timeouts), all of them: ...", TB),
    WorkerStartError("a reward scoring process could not load the reward function: ImportError: x", TB),
])
def test_reward_failure_exits_1_with_the_first_traceback(monkeypatch, capsys, tmp_path, error):
    def run_training(cfg):
        raise error

    monkeypatch.setattr(jaxrl.trainer, "run_training", run_training)
    assert main(["--config", "configs/quickstart.yaml", f"trainer.default_local_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"jaxrl: error: {error}\n")
    assert "jaxrl: the first failure's traceback (in the scoring process):\n" + TB.rstrip() in err
