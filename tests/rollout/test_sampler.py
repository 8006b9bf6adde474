"""Tests of the embedded JAX sampler (jaxrl.rollout) against independent references.

Most tests share one tiny random fp32 Decoder and one sampler whose calls all land in the same
shape bucket (P=16, B=4, R=8), so only a few programs compile.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder, init_cache
from jaxrl.rollout import JaxSampler, RolloutEngine, RolloutOutput, SamplingParams
from jaxrl.rollout import sampling
from jaxrl.rollout.prompt_packing import pack_prompts, packed_length

PAD, BOS, EOS = 0, 1, 2
R = 8
# Lengths 9..16 all bucket to P=16 (bucket 8, max 16); 3-4 rows bucket to B=4.
PROMPTS = [
    [BOS, 5, 6, 7, 8, 9, 10, 11, 12, 13],
    [BOS, 40, 41],
    [BOS, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
]


def _cfg(**kw) -> ModelConfig:
    base = dict(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        bos_token_id=BOS,
        eos_token_id=(EOS,),
        pad_token_id=PAD,
    )
    base.update(kw)
    return ModelConfig(**base)


def _sharpen(state, scale: float = 8.0):
    """Scale matrices so the random model's next-token distributions are peaked (fewer near-ties)."""
    return jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, state)


@pytest.fixture(scope="module")
def cfg():
    return _cfg()


@pytest.fixture(scope="module")
def model(cfg):
    m = Decoder(cfg, rngs=nnx.Rngs(0))
    nnx.update(m, _sharpen(nnx.state(m)))
    return m


@pytest.fixture(scope="module")
def ref(model):
    return make_reference(model)


@pytest.fixture(scope="module")
def sampler(cfg, model):
    return JaxSampler.from_model(
        model, cfg, pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=16, prompt_length_bucket=8
    )


REF_LEN = 32


def make_reference(model):
    """Return ``logits(seq) -> float32 [len(seq), V]``: one plain forward pass, no KV cache, no left
    padding, positions ``0..len-1`` (the independent reference). The sequence is right-padded to a
    fixed length so one jitted program serves every length; causal attention makes the right
    padding invisible to earlier positions."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(st, ids):
        pos = jnp.arange(REF_LEN, dtype=jnp.int32)[None]
        return nnx.merge(graphdef, st)(ids, pos, jnp.ones_like(ids))[0]

    def logits(seq):
        assert len(seq) <= REF_LEN
        ids = np.full((1, REF_LEN), PAD, np.int32)
        ids[0, : len(seq)] = seq
        return np.asarray(fwd(state, ids)[0, : len(seq)])

    return logits


def naive_greedy(ref, prompt: list[int], steps: int, stop=(EOS,)) -> list[int]:
    """Greedy decoding by recomputing the full forward pass each step (no KV cache)."""
    seq, out = list(prompt), []
    for _ in range(steps):
        tok = int(np.argmax(ref(seq)[-1]))
        out.append(tok)
        seq.append(tok)
        if tok in stop:
            break
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """HF TopKLogitsWarper: remove scores < the k-th largest."""
    if k <= 0:
        return logits
    k = min(k, logits.shape[-1])
    kth = np.sort(logits, axis=-1)[:, -k][:, None]
    return np.where(logits < kth, -np.inf, logits)


def np_top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """HF TopPLogitsWarper (min_tokens_to_keep=1), written out in numpy float32."""
    order = np.argsort(logits, axis=-1, kind="stable")
    srt = np.take_along_axis(logits, order, axis=-1).astype(np.float32)
    e = np.exp(srt - srt.max(-1, keepdims=True))
    probs = (e / e.sum(-1, keepdims=True)).astype(np.float32)
    remove_sorted = np.cumsum(probs, axis=-1, dtype=np.float32) <= np.float32(1.0 - p)
    remove_sorted[:, -1] = False
    remove = np.zeros_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=-1)
    return np.where(remove, -np.inf, logits)


# ----------------------------------------------------------------------------- API / validation
def test_protocol_and_output_shapes(sampler):
    assert isinstance(sampler, RolloutEngine)
    out = sampler.generate(PROMPTS, SamplingParams(n=1, do_sample=False, max_new_tokens=R))
    assert isinstance(out, RolloutOutput)
    n = len(PROMPTS)
    assert out.prompt_ids.shape == (n, 16) and out.prompt_ids.dtype == np.int32
    assert out.prompt_mask.shape == (n, 16) and out.prompt_mask.dtype == np.int32
    assert out.response_ids.shape == (n, R) and out.response_ids.dtype == np.int32
    assert out.response_mask.shape == (n, R) and out.response_mask.dtype == np.int32
    assert out.rollout_log_probs.shape == (n, R) and out.rollout_log_probs.dtype == np.float32
    np.testing.assert_array_equal(out.prompt_index, np.arange(n))
    for i, p in enumerate(PROMPTS):  # left padding with the pad id
        np.testing.assert_array_equal(out.prompt_ids[i, 16 - len(p) :], p)
        assert (out.prompt_ids[i, : 16 - len(p)] == PAD).all()
        assert out.prompt_mask[i].sum() == len(p) and out.prompt_mask[i, -len(p) :].all()
    assert out.num_generated_tokens == int(out.response_mask.sum())
    np.testing.assert_array_equal(out.response_lengths, out.response_mask.sum(-1))


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop_token_ids": ("a",)}, "stop_token_ids"),
        ({"do_sample": 1}, "do_sample"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**32}, "seed"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_sampling_params_validation(kw, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kw)


def test_sampling_params_defaults_and_list_stop_ids():
    sp = SamplingParams(stop_token_ids=[5, 6])
    assert sp.stop_token_ids == (5, 6)
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens, sp.do_sample, sp.seed) == (
        1, 1.0, 1.0, -1, 64, True, 0
    )
    assert not sp.greedy and SamplingParams(do_sample=False).greedy and SamplingParams(temperature=0).greedy


def test_bad_prompts_raise(sampler):
    sp = SamplingParams(do_sample=False, max_new_tokens=R)
    with pytest.raises(ValueError, match="empty"):
        sampler.generate([], sp)
    with pytest.raises(ValueError, match=r"prompt 1 has 17 tokens.*max_prompt_length=16"):
        sampler.generate([[BOS], [BOS] * 17], sp)
    with pytest.raises(ValueError, match=r"prompt 0 has token ids \[64\]"):
        sampler.generate([[BOS, 64]], sp)
    with pytest.raises(ValueError, match=r"prompt 1 must be a flat list of int"):
        sampler.generate([[BOS], [BOS, 2.5]], sp)


def test_empty_prompt_means_bos(sampler):
    sp = SamplingParams(do_sample=False, max_new_tokens=R)
    a = sampler.generate([[], PROMPTS[0], PROMPTS[2]], sp)
    b = sampler.generate([[BOS], PROMPTS[0], PROMPTS[2]], sp)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)


def test_empty_prompt_without_bos_raises(model):
    cfg = _cfg(bos_token_id=None)
    s = JaxSampler(cfg, *nnx.split(model), pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=4)
    with pytest.raises(ValueError, match="prompt 0 is empty.*bos"):
        s.generate([[]], SamplingParams())


# ----------------------------------------------------------------------------- greedy correctness
def test_greedy_kv_cache_equals_full_recompute(sampler, ref):
    out = sampler.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=R))
    for i, p in enumerate(PROMPTS):
        expect = naive_greedy(ref, p, R)
        got = out.response_token_lists()[i]
        assert got == expect, f"prompt {i}: kv-cache {got} != recompute {expect}"
        # Greedy log-probs are under temperature 1.
        lp = log_softmax(ref(p + expect))
        want = [lp[len(p) - 1 + t, tok] for t, tok in enumerate(expect)]
        np.testing.assert_allclose(out.rollout_log_probs[i, : len(expect)], want, atol=1e-5)


def test_padding_invariance(sampler):
    sp = SamplingParams(do_sample=False, max_new_tokens=R)
    before = sampler.num_compiles
    alone = sampler.generate([PROMPTS[1]], sp)  # P=8, B=1: a different bucket
    assert sampler.num_compiles == before + 2  # prefill + decode for the new bucket
    mixed = sampler.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], sp)  # P=16, B=4, padded more
    np.testing.assert_array_equal(alone.response_ids[0], mixed.response_ids[1])
    np.testing.assert_array_equal(alone.response_mask[0], mixed.response_mask[1])
    np.testing.assert_allclose(alone.rollout_log_probs[0], mixed.rollout_log_probs[1], atol=1e-5)


def test_stops_at_stop_token_and_masks_after(sampler, ref):
    expect = naive_greedy(ref, PROMPTS[0], R, stop=())
    stop_tok = expect[2]
    first = expect.index(stop_tok)
    out = sampler.generate(
        PROMPTS, SamplingParams(do_sample=False, max_new_tokens=R, stop_token_ids=(stop_tok,))
    )
    np.testing.assert_array_equal(out.response_ids[0, : first + 1], expect[: first + 1])
    assert out.response_mask[0].tolist() == [1] * (first + 1) + [0] * (R - first - 1)
    assert (out.response_ids[0, first + 1 :] == PAD).all()
    assert (out.rollout_log_probs[0, first + 1 :] == 0).all()
    assert (out.rollout_log_probs[0, : first + 1] < 0).all()
    # Other rows stop at their own first occurrence of the stop token (or run to R).
    for i in (1, 2):
        full = naive_greedy(ref, PROMPTS[i], R, stop=(stop_tok, EOS))
        assert out.response_token_lists()[i] == full


def test_loop_exits_early_when_all_rows_stop(sampler, ref):
    # 3 rows in a 4-row bucket: the filler row must not keep the loop running.
    firsts = tuple(sorted({naive_greedy(ref, p, 1)[0] for p in PROMPTS}))
    out = sampler.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=R, stop_token_ids=firsts))
    assert sampler.last_decode_steps == 1
    assert out.response_lengths.tolist() == [1, 1, 1]
    assert (out.response_ids[:, 1:] == PAD).all()
    sampler.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=R))
    assert sampler.last_decode_steps == max(len(naive_greedy(ref, p, R)) for p in PROMPTS)


def test_stops_at_model_eos(cfg, model, ref):
    expect = naive_greedy(ref, PROMPTS[1], R, stop=())
    eos = expect[1]
    s = JaxSampler.from_model(model, cfg, pad_token_id=PAD, eos_token_ids=(eos,), max_prompt_length=16)
    out = s.generate([PROMPTS[1]], SamplingParams(do_sample=False, max_new_tokens=R))
    k = expect.index(eos)
    assert out.response_token_lists()[0] == expect[: k + 1]
    assert out.response_lengths.tolist() == [k + 1]
    # every row finished early, so the loop exited early: the tail must still be padding
    assert (out.response_ids[0, k + 1 :] == PAD).all() and (out.rollout_log_probs[0, k + 1 :] == 0).all()


def test_ignore_eos_runs_to_max_new_tokens(cfg, model, ref):
    """``ignore_eos=True``: the model's eos no longer ends the row (greedy path continues through it)."""
    expect = naive_greedy(ref, PROMPTS[1], R, stop=())
    eos = expect[1]
    s = JaxSampler.from_model(model, cfg, pad_token_id=PAD, eos_token_ids=(eos,), max_prompt_length=16)
    out = s.generate([PROMPTS[1]], SamplingParams(do_sample=False, max_new_tokens=R, ignore_eos=True))
    assert out.response_token_lists()[0] == expect
    assert out.response_lengths.tolist() == [R]
    # an explicit stop id still ends it
    stop = expect[3]
    out = s.generate([PROMPTS[1]], SamplingParams(do_sample=False, max_new_tokens=R, ignore_eos=True,
                                                  stop_token_ids=(stop,)))
    assert out.response_token_lists()[0] == expect[: expect.index(stop) + 1]


def test_top_k_1_sampling_equals_greedy(sampler):
    greedy = sampler.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=R))
    topk1 = sampler.generate(PROMPTS, SamplingParams(temperature=0.7, top_k=1, max_new_tokens=R, seed=3))
    np.testing.assert_array_equal(greedy.response_ids, topk1.response_ids)
    np.testing.assert_array_equal(greedy.response_mask, topk1.response_mask)
    # temperature 0 is greedy too (vLLM convention)
    t0 = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=R))
    np.testing.assert_array_equal(greedy.response_ids, t0.response_ids)


# ----------------------------------------------------------------------------- sampling correctness
def test_sampled_log_probs_match_full_forward(sampler, ref):
    temp, top_k, top_p = 0.7, 12, 0.9
    out = sampler.generate(PROMPTS, SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, max_new_tokens=R))
    for i, p in enumerate(PROMPTS):
        resp = out.response_token_lists()[i]
        logits = ref(p + resp)
        lp = log_softmax(logits / temp)
        for t, tok in enumerate(resp):
            row = logits[len(p) - 1 + t][None] / np.float32(temp)
            kept = np.isfinite(np_top_p(np_top_k(row, top_k), top_p))[0]
            assert kept[tok], f"prompt {i} step {t}: token {tok} is outside the top-k/top-p set"
            assert abs(out.rollout_log_probs[i, t] - lp[len(p) - 1 + t, tok]) < 1e-5
        assert (out.rollout_log_probs[i, len(resp) :] == 0).all()


def test_n_samples_differ_and_seed_reproduces(sampler):
    prompt = [PROMPTS[0]]
    sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=R, seed=11)
    a = sampler.generate(prompt, sp)
    b = sampler.generate(prompt, sp)
    np.testing.assert_array_equal(a.prompt_index, [0, 0, 0, 0])
    assert len({tuple(r) for r in a.response_ids.tolist()}) > 1, "n=4 samples are all identical"
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_array_equal(a.rollout_log_probs, b.rollout_log_probs)
    c = sampler.generate(prompt, sp, rng_seed=12)
    assert not np.array_equal(a.response_ids, c.response_ids)


def test_rows_independent_of_chunking(cfg, model, sampler):
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=R, seed=5)
    whole = sampler.generate(PROMPTS[:2], sp)  # 4 rows in one chunk
    chunked_sampler = JaxSampler(
        cfg, *nnx.split(model), pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=16,
        prompt_length_bucket=8, max_batch_size=2,
    )
    chunked = chunked_sampler.generate(PROMPTS[:2], sp)  # two chunks of 2 rows
    np.testing.assert_array_equal(whole.response_ids, chunked.response_ids)
    np.testing.assert_allclose(whole.rollout_log_probs, chunked.rollout_log_probs, atol=1e-5)


def test_n_samples_prefill_each_distinct_prompt_once(cfg, model, sampler, ref):
    """n = 2 over 3 prompts prefills 3 prompts (bucketed to 4), not 6 rows, and samples exactly what the same prompts
    listed n times give (one prefill per row; a row's random stream depends only on its global row index); a chunk
    boundary that splits a prompt's rows (max_batch_size=4: rows 0-3, 4-5) keeps that."""
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=R, seed=3)
    listed = [p for p in PROMPTS for _ in range(2)]
    shared = sampler.generate(PROMPTS, sp)
    per_row = sampler.generate(listed, SamplingParams(n=1, temperature=1.0, max_new_tokens=R, seed=3))
    np.testing.assert_array_equal(shared.response_ids, per_row.response_ids)
    np.testing.assert_allclose(shared.rollout_log_probs, per_row.rollout_log_probs, atol=1e-5)
    np.testing.assert_array_equal(shared.prompt_index, [0, 0, 1, 1, 2, 2])
    for i, p in enumerate(listed):  # and each sample's log-probs are the full forward's
        resp = shared.response_token_lists()[i]
        lp = log_softmax(ref(p + resp))
        np.testing.assert_allclose(shared.rollout_log_probs[i, : len(resp)],
                                   [lp[len(p) - 1 + t, tok] for t, tok in enumerate(resp)], atol=1e-5)

    ids, mask = np.zeros((8, 16), np.int32), np.zeros((8, 16), np.int32)
    for i, p in enumerate(listed):
        ids[i, 16 - len(p):], mask[i, 16 - len(p):] = p, 1
    ids_u, mask_u, row_map = sampler._prefill_rows(ids, mask, shared.prompt_index)
    assert ids_u.shape == (4, 16)  # 3 distinct prompts + 1 filler, not 8 rows
    np.testing.assert_array_equal(ids_u[:3], ids[[0, 2, 4]])
    np.testing.assert_array_equal(row_map, [0, 0, 1, 1, 2, 2, 0, 0])
    assert mask_u[3].tolist() == [0] * 15 + [1]
    padded = JaxSampler(cfg, *nnx.split(model), pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=16,
                        prompt_length_bucket=8, packed_prefill=False)
    assert padded._prefill_rows(ids[:3], mask[:3], np.arange(3)) is None  # n = 1, padded: every row prefilled
    # n = 1, packed: the rows as they are, no row map (the prefill's cache is the decode's, no cache-sized gather)
    distinct_ids, distinct_mask, none = sampler._prefill_rows(ids[[0, 2, 4, 6]], mask[[0, 2, 4, 6]], np.arange(3))
    assert none is None
    np.testing.assert_array_equal(distinct_ids, ids[[0, 2, 4, 6]])
    np.testing.assert_array_equal(distinct_mask, mask[[0, 2, 4, 6]])
    np.testing.assert_array_equal(padded._prefill_rows(ids, mask, shared.prompt_index)[2], row_map)

    chunked = JaxSampler(cfg, *nnx.split(model), pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=16,
                         prompt_length_bucket=8, max_batch_size=4).generate(PROMPTS, sp)
    np.testing.assert_array_equal(chunked.response_ids, shared.response_ids)
    np.testing.assert_allclose(chunked.rollout_log_probs, shared.rollout_log_probs, atol=1e-5)


def test_packed_prefill_samples_what_padded_prefill_samples(cfg, model, sampler):
    """The default packed prefill (prompts' real tokens in one row) and the padded ``[B, P]`` prefill give the same
    samples and log-probs, greedy and sampled, n = 1 and n = 2."""
    padded = JaxSampler(cfg, *nnx.split(model), pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=16,
                        prompt_length_bucket=8, packed_prefill=False)
    assert sampler.packed_prefill and not padded.packed_prefill
    for sp in (SamplingParams(do_sample=False, max_new_tokens=R), SamplingParams(n=2, max_new_tokens=R, seed=4)):
        a, b = sampler.generate(PROMPTS, sp), padded.generate(PROMPTS, sp)
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_allclose(a.rollout_log_probs, b.rollout_log_probs, atol=1e-5)


def test_prefill_packed_fills_the_padded_prefill_cache(cfg, model, sampler):
    """Prompts packed end to end into one row of 192 tokens write each prompt token's keys and values to the same
    cache slots as the left-padded prefill, and nothing else."""
    rng = np.random.default_rng(0)
    prompts = [[BOS] + rng.integers(3, 64, size=n).tolist() for n in (15, 2, 9, 0, 13, 15, 11, 14, 15, 6, 12, 15, 14)]
    width, r = 16, 4
    u = len(prompts)
    ids, mask = np.full((u, width), PAD, np.int32), np.zeros((u, width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    packed = pack_prompts(ids, mask, cache_len=width + r - 1, pad_token_id=PAD)
    assert packed.input_ids.shape == (1, 192)
    assert (packed.slots < width + r - 1).sum() == sum(len(p) - 1 for p in prompts)
    graphdef, state = nnx.split(model)
    got = nnx.merge(graphdef, state).prefill_packed(
        jnp.asarray(packed.input_ids), jnp.asarray(packed.positions), jnp.asarray(packed.segment_cols),
        init_cache(cfg, u, width + r - 1), jnp.asarray(packed.rows), jnp.asarray(packed.slots))
    want = sampler._prefill_impl(state, jnp.asarray(ids), jnp.asarray(mask), max_new_tokens=r)
    filled = np.zeros((u, width + r - 1), bool)
    for i, p in enumerate(prompts):
        filled[i, width - len(p): width - 1] = True
    for g, w in ((got.k, want.k), (got.v, want.v)):
        g, w = (np.moveaxis(np.stack(x), 3, 2) for x in (g, w))  # per layer [B, nKV, S, D] -> [L, B, S, nKV, D]
        np.testing.assert_allclose(g[:, filled], w[:, filled], atol=1e-5)
        assert not g[:, ~filled].any()  # padding, the last prompt tokens and generated slots untouched
        assert np.abs(w[:, filled]).min() > 0


def test_pack_prompts_layout():
    """Every prompt token but the last in exactly one cell with its row, left-padded slot, position and column in
    ``segment_cols``, prompts in order; the row's length a multiple of 64, on 8 sizes per doubling past 512;
    right-padded prompts refused."""
    lengths = [7, 1, 4, 6, 3, 0, 5]
    width, cache_len = 8, 12
    ids = np.zeros((len(lengths), width), np.int32)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = 100 * i + np.arange(n)
        mask[i, width - n:] = 1
    packed = pack_prompts(ids, mask, cache_len=cache_len, pad_token_id=0)
    assert packed.input_ids.shape == (1, 64)
    real = packed.slots < cache_len
    total = sum(max(n - 1, 0) for n in lengths)
    assert real.sum() == total and real[0, :total].all()
    for i, n in enumerate(lengths):
        cells = real & (packed.rows == i)
        assert cells.sum() == max(n - 1, 0)
        np.testing.assert_array_equal(packed.slots[cells], np.arange(width - n, width - 1))
        np.testing.assert_array_equal(packed.positions[cells], np.arange(max(n - 1, 0)))
        np.testing.assert_array_equal(packed.input_ids[cells], 100 * i + np.arange(max(n - 1, 0)))
        cols = packed.segment_cols[0, i]  # the per-prompt attention's gather: its tokens' columns, then "none" (64)
        np.testing.assert_array_equal(cols[: max(n - 1, 0)], np.flatnonzero(cells[0]))
        assert (cols[max(n - 1, 0):] == 64).all()
    np.testing.assert_array_equal(packed.rows[real], np.sort(packed.rows[real]))  # prompts in order
    assert (packed.rows[~real] == 0).all() and (packed.input_ids[~real] == 0).all()
    assert [packed_length(n) for n in (1, 64, 65, 512, 513, 577, 1025, 1153, 2049)] == \
        [64, 64, 128, 512, 576, 640, 1152, 1280, 2304]
    with pytest.raises(ValueError, match="prompt 0 is not left-padded"):
        pack_prompts(ids[::-1, ::-1].copy(), mask[::-1, ::-1].copy(), cache_len=cache_len, pad_token_id=0)


def test_no_recompile_within_bucket(sampler):
    sampler.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=R))
    before = sampler.num_compiles
    # different prompt lengths (9..16 -> P=16), row counts (3..4 -> B=4), sampling controls and seeds
    # (and the packed prefill's row: 9 + 2 + 14, 8 + 15 + 11 and 4 x 11 tokens all pack into one row of 64)
    sampler.generate([[BOS] * 9, [BOS] * 16, [BOS] * 12], SamplingParams(temperature=0.5, top_p=0.8, max_new_tokens=R))
    sampler.generate([[BOS, 3] * 6] * 4, SamplingParams(top_k=5, seed=9, max_new_tokens=R, stop_token_ids=(7, 8)))
    assert sampler.num_compiles == before


def test_update_weights(sampler, model, cfg):
    sp = SamplingParams(do_sample=False, max_new_tokens=R)
    original = sampler.params
    base = sampler.generate(PROMPTS, sp)
    compiles = sampler.num_compiles
    other = nnx.state(Decoder(cfg, rngs=nnx.Rngs(1)))
    try:
        sampler.update_weights(_sharpen(other))
        new = sampler.generate(PROMPTS, sp)
        assert not np.array_equal(base.response_ids, new.response_ids)
        assert sampler.num_compiles == compiles
    finally:
        sampler.update_weights(original)
    np.testing.assert_array_equal(sampler.generate(PROMPTS, sp).response_ids, base.response_ids)

    wrong_shape = nnx.state(Decoder(_cfg(intermediate_size=48), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"mismatch.*gate_proj.*\(32, 64\).*\(32, 48\)"):
        sampler.update_weights(wrong_shape)
    fewer_layers = nnx.state(Decoder(_cfg(num_hidden_layers=1), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"missing \[.*\['layers'\]\[1\]"):
        sampler.update_weights(fewer_layers)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), original)
    with pytest.raises(ValueError, match="bfloat16"):
        sampler.update_weights(bf16)
    kept = jax.tree_util.tree_leaves(sampler.params)
    assert all(a is b for a, b in zip(kept, jax.tree_util.tree_leaves(original), strict=True))


# ----------------------------------------------------------------------------- pure functions
@pytest.mark.parametrize("k", [-1, 0, 1, 5, 50, 100])
def test_top_k_filter_matches_numpy(k):
    logits = np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32) * 3
    got = np.asarray(jax.jit(sampling.top_k_filter)(logits, k))
    np.testing.assert_array_equal(got, np_top_k(logits, k))


@pytest.mark.parametrize("p", [1e-6, 0.1, 0.5, 0.9, 0.99, 1.0])
def test_top_p_filter_matches_numpy(p):
    logits = np.random.default_rng(1).normal(size=(6, 50)).astype(np.float32) * 2
    got = np.asarray(jax.jit(sampling.top_p_filter)(logits, p))
    np.testing.assert_array_equal(got, np_top_p(logits, p))
    assert np.isfinite(got).sum(-1).min() >= 1  # at least one token kept
    if p == 1e-6:
        np.testing.assert_array_equal(np.isfinite(got).sum(-1), 1)


@pytest.mark.parametrize("k,p", [(-1, 1.0), (10, 1.0), (-1, 0.7), (10, 0.7), (3, 0.95)])
def test_filter_logits_is_top_k_then_top_p(k, p):
    logits = np.random.default_rng(2).normal(size=(6, 50)).astype(np.float32) * 2
    got = np.asarray(jax.jit(sampling.filter_logits)(logits, k, p))
    np.testing.assert_array_equal(got, np_top_p(np_top_k(logits, k), p))


def test_select_tokens_samples_filtered_distribution():
    rng = np.random.default_rng(3)
    row = rng.normal(size=(1, 20)).astype(np.float32) * 2
    n, temp, k, p = 4000, 0.8, 6, 0.9
    logits = jnp.asarray(np.repeat(row, n, axis=0))
    keys = jax.random.split(jax.random.key(0), n)
    toks, lps = jax.jit(
        lambda lg, ks: sampling.select_tokens(lg, ks, temperature=temp, top_k=k, top_p=p, greedy=False)
    )(logits, keys)
    toks, lps = np.asarray(toks), np.asarray(lps)
    filt = np_top_p(np_top_k(row / np.float32(temp), k), p)[0]
    probs = np.exp(log_softmax(filt[None])[0])
    assert set(toks.tolist()) <= set(np.flatnonzero(np.isfinite(filt)).tolist())
    freq = np.bincount(toks, minlength=20) / n
    np.testing.assert_allclose(freq, probs, atol=0.03)
    # log-probs are under the untruncated temperature-scaled softmax
    np.testing.assert_allclose(lps, log_softmax(row / np.float32(temp))[0, toks], atol=1e-5)

    g_toks, g_lps = sampling.select_tokens(logits[:2], keys[:2], temperature=temp, top_k=k, top_p=p, greedy=True)
    assert np.asarray(g_toks).tolist() == [int(row.argmax())] * 2
    np.testing.assert_allclose(np.asarray(g_lps), log_softmax(row)[0, row.argmax()], atol=1e-6)


def test_sample_categorical_matches_softmax_across_blocks():
    """Two-stage inverse-CDF sampling over a vocabulary of several 256-token blocks (+ a ragged last block):
    frequencies follow softmax(logits); -inf entries (whole blocks included) are never drawn."""
    rng = np.random.default_rng(11)
    v, n = 700, 40000
    row = rng.normal(size=v).astype(np.float32) * 1.5
    row[:256] = -np.inf  # the first block has no mass at all
    row[300:310] = -np.inf
    row[[400, 650]] = [3.5, 3.0]  # heavy tokens in blocks 1 and 2
    logits = jnp.asarray(np.repeat(row[None], n, axis=0))
    toks = np.asarray(jax.jit(sampling.sample_categorical)(jax.random.split(jax.random.key(3), n), logits))
    probs = np.exp(log_softmax(row[None])[0])
    assert np.isfinite(row[toks]).all()
    freq = np.bincount(toks, minlength=v) / n
    np.testing.assert_allclose(freq, probs, atol=4 * np.sqrt(probs.max() / n))
    for tok in (400, 650):  # the heavy tokens: relative error of their frequency
        assert abs(freq[tok] - probs[tok]) < 0.05 * probs[tok]


# ----------------------------------------------------------------------------- real model
def test_stories260k_golden_greedy(shared):
    from jaxrl.models import load_pretrained

    model_dir = shared / "models" / "stories260K"
    golden = json.loads((model_dir / "greedy_from_bos_256_ids.json").read_text())
    pre = load_pretrained(str(model_dir))
    s = JaxSampler.from_model(
        pre.model, pre.config, pad_token_id=0, eos_token_ids=pre.config.eos_token_id, max_prompt_length=8
    )
    out = s.generate([[]], SamplingParams(do_sample=False, max_new_tokens=len(golden) - 1))
    assert out.prompt_ids[0, out.prompt_mask[0].astype(bool)].tolist() == golden[:1]
    assert out.response_token_lists()[0] == golden[1:]


@pytest.mark.parametrize("override, packed", [([], True), (["actor_rollout_ref.rollout.packed_prefill=false"], False)])
def test_config_key_packed_prefill_reaches_the_sampler(cfg, model, override, packed):
    from types import SimpleNamespace

    from jaxrl.config import load_config
    from jaxrl.rollout.factory import make_rollout_engine

    run_cfg = load_config("configs/quickstart.yaml", override)
    engine = make_rollout_engine(run_cfg, cfg, *nnx.split(model), SimpleNamespace(pad_token_id=PAD))
    assert isinstance(engine, JaxSampler) and engine.packed_prefill is packed


# ----------------------------------------------------------------------------- decode in segments
def test_decode_segment_ends():
    from jaxrl.rollout.jax_sampler import DECODE_SEGMENT_MIN_TOKENS, decode_segment_ends

    assert DECODE_SEGMENT_MIN_TOKENS == 128
    assert decode_segment_ends(512, 4) == (128, 256, 384, 512)
    assert decode_segment_ends(1024, 4) == (256, 512, 768, 1024)
    assert decode_segment_ends(300, 4) == (150, 300)  # 2 segments of >= 128 steps
    assert decode_segment_ends(255, 4) == (255,) and decode_segment_ends(128, 4) == (128,)
    assert decode_segment_ends(512, 1) == (512,)
    assert decode_segment_ends(13, 4, 4) == (5, 10, 13)  # the last one shorter
    assert decode_segment_ends(1, 4, 4) == (1,)
    for bad in ({"max_new_tokens": 0}, {"max_segments": 0}, {"min_tokens": True}):
        args = {"max_new_tokens": 12, "max_segments": 4, "min_tokens": 4, **bad}
        with pytest.raises(ValueError, match=rf"^{next(iter(bad))}=.* must be an int >= 1"):
            decode_segment_ends(**args)
    with pytest.raises(ValueError, match=r"max_decode_segments=0 must be an int >= 1"):
        JaxSampler(_cfg(), *nnx.split(Decoder(_cfg(), rngs=nnx.Rngs(0))), pad_token_id=PAD, eos_token_ids=(EOS,),
                   max_prompt_length=16, max_decode_segments=0)


R_LONG = 12  # 3 decode segments of 4 steps with decode_segment_min_tokens=4


def _segmented(cfg, model, segments: int, **kw) -> JaxSampler:
    return JaxSampler(cfg, *nnx.split(model), pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=16,
                      prompt_length_bucket=8, max_decode_segments=segments, decode_segment_min_tokens=4, **kw)


@pytest.mark.parametrize("packed", [True, False])
def test_segmented_decode_samples_what_one_loop_samples(cfg, model, ref, packed):
    """Three decode segments over a cache grown from 15 + 4 to 15 + 12 slots give the full-recompute greedy tokens
    and log-probs, and the same samples and log-probs as one loop over the whole cache (n = 1 and n = 2, packed and
    padded prefill); each segment is its own program (prefill + 3 decode loops + 2 growths)."""
    one, seg = _segmented(cfg, model, 1, packed_prefill=packed), _segmented(cfg, model, 4, packed_prefill=packed)
    greedy = SamplingParams(do_sample=False, max_new_tokens=R_LONG, ignore_eos=True)
    out = seg.generate(PROMPTS, greedy)
    assert seg.num_compiles == 6 and seg.last_decode_steps == R_LONG
    for i, p in enumerate(PROMPTS):
        expect = naive_greedy(ref, p, R_LONG, stop=())
        assert out.response_token_lists()[i] == expect, f"prompt {i}"
        lp = log_softmax(ref(p + expect))
        np.testing.assert_allclose(out.rollout_log_probs[i], [lp[len(p) - 1 + t, tok] for t, tok in enumerate(expect)],
                                   atol=1e-5)
    for sp in (greedy, SamplingParams(n=2, max_new_tokens=R_LONG, seed=4, ignore_eos=True),
               SamplingParams(n=1, max_new_tokens=R_LONG, seed=9)):
        a, b = seg.generate(PROMPTS, sp), one.generate(PROMPTS, sp)
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.response_mask, b.response_mask)
        np.testing.assert_allclose(a.rollout_log_probs, b.rollout_log_probs, atol=1e-5)
    assert one.num_compiles == 2 * 2  # prefill + decode for n = 1 and for n = 2 (a different prefill)


def test_segmented_decode_stops_between_segments(cfg, model, ref):
    """Every row stopping in the second segment ends the decode there (the third segment never runs, so its program
    is never built), with the tokens up to each row's stop as one loop gives them."""
    seg = _segmented(cfg, model, 4)
    stop = {naive_greedy(ref, p, R_LONG, stop=())[5] for p in PROMPTS}  # step 5 lies in the second segment (4..7)
    sp = SamplingParams(do_sample=False, max_new_tokens=R_LONG, stop_token_ids=tuple(stop), ignore_eos=True)
    out = seg.generate(PROMPTS, sp)
    assert seg.last_decode_steps <= 6 and seg.num_compiles == 1 + 2 + 1  # prefill, 2 decode loops, 1 growth
    for i, p in enumerate(PROMPTS):
        assert out.response_token_lists()[i] == naive_greedy(ref, p, R_LONG, stop=tuple(stop))
    assert out.response_ids.shape == (3, R_LONG) and (out.response_ids[out.response_mask == 0] == PAD).all()


def test_segmented_decode_on_a_mesh(cfg, model):
    """On a rollout mesh (rows over ``data``) the segmented decode samples what one loop on one device does."""
    from sharding import DEFAULT_RULES, make_mesh, param_shardings, shard_state

    graphdef, state = nnx.split(model)
    mesh = make_mesh(2, 1, 2, devices=jax.devices()[:4])
    on_mesh = shard_state(state, param_shardings(state, mesh, DEFAULT_RULES))
    seg = JaxSampler(cfg, graphdef, on_mesh, pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=16,
                     prompt_length_bucket=8, mesh=mesh, rules=DEFAULT_RULES, max_decode_segments=4,
                     decode_segment_min_tokens=4)
    sp = SamplingParams(n=2, max_new_tokens=R_LONG, seed=2)
    a, b = seg.generate(PROMPTS, sp), _segmented(cfg, model, 1).generate(PROMPTS, sp)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_allclose(a.rollout_log_probs, b.rollout_log_probs, atol=1e-5)


@pytest.mark.parametrize("override, segments", [([], 4), (["actor_rollout_ref.rollout.max_decode_segments=1"], 1)])
def test_config_key_max_decode_segments_reaches_the_sampler(cfg, model, override, segments):
    from types import SimpleNamespace

    from jaxrl.config import load_config
    from jaxrl.rollout.factory import make_rollout_engine

    run_cfg = load_config("configs/quickstart.yaml", override)
    engine = make_rollout_engine(run_cfg, cfg, *nnx.split(model), SimpleNamespace(pad_token_id=PAD))
    assert isinstance(engine, JaxSampler) and engine.max_decode_segments == segments


def test_config_refuses_a_bad_max_decode_segments():
    from jaxrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.max_decode_segments.*0"):
        load_config("configs/quickstart.yaml", ["actor_rollout_ref.rollout.max_decode_segments=0"])


def test_cache_growth_drops_each_old_layer(cfg, sampler):
    """Growing the cache keeps each layer's slots and zero-fills the new ones, and gathering a compaction's rows keeps
    the rows asked for; both leave no reference to the old buffers (so each holds about one old layer beside the new
    cache)."""
    import weakref

    rng = np.random.default_rng(0)
    k = [jnp.asarray(rng.normal(size=(2, 2, 5, 8)), jnp.float32) for _ in range(cfg.num_hidden_layers)]
    v = [x + 1 for x in k]
    want = [np.asarray(x).copy() for x in k + v]  # (a plain np.asarray view would keep the array alive)
    old = [weakref.ref(x) for x in k + v]
    sampler._grow_layers(k, v, 9)
    assert all(r() is None for r in old)
    for got, w in zip(k + v, want):
        assert got.shape == (2, 2, 9, 8)
        np.testing.assert_array_equal(np.asarray(got)[:, :, :5], w)
        assert not np.asarray(got)[:, :, 5:].any()
    del got  # (the loop variable still holds the last layer)
    # and a compaction's row gather the same way
    want = [np.asarray(x)[[1, 1]].copy() for x in k + v]
    old = [weakref.ref(x) for x in k + v]
    sampler._take_layers(k, v, jnp.asarray([1, 1], jnp.int32))
    assert all(r() is None for r in old)
    for got, w in zip(k + v, want):
        np.testing.assert_array_equal(np.asarray(got), w)


# ----------------------------------------------------------------------------- finished rows compacted away
def _compacting(cfg, model, **kw) -> tuple[JaxSampler, list]:
    """A sampler compacting down to 1 row, and the live-row counts of its compactions (recorded by a wrapper)."""
    s = JaxSampler(cfg, *nnx.split(model), pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=16,
                   prompt_length_bucket=8, compact_min_rows=1, **kw)
    sizes, compact = [], s._compact
    s._compact = lambda *a: (sizes.append(len(a[6])), compact(*a))[1]  # a[6]: the live slots
    return s, sizes


@pytest.mark.parametrize("segments", [1, 4])
def test_compaction_keeps_every_rows_tokens(cfg, model, ref, segments):
    """Rows stopping at different steps: the batch of 4 (3 prompts + a filler) shrinks to 2 rows, then to 1, and
    every row's tokens and log-probs are the full-recompute greedy ones; sampled (n = 2: 6 rows in 8), each row's
    samples and log-probs equal those of a sampler that never compacts, in one decode loop or in segments."""
    full = [naive_greedy(ref, p, R_LONG, stop=()) for p in PROMPTS]
    stop = (full[0][1], full[1][4])
    want = [naive_greedy(ref, p, R_LONG, stop=stop) for p in PROMPTS]
    lengths = [len(w) for w in want]
    assert len(set(lengths)) == 3 and sorted(lengths)[1] < R_LONG, lengths  # two rows stop, at different steps
    comp, sizes = _compacting(cfg, model, max_decode_segments=segments, decode_segment_min_tokens=4)
    out = comp.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=R_LONG, stop_token_ids=stop,
                                                ignore_eos=True))
    assert sizes == [2, 1] and comp.last_decode_steps == max(lengths)
    assert out.response_token_lists() == want
    for i, p in enumerate(PROMPTS):
        lp = log_softmax(ref(p + want[i]))
        np.testing.assert_allclose(out.rollout_log_probs[i, : lengths[i]],
                                   [lp[len(p) - 1 + t, tok] for t, tok in enumerate(want[i])], atol=1e-5)
    assert (out.response_ids[out.response_mask == 0] == PAD).all() and (out.rollout_log_probs[out.response_mask == 0]
                                                                        == 0).all()

    plain = JaxSampler(cfg, *nnx.split(model), pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=16,
                       prompt_length_bucket=8, compact_finished_rows=False, max_decode_segments=segments,
                       decode_segment_min_tokens=4)
    compacted = 0
    for seed in (1, 2, 3):
        sp = SamplingParams(n=2, max_new_tokens=R_LONG, seed=seed, stop_token_ids=stop)
        del sizes[:]
        a, b = comp.generate(PROMPTS, sp), plain.generate(PROMPTS, sp)
        compacted += len(sizes)
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.response_mask, b.response_mask)
        np.testing.assert_allclose(a.rollout_log_probs, b.rollout_log_probs, atol=1e-5)
    assert compacted >= 1


def test_compaction_is_off_below_its_minimum_and_by_the_config_key(cfg, model, ref):
    """A 4-row batch never compacts with the default minimum of 4 rows; ``compact_finished_rows=False`` never does;
    the config key reaches the sampler."""
    from types import SimpleNamespace

    from jaxrl.config import load_config
    from jaxrl.rollout.factory import make_rollout_engine
    from jaxrl.rollout.jax_sampler import COMPACT_MIN_ROWS

    full = [naive_greedy(ref, p, R_LONG, stop=()) for p in PROMPTS]
    sp = SamplingParams(do_sample=False, max_new_tokens=R_LONG, stop_token_ids=(full[0][1], full[1][4]))
    s = JaxSampler(cfg, *nnx.split(model), pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=16,
                   prompt_length_bucket=8)
    assert s.compact_finished_rows and s.compact_min_rows == COMPACT_MIN_ROWS == 4
    called = []
    s._compact = lambda *a: called.append(a)
    s.generate(PROMPTS, sp)
    assert not called
    for override, on in (([], True), (["actor_rollout_ref.rollout.compact_finished_rows=false"], False)):
        engine = make_rollout_engine(load_config("configs/quickstart.yaml", override), cfg, *nnx.split(model),
                                     SimpleNamespace(pad_token_id=PAD))
        assert engine.compact_finished_rows is on
