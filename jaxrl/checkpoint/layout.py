"""Names on disk (``global_step_<N>``, items ``<role>.<part>``, ``meta``), the steps orbax finalized, and the
checks and sizes of what a save is given (the layout is in :mod:`jaxrl.checkpoint`'s docstring)."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STEP_PREFIX = "global_step"
TOKENIZER_DIRNAME = "tokenizer"
META_ITEM = "meta"
RESUME_MODES: tuple[str, ...] = ("auto", "disable", "resume_path")
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_STEP_DIR_RE = re.compile(rf"^{STEP_PREFIX}_(0|[1-9]\d*)$")
_TMP_MARK = ".orbax-checkpoint-tmp"


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    """The folder of checkpoint ``step`` under the run root ``directory``: ``<directory>/global_step_<step>``."""
    return Path(directory).expanduser() / f"{STEP_PREFIX}_{int(step)}"


def parse_step_dir(path: str | os.PathLike) -> int | None:
    """The step number of a ``.../global_step_<N>`` folder name, or None for any other name."""
    m = _STEP_DIR_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def _complete_steps(directory: Path) -> list[int]:
    """Steps under ``directory`` whose folders orbax considers finalized (tmp folders excluded), ascending."""
    if not directory.is_dir():
        return []
    import orbax.checkpoint as ocp

    fmt = ocp.path.step.standard_name_format(step_prefix=STEP_PREFIX)
    return sorted(m.step for m in fmt.find_all(directory))


def latest_complete_step(directory: str | os.PathLike) -> int | None:
    """The newest step under the run root ``directory`` whose save finished (orbax-finalized), or None."""
    steps = _complete_steps(Path(directory).expanduser())
    return steps[-1] if steps else None


# --------------------------------------------------------------------------------------------- helpers


def model_meta(model_cfg, *, path: str, param_dtype: str, lora: dict | None = None, scan_layout: bool = False) -> dict:
    """The ``meta["model"]`` entry :mod:`jaxrl.export` needs to rebuild the policy without the original files.

    Args:
      model_cfg: the policy's :class:`jaxrl.models.ModelConfig`.
      path: the model spec the run was started from (``actor_rollout_ref.model.path``); the export falls back
        to its tokenizer when the checkpoint root has no ``tokenizer/``.
      param_dtype: the stored parameter dtype name (``"float32"`` / ``"bfloat16"``).
      lora: the actor's LoRA adapters, ``{"rank", "alpha", "targets": [HF module names]}``, or None (full
        fine-tuning: the checkpoint holds the whole policy). With LoRA the checkpoint holds the adapters only and
        the export rebuilds the policy from the base model at ``path``.
      scan_layout: the actor's params are saved in the scan layout (layers stacked, :mod:`jaxrl.models.scan_layout`).

    Returns:
      ``{"hf_config": model_cfg.to_hf_config(), "path": path, "param_dtype": param_dtype}`` (+ ``"lora"``,
      + ``"scan_layout": True``) (JSON-serialisable).
    """
    meta = {"hf_config": model_cfg.to_hf_config(), "path": str(path), "param_dtype": str(param_dtype)}
    if scan_layout:
        meta["scan_layout"] = True
    if lora is not None:
        meta["lora"] = {"rank": int(lora["rank"]), "alpha": float(lora["alpha"]), "targets": list(lora["targets"])}
    return meta


def max_to_keep_from_config(max_actor_ckpt_to_keep: int | None, max_critic_ckpt_to_keep: int | None, *,
                            has_critic: bool) -> int | None:
    """One store limit from verl's ``trainer.max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep``.

    verl treats None and 0 as "keep all". Actor and critic live in the same step folder here, and a step is
    resumable only with both, so the store keeps the larger of the two limits (all, if either keeps all).
    Without a critic only the actor's limit counts.
    """
    def norm(v):
        return None if v in (None, 0) else int(v)

    actor = norm(max_actor_ckpt_to_keep)
    if not has_critic:
        return actor
    critic = norm(max_critic_ckpt_to_keep)
    if actor is None or critic is None:
        return None
    return max(actor, critic)


def _check_json(obj: Any, where: str) -> None:
    """Raise TypeError naming the first value of ``obj`` that does not round-trip through JSON exactly."""
    if obj is None or isinstance(obj, (str, bool, int)):
        return
    if isinstance(obj, float):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_json(v, f"{where}[{i}]")
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"checkpoint meta key {where}[{k!r}] must be a str (JSON object keys are strings)")
            _check_json(v, f"{where}[{k!r}]")
        return
    raise TypeError(
        f"checkpoint meta value {where} = {obj!r} ({type(obj).__name__}) is not JSON-serialisable; convert it "
        "to str/int/float/bool/None/list/dict (numpy scalars: .item())"
    )


def _check_arrays(arrays: Any, what: str) -> None:
    if not isinstance(arrays, Mapping) or not arrays:
        raise TypeError(f"{what} must be a non-empty dict {{role: {{part: pytree}}}}, got {type(arrays).__name__}")
    for role, parts in arrays.items():
        if not (isinstance(role, str) and _NAME_RE.match(role)):
            raise ValueError(f"{what}: role name {role!r} must match {_NAME_RE.pattern} (e.g. 'actor')")
        if not isinstance(parts, Mapping) or not parts:
            raise TypeError(f"{what}[{role!r}] must be a non-empty dict {{part: pytree}}, got {type(parts).__name__}")
        for part in parts:
            if not (isinstance(part, str) and _NAME_RE.match(part)):
                raise ValueError(f"{what}[{role!r}]: part name {part!r} must match {_NAME_RE.pattern}")


_MIB = 1 << 20


def required_bytes(arrays: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any] | None = None) -> int:
    """Bytes a checkpoint of ``arrays`` (+ ``meta``) needs on disk, as used by the free-space check.

    The arrays' ``nbytes`` (global shapes: every array is written once, whatever its sharding) plus 5% and
    1 MiB for orbax's per-array metadata, indexes and filesystem blocks, plus the JSON meta.
    """
    import jax

    data = sum(int(getattr(x, "nbytes", 0)) for parts in arrays.values() for tree in parts.values()
               for x in jax.tree.leaves(tree))
    meta_bytes = len(json.dumps(meta)) if meta is not None else 0
    return data + data // 20 + _MIB + meta_bytes


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", _MIB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%S")


def _item(role: str, part: str) -> str:
    return f"{role}.{part}"
