"""jaxrl.config: schema defaults, YAML + override merging, validation messages, verl compat notes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from jaxrl.config import ConfigError, JaxRLConfig, config_to_yaml, load_config, load_config_with_notes, valid_keys
from jaxrl.config import compat, schema
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
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_validates_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    dumped = _write(tmp_path, config_to_yaml(cfg))
    assert load_config(dumped) == cfg


def test_expected_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"quickstart.yaml", "gsm8k_grpo_smollm2_135m.yaml", "grpo_gsm8k_qwen3_1.7b.yaml"} <= names


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
    ("algorithm.adv_estimator=gae", ["'grpo'"]),
    ("actor_rollout_ref.model.dtype=float16", ["'float32'", "'bfloat16'"]),
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
    ("trainer.test_freq=0", "-1 (off)"),
    ("algorithm.gamma=1.5", "[0.0, 1.0]"),
    ("actor_rollout_ref.rollout.max_new_tokens=600", "data.max_response_length=512"),
    ("custom_reward_function.name=not-a-name", "Python function name"),
])
def test_range_errors(override, expected):
    msg = _error(None, [override])
    assert override.split("=")[0] in msg and expected in msg


def test_reward_model_enable_not_supported():
    msg = _error(None, ["reward_model.enable=True"])
    assert "reward_model.enable" in msg and "not supported yet" in msg


def test_validation_needs_val_files():
    msg = _error(None, ["data.val_files=null"])
    assert "data.val_files" in msg and "trainer.val_before_train" in msg
    cfg = load_config(None, ["data.val_files=null", "trainer.val_before_train=False"])
    assert cfg.data.val_files is None


def test_choice_lists_match_the_algorithms():
    from jaxrl.algorithms import LOSS_AGG_MODES, KL_PENALTIES

    assert schema.KL_PENALTY_CHOICES == tuple(KL_PENALTIES)
    assert schema.LOSS_AGG_MODE_CHOICES == tuple(LOSS_AGG_MODES)


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
    assert list(by_key) == [
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
        "actor_rollout_ref.ref.fsdp_config.param_offload",
        "actor_rollout_ref.model.use_remove_padding",
    ]
    assert "`fsdp` axis" in by_key["actor_rollout_ref.ref.fsdp_config.param_offload"].note
    assert by_key["actor_rollout_ref.actor.fsdp_config.optimizer_offload"].value is True
    assert "\n" not in str(by_key["actor_rollout_ref.actor.fsdp_config.param_offload"])
    assert loaded.config.actor_rollout_ref.model.use_remove_padding is True  # a real (no-op) field


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
    msg = _error(None, ["actor_rollout_ref.model.lora_rank=8"])
    assert "actor_rollout_ref.model.lora_rank=8 is not supported" in msg and "valid: 0" in msg
    assert load_config_with_notes(None, ["actor_rollout_ref.model.lora_rank=0"]).notes[0].key.endswith("lora_rank")
    assert "use_dynamic_bsz=True is not supported" in _error(None, ["actor_rollout_ref.actor.use_dynamic_bsz=True"])


def test_wildcards_never_swallow_schema_typos():
    # reward_model.* has verl-only keys in the table, but a typo of a real key is still an error
    assert "did you mean 'reward_model.enable'" in _error(None, ["reward_model.enabel=True"])
    notes = load_config_with_notes(None, ["critic.optim.lr=1e-5", "algorithm._target_=x.AlgoConfig"]).notes
    assert [n.key for n in notes] == ["critic.optim.lr", "algorithm._target_"]


def test_compat_tables_are_consistent():
    leaves = set(valid_keys())
    for key in compat.REQUIRED_VALUES:
        assert key in compat.NOTES and key not in leaves, key
    for old, new in compat.RENAMES.items():
        assert new in leaves and old not in leaves, old
    exact_schema = {k for k in compat.NOTES if k in leaves}
    assert exact_schema == {
        "actor_rollout_ref.model.use_remove_padding",
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
    }


def test_dataclass_defaults_match_loaded_defaults():
    """The schema is the single source of truth: the loader adds nothing but the documented fills."""
    fresh = JaxRLConfig()
    loaded = load_config(None)
    assert loaded.algorithm == fresh.algorithm and loaded.reward_model == fresh.reward_model
    assert loaded.trainer == dataclasses.replace(fresh.trainer, default_local_dir="checkpoints/verl_examples/gsm8k")
    assert loaded.actor_rollout_ref.actor == fresh.actor_rollout_ref.actor
    assert loaded.actor_rollout_ref.model == fresh.actor_rollout_ref.model
    assert yaml.safe_load(config_to_yaml(loaded))["trainer"]["logger"] == fresh.trainer.logger
