"""PRIME: implicit process rewards from an online-trained implicit PRM, and the advantages that combine them.

Source: Cui et al. 2025, "Process Reinforcement through Implicit Rewards" (arXiv 2502.01456), Sec. 3 (implicit
PRM, its cross-entropy loss on outcome labels, online update) and Sec. 3.3 / Eq. for the advantage (leave-one-out
over the process rewards and over the outcome rewards, returns summed); verl's ``recipe/prime``
(``prime_core_algos.py``, ``prime_dp_rm.py``): the coefficients ``algorithm.reward_dpo_coef`` /
``algorithm.reward_gt_coef``, ``reward_model.prime_granularity``, ``reward_model.prime_norm`` and the final
whitening of the advantages. Written from the formulas, not from verl's code.

Notation: ``B`` responses, ``R`` response tokens; the implicit PRM ``pi_phi`` is a causal LM, ``pi_ref`` its frozen
reference, ``beta`` = ``reward_model.model.beta_train``. Per token::

    q_t = log pi_phi(y_t | y_<t) - log pi_ref(y_t | y_<t)          (0 where response_mask is 0)
    r_t = beta * q_t                                                the implicit process reward
    r(y) = beta * sum_t q_t                                         the sequence-level implicit reward

The PRM is trained on ``r(y)`` against the outcome (verifier) label ``acc`` in [0, 1] with binary cross-entropy,
``-[acc log sigmoid(r(y)) + (1 - acc) log sigmoid(-r(y))]``.

Pure functions of arrays (jax / numpy); :func:`compute_prime_advantage` is the ``"prime"`` advantage estimator
(:mod:`jaxrl.algorithms.registry`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.algorithms.stats import masked_whiten

__all__ = [
    "GRANULARITIES",
    "PRIME_NORMS",
    "compute_prime_advantage",
    "implicit_log_ratio",
    "implicit_process_rewards",
    "prime_norm",
    "prm_ce_loss",
    "prm_pairwise_accuracy",
    "prm_sign_accuracy",
]

GRANULARITIES: tuple[str, ...] = ("token", "whole")  # reward_model.prime_granularity
PRIME_NORMS: tuple[str, ...] = ("batch_norm", "none")  # reward_model.prime_norm


def implicit_log_ratio(prm_log_probs, ref_log_probs, response_mask):
    """``q_t = log pi_phi(y_t|y_<t) - log pi_ref(y_t|y_<t)``, masked.

    Args:
      prm_log_probs, ref_log_probs: float32 ``[B, R]``, the PRM's and its reference's log-probs of the response
        tokens.
      response_mask: 0/1 ``[B, R]``.

    Returns:
      float32 ``[B, R]``, 0 where ``response_mask`` is 0.
    """
    mask = jnp.asarray(response_mask, jnp.float32)
    return (jnp.asarray(prm_log_probs, jnp.float32) - jnp.asarray(ref_log_probs, jnp.float32)) * mask


def implicit_process_rewards(log_ratio, response_mask, *, beta: float, granularity: str = "token"):
    """Dense process rewards from the implicit PRM's log-ratio (PRIME Sec. 3.1: ``r_t = beta * q_t``).

    Args:
      log_ratio: float32 ``[B, R]``, :func:`implicit_log_ratio`.
      response_mask: 0/1 ``[B, R]``.
      beta: ``reward_model.model.beta_train`` (> 0).
      granularity: ``"token"`` (``r_t`` on every response token, the paper's process rewards) or ``"whole"``
        (verl's option: the sequence reward ``beta * sum_t q_t`` on the last valid token, 0 elsewhere).

    Returns:
      float32 ``[B, R]``, 0 where ``response_mask`` is 0.

    Raises:
      ValueError: an unknown ``granularity``.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"reward_model.prime_granularity={granularity!r} is invalid; expected one of {GRANULARITIES}")
    mask = jnp.asarray(response_mask, jnp.float32)
    r = beta * jnp.asarray(log_ratio, jnp.float32) * mask
    if granularity == "token":
        return r
    width = mask.shape[1]
    last = width - 1 - jnp.argmax(mask[:, ::-1] != 0, axis=1)
    onehot = jax.nn.one_hot(last, width, dtype=jnp.float32) * (jnp.sum(mask, -1, keepdims=True) > 0)
    return onehot * jnp.sum(r, axis=-1, keepdims=True)


def prime_norm(rewards, mode: str = "batch_norm"):
    """verl's ``reward_model.prime_norm``: with ``"batch_norm"`` the process rewards are divided by the largest
    absolute return-to-go in the batch, ``max_{i,t} |sum_{s >= t} r_{i,s}| + 1e-6``, so no return exceeds 1 in
    magnitude; ``"none"`` returns them as they are.

    Args:
      rewards: float32 ``[B, R]`` (0 on masked positions).
      mode: ``"batch_norm"`` or ``"none"``.

    Returns:
      float32 ``[B, R]``.

    Raises:
      ValueError: an unknown ``mode``.
    """
    if mode not in PRIME_NORMS:
        raise ValueError(f"reward_model.prime_norm={mode!r} is invalid; expected one of {PRIME_NORMS}")
    rewards = jnp.asarray(rewards, jnp.float32)
    if mode == "none":
        return rewards
    to_go = jnp.flip(jnp.cumsum(jnp.flip(rewards, -1), axis=-1), -1)
    return rewards / (jnp.max(jnp.abs(to_go)) + 1e-6)


def prm_ce_loss(prm_log_probs, ref_log_probs, response_mask, acc, *, beta: float, num_seqs=None):
    """The implicit PRM's cross-entropy loss (PRIME Sec. 3.2, verl's ``loss_type=ce``).

    ``z_i = beta * sum_t q_{i,t}``; ``loss_i = -[acc_i log sigmoid(z_i) + (1 - acc_i) log sigmoid(-z_i)]`` (the
    log-sigmoid form: exact where ``sigmoid`` would round to 0 or 1). Returns ``sum_i loss_i / num_seqs``: the mean
    over the rows when ``num_seqs`` is the row count, and, with the whole mini-batch's row count, micro-batch shares
    that add up to the mini-batch mean exactly. Padding rows (response mask all 0) contribute 0.

    Args:
      prm_log_probs, ref_log_probs: float32 ``[B, R]``.
      response_mask: 0/1 ``[B, R]``; a row whose mask is all 0 contributes 0 (padding rows).
      acc: float32 ``[B]`` outcome labels in [0, 1].
      beta: ``reward_model.model.beta_train``.
      num_seqs: the normaliser (float scalar); None = the number of rows with a non-empty mask (at least 1).

    Returns:
      float32 scalar loss.
    """
    mask = jnp.asarray(response_mask, jnp.float32)
    z = beta * jnp.sum(implicit_log_ratio(prm_log_probs, ref_log_probs, mask), axis=-1)
    acc = jnp.asarray(acc, jnp.float32)
    per_row = -(acc * jax.nn.log_sigmoid(z) + (1.0 - acc) * jax.nn.log_sigmoid(-z))
    valid = (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
    if num_seqs is None:
        num_seqs = jnp.maximum(jnp.sum(valid), 1.0)
    return jnp.sum(per_row * valid) / num_seqs


def prm_pairwise_accuracy(seq_rewards, acc, group_ids) -> float:
    """How often the PRM orders two responses to one prompt as their outcome labels do (verl's
    ``reward_model/dpo_acc``): per group, over the pairs ``i < j``, the ``|acc_i - acc_j|``-weighted fraction with
    ``sign(r_i - r_j) == sign(acc_i - acc_j)``, a tie ``r_i == r_j`` counting 0.5 (verl counts it as ``<``, so an
    untrained PRM, equal to its reference, would not sit at chance); a group whose labels are all equal scores 0.5;
    the mean over groups. Chance level is 0.5.

    Args:
      seq_rewards: ``[B]`` the sequence implicit rewards ``sum_t r_t``.
      acc: ``[B]`` outcome labels.
      group_ids: ``[B]`` int prompt groups.

    Returns:
      the accuracy, a float in [0, 1] (0.5 for an empty batch).
    """
    r, a, g = np.asarray(seq_rewards, np.float64), np.asarray(acc, np.float64), np.asarray(group_ids)
    out = []
    for gid in np.unique(g):
        idx = np.flatnonzero(g == gid)
        iu, ju = np.triu_indices(len(idx), k=1)
        da = a[idx][iu] - a[idx][ju]
        dr = r[idx][iu] - r[idx][ju]
        w = np.abs(da)
        if w.sum() == 0:
            out.append(0.5)
            continue
        right = np.where(dr == 0, 0.5, ((dr > 0) == (da > 0)).astype(np.float64))  # a tie is a coin flip
        out.append(float(np.sum(right * w) / w.sum()))
    return float(np.mean(out)) if out else 0.5


def prm_sign_accuracy(seq_rewards, acc) -> float:
    """verl's ``reward_model/dpo_acc_abs``: the fraction of responses whose sequence implicit reward has the sign of
    ``2 acc - 1`` (positive for a correct response, negative for a wrong one)."""
    r, a = np.asarray(seq_rewards, np.float64), np.asarray(acc, np.float64)
    return float(np.mean(np.sign(r) == np.sign(2.0 * a - 1.0))) if r.size else 0.0


def _leave_one_out_baseline(per_row, group_ids):
    """``(1 / (n_g - 1)) sum_{j != i, j in g(i)} per_row[j]`` for each row ``i``; 0 in a group of one."""
    num = per_row.shape[0]
    total = jax.ops.segment_sum(per_row, group_ids, num_segments=num)[group_ids]
    count = jax.ops.segment_sum(jnp.ones_like(per_row), group_ids, num_segments=num)[group_ids]
    return jnp.where(count > 1.0, (total - per_row) / jnp.maximum(count - 1.0, 1.0), 0.0)


def _returns(rewards, mask, gamma):
    """``G_t = sum_{s >= t} gamma^(s - t) r_s`` over the masked rewards ``[B, R]``."""

    def step(running, xs):
        r_t, m_t = xs
        running = r_t * m_t + gamma * running
        return running, running

    _, ret = jax.lax.scan(step, jnp.zeros(rewards.shape[:1], rewards.dtype), (rewards.T, mask.T), reverse=True)
    return ret.T


def compute_prime_advantage(token_level_rewards, response_mask, group_ids, *, rm_scores, reward_dpo_coef: float = 5.0,
                            reward_gt_coef: float = 5.0, gamma: float = 1.0):
    """PRIME's advantage: leave-one-out over the implicit process rewards and over the outcome rewards, the two
    returns summed with verl's coefficients, then whitened over the batch (verl ``compute_rloo_advantage_return``).

    Process part (the paper's three steps): per response ``i`` of a group of ``n``, the baseline is the mean of the
    *other* responses' average per-token process reward, ``b_i = (1/(n-1)) sum_{j != i} mean_t r^j_t``; every token
    gets ``r^i_t - b_i`` and the return ``sum_{s >= t} gamma^(s-t) (r^i_s - b_i)``. (verl's recipe scales each
    token by ``n/(n-1)`` instead, ``r_t n/(n-1) - (1/(n-1)) sum_j mean_t r^j_t``, which differs from this by
    ``(r_t - mean_t r^i_t)/(n-1)`` per token; here the paper's form.)
    Outcome part: RLOO on the sequence outcome reward ``o_i = sum_t token_level_rewards[i, t]``:
    ``o_i - (1/(n-1)) sum_{j != i} o_j``, placed on the last valid token, so its return is that value on every
    earlier token (times ``gamma`` powers).

    ``returns = reward_dpo_coef * process_returns + reward_gt_coef * outcome_returns``; ``advantages =
    masked_whiten(returns)`` (mean 0, unit variance over the valid tokens), 0 where ``response_mask`` is 0. A group of
    one has baseline 0.

    Args:
      token_level_rewards: float32 ``[B, R]``, the outcome (verifier) score on the last response token.
      response_mask: 0/1 ``[B, R]``.
      group_ids: int32 ``[B]`` prompt groups in ``[0, B)``.
      rm_scores: float32 ``[B, R]``, the implicit process rewards (:func:`implicit_process_rewards`, after
        :func:`prime_norm`).
      reward_dpo_coef: weight of the process-reward return (``algorithm.reward_dpo_coef``, verl recipe: 5).
      reward_gt_coef: weight of the outcome-reward return (``algorithm.reward_gt_coef``, verl recipe: 5).
      gamma: discount (``algorithm.gamma``; verl's recipe: 1).

    Returns:
      ``(advantages, returns)``, float32 ``[B, R]`` each.
    """
    mask = jnp.asarray(response_mask, jnp.float32)
    gids = jnp.asarray(group_ids, jnp.int32)
    outcome = jnp.asarray(token_level_rewards, jnp.float32) * mask
    process = jnp.asarray(rm_scores, jnp.float32) * mask
    length = jnp.maximum(jnp.sum(mask, -1), 1.0)
    base_p = _leave_one_out_baseline(jnp.sum(process, -1) / length, gids)
    process_ret = _returns((process - base_p[:, None]) * mask, mask, gamma)
    seq_o = jnp.sum(outcome, -1)
    loo_o = seq_o - _leave_one_out_baseline(seq_o, gids)
    width = mask.shape[1]
    last = width - 1 - jnp.argmax(mask[:, ::-1] != 0, axis=1)
    outcome_tok = jax.nn.one_hot(last, width, dtype=jnp.float32) * loo_o[:, None] * mask
    outcome_ret = _returns(outcome_tok, mask, gamma)
    returns = (reward_dpo_coef * process_ret + reward_gt_coef * outcome_ret) * mask
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns
