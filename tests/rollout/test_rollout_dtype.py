"""The rollout's own compute dtype (``actor_rollout_ref.rollout.dtype``, :class:`JaxSampler` ``dtype=``).

A bfloat16 rollout of a float32 model runs every projection and the LM head as a bfloat16 x bfloat16 -> float32 matmul
on bfloat16 copies of the weight matrices (:func:`jaxrl.models.decoder.project`); a float32 rollout of a bfloat16 model
computes the whole forward in float32. Checked against numpy (the matmul), against the plain forward without a KV
cache in the same mode (the sampler's log-probs), against the float32 sampler (close, not equal), and on the compiled
decode program (its weights arrive as bfloat16 and XLA makes no float32 copy of them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder, init_cache, project
from jaxrl.rollout import JaxSampler, SamplingParams
from jaxrl.rollout.jax_sampler import _per_layer_matrices_as, _rollout_attributes

PAD, BOS, EOS = 0, 1, 2
R = 8
PROMPTS = [[BOS, 5, 6, 7, 8, 9, 10, 11, 12, 13], [BOS, 40, 41], [BOS, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]]


def _cfg(**kw) -> ModelConfig:
    base = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, bos_token_id=BOS, eos_token_id=(EOS,),
                pad_token_id=PAD)
    base.update(kw)
    return ModelConfig(**base)


def _model(cfg, dtype=jnp.float32, seed=0):
    m = Decoder(cfg, rngs=nnx.Rngs(seed), dtype=dtype)
    nnx.update(m, jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, nnx.state(m)))  # peaked distributions
    return m


def _sampler(model, cfg, dtype):
    return JaxSampler.from_model(model, cfg, pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=16,
                                 prompt_length_bucket=8, dtype=dtype)


def _scored(model, prompt, response, attrs):
    """Log-probs of ``response`` after ``prompt`` by one plain forward (no KV cache, no padding), the model merged
    with bfloat16 weight matrices and ``attrs`` set as the sampler sets them."""
    graphdef, state = nnx.split(model)
    if "matmul_dtype" in attrs:
        state = jax.tree.map(lambda w: w.astype(jnp.bfloat16) if w.ndim >= 2 else w, state)
    m = nnx.merge(graphdef, state)
    m.set_attributes(**attrs, raise_if_not_found=False)
    seq = np.asarray([list(prompt) + list(response)], np.int32)
    logits, _ = m(jnp.asarray(seq), jnp.arange(seq.shape[1])[None], jnp.ones_like(seq))
    logp = jax.nn.log_softmax(np.asarray(logits[0], np.float64), axis=-1)
    pos = np.arange(len(prompt) - 1, seq.shape[1] - 1)
    return np.asarray(logp)[pos, seq[0, len(prompt):]]


def test_project_is_a_bfloat16_matmul_accumulated_in_float32():
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(3, 5, 48)).astype(np.float32), rng.normal(size=(48, 4, 8)).astype(np.float32)
    y = project(jnp.asarray(x), jnp.asarray(w), jnp.float32, jnp.bfloat16)
    assert y.dtype == jnp.float32 and y.shape == (3, 5, 4, 8)
    xb, wb = (a.astype(ml_dtypes.bfloat16).astype(np.float64) for a in (x, w))
    expected = (xb.reshape(15, 48) @ wb.reshape(48, 32)).reshape(3, 5, 4, 8)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)
    exact = np.einsum("btk,kho->btho", x.astype(np.float64), w.astype(np.float64))
    assert np.abs(np.asarray(y) - exact).max() > 1e-3  # the operands were rounded: not the float32 product
    np.testing.assert_allclose(np.asarray(project(jnp.asarray(x), jnp.asarray(w), jnp.float32)), exact, rtol=1e-4,
                               atol=1e-4)


def test_rollout_attributes_per_model_dtype():
    assert _rollout_attributes(jnp.float32, None) == {} and _rollout_attributes(jnp.float32, "float32") == {}
    assert _rollout_attributes(jnp.bfloat16, "bfloat16") == {}
    assert _rollout_attributes(jnp.float32, "bfloat16") == {"matmul_dtype": jnp.dtype(jnp.bfloat16)}
    assert _rollout_attributes(jnp.bfloat16, "float32") == {"dtype": jnp.dtype(jnp.float32)}
    cfg = _cfg()
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.dtype='float16' is invalid; valid: None, "
                                         r"float32, bfloat16"):
        _sampler(_model(cfg), cfg, "float16")


@pytest.mark.parametrize("greedy", [True, False])
def test_bfloat16_rollout_scores_its_samples_as_a_bfloat16_forward(greedy):
    cfg = _cfg()
    model = _model(cfg)
    sp = SamplingParams(n=2, do_sample=not greedy, temperature=1.0, max_new_tokens=R, seed=3)
    out = _sampler(model, cfg, "bfloat16").generate(PROMPTS, sp)
    ref32 = _sampler(model, cfg, None).generate(PROMPTS, sp)
    assert out.response_mask.sum() > 0
    diffs = []
    for row in range(len(PROMPTS) * 2):
        prompt = PROMPTS[out.prompt_index[row]]
        n = int(out.response_mask[row].sum())
        response = out.response_ids[row, :n]
        lp = out.rollout_log_probs[row, :n]
        np.testing.assert_allclose(lp, _scored(model, prompt, response, {"matmul_dtype": jnp.bfloat16}), atol=2e-4)
        diffs.append(np.abs(lp - _scored(model, prompt, response, {})))  # against the float32 model
    diffs = np.concatenate(diffs)
    assert diffs.max() > 1e-4, "the bfloat16 rollout gave the float32 log-probs: it did not round"
    assert np.median(diffs) < 0.05, diffs
    if greedy:  # peaked distributions: the same greedy tokens as the float32 sampler
        np.testing.assert_array_equal(out.response_ids, ref32.response_ids)


def test_float32_rollout_of_a_bfloat16_model_equals_the_float32_model():
    cfg = _cfg()
    model16 = _model(cfg, dtype=jnp.bfloat16)
    model32 = _model(cfg, dtype=jnp.float32)  # the same seed: the same float32 weights
    sp = SamplingParams(n=1, do_sample=True, temperature=1.0, max_new_tokens=R, seed=5)
    out = _sampler(model16, cfg, "float32").generate(PROMPTS, sp)
    ref = _sampler(model32, cfg, None).generate(PROMPTS, sp)
    as16 = _sampler(model16, cfg, None).generate(PROMPTS, sp)
    np.testing.assert_array_equal(out.response_ids, ref.response_ids)
    np.testing.assert_allclose(out.rollout_log_probs, ref.rollout_log_probs, atol=1e-5)
    assert np.abs(as16.rollout_log_probs - ref.rollout_log_probs).max() > 1e-3  # the bfloat16 model differs


def test_bfloat16_decode_program_holds_no_float32_copy_of_the_weights():
    """XLA:CPU turns a bfloat16 -> bfloat16 dot into a float32 one and hoists the weights' conversion out of the
    decode loop (a float32 copy of the model in the program's temporaries); the bfloat16 x bfloat16 -> float32
    projections keep the weights bfloat16 inside the loop."""
    cfg = _cfg(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
               head_dim=32, num_hidden_layers=2)
    sampler = _sampler(_model(cfg), cfg, "bfloat16")
    weights = sampler._call_weights()
    matrices = [w for w in jax.tree.leaves(weights) if w.ndim >= 2]
    assert matrices and all(w.dtype == jnp.bfloat16 for w in matrices)
    f32_bytes = sum(w.size * 4 for w in matrices)
    b, p = 4, 16
    cache = init_cache(cfg, b, p + R - 1, jnp.float32)
    ids = jnp.full((b, p), BOS, jnp.int32)
    controls = {"seed": np.uint32(0), "temperature": np.float32(1.0), "top_k": np.int32(-1),
                "top_p": np.float32(1.0), "greedy": np.bool_(False)}
    carry = (jnp.int32(0), ids[:, -1], jnp.zeros((b,), bool), jnp.zeros((b, R), jnp.int32),
             jnp.zeros((b, R), jnp.float32), jnp.zeros((b, R), jnp.int32))
    compiled = sampler._decode_jit.lower(weights, cache, carry, jnp.ones_like(ids), jnp.arange(b, dtype=jnp.int32),
                                         jnp.full((8,), EOS, jnp.int32), controls, jnp.int32(R),
                                         jnp.int32(0)).compile()
    mem = compiled.memory_analysis()
    # (measured with jax 0.10.2: 2.3 MB here, 9.9 MB for the same model computing in bfloat16 throughout)
    assert mem.temp_size_in_bytes < 0.5 * f32_bytes, (mem.temp_size_in_bytes, f32_bytes)


def test_the_run_config_key_reaches_the_sampler():
    from types import SimpleNamespace

    from jaxrl.config import load_config
    from jaxrl.rollout.factory import make_rollout_engine

    cfg = _cfg()
    graphdef, params = nnx.split(_model(cfg))
    for value, attrs in (("bfloat16", {"matmul_dtype": jnp.dtype(jnp.bfloat16)}), (None, {})):
        run = load_config(None, ["actor_rollout_ref.model.dtype=float32", f"actor_rollout_ref.rollout.dtype={value}"
                                 if value else "actor_rollout_ref.rollout.dtype=null"])
        engine = make_rollout_engine(run, cfg, graphdef, params, SimpleNamespace(pad_token_id=PAD))
        assert isinstance(engine, JaxSampler) and engine._rollout_attrs == attrs


def test_bfloat16_weights_from_the_scan_layout_are_one_cast_copy():
    """Stacked (scan-layout) float32 weights become per-layer bfloat16 matrices in one program whose temporaries
    hold no float32 copy of the layers (unstacking, then casting, held one), with the same values as the cast of
    the per-layer weights; the sampler generates from them as from per-layer weights."""
    from jaxrl.models.scan_layout import stack_layers

    cfg = _cfg(vocab_size=512, hidden_size=128, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, num_hidden_layers=4)
    model = Decoder(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, remat=True)
    graphdef, state = nnx.split(model)
    _, stacked = stack_layers(graphdef, state)
    per_layer = _sampler(model, cfg, "bfloat16")
    held_stacked = _sampler(model, cfg, "bfloat16")
    held_stacked.update_weights(stacked)
    got, want = held_stacked._call_weights(), per_layer._call_weights()
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and (a.ndim < 2 or a.dtype == jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    layer_f32 = sum(w.size * 4 for w in jax.tree.leaves(stacked) if w.ndim >= 3)
    compiled = _per_layer_matrices_as.lower(stacked, jnp.dtype(jnp.bfloat16)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 0.25 * layer_f32
    sp = SamplingParams(n=1, do_sample=True, temperature=1.0, max_new_tokens=R, seed=3)
    a, b = held_stacked.generate(PROMPTS, sp), per_layer.generate(PROMPTS, sp)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_array_equal(a.rollout_log_probs, b.rollout_log_probs)
