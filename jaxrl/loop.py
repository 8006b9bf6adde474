"""The training loop every trainer shares: resume, validation and checkpoint cadence, SIGTERM, the non-finite guard.

:class:`TrainingLoop.fit` is the loop of :class:`jaxrl.trainer.Trainer` (RL) and of
:class:`jaxrl.offline.trainer.OfflineTrainer` (SFT, DPO); a subclass supplies one training step
(:meth:`TrainingLoop.train_step`), validation (:meth:`TrainingLoop.validate`), checkpoint save / resume and the
metric shown on the progress bar. The components object ``c`` it runs over provides ``cfg.trainer``
(``val_before_train``, ``test_freq``, ``save_freq``, ``max_nonfinite_steps``), ``total_training_steps``, ``logger``
(:class:`jaxrl.metrics.MetricsLogger`) and ``store`` (:class:`jaxrl.checkpoint.CheckpointStore`).

Also the two ends of every run: :func:`setup_run_logging` and :func:`export_final_model` (the trained policy as a
Hugging Face folder, ``<run>/hf_model``; with LoRA also the adapter in PEFT's format, ``<run>/lora_adapter``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

from jaxrl import distributed
from jaxrl.metrics import peak_rss_bytes, phase_peaks, timed
from jaxrl.run_checkpoint import check_final_checkpoint, latest_checkpoint_text

log = logging.getLogger("jaxrl")

__all__ = ["NonFiniteTrainingError", "TrainingLoop", "export_final_model", "setup_run_logging"]


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient (``trainer.max_nonfinite_steps``)."""


class TrainingLoop:
    """``fit()`` over the hooks a trainer implements.

    Attributes:
      step: the last completed training step (0 before the first).
      nonfinite_in_a_row: consecutive steps whose update was skipped for a non-finite loss / gradient.
    """

    progress_key = ""  # the metric on the progress bar (shown when the step's metrics hold it)
    progress_label = ""
    # metrics counting a step's skipped (non-finite) updates; > 0 in any of them = a non-finite step
    nonfinite_keys: tuple[str, ...] = ()

    def __init__(self, c):
        self.c = c
        self.step = 0
        self.nonfinite_in_a_row = 0

    # -- what a trainer provides --------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One training step; returns its metrics."""
        raise NotImplementedError

    def validate(self) -> dict[str, float]:
        """Validation metrics (empty when the run has no validation set)."""
        raise NotImplementedError

    def has_validation(self) -> bool:
        """True when the run has a validation set."""
        raise NotImplementedError

    def save_checkpoint(self) -> bool:
        """Save the training state at :attr:`step` (a failed save is logged; :meth:`fit` checks the final one)."""
        raise NotImplementedError

    def resume(self) -> bool:
        """Restore the checkpoint ``trainer.resume_mode`` names into the run (and set :attr:`step`); True if one
        was restored."""
        raise NotImplementedError

    def after_log(self, metrics: dict[str, float]) -> None:
        """Called after each step's metrics are logged (e.g. to redraw a plot)."""

    def validation_due(self) -> bool:
        """Whether :attr:`step` validates: every ``trainer.test_freq`` steps and at the last step (``test_freq``
        -1: never)."""
        freq = self.c.cfg.trainer.test_freq
        return freq > 0 and (self.step % freq == 0 or self.step == self.c.total_training_steps)

    # -- the loop --------------------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        """Train to ``total_training_steps``: resume if a checkpoint says so, validate every ``test_freq`` steps
        and at the end, checkpoint every ``save_freq`` steps and at the end, stop cleanly on SIGTERM.

        Raises:
          NonFiniteTrainingError: ``trainer.max_nonfinite_steps`` consecutive steps were non-finite.
          jaxrl.checkpoint.CheckpointSaveError: the run's final checkpoint is not on disk.
        """
        from tqdm import tqdm

        c, cfg = self.c, self.c.cfg
        total = c.total_training_steps
        resumed = self.resume()
        if not resumed:
            c.logger.truncate_after(-1)  # a fresh run starts a fresh metrics.jsonl in a reused folder
        if resumed and self.step >= total:
            log.info("the checkpoint is already at step %d of %d: nothing left to train", self.step, total)
        if cfg.trainer.val_before_train and self.has_validation() and not resumed:
            t: dict[str, float] = {}
            with timed("testing", t):
                val = self.validate()
            c.logger.log(0, {**val, "timing_s/testing": t["testing"], **self._phase_peaks()})
        last: dict[str, float] = {}
        bar = tqdm(total=total, initial=self.step, desc="jaxrl", unit="step", dynamic_ncols=True,
                   disable=not distributed.is_primary())  # one console
        with _sigterm_flag() as stop:
            try:
                stopped = False  # SIGTERM, agreed by every process before each step
                while self.step < total:
                    if distributed.any_process(stop.is_set()):
                        stopped = True
                        break
                    self.step += 1
                    last = self._step_validate_log()
                    self._check_finite(last)
                    if self._save_due():
                        with phase_peaks.phase("save_checkpoint"):  # its peak: in the next step's row
                            self.save_checkpoint()
                    if self.progress_key in last:
                        bar.set_postfix({self.progress_label or self.progress_key: f"{last[self.progress_key]:.3f}"})
                    bar.update(1)
                stopped = stopped or distributed.any_process(stop.is_set())
                final = self.step if self._save_due() else None  # the save that ends the run, if any
                if stopped:
                    log.warning("SIGTERM: stopping after step %d", self.step)
                    if final is None:
                        self.save_checkpoint()
                        final = self.step
                check_final_checkpoint(c.store, final)
                if stopped:
                    log.warning("rerun the same command to resume from step %d", self.step)
            finally:
                bar.close()
                c.store.close()  # waits for an asynchronous save (a failure is logged), ends orbax's threads
        return last

    def _step_validate_log(self) -> dict[str, float]:
        """One training step, then validation when due, then logging."""
        c = self.c
        metrics = self.train_step()
        metrics["training/global_step"] = self.step
        if self.has_validation() and self.validation_due():
            t: dict[str, float] = {}
            with timed("testing", t):
                metrics.update(self.validate())
            metrics["timing_s/testing"] = t["testing"]
            metrics.update(self._phase_peaks())
        c.logger.log(self.step, metrics)
        self.after_log(metrics)
        return metrics

    def _phase_peaks(self) -> dict[str, float]:
        """The validation's ``perf/cpu_memory_peak_gb/testing`` (:data:`jaxrl.metrics.phase_peaks`) and the
        process's peak ``perf/cpu_memory_peak_gb`` read again after it, for this row; none in a hybrid run, whose
        driver's memory is not the run's (``Components.memory_metrics``)."""
        peaks = phase_peaks.take()
        if getattr(self.c, "memory_metrics", None) is not None:
            return {}
        return {**peaks, "perf/cpu_memory_peak_gb": peak_rss_bytes() / 1024**3}

    def _check_finite(self, metrics: dict) -> None:
        """Count consecutive steps whose update was skipped for a non-finite loss/gradient; abort past the limit."""
        bad = any(metrics.get(k, 0) > 0 for k in self.nonfinite_keys)
        bad = distributed.any_process(bad)  # one counter for the whole world: every process stops at the same step
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if bad else 0
        if bad:
            log.warning("step %d: non-finite loss or gradient, update skipped (%d in a row)",
                        self.step, self.nonfinite_in_a_row)
        limit = self.c.cfg.trainer.max_nonfinite_steps
        if self.nonfinite_in_a_row >= limit:
            raise NonFiniteTrainingError(
                f"{self.nonfinite_in_a_row} consecutive steps ending at step {self.step} had a non-finite loss or "
                f"gradient (trainer.max_nonfinite_steps={limit}); the non-finite updates were skipped (params and "
                f"optimizer state kept). Check the rewards and the learning rate; "
                f"{latest_checkpoint_text(self.c.store)}"
            )

    def _save_due(self) -> bool:
        freq = self.c.cfg.trainer.save_freq
        return freq > 0 and (self.step % freq == 0 or self.step == self.c.total_training_steps)


@contextlib.contextmanager
def _sigterm_flag():
    """A ``threading.Event`` set by SIGTERM while the block runs (main thread only; elsewhere never set)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, previous)


def setup_run_logging() -> None:
    """The run's log format on stderr (INFO), without jax's platform and orbax's per-save noise."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU found" noise on CPU/GPU
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save progress lines


def export_final_model(c, base_model_path: str | None = None) -> None:
    """Write the trained policy as a Hugging Face model folder, ``c.out_dir / "hf_model"``, with ``c.tokenizer``;
    loadable by transformers and ``jaxrl.generate --model``. The weights are ``c.actor.merged_params()`` over
    ``c.actor.base_graphdef`` (:class:`jaxrl.workers.trained_role.TrainedRole`): the params themselves for full
    fine-tuning; with LoRA (``c.actor.lora`` set) the base with the adapters merged in (``W + (alpha / r) A B``),
    and the adapters alone also go to ``c.out_dir / "lora_adapter"`` in PEFT's format
    (:func:`jaxrl.models.lora.save_peft_adapter`, ``base_model_name_or_path`` = ``base_model_path``).

    With several processes every one calls it (the params are gathered from all); only the primary writes.
    """
    from flax import nnx

    from jaxrl.models.hf import save_hf

    actor = c.actor
    export_dir = c.out_dir / "hf_model"
    params = distributed.to_host(actor.merged_params())  # several processes: gathered from all (every one calls it)
    distributed.run_on_primary(save_hf, nnx.merge(actor.base_graphdef, params), c.model_cfg, export_dir,
                               tokenizer=c.tokenizer, share=False)
    log.info("final model exported to %s (load with transformers or jaxrl.generate --model)", export_dir)
    if actor.lora is None:
        return
    from jaxrl.models.lora import save_peft_adapter

    adapter_dir = c.out_dir / "lora_adapter"
    adapters = distributed.to_host(actor.params)
    distributed.run_on_primary(save_peft_adapter, adapters, actor.lora, adapter_dir,
                               num_layers=c.model_cfg.num_hidden_layers, base_model_name_or_path=base_model_path,
                               share=False)
    log.info("LoRA adapter exported to %s (PEFT format: peft.PeftModel.from_pretrained(base, dir))", adapter_dir)
