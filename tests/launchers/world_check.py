"""One host of a simulated pod: join the JAX world from the JAXRL_* env contract (issue 15), print what it sees.

Run by the fake gcloud's `ssh --worker=i` (tests/launchers/test_simulated_pod.py); prints one JSON line:
process_index, process_count, device_count, local_device_count and `psum`: the sum over every device of
the world of (global device index + 1), computed with `jax.lax.psum` inside `jax.shard_map`.
Stands in for jaxrl.distributed until issue 15 is merged; binds and talks on 127.0.0.1 only.
"""

import json
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

address = os.environ["JAXRL_COORDINATOR_ADDRESS"]
jax.config.update("jax_num_cpu_devices", int(os.environ["JAXRL_LOCAL_DEVICE_COUNT"]))
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(address, int(os.environ["JAXRL_NUM_PROCESSES"]), int(os.environ["JAXRL_PROCESS_ID"]),
                           coordinator_bind_address=address, initialization_timeout=60,
                           heartbeat_timeout_seconds=10, shutdown_timeout_seconds=10)
mesh = Mesh(np.array(jax.devices()), ("d",))
n = jax.device_count()
x = jax.make_array_from_callback((n,), NamedSharding(mesh, P("d")),
                                 lambda idx: np.arange(1, n + 1, dtype=np.float32)[idx])
total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)
print(json.dumps({"process_index": jax.process_index(), "process_count": jax.process_count(), "device_count": n,
                  "local_device_count": jax.local_device_count(),
                  "psum": float(total.addressable_data(0)[0])}), flush=True)
jax.distributed.shutdown()
