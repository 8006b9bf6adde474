"""RL math for jaxrl as pure, ``jax.jit``-able functions (verl's names and semantics).

- ``registry``: the names of the advantage estimators and policy losses and the options each takes
  (no jax import: the config schema reads its choices from it); ``register_adv_estimator`` /
  ``register_policy_loss`` add a user's own.
- ``advantages``: advantage estimators (``"grpo"`` incl. Dr. GRPO, ``"gae"``, ``"rloo"``,
  ``"reinforce_plus_plus"``, ``"reinforce_plus_plus_baseline"``, ``"remax"``, ``"grpo_passk"``,
  ``"opo"``, ``"gpg"``); ``stats``: group mean/std and verl's ``masked_whiten`` / ``masked_var``.
- ``policy_loss``: policy-gradient losses (``"vanilla"`` PPO-clip / clip-higher / dual clip,
  ``"gspo"``, ``"cispo"``, ``"gpg"``) and ``tis_weights`` (truncated importance sampling for the
  rollout/trainer mismatch); ``cov_losses``: ``"clip_cov"``, ``"kl_cov"``.
- ``kl``: per-token KL estimators (k1/abs/k2/k3), their straight-through ``"+"`` variants, the
  importance-weighted k3 (``"low_var_kl_is"``, DeepSeek-V3.2 / TRL) and the exact full-vocabulary
  KL (``kl_full``).
- ``kl_control``: fixed / adaptive KL coefficient controllers (pure, checkpointable) and the
  in-reward KL penalty ``apply_kl_penalty``.
- ``value``: clipped critic loss and explained variance.
- ``preference``: DPO-family losses on sequence log-ratios (``"sigmoid"`` DPO with cDPO label smoothing,
  ``"ipo"``, ``"hinge"``, ``"robust"``), implicit rewards, and the best-vs-worst pairing of a group's samples
  (online DPO).
- ``prime``: PRIME (implicit process rewards ``beta * log(pi_phi / pi_ref)``, the implicit PRM's cross-entropy
  loss, its accuracies, the ``"prime"`` estimator: leave-one-out over process and outcome rewards).
- ``agg``: per-token loss -> scalar, exact under micro-batching.
- ``logprob``: log-probs and entropies in float32, from logits or (``head_log_probs``) from hidden states through the
  LM head in position chunks.

Imports nothing but jax/numpy and the standard library. The names below are imported from their
module on first use (``from jaxrl.algorithms import agg_loss``), so importing the package, or its
``registry``, does not import jax.
"""

from __future__ import annotations

import importlib

_EXPORTS: dict[str, tuple[str, ...]] = {  # module -> the names it exports here
    "advantages": (
        "compute_gae_advantage_return", "compute_gpg_outcome_advantage", "compute_grpo_outcome_advantage",
        "compute_grpo_passk_outcome_advantage", "compute_opo_outcome_advantage",
        "compute_reinforce_plus_plus_baseline_outcome_advantage", "compute_reinforce_plus_plus_outcome_advantage",
        "compute_remax_outcome_advantage", "compute_rloo_outcome_advantage",
    ),
    "stats": (
        "group_mean_std", "masked_var", "masked_whiten",
    ),
    "agg": (
        "LOSS_AGG_MODES", "agg_loss", "check_loss_agg_mode", "masked_mean", "masked_sum",
    ),
    "kl": (
        "KL_PENALTIES", "KL_PENALTIES_IMPORTANCE_WEIGHTED", "KL_PENALTIES_STRAIGHT_THROUGH", "KL_PENALTY_FULL",
        "kl_full", "kl_penalty",
    ),
    "kl_control": (
        "KL_CTRL_TYPES", "AdaptiveKLController", "FixedKLController", "KLController", "apply_kl_penalty",
        "get_kl_controller",
    ),
    "logprob": (
        "LOGITS_CHUNK_BYTES", "entropy_from_logits", "head_log_probs", "log_probs_from_logits",
    ),
    "policy_loss": (
        "compute_policy_loss_cispo", "compute_policy_loss_gpg", "compute_policy_loss_gspo",
        "compute_policy_loss_vanilla", "tis_weights",
    ),
    "cov_losses": (
        "compute_policy_loss_clip_cov", "compute_policy_loss_kl_cov",
    ),
    "value": (
        "compute_value_loss", "explained_variance",
    ),
    "preference": (
        "best_worst_pairs", "dpo_sigmoid_loss", "hinge_loss", "implicit_rewards", "ipo_loss", "robust_dpo_loss",
        "sequence_log_probs",
    ),
    "prime": (
        "compute_prime_advantage", "implicit_log_ratio", "implicit_process_rewards", "prime_norm", "prm_ce_loss",
        "prm_pairwise_accuracy", "prm_sign_accuracy",
    ),
    "registry": (
        "get_adv_estimator", "get_policy_loss", "register_adv_estimator", "register_policy_loss",
        "register_preference_loss", "registered_adv_estimators", "registered_policy_losses",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxrl.algorithms' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"jaxrl.algorithms.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
