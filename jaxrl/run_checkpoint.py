"""A run's checkpoint: what it holds, whether one fits this run, saving it and resuming from it.

The trainer decides *when* (``trainer.save_freq``, the end, SIGTERM, the start of :meth:`jaxrl.trainer.Trainer.fit`);
:class:`RunCheckpoints` decides *what*: each trained role's :meth:`state` (arrays + JSON meta), the data
iterator's position, the KL controller and the model info :mod:`jaxrl.export` needs, stored by a
:class:`jaxrl.checkpoint.CheckpointStore` in the layout ``docs/architecture.md`` (Checkpoint layout) describes::

    arrays  {"actor": {"params", "opt_state"}, "critic": {...},          one orbax item per <role>.<part>
             "reward_model": {...} (PRIME's implicit PRM)}
    meta    {"step", "data_state", "kl_ctrl", "actor": {"num_updates", "rng"}, "model", "critic": {...},
             "reward_model": {...}, "fingerprint"}                          JSON
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

log = logging.getLogger("jaxrl")


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What :meth:`RunCheckpoints.resume` restored beyond the roles and the data position."""

    step: int  # the training step the checkpoint was saved after
    kl_ctrl_value: float | None  # the KL controller's coefficient (its target/horizon stay this run's config); None
    # when the run has no KL controller (the offline trainers)
    path: Path  # the checkpoint folder
    meta: dict = dataclasses.field(default_factory=dict)  # the checkpoint's whole meta (e.g. "async_rollout")


class RunCheckpoints:
    """Saving and restoring the training state of the run :class:`jaxrl.build.Components` describes.

    Reads ``c.actor`` / ``c.critic`` (``state()`` / ``load_state()``), ``c.train_data`` (``get_state`` /
    ``set_state`` / ``prompts_digest``), ``c.store``, ``c.resume_from``, ``c.out_dir``, ``c.model_meta`` and
    ``c.cfg``.
    """

    def __init__(self, c):
        self.c = c
        self._fingerprint: dict | None = None  # see fingerprint()

    def roles(self) -> dict:
        """The trained roles, by the name their checkpoint items carry: ``actor`` (and ``critic``, and PRIME's
        implicit PRM ``reward_model``)."""
        c = self.c
        roles = {"actor": c.actor}
        if c.critic is not None:
            roles["critic"] = c.critic
        if getattr(c, "prm", None) is not None:  # the offline trainers' components have no PRM
            roles["reward_model"] = c.prm
        return roles

    def state_arrays(self) -> dict:
        """The device state a checkpoint holds: params and optimizer states of every trained role."""
        return {name: role.state()[0] for name, role in self.roles().items()}

    def state_meta(self, step: int, kl_ctrl=None, extra: dict | None = None, roles: dict | None = None) -> dict:
        """The host state a checkpoint holds (JSON): step, data position, RNGs, KL controller (when the run has
        one), model info, and ``extra`` (the async pipeline's ``{"async_rollout": state}``, whose ``data_state`` is
        then the run's data position: the iterator has run ahead to batches that are generated again on resume).
        ``roles``: each role's meta when already taken (``{name: role.state()[1]}``), else taken now."""
        c = self.c
        if roles is None:
            roles = {name: role.state()[1] for name, role in self.roles().items()}
        pipeline = (extra or {}).get("async_rollout")
        data_state = pipeline["data_state"] if pipeline else c.train_data.get_state()
        meta = {"step": step, "data_state": data_state, **(extra or {})}
        if kl_ctrl is not None:
            meta["kl_ctrl"] = {k: float(v) for k, v in kl_ctrl._asdict().items()}
        meta.update({"actor": roles["actor"], "model": c.model_meta})
        for name in ("critic", "reward_model"):
            if name in roles:
                meta[name] = roles[name]
        meta["fingerprint"] = self.fingerprint()
        return meta

    def fingerprint(self) -> dict:
        """What a checkpoint of this run needs in a run that resumes it (:mod:`jaxrl.fingerprint`): the model
        config, trained roles, array shapes/dtypes and the data settings the iterator position depends on.
        Constant over a run (computed once)."""
        if self._fingerprint is None:
            from jaxrl.fingerprint import fingerprint

            arrays = self.state_arrays()
            data, context = self.data_fingerprint()
            self._fingerprint = fingerprint(model=self.c.model_meta, roles=list(arrays), arrays=arrays, data=data,
                                            context=context, settings=self.settings_fingerprint())
        return self._fingerprint

    def data_fingerprint(self) -> tuple[dict, dict]:
        """``(data, context)`` of :func:`jaxrl.fingerprint.fingerprint`: the settings the data-iterator position
        depends on (compared on resume) and the config values that explain a change of them (reported only)."""
        c, d = self.c, self.c.cfg.data
        state = c.train_data.get_state()
        data = {
            self._batch_key(): state["batch_size"], "data.seed": state["seed"], "data.shuffle": state["shuffle"],
            "data.drop_last": state["drop_last"], "data.num_prompts": state["num_rows"],
            "data.prompts_sha256": c.train_data.prompts_digest(),
        }
        model = c.cfg.actor_rollout_ref.model
        context = {
            "data.train_files": d.train_files, "data.train_max_samples": d.train_max_samples,
            "data.max_prompt_length": d.max_prompt_length,
            "data.filter_overlong_prompts": d.filter_overlong_prompts,
            "data.truncation": d.truncation, "data.prompt_key": d.prompt_key,
            "actor_rollout_ref.model.path": model.path,
            "actor_rollout_ref.model.tokenizer_path": model.tokenizer_path,
        }
        return data, context

    def settings_fingerprint(self) -> dict:
        """The other settings the saved arrays depend on (``settings`` of :func:`jaxrl.fingerprint.fingerprint`,
        compared on resume): LoRA's ``<section>.lora_rank`` / ``lora_alpha`` / ``target_modules`` /
        ``exclude_modules`` of ``actor_rollout_ref.model`` (and ``critic.model`` with a critic) where LoRA is on;
        empty without LoRA, so full fine-tuning fingerprints are unchanged."""
        c = self.c
        settings = {}
        sections = [("actor_rollout_ref.model", c.cfg.actor_rollout_ref.model)]
        if c.critic is not None:
            sections.append(("critic.model", c.cfg.critic.model))
        staleness = getattr(getattr(c.cfg, "async_training", None), "staleness", 0)
        if staleness:  # the checkpoint holds the batches generated ahead (absent: synchronous fingerprints unchanged)
            settings["async_training.staleness"] = staleness
        if getattr(c, "prm", None) is not None:  # PRIME: the PRM's and its reference's model files
            m = c.cfg.reward_model.model
            settings.update({"reward_model.model.path": m.path, "reward_model.model.ref_path": m.ref_path})
        for prefix, section in sections:
            if getattr(section, "lora_rank", 0):
                settings.update({f"{prefix}.lora_rank": section.lora_rank,
                                 f"{prefix}.lora_alpha": section.lora_alpha,
                                 f"{prefix}.target_modules": section.target_modules,
                                 f"{prefix}.exclude_modules": getattr(section, "exclude_modules", None)})
        return settings

    def _batch_key(self) -> str:
        """The config key that sets the prompt pipeline's batch size: ``data.gen_batch_size`` under DAPO dynamic
        sampling when it is set, else ``data.train_batch_size`` (so toggling dynamic sampling alone keeps it)."""
        cfg = self.c.cfg
        dynamic = cfg.algorithm.filter_groups.enable and cfg.data.gen_batch_size
        return "data.gen_batch_size" if dynamic else "data.train_batch_size"

    def _check_resumable(self, step: int, meta: dict) -> None:
        """Raise CheckpointIncompatibleError when checkpoint ``step`` was written by an incompatible configuration.

        Checkpoints with a fingerprint are compared on all of it; older ones on what their meta holds (model
        config, roles, data-iterator settings; the store then compares the array shapes orbax stored).
        """
        from jaxrl.checkpoint import CheckpointIncompatibleError
        from jaxrl.fingerprint import differences, legacy_fingerprint, summary

        now = self.fingerprint()
        saved = meta.get("fingerprint")
        if isinstance(saved, dict):
            diffs = differences(saved, now)
        else:
            diffs = differences(legacy_fingerprint(meta, array_signatures=None, batch_key=self._batch_key()), now,
                                only_common=True)
        if diffs:  # the store fills in the checkpoint's path
            raise CheckpointIncompatibleError(f"written by another configuration: {summary(diffs)}", step=step,
                                              path=None, differences=diffs)

    def save_checkpoint(self, step: int, kl_ctrl=None, extra: dict | None = None) -> bool:
        """Save the full training state as checkpoint ``step`` (with ``kl_ctrl``, the RL run's KL controller, and
        ``extra`` host state, see :meth:`state_meta`); a failed save is logged, training goes on.

        Every call attempts its own save (an earlier asynchronous failure does not block it); whether the run's
        final checkpoint made it to disk is checked by :func:`check_final_checkpoint`.

        Returns:
          True when the save started; False when it was refused (logged) or the step is already on disk.
        """
        from jaxrl.checkpoint import CheckpointSaveError

        try:
            # one state() per role (a hybrid run's roles copy theirs from the train group on each call)
            states = {name: role.state() for name, role in self.roles().items()}
            return self.c.store.save(step, arrays={n: s[0] for n, s in states.items()},
                                     meta=self.state_meta(step, kl_ctrl, extra, roles={n: s[1] for n, s in
                                                                                      states.items()}))
        except CheckpointSaveError as e:
            log.error("checkpoint not saved (training state intact, earlier checkpoints kept): %s", e)
            return False

    def resume(self) -> Resumed | None:
        """Restore the checkpoint ``trainer.resume_mode`` names (``Components.resume_from``) into the roles and the
        data pipeline; None on a fresh start.

        The candidate's fingerprint is compared with this run's before any array is read; a corrupt newest
        checkpoint in the run folder is moved aside and the previous one used. Checkpoints in the run folder
        that this run would otherwise collide with (a fresh start, or newer than the step resumed) are moved
        aside as ``.superseded-<ts>`` (kept). The arrays are restored onto the roles' live shardings.

        Raises:
          CheckpointIncompatibleError: the checkpoint was written by an incompatible configuration (the message
            lists each change and the two ways out); nothing was restored or moved.
          CheckpointRestoreError: no checkpoint could be read.
        """
        from jaxrl.checkpoint import CheckpointIncompatibleError, CheckpointStore

        c = self.c
        if c.resume_from is None:
            c.store.supersede_after(None)
            return None
        root, step = c.resume_from
        own = Path(root).resolve() == c.out_dir.resolve()
        store = c.store if own else CheckpointStore(root, max_to_keep=None, read_only=True)
        try:
            step, arrays, meta = store.restore(step, like=self.state_arrays(), check=self._check_resumable)
        except CheckpointIncompatibleError as e:
            from jaxrl.fingerprint import summary

            raise CheckpointIncompatibleError(
                f"cannot resume from {e.path}: it was written by a run with another configuration: "
                f"{summary(e.differences)}. Either start over with trainer.resume_mode=disable (this folder's "
                "checkpoints are then moved aside, not deleted) or set another trainer.default_local_dir",
                step=e.step, path=e.path, differences=e.differences) from None
        finally:
            if not own:
                store.close()
        c.store.supersede_after(step if own else None)
        for name, role in self.roles().items():
            role.load_state(arrays[name], meta[name])
        c.train_data.set_state(meta["data_state"])
        kl_ctrl = meta.get("kl_ctrl")
        return Resumed(step=step, kl_ctrl_value=None if kl_ctrl is None else kl_ctrl["value"],
                       path=store.step_path(step), meta=meta)


def check_final_checkpoint(store, step: int | None) -> None:
    """Wait for ``store``'s saves and make sure the run's final checkpoint ``step`` (the last step's or the SIGTERM
    one; None: the run ends without one) is complete on disk.

    Raises:
      CheckpointSaveError: it is not; the one-line message gives the reason (free space needed and available, or
        the write error) and the newest complete checkpoint to resume from.
    """
    from jaxrl import distributed
    from jaxrl.checkpoint import CheckpointSaveError

    try:
        store.wait()
    except CheckpointSaveError:
        pass  # logged and recorded in store.save_errors by the store
    distributed.run_on_primary(_require_on_disk, store, step)  # several processes: the primary decides for all


def _require_on_disk(store, step: int | None) -> None:
    from jaxrl.checkpoint import CheckpointSaveError

    if step is None or step in store.steps():
        return
    err = store.save_errors.get(step)
    reason = err.reason if err is not None else "it is not on disk"
    newest = store.latest_step()
    where = (f"the newest complete checkpoint is {store.step_path(newest)} (step {newest})" if newest is not None
             else f"no complete checkpoint exists in {store.directory}")
    raise CheckpointSaveError(
        f"the final checkpoint (step {step}) was not saved: {reason}; {where}; fix the cause (e.g. free disk "
        "space) and rerun the same command to resume from it",
        step=step, directory=store.directory, reason=reason)


def latest_checkpoint_text(store) -> str:
    """Where to resume from, for error messages: ``the last checkpoint is <path>.`` or ``no checkpoint was saved
    yet.``"""
    step = store.latest_step()
    return "no checkpoint was saved yet." if step is None else f"the last checkpoint is {store.step_path(step)}."
