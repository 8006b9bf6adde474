"""Benchmark: the weight sync across worlds (the hybrid controller) against the translator's sync in one world.

Hybrid: a 2-node Ray cluster on loopback in this process (the tests' ``LocalCluster``: 1 CPU per node), the train
group (2 simulated CPU devices, ``trainer.mesh.fsdp=2``) on one node and the rollout group (2 devices, the embedded
sampler tensor-parallel 2) on the other, built by :func:`jaxrl.hybrid.controller.hybrid_run`; each sync is the
run's own ``RemoteWeightSync.sync(actor.merged_params())``: the train group gathers its weights to host memory and
puts them into Ray's object store, the rollout group receives them from the other node's store and loads them
through its translator. Reported: bytes, and the seconds of the whole sync and of its parts.

In one world (a subprocess with 4 simulated CPU devices): the same policy on a train mesh ``fsdp=2``, the translator's
sync into the embedded sampler (tensor-parallel 2) colocated on the same 2 devices, and split onto 2 others
(:func:`jaxrl.rollout.factory.start_rollout` then ``WeightSync.sync``, as the trainer runs them).

Each case: one warm-up sync (compiles), then the median of ``--syncs`` syncs. Models: the real stories260K and
SmolLM2-135M-Instruct (GGUF dequantized to float32, 540 MB). On one machine every "transfer" is a memory copy (the
object store's node-to-node copy runs over loopback TCP): the numbers compare the paths' overheads; they are not
network measurements.

Run: ``python bench/hybrid_sync.py [--syncs 5]`` (about 3 minutes on 2 cores). Writes ``bench/results/hybrid_sync.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, header_lines, write_section  # noqa: E402

MODELS = {"stories260K": "stories260K",
          "SmolLM2-135M": "${JAXRL_SHARED}/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"}
BASE = ["trainer.mesh.fsdp=2", "trainer.nnodes=1", "trainer.n_gpus_per_node=2", "trainer.logger=[jsonl]",
        "actor_rollout_ref.actor.use_kl_loss=false", "trainer.val_before_train=false",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32"]


def _cfg(model: str, extra: list[str], out: str):
    from jaxrl.config import load_config

    return load_config("configs/quickstart.yaml", [*BASE, f"actor_rollout_ref.model.path={model}",
                                                   f"trainer.default_local_dir={out}", *extra])


def hybrid(model: str, syncs: int) -> dict:
    """The sync across worlds on a 2-node loopback cluster (module docstring)."""
    import ray

    from jaxrl.hybrid.controller import hybrid_run
    from tests.ray_backend.raykit import LocalCluster

    home = Path(tempfile.mkdtemp(prefix="hybrid_sync_home_"))
    cluster = LocalCluster(home, [{"num_cpus": 1}, {"num_cpus": 1}])
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        cfg = _cfg(model, ["trainer.launcher=ray", "actor_rollout_ref.rollout.nnodes=1",
                           "actor_rollout_ref.rollout.n_gpus_per_node=2"], tempfile.mkdtemp(prefix="hybrid_sync_"))
        with hybrid_run(cfg) as (c, _):
            reports = [c.weight_sync.sync(c.actor.merged_params()) for _ in range(syncs + 1)][1:]
    finally:
        ray.shutdown()
        cluster.shutdown()
    med = lambda key: statistics.median(getattr(r, key) for r in reports)  # noqa: E731
    return {"bytes": reports[0].bytes_moved, "seconds": med("seconds"), "gather_s": med("gather_s"),
            "load_s": med("load_s"), "transfer_s": statistics.median(r.seconds - r.gather_s - r.load_s
                                                                     for r in reports)}


def one_world(model: str, syncs: int) -> dict:
    """In a subprocess with 4 CPU devices: the translator's sync colocated (2 devices) and split (2 + 2)."""
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from bench.hybrid_sync import _one_world_child; " \
           f"_one_world_child({model!r}, {syncs})"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _one_world_child(model: str, syncs: int) -> None:
    import jax
    from flax import nnx

    from jaxrl import build
    from jaxrl.rollout.factory import start_rollout
    from jaxrl.workers.placement import make_placement, shard_tree

    out = {}
    for kind in ("colocated", "split"):
        cfg = _cfg(model, [] if kind == "colocated" else ["trainer.placement=split", "trainer.rollout_devices=2",
                                                          "trainer.n_gpus_per_node=4"], tempfile.mkdtemp())
        pre, tokenizer = build._load_policy(cfg.actor_rollout_ref.model)
        graphdef, params = nnx.split(pre.model)
        devices = jax.devices()[:2] if kind == "colocated" else jax.devices()
        placement = make_placement(kind, {"data": 1, "fsdp": 2, "tensor": 1},
                                   rollout_devices=None if kind == "colocated" else 2, rollout_tp=2, devices=devices)
        params, _ = shard_tree(params, placement.train_mesh, placement.rules)
        ws = start_rollout(cfg, pre.config, graphdef, params, tokenizer, mesh=placement.rollout_mesh,
                           rules=placement.rollout_rules, split=False)
        reports = [ws.sync(params) for _ in range(syncs + 1)][1:]
        out[kind] = {"bytes": reports[0].bytes_moved, "seconds": statistics.median(r.seconds for r in reports)}
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--syncs", type=int, default=5)
    args = ap.parse_args()
    records = []
    for name, path in MODELS.items():
        path = os.path.expandvars(path) if "${" in path else path
        t0 = time.perf_counter()
        h = hybrid(path, args.syncs)
        w = one_world(path, args.syncs)
        records.append({"model": name, "hybrid": h, "one_world": w, "wall_s": time.perf_counter() - t0})
        print(name, json.dumps(records[-1]), flush=True)
    lines = header_lines("hybrid_sync: weights across worlds (object store) vs the translator in one world",
                         f"python bench/hybrid_sync.py --syncs {args.syncs}",
                         ["hybrid: 2 Ray nodes on loopback (1 CPU each), train group fsdp=2 on one, rollout group "
                          "tensor=2 on the other; one world: 4 simulated CPU devices in one process",
                          f"each case: the median of {args.syncs} syncs after a warm-up sync"])
    lines += ["| model | path | bytes per sync | seconds per sync | parts | vs colocated |", "|---|---|---|---|---|---|"]
    for r in records:
        h, w = r["hybrid"], r["one_world"]
        base = w["colocated"]["seconds"]
        lines.append(f"| {r['model']} | translator, colocated (2 devices) | {w['colocated']['bytes'] / 1e6:.2f} MB "
                     f"moved | {base:.3f} | one jitted reshard | 1.00x |")
        lines.append(f"| {r['model']} | translator, split 2 + 2 (one world) | {w['split']['bytes'] / 1e6:.2f} MB moved | "
                     f"{w['split']['seconds']:.3f} | device-to-device pieces | {w['split']['seconds'] / base:.2f}x |")
        lines.append(f"| {r['model']} | hybrid: train world -> object store -> rollout world | "
                     f"{h['bytes'] / 1e6:.2f} MB through the store | {h['seconds']:.3f} | gather + put "
                     f"{h['gather_s']:.3f}, store transfer {h['transfer_s']:.3f}, load + translate {h['load_s']:.3f} | "
                     f"{h['seconds'] / base:.2f}x |")
    lines += ["", "The hybrid path copies the whole weights through host memory three times (gather to the train "
              "member's host, the object store's copy to the other node, the rollout member's host to its devices) "
              "where the colocated translator moves only the shards that change devices. On GPUs a "
              "device-to-device path between the two worlds (JAX's transfer server or NCCL) would replace the first "
              "and last copies; it is not built (no GPU was lent to build and measure it)."]
    md, _ = write_section("hybrid_sync", lines, records)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
