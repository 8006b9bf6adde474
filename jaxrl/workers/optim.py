"""Optimizer and learning-rate schedule for the actor (and later the critic), built from optax.

The schedule follows verl's semantics: warm-up and decay are counted in *training steps* (one RL step),
not in optimizer updates, so ``lr_warmup_steps_ratio`` means the same thing as in verl whatever the
number of mini-batches per step.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import optax


def lr_schedule(
    *,
    lr: float,
    total_training_steps: int,
    updates_per_step: int,
    lr_warmup_steps: int = -1,
    lr_warmup_steps_ratio: float = 0.0,
    lr_scheduler_type: str = "constant",
    min_lr_ratio: float = 0.0,
):
    """Learning rate as a function of the optimizer-update count.

    Linear warm-up from 0 to ``lr`` over the warm-up training steps (``lr_warmup_steps`` if >= 0, else
    ``ceil(lr_warmup_steps_ratio * total_training_steps)``), then constant or cosine decay to
    ``min_lr_ratio * lr`` at ``total_training_steps`` (verl ``get_constant_schedule_with_warmup`` /
    ``get_cosine_schedule_with_warmup``).

    Raises:
      ValueError: unknown ``lr_scheduler_type`` (valid: ``constant``, ``cosine``).
    """
    if lr_scheduler_type not in ("constant", "cosine"):
        raise ValueError(f"lr_scheduler_type={lr_scheduler_type!r}; valid: 'constant', 'cosine'")
    warmup = lr_warmup_steps if lr_warmup_steps >= 0 else int(math.ceil(lr_warmup_steps_ratio * total_training_steps))
    per_step = max(1, updates_per_step)
    total = max(1, total_training_steps)

    def schedule(count):
        step = count // per_step  # training step this update belongs to (0-based)
        warm = lr * (step + 1) / max(1, warmup)
        if lr_scheduler_type == "constant":
            after = jnp.asarray(lr, jnp.float32)
        else:
            progress = jnp.clip((step - warmup) / max(1, total - warmup), 0.0, 1.0)
            cos = 0.5 * (1.0 + jnp.cos(math.pi * progress))
            after = lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cos)
        return jnp.where(step < warmup, warm, after)

    return schedule


def make_optimizer(optim_cfg, *, grad_clip: float, total_training_steps: int, updates_per_step: int):
    """AdamW with global-norm gradient clipping and the schedule above.

    Args:
      optim_cfg: the ``actor_rollout_ref.actor.optim`` config section (lr, betas, eps, weight_decay,
        lr_warmup_steps, lr_warmup_steps_ratio, lr_scheduler_type, min_lr_ratio).
      grad_clip: max global gradient norm (``<= 0`` disables clipping).
      total_training_steps: RL steps in the run (for warm-up ratio and decay).
      updates_per_step: optimizer updates per RL step (``ppo_epochs x mini-batches``).

    Returns:
      ``(optax.GradientTransformation, schedule)``.
    """
    schedule = lr_schedule(
        lr=optim_cfg.lr,
        total_training_steps=total_training_steps,
        updates_per_step=updates_per_step,
        lr_warmup_steps=optim_cfg.lr_warmup_steps,
        lr_warmup_steps_ratio=optim_cfg.lr_warmup_steps_ratio,
        lr_scheduler_type=optim_cfg.lr_scheduler_type,
        min_lr_ratio=optim_cfg.min_lr_ratio,
    )
    b1, b2 = optim_cfg.betas
    parts = []
    if grad_clip and grad_clip > 0:
        parts.append(optax.clip_by_global_norm(grad_clip))
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay))
    return optax.chain(*parts), schedule
