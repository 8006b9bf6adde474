"""One host's process in the Ray backend's tests: ``python -m jaxrl.ray_backend.driver --nnodes 2 ... --module
tests.ray_backend.probe -- MODE OUT_DIR``. It joins the world the driver describes (the ``JAXRL_*`` contract,
:func:`jaxrl.distributed.initialize`) and writes what it saw to ``OUT_DIR/rank<i>.json``:

* ``world``: the world's sizes, the devices Ray gave its actor (``CUDA_VISIBLE_DEVICES``) and a ``psum`` over all 4
  devices of integer-valued floats (exact); it then writes ``OUT_DIR/ready-<i>`` and waits for ``OUT_DIR/go`` (the
  test reads the sockets meanwhile), then exits 0.
* ``fail``: rank 1 raises right after joining while rank 0 waits in a barrier (``run_guarded``, as jaxrl.train).
* ``single``: a run of one host (``trainer.nnodes=1``): no world to join (``local``), records its environment.
* ``sigterm``: each process writes ``ready-<i>`` and waits until SIGTERM reached any of them (``any_process``), then
  records whether it got one itself and exits 0 (as the trainer saves and stops).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from jaxrl import distributed
from jaxrl.config import load_config
from tests.distributed.probe import OVERRIDES


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    t0 = time.monotonic()
    while not path.exists():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    mode, out = argv[0], Path(argv[1])
    stop = threading.Event()
    if mode == "sigterm":
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cfg = load_config("configs/quickstart.yaml", [] if mode == "single" else OVERRIDES)
    spec = distributed.initialize(cfg)
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    rank = distributed.process_index()
    res = {"rank": rank, "process_count": distributed.process_count(), "device_count": jax.device_count(),
           "local_device_count": jax.local_device_count(), "mode": spec.mode, "bind": spec.coordinator_bind_address,
           "coordinator": os.environ.get("JAXRL_COORDINATOR_ADDRESS"), "pid": os.getpid(), "ppid": os.getppid(),
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "cwd": os.getcwd(),
           "ray_address": os.environ.get("RAY_ADDRESS"), "launcher": cfg.trainer.launcher,
           "world_env": sorted(k for k in os.environ if k.startswith("JAXRL_") and k != "JAXRL_SHARED")}
    if mode == "fail":
        if rank == 1:
            raise RuntimeError("probe failure on rank 1")
        distributed.barrier("the failed process never comes")
    elif mode == "sigterm":
        (out / f"ready-{rank}").write_text("")
        while not distributed.any_process(stop.is_set()):
            time.sleep(0.1)
        res["stopped_by_signal_here"] = stop.is_set()
    elif mode == "world":
        mesh = Mesh(np.array(jax.devices()), ("x",))
        host = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) * 1.5  # exact in float32, sums too
        x = distributed.to_global(host, jax.sharding.NamedSharding(mesh, P("x")))
        summed = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v.sum(0), "x"), mesh=mesh, in_specs=P("x"),
                                       out_specs=P()))(x)
        got = distributed.to_host(summed)
        res["psum"] = got.tolist()
        res["psum_exact"] = bool(np.array_equal(got, host.sum(0)))
        res["spans_processes"] = not x.is_fully_addressable
        distributed.barrier("probe-ready")
        (out / f"ready-{rank}").write_text("")
        _wait_for(out / "go")
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(distributed.run_guarded(main, sys.argv[1:]))
