"""Compare two sets of runs metric by metric: ``python scripts/compare_metrics.py BASE_DIR NEW_DIR [--tol 1e-5]``.

Each sub-folder of BASE_DIR holding a ``metrics.jsonl`` is matched with the same-named folder of NEW_DIR; every
numeric metric except timings and throughput is compared row by row (relative difference, floor 1). Used to show
that a refactor moves no number (same config, same seed). Exit status 1 on any mismatch or missing run/key.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SKIP = ("timing_s/", "perf/throughput", "perf/time")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare(base: Path, new: Path, tol: float) -> int:
    bad = 0
    for run in sorted(p for p in base.iterdir() if (p / "metrics.jsonl").is_file()):
        other = new / run.name / "metrics.jsonl"
        if not other.is_file():
            print(f"{run.name}: missing in {new}")
            bad += 1
            continue
        a, b = _rows(run / "metrics.jsonl"), _rows(other)
        if len(a) != len(b):
            print(f"{run.name}: {len(a)} rows vs {len(b)}")
            bad += 1
        worst, n = 0.0, 0
        for ra, rb in zip(a, b):
            for key, va in ra.items():
                if key.startswith(SKIP) or not isinstance(va, (int, float)) or isinstance(va, bool):
                    continue
                if key not in rb:
                    print(f"{run.name} step {ra.get('step')}: {key} missing")
                    bad += 1
                    continue
                diff = abs(va - rb[key]) / max(1.0, abs(va))
                worst, n = max(worst, diff), n + 1
                if diff > tol:
                    print(f"{run.name} step {ra.get('step')}: {key} {va!r} vs {rb[key]!r}")
                    bad += 1
        print(f"{run.name}: {len(a)} rows, {n} values, worst relative difference {worst:.2e}")
    print(f"mismatches: {bad}")
    return bad


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--tol", type=float, default=1e-5)
    args = p.parse_args()
    return 1 if compare(args.base, args.new, args.tol) else 0


if __name__ == "__main__":
    sys.exit(main())
