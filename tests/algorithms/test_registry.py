"""The estimator / policy-loss registry: one table of names and declared options, no jax import, user registration."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

from jaxrl.algorithms import registry
from jaxrl.config import schema

# What each built-in takes from the config (and, estimators, from the batch): the options the trainer / actor
# passed before the registry existed (inspect-filtered), now declared.
EXPECTED_ESTIMATORS = {
    "gae": (("gamma", "lam"), ("values",)),
    "grpo": (("norm_adv_by_std_in_grpo", "adv_std_epsilon"), ()),
    "rloo": ((), ()),
    "reinforce_plus_plus": (("gamma",), ()),
    "reinforce_plus_plus_baseline": ((), ()),
    "remax": ((), ("reward_baselines",)),
    "grpo_passk": (("norm_adv_by_std_in_grpo", "adv_std_epsilon"), ()),
    "opo": ((), ()),
    "gpg": ((), ()),
    "prime": (("reward_dpo_coef", "reward_gt_coef", "gamma"), ("rm_scores",)),
}
EXPECTED_LOSSES = {
    "vanilla": (), "gspo": (), "cispo": (), "gpg": (),
    "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "ppo_kl_coef"),
}


@pytest.fixture
def fresh_registries(monkeypatch):
    """Register into copies, so the global registries (the config's choices) are untouched afterwards."""
    for reg in (registry.ADV_ESTIMATORS, registry.POLICY_LOSSES):
        monkeypatch.setattr(reg, "_entries", dict(reg._entries))


def test_registry_and_config_import_no_jax():
    code = ("import sys, jaxrl.algorithms.registry, jaxrl.config; "
            "from jaxrl.config import load_config; load_config(None, ['algorithm.adv_estimator=gae']); "
            "assert 'jax' not in sys.modules, 'jax imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_builtin_declarations():
    for name, (options, inputs) in EXPECTED_ESTIMATORS.items():
        e = registry.ADV_ESTIMATORS.entry(name)
        assert (e.options, e.inputs) == (options, inputs), name
    for name, options in EXPECTED_LOSSES.items():
        assert registry.POLICY_LOSSES.entry(name).options == options, name
    assert set(registry.ADV_ESTIMATORS.names()) >= set(EXPECTED_ESTIMATORS)
    assert set(registry.POLICY_LOSSES.names()) >= set(EXPECTED_LOSSES)
    # the schema's choices are the registry's built-ins, in its order
    assert schema.ADV_ESTIMATOR_CHOICES == registry.BUILTIN_ADV_ESTIMATORS == tuple(EXPECTED_ESTIMATORS)
    assert schema.POLICY_LOSS_MODE_CHOICES == registry.BUILTIN_POLICY_LOSSES
    assert schema.CRITIC_ADV_ESTIMATORS == ("gae",) and registry.needs_critic("gae")
    assert not registry.needs_critic("grpo")


def test_declared_names_are_keywords_of_the_functions():
    """A renamed keyword in a built-in would break here, not silently fall back to its default."""
    for reg in (registry.ADV_ESTIMATORS, registry.POLICY_LOSSES):
        for name in reg.names():
            entry = reg.entry(name)
            params = inspect.signature(entry.load()).parameters
            for kw in entry.options + entry.inputs:
                assert kw in params and params[kw].kind is inspect.Parameter.KEYWORD_ONLY, (name, kw)


def test_builtins_are_imported_lazily():
    entry = registry.POLICY_LOSSES.entry("clip_cov")
    assert entry.target == "jaxrl.algorithms.cov_losses:compute_policy_loss_clip_cov"
    from jaxrl.algorithms import compute_policy_loss_clip_cov

    assert entry.load() is compute_policy_loss_clip_cov is registry.get_policy_loss("clip_cov")


def test_register_checks_declarations(fresh_registries):
    @registry.register_policy_loss("_t_ok", options=("clip_cov_ratio",))
    def ok(old_log_prob, log_prob, advantages, response_mask, *, clip_cov_ratio=1.0, **common):
        return 0.0, {}

    assert registry.POLICY_LOSSES.entry("_t_ok").options == ("clip_cov_ratio",)
    assert registry.get_policy_loss("_t_ok") is ok
    assert "_t_ok" in registry.POLICY_LOSSES.takes("clip_cov_ratio") and "clip_cov" in registry.POLICY_LOSSES.takes(
        "clip_cov_ratio")
    registry.register_policy_loss("_t_ok", options=("clip_cov_ratio",))(ok)  # a module imported twice: a no-op

    def strict(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low=0.2):
        return 0.0, {}

    with pytest.raises(ValueError, match=r"policy loss '_t_bad' declares 'kl_cov_ratio', which 'strict' does not "
                                         r"accept.*clip_ratio_low"):
        registry.register_policy_loss("_t_bad", options=("kl_cov_ratio",))(strict)
    assert "_t_bad" not in registry.POLICY_LOSSES.names()
    with pytest.raises(ValueError, match="already registered"):
        registry.register_policy_loss("vanilla")(strict)
    with pytest.raises(ValueError, match=r"unknown input 'ref_log_probs'; valid inputs: values, reward_baselines"):
        registry.register_adv_estimator("_t_in", inputs=("ref_log_probs",))(lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"unknown policy loss 'nope'; registered: \['vanilla'"):
        registry.get_policy_loss("nope")


def test_import_external_libs_runs_a_file_once(tmp_path, fresh_registries):
    lib = tmp_path / "my_algos.py"
    lib.write_text(textwrap.dedent("""
        from jaxrl.algorithms.registry import register_adv_estimator

        IMPORTS = []
        IMPORTS.append(1)

        @register_adv_estimator("_t_file_est", options=("gamma",))
        def est(token_level_rewards, response_mask, group_ids, *, gamma=1.0):
            return token_level_rewards, token_level_rewards
    """))
    registry.import_external_libs([str(lib)])
    registry.import_external_libs([str(lib)])  # the same config loaded again: not executed twice
    fn = registry.get_adv_estimator("_t_file_est")
    assert sys.modules[fn.__module__].IMPORTS == [1]
    assert registry.ADV_ESTIMATORS.entry("_t_file_est").options == ("gamma",)
    with pytest.raises(ImportError, match="no such file"):
        registry.import_external_libs([str(tmp_path / "missing.py")])
    with pytest.raises(ModuleNotFoundError):
        registry.import_external_libs(["jaxrl_no_such_module_xyz"])
