"""A run's checkpoint (jaxrl.run_checkpoint): the on-disk layout is pinned (a checkpoint written before the trainer
was split up must still resume), every trained role's state() goes in and comes back through load_state(), and a
checkpoint of another configuration is refused before anything is restored.

The roles and the data pipeline are small stand-ins exposing the boundary RunCheckpoints uses (``state`` /
``load_state``, ``get_state`` / ``set_state``); the store, orbax and the fingerprint are real. Real roles round-trip
in tests/workers/test_role_state.py, real runs resume in tests/test_resume.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algorithms import get_kl_controller
from jaxrl.checkpoint import CheckpointIncompatibleError, CheckpointStore
from jaxrl.config.loader import load_config
from jaxrl.run_checkpoint import RunCheckpoints, check_final_checkpoint


class Role:
    def __init__(self, value: float, num_updates: int, seed: int):
        self.params = {"w": jnp.full((4,), value, jnp.float32)}
        self.opt_state = {"mu": jnp.full((4,), value / 2, jnp.float32), "count": jnp.asarray(num_updates)}
        self.num_updates = num_updates
        self.rng = np.random.default_rng(seed)

    def state(self):
        return ({"params": self.params, "opt_state": self.opt_state},
                {"num_updates": self.num_updates, "rng": self.rng.bit_generator.state})

    def load_state(self, arrays, meta):
        self.params, self.opt_state = arrays["params"], arrays["opt_state"]
        self.num_updates = meta["num_updates"]
        self.rng.bit_generator.state = meta["rng"]


class Data:
    def __init__(self, position: int, seed: int = 1):
        self.state = {"batch_size": 4, "seed": seed, "shuffle": True, "drop_last": True, "num_rows": 32,
                      "position": position}

    def get_state(self):
        return dict(self.state)

    def set_state(self, state):
        self.state = dict(state)

    def prompts_digest(self):
        return "abc123"


@dataclasses.dataclass
class Run:  # the fields of jaxrl.build.Components that RunCheckpoints reads
    cfg: object
    actor: Role
    critic: Role | None
    train_data: Data
    store: CheckpointStore
    out_dir: Path
    model_meta: dict
    resume_from: tuple | None = None


MODEL = {"hf_config": {"hidden_size": 8, "model_type": "llama"}, "path": "tiny", "param_dtype": "float32"}


def run(out: Path, *, value=1.0, critic=True, data_seed=1, position=0, resume_from=None) -> Run:
    return Run(cfg=load_config(None), actor=Role(value, 3, 11), critic=Role(-value, 5, 12) if critic else None,
               train_data=Data(position, data_seed), store=CheckpointStore(out, max_to_keep=None, async_save=False),
               out_dir=out, model_meta=MODEL, resume_from=resume_from)


KL = get_kl_controller("fixed", 0.25)


def test_saved_layout_is_the_pre_refactor_one(tmp_path):
    r = run(tmp_path)
    assert RunCheckpoints(r).save_checkpoint(2, KL) is True
    step = tmp_path / "global_step_2"
    assert sorted(p.name for p in step.iterdir() if p.is_dir()) == [
        "actor.opt_state", "actor.params", "critic.opt_state", "critic.params", "meta"]
    meta = r.store.read_meta(2)
    assert list(meta) == ["step", "data_state", "kl_ctrl", "actor", "model", "critic", "fingerprint"]
    assert meta["step"] == 2 and meta["kl_ctrl"] == {"value": 0.25} and meta["model"] == MODEL
    assert meta["actor"] == {"num_updates": 3, "rng": np.random.default_rng(11).bit_generator.state}
    assert meta["critic"]["num_updates"] == 5 and meta["data_state"]["position"] == 0
    assert meta["fingerprint"]["roles"] == "actor,critic"
    assert set(meta["fingerprint"]["arrays"]) == {"actor.params", "actor.opt_state", "critic.params",
                                                  "critic.opt_state"}
    r.store.close()
    actor_only = run(tmp_path / "grpo", critic=False)
    RunCheckpoints(actor_only).save_checkpoint(1, KL)
    assert "critic" not in actor_only.store.read_meta(1)
    actor_only.store.close()


def test_resume_loads_every_role_and_the_data_position(tmp_path):
    saved = run(tmp_path, value=3.0, position=7)
    saved.actor.rng.random(5)  # the RNG moved on during training
    expected_rng = saved.actor.rng.bit_generator.state
    RunCheckpoints(saved).save_checkpoint(4, get_kl_controller("fixed", 0.5))
    check_final_checkpoint(saved.store, 4)  # on disk: no error
    saved.store.close()

    fresh = run(tmp_path, value=0.0, resume_from=(tmp_path, None))
    resumed = RunCheckpoints(fresh).resume()
    assert (resumed.step, resumed.kl_ctrl_value, resumed.path) == (4, 0.5, tmp_path / "global_step_4")
    np.testing.assert_array_equal(fresh.actor.params["w"], [3.0] * 4)
    np.testing.assert_array_equal(fresh.critic.opt_state["mu"], [-1.5] * 4)
    assert (fresh.actor.num_updates, fresh.critic.num_updates) == (3, 5)
    assert fresh.actor.rng.bit_generator.state == expected_rng
    assert fresh.train_data.state["position"] == 7
    fresh.store.close()


def test_fresh_start_moves_old_checkpoints_aside_and_restores_nothing(tmp_path):
    old = run(tmp_path)
    RunCheckpoints(old).save_checkpoint(2, KL)
    old.store.close()
    fresh = run(tmp_path, value=9.0)
    assert RunCheckpoints(fresh).resume() is None
    assert fresh.store.steps() == [] and len(list(tmp_path.glob("global_step_2.superseded-*"))) == 1
    np.testing.assert_array_equal(fresh.actor.params["w"], [9.0] * 4)
    fresh.store.close()


def test_another_configuration_is_refused_naming_the_change(tmp_path):
    old = run(tmp_path)
    RunCheckpoints(old).save_checkpoint(2, KL)
    old.store.close()
    other = run(tmp_path, value=5.0, data_seed=2, resume_from=(tmp_path, None))
    with pytest.raises(CheckpointIncompatibleError, match=r"data\.seed: 1 -> 2") as e:
        RunCheckpoints(other).resume()
    assert e.value.step == 2
    np.testing.assert_array_equal(other.actor.params["w"], [5.0] * 4)  # nothing restored
    assert other.store.steps() == [2]  # nothing moved
    other.store.close()


def test_a_missing_final_checkpoint_names_the_newest_complete_one(tmp_path):
    from jaxrl.checkpoint import CheckpointSaveError

    r = run(tmp_path)
    RunCheckpoints(r).save_checkpoint(2, KL)
    with pytest.raises(CheckpointSaveError, match=r"final checkpoint \(step 4\) was not saved.*global_step_2"):
        check_final_checkpoint(r.store, 4)
    r.store.close()
