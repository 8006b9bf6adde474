"""jaxrl.config: schema defaults, YAML + override merging, validation messages, verl compat notes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from jaxrl.config import ConfigError, JaxRLConfig, config_to_yaml, load_config, load_config_with_notes, valid_keys
from jaxrl.config import compat, schema
from jaxrl.config.batch_plan import BatchPlan
from jaxrl.paths import REPO_ROOT

CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def _error(config_path, overrides=()) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(config_path, list(overrides))
    return str(ei.value)


# ------------------------------------------------------------------------------- defaults
def test_defaults_load_with_verl_values():
    cfg = load_config(None)
    assert isinstance(cfg, JaxRLConfig)
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    # verl's ppo_trainer.yaml defaults
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.truncation) == (1024, 512, "error")
    assert (a.optim.lr, a.ppo_mini_batch_size, a.clip_ratio, a.clip_ratio_c) == (1e-6, 256, 0.2, 3.0)
    assert (a.kl_loss_type, a.loss_agg_mode, a.optim.lr_warmup_steps) == ("low_var_kl", "token-mean", -1)
    assert (r.val_kwargs.temperature, r.val_kwargs.do_sample, r.top_k) == (0.0, False, -1)
    assert (cfg.algorithm.kl_ctrl.type, cfg.algorithm.kl_ctrl.horizon) == ("fixed", 10000)
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"
    assert cfg.custom_reward_function.name == "compute_score" and cfg.reward_model.enable is False
    # interpolated / derived defaults
    assert (r.prompt_length, r.response_length, r.max_new_tokens) == (512, 512, 512)
    assert cfg.data.seed == cfg.trainer.seed == r.seed
    assert cfg.data.train_files == ["~/data/rlhf/gsm8k/train.parquet"]


def test_valid_keys_are_full_dotted_leaves():
    keys = valid_keys()
    assert "actor_rollout_ref.actor.optim.lr" in keys
    assert "actor_rollout_ref.rollout.val_kwargs.do_sample" in keys
    assert "actor_rollout_ref.actor" not in keys  # a section, not a leaf
    assert len(keys) == len(set(keys))


# ------------------------------------------------------------------------- merge precedence
def test_yaml_then_overrides_precedence(tmp_path):
    p = _write(
        tmp_path,
        "data:\n  train_batch_size: 32\n  max_prompt_length: 64\n"
        "actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 8\n    optim:\n      lr: 3.0e-4\n",
    )
    cfg = load_config(p, ["actor_rollout_ref.actor.optim.lr=2e-5", "data.train_batch_size=16",
                          "data.train_batch_size=24"])
    assert cfg.actor_rollout_ref.actor.optim.lr == 2e-5  # override beats YAML
    assert cfg.data.train_batch_size == 24  # later override beats earlier
    assert cfg.data.max_prompt_length == 64  # YAML beats default
    assert cfg.actor_rollout_ref.rollout.prompt_length == 64  # interpolation sees the merged value
    assert cfg.data.max_response_length == 512  # default kept


def test_override_value_grammar():
    cfg = load_config(None, [
        "trainer.logger=[console]", "data.truncation='left'", "data.shuffle=False",
        "data.train_files=[a.parquet, b.parquet]", "data.val_files=c.parquet",
        "actor_rollout_ref.rollout.stop_token_ids=[2,7]", "data.val_batch_size=null",
        "+actor_rollout_ref.rollout.top_k=5",
    ])
    assert cfg.trainer.logger == ["console"]
    assert cfg.data.truncation == "left" and cfg.data.shuffle is False
    assert cfg.data.train_files == ["a.parquet", "b.parquet"] and cfg.data.val_files == ["c.parquet"]
    assert cfg.actor_rollout_ref.rollout.stop_token_ids == [2, 7]
    assert cfg.data.val_batch_size is None and cfg.actor_rollout_ref.rollout.top_k == 5
    assert load_config(None, ["trainer.logger=jsonl"]).trainer.logger == ["jsonl"]  # scalar -> list


@pytest.mark.parametrize("item, fragment", [
    ("data.train_batch_size", "key=value"),
    ("~trainer.logger", "deleting keys"),
    ("data..seed=1", "empty key segment"),
])
def test_malformed_override(item, fragment):
    assert fragment in _error(None, [item])


def test_missing_and_malformed_config_file(tmp_path):
    assert "does not exist" in _error(tmp_path / "nope.yaml")
    assert "mapping" in _error(_write(tmp_path, "- a\n- b\n"))
    assert "Hydra defaults" in _error(_write(tmp_path, "defaults:\n  - ppo_trainer\n"))


# --------------------------------------------------------------------------- shipped configs
def _offline_kind(path: Path) -> str | None:
    """``sft`` / ``dpo`` for the offline trainers' configs (``configs/sft_*.yaml``, ``configs/dpo_*.yaml``)."""
    kind = path.name.split("_")[0]
    return kind if kind in ("sft", "dpo") else None


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_validates_and_round_trips(path, tmp_path):
    kind = _offline_kind(path)
    if kind is not None:  # python -m jaxrl.sft / jaxrl.dpo
        from jaxrl.config.offline_loader import load_offline_config

        cfg = load_offline_config(kind, path)
        assert load_offline_config(kind, _write(tmp_path, config_to_yaml(cfg))) == cfg
        return
    cfg = load_config(path)
    dumped = _write(tmp_path, config_to_yaml(cfg))
    assert load_config(dumped) == cfg


def test_expected_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"quickstart.yaml", "gsm8k_grpo_smollm2_135m.yaml", "grpo_gsm8k_qwen3_1.7b.yaml",
            "ppo_quickstart.yaml", "dapo_quickstart.yaml", "math500_grpo_smollm2_135m.yaml"} <= names


def test_shared_dir_expands_in_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXRL_SHARED", str(tmp_path))
    cfg = load_config(REPO_ROOT / "configs" / "gsm8k_grpo_smollm2_135m.yaml")
    assert cfg.actor_rollout_ref.model.path == str(
        tmp_path.resolve() / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
    )


# ---------------------------------------------------------------------------- unknown keys
@pytest.mark.parametrize("override, bad, good", [
    ("actor_rollout_ref.actor.optim.lrr=1", "actor_rollout_ref.actor.optim.lrr", "actor_rollout_ref.actor.optim.lr"),
    ("trainr.total_epochs=3", "trainr.total_epochs", "trainer.total_epochs"),
    ("data.max_prompt_len=3", "data.max_prompt_length", "data.max_prompt_length"),
    ("actor_rollout_ref.rollout.val_kwargs.temprature=1", "val_kwargs.temprature",
     "actor_rollout_ref.rollout.val_kwargs.temperature"),
    ("actor_rollout_ref.rollout.ppo_mini_batch_size=1", "rollout.ppo_mini_batch_size",
     "actor_rollout_ref.actor.ppo_mini_batch_size"),
])
def test_unknown_override_key_suggests(override, bad, good):
    msg = _error(None, [override])
    assert msg.startswith(f"Unknown config key '{override.split('=')[0]}'; did you mean '{good}'?")
    assert bad in msg


def test_unknown_exact_message():
    msg = _error(None, ["actor_rollout_ref.actor.optim.lrr=1"])
    assert msg.startswith(
        "Unknown config key 'actor_rollout_ref.actor.optim.lrr'; did you mean 'actor_rollout_ref.actor.optim.lr'?"
    )


@pytest.mark.parametrize("text, bad, good", [
    ("actor_rollout_ref:\n  actor:\n    optim:\n      lrr: 1.0\n",
     "actor_rollout_ref.actor.optim.lrr", "actor_rollout_ref.actor.optim.lr"),
    ("trainr:\n  total_epochs: 2\n", "trainr.total_epochs", "trainer.total_epochs"),
    ("actor_rollout_ref:\n  actr:\n    ppo_epochs: 2\n",
     "actor_rollout_ref.actr.ppo_epochs", "actor_rollout_ref.actor.ppo_epochs"),
])
def test_unknown_yaml_key_suggests(tmp_path, text, bad, good):
    p = _write(tmp_path, text)
    msg = _error(p)
    assert f"Unknown config key '{bad}'; did you mean '{good}'?" in msg
    assert str(p) in msg


def test_unknown_key_without_suggestion_lists_valid_keys():
    assert "valid top-level sections: data, actor_rollout_ref" in _error(None, ["zzzzzz=1"])
    msg = _error(None, ["algorithm.qqqqqqqqqq=1"])
    assert "valid keys under 'algorithm'" in msg and "adv_estimator" in msg


def test_section_given_a_scalar():
    assert "'actor_rollout_ref.actor' is a config section" in _error(None, ["actor_rollout_ref.actor=3"])


# ------------------------------------------------------------------------------ wrong types
@pytest.mark.parametrize("override, key, expected", [
    ("data.train_batch_size=abc", "data.train_batch_size='abc'", "expected int"),
    ("data.train_batch_size=1.5", "data.train_batch_size=1.5", "expected int"),
    ("data.shuffle=maybe", "data.shuffle='maybe'", "expected bool"),
    ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr='fast'", "expected float"),
    ("trainer.total_epochs=null", "trainer.total_epochs=null", "expected int"),
    ("actor_rollout_ref.rollout.stop_token_ids=[eos]", "stop_token_ids", "a list of int"),
])
def test_wrong_type_names_key_and_type(override, key, expected):
    msg = _error(None, [override])
    assert key in msg and expected in msg


def test_wrong_type_in_yaml_names_file(tmp_path):
    p = _write(tmp_path, "trainer:\n  nnodes: two\n")
    msg = _error(p)
    assert "trainer.nnodes='two'" in msg and "expected int" in msg and str(p) in msg


# ------------------------------------------------------------------------ choices and ranges
@pytest.mark.parametrize("override, valid", [
    ("data.truncation=middle", ["'error'", "'left'", "'right'"]),
    ("actor_rollout_ref.rollout.name=hf", ["'jax'", "'vllm'", "'jetstream'"]),
    ("actor_rollout_ref.actor.kl_loss_type=k4", ["'low_var_kl'", "'k3'", "'abs'"]),
    ("actor_rollout_ref.actor.loss_agg_mode=sum", ["'token-mean'", "'seq-mean-token-sum-norm'"]),
    ("algorithm.adv_estimator=ppo", ["'gae'", "'grpo'", "'reinforce_plus_plus_baseline'", "'gpg'"]),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=clip-cov", ["'vanilla'", "'clip_cov'", "'kl_cov'", "'gspo'"]),
    ("actor_rollout_ref.actor.kl_loss_type=k5+", ["'low_var_kl+'", "'k3+'", "'full'"]),
    ("algorithm.kl_penalty=full", ["'kl'", "'low_var_kl'"]),
    ("algorithm.kl_ctrl.type=pid", ["'fixed'", "'adaptive'"]),
    ("algorithm.filter_groups.metric=reward", ["'acc'", "'score'", "'seq_reward'", "'seq_final_reward'"]),
    ("critic.loss_agg_mode=sum", ["'token-mean'", "'seq-mean-token-sum-norm'"]),
    ("critic.model.dtype=float16", ["'float32'", "'bfloat16'"]),
    ("critic.optim.lr_scheduler_type=linear", ["'constant'", "'cosine'"]),
    ("actor_rollout_ref.model.dtype=float16", ["'float32'", "'bfloat16'"]),
    ("actor_rollout_ref.model.recompute_granularity=block", ["'full'", "'selective'"]),
    ("critic.model.recompute_granularity=none", ["'full'", "'selective'"]),
    ("actor_rollout_ref.actor.optim.lr_scheduler_type=linear", ["'constant'", "'cosine'"]),
    ("trainer.logger=[console,mlflow]", ["'console'", "'jsonl'"]),
])
def test_bad_choice_names_valid_values(override, valid):
    msg = _error(None, [override])
    key, value = override.split("=")
    assert msg.startswith(key) and "is invalid" in msg
    assert all(v in msg for v in valid)


@pytest.mark.parametrize("override, expected", [
    ("data.train_batch_size=0", "an int >= 1"),
    ("data.val_max_samples=0", "-1 (off)"),
    ("actor_rollout_ref.actor.optim.lr=0", "(0.0, inf)"),
    ("actor_rollout_ref.actor.optim.betas=[0.9]", "two numbers"),
    ("actor_rollout_ref.actor.clip_ratio_c=1.0", "(1.0, inf)"),
    ("actor_rollout_ref.rollout.top_p=0", "(0.0, 1.0]"),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=1.5", "(0.0, 1.0]"),
    ("actor_rollout_ref.rollout.dtype=float16", "null (the model's dtype) or one of 'float32', 'bfloat16'"),
    ("trainer.test_freq=0", "-1 (off)"),
    ("algorithm.gamma=1.5", "[0.0, 1.0]"),
    ("actor_rollout_ref.rollout.max_new_tokens=600", "data.max_response_length=512"),
    ("custom_reward_function.name=not-a-name", "Python function name"),
    ("critic.optim.lr=0", "(0.0, inf)"),
    ("critic.optim.betas=[0.9,1.0]", "two numbers"),
    ("critic.cliprange_value=-0.1", "[0.0, inf)"),
    ("critic.ppo_epochs=0", "an int >= 1"),
    ("critic.ppo_micro_batch_size_per_gpu=0", "an int >= 1 or null"),
    ("critic.forward_micro_batch_size_per_gpu=0", "an int >= 1 or null"),
    ("critic.model.path=''", "a non-empty string or null"),
    ("actor_rollout_ref.actor.tis_imp_ratio_cap=0", "> 0, or -1 (off)"),
    ("actor_rollout_ref.actor.tis_imp_ratio_cap=-2", "> 0, or -1 (off)"),
    ("actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0", "(0.0, 1.0]"),
    ("actor_rollout_ref.actor.policy_loss.kl_cov_ratio=1.5", "(0.0, 1.0]"),
    ("actor_rollout_ref.actor.policy_loss.clip_cov_ub=0.5", "clip_cov_lb=1.0"),
    ("actor_rollout_ref.actor.policy_loss.ppo_kl_coef=-1", "[0.0, inf)"),
    ("algorithm.filter_groups.max_num_gen_batches=-1", "an int >= 0"),
    ("data.gen_batch_size=0", "an int >= 1"),
    ("reward_model.overlong_buffer.penalty_factor=-1", "[0.0, inf)"),
])
def test_range_errors(override, expected):
    msg = _error(None, [override])
    assert override.split("=")[0] in msg and expected in msg


def test_rollout_dtype_is_verls_key_and_jetstream_refuses_another_dtype():
    assert load_config(None).actor_rollout_ref.rollout.dtype is None  # null: the model's dtype
    cfg = load_config(None, ["actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.model.dtype=float32"])
    assert cfg.actor_rollout_ref.rollout.dtype == "bfloat16"
    assert not load_config_with_notes(None, ["actor_rollout_ref.rollout.dtype=bfloat16"]).notes  # a real key now
    msg = _error(None, ["actor_rollout_ref.rollout.name=jetstream", "actor_rollout_ref.rollout.dtype=float32"])
    assert "rollout.dtype='float32' differs from actor_rollout_ref.model.dtype='bfloat16'" in msg
    load_config(None, ["actor_rollout_ref.rollout.name=jetstream", "actor_rollout_ref.rollout.dtype=bfloat16"])


def test_reward_model_keys_as_verl_with_the_checks_when_enabled():
    cfg = load_config(None, ["actor_rollout_ref.model.path=/m/policy"])
    rm = cfg.reward_model
    assert (rm.enable, rm.model.path, rm.micro_batch_size_per_gpu, rm.max_length) == (False, None, None, None)
    assert rm.model.input_tokenizer == "/m/policy" and rm.combine == "replace"  # verl: the policy's path
    load_config(None, ["reward_model.micro_batch_size_per_gpu=0"])  # off: not checked
    msg = _error(None, ["reward_model.enable=True"])
    assert "reward_model.model.path=None" in msg and "ForSequenceClassification" in msg
    on = ["reward_model.enable=True", "reward_model.model.path=/m/rm"]
    assert "reward_model.micro_batch_size_per_gpu=0" in _error(None, on + ["reward_model.micro_batch_size_per_gpu=0"])
    assert "reward_model.max_length=0" in _error(None, on + ["reward_model.max_length=0"])
    assert "'replace', 'sum'" in _error(None, on + ["reward_model.combine=mean"])
    loaded = load_config_with_notes(None, on + [
        "reward_model.model.input_tokenizer=null", "reward_model.micro_batch_size_per_gpu=8",
        "reward_model.model.trust_remote_code=True", "reward_model.use_reward_loop=True",
        "reward_model.rollout.name=vllm", "reward_model.model.fsdp_config.param_offload=True",
    ])
    rm = loaded.config.reward_model
    assert (rm.enable, rm.model.path, rm.model.input_tokenizer, rm.micro_batch_size_per_gpu) == (True, "/m/rm", None, 8)
    assert {n.key for n in loaded.notes} == {"reward_model.model.trust_remote_code", "reward_model.use_reward_loop",
                                             "reward_model.rollout.name", "reward_model.model.fsdp_config.param_offload"}
    assert "reward_model.micro_batch_size=8 is not supported" in _error(None, on + ["reward_model.micro_batch_size=8"])
    # on a mesh the RM micro-batch is per device, as in verl: 6 per device x data 2 x fsdp 2 = 24 rows per call
    cfg = load_config(None, on + ["trainer.mesh.data=2", "trainer.mesh.fsdp=2", "trainer.mesh.tensor=1",
                                  "reward_model.micro_batch_size_per_gpu=6"])
    assert BatchPlan.from_config(cfg, batch_shards=4).reward_model_rows == 24
    assert BatchPlan.from_config(cfg).reward_model_rows == 6


def test_math_verifier_choices():
    assert load_config(None, []).reward_model.math_verifier == "rule"
    assert load_config(None, ["reward_model.math_verifier=math_verify"]).reward_model.math_verifier == "math_verify"
    msg = _error(None, ["reward_model.math_verifier=sympy"])
    assert "reward_model.math_verifier='sympy'" in msg and "'rule', 'math_verify'" in msg
    from jaxrl.rewards import MATH_VERIFIERS

    assert schema.MATH_VERIFIER_CHOICES == MATH_VERIFIERS


def test_validation_needs_val_files():
    msg = _error(None, ["data.val_files=null"])
    assert "data.val_files" in msg and "trainer.val_before_train" in msg
    cfg = load_config(None, ["data.val_files=null", "trainer.val_before_train=False"])
    assert cfg.data.val_files is None


def test_choice_lists_match_the_algorithms():
    from jaxrl.algorithms import (
        KL_CTRL_TYPES,
        KL_PENALTIES,
        KL_PENALTIES_IMPORTANCE_WEIGHTED,
        KL_PENALTIES_STRAIGHT_THROUGH,
        KL_PENALTY_FULL,
        LOSS_AGG_MODES,
        registered_adv_estimators,
        registered_policy_losses,
    )

    assert schema.KL_PENALTY_CHOICES == tuple(KL_PENALTIES)
    kl_loss_types = (tuple(KL_PENALTIES) + tuple(KL_PENALTIES_STRAIGHT_THROUGH) + (KL_PENALTY_FULL,)
                     + tuple(KL_PENALTIES_IMPORTANCE_WEIGHTED))
    assert schema.KL_LOSS_TYPE_CHOICES == kl_loss_types
    assert schema.LOSS_AGG_MODE_CHOICES == tuple(LOSS_AGG_MODES)
    assert schema.KL_CTRL_TYPE_CHOICES == tuple(KL_CTRL_TYPES)
    for choices, registry in ((schema.ADV_ESTIMATOR_CHOICES, registered_adv_estimators()),
                              (schema.POLICY_LOSS_MODE_CHOICES, registered_policy_losses())):
        assert sorted(choices) == sorted(registry) and len(set(choices)) == len(choices)
    assert set(schema.CRITIC_ADV_ESTIMATORS) <= set(schema.ADV_ESTIMATOR_CHOICES)


# ------------------------------------------------------------------------- algorithm catalogue
@pytest.mark.parametrize("estimator", schema.ADV_ESTIMATOR_CHOICES)
def test_every_adv_estimator_loads(estimator):
    assert load_config(None, [f"algorithm.adv_estimator={estimator}"]).algorithm.adv_estimator == estimator


@pytest.mark.parametrize("mode", schema.POLICY_LOSS_MODE_CHOICES)
def test_every_policy_loss_mode_loads(mode):
    cfg = load_config(None, [f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}"])
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == mode


def test_policy_loss_and_tis_defaults_follow_verl():
    a = load_config(None).actor_rollout_ref.actor
    pl = a.policy_loss
    assert (pl.clip_cov_ratio, pl.clip_cov_lb, pl.clip_cov_ub) == (0.0002, 1.0, 5.0)
    assert (pl.kl_cov_ratio, pl.ppo_kl_coef) == (0.0002, 0.1)
    assert a.tis_imp_ratio_cap == -1
    cfg = load_config(None, ["actor_rollout_ref.actor.tis_imp_ratio_cap=2.0",
                             "actor_rollout_ref.actor.kl_loss_type=k3+",
                             "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
                             "actor_rollout_ref.actor.policy_loss.clip_cov_ub=7.5"])
    assert cfg.actor_rollout_ref.actor.tis_imp_ratio_cap == 2.0
    assert cfg.actor_rollout_ref.actor.kl_loss_type == "k3+"
    assert cfg.actor_rollout_ref.actor.policy_loss.clip_cov_ub == 7.5
    full = load_config(None, ["actor_rollout_ref.actor.kl_loss_type=full"])
    assert full.actor_rollout_ref.actor.kl_loss_type == "full"


def test_kl_ctrl_keys():
    cfg = load_config(None, ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.05",
                             "algorithm.kl_ctrl.horizon=500", "algorithm.kl_ctrl.kl_coef=0.2",
                             "algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=low_var_kl"])
    k = cfg.algorithm.kl_ctrl
    assert (k.type, k.target_kl, k.horizon, k.kl_coef) == ("adaptive", 0.05, 500, 0.2)
    assert "algorithm.kl_ctrl.target_kl=0" in _error(None, ["algorithm.kl_ctrl.target_kl=0"])


# ------------------------------------------------------------------------------------- critic
def test_critic_defaults_follow_verl_and_the_actor():
    cfg = load_config(None, ["actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_epochs=2",
                             "actor_rollout_ref.model.dtype=float32", "actor_rollout_ref.model.param_dtype=bfloat16",
                             "actor_rollout_ref.model.enable_gradient_checkpointing=False",
                             "actor_rollout_ref.model.recompute_granularity=selective"])
    c = cfg.critic
    assert (c.optim.lr, c.optim.weight_decay, c.cliprange_value, c.grad_clip) == (1e-5, 0.01, 0.5, 1.0)
    assert (c.loss_agg_mode, c.shuffle, c.model.path) == ("token-mean", False, None)
    assert (c.ppo_mini_batch_size, c.ppo_epochs) == (64, 2)  # null -> the actor's
    assert (c.model.dtype, c.model.param_dtype, c.model.enable_gradient_checkpointing) == ("float32", "bfloat16", False)
    assert c.model.recompute_granularity == "selective"
    assert load_config(None, []).critic.model.recompute_granularity == "full"
    assert c.ppo_micro_batch_size_per_gpu is None and c.forward_micro_batch_size_per_gpu is None
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6  # the critic's optim section is its own


def test_critic_explicit_values_win():
    cfg = load_config(None, ["critic.ppo_mini_batch_size=32", "critic.ppo_micro_batch_size_per_gpu=8",
                             "critic.ppo_epochs=3", "critic.model.path=/m/critic", "critic.model.dtype=float32",
                             "critic.optim.lr=1e-3", "critic.cliprange_value=0.2", "critic.shuffle=True"])
    c = cfg.critic
    assert (c.ppo_mini_batch_size, c.ppo_micro_batch_size_per_gpu, c.forward_micro_batch_size_per_gpu) == (32, 8, 8)
    assert (c.ppo_epochs, c.model.path, c.model.dtype, c.optim.lr) == (3, "/m/critic", "float32", 1e-3)
    assert (c.cliprange_value, c.shuffle) == (0.2, True)
    cfg = load_config(None, ["critic.ppo_micro_batch_size_per_gpu=8", "critic.forward_micro_batch_size_per_gpu=32"])
    assert cfg.critic.forward_micro_batch_size_per_gpu == 32


def test_critic_batch_arithmetic_checked_only_when_the_critic_is_used():
    bad = _SMALL + ["critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=4",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    load_config(None, bad)  # grpo: no critic, its section is not used
    msg = _error(None, bad + ["algorithm.adv_estimator=gae"])
    assert "critic.ppo_micro_batch_size_per_gpu=4" in msg and "6 responses" in msg
    msg = _error(None, _SMALL + ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                                 "critic.ppo_mini_batch_size=9"])
    assert "critic.ppo_mini_batch_size=9" in msg and "data.train_batch_size=8" in msg
    cfg = load_config(None, _SMALL + ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                                      "critic.ppo_micro_batch_size_per_gpu=3"])
    assert cfg.critic.ppo_mini_batch_size == 4


def test_critic_compat_keys():
    loaded = load_config_with_notes(None, [
        "critic.model.fsdp_config.param_offload=True", "critic.strategy=fsdp", "critic.model.use_remove_padding=True",
        "critic.optim.warmup_style=cosine", "critic.optim.clip_grad=0.5", "critic.enable=True",
    ])
    keys = [n.key for n in loaded.notes]
    assert keys == ["critic.model.fsdp_config.param_offload", "critic.strategy",
                    "critic.optim.warmup_style", "critic.optim.clip_grad", "critic.enable"]
    assert loaded.config.critic.optim.lr_scheduler_type == "cosine" and loaded.config.critic.grad_clip == 0.5
    assert loaded.config.critic.model.use_remove_padding is True  # a real key now (packed value model)
    assert "critic.model.lora_adapter_path='/a' is not supported" in _error(None, ["critic.model.lora_adapter_path=/a"])
    # no wildcard swallows a typo of a real critic key
    assert "did you mean 'critic.optim.lr'" in _error(None, ["critic.optim.lrr=1e-5"])
    assert "did you mean 'critic.cliprange_value'" in _error(None, ["critic.cliprange_val=0.2"])


# --------------------------------------------------------------------------------------- DAPO
def test_dapo_defaults():
    cfg = load_config(None)
    ob, fg = cfg.reward_model.overlong_buffer, cfg.algorithm.filter_groups
    assert (ob.enable, ob.len, ob.penalty_factor, ob.log) == (False, 4096, 1.0, False)
    assert (fg.enable, fg.metric, fg.max_num_gen_batches) == (False, "acc", 0)
    assert cfg.data.gen_batch_size == cfg.data.train_batch_size == 1024  # null -> train_batch_size


def test_overlong_buffer_len_must_fit_the_response_when_enabled():
    load_config(None, ["reward_model.overlong_buffer.len=4096"])  # off: not checked
    msg = _error(None, ["reward_model.overlong_buffer.enable=True"])  # 4096 > 512
    assert "reward_model.overlong_buffer.len=4096" in msg and "data.max_response_length=512" in msg
    assert "overlong_buffer.len=0" in _error(None, ["reward_model.overlong_buffer.enable=True",
                                                    "reward_model.overlong_buffer.len=0"])
    cfg = load_config(None, ["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=512"])
    assert cfg.reward_model.overlong_buffer.len == 512


def test_gen_batch_size_needs_group_filtering():
    msg = _error(None, ["data.gen_batch_size=2048"])
    assert "data.gen_batch_size=2048" in msg and "algorithm.filter_groups.enable=True" in msg
    cfg = load_config(None, ["data.gen_batch_size=1536", "algorithm.filter_groups.enable=True",
                             "algorithm.filter_groups.metric=seq_final_reward",
                             "algorithm.filter_groups.max_num_gen_batches=10"])
    assert cfg.data.gen_batch_size == 1536 and cfg.algorithm.filter_groups.metric == "seq_final_reward"
    msg = _error(None, ["trainer.n_gpus_per_node=4", "data.train_batch_size=8", "data.gen_batch_size=6",
                        "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                        "algorithm.filter_groups.enable=True"])
    assert "data.gen_batch_size=6" in msg and "4 devices" in msg


def test_shipped_ppo_and_dapo_configs():
    ppo = load_config(REPO_ROOT / "configs" / "ppo_quickstart.yaml")
    assert ppo.algorithm.adv_estimator == "gae" and ppo.trainer.total_training_steps == 40
    assert ppo.critic.model.path is None and ppo.critic.optim.lr > ppo.actor_rollout_ref.actor.optim.lr
    dapo = load_config(REPO_ROOT / "configs" / "dapo_quickstart.yaml")
    a = dapo.actor_rollout_ref.actor
    assert (a.clip_ratio_low, a.clip_ratio_high, a.use_kl_loss) == (0.2, 0.28, False)
    ob = dapo.reward_model.overlong_buffer
    assert ob.enable and ob.len < dapo.data.max_response_length
    assert dapo.algorithm.filter_groups.enable and dapo.data.gen_batch_size > dapo.data.train_batch_size


# -------------------------------------------------------------------------- batch arithmetic
_SMALL = ["trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=3"]


def test_batch_arithmetic_ok_follows_verl():
    # verl splits 8 x 3 = 24 responses into mini-batches of 4 x 3 = 12 (6 per device), micro 3 divides 6
    cfg = load_config(None, _SMALL + ["actor_rollout_ref.actor.ppo_mini_batch_size=4",
                                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"])
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 3
    # verl does not require train_batch_size % ppo_mini_batch_size == 0 (its own GSM8K recipe: 1024 / 80)
    load_config(None, _SMALL + ["actor_rollout_ref.actor.ppo_mini_batch_size=3"])


def test_micro_batch_must_divide_per_device_mini_batch():
    msg = _error(None, _SMALL + ["actor_rollout_ref.actor.ppo_mini_batch_size=4",
                                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4" in msg and "6 responses" in msg


def test_mini_batch_larger_than_train_batch():
    msg = _error(None, _SMALL + ["actor_rollout_ref.actor.ppo_mini_batch_size=9"])
    assert "ppo_mini_batch_size=9" in msg and "data.train_batch_size=8" in msg


def test_train_batch_must_split_over_devices():
    msg = _error(None, ["trainer.n_gpus_per_node=4", "data.train_batch_size=6", "actor_rollout_ref.rollout.n=1",
                        "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    assert "data.train_batch_size=6" in msg and "4 devices" in msg


def test_mini_batch_fewer_responses_than_devices():
    msg = _error(None, ["trainer.n_gpus_per_node=8", "data.train_batch_size=16",
                        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2"])
    assert "ppo_mini_batch_size=2" in msg and "8 devices" in msg


def test_tensor_parallel_must_divide_world_for_vllm():
    base = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=4"]
    load_config(None, base)  # the jax sampler ignores it
    msg = _error(None, base + ["actor_rollout_ref.rollout.name=vllm"])
    assert "tensor_model_parallel_size=4" in msg


# ---------------------------------------------------------------------------- interpolation
def test_default_local_dir_interpolates_names():
    cfg = load_config(None, ["trainer.project_name=proj", "trainer.experiment_name=exp1"])
    assert cfg.trainer.default_local_dir == "checkpoints/proj/exp1"


def test_yaml_interpolation_and_env(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRL_TEST_DIR", "/data/x")
    p = _write(tmp_path, "trainer:\n  experiment_name: run_${data.train_batch_size}\n"
                         "data:\n  train_batch_size: 256\n  train_files: ${oc.env:JAXRL_TEST_DIR}/train.parquet\n")
    cfg = load_config(p)
    assert cfg.trainer.experiment_name == "run_256"
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/run_256"
    assert cfg.data.train_files == ["/data/x/train.parquet"]


def test_bad_interpolation_suggests():
    msg = _error(None, ["trainer.default_local_dir=out/${trainer.projct_name}"])
    assert "trainer.default_local_dir" in msg and "did you mean 'trainer.project_name'?" in msg


# ------------------------------------------------------------------------------ compat notes
def test_fsdp_config_keys_give_notes():
    loaded = load_config_with_notes(None, [
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "actor_rollout_ref.model.use_remove_padding=True",
    ])
    by_key = {n.key: n for n in loaded.notes}
    assert list(by_key) == [  # use_remove_padding acts (packed rows): no note
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
        "actor_rollout_ref.ref.fsdp_config.param_offload",
    ]
    assert "`fsdp` axis" in by_key["actor_rollout_ref.ref.fsdp_config.param_offload"].note
    assert by_key["actor_rollout_ref.actor.fsdp_config.optimizer_offload"].value is True
    assert "\n" not in str(by_key["actor_rollout_ref.actor.fsdp_config.param_offload"])
    assert loaded.config.actor_rollout_ref.model.use_remove_padding is True


def test_fsdp_config_in_yaml_gives_notes(tmp_path):
    p = _write(tmp_path, "actor_rollout_ref:\n  actor:\n    fsdp_config:\n      param_offload: true\n"
                         "      wrap_policy:\n        min_num_params: 0\n")
    keys = [n.key for n in load_config_with_notes(p).notes]
    assert keys == ["actor_rollout_ref.actor.fsdp_config.param_offload",
                    "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params"]


def test_no_notes_without_compat_keys():
    assert load_config_with_notes(None, ["data.train_batch_size=512"]).notes == ()


def test_renamed_verl_key_moves_value():
    loaded = load_config_with_notes(None, ["actor_rollout_ref.actor.optim.warmup_style=cosine"])
    assert loaded.config.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    assert "lr_scheduler_type" in loaded.notes[0].note


def test_unsupported_verl_feature_value_rejected():
    msg = _error(None, ["actor_rollout_ref.model.lora_adapter_path=/adapters/a"])
    assert "actor_rollout_ref.model.lora_adapter_path='/adapters/a' is not supported" in msg and "valid: None" in msg
    notes = load_config_with_notes(None, ["actor_rollout_ref.model.lora_adapter_path=null"]).notes
    assert notes[0].key == "actor_rollout_ref.model.lora_adapter_path"
    assert "reward_model.use_dynamic_bsz=True is not supported" in _error(None, ["reward_model.use_dynamic_bsz=True"])


def test_lora_keys_are_verls_and_bad_values_are_one_line_errors():
    """actor_rollout_ref.model.{lora_rank, lora_alpha, target_modules, exclude_modules} and critic.model's are real
    keys (no notes), verl's defaults; rank 0 is full fine-tuning."""
    default = load_config(None)
    m = default.actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, m.target_modules, m.exclude_modules) == (0, 16, "all-linear", None)
    assert (default.critic.model.lora_rank, default.critic.model.target_modules) == (0, "all-linear")
    loaded = load_config_with_notes(None, [
        "actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]", "actor_rollout_ref.model.exclude_modules=.*mlp.*",
        "critic.model.lora_rank=8", "critic.model.target_modules=all-linear"])
    assert loaded.notes == ()
    m = loaded.config.actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, m.target_modules, m.exclude_modules) == (64, 32.0, ["q_proj", "v_proj"],
                                                                                ".*mlp.*")
    assert loaded.config.critic.model.lora_rank == 8
    lora = ["actor_rollout_ref.model.lora_rank=8"]
    for overrides, expected in [
        (["actor_rollout_ref.model.lora_rank=-8"], "actor_rollout_ref.model.lora_rank=-8 is invalid; expected an int"),
        (lora + ["actor_rollout_ref.model.lora_alpha=0"], "actor_rollout_ref.model.lora_alpha=0.0 is invalid"),
        (lora + ["actor_rollout_ref.model.target_modules=[lm_head]"], "LoRA on lm_head is not supported"),
        (lora + ["actor_rollout_ref.model.target_modules=(q"], "a regular expression (missing )"),
        (lora + ["actor_rollout_ref.model.exclude_modules=[]"], "actor_rollout_ref.model.exclude_modules=[] is invalid"),
        (["critic.model.lora_rank=4", "critic.model.target_modules=7"], "critic.model.target_modules=7 is invalid"),
    ]:
        msg = _error(None, overrides)
        assert expected in msg and "\n" not in msg, msg
    load_config(None, ["actor_rollout_ref.model.target_modules=7"])  # unused (and unchecked) at rank 0, as in verl


def test_dynamic_batch_and_packing_keys_act_with_verl_defaults():
    """verl's dynamic-batch keys are real: the log-prob / reference / critic switches and budgets follow the actor's
    when unset (verl's oc.select defaults), the critic packs with the model key, and the plan carries the budgets."""
    from jaxrl.config.batch_plan import BatchPlan

    loaded = load_config_with_notes(None, [
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=3000",
        "actor_rollout_ref.model.use_remove_padding=True", "critic.ppo_max_token_len_per_gpu=6000",
        "data.max_prompt_length=512", "data.max_response_length=1024",
    ])
    assert loaded.notes == ()
    c = loaded.config
    arr = c.actor_rollout_ref
    assert arr.rollout.log_prob_use_dynamic_bsz is True and arr.rollout.log_prob_max_token_len_per_gpu == 3000
    assert arr.ref.log_prob_use_dynamic_bsz is True and arr.ref.log_prob_max_token_len_per_gpu == 3000
    assert c.critic.use_dynamic_bsz is True and c.critic.forward_max_token_len_per_gpu == 6000
    assert c.critic.model.use_remove_padding is True
    plan = BatchPlan.from_config(c, batch_shards=2)
    assert (plan.actor.max_token_len, plan.actor.forward_max_token_len, plan.ref_max_token_len) == (3000,) * 3
    assert (plan.critic.max_token_len, plan.critic.forward_max_token_len) == (6000, 6000)
    assert plan.actor.remove_padding and plan.critic.remove_padding
    off = BatchPlan.from_config(load_config(None, ["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True"]))
    assert off.actor.max_token_len is None and off.actor.forward_max_token_len == 16384
    assert not off.actor.remove_padding
    # a budget must hold the longest sequence (verl asserts max_token_len >= the sequence length)
    msg = _error(None, ["actor_rollout_ref.actor.use_dynamic_bsz=True",
                        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000", "data.max_prompt_length=512",
                        "data.max_response_length=1024"])
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000 is below the longest sequence" in msg
    assert "valid: >= 1536" in msg and "\n" not in msg
    assert "ppo_max_token_len_per_gpu" in _error(None, ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=0"])
    # under a token budget the micro-batch row count is unused, so verl's divisibility rule does not apply
    odd = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"]
    assert "must divide the per-device mini-batch" in _error(None, odd)
    load_config(None, odd + ["actor_rollout_ref.actor.use_dynamic_bsz=True"])


def test_wildcards_never_swallow_schema_typos():
    # reward_model.* has verl-only keys in the table, but a typo of a real key is still an error
    assert "did you mean 'reward_model.enable'" in _error(None, ["reward_model.enabel=True"])
    notes = load_config_with_notes(None, ["critic.model.fsdp_config.param_offload=True",
                                          "algorithm._target_=x.AlgoConfig"]).notes
    assert [n.key for n in notes] == ["critic.model.fsdp_config.param_offload", "algorithm._target_"]


def test_compat_tables_are_consistent():
    leaves = set(valid_keys())
    for key in compat.REQUIRED_VALUES:
        assert key in compat.NOTES and key not in leaves, key
    for old, new in compat.RENAMES.items():
        assert new in leaves and old not in leaves, old
    exact_schema = {k for k in compat.NOTES if k in leaves}
    assert exact_schema == {
        "actor_rollout_ref.rollout.free_cache_engine",
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
    }


def test_dataclass_defaults_match_loaded_defaults(monkeypatch):
    """The schema is the single source of truth: the loader adds nothing but the documented fills."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fresh = JaxRLConfig()
    loaded = load_config(None)
    assert loaded.algorithm == fresh.algorithm
    rm_model = dataclasses.replace(fresh.reward_model.model, input_tokenizer=fresh.actor_rollout_ref.model.path)
    assert loaded.reward_model == dataclasses.replace(fresh.reward_model, model=rm_model)  # ${...model.path}
    assert loaded.trainer == dataclasses.replace(fresh.trainer, default_local_dir="checkpoints/verl_examples/gsm8k",
                                                 launcher="local")  # null -> local without RAY_ADDRESS
    assert loaded.actor_rollout_ref.actor == fresh.actor_rollout_ref.actor
    assert loaded.actor_rollout_ref.model == fresh.actor_rollout_ref.model
    assert yaml.safe_load(config_to_yaml(loaded))["trainer"]["logger"] == fresh.trainer.logger


@pytest.mark.parametrize("extra, fragment", [
    (["actor_rollout_ref.actor.ppo_epochs=2"], "ppo_epochs=2 (needs 1)"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=64"], "ppo_mini_batch_size=64 (needs data.train_batch_size=256"),
    (["algorithm.use_kl_in_reward=true"], "use_kl_in_reward=True (the reward's KL needs the old log-probs)"),
])
def test_skipping_the_old_pass_needs_on_policy_updates(extra, fragment):
    base = ["actor_rollout_ref.actor.recompute_old_log_prob=false", "data.train_batch_size=256",
            "actor_rollout_ref.actor.ppo_mini_batch_size=256"]
    msg = _error(None, base + extra)
    assert "recompute_old_log_prob=False is only exact when every update is on-policy" in msg and fragment in msg
    assert load_config(None, base).actor_rollout_ref.actor.recompute_old_log_prob is False


def test_use_fused_kernels_is_a_real_key_and_refuses_the_full_kl():
    """``actor_rollout_ref.model.use_fused_kernels`` acts (the update's LM head in position chunks): no note, the value
    kept, the actor built with it; with ``kl_loss_type='full'`` (which needs the whole logits) a one-line error."""
    loaded = load_config_with_notes(None, ["actor_rollout_ref.model.use_fused_kernels=True",
                                           "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"])
    assert [n.key for n in loaded.notes] == ["actor_rollout_ref.model.fused_kernel_options.impl_backend"]
    assert loaded.config.actor_rollout_ref.model.use_fused_kernels is True
    assert load_config(None, []).actor_rollout_ref.model.use_fused_kernels is False  # verl's default
    with pytest.raises(ConfigError) as e:
        load_config(None, ["actor_rollout_ref.model.use_fused_kernels=True", "actor_rollout_ref.actor.use_kl_loss=True",
                           "actor_rollout_ref.actor.kl_loss_type=full"])
    assert "use_fused_kernels=True" in str(e.value) and "kl_loss_type='full'" in str(e.value)
    assert "\n" not in str(e.value)
