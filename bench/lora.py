"""Benchmark: LoRA vs full fine-tuning of the actor on SmolLM2-135M -- peak host memory, update time, what a
checkpoint and a weight sync carry.

Each mode (``full``, ``lora-r8``, ``lora-r64``) runs in its own process (so peak RSS is its own), built by the
trainer's own construction path (``jaxrl.build._build_actor_and_reference`` from a config the loader validated:
GRPO with verl's KL loss, ``low_var_kl``, so full fine-tuning holds a reference copy and LoRA the base once), on
the real SmolLM2-135M-Instruct (shared GGUF dequantized to float32, ``bench/models.py``). Per mode:

* **update**: ``ActorWorker.update`` on ``B`` rows x (``P`` prompt + ``R`` response) tokens (the workload's
  prompts, random responses, ``bench/_jaxrl_bench.py:synthetic_batch``), micro-batches of ``micro`` rows, one AdamW
  step; one un-timed update (compile), then the median (min-max) of ``--repeats`` timed updates.
* **peak RSS**: ``ru_maxrss`` of the process after the updates (CPU: device memory is host memory, so this holds
  the base weights, the reference copy (full only), gradients, AdamW moments, activations and XLA's buffers), and
  the RSS right after the model load for comparison.
* **trained / optimizer / checkpoint bytes**: the trained arrays, the optimizer state, and what a checkpoint saves
  (``role.state()`` arrays: params + optimizer state).
* **sync bytes**: what a weight sync to the rollout engine carries: merged weights (the whole base tree, what the
  embedded sampler and vLLM get today) vs the adapters alone (what vLLM's LoRA adapter loading would take), and
  the time of the jitted merge (``ActorWorker.merged_params``).

Run: ``python bench/lora.py`` (about 10 min on a quiet 2-core box) or ``--quick``. Writes
``bench/results/lora.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, fmt_stats, header_lines, stats, write_section  # noqa: E402

MODES = {"full": 0, "lora-r8": 8, "lora-r64": 64}


def _rss_mb() -> float:
    """The current resident set size in MB (``/proc/self/statm``)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


def _nbytes(tree) -> int:
    import jax
    import numpy as np

    return int(sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def child(mode: str, rows: int, p: int, r: int, micro: int, repeats: int) -> dict:
    """One mode in this process; returns its record (see the module docstring)."""
    import jax
    from flax import nnx

    from bench._jaxrl_bench import synthetic_batch
    from bench.models import ensure_models
    from jaxrl.build import _build_actor_and_reference
    from jaxrl.config import load_config
    from jaxrl.models import load_pretrained
    from jaxrl.models.lora import adapter_bytes

    model_dir = ensure_models(["smollm2-135m"])["smollm2-135m"]
    rank = MODES[mode]
    overrides = [
        "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.n=1", f"data.train_batch_size={rows}",
        f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.actor.ppo_mini_batch_size={rows}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.model.dtype=float32", "actor_rollout_ref.model.param_dtype=float32",
        f"actor_rollout_ref.actor.optim.lr={1e-6 if rank == 0 else 1e-5}",
        f"actor_rollout_ref.model.lora_rank={rank}", "actor_rollout_ref.model.lora_alpha=16",
    ]
    cfg = load_config(None, overrides)
    pre = load_pretrained(str(model_dir))
    rss_loaded = _rss_mb()
    graphdef, params = nnx.split(pre.model)
    base_bytes = _nbytes(params)
    actor, ref = _build_actor_and_reference(cfg, graphdef, params, 100)
    tokenizer, vocab = pre.tokenizer, pre.config.vocab_size
    del pre, params
    batch = synthetic_batch(tokenizer, rows, p, r, vocab)
    batch.ref_log_probs, _ = ref.compute_log_probs(batch)
    batch.old_log_probs, _ = actor.compute_log_probs(batch)
    t0 = time.perf_counter()
    actor.update(batch)
    warm = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        actor.update(batch)  # returns host floats: blocks
        times.append(time.perf_counter() - t0)
    merge_s = None
    if actor.lora is not None:
        jax.block_until_ready(actor.merged_params())  # compile
        t0 = time.perf_counter()
        jax.block_until_ready(actor.merged_params())
        merge_s = time.perf_counter() - t0
    arrays, _ = actor.state()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # KB on Linux -> MB
    return {
        "mode": mode, "rank": rank, "rows": rows, "prompt_width": p, "response_len": r, "micro_rows": micro,
        "update_s": stats(times), "raw_update_s": times, "warmup_s": warm,
        "peak_rss_mb": peak, "rss_after_load_mb": rss_loaded,
        "trained_params": int(sum(x.size for x in jax.tree.leaves(actor.params))),
        "trained_bytes": _nbytes(actor.params), "optimizer_bytes": _nbytes(actor.opt_state),
        "checkpoint_bytes": _nbytes(arrays), "base_bytes": base_bytes,
        "reference_copy": ref.params is not actor.frozen,
        "sync_bytes_merged": base_bytes,
        "sync_bytes_adapters": adapter_bytes(actor.params) if actor.lora is not None else None,
        "merge_s": merge_s, "targets": len(actor.lora.targets) if actor.lora is not None else None,
    }


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rows / tokens / repeats (checks that it runs)")
    ap.add_argument("--repeats", type=int, default=None, help="timed updates per mode (default 5; quick 2)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--shape", type=int, nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    rows, p, r, micro = (8, 32, 32, 8) if args.quick else (16, 32, 64, 8)
    if args.child:
        rows, p, r, micro = args.shape
        print("RECORD " + json.dumps(child(args.child, rows, p, r, micro, repeats)), flush=True)
        return
    load_before = os.getloadavg()
    records = []
    for mode in args.modes:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--shape", str(rows), str(p), str(r),
               str(micro), "--repeats", str(repeats)]
        print(f"{mode}: {' '.join(cmd[2:])}", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
        rec = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RECORD "))[len("RECORD "):])
        records.append(rec)
        print(f"  update {fmt_stats(rec['update_s'], 3)} s, peak RSS {rec['peak_rss_mb']:.0f} MB, trained "
              f"{rec['trained_params']:,} params", flush=True)
    load_after = os.getloadavg()
    command = "python bench/lora.py" + (" --quick" if args.quick else "")
    lines = header_lines(
        "lora — LoRA vs full fine-tuning (SmolLM2-135M actor)", command,
        [f"workload: {rows} rows x ({p} prompt + {r} response) tokens, micro-batches of {micro}, one AdamW update, "
         "GRPO clipped loss + low_var_kl KL loss, float32, no remat; each mode in its own process",
         f"load average (1/5/15 min) before {load_before[0]:.1f}/{load_before[1]:.1f}/{load_before[2]:.1f}, "
         f"after {load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f} (2 cores shared: times are noisy)"])
    lines += [
        "| mode | trained params | optimizer state MB | checkpoint MB | reference | peak RSS MB (after load) "
        "| update s, median (min-max) | sync MB merged | sync MB adapters | merge s |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        lines.append(
            f"| {rec['mode']} | {rec['trained_params']:,} | {_mb(rec['optimizer_bytes'])} | "
            f"{_mb(rec['checkpoint_bytes'])} | {'copy' if rec['reference_copy'] else 'the frozen base (no copy)'} | "
            f"{rec['peak_rss_mb']:.0f} ({rec['rss_after_load_mb']:.0f}) | {fmt_stats(rec['update_s'], 3)} | "
            f"{_mb(rec['sync_bytes_merged'])} | {_mb(rec['sync_bytes_adapters'])} | "
            f"{'-' if rec['merge_s'] is None else f'{rec['merge_s']:.3f}'} |")
    lines += [
        "",
        "Reading: LoRA keeps the base once (the reference is the base with the adapters off) and AdamW moments for "
        "the adapters only, so optimizer state and checkpoints shrink by two to three orders of magnitude; peak "
        "memory drops by the reference copy, the full gradient and the full AdamW moments. The update still runs "
        "the whole forward and backward through the frozen base (activations' gradients are needed), so its time "
        "moves far less than its memory.",
        "",
        "Weight sync: jaxrl syncs merged weights (`W + (alpha/r) A B`, one jitted merge, then the translator as for "
        "full fine-tuning) to every engine. vLLM's LoRA adapter loading would move only the adapter bytes (the "
        "'adapters' column, measured from the trained arrays; not run here: no vLLM in this environment), but vLLM "
        "then computes the LoRA matmuls at every decode step (punica kernels, `enable_lora`, `max_lora_rank`) and "
        "the base still has to be loaded once. Merged sync keeps the rollout engines' fast path, the existing "
        "translator and one code path for all engines; the bytes it moves are what full fine-tuning moves today.",
    ]
    write_section("lora", lines, records)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
