"""Benchmark: the GRPO step, synchronous vs the asynchronous pipeline (``async_training.staleness``), and a model of
the speedup on GPUs.

Measured: the quickstart (real stories260K, 16 prompts x n = 8, 48 new tokens) through the real CLI on 8 simulated
CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``) in split placement (train mesh fsdp=2 x
tensor=2 on devices 0-3, the embedded sampler on devices 4-7), one variant after another: staleness 0 (synchronous),
1 (verl's one-step-off-policy) and 2; then on one device (the colocated case), staleness 0 and 1. Reported per variant: the median step time over steps 3.. (the first steps
compile), its phases, the time the end of a step waited for the generation in flight (``timing_s/wait_prev_gen``), the
share of the step during which the next batch was generating (``perf/gen_overlap_ratio``) and the scores.

Modelled: the H100 phase times of ``bench/results/gpu_h100.json`` (Qwen3-1.7B shapes, P = 512, R = 1024, 96 rows per
step) on a node of D cards, colocated synchronous vs split one-step-off with r rollout cards (see the section's text
for the formulas and assumptions).

Run: ``python bench/async_step.py [--steps 12]`` (about 5 minutes on 2 cores). Writes ``bench/results/async_step.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, ROOT, WORK_DIR, header_lines, write_section  # noqa: E402

SPLIT = ["trainer.placement=split", "trainer.rollout_devices=4", "trainer.mesh.fsdp=2", "trainer.mesh.tensor=2",
         # the quickstart's single-device micro-batches (64 rows) over the train mesh's 2 data-parallel devices
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32"]
PHASES = ("gen", "reward", "old_log_prob", "ref", "update_actor", "sync", "wait_prev_gen", "gen_overlap")


def run_variant(placement: str, staleness: int, steps: int) -> dict:
    out = WORK_DIR / "async_step" / f"{placement}-staleness{staleness}"
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    overrides = [*(SPLIT if placement == "split" else []), f"async_training.staleness={staleness}", f"trainer.total_training_steps={steps}",
                 "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
                 "trainer.resume_mode=disable", "actor_rollout_ref.actor.optim.lr=3e-4"]
    cmd = [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml", *overrides,
           f"trainer.default_local_dir={out}", "trainer.logger=[jsonl]"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8") if placement == "split" else None
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"staleness {staleness}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    later = rows[2:]

    def med(key: str) -> float | None:
        vals = [r[key] for r in later if key in r]
        return statistics.median(vals) if vals else None

    return dict(
        placement=placement, staleness=staleness, wall_s=wall, steps=len(rows), step_s=med("timing_s/step"),
        step_min=min(r["timing_s/step"] for r in later), step_max=max(r["timing_s/step"] for r in later),
        phases={p: med(f"timing_s/{p}") for p in PHASES}, overlap_ratio=med("perf/gen_overlap_ratio"),
        score_first3=statistics.mean(r["critic/score/mean"] for r in rows[:3]),
        score_last3=statistics.mean(r["critic/score/mean"] for r in rows[-3:]),
        command=("XLA_FLAGS=--xla_force_host_platform_device_count=8 " if placement == "split" else "")
        + "python -m jaxrl.train --config configs/quickstart.yaml " + " ".join(overrides),
    )


# ------------------------------------------------------------------------------------------------- the GPU model

def gpu_model(nodes=(4, 8)) -> tuple[list[str], dict]:
    """The step on D H100s from the measured single-card phases: generation time per card from the sampler's
    measured curve (rows per card), training time ideal data-parallel."""
    data = json.loads((RESULTS_DIR / "gpu_h100.json").read_text())
    step = data["run5"]["grpo_step"]
    warm = step["steps"][1]
    rows = step["rows"]
    train_1 = warm["old_log_prob"] + warm["update"]  # one card, all rows
    sync_s = warm["sync"]
    sampler = data["run4"]["sampler"]
    pts = sorted((int(b), v["whole_s"]) for b, v in sampler.items() if int(b) <= 32)  # (8, 3.69), (32, 9.07)

    def gen_time(rows_per_card: float) -> float:
        """Seconds for one card to generate ``rows_per_card`` rows of 1024 tokens: chunks of 32 rows (as the GRPO
        step ran: max_batch_size=32), a chunk of b rows by linear interpolation of the measured 8- and 32-row
        times (extrapolated below 8 rows)."""
        full, rest = divmod(math.ceil(rows_per_card), 32)
        (b0, t0), (b1, t1) = pts[0], pts[-1]
        chunk = lambda b: t0 + (b - b0) * (t1 - t0) / (b1 - b0)  # noqa: E731
        return full * t1 + (chunk(rest) if rest else 0.0)

    lines = [f"Inputs (H100, `bench/results/gpu_h100.json`): {rows} rows per step; one card generates 8 rows in "
             f"{pts[0][1]:.2f} s and 32 rows in {pts[-1][1]:.2f} s (1024 new tokens each); old log-probs + update of "
             f"all rows on one card {train_1:.2f} s; weight sync {sync_s:.2f} s.", "",
             "| cards D | colocated sync step s | best split (rollout r / train D-r) | one-step-off step s | "
             "speedup |", "|---|---|---|---|---|"]
    model = {}
    for d in nodes:
        sync_step = gen_time(rows / d) + train_1 / d + sync_s
        best = min(((max(gen_time(rows / r), train_1 / (d - r)) + sync_s, r) for r in range(1, d)))
        lines.append(f"| {d} | {sync_step:.2f} | {best[1]} / {d - best[1]} | {best[0]:.2f} | "
                     f"{sync_step / best[0]:.2f}x |")
        model[d] = {"sync_step_s": sync_step, "async_step_s": best[0], "rollout_cards": best[1]}
    g1 = gen_time(rows)
    bound = (g1 + train_1) / max(g1, train_1)
    lines += ["", f"Upper bound when generation does not shrink with more rollout cards (a long tail: the batch waits "
              f"for its longest response): (G + T) / max(G, T) = ({g1:.1f} + {train_1:.1f}) / {max(g1, train_1):.1f} "
              f"= {bound:.2f}x."]
    model["tail_bound"] = bound
    return lines, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    results = []
    for placement, ks in (("split", (0, 1, 2)), ("one device", (0, 1))):
        for k in ks:
            results.append(run_variant(placement, k, args.steps))
            print(json.dumps(results[-1]), flush=True)
    base = {r["placement"]: r for r in results if r["staleness"] == 0}
    lines = header_lines(
        "GRPO step: synchronous vs asynchronous pipeline (async_training.staleness)",
        "python bench/async_step.py" + (f" --steps {args.steps}" if args.steps != 12 else ""),
        [f"quickstart (stories260K, 16 prompts x n=8, 48 new tokens), {args.steps} steps per variant, lr 3e-4; "
         "split: 8 simulated CPU devices, 4 train (fsdp=2 x tensor=2) / 4 sampler; one device: the quickstart as "
         "shipped (every role and the sampler on one CPU device); variants run one after another",
         "step s: median over steps 3.. (min-max); phases: medians; overlap: share of the step during which the "
         "next batch was generating; wait: seconds the end of the step waited for it"])
    lines += ["| placement | staleness | step s | vs sync | gen | reward | old_log_prob | ref | update_actor | sync (incl. wait) | "
              "wait_prev_gen | overlap | score first3 -> last3 |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for r in results:
        ph = r["phases"]
        lines.append(
            f"| {r['placement']} | {r['staleness']} | {r['step_s']:.2f} ({r['step_min']:.2f}-{r['step_max']:.2f}) | "
            f"{r['step_s'] / base[r['placement']]['step_s']:.2f}x | {fmt(ph['gen'])} | {fmt(ph['reward'])} | "
            f"{fmt(ph['old_log_prob'])} | {fmt(ph['ref'])} | {fmt(ph['update_actor'])} | {fmt(ph['sync'])} | "
            f"{fmt(ph['wait_prev_gen'])} | {fmt(r['overlap_ratio'])} | {r['score_first3']:.3f} -> "
            f"{r['score_last3']:.3f} |")
    lines += ["", "Two CPU cores serve every simulated device, so the trainer and the generation thread share them: "
              "on this machine overlap cannot shorten the step much; the overlap column shows the pipeline runs both "
              "at once. On one device the overlap is the colocated case: the next batch's generation, decoding and "
              "reward scoring (host work, worker processes) run while the trainer's programs run.", "",
              *[f"- {r['placement']}, staleness {r['staleness']}: `{r['command']}`" for r in results], "",
              "### Model: one-step-off on H100s", ""]
    model_lines, model = gpu_model()
    lines += model_lines
    lines += ["", "Formulas: colocated synchronous on D cards = gen(rows / D) + T / D + sync; split one-step-off with r "
              "rollout cards = max(gen(rows / r), T / (D - r)) + sync (the generation of the next batch hides behind "
              "the update or the other way round; the sync after the update is the only wait). Training is assumed "
              "to scale ideally with cards; generation per card follows the measured curve, which is sublinear in "
              "rows (decode is memory-bound), so fewer rollout cards with more rows each lose little. Every row here "
              "is 1024 tokens (the random model ignores EOS): ragged responses add a long tail to generation, which "
              "the split pipeline hides and the colocated step waits for; the tail bound above is the limit of that."]
    md, _ = write_section("async_step", lines, {"measured": results, "model": model})
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
