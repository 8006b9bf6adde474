"""Load, merge and validate a jaxrl config: schema defaults <- YAML file <- ``key=value`` overrides.

Overrides use verl's (Hydra's) command-line spelling: ``a.b.c=value`` where ``value`` is parsed as
YAML by OmegaConf (``1e-6``, ``True``, ``[console,jsonl]``, ``null``, ``${trainer.project_name}``).
Every problem raises :class:`ConfigError` whose message names the full dotted key, the bad value and
what would be valid. Nothing here imports jax, so ``python -m jaxrl.train`` rejects a bad config in
well under a second (a module named by ``algorithm.external_lib`` is imported, and may import what it likes).

The work is cut along its seams: :mod:`jaxrl.config.parse` (read + merge), :mod:`jaxrl.config.checks`
(each key's value, derived defaults), :mod:`jaxrl.config.cross` (batch arithmetic from
:class:`~jaxrl.config.batch_plan.BatchPlan`, mesh, estimator / loss options, context length). This module is
the public API and re-exports the names the rest of jaxrl imports from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from jaxrl.config import compat
from jaxrl.config.checks import (Checks, import_external_libs, normalise, normalise_prime, validate_rewards,
                                 validate_sections)
from jaxrl.config.cross import (
    batch_mesh_axes,
    check_context_length,
    check_declared_options,
    check_mesh_batch_sizes,
    mesh_enabled,
    mesh_sizes,
    uneven_mini_batch_notes,
    validate_cross,
    validate_mesh,
)
from jaxrl.config.errors import ConfigError
from jaxrl.config.parse import assign, classify, raw_pairs, resolve
from jaxrl.config.schema import JaxRLConfig

__all__ = [
    "ConfigError",
    "LoadedConfig",
    "batch_mesh_axes",
    "check_context_length",
    "check_mesh_batch_sizes",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "load_config_with_notes",
    "mesh_enabled",
    "mesh_sizes",
]


@dataclass(frozen=True)
class LoadedConfig:
    """Result of :func:`load_config_with_notes`: the validated config and the compat notes
    (one per accepted verl key that has no JAX meaning, in first-seen order)."""

    config: JaxRLConfig
    notes: tuple[compat.CompatNote, ...]


def load_config_with_notes(config_path: str | Path | None, overrides: Sequence[str] = ()) -> LoadedConfig:
    """Load and validate a config, also returning the compat notes.

    Args:
      config_path: a YAML file (verl-style sections), or None for schema defaults only.
      overrides: ``"a.b.c=value"`` strings applied after the file, in order (later wins).

    Returns:
      :class:`LoadedConfig` with the validated :class:`JaxRLConfig` and one
      :class:`~jaxrl.config.compat.CompatNote` per accepted verl key with no JAX meaning, plus one per trained
      role whose ``ppo_mini_batch_size`` does not divide ``data.train_batch_size`` (accepted, as verl's FSDP
      workers do; the note gives the sizes that divide it).

    Raises:
      ConfigError: missing/invalid YAML file, malformed override, unknown key (with a "did you
        mean" suggestion), wrong type, unresolvable interpolation, value out of range or not one of
        the choices, verl batch arithmetic violated, an unsupported feature requested, or a ``trainer.distributed``
        / ``JAXRL_*`` world the config cannot run (:func:`jaxrl.distributed.check_world`), or launcher settings that
        do not fit (:func:`jaxrl.ray_backend.check_ray_launch`). ``trainer.launcher`` comes back resolved
        (``local`` or ``ray``).
    """
    from jaxrl.distributed import resolve_world  # (it imports this package's ConfigError)
    from jaxrl.ray_backend import check_ray_launch, resolve_launcher  # (no Ray import)

    kept, notes = classify(raw_pairs(config_path, list(overrides)))
    cfg = OmegaConf.structured(JaxRLConfig)
    assign(cfg, kept)
    obj = resolve(cfg)
    normalise(obj)
    import_external_libs(obj)  # a user's estimators / losses are valid choices from here on
    normalise_prime(obj)  # PRIME's filter defaults depend on the (possibly user-registered) estimator
    c = Checks(obj)
    validate_sections(obj, c)
    validate_mesh(obj, c)
    validate_rewards(obj, c)
    validate_cross(obj)
    spec = resolve_world(obj.trainer.distributed)  # the processes' world (JAXRL_* env / keys), no jax
    # null -> ray when RAY_ADDRESS is set (and this process was given no world to join), else local
    obj.trainer.launcher = resolve_launcher(obj.trainer.launcher, member=spec.mode != "local")
    check_ray_launch(obj, spec)  # with trainer.launcher=ray: the world its driver will form
    check_declared_options(obj, given={key for key, _, _ in kept})
    notes.extend(uneven_mini_batch_notes(obj))
    return LoadedConfig(config=obj, notes=tuple(notes))


def load_config(config_path: str | Path | None, overrides: Sequence[str] = ()) -> JaxRLConfig:
    """Schema defaults <- YAML file <- ``key=value`` overrides, validated, as a :class:`JaxRLConfig`.

    Interpolations (``${trainer.project_name}``, ``${oc.env:HOME}``) are resolved, and
    ``${JAXRL_SHARED}`` in a string expands to :func:`jaxrl.paths.shared_dir`. Derived defaults
    filled in the returned object: ``data.train_files``/``val_files`` become ``list[str]``;
    ``data.seed`` and ``actor_rollout_ref.rollout.seed`` null -> ``trainer.seed``;
    ``actor.clip_ratio_low``/``clip_ratio_high`` null -> ``actor.clip_ratio``;
    ``rollout.max_new_tokens`` null -> ``data.max_response_length``; ``data.gen_batch_size`` null ->
    ``data.train_batch_size``; ``critic.model.{enable_gradient_checkpointing,recompute_granularity,dtype,
    param_dtype}`` null -> ``actor_rollout_ref.model``'s; ``critic.ppo_mini_batch_size``/``ppo_epochs`` null ->
    the actor's;
    ``critic.forward_micro_batch_size_per_gpu`` null -> ``critic.ppo_micro_batch_size_per_gpu``;
    ``trainer.launcher`` null -> ``ray`` when ``RAY_ADDRESS`` is set and no world is given to join (``JAXRL_*`` /
    ``trainer.distributed``), else ``local``.

    Raises:
      ConfigError: see :func:`load_config_with_notes`.
    """
    return load_config_with_notes(config_path, overrides).config


def config_to_dict(cfg: JaxRLConfig) -> dict:
    """The config as plain nested dicts/lists (for logging, e.g. into a run's ``config.yaml``)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def config_to_yaml(cfg: JaxRLConfig) -> str:
    """The resolved config as YAML text; loading it back gives an equal config."""
    return OmegaConf.to_yaml(OmegaConf.create(config_to_dict(cfg)))
