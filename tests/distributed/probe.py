"""One process of a test world: ``python -m jaxrl.launch --nproc 2 --local-devices 2 --module tests.distributed.probe
-- MODE OUT_DIR``. It joins the world the launcher describes through :func:`jaxrl.distributed.initialize` (the
``JAXRL_*`` contract), does what ``MODE`` says and writes what it saw to ``OUT_DIR/rank<i>.json``:

* ``world``: the world's sizes; then, after ``OUT_DIR/ready-<i>`` and until the test writes ``OUT_DIR/go`` (so the
  test can look at the sockets while the world is up): a sharded matmul and a ``psum`` against numpy, the
  ``to_global`` / ``to_host`` round trip, an orbax save (:class:`jaxrl.checkpoint.CheckpointStore`) in one sharding
  restored into another, ``run_on_primary`` (a result, an exception with keyword-only attributes),
  ``any_process`` / ``all_processes``, ``check_replicas`` on equal and unequal batches, ``check_shared_dir``.
* ``fail``: rank 1 raises right after joining while rank 0 waits in a barrier (``run_guarded``, as ``jaxrl.train``).
* ``sigterm``: each process waits (writing ``ready-<i>``) until SIGTERM reached any of them (``any_process``), then
  records it and exits 0.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from jaxrl import distributed
from jaxrl.config import load_config

OVERRIDES = ["trainer.nnodes=2", "trainer.n_gpus_per_node=2", "trainer.mesh.fsdp=4",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"]


class ProbeError(RuntimeError):
    """An exception whose ``__init__`` takes keyword-only arguments (does not unpickle as itself)."""

    def __init__(self, message: str, *, step: int, where: Path):
        super().__init__(message)
        self.step = step
        self.where = where


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    t0 = time.monotonic()
    while not path.exists():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


def world(out: Path, rank: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    res: dict = {}
    distributed.barrier("probe-ready")  # a first collective: the collectives' connections are open now
    (out / f"ready-{rank}").write_text("")
    _wait_for(out / "go")

    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows, cols, repl = NamedSharding(mesh, P("x")), NamedSharding(mesh, P(None, "x")), NamedSharding(mesh, P())
    rng = np.random.default_rng(0)  # the same host values on every process
    a = rng.standard_normal((8, 8)).astype(np.float32)
    b = rng.standard_normal((8, 4)).astype(np.float32)

    # matmul with rows of a over the 4 devices of both processes; the result's rows stay sharded
    ga, gb = distributed.to_global((a, b), (rows, repl))
    res["a_spans_processes"] = not ga.is_fully_addressable
    prod = jax.jit(jnp.matmul, out_shardings=rows)(ga, gb)
    res["matmul_err"] = float(np.abs(distributed.to_host(prod) - a @ b).max())

    # psum over the mesh axis: every device contributes its 2 rows
    summed = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x.sum(0), "x"), mesh=mesh, in_specs=P("x"),
                                   out_specs=P()))(ga)
    res["psum_err"] = float(np.abs(distributed.to_host(summed) - a.sum(0)).max())

    # to_global -> to_host is the identity for every layout (and leaves non-array leaves numpy)
    tree = {"w": rng.standard_normal((8, 8)).astype(np.float32), "v": np.arange(48, dtype=np.int32).reshape(4, 12),
            "s": np.float32(3.5)}
    for name, sh in (("rows", {"w": rows, "v": rows, "s": repl}), ("cols", {"w": cols, "v": cols, "s": repl}),
                     ("replicated", repl)):
        back = distributed.to_host(distributed.to_global(tree, sh))
        res[f"roundtrip_{name}"] = all(np.array_equal(back[k], tree[k]) for k in tree)

    # orbax: save rows-sharded, restore column-sharded and replicated
    from jaxrl.checkpoint import CheckpointStore

    store = CheckpointStore(out / "ckpt", max_to_keep=None, async_save=True)
    store.save(1, arrays={"actor": {"params": {"w": ga}}}, meta={"step": 1, "note": "probe"}, wait=True)
    for name, sh in (("cols", cols), ("replicated", repl)):
        like = {"actor": {"params": {"w": jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)}}}
        step, arrays, meta = store.restore(like=like)
        w = arrays["actor"]["params"]["w"]
        res[f"restore_{name}"] = (step == 1 and meta["note"] == "probe" and w.sharding == sh
                                  and np.array_equal(distributed.to_host(w), a))
    res["steps_listed"] = store.steps()
    store.close()

    # run_on_primary: the primary's result, and its exception on everyone
    res["shared_result"] = distributed.run_on_primary(lambda: {"rank": distributed.process_index()})
    try:
        def boom():
            raise ProbeError("probe failure on the primary", step=7, where=out)

        distributed.run_on_primary(boom)
        res["shared_error"] = None
    except ProbeError as e:
        res["shared_error"] = [type(e).__name__, str(e), e.step, str(e.where)]

    res["any_process"] = distributed.any_process(rank == 1)
    res["all_processes"] = distributed.all_processes(rank == 1)

    ids = np.arange(12, dtype=np.int32).reshape(3, 4)
    distributed.check_replicas(3, ids, ids > 4)  # equal everywhere: no error
    try:
        distributed.check_replicas(7, ids + (rank == 1), ids > 4)
        res["divergence"] = None
    except distributed.ReplicaDivergenceError as e:
        res["divergence"] = str(e)

    distributed.check_shared_dir(out)
    res["shared_dir_clean"] = not list(out.glob(".jaxrl-shared-check-*"))
    return res


def main(argv: list[str]) -> int:
    mode, out = argv[0], Path(argv[1])
    stop = threading.Event()
    if mode == "sigterm":  # before joining: initialize must leave it in place (jax's preemption notifier takes it)
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cfg = load_config("configs/quickstart.yaml", OVERRIDES)
    spec = distributed.initialize(cfg)
    import jax

    rank = distributed.process_index()
    res = {"rank": rank, "process_count": distributed.process_count(), "device_count": jax.device_count(),
           "local_device_count": jax.local_device_count(), "primary": distributed.is_primary(),
           "mode": spec.mode, "bind": spec.coordinator_bind_address}
    if mode == "world":
        res.update(world(out, rank))
    elif mode == "fail":
        if rank == 1:
            raise RuntimeError("probe failure on rank 1")
        distributed.barrier("the failed process never comes")
    elif mode == "sigterm":
        (out / f"ready-{rank}").write_text("")
        while not distributed.any_process(stop.is_set()):
            time.sleep(0.1)
        res["stopped_by_signal_here"] = stop.is_set()
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(distributed.run_guarded(main, sys.argv[1:]))
