"""Actor worker: log-prob recompute, gradient accumulation invariance, and the direction of an update."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.batch import RLBatch
from jaxrl.models.decoder import Decoder
from jaxrl.workers.actor import ActorWorker, LogProbComputer
from tests.helpers import actor_setup, tiny_batch, tiny_model_config

CFG = tiny_model_config("llama")
P, R = 6, 5


def make_batch(n=8, seed=0) -> RLBatch:
    batch, rng = tiny_batch(n, seed, prompt_width=P, response_width=R, vocab_size=CFG.vocab_size)
    batch.advantages = (rng.normal(size=(n, R)) * batch.response_mask).astype(np.float32)
    return batch


def make_actor(graphdef, params, *, rows, log_prob_micro=None, **actor_overrides) -> ActorWorker:
    """An actor on ``rows`` responses per step (rollout.n = 1), its config from the schema dataclasses."""
    cfg, plan = actor_setup(rows=rows, log_prob_micro=log_prob_micro, **actor_overrides)
    return ActorWorker(graphdef, params, cfg, plan=plan, temperature=1.0, total_training_steps=1)


@pytest.fixture(scope="module")
def split_model():
    return nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)))


def reference_log_probs(graphdef, params, batch, temperature):
    """Independent recompute: full forward, numpy log-softmax, shift by one."""
    model = nnx.merge(graphdef, params)
    logits, _ = model(jnp.asarray(batch.input_ids()), jnp.asarray(batch.positions()), jnp.asarray(batch.attention_mask()))
    logits = np.asarray(logits, np.float64) / temperature
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    out = np.zeros(batch.response_ids.shape)
    for i in range(batch.size):
        for j in range(R):
            out[i, j] = logp[i, P + j - 1, batch.response_ids[i, j]] * batch.response_mask[i, j]
    return out


def test_log_probs_match_reference_and_ignore_chunking(split_model):
    graphdef, params = split_model
    batch = make_batch(n=7)
    ref = reference_log_probs(graphdef, params, batch, temperature=0.7)
    for mb in (1, 3, 7):
        lp, ent = LogProbComputer(graphdef, micro_batch_size=mb, temperature=0.7)(params, batch)
        np.testing.assert_allclose(lp, ref, atol=1e-5)
        assert ent.shape == (7, R) and np.all(ent[batch.response_mask == 1] > 0)
        assert np.all(ent[batch.response_mask == 0] == 0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batch_accumulation_equals_full_mini_batch(split_model, mode):
    graphdef, params = split_model
    batch = make_batch(n=8, seed=1)
    lp, _ = LogProbComputer(graphdef, micro_batch_size=8, temperature=1.0)(params, batch)
    rng = np.random.default_rng(2)
    batch.old_log_probs = (lp + rng.normal(scale=0.3, size=lp.shape) * batch.response_mask).astype(np.float32)
    batch.ref_log_probs = (lp + rng.normal(scale=0.3, size=lp.shape) * batch.response_mask).astype(np.float32)
    grads = {}
    for micro in (8, 2):
        actor = make_actor(graphdef, params, rows=8, log_prob_micro=8, ppo_mini_batch_size=8,
                           ppo_micro_batch_size_per_gpu=micro, loss_agg_mode=mode)
        stacked, nt, ns = actor.stack_micro(actor.minibatch_arrays(batch), np.arange(8), 8, micro)
        g, metrics = jax.jit(actor.accumulate_grads, static_argnames="prompt_width")(
            params, stacked, nt, ns, prompt_width=P)
        grads[micro] = (g, metrics)
    full, m_full = grads[8]
    for micro in (2,):
        g, m = grads[micro]
        for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(g)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac"):
            np.testing.assert_allclose(float(m[key]), float(m_full[key]), rtol=1e-4, atol=1e-6)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(full)) > 0


def test_update_raises_log_prob_of_positively_advantaged_responses(split_model):
    graphdef, params = split_model
    params = jax.tree.map(lambda x: x.copy(), params)
    batch = make_batch(n=4, seed=3)
    comp = LogProbComputer(graphdef, micro_batch_size=4, temperature=1.0)
    before, _ = comp(params, batch)
    batch.old_log_probs = before
    batch.ref_log_probs = before
    batch.advantages = np.where(np.arange(4)[:, None] % 2 == 0, 1.0, -1.0).astype(np.float32) * batch.response_mask
    actor = make_actor(graphdef, params, rows=4, log_prob_micro=4, ppo_mini_batch_size=4,
                       ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.0, use_kl_loss=False)
    metrics = actor.update(batch)
    after, _ = comp(actor.params, batch)
    delta = ((after - before) * batch.response_mask).sum(-1)
    assert delta[0] > 0 and delta[2] > 0 and delta[1] < 0 and delta[3] < 0
    assert metrics["actor/nonfinite_grad"] == 0 and metrics["actor/grad_norm"] > 0
    assert actor.num_updates == 1 and metrics["actor/lr"] == pytest.approx(1e-2)
    # entropy_coeff=0: the update computes no entropy (verl's calculate_entropy); the trainer logs the old pass's
    assert "actor/entropy" not in metrics


def test_skipping_the_old_pass_gives_the_same_on_policy_update(split_model):
    """recompute_old_log_prob=False (pi_old = stop_gradient(current)): one on-policy update yields the same params
    and losses as recomputing the old log-probs first; more than one update per step is refused."""
    graphdef, params = split_model
    batch = make_batch(n=4, seed=5)
    comp = LogProbComputer(graphdef, micro_batch_size=4, temperature=1.0)
    old, _ = comp(params, batch)
    batch.rollout_log_probs = old + 0.05 * batch.response_mask  # placeholder the skipping loss must not read
    batch.advantages = np.where(np.arange(4)[:, None] % 2 == 0, 1.0, -1.0).astype(np.float32) * batch.response_mask
    results = {}
    for recompute in (True, False):
        b = dataclasses.replace(batch, old_log_probs=old if recompute else None)
        actor = make_actor(graphdef, jax.tree.map(lambda x: x.copy(), params), rows=4, log_prob_micro=4,
                           ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, use_kl_loss=False,
                           recompute_old_log_prob=recompute)
        results[recompute] = (actor.update(b), actor.params)
    (m_re, p_re), (m_skip, p_skip) = results[True], results[False]
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        np.testing.assert_allclose(m_skip[k], m_re[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert m_skip["actor/pg_clipfrac"] == 0.0  # ratio exactly 1
    for a, b in zip(jax.tree.leaves(p_re), jax.tree.leaves(p_skip)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    two_updates = make_actor(graphdef, params, rows=4, log_prob_micro=4, ppo_mini_batch_size=2,
                             ppo_micro_batch_size_per_gpu=2, recompute_old_log_prob=False, use_kl_loss=False)
    with pytest.raises(ValueError, match="recompute_old_log_prob=False needs one on-policy update per step"):
        two_updates.update(dataclasses.replace(batch, old_log_probs=None))


def test_nonfinite_gradient_skips_update(split_model):
    graphdef, params = split_model
    params = jax.tree.map(lambda x: x.copy(), params)
    batch = make_batch(n=2, seed=4)
    batch.old_log_probs = np.zeros(batch.response_ids.shape, np.float32)
    batch.advantages = np.full(batch.response_ids.shape, np.nan, np.float32)
    actor = make_actor(graphdef, params, rows=2, log_prob_micro=2, use_kl_loss=False)
    before = jax.tree.map(np.asarray, actor.params)
    metrics = actor.update(batch)
    assert metrics["actor/nonfinite_grad"] == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(actor.params)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_actor_and_reference_share_the_log_prob_program():
    """The old-log-prob pass and the reference's run one model on the same shapes: one compiled executable, not
    two (each compile of a real model costs seconds and host memory), and the results stay each one's own."""
    from jaxrl.workers.actor import _log_probs_program

    model = Decoder(tiny_model_config(hidden_size=24, intermediate_size=40), rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(model)
    ref_params = jax.tree.map(lambda x: x * 0.5, params)
    batch = make_batch(n=8, seed=4)
    actor_lp, ref_lp = (LogProbComputer(graphdef, micro_batch_size=4, temperature=0.7) for _ in range(2))
    before = _log_probs_program._cache_size()
    a, _ = actor_lp(params, batch)
    b, _ = ref_lp(ref_params, batch)
    assert _log_probs_program._cache_size() == before + 1
    assert not np.allclose(a, b)  # different params, different log-probs through the shared program
    c, _ = LogProbComputer(graphdef, micro_batch_size=4, temperature=0.7)(params, batch)
    np.testing.assert_array_equal(a, c)
