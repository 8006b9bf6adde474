"""Advantage estimators and their registry (names follow verl's ``adv_estimator``).

Every estimator has the signature::

    fn(token_level_rewards [B, R] f32, response_mask [B, R], group_ids [B] int32, *, **config)
        -> (advantages [B, R], returns [B, R])

``group_ids[i]`` is the prompt group of row ``i`` (the responses sampled for the same prompt share
an id; verl's ``index``/``uid``), an integer in ``[0, B)``. Estimators are pure and ``jax.jit``-able
with static ``B`` (config kwargs are static). Add one with ``@register_adv_estimator("name")``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

AdvEstimatorFn = Callable[..., tuple[jax.Array, jax.Array]]

_ADV_ESTIMATORS: dict[str, AdvEstimatorFn] = {}


def register_adv_estimator(name: str) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator registering an advantage estimator under ``name`` (verl ``register_adv_est``).

    Raises:
      ValueError: ``name`` is already registered to a different function.
    """

    def decorator(fn: AdvEstimatorFn) -> AdvEstimatorFn:
        if name in _ADV_ESTIMATORS and _ADV_ESTIMATORS[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered to {_ADV_ESTIMATORS[name]!r}")
        _ADV_ESTIMATORS[name] = fn
        return fn

    return decorator


def registered_adv_estimators() -> tuple[str, ...]:
    """Names of the registered advantage estimators, sorted."""
    return tuple(sorted(_ADV_ESTIMATORS))


def get_adv_estimator(name: str) -> AdvEstimatorFn:
    """The advantage estimator registered as ``name`` (verl ``get_adv_estimator_fn``).

    Raises:
      ValueError: unknown name; the message lists the registered names.
    """
    try:
        return _ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; registered: {list(registered_adv_estimators())}"
        ) from None


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


def group_mean_std(scores: jax.Array, group_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-row mean, unbiased std and size of the row's group.

    Groups of size 1 get mean 0 and std 1 (verl's convention: the single response's advantage is
    its raw score). The std is the unbiased sample std (``ddof=1``), matching ``torch.std`` in verl.

    Args:
      scores: ``[B]`` float scores.
      group_ids: ``[B]`` integer group ids in ``[0, B)``.

    Returns:
      ``(mean [B], std [B], count [B])``, each gathered back to the rows.
    """
    num = scores.shape[0]
    ones = jnp.ones_like(scores)
    count = jax.ops.segment_sum(ones, group_ids, num_segments=num)
    safe_count = jnp.maximum(count, 1.0)
    mean_g = jax.ops.segment_sum(scores, group_ids, num_segments=num) / safe_count
    sq_dev = jnp.square(scores - mean_g[group_ids])
    var_g = jax.ops.segment_sum(sq_dev, group_ids, num_segments=num) / jnp.maximum(count - 1.0, 1.0)
    row_count = count[group_ids]
    single = row_count <= 1.0
    mean = jnp.where(single, 0.0, mean_g[group_ids])
    std = jnp.where(single, 1.0, jnp.sqrt(var_g[group_ids]))
    return mean, std, row_count


@register_adv_estimator("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    group_ids: jax.Array,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[jax.Array, jax.Array]:
    """GRPO outcome advantage: the response's score standardised within its prompt group.

    ``score_i = sum_t token_level_rewards[i, t]`` (over all positions, as verl; rewards at masked
    positions are expected to be 0). Then ``A_i = (score_i - mean_g) / (std_g + epsilon)`` with the
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
      epsilon: added to the std before dividing.

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
        adv = adv / (std + epsilon)
    advantages = adv[:, None] * mask
    return advantages, advantages
