"""Critic worker and value model: value read-out position, chunking and grad-accumulation invariance,
learning toward fixed returns, value clipping, skipped non-finite updates, and building from a policy."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.batch import RLBatch
from jaxrl.config.batch_plan import BatchPlan
from jaxrl.models import Pretrained
from jaxrl.models.decoder import Decoder
from jaxrl.models.value_model import ValueModel, build_value_model
from jaxrl.workers.critic import CriticWorker
from tests.helpers import critic_setup, tiny_batch, tiny_model_config, tiny_run_config

CFG = tiny_model_config("llama")
P, R = 6, 5
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def make_batch(n=8, seed=0) -> RLBatch:
    return tiny_batch(n, seed, prompt_width=P, response_width=R, vocab_size=CFG.vocab_size, group_size=1)[0]


@pytest.fixture(scope="module")
def split_model():
    return nnx.split(ValueModel(CFG, rngs=nnx.Rngs(0)))


def fresh(params):
    return jax.tree.map(lambda x: x.copy(), params)


def worker(graphdef, params, rows=8, **kw) -> CriticWorker:
    """A critic on ``rows`` responses per step (rollout.n = 1), its config from the schema dataclasses."""
    cfg, plan = critic_setup(rows=rows, **kw)
    return CriticWorker(graphdef, fresh(params), cfg, plan=plan, total_training_steps=1)


def reference_values(graphdef, params, batch):
    """Independent recompute: full-sequence hidden states @ head in numpy, read at P + j - 1."""
    model = nnx.merge(graphdef, params)
    hidden, _ = model.backbone(jnp.asarray(batch.input_ids()), jnp.asarray(batch.positions()),
                               jnp.asarray(batch.attention_mask()), return_hidden=True)
    v = np.asarray(hidden, np.float64) @ np.asarray(model.value_head[...], np.float64)[:, 0]
    v = v + float(model.value_bias[...][0])
    out = np.zeros(batch.response_ids.shape)
    for i in range(batch.size):
        for j in range(R):
            out[i, j] = v[i, P + j - 1] * batch.response_mask[i, j]
    return out


def test_values_match_reference_and_ignore_chunking(split_model):
    graphdef, params = split_model
    params = fresh(params)
    # A non-zero bias and a larger head make the check sensitive to both.
    params["value_bias"].set_value(jnp.array([0.3], jnp.float32))
    params["value_head"].set_value(params["value_head"][...] * 20.0)
    batch = make_batch(n=7)
    ref = reference_values(graphdef, params, batch)
    assert np.abs(ref[batch.response_mask == 1]).std() > 1e-2  # values differ across tokens
    for mb in (1, 3, 7):
        critic = worker(graphdef, params, rows=7, forward_micro_batch_size_per_gpu=mb, ppo_mini_batch_size=7,
                        ppo_micro_batch_size_per_gpu=7)
        values = critic.compute_values(batch)
        assert values.dtype == np.float32 and values.shape == (7, R)
        np.testing.assert_allclose(values, ref, atol=1e-5)
        assert np.all(values[batch.response_mask == 0] == 0)
    # Reading one position later (the state after the token) gives different numbers: the shift matters.
    shifted = reference_values(graphdef, params, batch)
    model = nnx.merge(graphdef, params)
    full = np.asarray(model(jnp.asarray(batch.input_ids()), jnp.asarray(batch.positions()),
                            jnp.asarray(batch.attention_mask())))
    np.testing.assert_allclose(full[:, P - 1 : P - 1 + R] * batch.response_mask, shifted, atol=1e-5)
    assert not np.allclose(full[:, P : P + R] * batch.response_mask, shifted, atol=1e-3)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_accumulation_equals_full_mini_batch(split_model, mode):
    graphdef, params = split_model
    batch = make_batch(n=8, seed=1)
    rng = np.random.default_rng(2)
    v0 = worker(graphdef, params).compute_values(batch)
    mask = batch.response_mask
    batch.values = ((v0 + rng.normal(scale=0.3, size=v0.shape)) * mask).astype(np.float32)
    batch.returns = (rng.normal(size=v0.shape) * mask).astype(np.float32)
    results = {}
    for micro in (8, 2):
        critic = worker(graphdef, params, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=micro,
                        loss_agg_mode=mode, cliprange_value=0.2)
        stacked, nt, ns = critic.stack_micro(critic.minibatch_arrays(batch), np.arange(8), 8, micro)
        assert stacked["input_ids"].shape[:2] == (8 // micro, micro)
        results[micro] = jax.jit(critic.accumulate_grads, static_argnames="prompt_width")(
            params, stacked, nt, ns, prompt_width=P)
    (g_full, m_full), (g_micro, m_micro) = results[8], results[2]
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_micro)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"):
        np.testing.assert_allclose(float(m_micro[key]), float(m_full[key]), rtol=1e-4, atol=1e-6)
    assert 0 < float(m_full["critic/vf_clipfrac"]) < 1  # both clip branches are exercised
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g_full)) > 0
    backbone_grad = g_full["backbone"]["layers"][0]["mlp"]["up_proj"][...]
    assert float(jnp.abs(backbone_grad).max()) > 0  # the gradient reaches the backbone, not just the head


def test_updates_reduce_value_loss_toward_fixed_returns(split_model):
    graphdef, params = split_model
    batch = make_batch(n=8, seed=3)
    mask = batch.response_mask
    # Targets depend on the row (its last token's reward propagated with gamma = 1): 1 or -1.
    batch.returns = (np.where(np.arange(8)[:, None] % 2 == 0, 1.0, -1.0) * mask).astype(np.float32)
    critic = worker(graphdef, params, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, cliprange_value=10.0,
                    ppo_epochs=2)
    mse = lambda v: float((((v - batch.returns) ** 2) * mask).sum() / mask.sum())  # noqa: E731
    losses, errors = [], []
    for _ in range(15):
        batch.values = critic.compute_values(batch)
        errors.append(mse(batch.values))
        metrics = critic.update(batch)
        losses.append(metrics["critic/vf_loss"])
    errors.append(mse(critic.compute_values(batch)))
    assert losses[-1] < 0.2 * losses[0] and errors[-1] < 0.2 * errors[0]
    assert critic.num_updates == 15 * 2 * 2 and critic.updates_per_step == 4
    assert metrics["critic/lr"] == pytest.approx(1e-2) and metrics["critic/nonfinite_grad"] == 0
    assert set(metrics) == {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm",
                            "critic/nonfinite_grad", "critic/lr"}


@pytest.mark.parametrize("cliprange, clipfrac, loss", [(0.1, 1.0, 0.5 * 1.9**2), (5.0, 0.0, 0.5)])
def test_value_clipping(split_model, cliprange, clipfrac, loss):
    graphdef, params = split_model
    batch = make_batch(n=4, seed=4)
    critic = worker(graphdef, params, rows=4, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4,
                    cliprange_value=cliprange)
    v = critic.compute_values(batch)
    mask = batch.response_mask
    # Old values 1 below the current prediction, returns 1 above: a small clip range pins the clipped
    # prediction near the old value, 2 - cliprange away from the return, so the clipped error dominates.
    batch.values = ((v - 1.0) * mask).astype(np.float32)
    batch.returns = ((v + 1.0) * mask).astype(np.float32)
    metrics = critic.update(batch)  # metrics are those of the params before the update
    assert metrics["critic/vf_clipfrac"] == pytest.approx(clipfrac, abs=1e-6)
    assert metrics["critic/vf_loss"] == pytest.approx(loss, rel=1e-4)


def test_nonfinite_gradient_skips_update(split_model):
    graphdef, params = split_model
    batch = make_batch(n=2, seed=5)
    batch.values = np.zeros(batch.response_ids.shape, np.float32)
    batch.returns = np.full(batch.response_ids.shape, np.nan, np.float32)
    critic = worker(graphdef, params, rows=2)
    before = jax.tree.map(np.asarray, critic.params)
    metrics = critic.update(batch)
    assert metrics["critic/nonfinite_grad"] == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(critic.params)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_update_requires_values_and_returns(split_model):
    graphdef, params = split_model
    batch = make_batch(n=2, seed=6)
    batch.returns = np.zeros(batch.response_ids.shape, np.float32)
    with pytest.raises(ValueError, match="batch.values"):
        worker(graphdef, params).update(batch)
    with pytest.raises(ValueError, match=r"critic.ppo_mini_batch_size\*rollout.n = 3 must be divisible by "
                                         r"critic.ppo_micro_batch_size_per_gpu = 2"):
        worker(graphdef, params, ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=2)
    # unset sizes follow the actor's (as the loader fills them); an unset micro-batch is the whole mini-batch
    cfg = tiny_run_config(rows=8, critic=dataclasses.replace(
        critic_setup(rows=8)[0], ppo_mini_batch_size=None, ppo_epochs=None, ppo_micro_batch_size_per_gpu=None))
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size, cfg.actor_rollout_ref.actor.ppo_epochs = 4, 3
    plan = BatchPlan.from_config(cfg).critic
    assert (plan.mini_batch_rows, plan.micro_batch_rows, plan.forward_rows, plan.ppo_epochs) == (4, 4, 4, 3)
    critic = CriticWorker(graphdef, fresh(params), cfg.critic, plan=plan, total_training_steps=1)
    assert critic.updates_per_step == 3 * 2


# ------------------------------------------------------------------------------------ value model
def test_value_model_from_policy_copies_the_backbone():
    policy = Pretrained(config=CFG, model=Decoder(CFG, rngs=nnx.Rngs(7)), tokenizer=None)
    vm = build_value_model(None, policy, param_dtype="float32", dtype="float32")
    src = nnx.to_pure_dict(nnx.state(policy.model, nnx.Param))
    dst = nnx.to_pure_dict(nnx.state(vm.backbone, nnx.Param))
    assert "lm_head" in src and "lm_head" not in dst and vm.backbone.lm_head is None
    src.pop("lm_head")
    for (pa, a), (pb, b) in zip(jax.tree_util.tree_leaves_with_path(src), jax.tree_util.tree_leaves_with_path(dst)):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()  # own buffers: donation-safe
    head = np.asarray(vm.value_head[...])
    assert head.shape == (CFG.hidden_size, 1) and 0 < head.std() < 3.0 / (CFG.hidden_size + 1)
    # The backbone's hidden states are the policy's: same final-normed features.
    ids = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
    pos = jnp.asarray([[0, 1, 2, 3]], jnp.int32)
    mask = jnp.ones((1, 4), jnp.int32)
    h_pol, _ = policy.model(ids, pos, mask, return_hidden=True)
    h_val, _ = vm.backbone(ids, pos, mask, return_hidden=True)
    np.testing.assert_allclose(np.asarray(h_pol), np.asarray(h_val), atol=1e-6)
    zeros = ValueModel.from_pretrained(policy, head_init="zeros")
    assert np.all(np.asarray(zeros(ids, pos, mask)) == 0)
    bf16 = ValueModel.from_pretrained(policy, param_dtype="bfloat16")
    assert bf16.backbone.embed_tokens[...].dtype == jnp.bfloat16 and bf16(ids, pos, mask).dtype == jnp.float32


def test_value_model_from_a_checkpoint_path(tmp_path):
    from jaxrl.models.hf import save_hf

    critic_src = Decoder(CFG, rngs=nnx.Rngs(8))
    save_hf(critic_src, CFG, tmp_path / "critic")
    policy = Pretrained(config=CFG, model=Decoder(CFG, rngs=nnx.Rngs(9)), tokenizer=None)
    vm = build_value_model(str(tmp_path / "critic"), policy)
    np.testing.assert_array_equal(np.asarray(vm.backbone.embed_tokens[...]), np.asarray(critic_src.embed_tokens[...]))
    big = dataclasses.replace(CFG, vocab_size=128)
    big_policy = Pretrained(config=big, model=None, tokenizer=None)
    with pytest.raises(ValueError, match="vocab_size=64 < the policy's 128"):
        build_value_model(str(tmp_path / "critic"), big_policy)
