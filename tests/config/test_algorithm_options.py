"""Load-time checks of the estimator / policy-loss choice: declared options, ``algorithm.external_lib``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from jaxrl.algorithms import registry
from jaxrl.config import ConfigError, config_to_yaml, load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
PL = "actor_rollout_ref.actor.policy_loss"


def _error(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.fixture
def fresh_registries(monkeypatch):
    for reg in (registry.ADV_ESTIMATORS, registry.POLICY_LOSSES):
        monkeypatch.setattr(reg, "_entries", dict(reg._entries))


# ------------------------------------------------------------------------------------ declared options
def test_an_option_the_chosen_loss_does_not_take_fails_with_its_name_and_the_loss_options():
    msg = _error([f"{PL}.clip_cov_ratio=0.001"])
    assert msg.startswith(f"{PL}.clip_cov_ratio=0.001 is set, but {PL}.loss_mode='vanilla' does not take it")
    assert "the options of 'vanilla': none" in msg and "(clip_cov)" in msg
    msg = _error([f"{PL}.loss_mode=kl_cov", f"{PL}.clip_cov_lb=2.0"])
    assert f"{PL}.clip_cov_lb=2.0" in msg and "the options of 'kl_cov': kl_cov_ratio, ppo_kl_coef" in msg
    ok = load_config(None, [f"{PL}.loss_mode=clip_cov", f"{PL}.clip_cov_ratio=0.001"])
    assert ok.actor_rollout_ref.actor.policy_loss.clip_cov_ratio == 0.001


def test_an_option_the_chosen_estimator_does_not_take_fails():
    msg = _error(["algorithm.gamma=0.9"])  # grpo
    assert msg.startswith("algorithm.gamma=0.9 is set, but algorithm.adv_estimator='grpo' does not take it")
    assert "the options of 'grpo': norm_adv_by_std_in_grpo" in msg and "(gae, reinforce_plus_plus, prime)" in msg
    msg = _error(["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.lam=0.95"])
    assert "algorithm.lam=0.95" in msg and "the options of 'reinforce_plus_plus': gamma" in msg
    assert "algorithm.norm_adv_by_std_in_grpo=False" in _error(["algorithm.adv_estimator=rloo",
                                                                "algorithm.norm_adv_by_std_in_grpo=false"])
    cfg = load_config(None, ["algorithm.adv_estimator=gae", "algorithm.gamma=0.9", "algorithm.lam=0.95"])
    assert (cfg.algorithm.gamma, cfg.algorithm.lam) == (0.9, 0.95)


def test_trl_matching_keys_load_and_are_checked():
    """algorithm.adv_std_epsilon (grpo / grpo_passk only, > 0), kl_loss_type=low_var_kl_is (a KL loss only: the
    in-reward algorithm.kl_penalty has no pi_old to weight by) and the dual clip turned off by clip_ratio_c=1e9."""
    a = "actor_rollout_ref.actor"
    cfg = load_config(None, ["algorithm.adv_std_epsilon=1e-4", f"{a}.kl_loss_type=low_var_kl_is",
                             f"{a}.clip_ratio_c=1e9"])
    assert cfg.algorithm.adv_std_epsilon == 1e-4 and cfg.actor_rollout_ref.actor.kl_loss_type == "low_var_kl_is"
    assert load_config(None, []).algorithm.adv_std_epsilon == 1e-6  # verl's epsilon stays the default
    load_config(None, ["algorithm.adv_estimator=grpo_passk", "algorithm.adv_std_epsilon=1e-4"])
    msg = _error(["algorithm.adv_estimator=rloo", "algorithm.adv_std_epsilon=1e-4"])
    assert msg.startswith("algorithm.adv_std_epsilon=0.0001 is set, but algorithm.adv_estimator='rloo' does not")
    assert "(grpo, grpo_passk)" in msg
    assert "algorithm.adv_std_epsilon=0.0 is invalid; expected a finite number in (0.0, inf)" in _error(
        ["algorithm.adv_std_epsilon=0"])
    msg = _error(["algorithm.kl_penalty=low_var_kl_is"])
    assert msg.startswith("algorithm.kl_penalty='low_var_kl_is' is invalid")
    assert "'low_var_kl'" in msg.split("expected", 1)[1] and "'low_var_kl_is'" not in msg.split("expected", 1)[1]
    assert "'k3_is'" in _error([f"{a}.kl_loss_type=k3_iss"])


def test_unset_options_and_values_equal_to_the_default_are_accepted(tmp_path):
    """The schema holds defaults for every option: only a value the user set (and that differs from the default)
    fails, so a dumped config (every key written out) loads back."""
    load_config(None, [f"{PL}.clip_cov_ratio=0.0002", "algorithm.gamma=1.0"])  # the defaults
    cfg = load_config(None, [f"{PL}.loss_mode=clip_cov", f"{PL}.clip_cov_ratio=0.01"])
    dumped = tmp_path / "dump.yaml"
    dumped.write_text(config_to_yaml(cfg))
    assert load_config(dumped) == cfg
    # switching the loss on top of that file: the file's clip_cov_ratio would be ignored -> refused
    assert "clip_cov_ratio=0.01 is set" in _error_file(dumped, [f"{PL}.loss_mode=vanilla"])


def _error_file(path, overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


def test_value_checks_come_before_the_option_check():
    assert "(0.0, 1.0]" in _error([f"{PL}.clip_cov_ratio=0"])
    assert "[0.0, 1.0]" in _error(["algorithm.gamma=1.5"])


# ------------------------------------------------------------------------------------ external_lib
def _write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_external_lib_registers_a_loss_that_becomes_a_valid_choice(tmp_path, fresh_registries):
    lib = _write(tmp_path, "my_losses.py", """
        from jaxrl.algorithms.registry import register_policy_loss

        @register_policy_loss("_cfg_my_loss", options=("ppo_kl_coef",))
        def my_loss(old_log_prob, log_prob, advantages, response_mask, *, ppo_kl_coef=0.1, **common):
            raise AssertionError("not called at load")
    """)
    assert "_cfg_my_loss" in _error([f"{PL}.loss_mode=_cfg_my_loss"])  # not registered: not a valid choice
    cfg = load_config(None, [f"algorithm.external_lib={lib}", f"{PL}.loss_mode=_cfg_my_loss", f"{PL}.ppo_kl_coef=0.5"])
    assert cfg.algorithm.external_lib == [str(lib)]
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "_cfg_my_loss"
    # loading it again (same process) does not register twice; its undeclared options are still refused
    msg = _error([f"algorithm.external_lib=[{lib}]", f"{PL}.loss_mode=_cfg_my_loss", f"{PL}.kl_cov_ratio=0.5"])
    assert "the options of '_cfg_my_loss': ppo_kl_coef" in msg


def test_external_lib_errors_are_one_line_config_errors(tmp_path, fresh_registries):
    msg = _error([f"algorithm.external_lib={tmp_path / 'missing.py'}"])
    assert msg.startswith(f"algorithm.external_lib='{tmp_path / 'missing.py'}' cannot be imported (ImportError")
    assert "cannot be imported (ModuleNotFoundError" in _error(["algorithm.external_lib=no_such_module_xyz"])
    boom = _write(tmp_path, "boom.py", "raise RuntimeError('bad line 1\\nline 2')\n")
    assert "(RuntimeError: bad line 1)" in _error([f"algorithm.external_lib={boom}"])
    clash = _write(tmp_path, "clash.py", """
        from jaxrl.algorithms.registry import register_policy_loss

        @register_policy_loss("vanilla")
        def vanilla(*a, **k):
            return 0.0, {}
    """)
    assert "policy loss 'vanilla' is already registered" in _error([f"algorithm.external_lib={clash}"])
    odd = _write(tmp_path, "odd_option.py", """
        from jaxrl.algorithms.registry import register_policy_loss

        @register_policy_loss("_cfg_odd", options=("my_coef",))
        def odd(old_log_prob, log_prob, advantages, response_mask, *, my_coef=1.0, **common):
            return 0.0, {}
    """)
    msg = _error([f"algorithm.external_lib={odd}", f"{PL}.loss_mode=_cfg_odd"])
    assert "declares the option 'my_coef', which is no key under actor_rollout_ref.actor.policy_loss" in msg
    assert "clip_cov_ratio" in msg
    assert "algorithm.external_lib=[] is invalid" in _error(["algorithm.external_lib=[]"])


def test_cli_reports_a_bad_external_lib_as_a_config_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl.train", "--print-config", f"algorithm.external_lib={tmp_path / 'nope.py'}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("jaxrl: config error: algorithm.external_lib=")
    assert "cannot be imported" in proc.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "jaxrl.train", "--print-config", "algorithm.external_lib=json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert ok.returncode == 0 and yaml.safe_load(ok.stdout)["algorithm"]["external_lib"] == ["json"]
