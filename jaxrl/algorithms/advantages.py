"""Advantage estimators (names follow verl's ``adv_estimator``).

Every estimator has the signature::

    fn(token_level_rewards [B, R] f32, response_mask [B, R], group_ids [B] int32, *, **options)
        -> (advantages [B, R], returns [B, R])

``group_ids[i]`` is the prompt group of row ``i`` (the responses sampled for the same prompt share
an id; verl's ``index``/``uid``), an integer in ``[0, B)``. Each estimator takes only the keyword
options it uses, named as in verl: ``norm_adv_by_std_in_grpo``, ``gamma``, ``lam``, ``f_norm``
(scalars; bools must be static under ``jax.jit``) and ``values`` [B, R], ``reward_baselines`` [B]
(arrays, traced); ``adv_std_epsilon`` (the std epsilon of ``grpo`` / ``grpo_passk``) is verl's
``epsilon`` under the name of its config key (verl has no key for it). Which of them the trainer
passes from the config is declared in :mod:`jaxrl.algorithms.registry` (the names, options and
batch inputs of every estimator; ``f_norm`` keeps its default).

Estimators: ``grpo``, ``gae``, ``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``,
``remax``, ``grpo_passk``, ``opo``, ``gpg``. They are pure and ``jax.jit``-able with static ``B``;
value checks (group-id range, group sizes, >= 2 valid tokens for whitening) run on eager calls only.
Advantages are exactly 0 wherever ``response_mask`` is 0. Add an estimator with
``@register_adv_estimator("name", options=..., inputs=...)`` (:mod:`jaxrl.algorithms.registry`).
The masked statistics (group mean/std, verl's ``masked_whiten``/``masked_var``) are in
:mod:`jaxrl.algorithms.stats`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.algorithms.registry import get_adv_estimator, register_adv_estimator, registered_adv_estimators
from jaxrl.algorithms.stats import group_mean_std, masked_var, masked_whiten

__all__ = [
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "get_adv_estimator",
    "group_mean_std",
    "masked_var",
    "masked_whiten",
    "register_adv_estimator",
    "registered_adv_estimators",
]


def _check_inputs(token_level_rewards, response_mask, group_ids):
    rewards = jnp.asarray(token_level_rewards)
    mask = jnp.asarray(response_mask)
    gids = jnp.asarray(group_ids)
    if rewards.ndim != 2 or rewards.shape != mask.shape:
        raise ValueError(
            f"token_level_rewards {rewards.shape} and response_mask {mask.shape} must both be [batch, resp_len]"
        )
    if not jnp.issubdtype(rewards.dtype, jnp.floating):
        raise ValueError(f"token_level_rewards must be floating point, got dtype {rewards.dtype}")
    batch = rewards.shape[0]
    if gids.shape != (batch,) or not jnp.issubdtype(gids.dtype, jnp.integer):
        raise ValueError(f"group_ids must be an integer array of shape ({batch},), got {gids.dtype}{gids.shape}")
    if not isinstance(gids, jax.core.Tracer) and batch:
        lo, hi = int(np.min(gids)), int(np.max(gids))
        if lo < 0 or hi >= batch:
            raise ValueError(f"group_ids must be in [0, {batch}) (batch size), got values in [{lo}, {hi}]")
    return rewards, mask.astype(rewards.dtype), gids


def compute_grpo_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    group_ids: jax.Array,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    adv_std_epsilon: float = 1e-6,
) -> tuple[jax.Array, jax.Array]:
    """GRPO outcome advantage: the response's score standardised within its prompt group.

    ``score_i = sum_t token_level_rewards[i, t]`` (over all positions, as verl; rewards at masked
    positions are expected to be 0). Then ``A_i = (score_i - mean_g) / (std_g + adv_std_epsilon)`` with the
    group's mean and *unbiased* std (``torch.std`` in verl, i.e. ``ddof=1``), or
    ``A_i = score_i - mean_g`` when ``norm_adv_by_std_in_grpo=False`` (Dr. GRPO, arXiv 2503.20783).
    A group of size 1 uses mean 0, std 1 (verl's convention); a group whose scores are all equal
    gets advantage 0. ``A_i`` is broadcast over the response and zeroed where ``response_mask`` is 0
    (an all-masked, zero-length response still counts in its group's statistics, as in verl).

    Sources: DeepSeekMath (arXiv 2402.03300) outcome supervision; verl
    ``core_algos.compute_grpo_outcome_advantage``.

    Args:
      token_level_rewards: ``[B, R]`` float rewards (typically one non-zero entry per row).
      response_mask: ``[B, R]`` 0/1 mask of valid response tokens.
      group_ids: ``[B]`` int32 group ids in ``[0, B)``; need not be contiguous.
      norm_adv_by_std_in_grpo: divide by the group std (GRPO) or not (Dr. GRPO). Static.
      adv_std_epsilon: added to the std before dividing (``algorithm.adv_std_epsilon``; verl's ``epsilon``,
        1e-6; TRL's ``GRPOTrainer`` adds 1e-4).

    Returns:
      ``(advantages [B, R], returns [B, R])`` in the rewards' dtype; both are the same array, as in verl.

    Raises:
      ValueError: wrong shapes/dtypes, or (eager call only) a group id outside ``[0, B)``.
    """
    rewards, mask, gids = _check_inputs(token_level_rewards, response_mask, group_ids)
    scores = jnp.sum(rewards, axis=-1)
    mean, std, _ = group_mean_std(scores, gids)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + adv_std_epsilon)
    advantages = adv[:, None] * mask
    return advantages, advantages


# ----------------------------------------------------------------------------- shared helpers


def _is_concrete(*xs) -> bool:
    """True when none of ``xs`` is a JAX tracer (eager call: value checks can run)."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _check_unit_interval(name: str, x) -> None:
    if _is_concrete(x) and not 0.0 <= float(x) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {float(x)}")


def _check_row_array(name: str, x, batch: int, dtype) -> jax.Array:
    arr = jnp.asarray(x)
    if arr.shape != (batch,) or not jnp.issubdtype(arr.dtype, jnp.floating):
        raise ValueError(f"{name} must be a float array of shape ({batch},), got {arr.dtype}{arr.shape}")
    return arr.astype(dtype)


def _mask_out(x: jax.Array, mask: jax.Array) -> jax.Array:
    """``x`` where ``mask`` is non-zero, exactly 0 elsewhere (even where ``x`` is inf/NaN)."""
    return jnp.where(mask != 0, x * mask, jnp.zeros_like(x))


# ----------------------------------------------------------------------------- critic-based: GAE


def compute_gae_advantage_return(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    group_ids: jax.Array,
    *,
    values: jax.Array,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Generalized Advantage Estimation over the response, skipping masked (observation) tokens.

    Computed as a reverse ``jax.lax.scan`` over time with per-row carries ``next_value`` and
    ``last_gae`` (both 0 after the last position). At every step ``t``::

        delta_t  = r_t + gamma * next_value - V_t
        gae_t    = delta_t + gamma * lam * last_gae
        if mask_t:  next_value, last_gae = V_t, gae_t      (a valid token updates the carries)
        else:       carries unchanged                        (a masked token is skipped)
        A_raw_t  = last_gae

    so a masked gap inside a response (tool output / observation tokens in a multi-turn rollout)
    is transparent: the valid token before the gap bootstraps from the first valid token after it,
    exactly as verl's ``compute_gae_advantage_return`` (which handles ``response_mask`` gaps this
    way). ``returns = A_raw + values`` (the critic's target), and the advantages are
    ``masked_whiten(A_raw, response_mask)`` over the whole batch (verl), then set to 0 at masked
    positions (verl leaves whitened leftovers there; no loss reads them). Masked positions never
    leak into valid ones, even if they hold inf/NaN values. ``group_ids`` is not used (it is
    validated for the uniform signature).

    Sources: Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation" (arXiv 1506.02438); verl ``core_algos.compute_gae_advantage_return``.

    Args:
      token_level_rewards: ``[B, R]`` float rewards.
      response_mask: ``[B, R]`` 0/1 mask of valid response (action) tokens; may have gaps.
      group_ids: ``[B]`` int32 group ids in ``[0, B)`` (unused).
      values: ``[B, R]`` float critic values ``V_t`` (cast to the rewards' dtype).
      gamma: discount factor in [0, 1] (verl ``algorithm.gamma``, default 1.0).
      lam: GAE lambda in [0, 1] (verl ``algorithm.lam``, default 1.0).

    Returns:
      ``(advantages [B, R], returns [B, R])`` in the rewards' dtype; ``returns`` is not masked (as verl).

    Raises:
      ValueError: wrong shapes/dtypes, ``gamma``/``lam`` outside [0, 1] (eager), or (eager) fewer
        than 2 valid tokens in the batch (whitening needs an unbiased variance, as verl).
    """
    rewards, mask, _ = _check_inputs(token_level_rewards, response_mask, group_ids)
    vals = jnp.asarray(values)
    if vals.shape != rewards.shape or not jnp.issubdtype(vals.dtype, jnp.floating):
        raise ValueError(f"values must be a float array of shape {rewards.shape}, got {vals.dtype}{vals.shape}")
    _check_unit_interval("gamma", gamma)
    _check_unit_interval("lam", lam)
    vals = vals.astype(rewards.dtype)

    def step(carry, xs):
        next_value, last_gae = carry
        r_t, v_t, m_t = xs
        valid = m_t != 0
        delta = r_t + gamma * next_value - v_t
        gae = delta + gamma * lam * last_gae
        next_value = jnp.where(valid, v_t, next_value)
        last_gae = jnp.where(valid, gae, last_gae)
        return (next_value, last_gae), last_gae

    zeros = jnp.zeros(rewards.shape[:1], rewards.dtype)
    _, adv_t = jax.lax.scan(step, (zeros, zeros), (rewards.T, vals.T, mask.T), reverse=True)
    raw = adv_t.T
    returns = raw + vals
    advantages = _mask_out(masked_whiten(raw, mask), mask)
    return advantages, returns


# ----------------------------------------------------------------------------- critic-free, outcome / token rewards


def compute_rloo_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    group_ids: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """REINFORCE Leave-One-Out: the score minus the mean score of the *other* responses in the group.

    ``score_i = sum_t token_level_rewards[i, t]``; for a group of size ``n > 1``:
    ``A_i = score_i - mean_{j != i} score_j = (score_i - mean_g) * n / (n - 1)``. A group of size 1
    keeps its raw score (verl's registered ``"rloo"``; its ``"rloo_vectorized"`` gives 0 instead).
    ``A_i`` is broadcast over the response and zeroed where ``response_mask`` is 0.

    Sources: Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
    from Human Feedback in LLMs" (arXiv 2402.14740); Kool et al. 2019; verl
    ``core_algos.compute_rloo_outcome_advantage``.

    Args:
      token_level_rewards: ``[B, R]`` float rewards.
      response_mask: ``[B, R]`` 0/1 mask.
      group_ids: ``[B]`` int32 group ids in ``[0, B)``.

    Returns:
      ``(advantages, returns)``, the same ``[B, R]`` array twice (as verl).

    Raises:
      ValueError: wrong shapes/dtypes, or (eager) a group id outside ``[0, B)``.
    """
    rewards, mask, gids = _check_inputs(token_level_rewards, response_mask, group_ids)
    scores = jnp.sum(rewards, axis=-1)
    mean, _, count = group_mean_std(scores, gids)
    loo = (scores - mean) * count / jnp.maximum(count - 1.0, 1.0)
    adv = jnp.where(count > 1.0, loo, scores)
    advantages = adv[:, None] * mask
    return advantages, advantages


def _reverse_discounted_returns(rewards: jax.Array, mask: jax.Array, gamma) -> jax.Array:
    """``G_t = r_t + gamma * G_{t+1}``, with the running return reset to 0 *before* every masked position."""

    def step(running, xs):
        r_t, m_t = xs
        running = r_t + gamma * running
        return jnp.where(m_t != 0, running, jnp.zeros_like(running)), running

    zeros = jnp.zeros(rewards.shape[:1], rewards.dtype)
    _, ret_t = jax.lax.scan(step, zeros, (rewards.T, mask.T), reverse=True)
    return ret_t.T


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    group_ids: jax.Array,
    *,
    gamma: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++: discounted reward-to-go, whitened over the whole batch (no critic, no groups).

    ``G_t = r_t + gamma * G_{t+1}`` computed right to left, where the running return is reset to 0
    after every masked position (verl "reset after EOS"): a masked gap inside a response therefore
    *cuts* the return (rewards after the gap do not reach tokens before it), unlike ``"gae"``.
    ``advantages = masked_whiten(G, response_mask) * response_mask``; ``returns = G`` (not masked).
    ``group_ids`` is validated but unused.

    Sources: Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models"
    (arXiv 2501.03262); verl ``core_algos.compute_reinforce_plus_plus_outcome_advantage``.

    Args:
      token_level_rewards: ``[B, R]`` float rewards.
      response_mask: ``[B, R]`` 0/1 mask.
      group_ids: ``[B]`` int32 group ids in ``[0, B)`` (unused).
      gamma: discount factor in [0, 1] (verl ``algorithm.gamma``, default 1.0).

    Returns:
      ``(advantages [B, R], returns [B, R])``.

    Raises:
      ValueError: wrong shapes/dtypes, ``gamma`` outside [0, 1] (eager), or (eager) fewer than 2
        valid tokens in the batch.
    """
    rewards, mask, _ = _check_inputs(token_level_rewards, response_mask, group_ids)
    _check_unit_interval("gamma", gamma)
    returns = _reverse_discounted_returns(rewards, mask, gamma)
    advantages = _mask_out(masked_whiten(returns, mask), mask)
    return advantages, returns


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    group_ids: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++ with a group-mean baseline, then batch whitening (verl's "RF++-baseline").

    ``A_i = score_i - mean_g`` (mean 0 for a group of size 1, so its raw score), broadcast over the
    response and masked, then ``masked_whiten(·, response_mask) * response_mask`` over the batch:
    the group baseline removes the prompt's difficulty, the global whitening fixes the scale.

    Sources: Hu, REINFORCE++ (arXiv 2501.03262); verl
    ``core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage``.

    Args:
      token_level_rewards: ``[B, R]`` float rewards.
      response_mask: ``[B, R]`` 0/1 mask.
      group_ids: ``[B]`` int32 group ids in ``[0, B)``.

    Returns:
      ``(advantages, returns)``, the same ``[B, R]`` array twice.

    Raises:
      ValueError: wrong shapes/dtypes, a group id outside ``[0, B)`` (eager), or (eager) fewer
        than 2 valid tokens in the batch.
    """
    rewards, mask, gids = _check_inputs(token_level_rewards, response_mask, group_ids)
    scores = jnp.sum(rewards, axis=-1)
    mean, _, _ = group_mean_std(scores, gids)
    tiled = (scores - mean)[:, None] * mask
    advantages = _mask_out(masked_whiten(tiled, mask), mask)
    return advantages, advantages


def compute_remax_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    group_ids: jax.Array,
    *,
    reward_baselines: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """ReMax: reward-to-go minus the score of the greedy response to the same prompt.

    ``returns_t = sum_{s >= t} r_s * mask_s`` (undiscounted reward-to-go) and
    ``A_t = returns_t - b``, where ``b = reward_baselines[i]`` is the score of a greedy
    (argmax-decoded) rollout of row ``i``'s prompt; advantages are 0 at masked positions (verl
    leaves the bare return at masked gap positions; no loss reads them). ``group_ids`` is
    validated but unused.

    Sources: Li et al., "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
    for Aligning Large Language Models" (arXiv 2310.10505); verl
    ``core_algos.compute_remax_outcome_advantage``.

    Args:
      token_level_rewards: ``[B, R]`` float rewards.
      response_mask: ``[B, R]`` 0/1 mask.
      group_ids: ``[B]`` int32 group ids in ``[0, B)`` (unused).
      reward_baselines: ``[B]`` float greedy-rollout scores (the trainer must generate them).

    Returns:
      ``(advantages [B, R], returns [B, R])``.

    Raises:
      ValueError: wrong shapes/dtypes (including ``reward_baselines`` not ``[B]`` float).
    """
    rewards, mask, _ = _check_inputs(token_level_rewards, response_mask, group_ids)
    baselines = _check_row_array("reward_baselines", reward_baselines, rewards.shape[0], rewards.dtype)
    masked = _mask_out(rewards, mask)
    returns = jnp.flip(jnp.cumsum(jnp.flip(masked, -1), axis=-1), -1)
    advantages = _mask_out(returns - baselines[:, None], mask)
    return advantages, returns


def compute_grpo_passk_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    group_ids: jax.Array,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    adv_std_epsilon: float = 1e-6,
) -> tuple[jax.Array, jax.Array]:
    """Pass@k advantage: only the best response of each group gets a non-zero advantage.

    For each group: ``A_best = r_max - r_second_max`` (divided by ``std_g + adv_std_epsilon``, the group's
    unbiased std, when ``norm_adv_by_std_in_grpo``); every other response gets 0. When the maximum
    is shared the advantage is 0 whichever row is "best" (the lowest row index is used). Broadcast
    over the response and masked.

    Sources: arXiv 2503.19595 (the pass@k policy-gradient estimator verl cites for this
    function); verl ``core_algos.compute_grpo_passk_outcome_advantage``.

    Args:
      token_level_rewards: ``[B, R]`` float rewards.
      response_mask: ``[B, R]`` 0/1 mask.
      group_ids: ``[B]`` int32 group ids in ``[0, B)``; every group needs >= 2 responses.
      norm_adv_by_std_in_grpo: divide by the group std. Static.
      adv_std_epsilon: added to the std (``algorithm.adv_std_epsilon``; verl's ``epsilon``).

    Returns:
      ``(advantages, returns)``, the same ``[B, R]`` array twice.

    Raises:
      ValueError: wrong shapes/dtypes; (eager) a group id outside ``[0, B)`` or a group with a
        single response (as verl). Under ``jax.jit`` a single-response group gets advantage 0.
    """
    rewards, mask, gids = _check_inputs(token_level_rewards, response_mask, group_ids)
    scores = jnp.sum(rewards, axis=-1)
    num = scores.shape[0]
    _, std, count = group_mean_std(scores, gids)
    if _is_concrete(gids) and num:
        counts = np.bincount(np.asarray(gids), minlength=num)
        small = np.flatnonzero((counts > 0) & (counts < 2))
        if small.size:
            raise ValueError(
                f"grpo_passk needs at least 2 responses per group; group(s) {small.tolist()} have 1"
            )
    group_max = jax.ops.segment_max(scores, gids, num_segments=num)[gids]
    rows = jnp.arange(num)
    first_max = jax.ops.segment_min(jnp.where(scores == group_max, rows, num), gids, num_segments=num)[gids]
    is_best = rows == first_max
    second = jax.ops.segment_max(jnp.where(is_best, -jnp.inf, scores), gids, num_segments=num)[gids]
    adv = jnp.where(is_best & (count > 1.0), group_max - second, 0.0)
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + adv_std_epsilon)
    advantages = adv.astype(rewards.dtype)[:, None] * mask
    return advantages, advantages


def compute_opo_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    group_ids: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """OPO: the score minus the group's length-weighted mean score (the optimal-variance baseline).

    With ``L_i = sum_t response_mask[i, t]`` (valid-token count): for a group of size > 1,
    ``b_g = sum_j L_j score_j / sum_j L_j`` and ``A_i = score_i - b_g``; a group of size 1 uses
    ``b = 0`` (raw score). A group whose responses are all zero-length gets ``b = 0`` (verl would
    divide 0 by 0; those rows are fully masked anyway). Broadcast over the response and masked.

    Sources: Hao et al., "On-Policy RL with Optimal Reward Baseline" (arXiv 2505.23585); verl
    ``core_algos.compute_opo_outcome_advantage``.

    Args:
      token_level_rewards: ``[B, R]`` float rewards.
      response_mask: ``[B, R]`` 0/1 mask.
      group_ids: ``[B]`` int32 group ids in ``[0, B)``.

    Returns:
      ``(advantages, returns)``, the same ``[B, R]`` array twice.

    Raises:
      ValueError: wrong shapes/dtypes, or (eager) a group id outside ``[0, B)``.
    """
    rewards, mask, gids = _check_inputs(token_level_rewards, response_mask, group_ids)
    num = rewards.shape[0]
    scores = jnp.sum(rewards, axis=-1)
    lengths = jnp.sum(mask, axis=-1)
    _, _, count = group_mean_std(scores, gids)
    num_g = jax.ops.segment_sum(lengths * scores, gids, num_segments=num)[gids]
    den_g = jax.ops.segment_sum(lengths, gids, num_segments=num)[gids]
    baseline = jnp.where((count > 1.0) & (den_g > 0), num_g / jnp.where(den_g > 0, den_g, 1.0), 0.0)
    advantages = (scores - baseline)[:, None] * mask
    return advantages, advantages


def compute_gpg_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    group_ids: jax.Array,
    *,
    f_norm: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """GPG advantage: group-mean-centred score, rescaled by the batch's fraction of non-zero scores.

    ``alpha = B / max(#{i : score_i != 0}, 1)`` (over the whole batch) and
    ``A_i = alpha * (score_i - mean_g) / f_norm`` (mean 0 for a group of size 1). No std division.
    Broadcast over the response and masked.

    Sources: Chu et al., "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning" (arXiv 2504.02546); verl ``core_algos.compute_gpg_outcome_advantage``.

    Args:
      token_level_rewards: ``[B, R]`` float rewards.
      response_mask: ``[B, R]`` 0/1 mask.
      group_ids: ``[B]`` int32 group ids in ``[0, B)``.
      f_norm: constant divisor (verl default 1.0).

    Returns:
      ``(advantages, returns)``, the same ``[B, R]`` array twice.

    Raises:
      ValueError: wrong shapes/dtypes, ``f_norm == 0`` (eager), or (eager) a group id outside ``[0, B)``.
    """
    rewards, mask, gids = _check_inputs(token_level_rewards, response_mask, group_ids)
    if _is_concrete(f_norm) and float(f_norm) == 0.0:
        raise ValueError("f_norm must be non-zero, got 0.0")
    scores = jnp.sum(rewards, axis=-1)
    mean, _, _ = group_mean_std(scores, gids)
    nonzero = jnp.sum((scores != 0).astype(rewards.dtype))
    alpha = scores.shape[0] / jnp.maximum(nonzero, 1.0)
    advantages = (alpha * (scores - mean) / f_norm)[:, None] * mask
    return advantages, advantages
