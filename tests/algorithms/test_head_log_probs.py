"""jaxrl.algorithms.logprob.head_log_probs: the LM head and log-softmax in position chunks equal the whole logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algorithms import entropy_from_logits, head_log_probs, log_probs_from_logits

B, R, H, V = 3, 11, 8, 40


def _inputs(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(k1, (B, R, H), jnp.float32)
    w = jax.random.normal(k2, (H, V), jnp.float32)
    labels = jax.random.randint(k3, (B, R), 0, V)
    return hidden, w, labels


def _full(hidden, w, labels):
    logits = hidden @ w / 0.7
    return log_probs_from_logits(logits, labels), entropy_from_logits(logits)


def _chunked(hidden, w, labels, chunk_bytes):
    return head_log_probs(hidden, labels, lambda h: h @ w / 0.7, with_entropy=True, chunk_bytes=chunk_bytes)


# positions per chunk: 1, 3 (11 = 4 chunks, the last padded), 6 (2 chunks), all 11 (no scan)
@pytest.mark.parametrize("positions", [1, 3, 6, 11])
def test_values_and_gradients_equal_the_whole_logits(positions):
    hidden, w, labels = _inputs()
    budget = positions * B * V * 4
    lp, ent = _chunked(hidden, w, labels, budget)
    lp_ref, ent_ref = _full(hidden, w, labels)
    np.testing.assert_allclose(lp, lp_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent, ent_ref, rtol=1e-6, atol=1e-6)

    coef = jax.random.normal(jax.random.key(9), (B, R))

    def loss(fn, h, w_):
        lp_, ent_ = fn(h, w_)
        return jnp.sum(coef * lp_) - 0.3 * jnp.sum(coef * ent_)

    g = jax.grad(lambda h, w_: loss(lambda a, b: _chunked(a, b, labels, budget), h, w_), argnums=(0, 1))(hidden, w)
    g_ref = jax.grad(lambda h, w_: loss(lambda a, b: _full(a, b, labels), h, w_), argnums=(0, 1))(hidden, w)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(g[1]).max()) > 0


def _array_shapes(jaxpr) -> set[tuple]:
    out = set()
    for eqn in jaxpr.eqns:
        out.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for p in eqn.params.values():  # scan bodies (ClosedJaxpr) and checkpointed ones (Jaxpr)
            inner = p if hasattr(p, "eqns") else getattr(p, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                out |= _array_shapes(inner)
    return out


def test_the_whole_logits_never_exist_in_forward_or_backward():
    hidden, w, labels = _inputs()
    budget = 3 * B * V * 4

    def loss(h, w_):
        lp, ent = _chunked(h, w_, labels, budget)
        return jnp.sum(lp) + jnp.sum(ent)

    shapes = _array_shapes(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(hidden, w).jaxpr)
    assert not any(len(s) >= 2 and s[-1] == V and int(np.prod(s[:-1])) >= B * R for s in shapes), sorted(shapes)
    assert any(s[-1:] == (V,) and int(np.prod(s[:-1])) == B * 3 for s in shapes if s)  # the chunks are there
    # and with the whole budget the logits are made at once (the check above can see them)
    whole = _array_shapes(jax.make_jaxpr(lambda h: _chunked(h, w, labels, None)[0])(hidden).jaxpr)
    assert (B, R, V) in whole


def test_entropy_is_none_unless_asked_and_bad_shapes_raise():
    hidden, w, labels = _inputs()
    lp, ent = head_log_probs(hidden, labels, lambda h: h @ w, chunk_bytes=1)
    assert ent is None and lp.shape == (B, R)
    with pytest.raises(ValueError,
                       match=r"hidden must be \[B, R, H\] and labels \[B, R\], got \(3, 11, 8\) and \(3, 10\)"):
        head_log_probs(hidden, labels[:, :10], lambda h: h @ w)
