"""Construction of an offline run (SFT or DPO) from a validated config, with the RL trainer's pieces: the run-folder
lock, resume discovery, the train mesh, the model loader, the trained-role scaffolding, the metrics logger and the
checkpoint store.

The order is the order of the failures a user sees: the run folder is locked and the checkpoint to resume from
located first, then the device mesh, the data files (every row checked), the sequence length against the model's
context (from its config alone) before the slow model load; the examples are tokenised after it, the role last.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from pathlib import Path

from jaxrl.metrics import MetricsLogger

log = logging.getLogger("jaxrl")

__all__ = ["OfflineComponents", "build_offline"]


@dataclasses.dataclass
class OfflineComponents:
    """Everything an offline run is made of (the attributes :class:`jaxrl.loop.TrainingLoop` and
    :class:`jaxrl.run_checkpoint.RunCheckpoints` read, by their names)."""

    cfg: object
    kind: str  # "sft" | "dpo"
    tokenizer: object
    model_cfg: object
    actor: object  # the trained role: jaxrl.workers.sft.SFTWorker | jaxrl.workers.preference.PreferenceWorker
    train_data: object  # jaxrl.data.offline.ExampleBatches
    val_items: list | None  # validation sequences (SFT) or pairs (DPO); None = no validation set
    val_width: int  # the validation batches' padded width
    logger: MetricsLogger
    out_dir: Path
    total_training_steps: int
    store: object  # jaxrl.checkpoint.CheckpointStore
    model_meta: dict
    ref_params: object | None = None  # DPO: the frozen reference (the initial params)
    placement: object | None = None
    lock: object | None = None
    resume_from: tuple | None = None
    critic: object | None = None  # none (RunCheckpoints' roles are the actor alone)


def build_offline(cfg, kind: str) -> OfflineComponents:
    """Build an ``sft`` or ``dpo`` run.

    Raises:
      jaxrl.runlock.RunLockError: another run holds the folder.
      jaxrl.config.ConfigError: a mesh that does not fit the devices, batch sizes that do not split over it,
        ``data.max_length`` beyond the model's context.
      FileNotFoundError, jaxrl.data.sources.DataFileError: a missing data file, a malformed row (names the file
        and line), an overlong sequence with ``data.truncation=error``.
      jaxrl.models.files.ModelFileError: a model file that cannot be used.
    """
    from jaxrl.checkpoint import find_resume_checkpoint
    from jaxrl.runlock import RunLock

    out_dir = Path(cfg.trainer.default_local_dir)
    lock = RunLock(out_dir).acquire()
    try:
        t = cfg.trainer
        resume_from = find_resume_checkpoint(t.resume_mode, out_dir, t.resume_from_path)
        return dataclasses.replace(_build(cfg, kind, out_dir), lock=lock, resume_from=resume_from)
    except BaseException:
        lock.release()
        raise


def _placement(cfg):
    """The train mesh from ``trainer.mesh`` (None: one device), and the batch arithmetic on its shards."""
    from jaxrl.config.offline_loader import check_offline_batch, offline_mesh_enabled, offline_mesh_sizes

    if not offline_mesh_enabled(cfg):
        return None
    from jaxrl.workers.placement import make_placement
    from sharding import DEFAULT_RULES, rules_from_dict

    rules = rules_from_dict(cfg.trainer.sharding_rules or {}, base=DEFAULT_RULES)
    placement = make_placement("colocated", offline_mesh_sizes(cfg), rollout_tp=1, rules=rules)
    check_offline_batch(cfg, placement.batch_shards)
    log.info("placement %s", placement.describe())
    return placement


def _rows(cfg, kind: str):
    """The train / validation rows (``LoadedRows``), every row checked for the trainer's format."""
    from jaxrl.data.preference import preference_row_check
    from jaxrl.data.sft import sft_row_check
    from jaxrl.data.sources import load_split

    d = cfg.data
    if kind == "sft":
        check = sft_row_check(d)
        needs = (f"a {d.multiturn.messages_key!r} conversation" if d.multiturn.enable
                 else f"a {d.prompt_key!r} prompt and a {d.response_key!r} response")
    else:
        check = preference_row_check(d)
        needs = f"{d.chosen_key!r} and {d.rejected_key!r} (and a {d.prompt_key!r}, or whole conversations)"
    common = dict(skip_malformed=d.skip_malformed, row_check=check, row_needs=needs)
    train = load_split(d.train_files, split="train", max_samples=d.train_max_samples, **common)
    val = load_split(d.val_files, split="val", max_samples=d.val_max_samples, **common) if d.val_files else None
    return train, val


def _check_context(cfg, config=None) -> None:
    """``data.max_length`` must fit the model's context (from its config file before the load, else the loaded
    one's)."""
    from jaxrl.config import ConfigError
    from jaxrl.models.files import read_model_config

    path = cfg.model.partial_pretrain
    if config is None:
        found = read_model_config(path, cheap_only=True)
        if found is None:
            return
        limit, where = found[0].get("max_position_embeddings"), found[1]
    else:
        limit, where = config.max_position_embeddings, "the loaded model"
    if limit is not None and cfg.data.max_length > limit:
        raise ConfigError(f"data.max_length={cfg.data.max_length} exceeds the model's context of {limit} tokens "
                          f"(max_position_embeddings of model.partial_pretrain={path!r}, {where}); lower it to at most "
                          f"{limit}")


def _load_model(cfg):
    from jaxrl.models import load_pretrained, remat_setting

    m = cfg.model
    pre = load_pretrained(m.partial_pretrain, param_dtype=m.param_dtype, dtype=m.dtype, remat=remat_setting(m))
    tokenizer = pre.tokenizer
    if m.tokenizer_path:
        from jaxrl.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(m.tokenizer_path)
    if tokenizer is None:
        raise ValueError(f"no tokenizer found for model {m.partial_pretrain!r}; set model.tokenizer_path")
    if cfg.data.chat_template:
        tokenizer.chat_template = cfg.data.chat_template  # trained with it, saved with it (tokenizer/, hf_model/)
    return pre, tokenizer


def optim_view(optim):
    """The ``optim`` section as :func:`jaxrl.workers.optim.make_optimizer` reads it (``lr_scheduler`` ->
    ``lr_scheduler_type``)."""
    return types.SimpleNamespace(**dataclasses.asdict(optim), lr_scheduler_type=optim.lr_scheduler)


def role_plan(cfg, kind: str, batch_shards: int):
    """The trained role's batch sizes: one mini-batch = one step of ``data.train_batch_size`` sequences (pairs),
    micro-batches of ``data.micro_batch_size_per_gpu`` per data-parallel device; the no-grad forward (validation,
    the reference) takes ``data.micro_batch_size_per_gpu`` rows per device (DPO: both sequences of that many pairs).
    """
    from jaxrl.config.batch_plan import RolePlan

    d = cfg.data
    per_forward = d.micro_batch_size_per_gpu * (2 if kind == "dpo" else 1)
    return RolePlan.derive(
        "data", rollout_n=1, rows_per_step=d.train_batch_size, mini_batch_size=d.train_batch_size,
        micro_batch_size_per_gpu=d.micro_batch_size_per_gpu, forward_key="data.micro_batch_size_per_gpu",
        forward_per_gpu=per_forward, batch_shards=batch_shards, mini_batch_key="data.train_batch_size",
        micro_batch_key="data.micro_batch_size_per_gpu",
    )


def _build(cfg, kind: str, out_dir: Path) -> OfflineComponents:
    import jax
    from flax import nnx

    from jaxrl.checkpoint import CheckpointStore, model_meta
    from jaxrl.config.loader import config_to_dict
    from jaxrl.data.offline import ExampleBatches, sequence_width
    from jaxrl.data.preference import build_preference_examples
    from jaxrl.data.sft import build_sft_examples

    placement = _placement(cfg)
    train_rows, val_rows = _rows(cfg, kind)
    _check_context(cfg)
    pre, tokenizer = _load_model(cfg)
    _check_context(cfg, pre.config)
    build = build_sft_examples if kind == "sft" else build_preference_examples
    d = cfg.data
    train_items = build(train_rows, tokenizer, d, "train")
    val_items = build(val_rows, tokenizer, d, "val") if val_rows is not None else None

    def width(items):
        return sequence_width([len(x) for it in items for x in (it if isinstance(it, tuple) else (it,))],
                              d.max_length)

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if len(train_items) < d.train_batch_size:
        from jaxrl.data.sources import DataFileError

        raise DataFileError(f"data.train_files has {len(train_items)} rows for data.train_batch_size="
                            f"{d.train_batch_size} (every step takes that many): lower it or give more rows")
    train_data = ExampleBatches(train_items, batch_size=d.train_batch_size, width=width(train_items),
                                shuffle=d.shuffle, seed=d.seed, pad_id=pad)
    total = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * train_data.steps_per_epoch
    log.info("%s data: %d train %s (width %d), %s validation; %d steps", kind, len(train_items),
             "sequences" if kind == "sft" else "pairs", train_data.width,
             len(val_items) if val_items is not None else "no", total)

    graphdef, params = nnx.split(pre.model)
    plan = role_plan(cfg, kind, 1 if placement is None else placement.batch_shards)
    mesh = {} if placement is None else {"mesh": placement.train_mesh, "rules": placement.rules}
    common = dict(plan=plan, optim=optim_view(cfg.optim), grad_clip=cfg.optim.clip_grad,
                  total_training_steps=total, seed=cfg.trainer.seed, **mesh)
    ref_params = None
    if kind == "sft":
        from jaxrl.workers.sft import SFTWorker

        actor = SFTWorker(graphdef, params, **common)
    else:
        from jaxrl.workers.preference import PreferenceWorker

        ref_params = jax.tree.map(lambda x: x.copy(), params)  # frozen: the actor's buffers are donated
        actor = PreferenceWorker(graphdef, params, cfg.algorithm.dpo, temperature=1.0, name="train", **common)
        if placement is not None:
            from sharding import shard_state

            ref_params = shard_state(ref_params, actor.base_param_shardings)
    actor.init_optimizer()  # now, so a checkpoint always has its state
    logger = MetricsLogger(cfg.trainer.logger, out_dir, project_name=cfg.trainer.project_name,
                           experiment_name=cfg.trainer.experiment_name, config=config_to_dict(cfg))
    keep = cfg.trainer.max_ckpt_to_keep
    store = CheckpointStore(out_dir, async_save=cfg.trainer.checkpoint_async, max_to_keep=keep or None)
    try:
        store.save_tokenizer(tokenizer)
    except BaseException:
        store.close()
        raise
    return OfflineComponents(
        cfg=cfg, kind=kind, tokenizer=tokenizer, model_cfg=pre.config, actor=actor, train_data=train_data,
        val_items=val_items, val_width=width(val_items) if val_items else 0, logger=logger, out_dir=out_dir,
        total_training_steps=total, store=store,
        model_meta=model_meta(pre.config, path=cfg.model.partial_pretrain, param_dtype=cfg.model.param_dtype,
                              scan_layout=actor.scan_layout),
        ref_params=ref_params, placement=placement,
    )
