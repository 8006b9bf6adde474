"""KL coefficient controllers and the in-reward KL penalty (verl ``use_kl_in_reward``).

Controllers are immutable ``NamedTuple`` states with a pure ``update`` that returns the next
state (verl's classes mutate ``self.value``). Being NamedTuples they are JAX pytrees, and
``ctrl._asdict()`` / ``AdaptiveKLController(**d)`` round-trip them through a checkpoint.

Typical trainer step (verl ``ray_trainer.apply_kl_penalty``)::

    rewards, current_kl = apply_kl_penalty(scores, old_log_prob, ref_log_prob, mask,
                                           kl_coef=ctrl.value, kl_penalty=cfg.kl_penalty)
    ctrl = ctrl.update(float(current_kl), n_steps=batch_size)
    metrics["actor/reward_kl_penalty"] = float(current_kl)
    metrics["actor/reward_kl_penalty_coeff"] = <the kl_coef that was applied>
"""

from __future__ import annotations

import math
from typing import NamedTuple, Union

import jax
import jax.numpy as jnp

from jaxrl.algorithms.agg import masked_mean
from jaxrl.algorithms.kl import kl_penalty as _kl_penalty

KL_CTRL_TYPES: tuple[str, ...] = ("fixed", "adaptive")


def _is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


class FixedKLController(NamedTuple):
    """Constant KL coefficient (verl ``FixedKLController``).

    Attributes:
      value: the KL coefficient ``beta`` (float).
    """

    value: float

    def update(self, current_kl, n_steps) -> FixedKLController:
        """No-op: returns ``self`` (the arguments are accepted for the common controller interface)."""
        del current_kl, n_steps
        return self


class AdaptiveKLController(NamedTuple):
    """Proportional controller that steers the observed KL towards ``target`` (Ziegler et al. 2019).

    ``update(current_kl, n_steps)`` returns a controller with
    ``value * (1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon)``: the coefficient
    grows when the KL is above target and shrinks when below, by at most 20% per ``horizon`` steps.

    Sources: Ziegler et al., "Fine-Tuning Language Models from Human Preferences"
    (arXiv 1909.08593), Sec. 2.2; verl ``core_algos.AdaptiveKLController``.

    Attributes:
      value: current KL coefficient ``beta`` (verl ``init_kl_coef`` at creation).
      target: target KL (nats per token, as measured by ``apply_kl_penalty``), > 0.
      horizon: number of samples over which the error is corrected, > 0.
    """

    value: float
    target: float
    horizon: float

    def update(self, current_kl, n_steps) -> AdaptiveKLController:
        """Next controller state after observing ``current_kl`` over ``n_steps`` samples.

        Eager inputs (Python/numpy numbers or concrete arrays) are computed in float64 and the new
        ``value`` is a Python float; if any input is a JAX tracer the update is traced with ``jnp``
        (float32), so it can run inside ``jax.jit``.

        Args:
          current_kl: observed KL (scalar), e.g. the second output of ``apply_kl_penalty``.
          n_steps: number of samples it was measured on (verl passes the batch size), >= 0.

        Raises:
          ValueError: (eager) non-finite ``current_kl``, negative ``n_steps``, or a stored
            ``target``/``horizon`` that is not > 0.
        """
        if not _is_concrete(current_kl, n_steps, self.value, self.target, self.horizon):
            err = jnp.clip(current_kl / self.target - 1.0, -0.2, 0.2)
            return self._replace(value=self.value * (1.0 + err * n_steps / self.horizon))
        kl, steps = float(current_kl), float(n_steps)
        target, horizon = float(self.target), float(self.horizon)
        if not math.isfinite(kl):
            raise ValueError(f"current_kl must be finite, got {kl}")
        if steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {steps}")
        if not (target > 0 and horizon > 0):
            raise ValueError(f"AdaptiveKLController needs target > 0 and horizon > 0, got {target}, {horizon}")
        err = min(max(kl / target - 1.0, -0.2), 0.2)
        return self._replace(value=float(self.value) * (1.0 + err * steps / horizon))


KLController = Union[FixedKLController, AdaptiveKLController]


def get_kl_controller(
    type: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> KLController:
    """Build a controller from verl's ``algorithm.kl_ctrl`` fields (verl ``get_kl_controller``).

    Args:
      type: ``"fixed"`` or ``"adaptive"``.
      kl_coef: (initial) KL coefficient, >= 0.
      target_kl: adaptive only: target KL, > 0.
      horizon: adaptive only: horizon in samples, > 0.

    Returns:
      ``FixedKLController(kl_coef)`` or ``AdaptiveKLController(kl_coef, target_kl, horizon)``.

    Raises:
      ValueError: unknown ``type`` (lists the valid ones), negative ``kl_coef``, or an adaptive
        controller without a positive ``target_kl``/``horizon``.
    """
    if type not in KL_CTRL_TYPES:
        raise ValueError(f"unknown kl_ctrl type {type!r}; valid types are {list(KL_CTRL_TYPES)}")
    if not float(kl_coef) >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if type == "fixed":
        return FixedKLController(value=float(kl_coef))
    if target_kl is None or not float(target_kl) > 0:
        raise ValueError(f"adaptive kl_ctrl needs target_kl > 0, got {target_kl}")
    if horizon is None or not float(horizon) > 0:
        raise ValueError(f"adaptive kl_ctrl needs horizon > 0, got {horizon}")
    return AdaptiveKLController(value=float(kl_coef), target=float(target_kl), horizon=float(horizon))


def apply_kl_penalty(
    token_level_scores: jax.Array,
    old_log_prob: jax.Array,
    ref_log_prob: jax.Array,
    response_mask: jax.Array,
    kl_coef: float | jax.Array,
    kl_penalty: str = "kl",
) -> tuple[jax.Array, jax.Array]:
    """Subtract a per-token KL penalty from the rewards (verl ``ray_trainer.apply_kl_penalty``).

    ``kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty) * response_mask`` (exactly 0 at
    masked positions, even if the log-probs there are inf/NaN);
    ``token_level_rewards = token_level_scores - kl_coef * kld``;
    ``current_kl = mean_i( sum_t kld[i, t] / sum_t mask[i, t] )`` (per-sequence token mean, then
    batch mean; a zero-length row contributes 0 and still counts, as verl). Feed ``current_kl``
    and ``n_steps = batch`` to the controller's ``update``. The KL is between the behaviour policy
    (``old_log_prob``) and the reference, as verl.

    Sources: Ziegler et al. 2019 (arXiv 1909.08593), Stiennon et al. 2020 (per-token KL reward);
    verl ``ray_trainer.apply_kl_penalty``.

    Args:
      token_level_scores: ``[B, R]`` float task rewards (e.g. the score on the last token).
      old_log_prob: ``[B, R]`` float behaviour-policy log-probs of the sampled tokens.
      ref_log_prob: ``[B, R]`` float reference-policy log-probs.
      response_mask: ``[B, R]`` 0/1 mask.
      kl_coef: KL coefficient ``beta`` (the controller's ``value``).
      kl_penalty: a per-token estimator name (``kl.KL_PENALTIES`` or a ``"+"`` variant; the
        gradient trick is irrelevant here). ``"full"`` is not possible: it needs distributions.

    Returns:
      ``(token_level_rewards [B, R], current_kl scalar)`` in the scores' dtype (at least float32).

    Raises:
      ValueError: unknown/``"full"`` estimator, or shapes that are not all the same ``[B, R]``.
    """
    scores = jnp.asarray(token_level_scores)
    mask = jnp.asarray(response_mask)
    shapes = {
        "token_level_scores": scores.shape,
        "old_log_prob": jnp.shape(old_log_prob),
        "ref_log_prob": jnp.shape(ref_log_prob),
        "response_mask": mask.shape,
    }
    if len(set(shapes.values())) != 1 or scores.ndim != 2:
        raise ValueError(f"inputs must all be [batch, resp_len] with one shape, got {shapes}")
    kld = _kl_penalty(old_log_prob, ref_log_prob, kl_penalty)
    dtype = jnp.promote_types(scores.dtype, kld.dtype)
    mask = mask.astype(dtype)
    kld = jnp.where(mask != 0, kld.astype(dtype) * mask, 0.0)
    rewards = scores.astype(dtype) - kl_coef * kld
    current_kl = jnp.mean(masked_mean(kld, mask, axis=-1)) if scores.shape[0] else jnp.zeros((), dtype)
    return rewards, current_kl
