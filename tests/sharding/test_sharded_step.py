"""A mesh-sharded train step equals the single-device step, and the rollout sampler fed through the translator
generates what the trainer-side params generate (colocated and split placement), on 8 simulated CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from jaxrl.rollout.base import SamplingParams
from jaxrl.rollout.jax_sampler import JaxSampler
from sharding import (
    DEFAULT_RULES,
    TargetSpec,
    Translator,
    batch_sharding,
    build_plan,
    make_mesh,
    param_shardings,
    shard_state,
    split_devices,
)

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, bos_token_id=1, eos_token_id=(2,),
                  pad_token_id=0)
B, T = 8, 12
PROMPTS = [[1, 5, 9, 33], [1, 40, 41, 42, 43, 44, 45], [1, 17], [1, 60, 3, 8, 22]]


def test_eight_devices():
    assert len(jax.devices()) == 8, "tests/conftest.py must set --xla_force_host_platform_device_count=8"


@pytest.fixture(scope="module")
def model_parts():
    """graphdef and a random fp32 state (weights ~N(0, 0.3): peaked next-token distributions, no near-ties)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(CFG, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(3)

    def init(x):
        if x.ndim == 1:  # norm scales
            return jnp.asarray(1.0 + 0.1 * rng.normal(size=x.shape), jnp.float32)
        return jnp.asarray(0.3 * rng.normal(size=x.shape), jnp.float32)

    return graphdef, jax.tree.map(init, state)


def _loss(graphdef, params, batch):
    """Mean next-token NLL over ``batch["ids"]`` ``[B, T]`` (all positions real)."""
    model = nnx.merge(graphdef, params)
    ids = batch["ids"]
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    logits, _ = model(ids, positions, jnp.ones_like(ids))
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return nll.mean()


def _make_step(graphdef, tx):
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: _loss(graphdef, p, batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _leaves(tree):
    return jax.tree.leaves(tree)


def test_sharded_train_step_equals_single_device(model_parts):
    graphdef, state = model_parts
    # Gradients of the two layouts differ by fp32 summation-order noise (~1e-6 of their scale). Adam divides each
    # gradient by its own magnitude, so for an element whose gradient is near eps that noise is amplified by up to
    # lr / (4 eps); lr=1e-3, eps=1e-3 keep it below 1e-6 (the comparison is about sharding, not Adam's conditioning)
    # while every parameter still moves by ~lr.
    tx = optax.adamw(1e-3, eps=1e-3, weight_decay=0.1)
    batch = {"ids": jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (B, T)), jnp.int32)}
    step = _make_step(graphdef, tx)

    dev0 = jax.devices()[0]
    p1 = jax.device_put(state, dev0)
    o1 = jax.device_put(tx.init(p1), dev0)
    new_p1, new_o1, loss1 = jax.jit(step)(p1, o1, jax.device_put(batch, dev0))

    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    p_sh = param_shardings(state, mesh, DEFAULT_RULES)
    o_sh = param_shardings(tx.init(state), mesh, DEFAULT_RULES)
    b_sh = {"ids": batch_sharding(mesh, 2)}
    scalar = NamedSharding(mesh, P())
    p8 = shard_state(state, p_sh)
    o8 = shard_state(tx.init(state), o_sh)
    sharded_step = jax.jit(step, in_shardings=(p_sh, o_sh, b_sh), out_shardings=(p_sh, o_sh, scalar))
    new_p8, new_o8, loss8 = sharded_step(p8, o8, jax.device_put(batch, b_sh))

    np.testing.assert_allclose(float(loss8), float(loss1), rtol=1e-5)
    for a, b in zip(_leaves(new_p8), _leaves(new_p1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for a, b in zip(_leaves(new_o8), _leaves(new_o1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    # The step really ran sharded: outputs keep the rule layout (q kernel split over fsdp x tensor).
    q = new_p8["layers"][0]["self_attn"]["q_proj"].get_value()
    assert q.sharding.spec == P("fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (16, 2, 8)
    assert new_o8[0].mu["layers"][0]["self_attn"]["q_proj"].get_value().sharding.spec == P("fsdp", "tensor", None)
    # The parameters moved (the comparison is not between two untouched copies).
    before, after = state["embed_tokens"].get_value(), new_p1["embed_tokens"].get_value()
    assert not np.allclose(np.asarray(after), np.asarray(before))


def _greedy(sampler: JaxSampler):
    out = sampler.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=8))
    return out.response_ids, out.rollout_log_probs


def _sampler(graphdef, params):
    return JaxSampler(CFG, graphdef, params, pad_token_id=0, eos_token_ids=(), max_prompt_length=8,
                      prompt_length_bucket=8)


@pytest.fixture(scope="module")
def reference(model_parts):
    """Greedy ids / log-probs of the trainer-side params (train layout fsdp=4 x tensor=2)."""
    graphdef, state = model_parts
    trainer_params = shard_state(state, param_shardings(state, make_mesh(1, 4, 2), DEFAULT_RULES))
    sampler = _sampler(graphdef, trainer_params)
    ids, lp = _greedy(sampler)
    assert len(set(ids.ravel().tolist())) > 3  # a non-degenerate continuation
    return sampler, ids, lp


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_sampler_on_translated_params_matches_trainer(model_parts, reference, placement):
    graphdef, state = model_parts
    ref_sampler, ref_ids, ref_lp = reference
    if placement == "colocated":
        train_mesh = make_mesh(1, 4, 2)
        rollout_mesh = make_mesh(1, 1, 8)
    else:
        train, rollout = split_devices(4, 4)
        train_mesh = make_mesh(1, 2, 2, devices=train)
        rollout_mesh = make_mesh(1, 1, 4, devices=rollout)
    trainer_params = shard_state(state, param_shardings(state, train_mesh, DEFAULT_RULES))
    translated, report = Translator(build_plan(trainer_params, TargetSpec("jax", mesh=rollout_mesh))).sync(
        trainer_params)
    rollout_devices = {d.id for d in rollout_mesh.devices.flat}
    assert all({d.id for d in x.sharding.device_set} == rollout_devices for x in _leaves(translated))
    assert report.bytes_moved > 0

    ids, lp = _greedy(_sampler(graphdef, translated))
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(lp, ref_lp, rtol=1e-4, atol=1e-5)
    # The translated state is also a drop-in weight update for an existing sampler (same tree, shapes, dtypes).
    ref_sampler.update_weights(translated)
    assert ref_sampler.params is not trainer_params
