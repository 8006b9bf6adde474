"""The two choke points of every device <-> host crossing: :func:`to_host` and :func:`to_global`."""

from __future__ import annotations

from typing import Any


def to_host(tree: Any) -> Any:
    """Every array leaf of ``tree`` as a numpy array (the one device -> host crossing).

    An array laid over devices of several processes is all-gathered first (a collective: every process must call
    this with the same tree); one this process can read (its devices hold all of it, or it is replicated) is
    copied directly. Other leaves go through ``numpy.asarray``.

    Returns:
      the tree with numpy leaves (the same structure; e.g. an ``nnx.State`` stays one).
    """
    import jax
    import numpy as np

    leaves, treedef = jax.tree.flatten(tree)
    if any(_spans_processes(x) for x in leaves):
        from jax.experimental import multihost_utils

        leaves = [multihost_utils.process_allgather(x, tiled=True) if _spans_processes(x) else x for x in leaves]
    fetched = jax.device_get(leaves)
    return jax.tree.unflatten(treedef, [np.asarray(x) for x in fetched])


def _spans_processes(x) -> bool:
    """A ``jax.Array`` whose value this process cannot read on its own."""
    import jax

    return isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated


def to_global(tree: Any, shardings: Any) -> Any:
    """Host values (identical on every process) as global ``jax.Array`` s laid out by ``shardings`` (the one
    host -> device crossing of sharded inputs).

    Args:
      tree: a pytree whose numpy / Python leaves are the same on every process (``[N, ...]`` batch arrays,
        scalars); ``jax.Array`` leaves are returned as they are.
      shardings: a tree prefix of ``tree``: a ``jax.sharding.Sharding`` for each subtree (None leaves a subtree
        unplaced).

    Returns:
      the tree with every host leaf under a sharding replaced by a ``jax.Array`` with that sharding: each process
      builds the pieces its own devices hold, from its own copy (no communication). With one process this equals
      ``jax.device_put(leaf, sharding)``.
    """
    import jax

    def place(sharding, subtree):
        if sharding is None:
            return subtree
        return jax.tree.map(lambda x: _put(x, sharding), subtree)

    return jax.tree.map(place, shardings, tree,
                        is_leaf=lambda s: s is None or isinstance(s, jax.sharding.Sharding))


def _put(x, sharding):
    import jax
    import numpy as np

    if isinstance(x, jax.Array):
        return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
