"""Reward keys of the config: verl's ``+reward_model.reward_kwargs.*`` spelling, the managers, and what
:func:`jaxrl.rewards.factory.build_reward_manager` builds from them."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.rewards.factory import build_reward_manager, overlong_settings
from jaxrl.rewards.manager import OverlongBuffer

# verl's DAPO / GSPO launch scripts, e.g. examples/gspo_trainer/run_qwen30b_gspo.sh
VERL_DAPO = [
    "reward_model.reward_manager=dapo",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.len=16",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.1",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
    "+reward_model.reward_kwargs.max_resp_len=48",
]


def _error(overrides, config=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(config, overrides)
    return str(e.value)


def test_verl_reward_kwargs_spelling_is_accepted():
    cfg = load_config("configs/quickstart.yaml", VERL_DAPO)
    assert cfg.reward_model.reward_manager == "dapo"
    assert cfg.reward_model.reward_kwargs == {
        "overlong_buffer_cfg": {"enable": True, "len": 16, "penalty_factor": 0.1, "log": False}, "max_resp_len": 48}
    assert overlong_settings(cfg) == OverlongBuffer(len=16, penalty_factor=0.1, log=False, max_resp_len=48)
    # the same in a YAML mapping, merged key by key with later overrides
    cfg = load_config(None, ["reward_model.reward_manager=dapo",
                             "reward_model.reward_kwargs={overlong_buffer_cfg: {enable: true, len: 8}}",
                             "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5"])
    assert overlong_settings(cfg) == OverlongBuffer(len=8, penalty_factor=0.5, log=False, max_resp_len=None)


def test_overlong_keys_merge_and_the_old_spelling_still_works():
    old = load_config("configs/dapo_quickstart.yaml")  # reward_model.overlong_buffer.* (any manager)
    assert overlong_settings(old) == OverlongBuffer(len=16, penalty_factor=0.1, log=False, max_resp_len=None)
    mixed = load_config("configs/dapo_quickstart.yaml", [
        "reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.log=True"])
    assert overlong_settings(mixed) == OverlongBuffer(len=16, penalty_factor=0.1, log=True, max_resp_len=None)
    off = load_config("configs/dapo_quickstart.yaml", [
        "reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=False"])
    assert overlong_settings(off) is None
    assert overlong_settings(load_config(None)) is None


@pytest.mark.parametrize("overrides, expected", [
    (["+reward_model.reward_kwargs.max_resp_len=48"],
     "reward_model.reward_kwargs={'max_resp_len': 48} is not used by reward_model.reward_manager='naive'"),
    (["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer=1"],
     "reward_model.reward_kwargs.overlong_buffer=1 is not an argument of the dapo reward manager; valid: "),
    (["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.size=3"],
     "overlong_buffer_cfg.size=3 is not a setting of the overlong buffer; valid: enable, len, penalty_factor, log"),
    (["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
      "+reward_model.reward_kwargs.overlong_buffer_cfg.len=64", "+reward_model.reward_kwargs.max_resp_len=48"],
     "overlong_buffer_cfg.len=64 is invalid; expected an int in [1, max_resp_len=48]"),
    (["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.len=many"],
     "overlong_buffer_cfg.len='many' is invalid; expected int"),
    (["reward_model.reward_manager=batch"], "reward_model.reward_manager='batch' needs custom_reward_function.path"),
    (["reward_model.reward_manager=reinforce"], "expected one of 'naive', 'prime', 'dapo', 'batch'"),
    (["reward_model.num_workers=-1"], "reward_model.num_workers=-1 is invalid; expected an int >= 0 or null"),
    (["reward_model.max_error_fraction=1.5"], "reward_model.max_error_fraction=1.5 is invalid"),
    (["reward_model.reward_kwargs=3"], "reward_model.reward_kwargs=3 has the wrong type"),
    (["+custom_reward_function.reward_kwargs.1x=3"], "custom_reward_function.reward_kwargs has the key '1x'"),
])
def test_bad_reward_settings_are_one_line_errors(overrides, expected):
    msg = _error(overrides)
    assert expected in msg and "\n" not in msg, msg


def test_defaults_are_parallel_processes_and_stop_only_when_all_fail():
    rm = load_config(None).reward_model
    assert (rm.reward_manager, rm.num_workers, rm.max_error_fraction, rm.reward_kwargs) == ("naive", None, None, {})
    assert load_config(None, ["reward_model.num_workers=0"]).reward_model.num_workers == 0


def test_build_from_config_with_custom_kwargs_and_batch(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(
        "def compute_score(solution_str, ground_truth, score=1.0):\n"
        "    return score * (solution_str == ground_truth)\n"
        "def batch(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0, shift=0.0):\n"
        "    return [scale * (s == g) + shift for s, g in zip(solution_strs, ground_truths)]\n"
    )
    cfg = load_config(None, [f"custom_reward_function.path={f}", "+custom_reward_function.reward_kwargs.score=3.0",
                             "reward_model.num_workers=1"])
    with build_reward_manager(cfg) as mgr:
        assert mgr.compute_score.style == "scorer" and mgr.compute_score.reward_kwargs == {"score": 3.0}
        assert mgr.score(["d", "d"], ["a", "b"], ["a", "a"], [None, None]).scores.tolist() == [3.0, 0.0]
    cfg = load_config(None, [f"custom_reward_function.path={f}", "custom_reward_function.name=batch",
                             "reward_model.reward_manager=batch", "+reward_model.reward_kwargs.scale=2.0",
                             "+reward_model.reward_kwargs.shift=1.0", "+custom_reward_function.reward_kwargs.shift=0.5"])
    with build_reward_manager(cfg) as mgr:  # verl: the manager's kwargs reach the function, custom ones win
        assert mgr.compute_score.reward_kwargs == {"scale": 2.0, "shift": 0.5}
        np.testing.assert_allclose(mgr.score(["d"] * 2, ["a", "b"], ["a", "a"], [None] * 2).scores, [2.5, 0.5])


def test_verl_reward_loop_keys_are_accepted_with_their_defaults_only():
    from jaxrl.config import load_config_with_notes

    notes = load_config_with_notes(None, ["data.reward_fn_key=data_source", "reward_model.use_reward_loop=True",
                                          "reward_model.reward_loop_source=register"]).notes
    assert {n.key for n in notes} == {"data.reward_fn_key", "reward_model.use_reward_loop",
                                      "reward_model.reward_loop_source"}
    assert "user-defined manager classes are not supported" in _error(["reward_model.reward_loop_source=importlib"])
    assert "(valid: 'data_source')" in _error(["data.reward_fn_key=source"])


def test_the_cpu_hour_gsm8k_config_scores_format_with_verls_format_score(monkeypatch):
    """configs/gsm8k_grpo_smollm2_135m_cpu_hour.yaml: its custom reward (the repo's GSM8K scorer by file path, as
    verl's custom_reward_function takes it) loads from the repo root and gives 0.1 for a wrong '#### N' answer."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)  # the README runs every config from the repo root
    cfg = load_config("configs/gsm8k_grpo_smollm2_135m_cpu_hour.yaml", ["reward_model.num_workers=0"])
    assert cfg.custom_reward_function.name == "compute_score_with_extras"
    with build_reward_manager(cfg) as mgr:
        out = mgr.score(["openai/gsm8k"] * 3, ["#### 72", "#### 5", "it is 72"], ["72"] * 3, [None] * 3)
        assert out.scores.tolist() == pytest.approx([1.0, 0.1, 0.0])
        assert out.extra["format"] == [1.0, 1.0, 0.0] and out.extra["acc_flexible"] == [1.0, 0.0, 1.0]
