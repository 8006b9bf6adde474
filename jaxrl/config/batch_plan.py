"""A run's batch arithmetic, derived once from the config: verl's sizes (in prompts) turned into rows.

verl counts ``data.train_batch_size`` and ``ppo_mini_batch_size`` in prompts and ``*_micro_batch_size_per_gpu``
in responses (rows). Every row count a role or a check needs is derived here, from :class:`BatchPlan.from_config`,
and read from the plan everywhere else (the actor, the critic, the reference, the reward model, the trainer's
construction, the loader's checks and the mesh checks of :mod:`jaxrl.workers.placement`). No jax import.

What a ``*_micro_batch_size_per_gpu`` value means is decided in one function, :func:`micro_rows`: as in verl, the
rows each data-parallel device takes per micro-batch. On a device mesh the data-parallel devices are the train
mesh's batch shards (the axes the ``"batch"`` sharding rule splits rows over, ``data x fsdp`` by default), so one
micro-batch on the mesh is ``value x batch shards`` rows; without a mesh there is one device and the value is the
micro-batch. verl's FSDP workers do the same arithmetic per rank (``fsdp_workers.py``: ``ppo_mini_batch_size *=
rollout.n; ppo_mini_batch_size //= world_size // ulysses_sp`` and a micro-batch of ``*_per_gpu`` rows on each rank,
which must divide that per-rank mini-batch). ``ppo_mini_batch_size`` keeps verl's user-facing meaning, prompts per
optimizer update over all devices: the plan's mini-batch rows are global, and each device's share is
``mini-batch rows / batch shards`` (:attr:`RolePlan.per_device_mini_batch_rows`).

verl's token budgets (``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``, ``log_prob_*``, the critic's) are per
device too (:func:`token_budgets`); the plan keeps them per device (``RolePlan.max_token_len``,
``forward_max_token_len``, ``BatchPlan.ref_max_token_len``) and the planner (:mod:`jaxrl.workers.seqlen`) gives every
micro-batch at most that many real tokens on each of the ``batch_shards`` devices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

__all__ = ["BatchPlan", "MicroBatch", "RolePlan", "micro_rows", "online_dpo_plan", "token_budgets"]


def micro_rows(per_gpu: Optional[int], fallback: int, batch_shards: int = 1) -> int:
    """Rows of one micro-batch from a ``*_micro_batch_size_per_gpu`` value (the one place that reads them).

    Args:
      per_gpu: the configured value: rows per data-parallel device (verl's meaning), or None (unset).
      fallback: the rows (over all devices) an unset value stands for (the schema documents each key's fallback).
      batch_shards: the data-parallel devices: the train mesh's batch shards (``data x fsdp`` under the default
        rules); 1 without a mesh.

    Returns:
      ``per_gpu x batch_shards`` rows (one micro-batch over all data-parallel devices), else ``fallback``.
    """
    return fallback if per_gpu is None else int(per_gpu) * int(batch_shards)


def token_budgets(cfg) -> dict[str, Optional[int]]:
    """verl's dynamic batch size: ``{budget key: real tokens per data-parallel device, or None when its switch is
    off}`` for the actor's update, the rollout's log-prob forward, the reference's and the critic's update and
    forward. Unset (null) values follow verl's defaults: the log-prob and reference switches / budgets the actor's
    (``use_dynamic_bsz``, ``ppo_max_token_len_per_gpu``), the critic's switch the actor's and its forward budget its
    update budget (the loader fills them the same way; a config built from the schema dataclasses resolves here).
    """
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    actor_on, actor_len = bool(arr.actor.use_dynamic_bsz), arr.actor.ppo_max_token_len_per_gpu

    def pick(value, fallback):
        return fallback if value is None else value

    lp_on = pick(arr.rollout.log_prob_use_dynamic_bsz, actor_on)
    ref_on = pick(arr.ref.log_prob_use_dynamic_bsz, actor_on)
    critic_on = pick(critic.use_dynamic_bsz, actor_on)
    critic_fwd = pick(critic.forward_max_token_len_per_gpu, critic.ppo_max_token_len_per_gpu)
    return {
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": int(actor_len) if actor_on else None,
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": (
            int(pick(arr.rollout.log_prob_max_token_len_per_gpu, actor_len)) if lp_on else None),
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": (
            int(pick(arr.ref.log_prob_max_token_len_per_gpu, actor_len)) if ref_on else None),
        "critic.ppo_max_token_len_per_gpu": int(critic.ppo_max_token_len_per_gpu) if critic_on else None,
        "critic.forward_max_token_len_per_gpu": int(critic_fwd) if critic_on else None,
    }


class MicroBatch(NamedTuple):
    """One micro-batch size of a run, as a jitted phase runs it.

    Attributes:
      key: the config key that sets it.
      per_device: the key's value (rows per data-parallel device), None when unset.
      rows: rows of one call over all data-parallel devices (``per_device x batch shards``, or the fallback).
      unset_means: what an unset value stands for, for messages (e.g. ``"the whole mini-batch"``).
    """

    key: str
    per_device: Optional[int]
    rows: int
    unset_means: str


@dataclasses.dataclass(frozen=True)
class RolePlan:
    """The batch sizes of one trained role (the actor or the critic), in rows (= responses).

    Attributes:
      section: the role's config section, e.g. ``"actor_rollout_ref.actor"`` (messages name keys with it).
      rollout_n: responses per prompt (``actor_rollout_ref.rollout.n``).
      rows_per_step: responses per RL step (``data.train_batch_size x rollout.n``).
      mini_batch_size: prompts per optimizer update over all devices (``<section>.ppo_mini_batch_size``).
      micro_batch_size_per_gpu: the configured update micro-batch, rows per data-parallel device (None = the
        whole mini-batch).
      micro_batch_rows: rows per forward/backward of the update over all data-parallel devices
        (``micro_batch_size_per_gpu x batch_shards``).
      forward_key: the key of the no-grad forward's micro-batch (actor: the rollout's log-prob key; critic: its
        ``forward_micro_batch_size_per_gpu``).
      forward_per_gpu: that key's value (rows per device), None when unset.
      forward_rows: rows per no-grad forward call (log-probs / values) over all data-parallel devices.
      ppo_epochs: passes over each RL batch.
      batch_shards: the data-parallel devices the plan was derived for (the train mesh's batch shards; 1 = no mesh).
      remove_padding: the role's forward / backward run on packed rows (``model.use_remove_padding``, or
        ``actor.use_prefix_grouper``).
      share_prompts: those packed rows lay each distinct prompt once for all its responses
        (``actor.use_prefix_grouper``; :mod:`jaxrl.workers.packing`).
      max_token_len: the update's token budget, real tokens per data-parallel device per micro-batch
        (``ppo_max_token_len_per_gpu`` when ``use_dynamic_bsz``), None = micro-batches of ``micro_batch_rows``.
      forward_max_token_len: the no-grad forward's token budget per device (actor: the rollout's
        ``log_prob_max_token_len_per_gpu`` when ``log_prob_use_dynamic_bsz``; critic:
        ``forward_max_token_len_per_gpu`` when ``use_dynamic_bsz``), None = calls of ``forward_rows``.
      max_token_key, forward_max_token_key: the config keys of the two budgets (messages).
      mini_batch_key, micro_batch_key: the config keys of the mini-batch and the update micro-batch when they are
        not ``<section>.ppo_mini_batch_size`` / ``ppo_micro_batch_size_per_gpu`` (the offline trainers':
        ``data.train_batch_size`` / ``data.micro_batch_size_per_gpu``), for messages.
    """

    section: str
    rollout_n: int
    rows_per_step: int
    mini_batch_size: int
    micro_batch_size_per_gpu: Optional[int]
    micro_batch_rows: int
    forward_key: str
    forward_per_gpu: Optional[int]
    forward_rows: int
    ppo_epochs: int
    batch_shards: int = 1
    remove_padding: bool = False
    share_prompts: bool = False
    max_token_len: Optional[int] = None
    forward_max_token_len: Optional[int] = None
    max_token_key: str = ""
    forward_max_token_key: str = ""
    mini_batch_key: str = ""
    micro_batch_key: str = ""

    @classmethod
    def derive(cls, section: str, *, rollout_n: int, rows_per_step: int, mini_batch_size: int,
               micro_batch_size_per_gpu: Optional[int], forward_key: str, forward_per_gpu: Optional[int],
               forward_fallback: Optional[int] = None, ppo_epochs: int = 1, batch_shards: int = 1,
               remove_padding: bool = False, share_prompts: bool = False, max_token_len: Optional[int] = None,
               forward_max_token_len: Optional[int] = None, max_token_key: str = "",
               forward_max_token_key: str = "", mini_batch_key: str = "", micro_batch_key: str = "") -> "RolePlan":
        """The plan from the config values on ``batch_shards`` data-parallel devices (set micro-batches are per
        device, :func:`micro_rows`; unset ones fall back as the schema documents: the update's to the whole
        mini-batch, the forward's to ``forward_fallback`` rows, default the update micro-batch)."""
        mini_rows = int(mini_batch_size) * int(rollout_n)
        micro = micro_rows(micro_batch_size_per_gpu, mini_rows, batch_shards)
        forward = micro_rows(forward_per_gpu, micro if forward_fallback is None else forward_fallback, batch_shards)
        return cls(section=section, rollout_n=int(rollout_n), rows_per_step=int(rows_per_step),
                   mini_batch_size=int(mini_batch_size), micro_batch_size_per_gpu=micro_batch_size_per_gpu,
                   micro_batch_rows=micro, forward_key=forward_key, forward_per_gpu=forward_per_gpu,
                   forward_rows=forward, ppo_epochs=int(ppo_epochs), batch_shards=int(batch_shards),
                   remove_padding=bool(remove_padding or share_prompts), share_prompts=bool(share_prompts),
                   max_token_len=max_token_len,
                   forward_max_token_len=forward_max_token_len, max_token_key=max_token_key,
                   forward_max_token_key=forward_max_token_key, mini_batch_key=mini_batch_key,
                   micro_batch_key=micro_batch_key)

    @property
    def micro_key(self) -> str:
        """The config key of the update micro-batch."""
        return self.micro_batch_key or f"{self.section}.ppo_micro_batch_size_per_gpu"

    @property
    def mini_key(self) -> str:
        """The config key of the mini-batch, with the factor that makes it rows (messages)."""
        return self.mini_batch_key or f"{self.section}.ppo_mini_batch_size*rollout.n"

    @property
    def mini_batch_rows(self) -> int:
        """Responses per optimizer update: ``ppo_mini_batch_size x rollout.n``."""
        return self.mini_batch_size * self.rollout_n

    @property
    def per_device_mini_batch_rows(self) -> int:
        """Responses of one mini-batch on each data-parallel device: ``mini_batch_rows / batch_shards`` (verl's
        normalised ``ppo_mini_batch_size``; :meth:`check` requires it to be whole)."""
        return self.mini_batch_rows // self.batch_shards

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
        micro = micro_rows(self.micro_batch_size_per_gpu, mini_rows, self.batch_shards)
        return dataclasses.replace(self, mini_batch_size=int(mini_batch_size), micro_batch_rows=micro)

    def check(self) -> None:
        """The role's own arithmetic: positive sizes, a mini-batch that splits over the data-parallel devices and
        a per-device micro-batch that divides each device's share of it (verl's ``fsdp_workers`` asserts).

        Raises:
          ValueError: names the keys and values (per device, the data-parallel size and the global rows).
        """
        if self.mini_batch_size < 1 or self.ppo_epochs < 1 or self.rollout_n < 1 or self.batch_shards < 1:
            raise ValueError(f"{self.section}: the mini-batch ({self.mini_key}={self.mini_batch_size}), ppo_epochs="
                             f"{self.ppo_epochs}, rollout.n={self.rollout_n} and the data-parallel size "
                             f"{self.batch_shards} must all be >= 1")
        dp = self.batch_shards
        if self.mini_batch_rows % dp:
            raise ValueError(
                f"{self.mini_key} = {self.mini_batch_rows} {'rows' if self.mini_batch_key else 'responses'} per "
                "mini-batch "
                f"do not split over the {dp} data-parallel devices; valid: a multiple of {dp}"
            )
        for key, budget in ((self.max_token_key, self.max_token_len),
                            (self.forward_max_token_key, self.forward_max_token_len)):
            if budget is not None and budget < 1:
                raise ValueError(f"{key}={budget} must be >= 1 (real tokens per device per micro-batch)")
        if self.forward_rows < 1:
            raise ValueError(f"{self.forward_key} must be >= 1, got {self.forward_rows}")
        per_gpu = self.micro_batch_size_per_gpu
        if self.max_token_len is not None:
            return  # token-budget micro-batches: the update's row count is not used (verl ignores it too)
        if self.micro_batch_rows < 1 or self.mini_batch_rows % self.micro_batch_rows:
            where = "" if dp == 1 else (f" / {dp} data-parallel devices = {self.per_device_mini_batch_rows} per "
                                        "device")
            mesh = "" if dp == 1 else f" (a micro-batch of {per_gpu} x {dp} = {self.micro_batch_rows} rows)"
            raise ValueError(
                f"{self.mini_key} = {self.mini_batch_rows}{where} must be divisible by "
                f"{self.micro_key} = {per_gpu if per_gpu is not None else self.micro_batch_rows}{mesh}"
            )


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Every batch size of a run, in rows over all data-parallel devices.

    Attributes:
      rollout_n: responses per prompt.
      train_batch_size: prompts per RL step (``data.train_batch_size``).
      rows_per_step: responses per RL step, ``train_batch_size x rollout_n`` (the batch every phase sees).
      gen_rows_per_round: responses per generation round, ``data.gen_batch_size x rollout_n`` (DAPO dynamic
        sampling; unset = ``rows_per_step``).
      actor: the actor's plan (its ``forward_rows`` = ``rollout.log_prob_micro_batch_size_per_gpu`` x batch
        shards, null = a whole step).
      critic: the critic's plan (``critic.*``; unset mini-batch / epochs follow the actor's, an unset forward
        micro-batch the critic's update micro-batch). Derived for every config; a run builds the critic only for
        an estimator that reads values.
      ref_log_prob_rows: rows per reference log-prob call (``ref.log_prob_micro_batch_size_per_gpu`` x batch
        shards, null = the actor's log-prob micro-batch).
      reward_model_rows: rows per reward-model call (``reward_model.micro_batch_size_per_gpu`` x batch shards;
        None = decided per call by the reward model worker: the whole batch, padded to the mesh's batch shards).
      batch_shards: the data-parallel devices the plan was derived for: the train mesh's batch shards (``data x
        fsdp`` under the default rules), 1 without a mesh.
      ref_log_prob_per_gpu, reward_model_per_gpu: the configured per-device values behind ``ref_log_prob_rows``
        and ``reward_model_rows`` (None when unset), for messages.
      ref_max_token_len: the reference forward's token budget per device (``ref.log_prob_max_token_len_per_gpu``
        when ``ref.log_prob_use_dynamic_bsz``), None = calls of ``ref_log_prob_rows``.
    """

    rollout_n: int
    train_batch_size: int
    rows_per_step: int
    gen_rows_per_round: int
    actor: RolePlan
    critic: RolePlan
    ref_log_prob_rows: int
    reward_model_rows: Optional[int]
    batch_shards: int = 1
    ref_log_prob_per_gpu: Optional[int] = None
    reward_model_per_gpu: Optional[int] = None
    ref_max_token_len: Optional[int] = None

    @classmethod
    def from_config(cls, cfg, *, batch_shards: int = 1) -> "BatchPlan":
        """Derive the plan from a :class:`~jaxrl.config.schema.JaxRLConfig` (loaded or built from the schema
        dataclasses: the critic's unset sizes are resolved here as the loader fills them).

        Args:
          cfg: the config.
          batch_shards: the data-parallel devices the ``*_micro_batch_size_per_gpu`` values are per: the train
            mesh's batch shards (:attr:`jaxrl.workers.placement.Placement.batch_shards`), 1 without a mesh.

        Raises:
          ValueError: ``batch_shards < 1``.
        """
        if int(batch_shards) < 1:
            raise ValueError(f"batch_shards={batch_shards} must be >= 1 (1 = no mesh)")
        dp = int(batch_shards)
        arr = cfg.actor_rollout_ref
        n = int(arr.rollout.n)
        rows = int(cfg.data.train_batch_size) * n
        actor_cfg, critic_cfg = arr.actor, cfg.critic
        log_prob_key = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
        budgets = token_budgets(cfg)
        actor = RolePlan.derive(
            "actor_rollout_ref.actor", rollout_n=n, rows_per_step=rows,
            mini_batch_size=actor_cfg.ppo_mini_batch_size,
            micro_batch_size_per_gpu=actor_cfg.ppo_micro_batch_size_per_gpu,
            forward_key=log_prob_key, forward_per_gpu=arr.rollout.log_prob_micro_batch_size_per_gpu,
            forward_fallback=rows, ppo_epochs=actor_cfg.ppo_epochs, batch_shards=dp,
            remove_padding=arr.model.use_remove_padding, share_prompts=actor_cfg.use_prefix_grouper,
            max_token_len=budgets["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"],
            forward_max_token_len=budgets["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"],
            max_token_key="actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
            forward_max_token_key="actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        )
        critic_pad = critic_cfg.model.use_remove_padding
        critic_pad = arr.model.use_remove_padding if critic_pad is None else critic_pad
        critic_mini = critic_cfg.ppo_mini_batch_size or actor_cfg.ppo_mini_batch_size
        critic_epochs = critic_cfg.ppo_epochs or actor_cfg.ppo_epochs
        critic = RolePlan.derive(
            "critic", rollout_n=n, rows_per_step=rows, mini_batch_size=critic_mini,
            micro_batch_size_per_gpu=critic_cfg.ppo_micro_batch_size_per_gpu,
            forward_key="critic.forward_micro_batch_size_per_gpu",
            forward_per_gpu=critic_cfg.forward_micro_batch_size_per_gpu, ppo_epochs=critic_epochs, batch_shards=dp,
            remove_padding=critic_pad, max_token_len=budgets["critic.ppo_max_token_len_per_gpu"],
            forward_max_token_len=budgets["critic.forward_max_token_len_per_gpu"],
            max_token_key="critic.ppo_max_token_len_per_gpu", forward_max_token_key="critic.forward_max_token_len_per_gpu",
        )
        rm, ref = cfg.reward_model.micro_batch_size_per_gpu, arr.ref.log_prob_micro_batch_size_per_gpu
        return cls(
            rollout_n=n, train_batch_size=int(cfg.data.train_batch_size), rows_per_step=rows,
            gen_rows_per_round=int(cfg.data.gen_batch_size or cfg.data.train_batch_size) * n, actor=actor,
            critic=critic,
            ref_log_prob_rows=micro_rows(ref, actor.forward_rows, dp),
            reward_model_rows=None if rm is None else micro_rows(rm, 0, dp), batch_shards=dp,
            ref_log_prob_per_gpu=ref, reward_model_per_gpu=rm,
            ref_max_token_len=budgets["actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"],
        )

    def micro_batches(self, *, critic: bool, reward_model: bool) -> list[MicroBatch]:
        """Every fixed-size micro-batch a jitted phase runs (what must split over a mesh's batch axes): the actor's
        update and log-prob calls, the reference's, the critic's update and value calls (``critic``) and the reward
        model's (``reward_model``, when its size is set); passes under a token budget are left out."""
        a, c = self.actor, self.critic
        out = [
            MicroBatch(a.micro_key, a.micro_batch_size_per_gpu, a.micro_batch_rows, "the whole mini-batch"),
            MicroBatch(a.forward_key, a.forward_per_gpu, a.forward_rows, "all responses of a step in one call"),
            MicroBatch("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", self.ref_log_prob_per_gpu,
                       self.ref_log_prob_rows, f"the actor's log-prob micro-batch ({a.forward_key})"),
        ]
        # a pass under a token budget (use_dynamic_bsz) does not use its row count
        unused = {a.micro_key} if a.max_token_len is not None else set()
        unused |= {a.forward_key} if a.forward_max_token_len is not None else set()
        if self.ref_max_token_len is not None:
            unused.add("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu")
        if c.max_token_len is not None:
            unused |= {c.micro_key, c.forward_key}
        if reward_model and self.reward_model_rows is not None:
            out.append(MicroBatch("reward_model.micro_batch_size_per_gpu", self.reward_model_per_gpu,
                                  self.reward_model_rows, "the whole batch"))
        if critic:
            out += [MicroBatch(c.micro_key, c.micro_batch_size_per_gpu, c.micro_batch_rows, "the whole mini-batch"),
                    MicroBatch(c.forward_key, c.forward_per_gpu, c.forward_rows,
                               f"the critic's update micro-batch ({c.micro_key})")]
        return [mb for mb in out if mb.key not in unused]


def online_dpo_plan(cfg, *, batch_shards: int = 1) -> RolePlan:
    """Online DPO's actor plan (``algorithm.dpo.enable``), in pairs: ``ppo_mini_batch_size`` pairs per update (a
    prompt gives at most one pair), ``ppo_micro_batch_size_per_gpu`` pairs per data-parallel device per micro-batch
    (each pair is two sequences); the no-grad forward keeps the rollout's log-prob micro-batch (rows)."""
    a, arr = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref
    rows = int(cfg.data.train_batch_size) * int(arr.rollout.n)
    return RolePlan.derive(
        "actor_rollout_ref.actor", rollout_n=1, rows_per_step=cfg.data.train_batch_size,
        mini_batch_size=a.ppo_mini_batch_size, micro_batch_size_per_gpu=a.ppo_micro_batch_size_per_gpu,
        forward_key="actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        forward_per_gpu=arr.rollout.log_prob_micro_batch_size_per_gpu, forward_fallback=rows, ppo_epochs=a.ppo_epochs,
        batch_shards=batch_shards, mini_batch_key="actor_rollout_ref.actor.ppo_mini_batch_size (pairs)",
    )


def prime_plan(cfg, *, batch_shards: int = 1) -> RolePlan:
    """PRIME's implicit PRM plan (``algorithm.adv_estimator=prime``), in responses as verl's recipe counts them:
    ``reward_model.mini_batch_size`` responses per optimizer update (null: the value of
    ``actor.ppo_mini_batch_size``), ``reward_model.micro_batch_size_per_gpu`` responses per data-parallel device per
    micro-batch (null: the whole mini-batch) and per no-grad forward (null: a whole step); one pass per step."""
    rm = cfg.reward_model
    rows = int(cfg.data.train_batch_size) * int(cfg.actor_rollout_ref.rollout.n)
    mini = rm.mini_batch_size if rm.mini_batch_size is not None else cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    return RolePlan.derive(
        "reward_model", rollout_n=1, rows_per_step=rows, mini_batch_size=mini,
        micro_batch_size_per_gpu=rm.micro_batch_size_per_gpu, forward_key="reward_model.micro_batch_size_per_gpu",
        forward_per_gpu=rm.micro_batch_size_per_gpu, forward_fallback=rows, ppo_epochs=1, batch_shards=batch_shards,
        mini_batch_key="reward_model.mini_batch_size (responses)", micro_batch_key="reward_model.micro_batch_size_per_gpu",
    )
