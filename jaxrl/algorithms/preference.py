"""Preference losses (DPO and its relatives) and the online pairing of a group's samples, as pure functions.

Every loss is registered by name in :mod:`jaxrl.algorithms.registry` (``PREFERENCE_LOSSES``; the config value is
``algorithm.dpo.loss_type``) and has the signature::

    fn(chosen_logratios [B], rejected_logratios [B], *, beta, chosen_lengths [B], rejected_lengths [B],
       **own_options) -> per-pair loss [B] (float32)

where a *log-ratio* is ``log pi_theta(y | x) - log pi_ref(y | x)``, the response's summed token log-probabilities
under the policy minus those under the frozen reference (:func:`sequence_log_probs`), and the lengths are the
responses' token counts (only the length-normalised losses read them). The caller averages over pairs. The
implicit reward of a response is ``beta x its log-ratio`` (:func:`implicit_rewards`), what TRL logs as
``rewards/chosen`` / ``rewards/rejected``.

Losses (``d = chosen_logratios - rejected_logratios``):

- ``sigmoid``: DPO, Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a
  Reward Model", eq. 7: ``-log sigmoid(beta d)``; with ``label_smoothing = e > 0`` the conservative DPO of
  Mitchell 2023 ("A note on DPO with noisy preferences", cDPO; TRL's ``label_smoothing``): the label is assumed
  flipped with probability ``e``: ``-(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d)``.
- ``ipo``: IPO, Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
  Preferences", eq. 17: ``(h - 1 / (2 beta))^2`` with ``h`` the difference of the *length-normalised*
  log-ratios ``chosen_logratios / chosen_lengths - rejected_logratios / rejected_lengths`` (as TRL computes it:
  the per-token average keeps ``beta`` comparable across lengths; ``beta`` is the paper's ``tau``).
- ``hinge``: SLiC-HF, Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration with Human Feedback":
  ``max(0, 1 - beta d)``.
- ``robust``: robust DPO, Chowdhury et al. 2024, "Provably Robust DPO", eq. 8: the unbiased loss under label
  noise ``e``: ``(-(1 - e) log sigmoid(beta d) + e log sigmoid(-beta d)) / (1 - 2 e)``, ``e < 0.5``.

Imports only jax and numpy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "best_worst_pairs",
    "dpo_sigmoid_loss",
    "hinge_loss",
    "implicit_rewards",
    "ipo_loss",
    "robust_dpo_loss",
    "sequence_log_probs",
]

_F32 = jnp.float32


def sequence_log_probs(token_log_probs: jax.Array, mask: jax.Array) -> jax.Array:
    """``log pi(y | x)`` of each response: its token log-probabilities summed over ``mask``.

    Args:
      token_log_probs: ``[B, R]`` float log-probabilities (nats) of the response tokens.
      mask: ``[B, R]`` 0/1 (any numeric dtype): 1 on the response's tokens.

    Returns:
      ``[B]`` float32; masked entries contribute exactly 0 (even when they hold inf/NaN).
    """
    lp = jnp.asarray(token_log_probs, _F32)
    m = jnp.asarray(mask).astype(_F32)
    return jnp.sum(jnp.where(m != 0, lp * m, 0.0), axis=-1)


def implicit_rewards(log_probs: jax.Array, ref_log_probs: jax.Array, beta: float) -> jax.Array:
    """DPO's implicit reward ``beta (log pi(y|x) - log pi_ref(y|x))`` per response (Rafailov et al. 2023, eq. 5
    without the prompt-only term), ``[B]`` float32 from ``[B]`` sequence log-probs."""
    return beta * (jnp.asarray(log_probs, _F32) - jnp.asarray(ref_log_probs, _F32))


def _check(beta: float, label_smoothing: float = 0.0, hi: float = 0.5, *, hi_open: bool = False) -> None:
    """Eager checks of the scalar options (python numbers; traced values are not checked)."""
    if isinstance(beta, (int, float)) and not beta > 0:
        raise ValueError(f"beta={beta!r} must be > 0")
    if isinstance(label_smoothing, (int, float)):
        ok = 0.0 <= label_smoothing < hi if hi_open else 0.0 <= label_smoothing <= hi
        if not ok:
            raise ValueError(f"label_smoothing={label_smoothing!r} must be in [0, {hi}{')' if hi_open else ']'}")


def _delta(chosen_logratios, rejected_logratios) -> jax.Array:
    c = jnp.asarray(chosen_logratios, _F32)
    r = jnp.asarray(rejected_logratios, _F32)
    if c.shape != r.shape or c.ndim != 1:
        raise ValueError(f"chosen and rejected log-ratios must both be [B], got {c.shape} and {r.shape}")
    return c - r


def dpo_sigmoid_loss(chosen_logratios, rejected_logratios, *, beta: float, chosen_lengths=None,
                     rejected_lengths=None, label_smoothing: float = 0.0) -> jax.Array:
    """DPO's sigmoid loss (Rafailov et al. 2023, eq. 7), with cDPO label smoothing (Mitchell 2023).

    ``-(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d)``, ``d = chosen_logratios - rejected_logratios``,
    ``e = label_smoothing`` (0 = plain DPO).

    Args:
      chosen_logratios, rejected_logratios: ``[B]`` float, ``log pi - log pi_ref`` of each pair's responses.
      beta: the KL-regularisation strength, > 0.
      chosen_lengths, rejected_lengths: unused (the common signature).
      label_smoothing: the assumed probability that a pair's label is flipped, in ``[0, 0.5]``.

    Returns:
      ``[B]`` float32 per-pair losses.

    Raises:
      ValueError: ``beta <= 0``, ``label_smoothing`` outside ``[0, 0.5]``, mismatched shapes.
    """
    _check(beta, label_smoothing)
    z = beta * _delta(chosen_logratios, rejected_logratios)
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)


def ipo_loss(chosen_logratios, rejected_logratios, *, beta: float, chosen_lengths, rejected_lengths) -> jax.Array:
    """IPO (Azar et al. 2023, eq. 17) on length-normalised log-ratios, as TRL computes it.

    ``(chosen_logratios / chosen_lengths - rejected_logratios / rejected_lengths - 1 / (2 beta))^2``; a length
    below 1 counts as 1.

    Args:
      chosen_logratios, rejected_logratios: ``[B]`` float log-ratios.
      beta: the paper's ``tau``, > 0 (the target log-ratio gap per token is ``1 / (2 beta)``).
      chosen_lengths, rejected_lengths: ``[B]`` response token counts.

    Returns:
      ``[B]`` float32 per-pair losses.

    Raises:
      ValueError: ``beta <= 0``, mismatched shapes.
    """
    _check(beta)
    _delta(chosen_logratios, rejected_logratios)
    c = jnp.asarray(chosen_logratios, _F32) / jnp.maximum(jnp.asarray(chosen_lengths, _F32), 1.0)
    r = jnp.asarray(rejected_logratios, _F32) / jnp.maximum(jnp.asarray(rejected_lengths, _F32), 1.0)
    return (c - r - 1.0 / (2.0 * beta)) ** 2


def hinge_loss(chosen_logratios, rejected_logratios, *, beta: float, chosen_lengths=None,
               rejected_lengths=None) -> jax.Array:
    """SLiC's hinge loss (Zhao et al. 2023): ``max(0, 1 - beta d)``, ``[B]`` float32.

    Raises:
      ValueError: ``beta <= 0``, mismatched shapes.
    """
    _check(beta)
    return jax.nn.relu(1.0 - beta * _delta(chosen_logratios, rejected_logratios))


def robust_dpo_loss(chosen_logratios, rejected_logratios, *, beta: float, chosen_lengths=None,
                    rejected_lengths=None, label_smoothing: float = 0.0) -> jax.Array:
    """Robust DPO (Chowdhury et al. 2024, eq. 8): the DPO loss de-biased for label noise ``e = label_smoothing``.

    ``(-(1 - e) log sigmoid(beta d) + e log sigmoid(-beta d)) / (1 - 2 e)``, ``[B]`` float32.

    Raises:
      ValueError: ``beta <= 0``, ``label_smoothing`` outside ``[0, 0.5)``, mismatched shapes.
    """
    _check(beta, label_smoothing, hi_open=True)
    z = beta * _delta(chosen_logratios, rejected_logratios)
    e = label_smoothing
    return (-(1.0 - e) * jax.nn.log_sigmoid(z) + e * jax.nn.log_sigmoid(-z)) / (1.0 - 2.0 * e)


def best_worst_pairs(scores: np.ndarray, group_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Online preference pairs from a batch of scored samples: in every group of responses to one prompt, the
    highest-scored response is *chosen* and the lowest-scored one *rejected* (the first of equal scores).

    A group whose responses all score the same carries no preference and gives no pair.

    Args:
      scores: ``[N]`` float sequence scores (the reward of each response).
      group_ids: ``[N]`` int, equal for responses to the same prompt (:attr:`jaxrl.batch.RLBatch.group_ids`).

    Returns:
      ``(chosen [M], rejected [M], tied_groups)``: int64 row indices of the ``M`` pairs, in the order the groups
      first appear, and the number of groups left out because all their scores were equal (or they had one
      response).

    Raises:
      ValueError: ``scores`` and ``group_ids`` are not ``[N]`` arrays of one length, or a score is not finite.
    """
    scores = np.asarray(scores, np.float64)
    group_ids = np.asarray(group_ids)
    if scores.ndim != 1 or scores.shape != group_ids.shape:
        raise ValueError(f"scores {scores.shape} and group_ids {group_ids.shape} must be [N] arrays of one length")
    if not np.all(np.isfinite(scores)):
        raise ValueError(f"scores must be finite to rank responses, got {scores[~np.isfinite(scores)][:3]}")
    _, first, inverse = np.unique(group_ids, return_index=True, return_inverse=True)
    chosen, rejected, tied = [], [], 0
    for g in np.argsort(first, kind="stable"):
        rows = np.flatnonzero(inverse == g)
        s = scores[rows]
        best, worst = rows[int(np.argmax(s))], rows[int(np.argmin(s))]
        if s.max() == s.min():
            tied += 1
            continue
        chosen.append(best)
        rejected.append(worst)
    return np.asarray(chosen, np.int64), np.asarray(rejected, np.int64), tied
