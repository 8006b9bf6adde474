"""The weight format a rollout engine accepts: declared by the engine, produced by its weight sync, checked on load.

Three formats, one per kind of engine:

* ``"jax"`` - the policy's ``nnx.State`` in the decoder's own layout (the embedded
  :class:`~jaxrl.rollout.jax_sampler.JaxSampler`). With a ``mesh`` every array must already live on that mesh,
  laid out by ``rules`` (the translator's ``"jax"`` target produces it); without one the params are taken as they
  are (one device, no translation).
* ``"hf_device"`` - Hugging Face checkpoint tensors ``{hf_name: jax.Array}`` (names and layouts of
  :func:`sharding.hf_table`), every array on ``device`` (in-process vLLM: handed over by DLPack, no copy).
* ``"hf_host"`` - the same tensors in host memory (numpy arrays or jax arrays on a CPU device; the vLLM worker
  process reads them through shared memory).

:meth:`WeightFormat.check` is the one format check every engine runs before it loads anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.rollout.base import WeightFormatError
from sharding.rules import TENSOR_PARALLEL_RULES, Rules

__all__ = ["FORMATS", "WeightFormat", "check_same_params", "params_signature"]

FORMATS: tuple[str, ...] = ("jax", "hf_device", "hf_host")


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """One engine's weight format (build it with :meth:`jax`, :meth:`hf_on_device` or :meth:`hf_on_host`).

    Attributes:
      kind: ``"jax"``, ``"hf_device"`` or ``"hf_host"``.
      mesh: ``"jax"``: the engine's mesh (None = the params as they are, no translation).
      rules: ``"jax"`` with a mesh: the logical-axis rules that lay the weights out on it.
      device: ``"hf_*"``: the device the translator lands the tensors on (``"hf_host"``: the host CPU device).

    Raises:
      ValueError: an unknown kind, or fields that do not belong to it.
    """

    kind: str
    mesh: Mesh | None = None
    rules: Rules | None = None
    device: Any = None

    def __post_init__(self) -> None:
        if self.kind not in FORMATS:
            raise ValueError(f"WeightFormat.kind={self.kind!r}; valid: {list(FORMATS)}")
        if self.kind == "jax" and self.device is not None:
            raise ValueError("a 'jax' weight format has a mesh (or none), not a device")
        if self.kind != "jax" and (self.mesh is not None or self.rules is not None or self.device is None):
            raise ValueError(f"a {self.kind!r} weight format needs a device and no mesh/rules")

    @classmethod
    def jax(cls, mesh: Mesh | None = None, rules: Rules | None = None) -> "WeightFormat":
        """The decoder's ``nnx.State``; on ``mesh`` by ``rules`` (default
        :data:`sharding.rules.TENSOR_PARALLEL_RULES`), or as given when ``mesh`` is None."""
        return cls("jax", mesh=mesh, rules=(rules or TENSOR_PARALLEL_RULES) if mesh is not None else None)

    @classmethod
    def hf_on_device(cls, device=None) -> "WeightFormat":
        """HF checkpoint tensors as ``jax.Array`` s on ``device`` (default ``jax.devices()[0]``)."""
        return cls("hf_device", device=device if device is not None else jax.devices()[0])

    @classmethod
    def hf_on_host(cls) -> "WeightFormat":
        """HF checkpoint tensors in host memory (landed on the host CPU device ``jax.devices("cpu")[0]``)."""
        return cls("hf_host", device=jax.devices("cpu")[0])

    def describe(self) -> str:
        """One phrase for messages, e.g. ``"the policy's nnx.State on mesh data=2 x fsdp=1 x tensor=2"``."""
        if self.kind == "jax":
            if self.mesh is None:
                return "the policy's nnx.State (JAX layout, as given)"
            return "the policy's nnx.State on mesh " + " x ".join(f"{a}={self.mesh.shape[a]}" for a in self.mesh.axis_names)
        where = f"on device {self.device}" if self.kind == "hf_device" else "in host memory"
        return f"Hugging Face tensors {{hf_name: array}} {where}"

    def check(self, weights: Any, engine: str) -> None:
        """Refuse ``weights`` unless they are in this format.

        Args:
          weights: what an engine's ``update_weights`` received.
          engine: the engine's name, for the message.

        Raises:
          WeightFormatError: another format (an ``nnx.State`` for an HF engine, a mapping for the JAX sampler), or
            arrays on other devices (names the first offenders, where they live and where they must).
        """
        want = f"{engine} takes {self.describe()}"
        if self.kind == "jax":
            if not isinstance(weights, nnx.State):
                raise WeightFormatError(f"{want}; got {_what(weights)} (sync through jaxrl.rollout.WeightSync)")
            if self.mesh is not None:
                devices = set(self.mesh.devices.flat)
                off = [(name, _devices(x)) for name, x in _flat(weights)
                       if not isinstance(x, jax.Array) or set(x.sharding.device_set) != devices]
                if off:
                    raise WeightFormatError(f"{want} (devices {sorted(d.id for d in devices)}); got arrays elsewhere: "
                                            + ", ".join(f"{p} {d}" for p, d in off[:3]))
            return
        if isinstance(weights, nnx.State) or not isinstance(weights, Mapping):
            raise WeightFormatError(f"{want}; got {_what(weights)} (sync through jaxrl.rollout.WeightSync)")
        if self.kind == "hf_device":
            off = [(k, _devices(x)) for k, x in weights.items()
                   if not isinstance(x, jax.Array) or set(x.sharding.device_set) != {self.device}]
        else:
            off = [(k, _devices(x)) for k, x in weights.items()
                   if not (isinstance(x, np.ndarray)
                           or (isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.sharding.device_set)))]
        if off:
            raise WeightFormatError(f"{want}; got tensors elsewhere: " + ", ".join(f"{k} {d}" for k, d in off[:3]))


def params_signature(params: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{path: (shape, dtype)}`` of every array leaf of a pytree (e.g. an ``nnx.State``): what an engine compares
    a new set of weights against."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {
        jax.tree_util.keystr(path): (tuple(np.shape(leaf)), str(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype))
        for path, leaf in leaves
    }


def check_same_params(reference: Any, params: Any, engine: str) -> None:
    """Refuse ``params`` unless they have exactly ``reference``'s tree, leaf shapes and dtypes (an engine's
    ``update_weights``: new weights for the same model).

    Args:
      reference: the engine's current params. params: the new ones. engine: its name, for the message.
    Raises:
      ValueError: names the missing / unexpected leaf paths, the first leaves whose shape or dtype differ, or a
        tree structure (node types / metadata) that differs.
    """
    want, got = params_signature(reference), params_signature(params)
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise ValueError(
            f"update_weights: parameter tree differs from the {engine}'s; missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}"
        )
    diffs = [f"{p}: expected {want[p]}, got {got[p]}" for p in sorted(got) if got[p] != want[p]]
    if diffs:
        raise ValueError(
            "update_weights: leaf shape/dtype mismatch (expected (shape, dtype)): " + "; ".join(diffs[:5])
            + (f" ... and {len(diffs) - 5} more" if len(diffs) > 5 else "")
        )
    ref_tree, new_tree = jax.tree_util.tree_structure(reference), jax.tree_util.tree_structure(params)
    if ref_tree != new_tree:
        raise ValueError(
            f"update_weights: parameter tree structure (node types/metadata) differs from the {engine}'s: "
            f"{new_tree} vs {ref_tree}"
        )


def _flat(state: nnx.State) -> list[tuple[str, Any]]:
    """``[(dotted name, array)]`` of an ``nnx.State``."""
    return [(".".join(str(getattr(k, "key", k)) for k in path), leaf.get_value() if isinstance(leaf, nnx.Variable)
             else leaf) for path, leaf in nnx.to_flat_state(state)]


def _devices(x: Any) -> str:
    if isinstance(x, jax.Array):
        return "on " + ",".join(str(d) for d in sorted(x.sharding.device_set, key=lambda d: d.id))
    return f"as {type(x).__name__}"


def _what(x: Any) -> str:
    if isinstance(x, nnx.State):
        return "an nnx.State (the JAX layout)"
    if isinstance(x, Mapping):
        return f"a mapping of {len(x)} tensors"
    return f"a {type(x).__name__}"
