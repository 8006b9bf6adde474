"""Packed rows (``use_remove_padding``) and token-budget micro-batches (``use_dynamic_bsz``) are exact.

Packed log-probs, entropies and values equal the padded ones, and the gradient of a mini-batch over packed and / or
token-budget micro-batches equals the padded full mini-batch's gradient, for every ``loss_agg_mode`` (the padded
path has parity with transformers: tests/models/test_decoder_parity.py). Also: the host-side planning (balanced
partitions, budgets, buckets, layouts), and that ragged steps compile a handful of programs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.batch import RLBatch
from jaxrl.models.decoder import Decoder, gqa_attention, segment_gqa_attention, segment_layout
from jaxrl.models.value_model import ValueModel
from jaxrl.workers.actor import ActorWorker, LogProbComputer
from jaxrl.workers.critic import CriticWorker
from jaxrl.workers.packing import packed_micro, padded_micro, real_lengths, scatter_rows, spans
from jaxrl.workers.seqlen import balanced_partitions, bucket, bucket_below, chunk_slots, plan_slots, token_budget_slots
from tests.helpers import actor_setup, critic_setup, tiny_batch, tiny_model_config

P, R = 7, 6
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# fp32 tolerance: packed and padded runs sum the same terms in other orders (attention over T vs P + R keys,
# scoring K vs R columns)
ATOL = 2e-5


def ragged_batch(n=12, seed=0, vocab=64) -> RLBatch:
    """Prompts of 1..P tokens, responses of 0..R tokens (one empty, one full), advantages / old / ref log-probs."""
    batch, rng = tiny_batch(n, seed, prompt_width=P, response_width=R, vocab_size=vocab)
    resp_len = rng.integers(1, R + 1, size=n)
    resp_len[0], resp_len[1] = R, 0
    prompt_len = rng.integers(1, P + 1, size=n)
    batch.prompt_mask = (np.arange(P)[None] >= (P - prompt_len)[:, None]).astype(np.int32)
    batch.prompt_ids = (rng.integers(3, vocab, (n, P)) * batch.prompt_mask).astype(np.int32)
    batch.response_mask = (np.arange(R)[None] < resp_len[:, None]).astype(np.int32)
    batch.response_ids = (batch.response_ids * batch.response_mask).astype(np.int32)
    m = batch.response_mask
    batch.advantages = (rng.normal(size=(n, R)) * m).astype(np.float32)
    batch.old_log_probs = (-rng.uniform(0.5, 4.0, size=(n, R)) * m).astype(np.float32)
    batch.ref_log_probs = (-rng.uniform(0.5, 4.0, size=(n, R)) * m).astype(np.float32)
    batch.rollout_log_probs = batch.old_log_probs
    batch.values = (rng.normal(size=(n, R)) * m).astype(np.float32)
    batch.returns = (rng.normal(size=(n, R)) * m).astype(np.float32)
    return batch


def max_diff(a, b) -> float:
    return max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ------------------------------------------------------------------------------------------------ host planning
def test_bucket_below_grid():
    """Widths under a token budget: eighths of it above its half, then {1, 3/4} per octave; always >= n, <= top."""
    assert [bucket_below(n, 1024) for n in (590, 640, 641, 1000, 512, 400, 300, 1)] == [640, 640, 768, 1024, 512,
                                                                                      512, 384, 1]
    for top in (1, 7, 1000, 1024, 1280):
        widths = {bucket_below(n, top) for n in range(1, top + 1)}
        for n in range(1, top + 1):
            w = bucket_below(n, top)
            assert n <= w <= top
            if 2 * n > top:
                assert w - n < top / 8 + 1  # at most an eighth of the budget wasted above half of it
        assert len([w for w in widths if 2 * w > top]) <= 5  # a handful of shapes near the budget
    with pytest.raises(ValueError, match="need 1 <= top"):
        bucket_below(1025, 1024)


def test_bucket_grid():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 9, 13, 100)] == [1, 1, 2, 3, 4, 6, 6, 8, 12, 16, 128]
    assert [bucket(n, fine=False) for n in (1, 3, 5, 9, 100)] == [1, 4, 8, 16, 128]
    assert bucket(3, minimum=16) == 16
    for n in range(1, 3000):
        b = bucket(n)
        assert n <= b < 1.5 * n + 1


def test_balanced_partitions_cover_and_balance():
    rng = np.random.default_rng(0)
    w = rng.integers(1, 500, size=101)
    parts = balanced_partitions(w, 7)
    assert sorted(i for p in parts for i in p) == list(range(101))
    sums = [int(w[p].sum()) for p in parts]
    assert sums == sorted(sums, reverse=True)
    assert max(sums) - min(sums) <= int(w.max())  # differencing: the spread stays below one item
    assert balanced_partitions([5], 3) == [[0], [], []]
    w2 = np.array([4, 3, 3, 2, 2, 2])
    assert [int(w2[p].sum()) for p in balanced_partitions(w2, 2)] == [8, 8]  # the perfect split
    with pytest.raises(ValueError, match="partitions must be >= 1"):
        balanced_partitions([1], 0)


def test_token_budget_slots_respect_the_budget():
    rng = np.random.default_rng(1)
    lengths = rng.integers(10, 200, size=64)
    rows = np.arange(100, 164)
    for shards in (1, 2, 4):
        budget = 400
        micros = token_budget_slots(rows, lengths, budget, shards)
        # verl's count: ceil(real tokens / (budget x devices)) micro-batches, more only if a part would overflow
        assert len(micros) >= int(np.ceil(lengths.sum() / (budget * shards)))
        assert len(micros) <= int(np.ceil(lengths.sum() / (budget * shards))) + 1
        seen = []
        for slots in micros:
            assert slots.shape[0] == shards
            for row in slots:
                real = row[row >= 0]
                seen += real.tolist()
                assert lengths[real - 100].sum() <= budget
        assert sorted(seen) == rows.tolist()
    with pytest.raises(ValueError, match=r"ppo_max_token_len_per_gpu=150 is below the longest sequence \(199"):
        token_budget_slots(rows, np.r_[lengths[:-1], 199], 150, 1, key="ppo_max_token_len_per_gpu")


def test_packed_layout_places_every_real_token():
    batch = ragged_batch()
    ids, mask = batch.input_ids(), batch.attention_mask()
    arrays = {"input_ids": ids, "attention_mask": mask, "positions": batch.positions(),
              "response_mask": batch.response_mask.astype(np.float32)}
    slots = chunk_slots(np.arange(batch.size), real_lengths(mask), 2)
    micro = packed_micro(arrays, slots, P)
    start, end = spans(mask, P)
    seg, pos = micro["segment_ids"], micro["positions"]
    assert (seg != 0).sum() == mask.sum()  # every real token once, nothing else
    for d, row in enumerate(slots):
        for j, i in enumerate(row):
            if i < 0:
                continue
            cols = np.flatnonzero(seg[d] == j + 1)
            np.testing.assert_array_equal(micro["input_ids"][d, cols], ids[i, start[i]:end[i]])
            np.testing.assert_array_equal(pos[d, cols], np.arange(end[i] - start[i]))  # restart per segment
            n = end[i] - start[i]  # the per-segment attention's gather: slot j's tokens in order, then "none" (T)
            want = np.r_[cols, np.full(ids.shape[1] - n, seg.shape[1])]
            np.testing.assert_array_equal(micro["segment_cols"][d, j], want)
    empty = slots < 0
    assert (micro["segment_cols"][empty] == seg.shape[1]).all()
    # scoring columns hold the token before each response token; their ids are the response tokens
    resp = micro["response_mask"].reshape(2, -1)
    for d in range(2):
        k = micro["slot_index"][d][resp[d] > 0]
        nxt = micro["input_ids"][d, micro["score_cols"][d, k] + 1]
        np.testing.assert_array_equal(nxt, micro["score_ids"][d, k])
    padded = padded_micro({"r": batch.response_ids}, slots)["r"]
    np.testing.assert_array_equal(scatter_rows([padded], [slots], batch.size), batch.response_ids)


# -------------------------------------------------------------------------------------------------- forward passes
@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def policy(request):
    cfg = tiny_model_config(request.param)
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(1)))
    return graphdef, params


def test_packed_log_probs_and_entropies_equal_padded(policy):
    graphdef, params = policy
    batch = ragged_batch(n=13, seed=3)
    lp0, ent0 = LogProbComputer(graphdef, micro_batch_size=13, temperature=0.7)(params, batch)
    assert np.abs(lp0).max() > 1.0
    for kw in (dict(remove_padding=True), dict(remove_padding=True, max_token_len=24), dict(max_token_len=24)):
        lp, ent = LogProbComputer(graphdef, micro_batch_size=4, temperature=0.7, **kw)(params, batch)
        np.testing.assert_allclose(lp, lp0, rtol=0, atol=ATOL, err_msg=str(kw))
        np.testing.assert_allclose(ent, ent0, rtol=0, atol=ATOL, err_msg=str(kw))
        assert np.all(lp[batch.response_mask == 0] == 0) and np.all(ent[batch.response_mask == 0] == 0)


def test_per_segment_attention_equals_the_segment_mask(policy):
    """Decoder(segment_cols=...) (attention gathered per segment into a padded layout) gives the hidden states and
    parameter gradient of the dense [G, T, T] same-segment mask at every real token."""
    graphdef, params = policy
    batch = ragged_batch(n=7, seed=5)
    mask = batch.attention_mask()
    arrays = {"input_ids": batch.input_ids(), "attention_mask": mask, "positions": batch.positions(),
              "response_mask": batch.response_mask.astype(np.float32)}
    micro = packed_micro(arrays, chunk_slots(np.arange(batch.size), real_lengths(mask), 2), P)
    ids, pos, seg = (jnp.asarray(micro[k]) for k in ("input_ids", "positions", "segment_ids"))
    cols = jnp.asarray(micro["segment_cols"])
    assert cols.shape[1] >= 3  # several sequences share a row

    def hidden(p, with_cols):
        return nnx.merge(graphdef, p)(ids, pos, seg != 0, return_hidden=True, segment_ids=seg,
                                      segment_cols=cols if with_cols else None)[0]

    real = np.asarray(seg) != 0
    np.testing.assert_allclose(np.asarray(hidden(params, True))[real], np.asarray(hidden(params, False))[real],
                               atol=1e-5)
    weight = jnp.where(seg[..., None] != 0, 1.0, 0.0)
    grads = [jax.grad(lambda p, c=c: ((hidden(p, c) * weight) ** 2).sum())(params) for c in (True, False)]
    for g_cols, g_mask in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_allclose(np.asarray(g_cols), np.asarray(g_mask), atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="segment_cols must be"):
        nnx.merge(graphdef, params)(ids, pos, seg != 0, segment_cols=cols)  # without segment_ids
    # the path is taken (the scatter of the packed columns' places in the per-segment layout is in the program), and
    # the attention alone equals dense masked attention on random inputs, with exact zeros on row padding
    assert "scatter" in str(jax.make_jaxpr(lambda p: hidden(p, True))(params))
    assert "scatter" not in str(jax.make_jaxpr(lambda p: hidden(p, False))(params))
    g, t = seg.shape
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((g, t, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((g, t, 2, 8)), jnp.float32) for _ in range(2))
    layout = segment_layout(cols, t)
    idx = jnp.arange(t)
    dense = (idx[None, :, None] >= idx[None, None, :]) & (seg[:, :, None] == seg[:, None, :]) & (seg != 0)[:, None]
    got = np.asarray(segment_gqa_attention(q, k, v, layout))
    np.testing.assert_allclose(got[real], np.asarray(gqa_attention(q, k, v, dense))[real], atol=1e-5)
    assert (~real).any() and not got[~real].any()


def test_decoder_without_segment_ids_is_unchanged(policy):
    """segment_ids=None is the default program: same jaxpr as a call that never mentions it."""
    graphdef, params = policy
    batch = ragged_batch(n=3)
    args = (jnp.asarray(batch.input_ids()), jnp.asarray(batch.positions()), jnp.asarray(batch.attention_mask()))

    def plain(p, *a):
        return nnx.merge(graphdef, p)(*a)[0]

    def explicit(p, *a):
        return nnx.merge(graphdef, p)(*a, segment_ids=None)[0]

    assert str(jax.make_jaxpr(plain)(params, *args)) == str(jax.make_jaxpr(explicit)(params, *args))


# ----------------------------------------------------------------------------------------------------- gradients
def make_actor(graphdef, params, n, **overrides) -> ActorWorker:
    remove_padding = overrides.pop("remove_padding", False)
    max_token_len = overrides.pop("max_token_len", None)
    fused_lm_head = overrides.pop("fused_lm_head", False)
    cfg, plan = actor_setup(rows=n, log_prob_micro=n, ppo_mini_batch_size=n, ppo_micro_batch_size_per_gpu=n,
                            **overrides)
    plan = dataclasses.replace(plan, remove_padding=remove_padding, max_token_len=max_token_len)
    ref = params if cfg.use_kl_loss and cfg.kl_loss_type == "full" else None
    return ActorWorker(graphdef, params, cfg, plan=plan, temperature=0.8, total_training_steps=1, ref_params=ref,
                       fused_lm_head=fused_lm_head)


def padded_full_grads(role, batch):
    """The reference: the padded path, the whole mini-batch in one micro-batch."""
    arrays = role.minibatch_arrays(batch)
    stacked, nt, ns = role.stack_micro(arrays, np.arange(batch.size), batch.size, batch.size)
    return jax.jit(role.accumulate_grads, static_argnames="prompt_width")(
        role.params, stacked, nt, ns, role._update_extra(), prompt_width=batch.prompt_width)


def slotted(role, batch):
    role.init_optimizer()
    grads, sums, wsums, tok = role.slotted_grads(role.params, role.minibatch_arrays(batch), np.arange(batch.size),
                                                 batch.prompt_width, role._update_extra())
    metrics = dict(sums)
    metrics.update({k: v / max(float(tok), 1.0) for k, v in wsums.items()})
    return grads, metrics


SCHEMES = {  # (remove_padding, token budget per device, micro-batch rows when no budget)
    "packed": dict(remove_padding=True),
    "dynamic": dict(max_token_len=30),
    "packed+dynamic": dict(remove_padding=True, max_token_len=30),
}


# every loss_agg_mode under packed token-budget micro-batches; packed fixed-count and padded token-budget ones once
CASES = [(m, "packed+dynamic") for m in MODES] + [("token-mean", "packed"), ("seq-mean-token-sum", "dynamic")]


@pytest.mark.parametrize("mode,scheme", CASES)
def test_actor_gradient_equals_padded_full_batch(mode, scheme):
    graphdef, params = nnx.split(Decoder(tiny_model_config("qwen2"), rngs=nnx.Rngs(2)))
    batch = ragged_batch(n=12, seed=5)
    ref_actor = make_actor(graphdef, params, 12, loss_agg_mode=mode, kl_loss_type="full")
    full, m_full = padded_full_grads(ref_actor, batch)
    actor = make_actor(graphdef, params, 12, loss_agg_mode=mode, kl_loss_type="full", **SCHEMES[scheme])
    if scheme == "packed":
        actor.plan = dataclasses.replace(actor.plan, micro_batch_rows=5)  # 3 ragged micro-batches of 5, 5, 2 rows
    micros = actor.micro_slots(np.arange(12), real_lengths(batch.attention_mask()))
    assert len(micros) >= 2  # really several micro-batches
    grads, metrics = slotted(actor, batch)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(full)) > 1e-3
    assert max_diff(grads, full) < ATOL, max_diff(grads, full)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl"):
        np.testing.assert_allclose(float(metrics[key]), float(m_full[key]), rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("loss_mode", ["gspo", "clip_cov", "kl_cov"])
def test_packed_gradient_for_other_policy_losses(loss_mode):
    graphdef, params = nnx.split(Decoder(tiny_model_config("llama"), rngs=nnx.Rngs(4)))
    batch = ragged_batch(n=8, seed=6)
    lp, _ = LogProbComputer(graphdef, micro_batch_size=8, temperature=0.8)(params, batch)
    batch.old_log_probs = (lp + 0.3 * np.random.default_rng(0).normal(size=lp.shape) * batch.response_mask
                           ).astype(np.float32)
    overrides = dict(loss_mode=loss_mode, loss_agg_mode="seq-mean-token-mean" if loss_mode == "gspo" else "token-mean")
    full, _ = padded_full_grads(make_actor(graphdef, params, 8, **overrides), batch)
    grads, _ = slotted(make_actor(graphdef, params, 8, remove_padding=True, **overrides), batch)
    assert max_diff(grads, full) < ATOL, max_diff(grads, full)


def make_critic(n, **overrides):
    remove_padding = overrides.pop("remove_padding", False)
    max_token_len = overrides.pop("max_token_len", None)
    overrides.pop("fused_lm_head", False)  # the critic has no LM head to fuse: the key is the actor's
    graphdef, params = nnx.split(ValueModel(tiny_model_config("qwen3"), rngs=nnx.Rngs(3)))
    cfg, plan = critic_setup(rows=n, ppo_mini_batch_size=n, ppo_micro_batch_size_per_gpu=n, **overrides)
    plan = dataclasses.replace(plan, remove_padding=remove_padding, max_token_len=max_token_len,
                               forward_max_token_len=max_token_len, forward_rows=5)
    return CriticWorker(graphdef, params, cfg, plan=plan, total_training_steps=1)


@pytest.mark.parametrize("mode,scheme", CASES)
def test_critic_values_and_gradient_equal_padded(mode, scheme):
    batch = ragged_batch(n=10, seed=7)
    base = make_critic(10, loss_agg_mode=mode)
    critic = make_critic(10, loss_agg_mode=mode, **SCHEMES[scheme])
    v0 = base.compute_values(batch)
    assert np.abs(v0).max() > 1e-3
    np.testing.assert_allclose(critic.compute_values(batch), v0, rtol=0, atol=ATOL)
    full, m_full = padded_full_grads(base, batch)
    if scheme == "packed":
        critic.plan = dataclasses.replace(critic.plan, micro_batch_rows=4)
    grads, metrics = slotted(critic, batch)
    assert max_diff(grads, full) < ATOL, max_diff(grads, full)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"):
        np.testing.assert_allclose(float(metrics[key]), float(m_full[key]), rtol=1e-5, atol=1e-6, err_msg=key)


def test_packed_update_equals_padded_update():
    """A whole ``update`` (AdamW step, metrics) on packed token-budget micro-batches equals the padded one."""
    graphdef, params = nnx.split(Decoder(tiny_model_config("llama"), rngs=nnx.Rngs(5)))
    batch = ragged_batch(n=12, seed=8)
    copy = lambda t: jax.tree.map(lambda x: jnp.array(x, copy=True), t)  # noqa: E731
    base = make_actor(graphdef, copy(params), 12)
    packed = make_actor(graphdef, copy(params), 12, remove_padding=True, max_token_len=30)
    m0, m1 = base.update(batch), packed.update(batch)
    assert max_diff(packed.params, base.params) < 1e-5
    assert max_diff(packed.params, params) > 1e-4
    for key, v in m0.items():
        np.testing.assert_allclose(m1[key], v, rtol=1e-4, atol=1e-6, err_msg=key)


# ----------------------------------------------------------------------------------------------- compiled shapes
def test_ragged_steps_compile_a_handful_of_programs():
    """Twelve steps of batches with random prompt / response lengths: bucketed packed shapes (row length anchored
    at the token budget, scoring columns and sequences per row on powers of two) keep the compiled accumulation and
    log-prob programs to a few, one per layout shape met, and the later steps add none."""
    graphdef, params = nnx.split(Decoder(tiny_model_config("llama", num_hidden_layers=1), rngs=nnx.Rngs(6)))
    actor = make_actor(graphdef, params, 16, remove_padding=True, max_token_len=40)
    actor.log_prob.max_token_len = 40
    actor.init_optimizer()
    from jaxrl.workers.actor import _packed_log_probs_program  # module-level: shared by every computer, count deltas

    log_prob_programs = _packed_log_probs_program._cache_size()
    layouts, counts = set(), []
    for step in range(12):
        batch = ragged_batch(n=16, seed=100 + step)
        actor.compute_log_probs(batch)
        actor.update(batch)
        arrays = actor.minibatch_arrays(batch)
        for slots in actor.micro_slots(np.arange(16), real_lengths(batch.attention_mask())):
            micro = packed_micro(arrays, slots, P, max_row_tokens=40)
            layouts.add((micro["input_ids"].shape, micro["score_cols"].shape, micro["slot_index"].shape))
        counts.append(actor._accumulate_fn._cache_size())
    assert actor._apply_fn._cache_size() == 1
    assert counts[-1] == len(layouts)  # one program per layout shape, none per step
    print("programs after each step:", counts)
    # 8 with widths {1, 3/4, 1/2} of the budget; 10 here with its eighths above half of it (bucket_below)
    assert counts[-1] <= 12, (counts, layouts)
    assert len(set(counts[-4:])) == 1, counts  # the bucket grid is exhausted: the last steps compile nothing new
    assert 1 <= _packed_log_probs_program._cache_size() - log_prob_programs <= 12

def test_plan_slots_fixed_matches_row_chunks():
    rows = np.arange(10)
    (a, b, c) = plan_slots(rows, np.ones(10), shards=2, micro_rows=4)
    np.testing.assert_array_equal(a, [[0, 1], [2, 3]])
    np.testing.assert_array_equal(c, [[8, 9], [-1, -1]])


def _shapes(jaxpr) -> set[tuple]:
    """Every array shape a jaxpr makes, its sub-jaxprs (scan, checkpoint, custom rules) included."""
    out = set()
    for eqn in jaxpr.eqns:
        out.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for p in eqn.params.values():
            inner = p if hasattr(p, "eqns") else getattr(p, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                out |= _shapes(inner)
    return out


@pytest.mark.parametrize("scheme", ["padded", "packed+dynamic"])
def test_chunked_lm_head_equals_the_whole_logits(monkeypatch, scheme):
    """With ``fused_lm_head`` (``actor_rollout_ref.model.use_fused_kernels``) the update's LM head runs in position
    chunks once the logits pass ``LOGITS_CHUNK_BYTES`` (:func:`jaxrl.algorithms.logprob.head_log_probs`), and the
    no-grad log-prob pass always does: gradient, loss terms (entropy in the loss), log-probs and entropies equal
    those of the whole logits; without the flag the update keeps the whole logits."""
    from jaxrl.algorithms import logprob

    graphdef, params = nnx.split(Decoder(tiny_model_config("llama"), rngs=nnx.Rngs(4)))
    vocab = tiny_model_config("llama").vocab_size
    batch = ragged_batch(n=12, seed=7)
    kw = {} if scheme == "padded" else SCHEMES[scheme]
    overrides = dict(loss_agg_mode="token-mean", kl_loss_type="low_var_kl", entropy_coeff=0.01)

    def run(fused):
        actor = make_actor(graphdef, params, 12, **overrides, **kw, fused_lm_head=fused)
        grads, metrics = slotted(actor, batch) if kw else padded_full_grads(actor, batch)
        lp = LogProbComputer(graphdef, micro_batch_size=4, temperature=0.8, **kw)(params, batch)
        return grads, metrics, lp, actor

    whole = run(False)
    # 2 positions per chunk of the widest call (12 rows x vocab x 4 B per position): several chunks everywhere
    monkeypatch.setattr(logprob, "LOGITS_CHUNK_BYTES", 2 * 12 * vocab * 4)
    jax.clear_caches()  # the module-level log-prob programs were traced with the whole budget
    try:
        chunked = run(True)
        if scheme == "padded":  # the update's program: no [12, R, V] logits with the flag, and they are there without
            arrays = chunked[3].minibatch_arrays(batch)
            stacked, nt, ns = chunked[3].stack_micro(arrays, np.arange(12), 12, 12)
            for actor, present in ((chunked[3], False), (whole[3], True)):
                jaxpr = jax.make_jaxpr(functools.partial(actor.accumulate_grads, prompt_width=P))(
                    actor.params, stacked, nt, ns, actor._update_extra())
                assert ((12, R, vocab) in _shapes(jaxpr.jaxpr)) is present
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert max_diff(chunked[0], whole[0]) < 1e-6, max_diff(chunked[0], whole[0])
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(whole[0])) > 1e-3
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        np.testing.assert_allclose(float(chunked[1][key]), float(whole[1][key]), rtol=1e-6, err_msg=key)
    for a, b in zip(chunked[2], whole[2]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
