"""The SFT role: next-token cross-entropy on the loss-masked tokens (verl's ``fsdp_sft_trainer``), on the trained
role's scaffolding (:class:`jaxrl.workers.trained_role.TrainedRole`: mesh placement, AdamW and its schedule,
micro-batch gradient accumulation, checkpoint state).

The loss of a step is the token mean over the whole step (``data.train_batch_size`` sequences): each micro-batch
adds ``-sum(mask * log p(token)) / num_tokens`` with ``num_tokens`` the step's target tokens, so accumulation over
micro-batches gives exactly the full-batch loss and gradient (verl averages per-micro-batch means instead, which
weighs a token by its micro-batch's size). Sequences arrive as :class:`jaxrl.batch.RLBatch` rows in the layout of
:mod:`jaxrl.data.offline` (a one-token prompt, the rest as the response, ``response_mask`` = the targets).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxrl.algorithms import log_probs_from_logits, masked_sum
from jaxrl.batch import RLBatch
from jaxrl.config.batch_plan import RolePlan
from jaxrl.workers.actor import LogProbComputer, forward_response
from jaxrl.workers.trained_role import TrainedRole

__all__ = ["SFTWorker", "sft_loss"]


def sft_loss(log_probs, mask, num_tokens):
    """Negative log-likelihood of the target tokens, normalised by ``num_tokens``.

    Args:
      log_probs: ``[B, R]`` float log-probabilities of each response token.
      mask: ``[B, R]`` 0/1, 1 on target tokens.
      num_tokens: the normaliser (the step's target tokens; the micro-batch's own for a plain mean).

    Returns:
      float32 scalar ``-sum(mask * log_probs) / num_tokens``.
    """
    return -masked_sum(jnp.asarray(log_probs, jnp.float32), mask) / num_tokens


class SFTWorker(TrainedRole):
    """The model fine-tuned on demonstrations.

    Args:
      graphdef, params: ``nnx.split`` of the decoder.
      plan: the batch sizes (one mini-batch = one step of ``data.train_batch_size`` sequences, its micro-batch
        ``data.micro_batch_size_per_gpu`` per data-parallel device; ``forward_rows`` the validation batch).
      optim: the ``optim`` section, as :func:`jaxrl.workers.optim.make_optimizer` reads it.
      grad_clip: max global gradient norm (``optim.clip_grad``; <= 0 = none).
      total_training_steps: the schedule's horizon.
      mesh, rules: the train mesh and its rules (None = one device).

    Metrics (verl's names): ``train/loss``, ``train/grad_norm``, ``train/lr``, ``train/nonfinite_grad``.
    """

    name = "train"

    def __init__(self, graphdef, params, *, plan: RolePlan, optim, grad_clip: float, total_training_steps: int,
                 seed: int = 0, mesh=None, rules=None):
        super().__init__(graphdef, params, plan=plan, optim=optim, grad_clip=grad_clip, shuffle=False,
                         total_training_steps=total_training_steps, seed=seed, mesh=mesh, rules=rules)
        self.log_prob = LogProbComputer(self.graphdef, micro_batch_size=plan.forward_rows, temperature=1.0, mesh=mesh,
                                        rules=rules)

    def minibatch_arrays(self, batch: RLBatch) -> dict[str, np.ndarray]:
        return batch.sequence_arrays()

    def _micro_loss(self, params, micro, num_tokens, num_seqs, prompt_width, extra):
        logits = forward_response(self.graphdef, params, micro["input_ids"], micro["positions"],
                                  micro["attention_mask"], prompt_width, 1.0, self.activation_sharding)
        mask = micro["response_mask"]
        loss = sft_loss(log_probs_from_logits(logits, micro["response_ids"]), mask, num_tokens)
        return loss, ({"train/loss": loss}, {}, jnp.sum(mask))

    def update(self, batch: RLBatch) -> dict[str, float]:
        """One optimizer step on ``batch`` (``data.train_batch_size`` sequences); returns ``train/loss`` (the step's
        token-mean NLL), ``train/grad_norm``, ``train/nonfinite_grad`` and ``train/lr``."""
        return self.run_updates(batch)

    def nll(self, batch: RLBatch) -> tuple[float, float]:
        """``(summed negative log-likelihood, target tokens)`` of ``batch`` under the current params (no gradient;
        validation). The loss of several batches is the sum of the first over the sum of the second."""
        lp, _ = self.log_prob(self.params, batch)
        mask = batch.response_mask.astype(np.float32)
        return float(-(lp * mask).sum()), float(mask.sum())
