"""Load and validate the offline trainers' configs (``python -m jaxrl.sft`` / ``python -m jaxrl.dpo``).

The same reading as ``python -m jaxrl.train`` (:mod:`jaxrl.config.parse` over the schema's
:class:`~jaxrl.config.parse.KeyTable`): schema defaults <- YAML file <- ``key=value`` overrides, unknown keys with a
"did you mean", verl keys with no JAX meaning as notes (:mod:`jaxrl.config.offline_compat`), every bad value a
:class:`ConfigError` naming the key, the value and what is valid. No jax import.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from jaxrl.algorithms import registry
from jaxrl.config import schema
from jaxrl.config.checks import Checks, is_int, normalise_data_files_and_seed
from jaxrl.config.cross import check_declared_options, validate_sharding_rules
from jaxrl.config.errors import ConfigError
from jaxrl.config.loader import LoadedConfig
from jaxrl.config.offline_compat import OFFLINE
from jaxrl.config.offline_schema import OFFLINE_LR_SCHEDULER_CHOICES, DPOConfig, SFTConfig
from jaxrl.config.parse import KeyTable, assign, classify, raw_pairs, resolve

__all__ = ["OFFLINE_KINDS", "check_offline_batch", "load_offline_config", "load_offline_config_with_notes",
           "offline_mesh_enabled", "offline_mesh_sizes"]

OFFLINE_KINDS: dict[str, type] = {"sft": SFTConfig, "dpo": DPOConfig}
_TABLES = {kind: KeyTable.of(root, OFFLINE) for kind, root in OFFLINE_KINDS.items()}
_MAX_SEED = 2**32
_DPO_OPTIONS = ((registry.PREFERENCE_LOSSES, "algorithm.dpo.loss_type", "algorithm.dpo", ("label_smoothing",)),)


def load_offline_config_with_notes(kind: str, config_path: str | Path | None,
                                   overrides: Sequence[str] = ()) -> LoadedConfig:
    """Load and validate an ``sft`` or ``dpo`` config, with the compat notes.

    Args:
      kind: ``"sft"`` (:class:`~jaxrl.config.offline_schema.SFTConfig`) or ``"dpo"``
        (:class:`~jaxrl.config.offline_schema.DPOConfig`).
      config_path: a YAML file, or None for schema defaults only.
      overrides: ``"a.b.c=value"`` strings applied after the file, in order.

    Returns:
      :class:`~jaxrl.config.loader.LoadedConfig`; derived defaults filled: ``data.train_files`` / ``val_files``
      as lists, ``data.seed`` null -> ``trainer.seed``, ``data.prompt_dict_keys`` / ``response_dict_keys`` as lists.

    Raises:
      ConfigError: a missing / invalid YAML file, a malformed override, an unknown key, a wrong type, a value out of
        range or not one of the choices, batch sizes that do not divide, an unsupported verl value.
      ValueError: an unknown ``kind`` (a programming error).
    """
    if kind not in OFFLINE_KINDS:
        raise ValueError(f"kind={kind!r}; valid: {list(OFFLINE_KINDS)}")
    table = _TABLES[kind]
    kept, notes = classify(raw_pairs(config_path, list(overrides), table), table)
    cfg = OmegaConf.structured(table.root)
    assign(cfg, kept, table)
    obj = resolve(cfg, table)
    _normalise(obj)
    c = Checks(obj)
    _validate_common(obj, c)
    if kind == "sft":
        _validate_sft(obj, c)
    else:
        _validate_dpo(obj, c)
        check_declared_options(obj, {key for key, _, _ in kept}, option_sections=_DPO_OPTIONS)
    sizes = offline_mesh_sizes(obj)
    if not offline_mesh_enabled(obj):
        check_offline_batch(obj, 1)
    elif all(v != -1 for v in sizes.values()):  # else once the devices are known (jaxrl.offline.build)
        check_offline_batch(obj, _batch_shards(obj, sizes))
    return LoadedConfig(config=obj, notes=tuple(notes))


def load_offline_config(kind: str, config_path: str | Path | None, overrides: Sequence[str] = ()):
    """:func:`load_offline_config_with_notes` without the notes."""
    return load_offline_config_with_notes(kind, config_path, overrides).config


def _normalise(cfg) -> None:
    normalise_data_files_and_seed(cfg)
    d = cfg.data
    for name in ("prompt_dict_keys", "response_dict_keys"):
        v = getattr(d, name, None)
        if isinstance(v, str):
            setattr(d, name, [v])


def _validate_common(cfg, c: Checks) -> None:
    d, t = cfg.data, cfg.trainer
    c.files("data.train_files", nullable=False)
    c.files("data.val_files", nullable=True)
    c.int_at_least("data.train_batch_size", 1)
    c.int_at_least("data.micro_batch_size_per_gpu", 1)
    c.int_at_least("data.train_max_samples", 1, off=-1)
    c.int_at_least("data.val_max_samples", 1, off=-1)
    c.int_at_least("data.max_length", 2)
    c.choice("data.truncation", schema.TRUNCATION_CHOICES)
    c.text("data.chat_template", nullable=True)
    if not (is_int(d.seed) and 0 <= d.seed < _MAX_SEED):
        c.fail("data.seed", f"an int in [0, {_MAX_SEED}) or null (= trainer.seed)")
    c.text("data.prompt_key")
    # model
    c.text("model.partial_pretrain")
    c.text("model.tokenizer_path", nullable=True)
    c.choice("model.dtype", schema.DTYPE_CHOICES)
    c.choice("model.param_dtype", schema.DTYPE_CHOICES)
    c.choice("model.recompute_granularity", schema.RECOMPUTE_GRANULARITY_CHOICES)
    # optim
    c.real("optim.lr", 0.0, lo_open=True)
    c.real("optim.lr_warmup_steps_ratio", 0.0, 1.0)
    c.int_at_least("optim.lr_warmup_steps", 0, off=-1)
    c.real("optim.weight_decay", 0.0)
    betas = cfg.optim.betas
    if not (len(betas) == 2 and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
        c.fail("optim.betas", "two numbers in [0, 1), e.g. [0.9, 0.95]")
    c.real("optim.eps", 0.0, lo_open=True)
    c.real("optim.min_lr_ratio", 0.0, 1.0)
    c.real("optim.clip_grad", -math.inf)
    c.choice("optim.lr_scheduler", OFFLINE_LR_SCHEDULER_CHOICES)
    # trainer
    c.int_at_least("trainer.total_epochs", 1)
    c.int_at_least("trainer.total_training_steps", 1, nullable=True)
    c.int_at_least("trainer.test_freq", 1, off=-1)
    c.int_at_least("trainer.save_freq", 1, off=-1)
    loggers = t.logger
    if not loggers or any(x not in schema.LOGGER_CHOICES for x in loggers) or len(set(loggers)) != len(loggers):
        c.fail("trainer.logger", "a non-empty list without repeats of " + ", ".join(map(repr, schema.LOGGER_CHOICES)))
    c.text("trainer.project_name")
    c.text("trainer.experiment_name")
    c.text("trainer.default_local_dir")
    if t.nnodes != 1:
        c.fail("trainer.nnodes", "1: the offline trainers run in one process (use trainer.mesh for its devices)")
    if not (is_int(t.seed) and 0 <= t.seed < _MAX_SEED):
        c.fail("trainer.seed", f"an int in [0, {_MAX_SEED})")
    c.choice("trainer.resume_mode", schema.RESUME_MODE_CHOICES)
    c.text("trainer.resume_from_path", nullable=True)
    if t.resume_mode == "resume_path" and t.resume_from_path is None:
        c.fail("trainer.resume_from_path", "a path when trainer.resume_mode='resume_path' (a run's checkpoint "
               "directory or one of its global_step_<N> folders)")
    c.int_at_least("trainer.max_ckpt_to_keep", 1, off=0, nullable=True)
    c.int_at_least("trainer.max_nonfinite_steps", 1)
    for axis in schema.MESH_AXIS_CHOICES:
        c.int_at_least(f"trainer.mesh.{axis}", 1, off=-1, nullable=True)
    if sum(v == -1 for v in offline_mesh_sizes(cfg).values()) > 1:
        raise ConfigError(f"trainer.mesh {offline_mesh_sizes(cfg)} (unset axes filled) has more than one axis set "
                          "to -1; at most one axis may fill the remaining devices")
    validate_sharding_rules(t.sharding_rules)


def _validate_sft(cfg, c: Checks) -> None:
    d = cfg.data
    c.text("data.response_key")
    for key in ("data.prompt_dict_keys", "data.response_dict_keys"):
        v = getattr(d, key.split(".")[1])
        if v is not None and not (isinstance(v, list) and all(isinstance(k, str) and k for k in v)):
            c.fail(key, "a list of keys into the nested column (e.g. ['question']) or null")
    c.text("data.multiturn.messages_key")


def _validate_dpo(cfg, c: Checks) -> None:
    c.text("data.chosen_key")
    c.text("data.rejected_key")
    c.preference_loss("algorithm.dpo")


# ------------------------------------------------------------------------------------ mesh and batch
def offline_mesh_enabled(cfg) -> bool:
    """True when any ``trainer.mesh`` axis is set (the run trains on a device mesh)."""
    m = cfg.trainer.mesh
    return any(v is not None for v in (m.data, m.fsdp, m.tensor))


def offline_mesh_sizes(cfg) -> dict[str, int]:
    """``trainer.mesh`` with unset axes filled (as :func:`jaxrl.config.cross.mesh_sizes`)."""
    m = cfg.trainer.mesh
    data = 1 if m.data is None else m.data
    tensor = 1 if m.tensor is None else m.tensor
    fsdp = m.fsdp if m.fsdp is not None else (1 if -1 in (data, tensor) else -1)
    return {"data": data, "fsdp": fsdp, "tensor": tensor}


def _batch_shards(cfg, sizes: dict[str, int]) -> int:
    rules = cfg.trainer.sharding_rules or {}
    axes = rules.get("batch", ["data", "fsdp"]) if "batch" in rules else ["data", "fsdp"]
    axes = [] if axes is None else ([axes] if isinstance(axes, str) else list(axes))
    return math.prod(sizes[a] for a in axes)


def check_offline_batch(cfg, batch_shards: int) -> None:
    """verl's SFT batch arithmetic on ``batch_shards`` data-parallel devices: ``data.train_batch_size`` rows
    split evenly over them, and ``data.micro_batch_size_per_gpu`` divides each device's share.

    Raises:
      ConfigError: names both keys, the data-parallel size and the valid values.
    """
    d = cfg.data
    unit = "sequences" if hasattr(d, "response_key") else "pairs"
    if d.train_batch_size % batch_shards:
        raise ConfigError(
            f"data.train_batch_size={d.train_batch_size} {unit} do not split over the {batch_shards} data-parallel "
            f"devices of trainer.mesh; valid: a multiple of {batch_shards}")
    share = d.train_batch_size // batch_shards
    if share % d.micro_batch_size_per_gpu:
        divisors = [k for k in range(1, share + 1) if share % k == 0]
        raise ConfigError(
            f"data.micro_batch_size_per_gpu={d.micro_batch_size_per_gpu} must divide each device's share of "
            f"data.train_batch_size={d.train_batch_size} {unit} / {batch_shards} device(s) = {share}; valid: "
            f"{divisors}")
