"""PRIME's implicit process reward model: a causal LM trained online from outcome labels; its per-token log-ratio to a
frozen reference is the dense process reward (Cui et al. 2025, arXiv 2502.01456; verl's ``recipe/prime``).

:class:`ImplicitPRMWorker` is a trained role (:class:`jaxrl.workers.trained_role.TrainedRole`: its own AdamW and
schedule from ``reward_model.model.optim``, mini-batches of ``reward_model.mini_batch_size`` responses,
micro-batches of ``reward_model.micro_batch_size_per_gpu`` per data-parallel device, mesh placement,
``state()`` / ``load_state()`` for checkpoints). This module holds the PRM's loss of one micro-batch
(:func:`jaxrl.algorithms.prime.prm_ce_loss` on ``log pi_phi - log pi_ref``) and its step (:meth:`ImplicitPRMWorker.step`):

    ref log-probs (frozen) -> PRM log-probs -> accuracies "before" -> update (update=before|after) ->
    [before: PRM log-probs again] -> r_t = beta q_t (prime_granularity) -> prime_norm -> rm_scores [N, R]

Log-probs are read at temperature 1 (the PRM's own distribution, not the rollout's sampling temperature), on padded
rows. The frozen reference is never checkpointed: it is rebuilt from its model file at resume.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxrl.algorithms import log_probs_from_logits
from jaxrl.algorithms.prime import (implicit_log_ratio, implicit_process_rewards, prime_norm, prm_ce_loss,
                                    prm_pairwise_accuracy, prm_sign_accuracy)
from jaxrl.batch import RLBatch
from jaxrl.config.batch_plan import RolePlan
from jaxrl.workers.actor import LogProbComputer, forward_response
from jaxrl.workers.placement import shard_tree
from jaxrl.workers.trained_role import TrainedRole


class ImplicitPRMWorker(TrainedRole):
    """The implicit PRM (metrics under verl's ``reward_model/``).

    Args:
      graphdef, params: ``nnx.split`` of the PRM decoder (initialised from the policy or ``reward_model.model.path``).
      ref_graphdef, ref_params: the frozen reference decoder (``reward_model.model.ref_path``; by default the PRM's
        initial weights, possibly the very arrays of the actor's reference).
      rm_cfg: the ``reward_model`` config section: ``model.beta_train``, ``model.update``, ``model.optim`` (with
        ``grad_clip``), ``prime_granularity``, ``prime_norm``.
      plan: the PRM's batch sizes (:func:`jaxrl.config.batch_plan.prime_plan` for the mesh's batch shards).
      total_training_steps: RL steps in the run (the learning-rate schedule).
      seed: the role's RNG seed (its rows are not shuffled, as verl's).
      mesh, rules: the train mesh and its rules, or None (one device).

    Raises:
      ValueError: sizes that do not fit (see :class:`~jaxrl.workers.trained_role.TrainedRole`).
    """

    name = "reward_model"

    def __init__(self, graphdef, params, ref_graphdef, ref_params, rm_cfg, *, plan: RolePlan,
                 total_training_steps: int, seed: int = 0, mesh=None, rules=None):
        m = rm_cfg.model
        super().__init__(graphdef, params, plan=plan, optim=m.optim, grad_clip=m.optim.grad_clip, shuffle=False,
                         total_training_steps=total_training_steps, seed=seed, mesh=mesh, rules=rules)
        self.beta = float(m.beta_train)
        self.update_mode = m.update
        self.granularity = rm_cfg.prime_granularity
        self.norm = rm_cfg.prime_norm
        self.ref_params = ref_params
        if mesh is not None:
            self.ref_params, _ = shard_tree(ref_params, mesh, self.rules)
        common = dict(micro_batch_size=plan.forward_rows, temperature=1.0, mesh=mesh, rules=rules)
        self.log_prob = LogProbComputer(self.graphdef, **common)
        self.ref_log_prob = LogProbComputer(ref_graphdef, **common)

    # -- forwards --------------------------------------------------------------------------------------------

    def log_probs(self, batch: RLBatch) -> np.ndarray:
        """The PRM's log-probs of the response tokens, float32 ``[N, R]`` (0 where masked)."""
        return self.log_prob(self.model_state(), batch)[0]

    def ref_log_probs(self, batch: RLBatch) -> np.ndarray:
        """The frozen reference's log-probs of the response tokens, float32 ``[N, R]`` (0 where masked)."""
        return self.ref_log_prob(self.ref_params, batch)[0]

    # -- the update ------------------------------------------------------------------------------------------

    def _micro_loss(self, params, micro, num_tokens, num_seqs, prompt_width, extra=None):
        mask = micro["response_mask"]
        logits = forward_response(self.graphdef, params, micro["input_ids"], micro["positions"],
                                  micro["attention_mask"], prompt_width, 1.0, self.activation_sharding)
        log_prob = log_probs_from_logits(logits, micro["response_ids"])
        loss = prm_ce_loss(log_prob, micro["ref_log_probs"], mask, micro["acc"], beta=self.beta, num_seqs=num_seqs)
        return loss, ({"reward_model/dpo_loss": loss}, {}, jnp.sum(mask))

    def minibatch_arrays(self, batch: RLBatch) -> dict[str, np.ndarray]:
        """The per-row arrays the loss reads (``batch.ref_log_probs`` here are the PRM reference's, ``batch.acc``
        the outcome labels)."""
        return {
            **batch.sequence_arrays(),
            "ref_log_probs": np.asarray(batch.ref_log_probs, np.float32),
            "acc": np.asarray(batch.acc, np.float32),
        }

    # -- one RL step -----------------------------------------------------------------------------------------

    def step(self, batch: RLBatch) -> tuple[np.ndarray, dict[str, float]]:
        """Update the PRM on the step's responses as ``reward_model.model.update`` says and score them.

        ``before`` (verl's default): update, then score with the updated PRM; ``after``: score with the PRM as it
        was before the step (then update); ``none``: score only. The accuracies ``*_before`` are the PRM's before
        this step's update (on responses it has not trained on: the held-out measure), the others those of the
        scores returned.

        Args:
          batch: needs the ids / masks, ``acc`` ``[N]`` (outcome labels in [0, 1]) and ``group_ids``.

        Returns:
          ``(rm_scores, metrics)``: float32 ``[N, R]`` process rewards (after ``prime_norm``, 0 where masked);
          ``reward_model/dpo_loss``, ``grad_norm``, ``lr``, ``nonfinite_grad`` (update), ``reward_model/dpo_acc``,
          ``dpo_acc_abs``, ``dpo_acc_before``, ``dpo_acc_abs_before`` (:func:`jaxrl.algorithms.prime.
          prm_pairwise_accuracy` / ``prm_sign_accuracy``), ``reward_model/reward`` (mean sequence sum of the
          returned scores) and ``reward_model/raw_reward`` (mean ``sum_t q_t``).

        Raises:
          ValueError: ``batch.acc`` is not set.
        """
        if batch.acc is None:
            raise ValueError("the implicit PRM's step needs batch.acc (the outcome labels), which is not set")
        mask = batch.response_mask.astype(np.float32)
        acc = np.asarray(batch.acc, np.float32)
        ref = self.ref_log_probs(batch)
        q = np.asarray(implicit_log_ratio(self.log_probs(batch), ref, mask))
        metrics = {"reward_model/dpo_acc_before": prm_pairwise_accuracy(q.sum(-1), acc, batch.group_ids),
                   "reward_model/dpo_acc_abs_before": prm_sign_accuracy(q.sum(-1), acc)}
        if self.update_mode in ("before", "after"):
            metrics.update(self.run_updates(dataclasses.replace(batch, ref_log_probs=ref)))
            if self.update_mode == "before":
                q = np.asarray(implicit_log_ratio(self.log_probs(batch), ref, mask))
        elif self._tx is None:
            self.init_optimizer()
        scores = prime_norm(implicit_process_rewards(q, mask, beta=self.beta, granularity=self.granularity), self.norm)
        scores = np.asarray(scores, np.float32) * mask
        metrics.update({
            "reward_model/dpo_acc": prm_pairwise_accuracy(q.sum(-1), acc, batch.group_ids),
            "reward_model/dpo_acc_abs": prm_sign_accuracy(q.sum(-1), acc),
            "reward_model/reward": float(scores.sum(-1).mean()),
            "reward_model/raw_reward": float(q.sum(-1).mean()),
        })
        return scores, metrics
