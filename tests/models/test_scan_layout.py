"""The scan layout (layers stacked for the update, jaxrl.models.scan_layout): exact round trip, the same forward and
gradient as the per-layer model, a trained role that holds it, and the rollout side that takes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models.decoder import Decoder, StackedBlocks
from jaxrl.models.scan_layout import is_scan_layout, stack_layers, unstack_layers
from jaxrl.models.value_model import ValueModel
from jaxrl.rollout.base import SamplingParams, WeightFormatError
from jaxrl.rollout.jax_sampler import JaxSampler
from jaxrl.rollout.weight_sync import WeightSync, per_layer_params
from jaxrl.workers.actor import ActorWorker
from tests.helpers import actor_setup, tiny_batch, tiny_model_config

CFG = tiny_model_config("llama")
P, R = 6, 5


def _model(remat=True, seed=0):
    return Decoder(CFG, rngs=nnx.Rngs(seed), remat=remat)


def _leaves_equal(a, b) -> bool:
    return all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _vars(state):
    return jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def test_stack_then_unstack_gives_back_the_per_layer_state_exactly():
    graphdef, state = nnx.split(_model())
    scan_graphdef, stacked = stack_layers(graphdef, state)
    assert is_scan_layout(stacked) and not is_scan_layout(state)
    assert isinstance(nnx.merge(scan_graphdef, stacked).layers, StackedBlocks)
    q = stacked["layers"]["block"]["self_attn"]["q_proj"]
    assert q.shape == (CFG.num_hidden_layers, *state["layers"][0]["self_attn"]["q_proj"].shape)
    assert q.get_metadata()["out_sharding"] == (None, "embed", "heads", "head_dim")  # the layer axis unsharded

    back = jax.jit(unstack_layers)(stacked)
    assert jax.tree.structure(back) == jax.tree.structure(state)  # the same tree, metadata included
    assert _leaves_equal(back, state)
    assert [v.get_metadata() for v in _vars(back)] == [v.get_metadata() for v in _vars(state)]
    assert nnx.graphdef(nnx.merge(graphdef, back)) == graphdef
    assert unstack_layers(state) is state  # nothing stacked: unchanged


def test_only_decoders_whose_training_forward_is_the_scan_are_stacked():
    assert stack_layers(*nnx.split(_model(remat=False))) is None  # no remat: the training forward is the layer loop
    assert stack_layers(None, {"w": jnp.zeros(3)}) is None  # not an nnx model
    value = ValueModel(CFG, rngs=nnx.Rngs(0), remat=True)  # a decoder inside another module (the critic)
    graphdef, stacked = stack_layers(*nnx.split(value))
    assert is_scan_layout(stacked) and isinstance(nnx.merge(graphdef, stacked).backbone.layers, StackedBlocks)


def test_scan_layout_forward_and_gradient_equal_the_per_layer_model():
    graphdef, state = nnx.split(_model())
    scan_graphdef, stacked = stack_layers(graphdef, state)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 9)))
    mask = jnp.asarray((np.arange(9)[None] >= np.array([[0], [2], [4]])).astype(np.int32))
    pos = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    target = jnp.asarray(rng.normal(size=(3, 9, CFG.vocab_size)), jnp.float32)

    def loss(g, p, remat=None):
        logits, _ = nnx.merge(g, p)(ids, pos, mask, remat=remat)
        return jnp.sum(logits * target * mask[..., None])

    per_layer_grad = jax.grad(lambda p: loss(graphdef, p))(state)
    scan_grad = jax.grad(lambda p: loss(scan_graphdef, p))(stacked)
    np.testing.assert_allclose(loss(scan_graphdef, stacked), loss(graphdef, state), rtol=1e-6)
    np.testing.assert_allclose(loss(scan_graphdef, stacked, remat=False), loss(graphdef, state), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(unstack_layers(scan_grad)), jax.tree.leaves(per_layer_grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="scan layout"):  # a training layout never decodes
        from jaxrl.models.decoder import init_cache

        nnx.merge(scan_graphdef, stacked)(ids[:, :1], pos[:, :1], jnp.ones((3, 4), jnp.int32),
                                          cache=init_cache(CFG, 3, 4), cache_index=0)


def _batch(n=8, seed=0):
    batch, rng = tiny_batch(n, seed, prompt_width=P, response_width=R, vocab_size=CFG.vocab_size)
    batch.advantages = (rng.normal(size=(n, R)) * batch.response_mask).astype(np.float32)
    return batch


@pytest.mark.parametrize("remat", [True, "selective"])
def test_an_actor_on_a_remat_model_trains_in_the_scan_layout_like_the_per_layer_one(remat):
    """The same update from the same weights: the scan-layout actor (remat model, either recompute granularity) and
    the per-layer one (no remat) end at the same weights; the stacked actor hands the engine its own arrays and the
    export per-layer ones."""
    cfg, plan = actor_setup(rows=8, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4, use_kl_loss=False)
    graphdef, state = nnx.split(_model(remat=remat))
    plain_graphdef, plain_state = nnx.split(_model(remat=False))
    copy = lambda tree: jax.tree.map(lambda x: x.copy(), tree)  # noqa: E731  (the update donates its inputs)
    scan_actor = ActorWorker(graphdef, copy(state), cfg, plan=plan, temperature=1.0, total_training_steps=1)
    plain_actor = ActorWorker(plain_graphdef, copy(plain_state), cfg, plan=plan, temperature=1.0,
                              total_training_steps=1)
    assert scan_actor.scan_layout and not plain_actor.scan_layout
    assert scan_actor.base_graphdef == graphdef and scan_actor.graphdef != graphdef

    batch = _batch()
    lp_scan, _ = scan_actor.compute_log_probs(batch)
    lp_plain, _ = plain_actor.compute_log_probs(batch)
    np.testing.assert_allclose(lp_scan, lp_plain, atol=1e-6)
    batch.old_log_probs = lp_plain
    m_scan, m_plain = scan_actor.update(batch), plain_actor.update(batch)
    np.testing.assert_allclose(m_scan["actor/grad_norm"], m_plain["actor/grad_norm"], rtol=1e-5)
    assert is_scan_layout(scan_actor.params) and is_scan_layout(scan_actor.opt_state)  # moments stacked too
    merged = scan_actor.merged_params()
    assert jax.tree.structure(merged) == jax.tree.structure(plain_actor.merged_params())
    # AdamW at lr 1e-2 moves every weight by about 1e-2; the two layouts sum the gradient in another order, and
    # m / sqrt(v) magnifies that rounding where a gradient is near 0: within 1% of a step
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(state)))
    assert moved > 5e-3
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(plain_actor.merged_params()), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)
    assert is_scan_layout(scan_actor.rollout_params())
    assert _leaves_equal(scan_actor.rollout_params(), scan_actor.params)  # its own arrays: no copy
    assert not is_scan_layout(plain_actor.rollout_params())


def _sampler(params, graphdef, **kw):
    return JaxSampler(CFG, graphdef, params, eos_token_ids=(CFG.vocab_size - 1,), pad_token_id=0,
                      max_prompt_length=8, **kw)


def test_the_sampler_generates_the_same_from_the_scan_layout_and_keeps_no_per_layer_copy():
    graphdef, state = nnx.split(_model())
    _, stacked = stack_layers(graphdef, state)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    greedy = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)  # sampled: the same draws from the same logits
    want = _sampler(state, graphdef).generate(prompts, greedy)
    sampler = _sampler(stacked, graphdef)
    got = sampler.generate(prompts, greedy)
    np.testing.assert_array_equal(got.response_ids, want.response_ids)
    np.testing.assert_allclose(got.rollout_log_probs, want.rollout_log_probs, atol=1e-6)
    assert sampler.params is stacked or _leaves_equal(sampler.params, stacked)  # held as given, not unstacked
    assert is_scan_layout(sampler.params)
    sampler.update_weights(state)  # either layout of the same model is accepted
    sampler.update_weights(stacked)
    with pytest.raises(ValueError, match="shape/dtype mismatch"):
        sampler.update_weights(jax.tree.map(lambda x: x[..., :1] if x.ndim == 3 else x, stacked))


def test_weight_sync_unstacks_for_an_engine_that_needs_per_layer_weights():
    graphdef, state = nnx.split(_model())
    _, stacked = stack_layers(graphdef, state)
    assert _leaves_equal(per_layer_params(stacked), state) and per_layer_params(state) is state
    ptr = lambda tree: tree["embed_tokens"][...].unsafe_buffer_pointer()  # noqa: E731
    assert ptr(per_layer_params(stacked)) == ptr(stacked)  # only the stacked layers are copied

    class PerLayerEngine:  # an engine that declares the "jax" format but does not take the scan layout
        def __init__(self):
            self.weight_format = _sampler(state, graphdef).weight_format
            self.got = None

        def update_weights(self, params):
            self.got = params

    engine = PerLayerEngine()
    sync = WeightSync(engine)
    assert not sync.takes_scan_layout
    sync.sync(stacked)
    assert not is_scan_layout(engine.got) and _leaves_equal(engine.got, state)
    sampler_sync = WeightSync(_sampler(state, graphdef))
    assert sampler_sync.takes_scan_layout
    sampler_sync.sync(stacked)
    assert is_scan_layout(sampler_sync.engine.params)


def test_a_sampler_on_a_mesh_refuses_the_scan_layout():
    from jax.sharding import Mesh

    graphdef, state = nnx.split(_model())
    _, stacked = stack_layers(graphdef, state)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    with pytest.raises(WeightFormatError, match="scan layout"):
        _sampler(stacked, graphdef, mesh=mesh)
