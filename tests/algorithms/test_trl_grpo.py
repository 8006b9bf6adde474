"""jaxrl reproduces TRL's ``GRPOTrainer`` loss and gradient from config keys alone.

TRL is not a dependency: its GRPO loss is written out below in numpy from TRL 1.16.0 (the PyPI wheel),
``trl/trainer/grpo_trainer.py``:

- advantages, ``_generate_and_score_completions`` lines 2765-2787: group mean, ``nanstd`` (``trl/trainer/utils.py``
  1021-1043: Bessel-corrected, like ``torch.std``), ``advantages / (std_rewards + 1e-4)`` (``scale_rewards="group"``);
- ``_compute_loss`` lines 3083-3095: ``coef_1 = exp(per_token_logps - old_per_token_logps)`` (token level, no clamp);
  3100-3105: ``per_token_kl = exp(ref - logp) - (ref - logp) - 1``, times ``coef_1`` under ``use_bias_correction_kl``
  (default ``True``); 3113-3120: ``-min(coef_1 * A, clamp(coef_1, 1 - epsilon, 1 + epsilon_high) * A)`` (no dual
  clip); 3150: ``+ beta * per_token_kl``;
- aggregation, lines 3153-3173, per micro-batch (one ``_compute_loss`` call per gradient-accumulation step, the
  ``.grad`` of the steps summed; line 285 ``loss_is_scaled_for_ga = True`` stops ``transformers.Trainer`` from
  dividing again): ``grpo`` = mean over rows of per-row token means / accumulation steps; ``bnpo`` = the micro-batch's
  token mean / accumulation steps; ``dr_grpo`` = sum / (rows x ``max_completion_length``) / accumulation steps;
  ``dapo`` (the default) = sum / the generation batch's token count (``num_items_in_batch``, line 2498; one process,
  ``steps_per_generation`` = accumulation steps).

TRL's defaults are ``loss_type="dapo"``, ``epsilon=0.2``, ``scale_rewards="group"``, ``use_bias_correction_kl=True``,
``importance_sampling_level="token"``; ``beta`` is 0.0 in TRL 1.16 (0.04 before TRL 0.19): the test takes 0.04 so the
KL term is in the loss. Off-policy: ``old_per_token_logps`` differ from the current log-probs (``num_iterations > 1``,
or ``steps_per_generation`` > accumulation steps), with both clip sides active and, on negative-advantage tokens,
ratios above jaxrl's default dual clip ``clip_ratio_c=3``.

The jaxrl side is the real path: ``load_config`` on key overrides, ``BatchPlan.from_config``, ``ActorWorker``,
:func:`jaxrl.trainer.compute_advantages` (the ``adv`` phase) and ``ActorWorker.accumulate_grads`` (the gradient the
update applies, accumulated over micro-batches) / ``ActorWorker.update`` (its ``actor/grad_norm``), on a tiny random
Llama. TRL's parameter gradient is the numpy per-token gradient ``dL/dlogp`` (checked against numpy central
differences) pulled back through the same model's log-probs by ``jax.vjp`` of an independent full-sequence forward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import load_config
from jaxrl.config.batch_plan import BatchPlan
from jaxrl.models.decoder import Decoder
from jaxrl.trainer import compute_advantages
from jaxrl.workers.actor import ActorWorker, LogProbComputer
from tests.helpers import tiny_batch, tiny_model_config

CFG = tiny_model_config("llama")
P, R = 6, 8  # prompt width, response width (= max_completion_length)
G, PROMPTS = 4, 3  # num_generations, prompts per generation batch
N = G * PROMPTS  # rows of the generation batch = one optimizer step
MICRO = 4  # per_device_train_batch_size: N / MICRO = 3 gradient-accumulation steps
BETA, EPS = 0.04, 0.2
A = "actor_rollout_ref.actor"

# TRL loss_type -> jaxrl loss_agg_mode (README "Algorithms", matching TRL / verl)
AGG = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm"}


def trl_overrides(loss_type: str = "dapo", micro: int = MICRO) -> list[str]:
    """jaxrl config keys for TRL's GRPOTrainer defaults (``beta`` = 0.04)."""
    return [
        # the batch: 3 prompts x num_generations 4, one optimizer step per generation batch, micro-batches of `micro`
        f"data.train_batch_size={PROMPTS}", f"actor_rollout_ref.rollout.n={G}", f"data.max_response_length={R}",
        f"{A}.ppo_mini_batch_size={PROMPTS}", f"{A}.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={N}", "trainer.n_gpus_per_node=1",
        # scale_rewards="group", std + 1e-4
        "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=true", "algorithm.adv_std_epsilon=1e-4",
        # epsilon=0.2, epsilon_high=None, no dual clip
        f"{A}.clip_ratio_low={EPS}", f"{A}.clip_ratio_high={EPS}", f"{A}.clip_ratio_c=1e9",
        # beta, use_bias_correction_kl=True
        f"{A}.use_kl_loss=true", f"{A}.kl_loss_coef={BETA}", f"{A}.kl_loss_type=low_var_kl_is",
        f"{A}.loss_agg_mode={AGG[loss_type]}", f"{A}.entropy_coeff=0.0", f"{A}.tis_imp_ratio_cap=-1",
    ]


# ----------------------------------------------------------------------------- TRL's formulas in numpy


def trl_advantages(scores: np.ndarray) -> np.ndarray:
    """[N] per-completion advantages: (r - group mean) / (group std, ddof 1, + 1e-4); groups of G consecutive rows."""
    grouped = scores.astype(np.float64).reshape(-1, G)
    mean = np.repeat(grouped.mean(1), G)
    std = np.repeat(grouped.std(1, ddof=1), G)
    return (scores - mean) / (std + 1e-4)


def trl_loss_and_grad(lp, old, ref, adv, mask, loss_type, micro):
    """TRL's accumulated loss over the generation batch and its gradient with respect to every per-token log-prob.

    Args:
      lp, old, ref: ``[N, R]`` float64 current / old / reference per-token log-probs.
      adv: ``[N]`` advantages; mask: ``[N, R]`` completion mask; micro: rows per accumulation step.

    Returns:
      ``(loss, dloss/dlp [N, R])``: the sum over accumulation steps of what each step backpropagates.
    """
    steps = N // micro
    total_tokens = mask.sum()  # num_items_in_batch
    loss, grad = 0.0, np.zeros_like(lp)
    for s in range(0, N, micro):
        sl = slice(s, s + micro)
        x, o, r, m, a = lp[sl], old[sl], ref[sl], mask[sl], adv[sl, None]
        coef_1 = np.exp(x - o)
        coef_2 = np.clip(coef_1, 1 - EPS, 1 + EPS)
        kl = (np.exp(r - x) - (r - x) - 1) * coef_1
        per_token = -np.minimum(coef_1 * a, coef_2 * a) + BETA * kl
        # d/dx: the unclipped branch carries -A * coef_1, a clipped one nothing; d(coef_1 * k3)/dx = coef_1 * (x - r)
        d_per_token = np.where(coef_1 * a <= coef_2 * a, -a * coef_1, 0.0) + BETA * coef_1 * (x - r)
        if loss_type == "grpo":
            weight = m / np.maximum(m.sum(-1, keepdims=True), 1.0) / micro / steps
        elif loss_type == "bnpo":
            weight = m / max(m.sum(), 1.0) / steps
        elif loss_type == "dr_grpo":
            weight = m / (micro * R) / steps
        else:  # dapo
            weight = m / total_tokens
        loss += float(np.sum(per_token * weight))
        grad[sl] = d_per_token * weight
    return loss, grad


# ----------------------------------------------------------------------------- the fixed tiny model and batch


@pytest.fixture(scope="module")
def setup():
    """The tiny model, the generation batch (scores, old / reference log-probs) and an independent log-prob forward."""
    graphdef, params = nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)))
    batch, rng = tiny_batch(N, 11, prompt_width=P, response_width=R, vocab_size=CFG.vocab_size, group_size=G)
    scores = np.round(rng.normal(size=N), 2).astype(np.float32)
    scores[4:8] = [0.0, 0.002, 0.0, 0.001]  # a group whose scores barely differ: the std epsilon matters
    last = batch.response_mask.sum(1) - 1
    batch.token_level_rewards = np.zeros((N, R), np.float32)
    batch.token_level_rewards[np.arange(N), last] = scores

    def logp_fn(p):
        """Full-sequence forward (not the actor's response slice), log-softmax, the response tokens' log-probs."""
        model = nnx.merge(graphdef, p)
        logits, _ = model(jnp.asarray(batch.input_ids()), jnp.asarray(batch.positions()),
                          jnp.asarray(batch.attention_mask()))
        logp = jax.nn.log_softmax(logits[:, P - 1 : P + R - 1].astype(jnp.float32), axis=-1)
        return jnp.take_along_axis(logp, jnp.asarray(batch.response_ids)[..., None], axis=-1)[..., 0]

    lp = jax.jit(logp_fn)(params)
    vjp = jax.jit(lambda g: jax.vjp(logp_fn, params)[1](g))  # dL/dlogp [N, R] -> dL/dparams, compiled once
    mask = batch.response_mask.astype(np.float64)
    lp = np.asarray(lp, np.float64) * mask
    # the old policy (a few updates back) and the reference: the current log-probs moved per token
    old = lp + rng.normal(scale=0.3, size=lp.shape) * mask
    ref = lp + rng.normal(scale=0.3, size=lp.shape) * mask
    adv_rows = trl_advantages(scores)
    neg = np.flatnonzero(adv_rows < -0.5)[:2]
    old[neg, 0] = lp[neg, 0] - 1.5  # ratio e^1.5 = 4.5 on two negative-advantage tokens: past clip_ratio_c = 3
    batch.old_log_probs = old.astype(np.float32)
    batch.ref_log_probs = ref.astype(np.float32)
    return dict(graphdef=graphdef, params=params, batch=batch, scores=scores, lp=lp, vjp=vjp, mask=mask,
                adv_rows=adv_rows)


def jaxrl_loss_and_grads(s, overrides):
    """From config: advantages as the adv phase computes them, then the actor's accumulated loss and gradient."""
    cfg = load_config(None, overrides)
    plan = BatchPlan.from_config(cfg, batch_shards=1).actor
    batch = dataclasses.replace(s["batch"])
    batch.advantages, _ = compute_advantages(cfg.algorithm, batch)
    actor = ActorWorker(s["graphdef"], s["params"], cfg.actor_rollout_ref.actor, plan=plan,
                        temperature=cfg.actor_rollout_ref.rollout.temperature, total_training_steps=1)
    stacked, num_tokens, num_seqs = actor.stack_micro(actor.minibatch_arrays(batch), np.arange(N),
                                                      plan.mini_batch_rows, plan.micro_batch_rows)
    grads, metrics = jax.jit(actor.accumulate_grads, static_argnames="prompt_width")(
        s["params"], stacked, num_tokens, num_seqs, prompt_width=P)
    c = cfg.actor_rollout_ref.actor
    loss = float(metrics["actor/pg_loss"]) + c.kl_loss_coef * float(metrics["actor/kl_loss"])
    return cfg, batch, actor, loss, grads, metrics


def trl_reference(s, loss_type, micro):
    loss, g = trl_loss_and_grad(s["lp"], s["batch"].old_log_probs.astype(np.float64),
                                s["batch"].ref_log_probs.astype(np.float64), s["adv_rows"], s["mask"], loss_type, micro)
    (param_grads,) = s["vjp"](jnp.asarray(g, jnp.float32))
    return loss, g, param_grads


def max_abs_diff(a, b) -> float:
    return max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ----------------------------------------------------------------------------- tests


def test_the_batch_is_off_policy_with_clipping_on_both_sides(setup):
    s = setup
    m = s["mask"] > 0
    ratio = np.exp(s["lp"] - s["batch"].old_log_probs)[m]
    a = np.broadcast_to(s["adv_rows"][:, None], s["mask"].shape)[m]
    assert np.mean(ratio > 1 + EPS) > 0.1 and np.mean(ratio < 1 - EPS) > 0.1
    assert np.any((ratio > 3.0) & (a < 0))  # jaxrl's default dual clip would bind here
    assert np.ptp(s["scores"][4:8]) < 0.01  # the near-flat group


def test_numpy_trl_gradient_matches_central_differences(setup):
    s = setup
    old, ref = s["batch"].old_log_probs.astype(np.float64), s["batch"].ref_log_probs.astype(np.float64)
    for loss_type in AGG:
        _, g = trl_loss_and_grad(s["lp"], old, ref, s["adv_rows"], s["mask"], loss_type, MICRO)
        h, fd = 1e-6, np.zeros_like(g)
        for i, j in zip(*np.nonzero(s["mask"])):
            up, down = s["lp"].copy(), s["lp"].copy()
            up[i, j] += h
            down[i, j] -= h
            fd[i, j] = (trl_loss_and_grad(up, old, ref, s["adv_rows"], s["mask"], loss_type, MICRO)[0]
                        - trl_loss_and_grad(down, old, ref, s["adv_rows"], s["mask"], loss_type, MICRO)[0]) / (2 * h)
        np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-9, err_msg=loss_type)


def test_trl_default_grpo_loss_and_gradient_from_config(setup):
    """TRL defaults (dapo, epsilon 0.2, group scaling + 1e-4, importance-weighted k3, beta 0.04), three
    gradient-accumulation steps: loss, per-parameter gradient and gradient norm within 1e-5."""
    s = setup
    cfg, batch, _, loss, grads, metrics = jaxrl_loss_and_grads(s, trl_overrides())
    adv_rows = batch.advantages[np.arange(N), 0]
    np.testing.assert_allclose(adv_rows, s["adv_rows"], rtol=1e-5, atol=1e-6)
    trl_loss, _, trl_grads = trl_reference(s, "dapo", MICRO)
    assert abs(loss - trl_loss) < 1e-5, (loss, trl_loss)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(trl_grads)) > 1e-2  # a gradient worth comparing
    assert max_abs_diff(grads, trl_grads) < 1e-5
    assert float(metrics["actor/pg_clipfrac"]) > 0.1

    # the update path: actor.update on the same batch logs the norm of this gradient
    actor = ActorWorker(s["graphdef"], jax.tree.map(lambda x: x.copy(), s["params"]), cfg.actor_rollout_ref.actor,
                        plan=BatchPlan.from_config(cfg, batch_shards=1).actor, temperature=1.0, total_training_steps=1)
    out = actor.update(batch)
    trl_norm = float(jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(trl_grads))))
    assert out["actor/grad_norm"] == pytest.approx(trl_norm, rel=1e-5)
    assert out["actor/kl_loss"] == pytest.approx(float(metrics["actor/kl_loss"]), rel=1e-6)


@pytest.mark.parametrize("loss_type,micro", [("grpo", MICRO), ("dr_grpo", MICRO), ("bnpo", N)])
def test_trl_loss_types_map_to_loss_agg_modes(setup, loss_type, micro):
    """grpo <-> seq-mean-token-mean, dr_grpo <-> seq-mean-token-sum-norm (max_completion_length = the response
    width), bnpo <-> token-mean with one micro-batch per update."""
    s = setup
    _, _, _, loss, grads, _ = jaxrl_loss_and_grads(s, trl_overrides(loss_type, micro))
    trl_loss, _, trl_grads = trl_reference(s, loss_type, micro)
    assert abs(loss - trl_loss) < 1e-5, (loss, trl_loss)
    assert max_abs_diff(grads, trl_grads) < 1e-5


def test_bnpo_under_gradient_accumulation_is_not_token_mean(setup):
    """TRL's bnpo normalises each micro-batch by its own tokens; jaxrl's token-mean (TRL's dapo) by the mini-batch's:
    with several micro-batches of different token counts they differ (README: no config reproduces bnpo there)."""
    s = setup
    _, _, _, loss, grads, _ = jaxrl_loss_and_grads(s, trl_overrides("bnpo", MICRO))
    bnpo_loss, _, bnpo_grads = trl_reference(s, "bnpo", MICRO)
    dapo_loss, _, dapo_grads = trl_reference(s, "dapo", MICRO)
    assert max_abs_diff(grads, dapo_grads) < 1e-5
    assert max_abs_diff(grads, bnpo_grads) > 1e-4 and abs(loss - bnpo_loss) > 1e-4


@pytest.mark.parametrize("key,verl_default", [
    ("algorithm.adv_std_epsilon", "1e-6"), (f"{A}.kl_loss_type", "low_var_kl"), (f"{A}.kl_loss_type", "low_var_kl+"),
    (f"{A}.clip_ratio_c", "3.0"),
])
def test_each_trl_key_is_needed(setup, key, verl_default):
    """Any one of the keys back at jaxrl's (verl's) default and the loss or the gradient is no longer TRL's."""
    s = setup
    overrides = [o for o in trl_overrides() if not o.startswith(key + "=")] + [f"{key}={verl_default}"]
    _, _, _, loss, grads, _ = jaxrl_loss_and_grads(s, overrides)
    trl_loss, _, trl_grads = trl_reference(s, "dapo", MICRO)
    assert max(abs(loss - trl_loss), max_abs_diff(grads, trl_grads)) > 1e-4
