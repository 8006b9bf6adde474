"""verl's per-device batch sizes on a mesh, through the run's real construction (``jaxrl.build.build``): PPO's
quickstart (stories260K, actor + reference + critic) on a 4-device train mesh (``trainer.mesh.fsdp=4``, split
placement: the sampler on the other 4 of the 8 simulated devices). As in verl's FSDP workers, each of the 4
data-parallel devices takes ``*_micro_batch_size_per_gpu`` rows, so one micro-batch of a role is that x 4 rows.
The built roles' sizes are asserted for every key; the actor's update and log-prob calls also run (the critic's
update and value calls use the same TrainedRole loop and chunking on their plan; tests/workers/test_sharded_training.py
checks sharded results equal single-device ones)."""

from __future__ import annotations

import numpy as np

from jaxrl.build import build
from jaxrl.config import load_config
from jaxrl.workers import actor as actor_module
from jaxrl.workers.microbatch import pad_rows, stack_micro
from tests.helpers import tiny_batch

ROWS = 16  # data.train_batch_size=4 x rollout.n=4: one mini-batch of 16 responses, 4 per device


def _spy(fn, calls):
    """``fn`` that records the leading shape of what it returns (the arrays a jitted phase is called with)."""
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        calls.append(out[0]["input_ids"].shape[:2] if isinstance(out, tuple) else out.shape[0])
        return out
    return wrapped


def test_per_gpu_sizes_mean_rows_per_device_on_four_devices(shared, tmp_path, monkeypatch):
    cfg = load_config("configs/ppo_quickstart.yaml", [
        "trainer.placement=split", "trainer.rollout_devices=4", "trainer.mesh.fsdp=4",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=5",
        "critic.ppo_micro_batch_size_per_gpu=1", "critic.forward_micro_batch_size_per_gpu=4",
        f"trainer.default_local_dir={tmp_path}", "trainer.logger=[jsonl]",
    ])
    c = build(cfg)
    try:
        assert dict(c.placement.train_mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 1}
        assert c.placement.batch_shards == 4
        # the plans the roles use: per-device value x 4 data-parallel devices
        assert (c.actor.plan.micro_batch_rows, c.actor.plan.per_device_mini_batch_rows) == (8, 4)
        assert (c.actor.log_prob.micro_batch_size, c.ref.log_prob.micro_batch_size) == (12, 20)
        assert (c.critic.plan.micro_batch_rows, c.critic.forward_batch_rows) == (4, 16)  # compute_values' chunks

        batch, rng = tiny_batch(ROWS, seed=0, prompt_width=8, response_width=6, vocab_size=c.model_cfg.vocab_size)
        mask = batch.response_mask.astype(np.float32)
        batch.advantages = (rng.normal(size=mask.shape) * mask).astype(np.float32)

        # log-prob forward: 16 rows in calls of 3 x 4 = 12 rows (the last padded)
        calls: list = []
        monkeypatch.setattr(actor_module, "pad_rows", _spy(pad_rows, calls))
        batch.old_log_probs, _ = c.actor.compute_log_probs(batch)
        assert calls == [12] * 8  # 2 calls x (ids, positions, mask, response ids)
        batch.ref_log_probs = batch.old_log_probs  # the reference runs the same LogProbComputer (20 rows, above)

        # the update: one mini-batch of 16 rows stacked as 2 micro-batches of 2 x 4 = 8 rows (verl: 4 rows per
        # device, 2 per micro-batch); the critic's update runs the same TrainedRole loop on its plan (4 rows, above)
        stacked: list = []
        c.actor.stack_micro = _spy(stack_micro, stacked)
        metrics = c.actor.update(batch)
        assert stacked == [(2, 8)] and np.isfinite(metrics["actor/pg_loss"]) and c.actor.num_updates == 1
    finally:
        c.store.close()
        c.lock.release()
