"""The training layout of a decoder's layers: every block weight stacked along a leading ``[L, ...]`` axis.

The rematerialised training forward runs the blocks as one ``lax.scan`` over their weights stacked along a new
leading axis (:meth:`jaxrl.models.decoder.Decoder._remat_scan`). When the weights are stored per layer (the layout
every loader, exporter, translator and rollout engine reads), that stacked copy is made inside every gradient
program and the gradient comes back stacked and is sliced into per-layer arrays: on SmolLM2-135M two 0.42 GB
buffers among the update's temporaries (XLA's buffer assignment, bench/results/summary.md). A trained role therefore
holds its model in the *scan layout* (MaxText's ``scan_layers``): each :class:`~jaxrl.models.decoder.Decoder`'s
``layers`` become one :class:`~jaxrl.models.decoder.StackedBlocks` whose block holds ``[L, ...]`` parameters, so the
scan reads the stored weights and the gradient and the AdamW moments have the same stacked tree.

The per-layer layout stays what everything outside the update reads (the rollout engine's weights, the Hugging Face
export): :func:`unstack_layers` gives it back (traceable) and :func:`unstacked_copy` on concrete arrays, copying the
stacked layers only.

State trees: per layer ``state["layers"][i][...]``; scan layout ``state["layers"]["block"][...]`` (leaves ``[L,
...]``, logical sharding names with a leading ``None``: the layer axis is never sharded).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.decoder import Decoder, StackedBlocks

__all__ = ["is_scan_layout", "stack_layers", "unstack_layers", "unstacked_copy"]


def _names(var: nnx.Variable):
    meta = var.get_metadata()
    names = meta.get("out_sharding")
    return tuple(names) if names else None


def _stacked_var(vars_: tuple[nnx.Variable, ...]) -> nnx.Variable:
    """One Variable ``[L, ...]`` from ``L`` like Variables (their logical names get a leading ``None``)."""
    v0 = vars_[0]
    value = jnp.stack([v[...] for v in vars_])
    names = _names(v0)
    return v0.replace(value) if names is None else v0.replace(value, out_sharding=(None, *names))


def _layer_var(var: nnx.Variable, i: int) -> nnx.Variable:
    """Layer ``i`` of a stacked Variable (the leading ``None`` dropped from its logical names)."""
    names = _names(var)
    value = var[...][i]
    return var.replace(value) if names is None else var.replace(value, out_sharding=names[1:])


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _decoders(model: nnx.Module) -> list[Decoder]:
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, Decoder)]


def stack_layers(graphdef, state) -> tuple[Any, Any] | None:
    """The model ``nnx.merge(graphdef, state)`` with every decoder's blocks in the scan layout.

    A decoder qualifies when its ``remat`` is on (the training forward is then the scan) and all its blocks have one
    structure (LoRA adapters on some layers only do not); others keep their per-layer blocks.

    Args:
      graphdef, state: ``nnx.split`` of a model holding one or more :class:`Decoder` (a policy, a value model).

    Returns:
      ``(graphdef, state)`` of the model in the scan layout (the stacked weights are new arrays; the rest of
      ``state``'s arrays are shared, not copied), or None when no decoder qualifies.
    """
    if not isinstance(graphdef, nnx.GraphDef):  # not an nnx model (a test's bare pytree)
        return None
    model = nnx.merge(graphdef, state)  # the same arrays
    changed = False
    for dec in _decoders(model):
        if isinstance(dec.layers, StackedBlocks) or not dec.remat or len(dec.layers) < 2:
            continue
        splits = [nnx.split(block) for block in dec.layers]
        block_graphdef = splits[0][0]
        if any(g != block_graphdef for g, _ in splits[1:]):
            continue
        stacked = jax.tree.map(lambda *vs: _stacked_var(vs), *(s for _, s in splits), is_leaf=_is_var)
        dec.layers = StackedBlocks(nnx.merge(block_graphdef, stacked), len(splits))
        changed = True
    return nnx.split(model) if changed else None


def is_scan_layout(tree) -> bool:
    """Whether ``tree`` (an ``nnx.State``, its optimizer state, a pytree over either) holds any decoder's layers in
    the scan layout: a ``layers`` entry whose child is ``block``."""
    for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_var)[0]:
        keys = [getattr(k, "key", None) for k in path]
        if any(a == "layers" and b == "block" for a, b in zip(keys, keys[1:])):
            return True
    return False


def _plain(node):
    """Nested ``nnx.State`` -> nested dicts (as a State's own mapping holds them), Variables kept."""
    if isinstance(node, (dict, nnx.State)):
        return {k: _plain(v) for k, v in node.items()}
    return node


def _unstack_block(block) -> dict:
    """``{0: ..., L-1: ...}``: layer ``i``'s slice of every stacked leaf of one ``StackedBlocks`` state."""
    num = jax.tree.leaves(block, is_leaf=_is_var)[0].shape[0]
    return {i: _plain(jax.tree.map(lambda v, i=i: _layer_var(v, i), block, is_leaf=_is_var)) for i in range(num)}


_UNSTACK_BLOCK = jax.jit(_unstack_block)


def _map_layers(state, fn):
    """``state`` with every ``layers`` entry holding ``{"block": ...}`` replaced by ``fn(block)``; other leaves are
    the same objects (not copied). A state without stacked layers is returned unchanged."""

    def convert(node):
        if not isinstance(node, (dict, nnx.State)):
            return node
        out = {}
        for key, value in node.items():
            if key == "layers" and isinstance(value, (dict, nnx.State)) and "block" in value:
                out[key] = fn(value["block"])
            else:
                out[key] = convert(value)
        return out

    if not is_scan_layout(state):
        return state
    return nnx.State(convert(state))


def unstack_layers(state):
    """The per-layer state of a scan-layout ``state`` (traceable).

    Every ``layers`` entry holding ``{"block": ...}`` becomes ``{0: ..., 1: ..., L-1: ...}`` with layer ``i``'s slice
    of each stacked leaf; the result is what ``nnx.split`` of the per-layer model gives (its graphdef is the model's
    own). A state without stacked layers is returned unchanged.
    """
    return _map_layers(state, _unstack_block)


def unstacked_copy(state):
    """:func:`unstack_layers` on concrete arrays, copying only the stacked layer weights (one jitted program per
    block structure); the embedding, the final norm and any other leaf are ``state``'s own arrays, not copies."""
    return _map_layers(state, _UNSTACK_BLOCK)
