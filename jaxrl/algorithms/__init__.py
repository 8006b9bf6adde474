"""RL math for jaxrl as pure, ``jax.jit``-able functions (verl's names and semantics).

- ``advantages``: advantage estimators + registry (``"grpo"``, Dr. GRPO via a flag).
- ``policy_loss``: policy-gradient losses + registry (``"vanilla"`` PPO-clip / clip-higher / dual-clip).
- ``kl``: per-token KL estimators (k1/abs/k2/k3).
- ``agg``: per-token loss -> scalar, exact under micro-batching.
- ``logprob``: log-probs and entropies from logits in float32.

Imports nothing but jax/numpy.
"""

from jaxrl.algorithms.advantages import (
    compute_grpo_outcome_advantage,
    get_adv_estimator,
    group_mean_std,
    register_adv_estimator,
    registered_adv_estimators,
)
from jaxrl.algorithms.agg import LOSS_AGG_MODES, agg_loss, check_loss_agg_mode, masked_mean, masked_sum
from jaxrl.algorithms.kl import KL_PENALTIES, kl_penalty
from jaxrl.algorithms.logprob import entropy_from_logits, log_probs_from_logits
from jaxrl.algorithms.policy_loss import (
    compute_policy_loss_vanilla,
    get_policy_loss,
    register_policy_loss,
    registered_policy_losses,
)

__all__ = [
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "agg_loss",
    "check_loss_agg_mode",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss_vanilla",
    "entropy_from_logits",
    "get_adv_estimator",
    "get_policy_loss",
    "group_mean_std",
    "kl_penalty",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "register_adv_estimator",
    "register_policy_loss",
    "registered_adv_estimators",
    "registered_policy_losses",
]
