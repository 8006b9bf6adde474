"""Shared prompts (``actor.use_prefix_grouper``): each distinct prompt laid once per packed row, exact.

A GRPO batch repeats every prompt ``n`` times. With ``share_prompts`` the packed layout lays a prompt once and its
responses attend to that copy (:mod:`jaxrl.workers.packing`), and the planner keeps a prompt's rows on one device
(:mod:`jaxrl.workers.seqlen`). Here: the layout holds every sequence's real tokens at the right positions with
fewer columns, and log-probs, entropies, losses and gradients equal the padded ones (the padded path has parity
with transformers: tests/models/test_decoder_parity.py), under fixed and token-budget micro-batches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import ConfigError, load_config
from jaxrl.config.batch_plan import BatchPlan
from jaxrl.models.decoder import Decoder
from jaxrl.workers.actor import LogProbComputer
from jaxrl.workers.packing import packed_micro, prompt_groups, prompt_sharing, real_lengths, spans
from jaxrl.workers.seqlen import plan_slots, token_budget_slots
from tests.helpers import tiny_model_config
from tests.workers.test_packing import ATOL, MODES, P, make_actor, max_diff, padded_full_grads, ragged_batch, slotted


def grouped_batch(n=12, group=3, seed=0):
    """:func:`ragged_batch` with each run of ``group`` rows repeating its first row's prompt (a GRPO batch), and
    the last row's prompt its own."""
    batch = ragged_batch(n=n, seed=seed)
    for i in range(n - 1):
        g = (i // group) * group
        batch.prompt_ids[i], batch.prompt_mask[i] = batch.prompt_ids[g], batch.prompt_mask[g]
    assert len({batch.prompt_ids[i].tobytes() for i in range(n)}) == -(-(n - 1) // group) + 1
    return batch


def arrays_of(batch):
    return {"input_ids": batch.input_ids(), "attention_mask": batch.attention_mask(),
            "response_ids": batch.response_ids, "response_mask": batch.response_mask.astype(np.float32)}


def test_prompt_groups_name_equal_prompts():
    batch = grouped_batch(n=10, group=4)
    groups = prompt_groups(batch.input_ids(), batch.attention_mask(), P)
    for i in range(10):
        for j in range(10):
            same = batch.prompt_ids[i].tobytes() == batch.prompt_ids[j].tobytes()
            assert (groups[i] == groups[j]) == same
    assert len(set(groups.tolist())) == 4  # 0-3, 4-7, 8, 9 (its own prompt)
    shared = prompt_sharing(arrays_of(batch), P, True)
    np.testing.assert_array_equal(shared["prompt_lengths"], batch.prompt_mask.sum(1))
    assert prompt_sharing(arrays_of(batch), P, False) == {"groups": None, "prompt_lengths": None}


def test_shared_layout_lays_each_prompt_once():
    batch = grouped_batch(n=12, group=3)
    ids, mask = batch.input_ids(), batch.attention_mask()
    arrays = arrays_of(batch)
    slots = np.array([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    plain, micro = packed_micro(arrays, slots, P), packed_micro(arrays, slots, P, share_prompts=True)
    start, end = spans(mask, P)
    prompt_len, resp_len = P - start, end - P
    # real tokens: each distinct prompt of a device row once, every response
    for d, row in enumerate(slots):
        distinct = {ids[i, start[i]:P].tobytes(): prompt_len[i] for i in row}
        assert (micro["segment_ids"][d] != 0).sum() == sum(distinct.values()) + resp_len[row].sum()
    assert (micro["segment_ids"] != 0).sum() < (plain["segment_ids"] != 0).sum()
    t = micro["input_ids"].shape[1]
    for d, row in enumerate(slots):
        for j, i in enumerate(row):
            n = end[i] - start[i]
            cols = micro["segment_cols"][d, j]
            assert (cols[n:] == t).all() and (cols[:n] < t).all()
            # the sequence's real tokens at its columns, at positions 0..n-1 (the padded row's)
            np.testing.assert_array_equal(micro["input_ids"][d, cols[:n]], ids[i, start[i]:end[i]])
            np.testing.assert_array_equal(micro["positions"][d, cols[:n]], np.arange(n))
            # response token q is scored at the column of the token before it in this sequence
            k = micro["slot_index"][d].reshape(len(row), -1)[j, : resp_len[i]]
            np.testing.assert_array_equal(micro["score_cols"][d, k], cols[prompt_len[i] - 1 : n - 1])
            np.testing.assert_array_equal(micro["score_ids"][d, k], batch.response_ids[i, : resp_len[i]])
        # a group's later rows read the first row's prompt columns
        for a, b in ((0, 1), (0, 2), (3, 4)):
            i = row[a]
            np.testing.assert_array_equal(micro["segment_cols"][d, a, : prompt_len[i]],
                                          micro["segment_cols"][d, b, : prompt_len[i]])


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def policy(request):
    return nnx.split(Decoder(tiny_model_config(request.param), rngs=nnx.Rngs(1)))


def test_shared_log_probs_and_entropies_equal_padded(policy):
    graphdef, params = policy
    batch = grouped_batch(n=13, group=4, seed=3)
    lp0, ent0 = LogProbComputer(graphdef, micro_batch_size=13, temperature=0.7)(params, batch)
    assert np.abs(lp0).max() > 1.0
    for kw in (dict(micro_batch_size=8), dict(micro_batch_size=4, max_token_len=24),
               dict(micro_batch_size=4, max_token_len=12)):
        lp, ent = LogProbComputer(graphdef, temperature=0.7, share_prompts=True, **kw)(params, batch)
        np.testing.assert_allclose(lp, lp0, rtol=0, atol=ATOL, err_msg=str(kw))
        np.testing.assert_allclose(ent, ent0, rtol=0, atol=ATOL, err_msg=str(kw))
        assert np.all(lp[batch.response_mask == 0] == 0)


SCHEMES = {"fixed": dict(remove_padding=True, share_prompts=True),
           "budget": dict(remove_padding=True, share_prompts=True, max_token_len=30)}
CASES = [(m, "budget") for m in MODES] + [("token-mean", "fixed")]


@pytest.mark.parametrize("mode,scheme", CASES)
def test_shared_gradient_equals_padded_full_batch(mode, scheme):
    graphdef, params = nnx.split(Decoder(tiny_model_config("qwen2"), rngs=nnx.Rngs(2)))
    batch = grouped_batch(n=12, group=3, seed=5)
    full, m_full = padded_full_grads(make_actor(graphdef, params, 12, loss_agg_mode=mode, kl_loss_type="full"),
                                     batch)
    actor = make_actor(graphdef, params, 12, loss_agg_mode=mode, kl_loss_type="full")
    actor.plan = dataclasses.replace(actor.plan, **SCHEMES[scheme])
    if scheme == "fixed":
        actor.plan = dataclasses.replace(actor.plan, micro_batch_rows=6)  # 2 micro-batches of 2 groups
    sharing = prompt_sharing(actor.minibatch_arrays(batch), P, True)
    micros = actor.micro_slots(np.arange(12), real_lengths(batch.attention_mask()), sharing)
    assert len(micros) >= 2
    grads, metrics = slotted(actor, batch)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(full)) > 1e-3
    assert max_diff(grads, full) < ATOL, max_diff(grads, full)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl"):
        np.testing.assert_allclose(float(metrics[key]), float(m_full[key]), rtol=1e-5, atol=1e-6, err_msg=key)


def test_planner_keeps_a_prompts_rows_together_and_counts_it_once():
    # 4 groups of 4 rows: prompt 20 tokens, responses 10 -> 60 shared tokens per group (120 unshared)
    lengths = np.full(16, 30)
    groups, prompts = np.repeat(np.arange(4), 4), np.full(16, 20)
    rows = np.arange(100, 116)
    for shards in (1, 2):
        micros = plan_slots(rows, lengths, shards=shards, micro_rows=8, packed=True, groups=groups,
                            prompt_lengths=prompts)
        for slots in micros:
            for dev in slots:
                real = dev[dev >= 0] - 100
                # whole groups per device
                assert all(np.isin(np.flatnonzero(groups == g), real).all() for g in set(groups[real].tolist()))
    # a budget of 120 fits two shared groups (2 x 60) where unshared rows take one group (4 x 30) per micro-batch
    shared = token_budget_slots(rows, lengths, 120, 1, groups=groups, prompt_lengths=prompts)
    assert len(shared) == 2 and len(token_budget_slots(rows, lengths, 120, 1)) == 4
    # a group over the budget is cut into pieces that each fit (prompt laid again per piece)
    cut = token_budget_slots(rows, lengths, 45, 1, groups=groups, prompt_lengths=prompts)
    seen = []
    for slots in cut:
        real = slots[slots >= 0] - 100
        seen += real.tolist()
        assert len(set(groups[real].tolist())) == 1
        assert 20 + 10 * len(real) <= 45
    assert sorted(seen) == list(range(16))


def test_use_prefix_grouper_reaches_the_plan():
    base = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2", "trainer.n_gpus_per_node=1"]
    plan = BatchPlan.from_config(load_config(None, [*base, "actor_rollout_ref.actor.use_prefix_grouper=true"]))
    assert plan.actor.share_prompts and plan.actor.remove_padding  # implies the packed layout
    assert not plan.critic.share_prompts
    off = BatchPlan.from_config(load_config(None, base))
    assert not off.actor.share_prompts and not off.actor.remove_padding
    with pytest.raises(ConfigError, match="use_prefix_grouper=True"):
        load_config(None, [*base, "algorithm.dpo.enable=true", "actor_rollout_ref.actor.use_prefix_grouper=true"])


def test_shared_update_over_shuffled_mini_batches_equals_padded():
    """Two shuffled mini-batches per step (each plans its own rows' prompt groups): the whole ``update`` (AdamW
    steps, metrics) with shared prompts equals the padded one."""
    from jaxrl.workers.actor import ActorWorker
    from tests.helpers import actor_setup

    graphdef, params = nnx.split(Decoder(tiny_model_config("llama"), rngs=nnx.Rngs(5)))
    batch = grouped_batch(n=12, group=3, seed=8)
    copy = lambda t: jax.tree.map(lambda x: jnp.array(x, copy=True), t)  # noqa: E731
    workers = []
    for share in (False, True):
        cfg, plan = actor_setup(rows=12, log_prob_micro=12, ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=3,
                                shuffle=True)
        plan = dataclasses.replace(plan, remove_padding=share, share_prompts=share)
        workers.append(ActorWorker(graphdef, copy(params), cfg, plan=plan, temperature=0.8, total_training_steps=1))
    base, shared = workers
    assert base.plan.mini_batch_rows == 6  # two mini-batches: the shared planner sees a shuffled subset each time
    m0, m1 = base.update(batch), shared.update(batch)
    assert max_diff(shared.params, base.params) < 1e-5
    assert max_diff(shared.params, params) > 1e-4
    for key, v in m0.items():
        np.testing.assert_allclose(m1[key], v, rtol=1e-4, atol=1e-6, err_msg=key)
