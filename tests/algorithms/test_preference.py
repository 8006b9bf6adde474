"""DPO-family losses against an independent torch reference (values and gradients, float64), the registry's
declarations, and the best-vs-worst pairing of online DPO."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from jaxrl.algorithms import best_worst_pairs, implicit_rewards, sequence_log_probs
from jaxrl.algorithms.registry import PREFERENCE_LOSSES


def _batch(seed=0, b=6, r=7, v=11):
    """Policy / reference logits of chosen and rejected responses ``[B, R, V]``, their tokens and masks."""
    rng = np.random.default_rng(seed)
    out = {}
    for side in ("chosen", "rejected"):
        lengths = rng.integers(1, r + 1, size=b)
        out[f"{side}_mask"] = (np.arange(r)[None] < lengths[:, None]).astype(np.float32)
        out[f"{side}_ids"] = rng.integers(0, v, size=(b, r))
        out[f"{side}_logits"] = rng.normal(size=(b, r, v)).astype(np.float32) * 2
        out[f"{side}_ref_logits"] = rng.normal(size=(b, r, v)).astype(np.float32) * 2
    return out


def _torch_loss(loss_type, batch, beta, eps, policy_logits):
    """The reference: TRL's formulas written out in torch from the logits (float64)."""
    def seq(logits, side):
        lp = torch.log_softmax(logits.double(), -1)
        tok = torch.gather(lp, -1, torch.as_tensor(batch[f"{side}_ids"])[..., None])[..., 0]
        mask = torch.as_tensor(batch[f"{side}_mask"]).double()
        return (tok * mask).sum(-1), mask.sum(-1)

    pc, lc = seq(policy_logits["chosen"], "chosen")
    pr, lr = seq(policy_logits["rejected"], "rejected")
    rc, _ = seq(torch.as_tensor(batch["chosen_ref_logits"]), "chosen")
    rr, _ = seq(torch.as_tensor(batch["rejected_ref_logits"]), "rejected")
    d = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        per = -(1 - eps) * F.logsigmoid(beta * d) - eps * F.logsigmoid(-beta * d)
    elif loss_type == "robust":
        per = (-(1 - eps) * F.logsigmoid(beta * d) + eps * F.logsigmoid(-beta * d)) / (1 - 2 * eps)
    elif loss_type == "hinge":
        per = torch.relu(1 - beta * d)
    elif loss_type == "ipo":
        per = ((pc - rc) / lc - (pr - rr) / lr - 1 / (2 * beta)) ** 2
    return per.mean()


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0), ("hinge", 0.0),
                                           ("robust", 0.1)])
def test_loss_and_gradient_match_torch(loss_type, eps):
    batch = _batch()
    beta = 0.5 if loss_type != "ipo" else 0.1
    fn = PREFERENCE_LOSSES.get(loss_type)
    options = {"label_smoothing": eps} if "label_smoothing" in PREFERENCE_LOSSES.entry(loss_type).options else {}

    def jax_loss(chosen_logits, rejected_logits):
        def seq(logits, side):
            lp = jax.nn.log_softmax(logits, -1)
            tok = jnp.take_along_axis(lp, jnp.asarray(batch[f"{side}_ids"])[..., None], -1)[..., 0]
            return sequence_log_probs(tok, batch[f"{side}_mask"])

        ref = {s: jax.lax.stop_gradient(seq(jnp.asarray(batch[f"{s}_ref_logits"]), s)) for s in ("chosen", "rejected")}
        per = fn(seq(chosen_logits, "chosen") - ref["chosen"], seq(rejected_logits, "rejected") - ref["rejected"],
                 beta=beta, chosen_lengths=batch["chosen_mask"].sum(-1), rejected_lengths=batch["rejected_mask"].sum(-1),
                 **options)
        return per.mean()

    value, (g_c, g_r) = jax.value_and_grad(jax_loss, argnums=(0, 1))(batch["chosen_logits"], batch["rejected_logits"])
    logits = {s: torch.tensor(batch[f"{s}_logits"], dtype=torch.float64, requires_grad=True)
              for s in ("chosen", "rejected")}
    ref_value = _torch_loss(loss_type, batch, beta, eps, logits)
    ref_value.backward()
    assert float(value) == pytest.approx(float(ref_value.detach()), abs=1e-5, rel=1e-5)
    np.testing.assert_allclose(np.asarray(g_c), logits["chosen"].grad.numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g_r), logits["rejected"].grad.numpy(), atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(g_c)).max() > 1e-4  # a gradient that is all zeros would match a zero reference too


def test_sigmoid_loss_at_equal_logratios_is_log2_and_smoothing_is_symmetric():
    z = np.zeros(3, np.float32)
    loss = PREFERENCE_LOSSES.get("sigmoid")(z, z, beta=0.1)
    np.testing.assert_allclose(loss, np.log(2.0), rtol=1e-6)
    c, r = np.array([2.0, -1.0]), np.array([0.0, 1.0])
    a = PREFERENCE_LOSSES.get("sigmoid")(c, r, beta=1.0, label_smoothing=0.3)
    b = PREFERENCE_LOSSES.get("sigmoid")(r, c, beta=1.0, label_smoothing=0.3)
    # cDPO with e: the loss of (c, r) plus the loss of the swapped pair equals plain DPO's sum of both directions
    plain = PREFERENCE_LOSSES.get("sigmoid")
    np.testing.assert_allclose(a + b, plain(c, r, beta=1.0) + plain(r, c, beta=1.0), rtol=1e-6)


@pytest.mark.parametrize("loss_type,kwargs,match", [
    ("sigmoid", {"beta": 0.0}, "beta=0.0 must be > 0"),
    ("sigmoid", {"beta": 0.1, "label_smoothing": 0.6}, r"label_smoothing=0.6 must be in \[0, 0.5\]"),
    ("robust", {"beta": 0.1, "label_smoothing": 0.5}, r"label_smoothing=0.5 must be in \[0, 0.5\)"),
])
def test_bad_options_raise(loss_type, kwargs, match):
    with pytest.raises(ValueError, match=match):
        PREFERENCE_LOSSES.get(loss_type)(np.zeros(2), np.zeros(2), **kwargs)


def test_registry_declares_the_losses_and_their_options():
    assert PREFERENCE_LOSSES.names() == ("sigmoid", "ipo", "hinge", "robust")
    assert PREFERENCE_LOSSES.entry("sigmoid").options == ("label_smoothing",)
    assert PREFERENCE_LOSSES.entry("ipo").options == ()


def test_implicit_rewards_and_sequence_log_probs():
    lp = np.array([[-1.0, -2.0, np.nan], [-0.5, -0.5, -0.5]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    np.testing.assert_allclose(sequence_log_probs(lp, mask), [-3.0, -1.5])
    np.testing.assert_allclose(implicit_rewards(np.array([-3.0]), np.array([-4.0]), 0.1), [0.1], rtol=1e-6)


def test_best_worst_pairs():
    scores = np.array([0.1, 0.9, 0.5, 1.0, 1.0, 0.2, 0.3, 0.2, 0.3])
    groups = np.array([3, 3, 3, 1, 1, 7, 7, 7, 5])
    chosen, rejected, tied = best_worst_pairs(scores, groups)
    # groups in order of appearance: 3 -> (1, 0); 1 tied; 7 -> (6, 5) (first of the equal lowest); 5 alone
    assert chosen.tolist() == [1, 6] and rejected.tolist() == [0, 5] and tied == 2
    with pytest.raises(ValueError, match="finite"):
        best_worst_pairs(np.array([np.nan, 1.0]), np.array([0, 0]))
