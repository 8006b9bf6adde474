"""RL math for jaxrl as pure, ``jax.jit``-able functions (verl's names and semantics).

- ``advantages``: advantage estimators + registry (``"grpo"`` incl. Dr. GRPO, ``"gae"``, ``"rloo"``,
  ``"reinforce_plus_plus"``, ``"reinforce_plus_plus_baseline"``, ``"remax"``, ``"grpo_passk"``,
  ``"opo"``, ``"gpg"``) and verl's ``masked_whiten`` / ``masked_var``.
- ``policy_loss``: policy-gradient losses + registry (``"vanilla"`` PPO-clip / clip-higher / dual
  clip, ``"gspo"``, ``"cispo"``, ``"clip_cov"``, ``"kl_cov"``, ``"gpg"``) and ``tis_weights``
  (truncated importance sampling for the rollout/trainer mismatch).
- ``kl``: per-token KL estimators (k1/abs/k2/k3), their straight-through ``"+"`` variants, and the
  exact full-vocabulary KL (``kl_full``).
- ``kl_control``: fixed / adaptive KL coefficient controllers (pure, checkpointable) and the
  in-reward KL penalty ``apply_kl_penalty``.
- ``value``: clipped critic loss and explained variance.
- ``agg``: per-token loss -> scalar, exact under micro-batching.
- ``logprob``: log-probs and entropies from logits in float32.

Imports nothing but jax/numpy and the standard library.
"""

from jaxrl.algorithms.advantages import (
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator,
    group_mean_std,
    masked_var,
    masked_whiten,
    register_adv_estimator,
    registered_adv_estimators,
)
from jaxrl.algorithms.agg import LOSS_AGG_MODES, agg_loss, check_loss_agg_mode, masked_mean, masked_sum
from jaxrl.algorithms.kl import (
    KL_PENALTIES,
    KL_PENALTIES_STRAIGHT_THROUGH,
    KL_PENALTY_FULL,
    kl_full,
    kl_penalty,
)
from jaxrl.algorithms.kl_control import (
    KL_CTRL_TYPES,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    get_kl_controller,
)
from jaxrl.algorithms.logprob import entropy_from_logits, log_probs_from_logits
from jaxrl.algorithms.policy_loss import (
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_vanilla,
    get_policy_loss,
    register_policy_loss,
    registered_policy_losses,
    tis_weights,
)
from jaxrl.algorithms.value import compute_value_loss, explained_variance

__all__ = [
    "KL_CTRL_TYPES",
    "KL_PENALTIES",
    "KL_PENALTIES_STRAIGHT_THROUGH",
    "KL_PENALTY_FULL",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "agg_loss",
    "apply_kl_penalty",
    "check_loss_agg_mode",
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "explained_variance",
    "get_adv_estimator",
    "get_kl_controller",
    "get_policy_loss",
    "group_mean_std",
    "kl_full",
    "kl_penalty",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_estimator",
    "register_policy_loss",
    "registered_adv_estimators",
    "registered_policy_losses",
    "tis_weights",
]
