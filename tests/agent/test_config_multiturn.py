"""verl's ``actor_rollout_ref.rollout.multi_turn`` keys: loaded, checked, and a bad tool config refused by
``python -m jaxrl.train`` before jax loads (exit 1 for a missing file, 2 for a bad config)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.config.errors import ConfigError
from jaxrl.config.loader import load_config, load_config_with_notes

REPO = Path(__file__).resolve().parents[2]
MT = "actor_rollout_ref.rollout.multi_turn"


def test_verl_multi_turn_keys_load():
    cfg = load_config("configs/quickstart.yaml", [
        f"{MT}.enable=true", f"{MT}.max_assistant_turns=5", f"{MT}.max_user_turns=2",
        f"{MT}.tool_config_path=configs/tools/python_tool.yaml", f"{MT}.format=hermes",
    ])
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert (mt.enable, mt.max_assistant_turns, mt.max_user_turns, mt.tool_config_path, mt.format) == (
        True, 5, 2, "configs/tools/python_tool.yaml", "hermes")
    assert load_config(None).actor_rollout_ref.rollout.multi_turn.enable is False


@pytest.mark.parametrize("overrides, msg", [
    ([f"{MT}.enable=true"], f"{MT}.tool_config_path"),
    ([f"{MT}.format=json"], f"{MT}.format"),
    ([f"{MT}.max_assistant_turns=0"], f"{MT}.max_assistant_turns"),
    ([f"{MT}.tool_response_truncate_side=up"], f"{MT}.tool_response_truncate_side"),
    ([f"{MT}.enable=true", f"{MT}.tool_config_path=x.yaml", "actor_rollout_ref.rollout.name=vllm"], f"{MT}.enable"),
])
def test_bad_multi_turn_settings(overrides, msg):
    with pytest.raises(ConfigError, match=msg.replace(".", r"\.")):
        load_config(None, overrides)


def test_verl_interaction_key_is_accepted_with_a_note():
    loaded = load_config_with_notes(None, [f"{MT}.interaction_config_path=x.yaml"])
    assert any("env_class" in str(n) for n in loaded.notes)


def _train(*overrides):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml",
                           f"{MT}.enable=true", *overrides], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_train_refuses_a_bad_tool_config_before_jax(tmp_path):
    out = _train(f"{MT}.tool_config_path={tmp_path}/missing.yaml", f"trainer.default_local_dir={tmp_path}/run")
    assert out.returncode == 1 and out.stderr.strip().endswith(
        f"jaxrl: error: multi_turn.tool_config_path='{tmp_path}/missing.yaml' does not exist"), out.stderr
    bad = tmp_path / "tools.yaml"
    bad.write_text("tools:\n  - class_name: mypkg.tools.Missing\n")
    out = _train(f"{MT}.tool_config_path={bad}", f"trainer.default_local_dir={tmp_path}/run")
    assert out.returncode == 2 and "cannot import module 'mypkg.tools'" in out.stderr.splitlines()[-1], out.stderr
    out = _train(f"{MT}.env_class=jaxrl.agent.tools.CalculatorTool", f"trainer.default_local_dir={tmp_path}/run")
    assert out.returncode == 2 and "is not a subclass of jaxrl.agent.env.Environment" in out.stderr, out.stderr
