"""``dense``: the decoder's projections as one 2-D matmul, against ``jnp.einsum`` on the named axes.

Every projection of the decoder (q/k/v/o, gate/up/down, the LM head) goes through ``dense``, which flattens the
``[B, T]`` axes before the matmul so that XLA:CPU's weight gradient is a plain matmul (see its docstring). These
tests pin its values and gradients to the einsum forms it replaced, and check that the decoder's training forward
holds no projection with a 3-D activation operand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder, dense

CASES = {
    # name: (x shape, w shape, in_dims, transposed, einsum spec)
    "mlp": ((2, 5, 6), (6, 7), 1, False, "bth,hi->bti"),
    "qkv": ((2, 5, 6), (6, 3, 4), 1, False, "bth,hnd->btnd"),
    "o_proj": ((2, 5, 3, 4), (3, 4, 6), 2, False, "btnd,ndh->bth"),
    "tied_head": ((2, 5, 6), (11, 6), 1, True, "bth,vh->btv"),
}


def _arrays(xs, ws, seed=0):
    r = np.random.RandomState(seed)
    return jnp.asarray(r.randn(*xs), jnp.float32), jnp.asarray(r.randn(*ws), jnp.float32)


@pytest.mark.parametrize("name", list(CASES))
def test_values_and_gradients_equal_einsum(name):
    xs, ws, in_dims, transposed, spec = CASES[name]
    x, w = _arrays(xs, ws)
    ours = lambda x, w: dense(x, w, in_dims=in_dims, transposed=transposed)  # noqa: E731
    ref = lambda x, w: jnp.einsum(spec, x, w)  # noqa: E731
    np.testing.assert_allclose(np.asarray(ours(x, w)), np.asarray(ref(x, w)), rtol=1e-5, atol=1e-5)
    cot = jnp.asarray(np.random.RandomState(1).randn(*ref(x, w).shape), jnp.float32)
    g_ours = jax.grad(lambda x, w: jnp.sum(ours(x, w) * cot), argnums=(0, 1))(x, w)
    g_ref = jax.grad(lambda x, w: jnp.sum(ref(x, w) * cot), argnums=(0, 1))(x, w)
    for a, b in zip(g_ours, g_ref):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_dtypes_follow_the_operands_and_preferred_type():
    x, w = _arrays((2, 3, 4), (4, 5))
    assert dense(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    y = dense(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    assert y.dtype == jnp.float32 and y.shape == (2, 3, 5)


def test_a_weight_that_does_not_take_the_input_is_a_one_line_error():
    x, w = _arrays((2, 3, 4), (5, 6))
    with pytest.raises(ValueError, match=r"weight \(5, 6\) does not take input axes \(4,\)") as e:
        dense(x, w)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="last 1 weight axes"):
        dense(x, w, transposed=True)


def test_decoder_projections_are_two_dimensional_matmuls():
    """The training forward's and backward's matmuls over weights take ``[B*T, in]`` activations, never
    ``[B, T, ...]`` ones: a projection written back as a batched einsum would bring back the transposed
    weight-gradient copies ``dense`` avoids."""
    b, t = 3, 8
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=4, tie_word_embeddings=True)
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    ids = jnp.zeros((b, t), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = jnp.ones((b, t), bool)

    def loss(st):
        logits, _ = nnx.merge(graphdef, st)(ids, pos, mask)
        return jnp.sum(logits)

    dots = []

    def walk(jp):
        for eqn in jp.eqns:
            if eqn.primitive.name == "dot_general":
                dots.append([tuple(v.aval.shape) for v in eqn.invars])
            for sub in jax.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(jax.grad(loss))(state).jaxpr)
    batched = [s for s in dots if any(len(x) >= 3 and x[:2] == (b, t) for x in s)]
    assert not batched, batched
    rows = [s for s in dots if any(x[0] == b * t and len(x) == 2 for x in s)]
    # 7 projections per layer and the head: a forward matmul and two backward ones (input and weight gradient)
    assert len(rows) >= 3 * (7 * cfg.num_hidden_layers + 1), len(rows)
