"""Benchmark: the GSM8K GRPO step on SmolLM2-135M (ragged real prompts, responses stopping at EOS) per variant.

Each variant is the real CLI, ``python -m jaxrl.train --config configs/gsm8k_grpo_smollm2_135m.yaml`` (4 prompts x
n = 4 per step, prompts <= 256 tokens, responses <= 128, KL loss against the reference) for ``--steps`` steps with
validation and checkpoints off, run one after another in this invocation:

* ``as-shipped``: the config file without overrides (since 12-05: the prefix grouper, 1024-token micro-batches,
  no old-log-prob pass, selective recomputation in the update);
* ``padded``: micro-batches of 4 rows padded to the bucketed prompt width + 128, with the old-log-prob pass (the config
  as shipped until ``use_prefix_grouper``);
* ``prefix-grouper``: ``padded`` with ``actor.use_prefix_grouper=true`` (packed rows, each prompt laid once for its
  4 responses in the update, the old-log-prob and the reference passes; micro-batches of 4 and 8 rows = 1 and 2
  prompts): the config as shipped on 12-04;
* ``prefix-grouper-on-policy`` / ``prefix-grouper-budget`` / ``prefix-grouper-budget-on-policy``: the prefix grouper
  without the old-log-prob pass, with 1024-token micro-batches (``use_dynamic_bsz``), or both (what the config ships,
  spelled out);
* ``packed``: ``padded`` with ``use_remove_padding`` + ``use_dynamic_bsz`` (packed rows, 1024-token micro-batches);
* ``on-policy``: ``padded`` with ``actor.recompute_old_log_prob=false``: the config makes one on-policy update per
  step, so the update's own (detached) log-probs are the old ones and the separate old-log-prob pass is skipped, as
  TRL and Tunix do at one iteration (same loss and gradient);
* ``bf16-rollout`` / ``bf16-rollout-on-policy`` / ``as-shipped-bf16-rollout``: ``padded`` / ``on-policy`` /
  ``as-shipped`` with ``rollout.dtype=bfloat16`` (the sampler's weight matrices and matmuls in bfloat16 with float32
  accumulation, verl's default rollout dtype; the update and the log-prob passes stay float32). Its samples differ
  from the float32 rollout's (bfloat16 rounding flips some sampled tokens), so compare the per-token times too;
* ``as-shipped-full-recompute`` / ``as-shipped-selective-recompute``: ``as-shipped`` with the update's layers
  recomputed whole in the backward (``model.recompute_granularity=full``) or with their projection outputs kept
  (``selective``);
* ``padded@REV`` (``--baseline-rev REV``): the config as shipped, without overrides (revisions before the packing
  work refuse the dynamic-batch keys), run by the code of git revision ``REV`` (a detached worktree under
  ``outputs/bench/``), e.g. ``cd79688``, the code when issue 19 was filed, to compare with "today's" step.

Reported per variant: the median step time over the steps after the first (the first compiles), its phases,
the first step, the response length and real tokens per step, and the peak ``perf/cpu_memory_used_gb`` (RSS).
Every variant sees the same prompts (same seed), and the sampled responses agree between the float32-rollout
variants (identical rollout code and weights), so the work per step is the same and ratios are meaningful.

``--rounds N`` runs every variant and the baseline N times, interleaved (round ``i`` runs each once, the order
rotated by ``i``), and reports each ratio to the baseline as the median of the per-round ratios: on a VM whose speed
drifts by up to 1.5x within an hour (the baseline's two steps in one run: 113 and 176 s), runs far apart in time do
not compare.

Run: ``python bench/gsm8k_step.py [--steps 4] [--baseline-rev cd79688] [--rounds 2]`` (about 7 minutes per variant
and round on 2 cores).
Writes ``bench/results/gsm8k_step.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, WORK_DIR, header_lines, write_section  # noqa: E402

CONFIG = "configs/gsm8k_grpo_smollm2_135m.yaml"
OLD_PASS = "actor_rollout_ref.actor.recompute_old_log_prob=true"
NO_OLD_PASS = "actor_rollout_ref.actor.recompute_old_log_prob=false"
PADDED = ["actor_rollout_ref.model.use_remove_padding=false", "actor_rollout_ref.actor.use_dynamic_bsz=false",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
          "actor_rollout_ref.actor.use_prefix_grouper=false", OLD_PASS]  # padded rows, every prompt once per response
PACKED = ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024", "actor_rollout_ref.actor.use_prefix_grouper=false",
          OLD_PASS]


def on_policy(overrides: list[str]) -> list[str]:
    """``overrides`` with the old-log-prob pass switched off (``actor.recompute_old_log_prob=false``)."""
    return [*(o for o in overrides if o != OLD_PASS), NO_OLD_PASS]


ON_POLICY = on_policy(PADDED)
# the config as shipped from 12-04 to 12-05 (prefix grouper, fixed 4-row micro-batches, the old-log-prob pass)
PREFIX_GROUPER = [*(o for o in PADDED if "use_prefix_grouper" not in o),
                  "actor_rollout_ref.actor.use_prefix_grouper=true"]
# the prefix grouper with token-budget micro-batches (update, old-log-prob and reference passes alike)
PREFIX_GROUPER_BUDGET = ["actor_rollout_ref.actor.use_prefix_grouper=true",
                         "actor_rollout_ref.actor.use_dynamic_bsz=true",
                         "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024"]
BF16_ROLLOUT = "actor_rollout_ref.rollout.dtype=bfloat16"
FULL_RECOMPUTE = "actor_rollout_ref.model.recompute_granularity=full"
SELECTIVE_RECOMPUTE = "actor_rollout_ref.model.recompute_granularity=selective"
VARIANTS = {"packed": PACKED, "padded": PADDED, "prefix-grouper": PREFIX_GROUPER, "on-policy": ON_POLICY,
            "prefix-grouper-on-policy": on_policy(PREFIX_GROUPER),
            "prefix-grouper-budget": [*PREFIX_GROUPER_BUDGET, OLD_PASS],
            # what the config ships since 12-05, spelled out
            "prefix-grouper-budget-on-policy": on_policy(PREFIX_GROUPER_BUDGET),
            "as-shipped": [],  # the config file without overrides
            "as-shipped-full-recompute": [FULL_RECOMPUTE],
            "as-shipped-selective-recompute": [SELECTIVE_RECOMPUTE],
            "bf16-rollout": [*PADDED, BF16_ROLLOUT],
            "bf16-rollout-on-policy": [*ON_POLICY, BF16_ROLLOUT],
            "as-shipped-bf16-rollout": [BF16_ROLLOUT]}
PHASES = ("gen", "old_log_prob", "ref", "update_actor")


def worktree(rev: str) -> Path:
    """A detached checkout of ``rev`` under ``outputs/bench/rev-<rev>`` (made once)."""
    path = WORK_DIR / f"rev-{rev}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True,
                       capture_output=True)
    return path


def run_variant(name: str, overrides: list[str], steps: int, code: Path = ROOT, round_: int = 0) -> dict:
    """One training process of ``steps`` steps (the CLI, ``code``'s revision): its step times, phases, lengths."""
    out = WORK_DIR / "gsm8k_step" / f"{name.replace('@', '-at-')}-r{round_}"
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    data = ROOT / "outputs" / "data" / "gsm8k"  # absolute: an older revision runs from its own worktree
    # the config of the code that runs (an older revision's as it shipped it: keys added since would be unknown there)
    cmd = [sys.executable, "-m", "jaxrl.train", "--config", str(code / CONFIG), *overrides,
           f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
           f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
           "trainer.save_freq=-1", "trainer.resume_mode=disable", f"trainer.default_local_dir={out}",
           "trainer.logger=[console,jsonl]"]
    env = dict(os.environ, PYTHONPATH=str(code), JAXRL_SHARED=os.environ.get("JAXRL_SHARED", str(ROOT.parent / "shared")))
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    (out / "train.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    later = rows[1:] or rows

    def med(key: str) -> float | None:
        vals = [r[key] for r in later if key in r]
        return statistics.median(vals) if vals else None

    return dict(
        name=name, wall_s=wall, steps=len(rows), first_step_s=rows[0]["timing_s/step"],
        later_steps=[r["timing_s/step"] for r in later],
        # from the third step on: past the second step's compiles of new prompt / packed widths (this code's compiled
        # programs may also come from its persistent compilation cache, on by default; older revisions had none)
        steady_steps=[r["timing_s/step"] for r in rows[2:]] or [r["timing_s/step"] for r in later],
        compile_s=[r.get("perf/compile_time_s") for r in rows],
        step_s=med("timing_s/step"), step_min=min(r["timing_s/step"] for r in later),
        step_max=max(r["timing_s/step"] for r in later),
        phases={p: med(f"timing_s/{p}") for p in PHASES},
        response_length=statistics.mean(r["response_length/mean"] for r in rows),
        real_tokens=statistics.mean(r["perf/total_num_tokens"] for r in rows),
        peak_rss_gb=max((r["perf/cpu_memory_used_gb"] for r in rows if "perf/cpu_memory_used_gb" in r), default=None),
        scores=[r.get("critic/score/mean") for r in rows],
        command=" ".join(["python -m jaxrl.train --config", CONFIG, *overrides]) + (
            f" (code at {code.name})" if code != ROOT else ""),
    )


def merge_rounds(runs: list[dict]) -> dict:
    """One variant's runs (one per round) as one row: step statistics over every run's steps after its first, the
    phases' medians over the runs, first step / wall / RSS of all runs (median / sum / max)."""
    steps = [s for r in runs for s in r["later_steps"]]
    med = statistics.median
    return dict(
        runs[0], wall_s=sum(r["wall_s"] for r in runs), first_step_s=med([r["first_step_s"] for r in runs]),
        later_steps=steps, step_s=med(steps), step_min=min(steps), step_max=max(steps),
        steady_steps=[s for r in runs for s in r["steady_steps"]],
        round_steady_s=[med(r["steady_steps"]) for r in runs],
        phases={p: (med(v) if (v := [r["phases"][p] for r in runs if r["phases"][p] is not None]) else None)
                for p in PHASES},
        peak_rss_gb=max((r["peak_rss_gb"] for r in runs if r["peak_rss_gb"] is not None), default=None),
        round_step_s=[r["step_s"] for r in runs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--baseline-rev", default=None, help="also run the padded config with this git revision's code")
    ap.add_argument("--variants", default="packed,padded", help="comma list of " + ", ".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every variant (and the baseline) this many times, interleaved, order rotated per round")
    ap.add_argument("--quick", action="store_true", help="2 steps, packed only")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 1:
        ap.error(f"--rounds and --steps must be >= 1; got {args.rounds} and {args.steps}")
    if not (ROOT / "outputs/data/gsm8k/train.parquet").exists():
        subprocess.run([sys.executable, "-m", "jaxrl.data.prepare", "gsm8k", "--output", "outputs/data/gsm8k"],
                       cwd=ROOT, check=True)
    steps = 2 if args.quick else args.steps
    variants = ["packed"] if args.quick else args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {v!r}; valid: {', '.join(VARIANTS)}")
    runs: dict[str, list[dict]] = {}
    jobs = [(v, VARIANTS[v], ROOT) for v in variants]
    if args.baseline_rev and not args.quick:
        jobs.append((f"padded@{args.baseline_rev}", [], worktree(args.baseline_rev)))
    for i in range(args.rounds):  # round i runs every job once, the order rotated by i (neighbours in time pair up)
        for name, overrides, code in jobs[i % len(jobs):] + jobs[:i % len(jobs)]:
            runs.setdefault(name, []).append(run_variant(name, overrides, steps, code, i))
            print(json.dumps(runs[name][-1]), flush=True)
    results = [merge_rounds(runs[name]) for name, _, _ in jobs]

    base = results[-1]
    # per-round ratio to the last row (the baseline when there is one): each round's median step over the baseline's
    for r in results:
        ratios = [a / b for a, b in zip(r["round_step_s"], base["round_step_s"])]
        r["ratio"] = statistics.median(ratios)
        r["ratio_range"] = (min(ratios), max(ratios))
        r["steady_ratio"] = statistics.median(a / b for a, b in zip(r["round_steady_s"], base["round_steady_s"]))
    cmd = "python bench/gsm8k_step.py" + (f" --steps {args.steps}" if args.steps != 4 else "") + (
        f" --variants {args.variants}" if args.variants != "packed,padded" else "") + (
        f" --baseline-rev {args.baseline_rev}" if args.baseline_rev else "") + (
        f" --rounds {args.rounds}" if args.rounds != 1 else "")
    lines = header_lines(
        "GSM8K GRPO step on SmolLM2-135M: packed rows and token-budget micro-batches vs padded", cmd,
        [f"config: `{CONFIG}` (4 prompts x n=4, prompt <= 256, response <= 128, KL loss), {steps} steps per run, "
         "validation and checkpoints off; " + (
             "variants run one after another" if args.rounds == 1 else
             f"{args.rounds} rounds, each running every variant once (one process each) in turn, the order rotated "
             "per round"),
         "step s: median over every run's steps after its first (min-max); first step: includes compilation "
         "(median over the runs); phases: median over the runs",
         "step / last row's: the median of the per-round ratios of the runs' median steps (min-max when several "
         "rounds)",
         "steps 3+: the median over every run's steps from the third on (past the second step's compiles of new "
         "widths) and its ratio to the last row's, as above; this code's persistent compilation cache (on by default) "
         "may hold programs from earlier runs, an older revision compiles everything",
         "step-end RSS: the largest perf/cpu_memory_used_gb of the run, read at each step's end after free "
         "memory is handed back (not the peak inside a step: bench/memory.py measures that)"])
    lines += ["| variant | step s | first step s | gen | old_log_prob | ref | update_actor | response len | "
              "tokens/step | step-end RSS GB | step / last row's | steps 3+ s | steps 3+ / last row's |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ph = r["phases"]
        fmt = lambda x, digits=1: "-" if x is None else f"{x:.{digits}f}"  # noqa: E731  (a revision's missing metric)
        lines.append(f"| {r['name']} | {r['step_s']:.1f} ({r['step_min']:.1f}-{r['step_max']:.1f}) | "
                     f"{r['first_step_s']:.1f} | {fmt(ph['gen'])} | {fmt(ph['old_log_prob'])} | {fmt(ph['ref'])} | "
                     f"{fmt(ph['update_actor'])} | {r['response_length']:.1f} | {r['real_tokens']:.0f} | "
                     f"{fmt(r['peak_rss_gb'], 2)} | {r['ratio']:.2f}x" + (
                         f" ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})" if args.rounds > 1 else "")
                     + f" | {statistics.median(r['steady_steps']):.1f} | {r['steady_ratio']:.2f}x |")
    lines += ["", *[f"- {r['name']}: `{r['command']}`; process wall {r['wall_s']:.0f} s"
                    + (" (all rounds), per-round median steps " + ", ".join(f"{x:.1f}" for x in r["round_step_s"])
                       if args.rounds > 1 else "") for r in results]]
    md, _ = write_section("gsm8k_step", lines, results)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
