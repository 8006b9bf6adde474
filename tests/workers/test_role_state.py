"""Trained roles' checkpoint state: ``state()`` -> ``load_state()`` (through JSON, as a checkpoint's meta) into a
fresh role gives the same params, optimizer state, update count and shuffling RNG, so training continues exactly
as it would have."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.batch import RLBatch
from jaxrl.config.batch_plan import BatchPlan
from jaxrl.config.loader import load_config
from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from jaxrl.models.value_model import ValueModel
from jaxrl.workers.actor import ActorWorker
from jaxrl.workers.critic import CriticWorker

CFG = ModelConfig(
    model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False,
    qk_norm=False, bos_token_id=1, eos_token_id=(2,), pad_token_id=0,
)
P, R, N = 4, 3, 8
SECTIONS = load_config(None, [
    "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.shuffle=true",
    "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.optim.lr=1e-2",
    "critic.ppo_micro_batch_size_per_gpu=2", "critic.shuffle=true", "critic.optim.lr=1e-2", "trainer.n_gpus_per_node=1",
])
PLAN = BatchPlan.from_config(SECTIONS)  # 8 rows per step, mini-batches of 4, micro-batches of 2


def batch(seed: int) -> RLBatch:
    rng = np.random.default_rng(seed)
    response_mask = (np.arange(R)[None] < rng.integers(1, R + 1, size=N)[:, None]).astype(np.int32)
    b = RLBatch(
        prompt_ids=rng.integers(3, CFG.vocab_size, (N, P)).astype(np.int32), prompt_mask=np.ones((N, P), np.int32),
        response_ids=(rng.integers(3, CFG.vocab_size, (N, R)) * response_mask).astype(np.int32),
        response_mask=response_mask, group_ids=np.repeat(np.arange(N // 2), 2).astype(np.int32),
    )
    b.old_log_probs = (-2.0 * response_mask).astype(np.float32)
    b.advantages = (rng.normal(size=(N, R)) * response_mask).astype(np.float32)
    b.values = (rng.normal(size=(N, R)) * response_mask).astype(np.float32)
    b.returns = (rng.normal(size=(N, R)) * response_mask).astype(np.float32)
    return b


def actor(seed: int) -> ActorWorker:
    graphdef, params = nnx.split(Decoder(CFG, rngs=nnx.Rngs(seed)))
    a = ActorWorker(graphdef, params, SECTIONS.actor_rollout_ref.actor, plan=PLAN.actor, temperature=1.0,
                    total_training_steps=4, seed=seed)
    a.init_optimizer()
    return a


def critic(seed: int) -> CriticWorker:
    graphdef, params = nnx.split(ValueModel(CFG, rngs=nnx.Rngs(seed)))
    c = CriticWorker(graphdef, params, SECTIONS.critic, plan=PLAN.critic, total_training_steps=4, seed=seed)
    c.init_optimizer()
    return c


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_same_state(a, b):
    (arrays_a, meta_a), (arrays_b, meta_b) = a.state(), b.state()
    assert meta_a == meta_b
    assert jax.tree.structure(arrays_a) == jax.tree.structure(arrays_b)
    for x, y in zip(leaves(arrays_a), leaves(arrays_b)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("make", [actor, critic], ids=["actor", "critic"])
def test_state_round_trips_and_training_continues_identically(make):
    trained = make(0)
    trained.update(batch(1))  # moves params, optimizer moments, the update count and the shuffling RNG
    arrays, meta = trained.state()
    assert set(arrays) == {"params", "opt_state"} and set(meta) == {"num_updates", "rng"}
    assert meta["num_updates"] == trained.updates_per_step > 0
    meta = json.loads(json.dumps(meta))  # a checkpoint keeps the meta as JSON

    resumed = make(7)  # other initial weights and RNG seed: everything must come from the state
    assert resumed.state()[1] != meta
    resumed.load_state(jax.tree.map(lambda x: x.copy(), arrays), meta)  # copies: an update donates its buffers
    assert_same_state(trained, resumed)

    trained.update(batch(2))
    resumed.update(batch(2))
    assert_same_state(trained, resumed)  # same mini-batch order (RNG), same learning rate (count), same moments


def test_load_state_with_a_missing_entry_changes_nothing():
    a = actor(0)
    before = a.state()
    with pytest.raises(KeyError):
        a.load_state({"params": before[0]["params"]}, before[1])  # no opt_state
    with pytest.raises(KeyError):
        a.load_state(before[0], {"rng": before[1]["rng"]})  # no num_updates
    assert a.state()[1] == before[1] and a.state()[0]["opt_state"] is before[0]["opt_state"]
