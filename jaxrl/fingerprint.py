"""Checkpoint fingerprint: what a checkpoint needs to be resumable, and what changed when it is not.

A checkpoint is resumable by a run only when the run rebuilds the same state: the same model architecture, the
same trained roles with the same array shapes/dtypes and optimizer-state structure, and the same prompt order
for the saved data-iterator position. :func:`fingerprint` collects exactly that as one JSON dict, stored in each
checkpoint's meta (``meta["fingerprint"]``); on resume :func:`differences` compares it with the new run's,
before any array is read, and lists each difference as ``key: old -> new``.

Fingerprint keys (version 1)::

    version                      1
    model.<hf config key>        the policy's Hugging Face config (architecture, vocab, rope, ...)
    model.param_dtype            stored parameter dtype
    roles                        trained roles, e.g. "actor" or "actor,critic"
    data.<batch key>             prompts per pipeline batch (data.train_batch_size; data.gen_batch_size with DAPO
                                 dynamic sampling)
    data.seed / data.shuffle / data.drop_last
    data.num_prompts             prompts kept after filtering
    data.prompts_sha256          digest of the kept prompts' token ids in dataset order (changes with the train
                                 files' content, max_prompt_length filtering/truncation, the tokenizer, ...)
    <lora key>                   only with LoRA: actor_rollout_ref.model.lora_rank / lora_alpha / lora_targets (and the
                                 critic.model.* ones): the adapters' meaning (alpha scales them) and where they sit
    arrays                       {"<role>.<part>": {"<leaf path>": "<dtype>[<shape>]"}} for every saved tree
    context                      settings that decide the prompts (data.train_files, data.max_prompt_length, ...);
                                 reported next to a data difference, never a difference on their own (moving the
                                 data file leaves the prompts, and so the position, valid)

Checkpoints written before fingerprints existed are compared on what their meta holds (model config, roles,
data-iterator settings) plus the array signatures orbax stored with the arrays (:func:`legacy_fingerprint`).

Pure functions over JSON-able dicts; only :func:`tree_signature` imports jax.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

VERSION = 1
_NOT_SET = "(absent)"
_MAX_LISTED = 8

__all__ = ["VERSION", "differences", "fingerprint", "legacy_fingerprint", "tree_signature"]


def tree_signature(tree: Any) -> dict[str, str]:
    """``{leaf path: "dtype[d0,d1,...]"}`` of a pytree of arrays (or ``jax.ShapeDtypeStruct`` / orbax metadata).

    Paths join dict keys, attribute names and sequence indices with ``.``, so a live tree (``nnx.State``, optax
    NamedTuples) and the tree orbax stored for it (dicts and lists) give the same signature.
    """
    import jax
    import numpy as np

    def part(k) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = ",".join(str(int(d)) for d in getattr(leaf, "shape", ()))
        out[".".join(part(k) for k in path)] = f"{np.dtype(leaf.dtype).name}[{shape}]"
    return out


def fingerprint(*, model: Mapping, roles: list[str], arrays: Mapping[str, Mapping[str, Any]],
                data: Mapping[str, Any], context: Mapping[str, Any], settings: Mapping[str, Any] | None = None) -> dict:
    """The fingerprint of a run's checkpointable state.

    Args:
      model: ``{"hf_config": dict, "param_dtype": str, ...}`` (:func:`jaxrl.checkpoint.model_meta`).
      roles: the trained roles, e.g. ``["actor"]`` or ``["actor", "critic"]``.
      arrays: ``{role: {part: pytree}}`` as saved (leaves: arrays or ``ShapeDtypeStruct``).
      data: the settings the data-iterator position depends on, under their config names
        (``data.train_batch_size``, ``data.seed``, ``data.shuffle``, ``data.num_prompts``, ``data.prompts_sha256``...).
      context: settings that explain a data difference (``data.train_files`` ...), never compared on their own.
      settings: other settings the saved state depends on, compared like the data keys (LoRA's
        ``actor_rollout_ref.model.lora_rank`` ...; only present when LoRA is on, so full fine-tuning fingerprints
        are unchanged).

    Returns:
      A JSON-serialisable dict (layout in the module docstring).
    """
    fp: dict[str, Any] = {"version": VERSION}
    for k, v in sorted(dict(model.get("hf_config") or {}).items()):
        fp[f"model.{k}"] = _jsonable(v)
    fp["model.param_dtype"] = model.get("param_dtype")
    fp["roles"] = ",".join(roles)
    fp.update({k: _jsonable(v) for k, v in data.items()})
    fp.update({k: _jsonable(v) for k, v in (settings or {}).items()})
    fp["arrays"] = {f"{r}.{p}": tree_signature(tree) for r, parts in arrays.items() for p, tree in parts.items()}
    fp["context"] = {k: _jsonable(v) for k, v in context.items()}
    return fp


def legacy_fingerprint(meta: Mapping, *, array_signatures: Mapping[str, Mapping[str, str]] | None,
                       batch_key: str) -> dict:
    """What a checkpoint without ``meta["fingerprint"]`` tells about itself.

    Args:
      meta: the checkpoint's meta (step, data_state, model, actor, critic, ...).
      array_signatures: ``{"<role>.<part>": {path: sig}}`` read from orbax's own metadata (None: not compared).
      batch_key: the current run's name for the pipeline batch size (``data.train_batch_size`` or
        ``data.gen_batch_size``); old data states only say ``batch_size``.
    """
    fp: dict[str, Any] = {}
    model = meta.get("model") or {}
    for k, v in sorted(dict(model.get("hf_config") or {}).items()):
        fp[f"model.{k}"] = v
    if "param_dtype" in model:
        fp["model.param_dtype"] = model["param_dtype"]
    fp["roles"] = ",".join(r for r in ("actor", "critic") if r in meta)
    ds = meta.get("data_state") or {}
    for old, new in (("batch_size", batch_key), ("seed", "data.seed"), ("shuffle", "data.shuffle"),
                     ("drop_last", "data.drop_last"), ("num_rows", "data.num_prompts")):
        if old in ds:
            fp[new] = ds[old]
    if array_signatures is not None:
        fp["arrays"] = {k: dict(v) for k, v in array_signatures.items()}
    return fp


def differences(saved: Mapping, now: Mapping, *, only_common: bool = False) -> list[str]:
    """The differences between a checkpoint's fingerprint and the current run's, one ``key: old -> new`` each.

    Args:
      saved: the checkpoint's fingerprint (or :func:`legacy_fingerprint`).
      now: the current run's :func:`fingerprint`.
      only_common: compare only keys both have (for a legacy fingerprint, which lacks some keys).

    Returns:
      An empty list when the checkpoint is resumable by this run. Array trees are summarised per saved item
      (a count per kind of difference plus the first example). A data difference is followed by the context
      settings that changed (e.g. ``data.train_files``).
    """
    out: list[str] = []
    skip = {"version", "arrays", "context"}
    keys = [k for k in saved if k not in skip] + [k for k in now if k not in skip and k not in saved]
    data_changed = False
    for k in keys:
        if only_common and (k not in saved or k not in now):
            continue
        a, b = saved.get(k, _NOT_SET), now.get(k, _NOT_SET)
        if a != b:
            out.append(f"{k}: {_show(a)} -> {_show(b)}")
            data_changed |= k.startswith("data.")
    if "arrays" in saved and "arrays" in now:
        out.extend(array_differences(saved["arrays"], now["arrays"], only_common=only_common))
        if _per_layer_vs_stacked(saved["arrays"], now["arrays"]):
            out.append("layout: the checkpoint holds the decoder layers one by one, as jaxrl saved them before it "
                       "stored them stacked (2026-11-29, jaxrl.models.scan_layout), so it does not resume into this "
                       "version; `python -m jaxrl.export <checkpoint> --output DIR` still reads it, and a new run can "
                       "start from DIR")
    if data_changed:
        old_ctx, new_ctx = saved.get("context") or {}, now.get("context") or {}
        for k in sorted(set(old_ctx) | set(new_ctx)):
            if k in old_ctx and k in new_ctx and old_ctx[k] != new_ctx[k]:
                out.append(f"{k}: {_show(old_ctx[k])} -> {_show(new_ctx[k])}")
    return out


def array_differences(saved: Mapping[str, Mapping[str, str]], now: Mapping[str, Mapping[str, str]], *,
                      only_common: bool = False) -> list[str]:
    """Per item (``actor.params`` ...): arrays only in the checkpoint, only now, and with another shape/dtype."""
    out = []
    for item in list(saved) + [i for i in now if i not in saved]:
        if item not in saved or item not in now:
            if not only_common:
                out.append(f"{item}: {'saved' if item in saved else 'not saved'} -> "
                           f"{'needed' if item in now else 'not needed'}")
            continue
        a, b = saved[item], now[item]
        gone = [p for p in a if p not in b]
        new = [p for p in b if p not in a]
        changed = [p for p in a if p in b and a[p] != b[p]]
        parts = []
        if changed:
            p = changed[0]
            parts.append(f"{len(changed)} of {len(a)} arrays changed shape/dtype (e.g. {p}: {a[p]} -> {b[p]})")
        if gone:
            parts.append(f"{len(gone)} arrays only in the checkpoint (e.g. {gone[0]})")
        if new:
            parts.append(f"{len(new)} arrays only in this run (e.g. {new[0]})")
        if parts:
            out.append(f"{item}: " + ", ".join(parts))
    return out


_PER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")
_STACKED = re.compile(r"(^|\.)layers\.block\.")


def _per_layer_vs_stacked(saved: Mapping[str, Mapping[str, str]], now: Mapping[str, Mapping[str, str]]) -> bool:
    """Whether the checkpoint's arrays hold per-layer decoder weights where this run's are stacked."""
    def has(arrays, pattern):
        return any(pattern.search(p) for item in arrays.values() for p in item)

    return has(saved, _PER_LAYER) and not has(saved, _STACKED) and has(now, _STACKED)


def summary(diffs: list[str]) -> str:
    """``diffs`` joined on one line ("; "), the first few in full and the rest counted."""
    shown = diffs[:_MAX_LISTED]
    more = len(diffs) - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if v is None or isinstance(v, (str, bool, int, float)):
        return v
    return str(v)


def _show(v: Any) -> str:
    if v == _NOT_SET:
        return v
    text = json.dumps(v, sort_keys=True) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 120 else text[:117] + "..."
