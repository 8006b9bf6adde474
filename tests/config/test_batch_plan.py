"""The batch plan: one derivation of a run's row counts, equal to the numbers the roles used before it existed."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.config.batch_plan import BatchPlan, RolePlan, micro_rows

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _old_numbers(cfg) -> dict:
    """The arithmetic as actor.py / critic.py / trainer.build wrote it out before the plan (verl's formulas)."""
    a, k, r, n = cfg.actor_rollout_ref.actor, cfg.critic, cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.rollout.n
    rows = cfg.data.train_batch_size * n
    a_mini = a.ppo_mini_batch_size * n
    k_mini = int(k.ppo_mini_batch_size) * int(n)
    k_micro = k_mini if k.ppo_micro_batch_size_per_gpu is None else int(k.ppo_micro_batch_size_per_gpu)
    return {
        "rows_per_step": rows,
        "actor_mini": a_mini, "actor_micro": a.ppo_micro_batch_size_per_gpu,
        "actor_updates": a.ppo_epochs * math.ceil(rows / a_mini),
        "log_prob": r.log_prob_micro_batch_size_per_gpu,
        "ref": cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu or r.log_prob_micro_batch_size_per_gpu,
        "critic_mini": k_mini, "critic_micro": k_micro,
        "critic_forward": k_micro if k.forward_micro_batch_size_per_gpu is None
        else int(k.forward_micro_batch_size_per_gpu),
        "critic_updates": int(k.ppo_epochs) * math.ceil(rows / k_mini),
    }


def _plan_numbers(plan: BatchPlan) -> dict:
    return {
        "rows_per_step": plan.rows_per_step,
        "actor_mini": plan.actor.mini_batch_rows, "actor_micro": plan.actor.micro_batch_rows,
        "actor_updates": plan.actor.updates_per_step, "log_prob": plan.actor.forward_rows,
        "ref": plan.ref_log_prob_rows,
        "critic_mini": plan.critic.mini_batch_rows, "critic_micro": plan.critic.micro_batch_rows,
        "critic_forward": plan.critic.forward_rows, "critic_updates": plan.critic.updates_per_step,
    }


@pytest.mark.parametrize("name, overrides", [
    ("quickstart.yaml", []),
    ("ppo_quickstart.yaml", []),
    ("dapo_quickstart.yaml", []),
    ("grpo_gsm8k_qwen3_1.7b.yaml", []),
    ("quickstart.yaml", ["actor_rollout_ref.actor.ppo_epochs=3", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=4",
                         "critic.ppo_mini_batch_size=8", "critic.ppo_epochs=2"]),
])
def test_plan_equals_the_numbers_the_roles_used(name, overrides):
    cfg = load_config(CONFIGS / name, overrides)
    assert _plan_numbers(BatchPlan.from_config(cfg)) == _old_numbers(cfg)
    # without a mesh there is one data-parallel device: per-device sizes are the sizes (the single-device run)
    assert BatchPlan.from_config(cfg, batch_shards=1) == BatchPlan.from_config(cfg)
    assert BatchPlan.from_config(cfg).batch_shards == 1


def test_verl_qwen3_recipe():
    """verl's Qwen3-1.7B GSM8K command line: 80 prompts x n=3 = 240 responses per mini-batch, 12 micro-batches of
    20; 1024 x 3 = 3072 responses per step, so 13 mini-batches (the last of 192 responses, as verl's FSDP actor)."""
    plan = BatchPlan.from_config(load_config(CONFIGS / "grpo_gsm8k_qwen3_1.7b.yaml"))
    a = plan.actor
    assert (plan.rows_per_step, a.mini_batch_rows, a.micro_batch_rows, a.micro_batches_per_mini) == (3072, 240, 20, 12)
    assert (a.mini_batches_per_step, a.updates_per_step, a.forward_rows, plan.ref_log_prob_rows) == (13, 13, 20, 20)
    assert plan.rows_per_step - (a.mini_batches_per_step - 1) * a.mini_batch_rows == 192


def test_unset_sizes_resolve_as_documented():
    cfg = load_config(None, ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.n_gpus_per_node=1"])
    plan = BatchPlan.from_config(cfg)
    assert plan.actor.micro_batch_size_per_gpu is None and plan.actor.micro_batch_rows == 8  # the mini-batch
    assert plan.actor.forward_rows == plan.ref_log_prob_rows == 16  # log-probs: the whole step in one call
    assert (plan.critic.mini_batch_rows, plan.critic.micro_batch_rows, plan.critic.forward_rows) == (8, 8, 8)
    cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 4
    assert BatchPlan.from_config(cfg).ref_log_prob_rows == 4  # the reference follows the rollout's log-prob size
    assert micro_rows(None, 7) == 7 and micro_rows(3, 7) == 3
    assert micro_rows(3, 7, batch_shards=4) == 12 and micro_rows(None, 7, batch_shards=4) == 7  # fallbacks: global
    # the critic's unset sizes on a raw schema config (not loaded) follow the actor's, as the loader fills them
    cfg.critic.ppo_mini_batch_size = cfg.critic.ppo_epochs = None
    cfg.actor_rollout_ref.actor.ppo_epochs = 2
    assert (BatchPlan.from_config(cfg).critic.mini_batch_rows, BatchPlan.from_config(cfg).critic.ppo_epochs) == (8, 2)


def test_dapo_generation_rounds_and_the_micro_batch_list():
    plan = BatchPlan.from_config(load_config(CONFIGS / "dapo_quickstart.yaml"))
    assert (plan.rows_per_step, plan.gen_rows_per_round) == (128, 24 * 8)
    cfg = load_config(CONFIGS / "ppo_quickstart.yaml", ["reward_model.micro_batch_size_per_gpu=16"])
    keys = {mb.key: mb.rows for mb in BatchPlan.from_config(cfg).micro_batches(critic=True, reward_model=False)}
    assert keys == {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 32,
                    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 64,
                    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 64,
                    "critic.ppo_micro_batch_size_per_gpu": 32, "critic.forward_micro_batch_size_per_gpu": 64}
    assert ("reward_model.micro_batch_size_per_gpu", 16, 16, "the whole batch") in BatchPlan.from_config(
        cfg).micro_batches(critic=False, reward_model=True)


def test_plan_is_frozen_and_checks_its_own_arithmetic():
    plan = BatchPlan.from_config(load_config(CONFIGS / "quickstart.yaml"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.actor.micro_batch_rows = 3
    bad = RolePlan.derive("critic", rollout_n=2, rows_per_step=8, mini_batch_size=3, micro_batch_size_per_gpu=4,
                          forward_key="critic.forward_micro_batch_size_per_gpu", forward_per_gpu=None)
    with pytest.raises(ValueError, match=r"critic.ppo_mini_batch_size\*rollout.n = 6 must be divisible by "
                                         r"critic.ppo_micro_batch_size_per_gpu = 4"):
        bad.check()
    assert bad.with_mini_batch_size(2).mini_batch_rows == 4 and bad.with_mini_batch_size(2).micro_batch_rows == 4


def test_loader_and_mesh_checks_read_the_plan():
    # verl's world arithmetic on the plan's rows (the uneven-mini-batch note included)
    with pytest.raises(ConfigError, match=r"ppo_micro_batch_size_per_gpu=48 must divide the per-device mini-batch"):
        load_config(CONFIGS / "quickstart.yaml", ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=48"])
    # a null log-prob micro-batch means "the whole step" (global rows) on a mesh too: it must split over the devices
    with pytest.raises(ConfigError, match=r"rollout.log_prob_micro_batch_size_per_gpu=null stands for all responses "
                                          r"of a step in one call: 6 rows per call, which do not split over the 4 "
                                          r"data-parallel devices \(trainer.mesh data=2 x fsdp=2\); set "):
        load_config(None, ["data.train_batch_size=3", "actor_rollout_ref.rollout.n=2", "trainer.n_gpus_per_node=1",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                           "trainer.mesh.data=2", "trainer.mesh.fsdp=2", "trainer.mesh.tensor=1"])


# -- verl's per-device meaning of *_micro_batch_size_per_gpu on a mesh --------------------------------------------
_FSDP4 = [  # 4 data-parallel devices: fsdp=4 (x tensor=2 fills the 8 simulated devices)
    "trainer.mesh.fsdp=4", "trainer.mesh.tensor=2", "trainer.n_gpus_per_node=1",
    "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "algorithm.adv_estimator=gae",
]


def test_per_gpu_sizes_are_per_device_as_in_verl():
    """verl's fsdp_workers: 4 ranks each take ppo_micro_batch_size_per_gpu=2 rows of a micro-batch, so one
    micro-batch of the whole update is 2 x 4 = 8 rows; the same for every *_per_gpu key."""
    cfg = load_config(None, _FSDP4 + [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=5",
        "critic.ppo_micro_batch_size_per_gpu=1", "critic.forward_micro_batch_size_per_gpu=4",
        "reward_model.enable=true", "reward_model.model.path=/m/rm", "reward_model.micro_batch_size_per_gpu=6",
    ])
    plan = BatchPlan.from_config(cfg, batch_shards=4)
    a, c = plan.actor, plan.critic
    assert plan.batch_shards == a.batch_shards == c.batch_shards == 4
    assert (a.mini_batch_rows, a.per_device_mini_batch_rows, a.micro_batch_rows, a.micro_batches_per_mini) == (
        16, 4, 8, 2)
    assert (a.forward_rows, plan.ref_log_prob_rows, c.micro_batch_rows, c.forward_rows, plan.reward_model_rows) == (
        12, 20, 4, 16, 24)
    # the global quantities do not depend on the devices: steps, prompts per update, updates per step
    one = BatchPlan.from_config(cfg)
    assert (one.actor.micro_batch_rows, one.actor.forward_rows, one.ref_log_prob_rows, one.critic.forward_rows) == (
        2, 3, 5, 4)
    assert (plan.rows_per_step, a.mini_batch_rows, a.updates_per_step) == (
        one.rows_per_step, one.actor.mini_batch_rows, one.actor.updates_per_step) == (32, 16, 2)
    # unset sizes stand for global rows, not per-device ones: the whole mini-batch, a whole step
    unset = BatchPlan.from_config(load_config(None, _FSDP4), batch_shards=4)
    assert (unset.actor.micro_batch_rows, unset.actor.forward_rows, unset.ref_log_prob_rows) == (16, 32, 32)
    assert unset.reward_model_rows is None
    with pytest.raises(ValueError, match="batch_shards=0 must be >= 1"):
        BatchPlan.from_config(cfg, batch_shards=0)


@pytest.mark.parametrize("override, expected", [
    # 16 responses per mini-batch / 4 devices = 4 per device: a per-device micro-batch of 8 does not divide it
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
     r"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \(rows per device, as in verl\) must divide the "
     r"per-device mini-batch: actor_rollout_ref.actor.ppo_mini_batch_size=4 x actor_rollout_ref.rollout.n=4 = 16 "
     r"responses / 4 data-parallel devices \(trainer.mesh data=1 x fsdp=4\) = 4; a micro-batch is 8 x 4 = 32 rows "
     r"on the mesh; valid: a divisor of 4"),
    ("critic.ppo_micro_batch_size_per_gpu=16",
     r"critic.ppo_micro_batch_size_per_gpu=16 \(rows per device, as in verl\) must divide the per-device "
     r"mini-batch: critic.ppo_mini_batch_size=4 x .* = 4; a micro-batch is 16 x 4 = 64 rows"),
    # ppo_mini_batch_size is global (prompts per update): 3 x 4 = 12 responses split 3 per device, so 2 fails there
    ("actor_rollout_ref.actor.ppo_mini_batch_size=3 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
     r"ppo_micro_batch_size_per_gpu=2 \(rows per device, as in verl\) must divide the per-device mini-batch: .*= 12 "
     r"responses / 4 data-parallel devices \(trainer.mesh data=1 x fsdp=4\) = 3"),
    # 1 prompt x 2 responses per mini-batch cannot give each of 4 devices a whole share
    ("actor_rollout_ref.rollout.n=2 actor_rollout_ref.actor.ppo_mini_batch_size=1",
     r"actor_rollout_ref.actor.ppo_mini_batch_size=1 x actor_rollout_ref.rollout.n=2 = 2 responses per mini-batch do "
     r"not split over the 4 data-parallel devices \(trainer.mesh data=1 x fsdp=4\)"),
])
def test_a_per_device_size_that_does_not_divide_is_named_with_the_device_count(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, _FSDP4 + override.split())


def test_batch_plan_imports_no_jax():
    code = "import sys, jaxrl.config.batch_plan; assert 'jax' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
