"""Benchmark: how jaxrl's GRPO step time grows with batch size, response length and model size.

Each point is a real training run of jaxrl's trainer, in this process (``jaxrl.build.build`` + ``Trainer.fit``,
config through the same loader as ``python -m jaxrl.train``, verl keys): GRPO, embedded JAX sampler
(``rollout.name=jax``, ``ignore_eos=true`` so every response has exactly the response length), temperature 1,
float32, no KL term (no reference model), one optimizer update per step (``ppo_mini_batch_size`` = the step's
prompts), micro-batches of ``min(rows, 16)`` rows, no gradient checkpointing, no validation, no checkpoints.
Prompts: the workload's story openings (``bench/workload.py``) written as a verl-format jsonl; reward: the
workload's distinct-word ratio, loaded as ``custom_reward_function`` from this file (:func:`compute_score`).

Per point: ``--warmup`` un-timed steps (compilation), then ``--steps`` measured steps; times come from the run's
``metrics.jsonl`` (``timing_s/step``, ``timing_s/gen``, ``timing_s/old_log_prob``, ``timing_s/update_actor``, ...),
median (min-max) over the measured steps.

Axes (each varies one thing from a base point):

* batch: prompts x group size (rows = responses per step), tiny-qwen2;
* response length: tokens generated per response, tiny-qwen2;
* model size: tiny-qwen2 (16 M), mid-qwen2 (49 M, built here by :func:`bench._jaxrl_bench.ensure_mid_qwen2`),
  smollm2-135m (135 M).

Run: ``python bench/scaling.py`` (about 20 min on a quiet 2-core box) or ``--quick`` (about 3 min).
Writes ``bench/results/scaling.{md,json}`` and ``bench/results/scaling.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, WORK_DIR, fmt_stats, header_lines, stats, write_section  # noqa: E402
from bench.workload import prompts as workload_prompts  # noqa: E402
from bench.workload import reward as workload_reward  # noqa: E402

SCRATCH = WORK_DIR / "scaling"
PHASES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "sync")
MAX_PROMPT_LENGTH = 64

# (prompts, group size, response length) per axis; model names per the model axis.
FULL = {
    "batch": {"model": "tiny-qwen2", "response_len": 32, "points": [(2, 4), (4, 4), (8, 4), (16, 4)]},
    "response": {"model": "tiny-qwen2", "prompts": 8, "group": 4, "points": [16, 32, 64, 128]},
    "model": {"prompts": 8, "group": 4, "response_len": 32, "points": ["tiny-qwen2", "mid-qwen2", "smollm2-135m"]},
}
QUICK = {
    "batch": {"model": "tiny-qwen2", "response_len": 8, "points": [(2, 2), (4, 2)]},
    "response": {"model": "tiny-qwen2", "prompts": 2, "group": 2, "points": [8, 16]},
    "model": {"prompts": 2, "group": 2, "response_len": 8, "points": ["tiny-qwen2", "mid-qwen2"]},
}


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """verl-signature reward for the runs: the workload's distinct-word ratio of the response, in [0, 1]."""
    return workload_reward(solution_str)


def _dataset(rows: int = 64) -> Path:
    """A verl-format jsonl of the workload prompts (cycled to ``rows`` rows) under ``outputs/bench/scaling``."""
    SCRATCH.mkdir(parents=True, exist_ok=True)
    path = SCRATCH / "prompts.jsonl"
    texts = workload_prompts()
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            f.write(json.dumps({"data_source": "bench/workload", "prompt": texts[i % len(texts)], "ability": "story",
                                "reward_model": {"style": "rule", "ground_truth": ""},
                                "extra_info": {"index": i}}) + "\n")
    return path


def _model_dir(name: str) -> Path:
    from bench._jaxrl_bench import ensure_mid_qwen2
    from bench.models import ensure_models

    return ensure_mid_qwen2() if name == "mid-qwen2" else ensure_models([name])[name]


def run_point(label: str, model: str, prompts: int, group: int, response_len: int, warmup: int,
              steps: int, data: Path) -> dict:
    """One training run of ``warmup + steps`` GRPO steps; returns the point's record (timings in seconds)."""
    from jaxrl.config import load_config
    from jaxrl.metrics import read_metrics
    from jaxrl.build import build
    from jaxrl.trainer import Trainer

    rows = prompts * group
    micro = min(rows, 16)
    out_dir = SCRATCH / "runs" / label
    shutil.rmtree(out_dir, ignore_errors=True)
    overrides = [
        f"data.train_files={data}", "data.val_files=null", f"data.train_batch_size={prompts}",
        f"data.max_prompt_length={MAX_PROMPT_LENGTH}", f"data.max_response_length={response_len}",
        "data.shuffle=false",
        f"actor_rollout_ref.model.path={_model_dir(model)}", "actor_rollout_ref.model.dtype=float32",
        "actor_rollout_ref.model.param_dtype=float32", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.weight_decay=0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}", "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.grad_clip=1.0",
        "actor_rollout_ref.rollout.name=jax", f"actor_rollout_ref.rollout.n={group}",
        "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.ignore_eos=true",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
        f"custom_reward_function.path={Path(__file__).resolve()}", "custom_reward_function.name=compute_score",
        f"trainer.total_training_steps={warmup + steps}", "trainer.total_epochs=1000", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable", f"trainer.default_local_dir={out_dir}", "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1", "trainer.seed=1", "trainer.project_name=bench_scaling", f"trainer.experiment_name={label}",
    ]
    cfg = load_config(None, overrides)
    t0 = time.perf_counter()
    c = build(cfg)
    build_s = time.perf_counter() - t0
    try:
        Trainer(c).fit()
    finally:
        c.logger.close()
    recs = [r for r in read_metrics(c.logger.jsonl_path) if "timing_s/step" in r]
    if len(recs) != warmup + steps:
        raise RuntimeError(f"{label}: metrics.jsonl has {len(recs)} step records, expected {warmup + steps}")
    measured = recs[warmup:]
    lengths = [r.get("response_length/mean") for r in measured]
    if any(x is None or abs(x - response_len) > 1e-6 for x in lengths):
        raise RuntimeError(f"{label}: mean response lengths {lengths} are not all {response_len} tokens; "
                           "is actor_rollout_ref.rollout.ignore_eos honoured?")
    rec = {
        "label": label, "model": model, "prompts": prompts, "group": group, "rows": rows,
        "response_len": response_len, "micro_rows": micro, "build_s": build_s,
        "warmup_step_s": [r["timing_s/step"] for r in recs[:warmup]],
        "step": stats([r["timing_s/step"] for r in measured]),
        "phases": {p: statistics.median(r.get(f"timing_s/{p}", 0.0) for r in measured) for p in PHASES},
        "response_tokens_per_s": statistics.median(rows * response_len / r["timing_s/step"] for r in measured),
        "metrics_jsonl": str(c.logger.jsonl_path),
    }
    print(f"  {label}: step {fmt_stats(rec['step'], 2)} s, gen {rec['phases']['gen']:.2f} s, "
          f"old_log_prob {rec['phases']['old_log_prob']:.2f} s, update {rec['phases']['update_actor']:.2f} s "
          f"(warm-up {', '.join(f'{x:.1f}' for x in rec['warmup_step_s'])} s, build {build_s:.1f} s)", flush=True)
    return rec


def plot(records: list[dict], params_m: dict[str, float], out: Path) -> Path:
    """Three panels (step time vs rows, vs response length, vs model parameters), phases as lines; returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("batch", "responses per step (prompts x group)", lambda r: r["rows"], False),
              ("response", "response length (tokens)", lambda r: r["response_len"], False),
              ("model", "model parameters (M)", lambda r: params_m[r["model"]], True)]
    series = [("step", "whole step"), ("gen", "gen"), ("old_log_prob", "old_log_prob"),
              ("update_actor", "update_actor")]
    for ax, (axis, xlabel, xf, logx) in zip(axes, panels):
        pts = sorted((r for r in records if r["axis"] == axis), key=xf)
        if not pts:
            ax.set_visible(False)
            continue
        xs = [xf(r) for r in pts]
        for key, name in series:
            ys = [r["step"]["median"] if key == "step" else r["phases"][key] for r in pts]
            ax.plot(xs, ys, marker="o", label=name, linewidth=2.2 if key == "step" else 1.2)
        if axis == "model":
            for r, x in zip(pts, xs):
                ax.annotate(r["model"], (x, r["step"]["median"]), textcoords="offset points", xytext=(4, 4),
                            fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("seconds (median)")
        ax.set_xscale("log", base=10 if logx else 2)
        ax.set_xticks(xs, [f"{x:.0f}" for x in xs])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        base = pts[0]
        desc = {"batch": f"{base['model']}, R={base['response_len']}",
                "response": f"{base['model']}, {base['prompts']}x{base['group']} rows",
                "model": f"{base['prompts']}x{base['group']} rows, R={base['response_len']}"}[axis]
        ax.set_title(f"GRPO step time vs {axis} ({desc})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--axes", default="batch,response,model", help="comma list of batch, response, model")
    ap.add_argument("--warmup", type=int, default=1, help="un-timed steps per point (compilation)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per point")
    ap.add_argument("--quick", action="store_true", help="tiny grid (about 3 min): 2 measured steps per point")
    a = ap.parse_args(argv)
    if a.quick and a.steps == 3:
        a.steps = 2
    if a.warmup < 0 or a.steps < 1:
        ap.error("--warmup must be >= 0 and --steps >= 1")
    axes = [x for x in a.axes.split(",") if x]
    grid = QUICK if a.quick else FULL
    bad = [x for x in axes if x not in grid]
    if bad:
        ap.error(f"unknown axes {bad}; valid: {', '.join(grid)}")
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TQDM_DISABLE", "1")  # the trainer's progress bar, once per point, is noise here

    from bench.models import num_params

    t_start = time.perf_counter()
    data = _dataset()
    records, done = [], {}
    for axis in axes:
        g = grid[axis]
        print(f"axis {axis}:", flush=True)
        for pt in g["points"]:
            if axis == "batch":
                key = (g["model"], pt[0], pt[1], g["response_len"])
            elif axis == "response":
                key = (g["model"], g["prompts"], g["group"], pt)
            else:
                key = (pt, g["prompts"], g["group"], g["response_len"])
            if key not in done:  # the base point is shared by several axes: run it once
                label = f"{key[0]}_p{key[1]}xg{key[2]}_r{key[3]}"
                done[key] = run_point(label, *key, warmup=a.warmup, steps=a.steps, data=data)
            records.append({**done[key], "axis": axis})
    params_m = {m: num_params(_model_dir(m)) / 1e6 for m in {r["model"] for r in records}}
    png = plot(records, params_m, RESULTS_DIR / "scaling.png")
    wall = time.perf_counter() - t_start

    cmd = " ".join(["python bench/scaling.py", *(sys.argv[1:] if argv is None else argv)])
    lines = header_lines(
        "GRPO step scaling (jaxrl trainer, embedded JAX sampler)", cmd,
        ["runs: jaxrl.build.build + Trainer.fit in-process, GRPO, rollout.name=jax, ignore_eos (every response "
         "exactly R tokens), T=1, float32, no KL/ref, one update per step, micro-batch min(rows, 16), no remat",
         f"per point: {a.warmup} warm-up step(s) then median (min-max) of {a.steps} measured steps, from "
         "metrics.jsonl timing_s/*; phase columns are medians",
         f"plot: `bench/results/{png.name}`", f"total wall time: {wall:.0f} s"])
    lines += ["| axis | model | params M | prompts x group = rows | R | step s | gen s | old_log_prob s | "
              "update_actor s | reward s | sync s | response tok/s |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        ph = r["phases"]
        lines.append(
            f"| {r['axis']} | {r['model']} | {params_m[r['model']]:.0f} | {r['prompts']} x {r['group']} = "
            f"{r['rows']} | {r['response_len']} | {fmt_stats(r['step'], 2)} | {ph['gen']:.2f} | "
            f"{ph['old_log_prob']:.2f} | {ph['update_actor']:.2f} | {ph['reward']:.2f} | {ph['sync']:.3f} | "
            f"{r['response_tokens_per_s']:.0f} |")
    lines += ["", f"![GRPO step scaling]({png.name})", ""]
    md, js = write_section("scaling", lines, records)
    print("\n".join(lines))
    print(f"wrote {md}, {js} and {png} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
