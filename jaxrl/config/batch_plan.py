"""A run's batch arithmetic, derived once from the config: verl's sizes (in prompts) turned into rows.

verl counts ``data.train_batch_size`` and ``ppo_mini_batch_size`` in prompts and ``*_micro_batch_size_per_gpu``
in responses (rows). Every row count a role or a check needs is derived here, from :class:`BatchPlan.from_config`,
and read from the plan everywhere else (the actor, the critic, the trainer's construction, the loader's checks and
the mesh checks of :mod:`jaxrl.workers.placement`). No jax import.

What a ``*_micro_batch_size_per_gpu`` value means is decided in one function, :func:`micro_rows`: today the rows
of one micro-batch (on a device mesh, of one micro-batch on the whole mesh, split over its batch axes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

__all__ = ["BatchPlan", "RolePlan", "micro_rows"]


def micro_rows(per_gpu: Optional[int], fallback: int) -> int:
    """Rows of one micro-batch from a ``*_micro_batch_size_per_gpu`` value (the one place that reads them).

    Args:
      per_gpu: the configured value, or None (unset).
      fallback: the rows an unset value stands for (the schema documents each key's fallback).

    Returns:
      ``per_gpu`` rows (a micro-batch's rows on the whole train mesh; one device without a mesh), else ``fallback``.
    """
    return fallback if per_gpu is None else int(per_gpu)


@dataclasses.dataclass(frozen=True)
class RolePlan:
    """The batch sizes of one trained role (the actor or the critic), in rows (= responses).

    Attributes:
      section: the role's config section, e.g. ``"actor_rollout_ref.actor"`` (messages name keys with it).
      rollout_n: responses per prompt (``actor_rollout_ref.rollout.n``).
      rows_per_step: responses per RL step (``data.train_batch_size x rollout.n``).
      mini_batch_size: prompts per optimizer update (``<section>.ppo_mini_batch_size``).
      micro_batch_size_per_gpu: the configured update micro-batch (None = the whole mini-batch).
      micro_batch_rows: rows per forward/backward of the update.
      forward_key: the key of the no-grad forward's micro-batch (actor: the rollout's log-prob key; critic: its
        ``forward_micro_batch_size_per_gpu``).
      forward_rows: rows per no-grad forward call (log-probs / values).
      ppo_epochs: passes over each RL batch.
    """

    section: str
    rollout_n: int
    rows_per_step: int
    mini_batch_size: int
    micro_batch_size_per_gpu: Optional[int]
    micro_batch_rows: int
    forward_key: str
    forward_rows: int
    ppo_epochs: int

    @classmethod
    def derive(cls, section: str, *, rollout_n: int, rows_per_step: int, mini_batch_size: int,
               micro_batch_size_per_gpu: Optional[int], forward_key: str, forward_per_gpu: Optional[int],
               forward_fallback: Optional[int] = None, ppo_epochs: int = 1) -> "RolePlan":
        """The plan from the config values (unset micro-batches fall back as the schema documents: the update's to
        the mini-batch, the forward's to ``forward_fallback``, default the update micro-batch)."""
        mini_rows = int(mini_batch_size) * int(rollout_n)
        micro = micro_rows(micro_batch_size_per_gpu, mini_rows)
        forward = micro_rows(forward_per_gpu, micro if forward_fallback is None else forward_fallback)
        return cls(section=section, rollout_n=int(rollout_n), rows_per_step=int(rows_per_step),
                   mini_batch_size=int(mini_batch_size), micro_batch_size_per_gpu=micro_batch_size_per_gpu,
                   micro_batch_rows=micro, forward_key=forward_key, forward_rows=forward, ppo_epochs=int(ppo_epochs))

    @property
    def micro_key(self) -> str:
        """The config key of the update micro-batch."""
        return f"{self.section}.ppo_micro_batch_size_per_gpu"

    @property
    def mini_batch_rows(self) -> int:
        """Responses per optimizer update: ``ppo_mini_batch_size x rollout.n``."""
        return self.mini_batch_size * self.rollout_n

    @property
    def mini_batches_per_step(self) -> int:
        """Mini-batches one pass over a step's rows makes (the last one may be smaller, as in verl's FSDP workers)."""
        return math.ceil(self.rows_per_step / self.mini_batch_rows)

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per RL step: ``ppo_epochs x mini-batches`` (the learning-rate schedule's step)."""
        return self.ppo_epochs * self.mini_batches_per_step

    @property
    def micro_batches_per_mini(self) -> int:
        """Micro-batches of one mini-batch (``mini_batch_rows // micro_batch_rows``)."""
        return self.mini_batch_rows // self.micro_batch_rows

    def with_mini_batch_size(self, mini_batch_size: int) -> "RolePlan":
        """The same role with another ``ppo_mini_batch_size`` (an unset micro-batch follows it)."""
        mini_rows = int(mini_batch_size) * self.rollout_n
        micro = micro_rows(self.micro_batch_size_per_gpu, mini_rows)
        return dataclasses.replace(self, mini_batch_size=int(mini_batch_size), micro_batch_rows=micro)

    def check(self) -> None:
        """The role's own arithmetic: positive sizes and micro-batches that divide the mini-batch.

        Raises:
          ValueError: names the keys and values.
        """
        if self.mini_batch_size < 1 or self.ppo_epochs < 1 or self.rollout_n < 1:
            raise ValueError(f"{self.section}: ppo_mini_batch_size={self.mini_batch_size}, ppo_epochs="
                             f"{self.ppo_epochs} and rollout.n={self.rollout_n} must all be >= 1")
        if self.micro_batch_rows < 1 or self.mini_batch_rows % self.micro_batch_rows:
            raise ValueError(
                f"{self.section}.ppo_mini_batch_size*rollout.n = {self.mini_batch_rows} must be divisible by "
                f"{self.micro_key} = {self.micro_batch_rows}"
            )
        if self.forward_rows < 1:
            raise ValueError(f"{self.forward_key} must be >= 1, got {self.forward_rows}")


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Every batch size of a run, in rows.

    Attributes:
      rollout_n: responses per prompt.
      train_batch_size: prompts per RL step (``data.train_batch_size``).
      rows_per_step: responses per RL step, ``train_batch_size x rollout_n`` (the batch every phase sees).
      gen_rows_per_round: responses per generation round, ``data.gen_batch_size x rollout_n`` (DAPO dynamic
        sampling; unset = ``rows_per_step``).
      actor: the actor's plan (its ``forward_rows`` = ``rollout.log_prob_micro_batch_size_per_gpu``, null = a
        whole step).
      critic: the critic's plan (``critic.*``; unset mini-batch / epochs follow the actor's, an unset forward
        micro-batch the critic's update micro-batch). Derived for every config; a run builds the critic only for
        an estimator that reads values.
      ref_log_prob_rows: rows per reference log-prob call (``ref.log_prob_micro_batch_size_per_gpu``, null = the
        actor's log-prob micro-batch).
      reward_model_rows: rows per reward-model call (``reward_model.micro_batch_size_per_gpu``; None = decided per
        call by the reward model worker: the whole batch, padded to the mesh's batch shards).
    """

    rollout_n: int
    train_batch_size: int
    rows_per_step: int
    gen_rows_per_round: int
    actor: RolePlan
    critic: RolePlan
    ref_log_prob_rows: int
    reward_model_rows: Optional[int]

    @classmethod
    def from_config(cls, cfg) -> "BatchPlan":
        """Derive the plan from a :class:`~jaxrl.config.schema.JaxRLConfig` (loaded or built from the schema
        dataclasses: the critic's unset sizes are resolved here as the loader fills them)."""
        arr = cfg.actor_rollout_ref
        n = int(arr.rollout.n)
        rows = int(cfg.data.train_batch_size) * n
        actor_cfg, critic_cfg = arr.actor, cfg.critic
        log_prob_key = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
        actor = RolePlan.derive(
            "actor_rollout_ref.actor", rollout_n=n, rows_per_step=rows,
            mini_batch_size=actor_cfg.ppo_mini_batch_size,
            micro_batch_size_per_gpu=actor_cfg.ppo_micro_batch_size_per_gpu,
            forward_key=log_prob_key, forward_per_gpu=arr.rollout.log_prob_micro_batch_size_per_gpu,
            forward_fallback=rows, ppo_epochs=actor_cfg.ppo_epochs,
        )
        critic_mini = critic_cfg.ppo_mini_batch_size or actor_cfg.ppo_mini_batch_size
        critic_epochs = critic_cfg.ppo_epochs or actor_cfg.ppo_epochs
        critic = RolePlan.derive(
            "critic", rollout_n=n, rows_per_step=rows, mini_batch_size=critic_mini,
            micro_batch_size_per_gpu=critic_cfg.ppo_micro_batch_size_per_gpu,
            forward_key="critic.forward_micro_batch_size_per_gpu",
            forward_per_gpu=critic_cfg.forward_micro_batch_size_per_gpu, ppo_epochs=critic_epochs,
        )
        return cls(
            rollout_n=n, train_batch_size=int(cfg.data.train_batch_size), rows_per_step=rows,
            gen_rows_per_round=int(cfg.data.gen_batch_size or cfg.data.train_batch_size) * n, actor=actor,
            critic=critic, ref_log_prob_rows=micro_rows(arr.ref.log_prob_micro_batch_size_per_gpu, actor.forward_rows),
            reward_model_rows=cfg.reward_model.micro_batch_size_per_gpu,
        )

    def micro_batches(self, *, critic: bool, reward_model: bool) -> list[tuple[str, int]]:
        """``(config key, rows)`` of every micro-batch a jitted phase runs (what must split over a mesh's batch
        axes): the actor's update and log-prob calls, the reference's, the critic's update and value calls
        (``critic``) and the reward model's (``reward_model``, when its size is set)."""
        out = [
            (self.actor.micro_key, self.actor.micro_batch_rows),
            (self.actor.forward_key, self.actor.forward_rows),
            ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", self.ref_log_prob_rows),
        ]
        if reward_model and self.reward_model_rows is not None:
            out.append(("reward_model.micro_batch_size_per_gpu", self.reward_model_rows))
        if critic:
            out += [(self.critic.micro_key, self.critic.micro_batch_rows),
                    (self.critic.forward_key, self.critic.forward_rows)]
        return out
