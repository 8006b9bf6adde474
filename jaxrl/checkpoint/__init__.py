"""Checkpoint store: asynchronous, atomic training checkpoints on top of ``orbax.checkpoint``.

On-disk layout (verl's ``global_step_{N}`` folders under ``trainer.default_local_dir``)::

    <directory>/                         the run's checkpoint root
      tokenizer/                         written once per run (save_pretrained), read by jaxrl.export
      global_step_10/                    one complete checkpoint (orbax CheckpointManager step folder)
        actor.params/  actor.opt_state/  one orbax item (StandardSave pytree, OCDBT) per role/part
        critic.params/ critic.opt_state/ (present only when the run has a critic)
        meta/metadata                    JSON: step, data_state, rng, kl_ctrl, num_updates, model, fingerprint
        _CHECKPOINT_METADATA, commit_success.txt   orbax bookkeeping
      global_step_20.orbax-checkpoint-tmp-<ts>/    a save in progress or interrupted: never listed;
                                                   a writable store removes it before its first save
      global_step_8.corrupt-<ts>/                  a checkpoint found unreadable on resume, moved aside (kept)
      global_step_12.superseded-<ts>/              a checkpoint of an abandoned trajectory (a fresh start or a
                                                   resume from an older step), moved aside (kept)

Atomicity is orbax's: each step is written into a ``<name>.orbax-checkpoint-tmp-<ts>`` folder and renamed to
``global_step_<N>`` only after every item (arrays and the JSON meta) has been written, so a killed process
never leaves a folder that :meth:`CheckpointStore.steps` reports as complete; a failed save removes its
temporary folder at once. Pruning (``max_to_keep``) deletes old steps only after the new one is complete.
Folders moved aside keep their step in the name but never match ``global_step_<N>``: they are not listed,
not resumed from, not pruned and never deleted by the store.

Failures: every save is attempted on its own. Before writing, :meth:`CheckpointStore.save` checks the free space
on the checkpoint filesystem against the bytes the save needs (:func:`required_bytes`) and refuses a save that
cannot fit, naming both numbers; an asynchronous save's failure is logged and recorded
(:attr:`CheckpointStore.save_errors`) when the next save starts, never raised into it. On resume a checkpoint
whose meta or arrays cannot be read is moved aside and the previous one is used; a checkpoint that is readable
but was written by an incompatible configuration (:class:`CheckpointIncompatibleError`) is never moved.

Scope: a single process (one host). Corruption detection covers unreadable/truncated/missing files and bad
metadata, not silent bit flips inside array data (there are no per-array checksums).

Modules: :mod:`~jaxrl.checkpoint.store` (:class:`CheckpointStore`: listing, saving, closing) ·
:mod:`~jaxrl.checkpoint.restore` (reading, fit checks) · :mod:`~jaxrl.checkpoint.corrupt` (moving checkpoints
aside) · :mod:`~jaxrl.checkpoint.resume` (:func:`find_resume_checkpoint`) · :mod:`~jaxrl.checkpoint.layout` (names,
finalized steps, sizes) · :mod:`~jaxrl.checkpoint.errors`. Import from the package: ``from jaxrl.checkpoint import
CheckpointStore``. Nothing here imports jax or orbax at import time (``jaxrl.train`` reads the run folder before
jax loads).
"""

from __future__ import annotations

from jaxrl.checkpoint.errors import (
    CheckpointError,
    CheckpointIncompatibleError,
    CheckpointRestoreError,
    CheckpointSaveError,
)
from jaxrl.checkpoint.layout import (
    META_ITEM,
    RESUME_MODES,
    STEP_PREFIX,
    TOKENIZER_DIRNAME,
    latest_complete_step,
    max_to_keep_from_config,
    model_meta,
    parse_step_dir,
    required_bytes,
    step_dir,
)
from jaxrl.checkpoint.resume import find_resume_checkpoint
from jaxrl.checkpoint.store import CheckpointStore

__all__ = [
    "META_ITEM",
    "RESUME_MODES",
    "STEP_PREFIX",
    "TOKENIZER_DIRNAME",
    "CheckpointError",
    "CheckpointIncompatibleError",
    "CheckpointRestoreError",
    "CheckpointSaveError",
    "CheckpointStore",
    "find_resume_checkpoint",
    "latest_complete_step",
    "max_to_keep_from_config",
    "model_meta",
    "parse_step_dir",
    "required_bytes",
    "step_dir",
]
