"""The offline trainers' controller: one SFT or DPO step per batch, validation loss, checkpoints, export.

The loop is the RL trainer's (:class:`jaxrl.loop.TrainingLoop`: resume, ``trainer.test_freq`` / ``save_freq``,
SIGTERM, the non-finite guard); a step is::

    batch = train_data.next_batch()                  data.train_batch_size sequences (SFT) or pairs (DPO)
    ref   = reference log-probs of both responses    DPO only: the frozen initial policy, no gradient
    update                                           one optimizer step, micro-batch gradient accumulation

Validation (as verl's SFT trainer: at ``trainer.test_freq`` and at the last step, and before the first step with
``trainer.val_before_train``) logs ``val/loss`` (SFT: the token-mean NLL of the validation set; DPO: the mean
preference loss, with ``val/rewards/*`` and ``val/logps/*``). A checkpoint holds what the RL trainer's does (the
trained role as ``actor``, the data position and a fingerprint of the data and model:
:class:`OfflineCheckpoints`), so ``python -m jaxrl.export`` reads it; the final model is written to
``<trainer.default_local_dir>/hf_model``.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from jaxrl.compilation_cache import use_compilation_cache
from jaxrl.host_memory import release_free_memory, set_up_host_memory
from jaxrl.loop import TrainingLoop, export_final_model, setup_run_logging
from jaxrl.metrics import compile_clock, memory_metrics, phase_peaks, timed
from jaxrl.offline.build import OfflineComponents, build_offline
from jaxrl.run_checkpoint import RunCheckpoints

log = logging.getLogger("jaxrl")

__all__ = ["OfflineCheckpoints", "OfflineTrainer", "run_offline"]


class OfflineCheckpoints(RunCheckpoints):
    """:class:`RunCheckpoints` of an offline run: its fingerprint's data part names the offline config's keys; it has
    no LoRA settings."""

    def data_fingerprint(self) -> tuple[dict, dict]:
        c, d = self.c, self.c.cfg.data
        state = c.train_data.get_state()
        unit = "sequences" if c.kind == "sft" else "pairs"
        data = {
            "data.train_batch_size": state["batch_size"], "data.seed": state["seed"], "data.shuffle": state["shuffle"],
            f"data.num_{unit}": state["num_rows"], f"data.{unit}_sha256": c.train_data.prompts_digest(),
            "data.width": c.train_data.width,
        }
        context = {"data.train_files": d.train_files, "data.train_max_samples": d.train_max_samples,
                   "data.max_length": d.max_length, "data.truncation": d.truncation,
                   "data.chat_template": d.chat_template, "model.partial_pretrain": c.cfg.model.partial_pretrain,
                   "model.tokenizer_path": c.cfg.model.tokenizer_path}
        return data, context

    def settings_fingerprint(self) -> dict:
        """Empty: the offline trainers are full fine-tuning (LoRA is refused by :mod:`jaxrl.config.offline_compat`)."""
        return {}


class OfflineTrainer(TrainingLoop):
    """Runs SFT or DPO over :class:`~jaxrl.offline.build.OfflineComponents`."""

    progress_key, progress_label = "train/loss", "loss"
    nonfinite_keys = ("train/nonfinite_grad",)

    def __init__(self, c: OfflineComponents):
        super().__init__(c)
        self.checkpoints = OfflineCheckpoints(c)
        self._val_pairs = None  # DPO: the validation batches with their (fixed) reference log-probs

    # -- one step ----------------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        c = self.c
        t: dict[str, float] = {}
        compile_clock.take()  # from here: this step's compiles
        with timed("step", t):
            batch = c.train_data.next_batch()
            if c.kind == "dpo":
                with timed("ref", t):
                    c.actor.reference_logps(c.ref_params, batch)
            with timed("update", t):
                metrics = c.actor.update(batch)
        rows = batch.both() if c.kind == "dpo" else batch
        n_tokens = int(rows.attention_mask().sum())
        metrics.update({f"timing_s/{k}": v for k, v in t.items()})
        metrics["perf/total_num_tokens"] = n_tokens
        metrics["perf/throughput"] = n_tokens / max(t["step"], 1e-9)
        metrics.update(compile_clock.take())
        release_free_memory()  # the step's freed buffers (and a finished async save's host copy) back to the OS
        metrics.update({**memory_metrics(), **phase_peaks.take()})
        metrics["training/epoch"] = c.train_data.epoch
        return metrics

    # -- validation ---------------------------------------------------------------------------------------------

    def has_validation(self) -> bool:
        return bool(self.c.val_items)

    def validation_due(self) -> bool:
        """verl's SFT trainer: at the last step, and every ``trainer.test_freq`` steps when that is > 0."""
        freq = self.c.cfg.trainer.test_freq
        return self.step == self.c.total_training_steps or (freq > 0 and self.step % freq == 0)

    def _val_batches(self):
        from jaxrl.data.offline import iter_batches

        c = self.c
        rows = max(c.actor.plan.forward_rows, 1) * 8  # several forward calls per batch (the role splits them)
        return iter_batches(c.val_items, rows, c.val_width, c.train_data.pad_id)

    def validate(self) -> dict[str, float]:
        c = self.c
        if c.kind == "sft":
            nll = tokens = 0.0
            for batch in self._val_batches():
                a, b = c.actor.nll(batch)
                nll, tokens = nll + a, tokens + b
            return {"val/loss": nll / max(tokens, 1.0)}
        if self._val_pairs is None:  # the reference is frozen: its log-probs are computed once
            self._val_pairs = list(self._val_batches())
            for pairs in self._val_pairs:
                c.actor.reference_logps(c.ref_params, pairs)
        sums: dict[str, float] = {}
        for pairs in self._val_pairs:
            for k, v in c.actor.evaluate(pairs).items():
                sums[k] = sums.get(k, 0.0) + v
        n = float(sum(p.size for p in self._val_pairs))
        return {f"val/{k}": v / n for k, v in sums.items()}

    # -- checkpoints --------------------------------------------------------------------------------------------

    def save_checkpoint(self) -> bool:
        return self.checkpoints.save_checkpoint(self.step)

    def resume(self) -> bool:
        resumed = self.checkpoints.resume()
        if resumed is None:
            return False
        self.step = resumed.step
        self.c.logger.truncate_after(resumed.step)
        log.info("resumed from %s at step %d", resumed.path, resumed.step)
        return True


def run_offline(cfg, kind: str) -> dict[str, float]:
    """Build the run, train, export the final model; returns the last metrics (what ``python -m jaxrl.sft`` /
    ``jaxrl.dpo`` call). Raises what :func:`~jaxrl.offline.build.build_offline` and
    :meth:`~jaxrl.loop.TrainingLoop.fit` raise."""
    setup_run_logging()
    t0 = time.perf_counter()
    use_compilation_cache(cfg.trainer.jax_compilation_cache_dir)  # before the first compile
    import jax

    # before any buffer: freed large buffers and a compile's freed memory go back to the OS (jaxrl.host_memory)
    set_up_host_memory(jax.monitoring.register_event_duration_secs_listener)
    c = build_offline(cfg, kind)
    try:
        log.info("%s run: %d steps of %d %s, output in %s", kind, c.total_training_steps, cfg.data.train_batch_size,
                 "sequences" if kind == "sft" else "pairs", c.out_dir)
        try:
            last = OfflineTrainer(c).fit()
        finally:
            c.logger.close()
        export_final_model(c)
        log.info("done in %.1f s", time.perf_counter() - t0)
        return {k: v for k, v in last.items() if np.isscalar(v)}
    finally:
        c.store.close()
        if c.lock is not None:
            c.lock.release()
