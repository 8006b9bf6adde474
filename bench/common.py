"""Shared pieces of the benchmark scripts: machine/version facts, step statistics, result files, peer venvs.

Every benchmark writes two files into ``bench/results/``: ``<name>.json`` (raw numbers, one record per measured
case) and ``<name>.md`` (a section with its own machine/versions/command/date header and a table).
``python bench/report.py`` stitches the sections into ``bench/RESULTS.md``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
WORK_DIR = ROOT / "outputs" / "bench"  # models, peer outputs, scratch (git-ignored)

__all__ = [
    "ROOT", "RESULTS_DIR", "WORK_DIR", "machine_info", "versions", "stats", "fmt_stats", "write_section",
    "header_lines", "run_in_venv", "now_utc", "timed_calls",
]


def now_utc() -> str:
    """The current time as ``YYYY-MM-DD HH:MM UTC``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def machine_info() -> str:
    """One line: hostname kind, OS, CPU model, logical CPUs, RAM (GiB) and any accelerator jax sees."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_kb = int(next(ln for ln in Path("/proc/meminfo").read_text().splitlines()
                          if ln.startswith("MemTotal")).split()[1])
        mem = f"{mem_kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        mem = "RAM unknown"
    return f"{platform.platform()} / {cpu} / {os.cpu_count()} logical CPUs / {mem}"


def versions(packages: Iterable[str] = ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "transformers")) -> str:
    """``name version`` for each installed package of ``packages`` (missing ones are skipped), plus Python."""
    parts = [f"python {platform.python_version()}"]
    for p in packages:
        try:
            parts.append(f"{p} {importlib.metadata.version(p)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(parts)


def stats(values: Sequence[float]) -> dict[str, float]:
    """``{"median", "min", "max", "n"}`` of ``values`` (seconds, tokens/s, ...).

    Raises:
      ValueError: ``values`` is empty.
    """
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("stats() of no values: measure at least one step after warm-up")
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def timed_calls(fn, repeats: int) -> tuple[float, list[float]]:
    """Call ``fn()`` once (the warm-up, which compiles) and then ``repeats`` times.

    ``fn`` must block until its work is done (return host values or call ``block_until_ready``).

    Returns:
      ``(warm-up seconds, [seconds of each timed call])``, wall-clock (``time.perf_counter``).
    """
    import time

    t0 = time.perf_counter()
    fn()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return warm, times


def fmt_stats(s: dict[str, float] | None, digits: int = 2) -> str:
    """``median (min-max)`` as text for a table cell; ``-`` for None."""
    if not s:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def header_lines(title: str, command: str, extra: Sequence[str] = ()) -> list[str]:
    """The header every results section starts with: title, date, machine, versions, command, extra lines."""
    return [
        f"## {title}", "",
        f"- date: {now_utc()}",
        f"- machine: {machine_info()}",
        f"- versions (this process): {versions()}",
        f"- command: `{command}`",
        *[f"- {e}" for e in extra],
        "",
    ]


def write_section(name: str, markdown_lines: Sequence[str], records: object) -> tuple[Path, Path]:
    """Write ``bench/results/<name>.md`` and ``bench/results/<name>.json``; returns both paths."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    md, js = RESULTS_DIR / f"{name}.md", RESULTS_DIR / f"{name}.json"
    md.write_text("\n".join(markdown_lines).rstrip() + "\n", encoding="utf-8")
    js.write_text(json.dumps(records, indent=2, default=str) + "\n", encoding="utf-8")
    return md, js


def run_in_venv(python: str | os.PathLike, args: Sequence[str], *, timeout_s: float, env: dict | None = None,
                log_path: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``python args...`` (a peer's venv interpreter, or ``sys.executable``) from the repo root.

    Output goes to ``log_path`` (stdout+stderr) when given. Raises ``RuntimeError`` naming the command and the log
    tail when it exits non-zero or runs past ``timeout_s`` seconds.
    """
    full_env = dict(os.environ)
    full_env.update(env or {})
    cmd = [str(python), *map(str, args)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(cmd)} ran past {timeout_s:.0f} s") from e
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return proc


if __name__ == "__main__":  # quick self-check: python bench/common.py
    print(machine_info())
    print(versions())
    print(stats([3.0, 1.0, 2.0]), file=sys.stderr)
