"""Policy-gradient losses and their registry (names follow verl's ``policy_loss.loss_mode``).

Every policy loss has the signature::

    fn(old_log_prob [B, R], log_prob [B, R], advantages [B, R], response_mask [B, R], *,
       loss_agg_mode="token-mean", num_tokens=None, num_seqs=None, **config)
        -> (pg_loss scalar, metrics dict[str, scalar])

``num_tokens`` / ``num_seqs`` are the mini-batch normalisers forwarded to ``agg_loss`` (see there),
which make gradient accumulation over micro-batches exact. Metrics are micro-batch token means,
wrapped in ``stop_gradient``. Add a loss with ``@register_policy_loss("name")``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl.algorithms.agg import agg_loss, check_loss_agg_mode, masked_mean
from jaxrl.algorithms.logprob import entropy_from_logits

__all__ = [
    "compute_policy_loss_vanilla",
    "entropy_from_logits",
    "get_policy_loss",
    "register_policy_loss",
    "registered_policy_losses",
]

PolicyLossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]

_POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name`` (verl ``register_policy_loss``).

    Raises:
      ValueError: ``name`` is already registered to a different function.
    """

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _POLICY_LOSSES and _POLICY_LOSSES[name] is not fn:
            raise ValueError(f"policy loss {name!r} is already registered to {_POLICY_LOSSES[name]!r}")
        _POLICY_LOSSES[name] = fn
        return fn

    return decorator


def registered_policy_losses() -> tuple[str, ...]:
    """Names of the registered policy losses, sorted."""
    return tuple(sorted(_POLICY_LOSSES))


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name`` (verl ``get_policy_loss_fn``).

    Raises:
      ValueError: unknown name; the message lists the registered names.
    """
    try:
        return _POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; registered: {list(registered_policy_losses())}") from None


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    num_tokens: jax.Array | float | None = None,
    num_seqs: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate with decoupled clip range and dual clip, exactly as verl computes it.

    Per token, with ``A`` the advantage and ``r = exp(clip(log_prob - old_log_prob, -20, 20))``:

    - ``L1 = -A * r``, ``L2 = -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)``, ``L = max(L1, L2)``
      (PPO-clip, arXiv 1707.06347; asymmetric "clip-higher" bounds from DAPO, arXiv 2503.14476);
    - where ``A < 0``: ``L = min(L, -A * clip_ratio_c)`` (dual-clip PPO, arXiv 1912.09729), which
      bounds the loss when ``r`` is very large on a negative-advantage token.

    The token losses are aggregated with ``agg_loss(…, loss_agg_mode, num_tokens, num_seqs)``.

    Metrics (token means over ``response_mask``, stop-gradient):
      ``pg_clipfrac``: fraction of tokens with ``L2 > L1`` (the clipped branch was taken);
      ``ppo_kl``: mean of ``old_log_prob - log_prob`` after the [-20, 20] clamp (k1 KL estimate);
      ``pg_clipfrac_lower``: fraction of tokens with ``A < 0`` and ``max(L1, L2) > -A * clip_ratio_c``.

    Source: verl ``core_algos.compute_policy_loss_vanilla``.

    Args:
      old_log_prob: ``[B, R]`` float log-probs of the sampled tokens under the behaviour policy.
      log_prob: ``[B, R]`` float log-probs under the current policy (differentiated).
      advantages: ``[B, R]`` float advantages.
      response_mask: ``[B, R]`` 0/1 mask of valid response tokens.
      clip_ratio_low: lower clip epsilon (ratio floor ``1 - clip_ratio_low``).
      clip_ratio_high: upper clip epsilon (ratio ceiling ``1 + clip_ratio_high``).
      clip_ratio_c: dual-clip constant, must be > 1.
      loss_agg_mode: see ``agg_loss``.
      num_tokens: mini-batch valid-token count for ``agg_loss`` (``None``: this batch's).
      num_seqs: mini-batch sequence count for ``agg_loss`` (``None``: this batch's).

    Returns:
      ``(pg_loss, {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"})``, all scalars.

    Raises:
      ValueError: ``clip_ratio_c <= 1``, unknown ``loss_agg_mode``, or mismatched shapes.
    """
    if not isinstance(clip_ratio_c, jax.core.Tracer) and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    check_loss_agg_mode(loss_agg_mode)
    old_log_prob, log_prob, advantages, response_mask = (
        jnp.asarray(x) for x in (old_log_prob, log_prob, advantages, response_mask)
    )
    shapes = {
        "old_log_prob": old_log_prob.shape,
        "log_prob": log_prob.shape,
        "advantages": advantages.shape,
        "response_mask": response_mask.shape,
    }
    if len(set(shapes.values())) != 1 or len(shapes["log_prob"]) != 2:
        raise ValueError(f"inputs must all be [batch, resp_len] with one shape, got {shapes}")

    negative_approx_kl = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    ratio = jnp.exp(negative_approx_kl)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_pg_losses1 = jnp.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = jnp.minimum(pg_losses3, clip_pg_losses1)
    negative_adv = advantages < 0
    pg_losses = jnp.where(negative_adv, clip_pg_losses2, clip_pg_losses1)

    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)

    f32 = jnp.float32
    metrics = {
        "pg_clipfrac": masked_mean((pg_losses2 > pg_losses1).astype(f32), response_mask),
        "ppo_kl": masked_mean((-negative_approx_kl).astype(f32), response_mask),
        "pg_clipfrac_lower": masked_mean(
            ((clip_pg_losses1 > pg_losses3) & negative_adv).astype(f32), response_mask
        ),
    }
    return pg_loss, jax.lax.stop_gradient(metrics)
