"""The DPO role: a preference loss (:mod:`jaxrl.algorithms.preference`, by ``algorithm.dpo.loss_type``) on
chosen / rejected pairs, on the trained role's scaffolding (:class:`jaxrl.workers.trained_role.TrainedRole`).

A pair's two sequences go through the policy in one forward (rows ``[2m, ...]`` per micro-batch of ``m`` pairs);
their token log-probabilities summed over each response give ``log pi(y | x)``, and the frozen reference's
(precomputed by the caller, :class:`jaxrl.batch.PairBatch`'s ``ref_*_logps``) the log-ratios the loss takes.
The step's loss is the mean over its pairs: each micro-batch adds its pairs' losses over the step's pair count, so
accumulation is exact. Metrics use TRL's names: ``rewards/chosen`` / ``rewards/rejected`` (the implicit rewards
``beta x log-ratio``, means over pairs), ``rewards/accuracies`` (the fraction of pairs whose chosen reward is the
higher), ``rewards/margins``, ``logps/chosen`` / ``logps/rejected`` (the policy's sequence log-probabilities).

Used offline (``python -m jaxrl.dpo``: pairs from files, temperature 1) and online (``algorithm.dpo.enable`` in
``python -m jaxrl.train``: pairs from the step's samples, log-probabilities at the rollout temperature, as the
actor's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.algorithms import log_probs_from_logits, sequence_log_probs
from jaxrl.algorithms.registry import PREFERENCE_LOSSES
from jaxrl.config.batch_plan import RolePlan
from jaxrl.workers.actor import LogProbComputer, forward_response
from jaxrl.workers.trained_role import TrainedRole

__all__ = ["PreferenceWorker", "sequence_logps"]


def sequence_logps(log_prob: LogProbComputer, params, batch) -> np.ndarray:
    """``log pi(y | x)`` of every row of an :class:`~jaxrl.batch.RLBatch`: float32 ``[N]``, the response tokens'
    log-probabilities under ``params`` summed over ``response_mask``."""
    lp, _ = log_prob(params, batch)
    return np.asarray(sequence_log_probs(lp, batch.response_mask), np.float32)


class PreferenceWorker(TrainedRole):
    """The policy trained on preference pairs.

    Args:
      graphdef, params: ``nnx.split`` of the decoder.
      dpo_cfg: the ``algorithm.dpo`` section (``loss_type``, ``beta``, ``label_smoothing``; the loss's declared
        options are passed by name).
      plan: the batch sizes in pairs (a mini-batch of pairs per update, micro-batches of pairs per device);
        ``forward_rows`` is the rows (sequences) of a no-grad log-prob call.
      optim, grad_clip: the optimizer section (as :func:`jaxrl.workers.optim.make_optimizer` reads it) and the max
        global gradient norm.
      temperature: logits are divided by it (1 offline; the rollout temperature online).
      total_training_steps: the schedule's horizon.
      name: the metric prefix of the update's own metrics (``train`` offline, ``actor`` online); the loss is
        ``<name>/loss`` offline and ``actor/dpo_loss`` online.
      shuffle, seed: shuffle the pairs before cutting mini-batches (online, with several updates per step).
      mesh, rules: the train mesh and its rules (None = one device).

    Raises:
      ValueError: an unknown ``loss_type``; sizes that do not fit (see :class:`TrainedRole`).
    """

    def __init__(self, graphdef, params, dpo_cfg, *, plan: RolePlan, optim, grad_clip: float, temperature: float,
                 total_training_steps: int, name: str = "train", shuffle: bool = False, seed: int = 0, mesh=None,
                 rules=None):
        self.name = name
        super().__init__(graphdef, params, plan=plan, optim=optim, grad_clip=grad_clip, shuffle=shuffle,
                         total_training_steps=total_training_steps, seed=seed, mesh=mesh, rules=rules)
        entry = PREFERENCE_LOSSES.entry(dpo_cfg.loss_type)
        self._loss_fn = entry.load()
        self._loss_options = {o: getattr(dpo_cfg, o) for o in entry.options}
        self.beta = float(dpo_cfg.beta)
        self.temperature = float(temperature)
        self.loss_key = "train/loss" if name == "train" else f"{name}/dpo_loss"
        self.log_prob = LogProbComputer(self.graphdef, micro_batch_size=plan.forward_rows, temperature=temperature,
                                        mesh=mesh, rules=rules)
        # the reference's weights keep the per-layer layout (the trained ones may be stacked: jaxrl.models.scan_layout)
        self.ref_log_prob = self.log_prob if self.base_graphdef == self.graphdef else LogProbComputer(
            self.base_graphdef, micro_batch_size=plan.forward_rows, temperature=temperature, mesh=mesh, rules=rules)

    def minibatch_arrays(self, pairs) -> dict[str, np.ndarray]:
        """Per-pair arrays ``[M, 2, ...]`` (axis 1: chosen, rejected) of a :class:`~jaxrl.batch.PairBatch`
        with its reference log-probabilities filled."""
        if pairs.ref_chosen_logps is None or pairs.ref_rejected_logps is None:
            raise ValueError("the DPO update needs the reference's log-probabilities (PairBatch.ref_*_logps)")
        c, r = pairs.chosen, pairs.rejected
        stack = lambda a, b: np.stack([a, b], axis=1)  # noqa: E731
        return {
            "input_ids": stack(c.input_ids(), r.input_ids()),
            "positions": stack(c.positions(), r.positions()),
            "attention_mask": stack(c.attention_mask(), r.attention_mask()),
            "response_ids": stack(c.response_ids, r.response_ids),
            "response_mask": stack(c.response_mask, r.response_mask).astype(np.float32),
            "ref_logps": stack(pairs.ref_chosen_logps, pairs.ref_rejected_logps).astype(np.float32),
            "valid": np.ones(pairs.size, np.float32),  # 0 on the rows stack_micro pads a mini-batch with
        }

    def pair_losses(self, params, micro, prompt_width):
        """``(per-pair loss [m], policy sequence log-probs [m, 2])`` of a micro-batch of ``m`` pairs."""
        m = micro["input_ids"].shape[0]
        flat = lambda x: x.reshape((2 * m,) + x.shape[2:])  # noqa: E731  [m, 2, ...] -> rows 2i (chosen), 2i+1
        logits = forward_response(self.graphdef, params, flat(micro["input_ids"]), flat(micro["positions"]),
                                  flat(micro["attention_mask"]), prompt_width, self.temperature,
                                  self.activation_sharding)
        mask = flat(micro["response_mask"])
        logps = sequence_log_probs(log_probs_from_logits(logits, flat(micro["response_ids"])), mask).reshape(m, 2)
        lengths = jnp.sum(mask, axis=-1).reshape(m, 2)
        ratios = logps - micro["ref_logps"]
        per = self._loss_fn(ratios[:, 0], ratios[:, 1], beta=self.beta, chosen_lengths=lengths[:, 0],
                            rejected_lengths=lengths[:, 1], **self._loss_options)
        return per, logps

    def _micro_loss(self, params, micro, num_tokens, num_seqs, prompt_width, extra):
        per, logps = self.pair_losses(params, micro, prompt_width)
        valid = micro["valid"]
        mean = lambda x: jnp.sum(x * valid) / num_seqs  # noqa: E731  the step's mean over pairs, by shares
        loss = mean(per)
        lp = jax.lax.stop_gradient(logps)
        rewards = self.beta * (lp - micro["ref_logps"])
        metrics = {
            self.loss_key: loss,
            "rewards/chosen": mean(rewards[:, 0]),
            "rewards/rejected": mean(rewards[:, 1]),
            "rewards/accuracies": mean((rewards[:, 0] > rewards[:, 1]).astype(jnp.float32)),
            "rewards/margins": mean(rewards[:, 0] - rewards[:, 1]),
            "logps/chosen": mean(lp[:, 0]),
            "logps/rejected": mean(lp[:, 1]),
        }
        return loss, (metrics, {}, jnp.sum(micro["response_mask"]))

    def reference_logps(self, ref_params, pairs) -> None:
        """Fill ``pairs.ref_chosen_logps`` / ``ref_rejected_logps`` with ``ref_params``' sequence log-probs."""
        both = sequence_logps(self.ref_log_prob, ref_params, pairs.both())
        pairs.ref_chosen_logps, pairs.ref_rejected_logps = both[: pairs.size], both[pairs.size:]

    def update(self, pairs) -> dict[str, float]:
        """The optimizer update(s) on a :class:`~jaxrl.batch.PairBatch` with its reference log-probs; returns
        the loss and TRL's ``rewards/*`` / ``logps/*`` (means over the updates) and ``<name>/grad_norm``,
        ``<name>/nonfinite_grad``, ``<name>/lr``."""
        return self.run_updates(pairs)

    def evaluate(self, pairs) -> dict[str, float]:
        """The loss and the ``rewards/*`` / ``logps/*`` metrics of ``pairs`` under the current params, no update
        (validation); sums over pairs, so several batches combine by adding and dividing by their pair count."""
        both = sequence_logps(self.log_prob, self.params, pairs.both())
        c, r = both[: pairs.size], both[pairs.size:]
        lc = pairs.chosen.response_mask.sum(-1).astype(np.float32)
        lr = pairs.rejected.response_mask.sum(-1).astype(np.float32)
        rc, rr = c - pairs.ref_chosen_logps, r - pairs.ref_rejected_logps
        per = np.asarray(self._loss_fn(rc, rr, beta=self.beta, chosen_lengths=lc, rejected_lengths=lr,
                                       **self._loss_options))
        wc, wr = self.beta * rc, self.beta * rr
        return {"loss": float(per.sum()), "rewards/chosen": float(wc.sum()), "rewards/rejected": float(wr.sum()),
                "rewards/accuracies": float((wc > wr).sum()), "rewards/margins": float((wc - wr).sum()),
                "logps/chosen": float(c.sum()), "logps/rejected": float(r.sum())}
