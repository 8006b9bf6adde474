"""Stitch the benchmark sections (``bench/results/*.md``) into ``bench/RESULTS.md``.

Each section carries its own date, machine, versions and command (written by the script that measured it); this
file adds the summary of the issue's goals that the lead writes in ``bench/results/summary.md`` (kept by hand:
goals, met or not, and what was profiled and changed) and orders the sections.

Run: ``python bench/report.py`` (after the benchmark scripts).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, ROOT, machine_info, now_utc, versions  # noqa: E402

ORDER = ("summary", "grpo_step", "grpo_step_gsm8k", "grpo_step_prefix_grouper", "grpo_step_gsm8k_prefix_grouper",
         "grpo_step_gsm8k_dynamic",
         "rollout_throughput",
         "rollout_throughput_bf16", "long_decode",
         "jetstream_throughput", "train_throughput", "scaling", "reshard", "lora", "memory", "memory_selective",
         "memory_saves", "memory_cpu_hour", "gsm8k_step", "gsm8k_cpu_hour", "async_step", "hybrid_sync", "gpu_h200",
         "gpu_h100")
OUT = ROOT / "bench" / "RESULTS.md"


def build() -> str:
    """The text of ``bench/RESULTS.md`` from the sections present (the order of :data:`ORDER`, then the rest).

    Raises:
      FileNotFoundError: ``bench/results/`` has no section.
    """
    sections = {p.stem: p for p in sorted(RESULTS_DIR.glob("*.md"))}
    if not sections:
        raise FileNotFoundError(f"no benchmark sections in {RESULTS_DIR}; run the bench/*.py scripts first")
    names = [n for n in ORDER if n in sections] + sorted(n for n in sections if n not in ORDER)
    head = [
        "# jaxrl benchmarks", "",
        f"Assembled {now_utc()} by `python bench/report.py` on {machine_info()} ({versions()}).",
        "Each section below says when, where and with which command it was measured. Benchmarks, not tests:",
        "nothing here is asserted in the test suite.", "",
        "Sections: " + " · ".join(f"[{n}](#{n})" for n in names), "",
    ]
    body = []
    for n in names:
        body += [f'<a id="{n}"></a>', "", sections[n].read_text(encoding="utf-8").rstrip(), ""]
    return "\n".join(head + body).rstrip() + "\n"


if __name__ == "__main__":
    OUT.write_text(build(), encoding="utf-8")
    print(f"wrote {OUT}")
