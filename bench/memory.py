"""Benchmark: host memory of a GRPO run, per component and per phase (issue 19 item 5).

Runs the trainer's own phases in this process on a config (default ``configs/gsm8k_grpo_smollm2_135m.yaml``: real
GSM8K prompts, the real SmolLM2-135M-Instruct, a KL loss, so actor + reference + AdamW state) for a few steps and
records, for every phase of every step, its wall time, the peak resident set size (RSS, sampled every 10 ms by a
thread), the RSS after it and the bytes of live JAX arrays. The resident arrays are attributed to their owners
(actor parameters, AdamW moments, reference parameters, the rollout engine's weights when they are separate
buffers); the transient peaks of each phase are its peak RSS minus the RSS before it.

This machine's backend is the CPU, so device memory *is* host memory: what a GPU would hold in HBM shows up here
as RSS, and "peak RSS" is what a run's ``perf/cpu_memory_peak_gb`` (VmHWM) reports, not the step-end RSS.

Each step runs as the trainer's does (:mod:`jaxrl.host_memory`): glibc's mmap threshold fixed at 1 MiB before the
build, each phase but the save run as :func:`jaxrl.host_memory.phase_heap` (freed buffers reused inside it, handed
back at its end), the free memory handed back to the OS after every XLA compile, before the update and at the step
end (before the step's RSS is read). ``--save`` adds an asynchronous checkpoint save after every step (before the checkpoint store
handed a finalized save's host copy back to the OS, each save left about the state's size resident).

Run: ``python bench/memory.py`` (about 10 minutes on 2 cores; the data is prepared first if missing), or with
config overrides: ``python bench/memory.py --name packed actor_rollout_ref.model.use_remove_padding=true``.
Writes ``bench/results/memory.md`` (``--name`` adds a section ``memory_<name>``).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

from bench.common import ROOT, WORK_DIR, header_lines, write_section  # noqa: E402

GB = 1024**3
DEFAULT_CONFIG = "configs/gsm8k_grpo_smollm2_135m.yaml"
PHASES = ("gen", "old_log_prob", "ref", "adv", "update_actor", "sync", "step_end", "save", "validate")


class PeakRSS:
    """A thread sampling this process's RSS every ``interval`` seconds; :meth:`reset` starts a new window."""

    def __init__(self, interval: float = 0.01):
        self._proc = psutil.Process()
        self._interval = interval
        self.peak = self.now()
        threading.Thread(target=self._run, daemon=True).start()

    def now(self) -> float:
        return self._proc.memory_info().rss / GB

    def reset(self) -> float:
        self.peak = self.now()
        return self.peak

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.now())
            time.sleep(self._interval)


def tree_gb(tree) -> float:
    import jax

    return sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree)) / GB


def buffer_ids(tree) -> set[int]:
    import jax

    out = set()
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            out.update(s.data.unsafe_buffer_pointer() for s in x.addressable_shards)
    return out


def live_gb() -> float:
    """Bytes of the live JAX arrays, each device buffer once (two ``jax.Array`` objects may share one buffer:
    the sampler's view of the actor's parameters)."""
    import jax

    seen: dict[int, int] = {}
    for a in jax.live_arrays():
        for s in a.addressable_shards:
            seen[s.data.unsafe_buffer_pointer()] = s.data.nbytes
    return sum(seen.values()) / GB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--name", default="", help="section suffix: results go to memory_<name>.md")
    ap.add_argument("--quick", action="store_true", help="1 step (checks the script works)")
    ap.add_argument("--save", action="store_true",
                    help="save a checkpoint after every step (asynchronous, as trainer.save_freq=1 does)")
    ap.add_argument("--val", action="store_true",
                    help="validate after every step (the config's val_max_samples, greedy as its val_kwargs say)")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = ap.parse_args()
    steps = 1 if args.quick else args.steps

    rss = PeakRSS()
    start_rss = rss.now()
    import jax  # noqa: F401  (the imports' share is measured with jax, as a run has it)

    from jaxrl.build import build
    from jaxrl.config.loader import load_config
    from jaxrl.host_memory import phase_heap, release_free_memory, set_up_host_memory
    from jaxrl.trainer import Trainer

    set_up_host_memory(jax.monitoring.register_event_duration_secs_listener)  # as run_training does, before the build

    import_rss = rss.now()
    if "gsm8k" in args.config and not (ROOT / "outputs/data/gsm8k/train.parquet").exists():
        subprocess.run([sys.executable, "-m", "jaxrl.data.prepare", "gsm8k", "--output", "outputs/data/gsm8k"],
                       cwd=ROOT, check=True)
    run_dir = WORK_DIR / "memory" / (args.name or "default")
    shutil.rmtree(run_dir, ignore_errors=True)  # this bench's own folder: a previous run's checkpoints would be newer
    overrides = [*args.overrides, "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
                 "trainer.resume_mode=disable", f"trainer.default_local_dir={run_dir}", "trainer.logger=[console]"]
    if args.save:
        overrides.append("trainer.max_actor_ckpt_to_keep=1")
    cfg = load_config(ROOT / args.config, overrides)

    rss.reset()
    t0 = time.perf_counter()
    c = build(cfg)
    build_s, build_peak, built_rss = time.perf_counter() - t0, rss.peak, rss.now()
    trainer = Trainer(c)
    actor_ids = buffer_ids(c.actor.params)
    engine_params = getattr(c.rollout, "params", None)
    engine_separate = engine_params is not None and not buffer_ids(engine_params) <= actor_ids
    components = {
        "actor parameters": tree_gb(c.actor.params),
        "AdamW state (first and second moments)": tree_gb(c.actor.opt_state),
        "reference parameters": tree_gb(c.ref.params) if c.ref is not None else 0.0,
        "rollout engine weights": tree_gb(engine_params) if engine_separate else 0.0,
    }
    if c.critic is not None:
        components["critic parameters"] = tree_gb(c.critic.params)
        components["critic AdamW state"] = tree_gb(c.critic.opt_state)
    resident_arrays = live_gb()
    components["other live arrays"] = max(resident_arrays - sum(components.values()), 0.0)

    rows = []
    for step in range(1, steps + 1):
        trainer.step = step
        batch = metrics = None
        for name in PHASES:
            skipped = ((name == "old_log_prob" and not cfg.actor_rollout_ref.actor.recompute_old_log_prob)  # on-policy
                       or (name == "ref" and c.ref is None) or (name == "save" and not args.save)
                       or (name == "validate" and not args.val))
            if skipped:
                continue
            if name == "update_actor":  # as Trainer.train_step: freed memory back to the OS before the update
                release_free_memory()
            before = rss.reset()
            t = time.perf_counter()
            # every phase but the save runs as the trainer's timed phases do (jaxrl.metrics.timed: phase_heap)
            with contextlib.nullcontext() if name == "save" else phase_heap():
                if name == "gen":
                    batch, metrics = c.experience.make_experience(c.train_data, seed=trainer._seed(), timings={})
                elif name == "old_log_prob":
                    batch.old_log_probs, _ = c.actor.compute_log_probs(batch)
                elif name == "ref":
                    batch.ref_log_probs, _ = c.ref.compute_log_probs(batch)
                elif name == "adv":
                    batch.token_level_rewards = trainer._apply_kl_in_reward(batch, metrics)
                    batch.advantages, batch.returns = trainer._advantages(batch)
                elif name == "update_actor":
                    c.actor.update(batch)
                elif name == "sync":
                    trainer.sync_rollout()
                elif name == "step_end":  # what Trainer.train_step does before reading perf/cpu_memory_used_gb
                    release_free_memory()
                elif name == "save":  # after the step, as TrainingLoop.fit saves
                    if not trainer.save_checkpoint():
                        raise SystemExit(f"step {step}: the checkpoint save did not start (see the log above)")
                elif name == "validate":  # after the step, as TrainingLoop.fit validates every test_freq steps
                    trainer.validate()
            rows.append(dict(step=step, phase=name, seconds=time.perf_counter() - t, before_gb=before,
                             peak_gb=rss.peak, after_gb=rss.now(), live_gb=live_gb(),
                             rows=int(batch.size), prompt_width=int(batch.prompt_width),
                             response_width=int(batch.response_ids.shape[1]),
                             real_tokens=int(batch.prompt_mask.sum() + batch.response_mask.sum())))
            print(f"step {step} {name:13s} {rows[-1]['seconds']:7.1f} s  peak {rows[-1]['peak_gb']:.2f} GB  "
                  f"after {rows[-1]['after_gb']:.2f} GB  live arrays {rows[-1]['live_gb']:.2f} GB", flush=True)
    c.store.close()
    c.reward.close()
    if c.lock is not None:
        c.lock.release()

    peak = max([build_peak] + [r["peak_gb"] for r in rows])
    last = rows[-1]
    model_cfg = c.model_cfg
    cache_rows = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    kv_gb = (2 * model_cfg.num_hidden_layers * cache_rows * (cfg.data.max_prompt_length + cfg.data.max_response_length)
             * model_cfg.num_key_value_heads * model_cfg.head_dim * 4) / GB

    def transient(phase: str) -> float:
        vals = [r["peak_gb"] - r["before_gb"] for r in rows if r["phase"] == phase]
        return max(vals) if vals else 0.0

    cmd = "python bench/memory.py" + (f" --config {args.config}" if args.config != DEFAULT_CONFIG else "") + (
        f" --name {args.name}" if args.name else "") + (
        " --save" if args.save else "") + (" --val" if args.val else "") + "".join(
        f" {o}" for o in args.overrides)
    lines = header_lines(
        "Host memory of a GRPO run, per component and phase" + (f" ({args.name})" if args.name else ""), cmd,
        [f"config: `{args.config}` + {args.overrides or 'no overrides'}, {steps} steps, "
         + ("validation after every step, " if args.val else "validation off, ")
         + ("an asynchronous checkpoint save after every step (the store hands its host copy back to the OS once "
            "the save is finalized), " if args.save else "no checkpoint saves, ")
         + "as the trainer does (jaxrl.host_memory): glibc's mmap threshold fixed at 1 MiB, each phase but the save "
         + "reusing freed buffers in the heap and handing them back at its end, free memory handed back "
           "to the OS after every compile, before the update and at each step end",
         f"rows per step: {cache_rows}; model: {model_cfg.model_type}, {model_cfg.num_hidden_layers} layers, "
         f"params {tree_gb(c.actor.params) * GB / 4 / 1e6:.1f} M (float32)",
         "RSS sampled every 10 ms; CPU backend, so device arrays are host memory"])
    lines += ["### Where the memory goes", "", "| component | GB | how measured |", "|---|---|---|",
              f"| interpreter + imports (jax, jaxrl) | {import_rss:.2f} | RSS after the imports ({start_rss:.2f} at "
              "start) |"]
    for k, v in components.items():
        how = "bytes of its live arrays" if k != "other live arrays" else "live arrays not attributed above"
        if k == "rollout engine weights" and not engine_separate:
            how = "none: the sampler holds the actor's own buffers (colocated, no copy)"
        lines.append(f"| {k} | {v:.2f} | {how} |")
    lines += [
        f"| model load, tokenizer, data, compiled programs, allocator | {built_rss - import_rss - resident_arrays:.2f}"
        " | RSS after build minus the imports and the live arrays |",
        f"| sampler KV cache (transient, gen) | {kv_gb:.2f} | 2 x layers x rows x (prompt + response) x kv heads x "
        f"head dim x 4 B; measured gen peak over its start: {transient('gen'):.2f} |",
        f"| log-prob forward temporaries (transient) | {transient('old_log_prob'):.2f} | old_log_prob peak minus its "
        "start |",
        f"| reference forward temporaries (transient) | {transient('ref'):.2f} | ref peak minus its start |",
        f"| update temporaries: gradients, activations (transient) | {transient('update_actor'):.2f} | update peak "
        "minus its start |",
        *([f"| validation temporaries: greedy generation of the validation set, scoring (transient) | "
           f"{transient('validate'):.2f} | validate peak minus its start |"] if args.val else []),
        f"| **peak RSS of the run** | **{peak:.2f}** | max over build and every phase |",
        f"| RSS after the last step | {last['after_gb']:.2f} | |",
        "| RSS at each step end | " + " / ".join(f"{r['after_gb']:.2f}" for r in rows if r["phase"] == "step_end")
        + f" | after phase `step_end` of steps 1-{steps} |",
        "",
        "### Per phase", "",
        "| step | phase | s | RSS before | peak | after | live arrays | P / R | real tokens |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| - | build | {build_s:.1f} | {import_rss:.2f} | {build_peak:.2f} | {built_rss:.2f} | {resident_arrays:.2f} "
        "| - | - |",
    ]
    for r in rows:
        lines.append(f"| {r['step']} | {r['phase']} | {r['seconds']:.1f} | {r['before_gb']:.2f} | {r['peak_gb']:.2f} "
                     f"| {r['after_gb']:.2f} | {r['live_gb']:.2f} | {r['prompt_width']} / {r['response_width']} | "
                     f"{r['real_tokens']} |")
    name = "memory" + (f"_{args.name}" if args.name else "")
    md, _ = write_section(name, lines, {"components": components, "import_gb": import_rss, "built_gb": built_rss,
                                        "peak_gb": peak, "kv_cache_gb": kv_gb, "phases": rows,
                                        "overrides": args.overrides, "save": args.save})
    print(f"peak RSS {peak:.2f} GB; wrote {md}")


if __name__ == "__main__":
    main()
