"""Benchmark: does GSM8K learn on a 2-core CPU within an hour? (issue 19's learning run)

Runs ``python -m jaxrl.train --config configs/gsm8k_grpo_smollm2_135m_cpu_hour.yaml`` (the real SmolLM2-135M-Instruct,
GRPO, 4 prompts x n = 4 per step, verl's GSM8K reward with ``format_score`` 0.1, greedy validation on 64 test
questions every 10 steps), stops it with SIGTERM after ``--minutes`` (the trainer then saves a checkpoint and
exits cleanly), and summarises its ``metrics.jsonl``:

* validation points: the format-following rate (``val-aux/openai/gsm8k/format/mean@1``: responses with a
  ``#### N`` answer), strict accuracy (``val-core/.../acc``) and verl's flexible-extraction accuracy
  (``val-aux/.../acc_flexible``), against the step and the minutes since the run started;
* training in windows of 5 steps: the format rate of the sampled responses (``reward/format/mean``), the score,
  the response length and the share of responses cut at 128 tokens;
* the median step time, the process's peak resident memory (``perf/cpu_memory_peak_gb``, VmHWM, the high-water
  mark, logged every step) and the largest step-end RSS (``perf/cpu_memory_used_gb``).

Minutes are the sum of the run's own ``timing_s/step`` and ``timing_s/testing`` (validation), so process start
and model load (about 15 s) are not in them.

Run: ``python bench/gsm8k_cpu_hour.py [--minutes 60]`` (writes ``bench/results/gsm8k_cpu_hour.{md,json}`` and
``docs/gsm8k_cpu_hour.png``); ``--summarize RUN_DIR`` only summarises a finished run of that config (the command
that made it is then passed as ``--command``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, WORK_DIR, header_lines, write_section  # noqa: E402

CONFIG = "configs/gsm8k_grpo_smollm2_135m_cpu_hour.yaml"
PLOT = ROOT / "docs" / "gsm8k_cpu_hour.png"
DS = "openai/gsm8k"
VAL = {"format": f"val-aux/{DS}/format/mean@1", "acc": f"val-core/{DS}/acc/mean@1",
       "acc_flexible": f"val-aux/{DS}/acc_flexible/mean@1"}
WINDOW = 5


def train(minutes: float, out: Path) -> float:
    """Run the config into ``out`` for at most ``minutes``, then SIGTERM it (a clean stop with a checkpoint).

    Returns the wall seconds of the process. Raises RuntimeError when it exits with an error.
    """
    cmd = [sys.executable, "-m", "jaxrl.train", "--config", CONFIG, f"trainer.default_local_dir={out}",
           "trainer.resume_mode=disable"]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=minutes * 60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the trainer's handler: finish the step, save, exit 0
            try:
                proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise RuntimeError(f"the run did not stop within 600 s of SIGTERM (log {out / 'train.log'})")
    if proc.returncode != 0:
        raise RuntimeError(f"the run exited {proc.returncode} (log {out / 'train.log'})")
    return time.perf_counter() - t0


def elapsed_minutes(records: list[dict]) -> list[float]:
    """Minutes since the run started at the end of each record: the running sum of ``timing_s/step`` and
    ``timing_s/testing`` (a step's validation is logged in its record)."""
    total, out = 0.0, []
    for r in records:
        total += r.get("timing_s/step", 0.0) + r.get("timing_s/testing", 0.0)
        out.append(total / 60)
    return out


def summarize(run_dir: Path) -> dict:
    """The summary of a run's ``metrics.jsonl`` (see the module docstring) as a JSON-able dict.

    Raises:
      FileNotFoundError: no ``metrics.jsonl`` in ``run_dir``.
      ValueError: the run has no validation record or no training step.
    """
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    minutes = elapsed_minutes(records)
    val = [{"step": r["step"], "minutes": m, **{k: r[key] for k, key in VAL.items() if key in r}}
           for r, m in zip(records, minutes) if VAL["format"] in r]
    steps = [(r, m) for r, m in zip(records, minutes) if r["step"] > 0 and "timing_s/step" in r]
    if not val or not steps:
        raise ValueError(f"{path}: {len(val)} validation records and {len(steps)} training steps; need both")
    windows = []
    for i in range(0, len(steps), WINDOW):
        chunk = steps[i : i + WINDOW]
        rs = [r for r, _ in chunk]
        windows.append({
            "steps": f"{rs[0]['step']}-{rs[-1]['step']}", "minutes": chunk[-1][1],
            "format": statistics.fmean(r["reward/format/mean"] for r in rs),
            "score": statistics.fmean(r["critic/score/mean"] for r in rs),
            "response_length": statistics.fmean(r["response_length/mean"] for r in rs),
            "clip_ratio": statistics.fmean(r["response_length/clip_ratio"] for r in rs),
        })
    step_times = [r["timing_s/step"] for r, _ in steps[1:]] or [steps[0][0]["timing_s/step"]]
    return {
        "run_dir": str(run_dir), "val": val, "windows": windows, "steps": len(steps),
        "minutes": minutes[-1], "step_s_median": statistics.median(step_times),
        "step_end_rss_gb": max(r.get("perf/cpu_memory_used_gb", 0.0) for r in records),
        "peak_rss_gb": max((r["perf/cpu_memory_peak_gb"] for r in records if "perf/cpu_memory_peak_gb" in r),
                           default=None),
        "phase_peaks": _phase_peaks(records),
        "train_format": [(r["step"], m, r["reward/format/mean"]) for r, m in steps],
    }


def _phase_peaks(records: list[dict]) -> dict[str, tuple[float, int]]:
    """Each phase's largest ``perf/cpu_memory_peak_gb/<phase>`` over the run and the row (step) that logged it,
    largest first (empty for runs from before those keys)."""
    prefix, out = "perf/cpu_memory_peak_gb/", {}
    for r in records:
        for key, value in r.items():
            if key.startswith(prefix) and value > out.get(key[len(prefix):], (-1.0, 0))[0]:
                out[key[len(prefix):]] = (value, r["step"])
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))


def plot(summary: dict, out_png: Path) -> Path:
    """The format rate (training: a 5-step moving mean; validation: greedy) and validation accuracies against
    minutes, into ``out_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    tf = summary["train_format"]
    xs = [m for _, m, _ in tf]
    ys = [statistics.fmean(v for _, _, v in tf[max(0, i - WINDOW + 1) : i + 1]) for i in range(len(tf))]
    ax.plot(xs, ys, label=f"train: format rate of the samples (T=0.7; mean of {WINDOW} steps)", color="tab:blue")
    val = summary["val"]
    ax.plot([v["minutes"] for v in val], [v["format"] for v in val], "o-", color="tab:orange",
            label="validation: format rate (greedy, 64 test questions)")
    for key, color in (("acc_flexible", "tab:green"), ("acc", "tab:red")):
        if all(key in v for v in val):
            ax.plot([v["minutes"] for v in val], [v[key] for v in val], "s--", color=color, markersize=4,
                    label=f"validation: {'accuracy, flexible extraction' if key == 'acc_flexible' else 'accuracy'}")
    ax.set_xlabel("minutes of training (2 CPU cores)")
    ax.set_ylabel("fraction of responses")
    ax.set_title("GRPO, SmolLM2-135M-Instruct on GSM8K: share of responses with a '#### N' answer", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def markdown(summary: dict, command: str) -> list[str]:
    lines = header_lines("Does GSM8K learn on a 2-core CPU within an hour? (SmolLM2-135M-Instruct, GRPO)", command, [
        f"config: `{CONFIG}` (4 prompts x n=4, temperature 0.7, responses <= 128 tokens, lr 1e-5, verl's GSM8K "
        "reward with format_score 0.1, greedy validation on the first 64 test questions every 10 steps)",
        f"run: {summary['steps']} steps in {summary['minutes']:.1f} minutes of steps and validation; median step "
        f"{summary['step_s_median']:.1f} s; peak RSS of the process "
        + (f"{summary['peak_rss_gb']:.2f} GB" if summary["peak_rss_gb"] is not None else "not logged (older run)")
        + f"; largest step-end RSS {summary['step_end_rss_gb']:.2f} GB",
        "largest peak RSS per phase (`perf/cpu_memory_peak_gb/<phase>`, GB, at step): "
        + (", ".join(f"{k} {v:.2f} ({step})" for k, (v, step) in summary.get("phase_peaks", {}).items())
           or "not logged (older run)"),
        f"plot: `{PLOT.relative_to(ROOT)}`",
    ])
    lines += ["", "### Validation (greedy)", "", "| step | minutes | format rate | accuracy (strict) | "
              "accuracy (flexible) |", "|---:|---:|---:|---:|---:|"]
    for v in summary["val"]:
        cells = [f"{v.get(k, float('nan')):.3f}" for k in ("format", "acc", "acc_flexible")]
        lines.append(f"| {v['step']} | {v['minutes']:.1f} | " + " | ".join(cells) + " |")
    lines += ["", f"### Training samples, in windows of {WINDOW} steps", "",
              "| steps | minutes at end | format rate | score | response length | cut at 128 |",
              "|---|---:|---:|---:|---:|---:|"]
    for w in summary["windows"]:
        lines.append(f"| {w['steps']} | {w['minutes']:.1f} | {w['format']:.3f} | {w['score']:.3f} | "
                     f"{w['response_length']:.1f} | {w['clip_ratio']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="stop the run (SIGTERM) after this many minutes")
    p.add_argument("--summarize", type=Path, default=None, help="summarise this finished run folder instead")
    p.add_argument("--command", default=None, help="with --summarize: the command that made the run")
    p.add_argument("--note", action="append", default=[], help="a line added to the section's notes")
    args = p.parse_args(argv)
    if args.summarize is None:
        run_dir = WORK_DIR / "gsm8k_cpu_hour"
        wall = train(args.minutes, run_dir)
        command = f"python bench/gsm8k_cpu_hour.py --minutes {args.minutes:g}"
        args.note.append(f"process wall time {wall / 60:.1f} min (start, load and the final save included)")
        # the trainer's whole life, the final save and export after SIGTERM included (no step record follows
        # those, so perf/cpu_memory_peak_gb cannot show them); Linux reports ru_maxrss in KiB
        life_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
        args.note.append(f"peak RSS of the trainer process over its whole life (getrusage, the final save and "
                         f"export after SIGTERM included): {life_gb:.2f} GB")
    else:
        run_dir = args.summarize
        command = args.command or f"python bench/gsm8k_cpu_hour.py --summarize {args.summarize}"
    summary = summarize(run_dir)
    plot(summary, PLOT)
    lines = markdown(summary, command)
    if args.note:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in args.note]
    md, js = write_section("gsm8k_cpu_hour", lines, summary)
    print(f"wrote {md}, {js}, {PLOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
