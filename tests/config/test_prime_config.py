"""PRIME's config: verl's recipe/prime keys are accepted (real fields or compat notes), its defaults derived under
algorithm.adv_estimator=prime, and what PRIME cannot do refused with one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.config.batch_plan import prime_plan
from jaxrl.config.loader import load_config_with_notes

REPO = Path(__file__).resolve().parents[2]
QUICK = REPO / "configs" / "prime_quickstart.yaml"

# verl's recipe/prime/config/prime_trainer.yaml and run_prime_qwen.sh keys (values as there, sizes for the quickstart)
VERL_PRIME = [
    "algorithm.adv_estimator=prime", "reward_model.enable=True", "reward_model.strategy=fsdp",
    "reward_model.model.path=null", "reward_model.model.ref_path=null", "reward_model.model.use_remove_padding=True",
    "reward_model.model.use_fused_kernels=False", "reward_model.model.fused_kernel_options.impl_backend=torch",
    "reward_model.model.tokenizer_path=stories260K", "reward_model.model.enable_gradient_checkpointing=False",
    "reward_model.model.ref_type=freeze", "reward_model.model.fsdp_config.min_num_params=0",
    "reward_model.model.fsdp_config.param_offload=False", "reward_model.model.fsdp_config.optimizer_offload=False",
    "reward_model.model.update=before", "reward_model.model.optim.lr=1e-6", "reward_model.model.optim.lr_warmup_steps=-1",
    "reward_model.model.optim.lr_warmup_steps_ratio=0.0", "reward_model.model.optim.lr_scheduler_type=constant",
    "reward_model.model.optim.total_training_steps=-1", "reward_model.model.optim.weight_decay=0.0",
    "reward_model.model.optim.grad_clip=10.0", "reward_model.model.beta_train=0.05", "reward_model.model.loss_type=ce",
    "reward_model.model.input_tokenizer=null", "reward_model.prime_granularity=token",
    "reward_model.prime_norm=batch_norm", "reward_model.mini_batch_size=64", "reward_model.micro_batch_size_per_gpu=32",
    "reward_model.reward_manager=prime", "algorithm.reward_gt_coef=5", "algorithm.reward_dpo_coef=5",
    "algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.kl_coef=0.0", "data.filter_accuracy=True",
    "data.accuracy_lower_bound=0.2", "data.accuracy_upper_bound=0.8", "data.oversample_factor=4.0",
    "data.filter_truncate=True", "data.truncation=right",
]


def test_verl_prime_keys_are_accepted():
    loaded = load_config_with_notes(QUICK, VERL_PRIME)
    cfg = loaded.config
    rm = cfg.reward_model
    assert (rm.model.update, rm.model.beta_train, rm.model.loss_type, rm.model.ref_type) == ("before", 0.05, "ce",
                                                                                             "freeze")
    assert (rm.model.optim.lr, rm.model.optim.grad_clip, rm.model.optim.weight_decay) == (1e-6, 10.0, 0.0)
    assert (rm.prime_granularity, rm.prime_norm, rm.mini_batch_size) == ("token", "batch_norm", 64)
    assert (cfg.algorithm.reward_gt_coef, cfg.algorithm.reward_dpo_coef) == (5.0, 5.0)
    d = cfg.data
    assert (d.filter_accuracy, d.accuracy_lower_bound, d.accuracy_upper_bound, d.oversample_factor,
            d.filter_truncate) == (True, 0.2, 0.8, 4.0, True)
    noted = {n.key for n in loaded.notes}
    assert {"reward_model.model.tokenizer_path", "reward_model.model.fused_kernel_options.impl_backend",
            "reward_model.model.optim.total_training_steps", "reward_model.model.fsdp_config.param_offload"} <= noted


def test_prime_defaults_follow_verls_recipe_and_stay_off_elsewhere():
    cfg = load_config(None, ["algorithm.adv_estimator=prime"])
    d, rm = cfg.data, cfg.reward_model
    assert (d.filter_accuracy, d.oversample_factor, d.filter_truncate) == (True, 4.0, True)
    assert (rm.model.update, rm.model.beta_train, rm.model.optim.lr, rm.model.optim.grad_clip) == ("before", 0.05,
                                                                                                  1e-6, 10.0)
    assert (cfg.algorithm.reward_dpo_coef, cfg.algorithm.reward_gt_coef) == (5.0, 5.0)
    assert rm.mini_batch_size == cfg.actor_rollout_ref.actor.ppo_mini_batch_size  # verl's interpolation
    grpo = load_config(None, ["algorithm.adv_estimator=grpo"]).data
    assert (grpo.filter_accuracy, grpo.oversample_factor, grpo.filter_truncate) == (False, 1.0, False)


def test_the_prm_plan_counts_responses_as_verl():
    cfg = load_config(QUICK)
    plan = prime_plan(cfg)
    assert (plan.mini_batch_rows, plan.micro_batch_rows, plan.updates_per_step) == (64, 32, 1)
    cfg = load_config(QUICK, ["reward_model.mini_batch_size=16", "reward_model.micro_batch_size_per_gpu=8"])
    assert prime_plan(cfg).updates_per_step == 4  # 16 prompts x 4 responses in mini-batches of 16 responses


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.adv_estimator=grpo", "data.filter_accuracy=true"], "data.filter_accuracy=True filter prompts for PRIME"),
    (["algorithm.adv_estimator=grpo", "data.oversample_factor=2"], "data.oversample_factor=2.0 filter prompts"),
    (["algorithm.adv_estimator=grpo", "algorithm.reward_gt_coef=1"], "algorithm.reward_gt_coef=1.0 is set, but"),
    (["algorithm.use_kl_in_reward=true"], "does not combine with algorithm.use_kl_in_reward=True"),
    (["algorithm.filter_groups.enable=true"], "does not combine with algorithm.filter_groups.enable=True"),
    (["reward_model.model.input_tokenizer=other/tok"], "reward_model.model.input_tokenizer='other/tok'"),
    (["reward_model.model.loss_type=dpo"], "reward_model.model.loss_type='dpo' is invalid; expected 'ce'"),
    (["reward_model.model.update=reverse"], "reward_model.model.update='reverse' is invalid"),
    (["reward_model.model.ref_type=ema"], "reward_model.model.ref_type='ema' is invalid"),
    (["reward_model.model.beta_train=0"], "reward_model.model.beta_train=0"),
    (["reward_model.prime_granularity=step"], "reward_model.prime_granularity='step' is invalid"),
    (["reward_model.prime_norm=l2"], "reward_model.prime_norm='l2' is invalid"),
    (["data.accuracy_lower_bound=0.9"], "data.accuracy_upper_bound=0.8 is invalid"),
    (["data.oversample_factor=0.5"], "data.oversample_factor=0.5 is invalid"),
    (["data.oversample_factor=1.5", "data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "reward_model.mini_batch_size=12",
      "reward_model.micro_batch_size_per_gpu=4"],
     "must be a whole number of prompts"),
    (["reward_model.mini_batch_size=48"], "reward_model.mini_batch_size (responses) = 48 must be divisible by"),
])
def test_what_prime_cannot_do_is_refused_in_one_line(overrides, message):
    base = None if "algorithm.adv_estimator=grpo" in overrides else QUICK  # the quickstart filters: PRIME's
    with pytest.raises(ConfigError) as e:
        load_config(base, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)
