"""GRPO step time, jaxrl against TRL and Tunix, side by side in one run on one machine.

Usage::

    python bench/grpo_step.py [--models tiny-qwen2,smollm2-135m] [--frameworks jaxrl,trl,tunix] [--steps 5]

For every model of ``--models`` (built or reused by :func:`bench.models.ensure_models`) the frameworks run back to
back on the same workload (:mod:`bench.workload`: 8 prompts x group 4, 32 response tokens, GRPO clip 0.2, no KL,
one AdamW step per GRPO step, float32). Each framework is a script ``bench/peers/<fw>_grpo.py`` with one CLI
contract (``--model-dir DIR --model-name NAME --steps N --out FILE.json``); jaxrl's runs with this interpreter,
TRL's and Tunix's with their own virtual environments, which this script first creates or reuses by running
``scripts/setup_bench_<fw>.sh`` (idempotent; the venv interpreter is ``.venv-bench-<fw>/bin/python``).

Each run's first ``bench.workload.WARMUP_STEPS`` steps are dropped; the report gives the median (min-max) of the
rest: total step time, its generation / log-prob / update phases (seconds of wall time) and response tokens per
step, the step time relative to jaxrl's, and the goal lines (jaxrl / TRL <= 0.5, jaxrl / Tunix <= 1.0). A
framework that fails (setup, crash, model it cannot load, timeout) is recorded with its error and does not stop
the others. Results: ``bench/results/grpo_step.{md,json}``; raw peer JSON and logs:
``outputs/bench/grpo_step/<model>/``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import workload as W  # noqa: E402
from bench.common import ROOT, WORK_DIR, fmt_stats, header_lines, run_in_venv, stats, write_section  # noqa: E402
from bench.models import MODEL_NAMES, ensure_models, num_params  # noqa: E402

OUT_DIR = WORK_DIR / "grpo_step"
PHASES = (("total_s", "step s"), ("gen_s", "gen s"), ("logprob_s", "logprob s"), ("update_s", "update s"))


@dataclass(frozen=True)
class Framework:
    """One benchmarked framework: its peer script and, for a peer, the setup script and venv it makes."""

    key: str  # --frameworks name
    label: str  # name in the report
    script: str  # peer script, relative to the repo root
    setup: str | None = None  # setup script (relative), None = run with this interpreter
    venv: str | None = None  # venv folder the setup script creates (relative)
    goal: float | None = None  # claim: jaxrl step time / this framework's <= goal
    extra: tuple[str, ...] = ()  # extra peer-script arguments

    def python(self) -> Path:
        """The interpreter that runs this framework's peer script."""
        return Path(sys.executable) if self.venv is None else ROOT / self.venv / "bin" / "python"


FRAMEWORKS = {
    "jaxrl": Framework("jaxrl", "jaxrl", "bench/peers/jaxrl_grpo.py"),
    # the same without the old-log-prob pass (recompute_old_log_prob=false), the work TRL and Tunix do here
    "jaxrl-onpolicy": Framework("jaxrl-onpolicy", "jaxrl, no old-log-prob pass", "bench/peers/jaxrl_grpo.py",
                                extra=("--no-old-log-prob",)),
    "trl": Framework("trl", "TRL", "bench/peers/trl_grpo.py", "scripts/setup_bench_trl.sh", ".venv-bench-trl", 0.5),
    "tunix": Framework("tunix", "Tunix", "bench/peers/tunix_grpo.py", "scripts/setup_bench_tunix.sh",
                       ".venv-bench-tunix", 1.0),
}


def _csv(value: str, valid: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in valid]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{what} {value!r}: unknown {bad or 'empty list'}; valid: {', '.join(valid)}")
    return list(dict.fromkeys(items))


def _error_lines(err: BaseException, n: int = 6) -> list[str]:
    """The first line of an error (the failing command and exit code) and the last ``n`` non-empty lines of the
    output tail it carries (where a Python traceback ends with its exception)."""
    lines = [ln.rstrip() for ln in str(err).splitlines() if ln.strip()]
    if not lines:
        return [type(err).__name__]
    head, rest = lines[0], lines[1:]
    return [head[:300], *[ln[:300] for ln in rest[-n:]]]


def _cell(text: str, width: int = 160) -> str:
    """``text`` as one markdown table cell: one line, ``|`` escaped, at most ``width`` characters."""
    t = " ".join(text.split()).replace("|", "\\|")
    return t if len(t) <= width else t[: width - 3] + "..."


def setup_framework(fw: Framework, timeout_s: float, skip: bool) -> str | None:
    """Create or reuse ``fw``'s venv with its setup script; returns None when usable, else the error text."""
    if fw.setup is None:
        return None
    py = fw.python()
    if skip:
        return None if py.is_file() else f"--skip-setup and no venv interpreter at {py}"
    script = ROOT / fw.setup
    if not script.is_file():
        return f"setup script {fw.setup} not found (and so no venv {fw.venv})"
    log = OUT_DIR / f"setup-{fw.key}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[grpo_step] setting up {fw.label}: bash {fw.setup} (log {log})", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(["bash", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"bash {fw.setup} ran past {timeout_s:.0f} s"
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        tail = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()][-6:]
        return "\n".join([f"bash {fw.setup} exited {proc.returncode} (log {log.relative_to(ROOT)})", *tail])
    if not py.is_file():
        return f"bash {fw.setup} succeeded but {py} does not exist"
    print(f"[grpo_step] {fw.label} venv ready in {time.perf_counter() - t0:.0f} s: {py}", flush=True)
    return None


def summarize(result: dict, steps_requested: int) -> dict:
    """Stats over the measured steps of a peer's JSON (first ``WARMUP_STEPS`` dropped, ordered by ``step``).

    Returns ``{"phases": {key: stats | None}, "response_tokens": stats | None, "n_steps": int, "warnings": [..]}``.

    Raises:
      ValueError: the JSON has no ``steps`` list, a step without ``step``/``total_s``, or no step after warm-up.
    """
    steps = result.get("steps")
    if not isinstance(steps, list) or not steps:
        raise ValueError(f"peer JSON has no 'steps' list: keys {sorted(result)}")
    for s in steps:
        if not isinstance(s, dict) or "step" not in s or s.get("total_s") is None:
            raise ValueError(f"peer JSON step without 'step' or 'total_s': {s!r}")
    steps = sorted(steps, key=lambda s: s["step"])
    measured = steps[W.WARMUP_STEPS:]
    if not measured:
        raise ValueError(f"peer JSON has {len(steps)} step(s): none left after {W.WARMUP_STEPS} warm-up step(s)")
    warnings = []
    if len(steps) != steps_requested:
        warnings.append(f"ran {len(steps)} steps, {steps_requested} requested")
    phases = {}
    for key, _ in PHASES:
        vals = [s.get(key) for s in measured]
        phases[key] = stats(vals) if all(v is not None for v in vals) else None
    toks = [s.get("response_tokens") for s in measured]
    tok_stats = stats(toks) if all(t is not None for t in toks) else None
    expected = W.NUM_PROMPTS * W.GROUP_SIZE * W.RESPONSE_LENGTH
    if tok_stats and (tok_stats["min"] != expected or tok_stats["max"] != expected):
        warnings.append(f"response tokens/step {tok_stats['min']:.0f}-{tok_stats['max']:.0f}, workload is {expected}")
    return {"phases": phases, "response_tokens": tok_stats, "n_steps": len(steps), "warnings": warnings}


def run_framework(fw: Framework, model: str, model_dir: Path, steps: int, timeout_s: float,
                  setup_error: str | None) -> dict:
    """Run one framework on one model; returns its record (``error`` set, no stats, when it failed)."""
    rec: dict = {"model": model, "framework": fw.key, "label": fw.label, "version": None, "error": None,
                 "notes": [], "steps": [], "wall_s": None}
    if setup_error:
        rec["error"] = f"setup failed: {setup_error}"
        return rec
    if not (ROOT / fw.script).is_file():
        rec["error"] = f"peer script {fw.script} not found"
        return rec
    if not fw.python().is_file():
        rec["error"] = f"no interpreter at {fw.python()} (run bash {fw.setup}, or drop --skip-setup)"
        return rec
    out = OUT_DIR / model / f"{fw.key}.json"
    log = OUT_DIR / model / f"{fw.key}.log"
    out.unlink(missing_ok=True)  # never read a stale result
    args = [fw.script, "--model-dir", str(model_dir), "--model-name", model, "--steps", str(steps), "--out", str(out),
            *fw.extra]
    rec["command"] = " ".join(shlex.quote(str(a)) for a in [fw.python(), *args])
    print(f"[grpo_step] {model} / {fw.label}: {rec['command']}", flush=True)
    t0 = time.perf_counter()
    try:
        run_in_venv(fw.python(), args, timeout_s=timeout_s, log_path=log, env={"PYTHONPATH": str(ROOT)})
        result = json.loads(out.read_text(encoding="utf-8"))
        rec.update(summarize(result, steps))
        rec["version"] = result.get("version")
        rec["notes"] = [str(n) for n in result.get("notes", [])]
        rec["steps"] = result["steps"]
    except Exception as e:  # noqa: BLE001 - one peer's failure must not stop the others
        rec["error"] = "\n".join(_error_lines(e)) + f"\n(log: {log.relative_to(ROOT)})"
    rec["wall_s"] = time.perf_counter() - t0
    status = "failed" if rec["error"] else f"step median {rec['phases']['total_s']['median']:.3f} s"
    print(f"[grpo_step] {model} / {fw.label}: {status} ({rec['wall_s']:.0f} s)", flush=True)
    return rec


def _median(rec: dict | None) -> float | None:
    if not rec or rec.get("error"):
        return None
    return rec["phases"]["total_s"]["median"]


def model_section(model: str, model_dir: Path, records: list[dict]) -> tuple[list[str], list[str]]:
    """The markdown table and goal lines for one model, and its notes."""
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    by_fw = {r["framework"]: r for r in records}
    jax_med = _median(by_fw.get("jaxrl"))
    lines = [
        f"### {model} ({cfg.get('model_type')}, {num_params(model_dir) / 1e6:.1f} M params)", "",
        "| framework | version | step s | gen s | logprob s | update s | response tokens/step | step time / jaxrl |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for r in records:
        if r["error"]:
            first = r["error"].splitlines()
            msg = first[-2] if len(first) > 1 and first[-1].startswith("(log:") else first[-1]
            lines.append(f"| {r['label']} | {r['version'] or '-'} | failed: {_cell(msg)} | - | - | - | - | - |")
            notes.append(f"{model} / {r['label']} failed:\n" + "\n".join(r["error"].splitlines()[:10]))
            continue
        ph = r["phases"]
        med = ph["total_s"]["median"]
        ratio = f"{med / jax_med:.2f}x" if jax_med else "-"
        toks = fmt_stats(r["response_tokens"], 0)
        lines.append(f"| {r['label']} | {r['version'] or '-'} | " + " | ".join(fmt_stats(ph[k], 3) for k, _ in PHASES)
                     + f" | {toks} | {ratio} |")
        notes.extend(f"{model} / {r['label']}: {n}" for n in [*r["notes"], *r["warnings"]])
    lines.append("")
    for jkey in ("jaxrl", "jaxrl-onpolicy"):
        jrec = by_fw.get(jkey)
        if jrec is None:
            continue
        j_med = _median(jrec)
        for r in records:
            fw = FRAMEWORKS[r["framework"]]
            if fw.goal is None:
                continue
            peer_med = _median(r)
            if j_med is None or peer_med is None:
                why = "; ".join(f"{x['label']} failed" for x in (jrec, r) if x and x["error"])
                lines.append(f"- {jrec['label']} / {fw.label} = n/a ({why}) (goal <= {fw.goal}: not measured)")
            else:
                x = j_med / peer_med
                lines.append(f"- {jrec['label']} / {fw.label} = {x:.2f} "
                             f"(goal <= {fw.goal}: {'met' if x <= fw.goal else 'not met'})")
    lines.append("")
    return lines, notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODEL_NAMES),
                   type=lambda v: _csv(v, MODEL_NAMES, "--models"), help="comma list (default: %(default)s)")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                   type=lambda v: _csv(v, tuple(FRAMEWORKS), "--frameworks"), help="comma list (default: %(default)s)")
    p.add_argument("--steps", type=int, default=W.WARMUP_STEPS + W.MEASURED_STEPS,
                   help="GRPO steps per run incl. %d warm-up (default %%(default)s)" % W.WARMUP_STEPS)
    p.add_argument("--timeout-min", type=float, default=40.0, help="limit per framework run, minutes (default 40)")
    p.add_argument("--setup-timeout-min", type=float, default=60.0, help="limit per venv setup, minutes (default 60)")
    p.add_argument("--skip-setup", action="store_true", help="use the peer venvs as they are; do not run setup")
    a = p.parse_args(argv)
    if a.steps < W.WARMUP_STEPS + 1:
        p.error(f"--steps must be >= {W.WARMUP_STEPS + 1} ({W.WARMUP_STEPS} warm-up + 1 measured), got {a.steps}")
    if a.timeout_min <= 0 or a.setup_timeout_min <= 0:
        p.error(f"timeouts must be > 0 minutes, got --timeout-min {a.timeout_min} "
                f"--setup-timeout-min {a.setup_timeout_min}")
    command = "python bench/grpo_step.py " + " ".join(shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    t_start = time.perf_counter()

    model_dirs = ensure_models(a.models)
    frameworks = [FRAMEWORKS[k] for k in a.frameworks]
    setup_errors = {fw.key: setup_framework(fw, a.setup_timeout_min * 60, a.skip_setup) for fw in frameworks}

    records: list[dict] = []
    for model, model_dir in model_dirs.items():
        for fw in frameworks:
            records.append(run_framework(fw, model, model_dir, a.steps, a.timeout_min * 60, setup_errors[fw.key]))

    workload = (f"workload: {W.NUM_PROMPTS} prompts x group {W.GROUP_SIZE} = {W.NUM_PROMPTS * W.GROUP_SIZE} rows, "
                f"exactly {W.RESPONSE_LENGTH} response tokens (EOS ignored), prompts <= {W.MAX_PROMPT_LENGTH} "
                f"tokens, distinct-word reward, GRPO clip {W.CLIP_EPS}, no KL (no reference model), one AdamW step "
                f"(lr {W.LEARNING_RATE:g}, weight decay 0) per GRPO step over all rows in micro-batches of "
                f"{W.MICRO_BATCH}, grad clip {W.MAX_GRAD_NORM}, temperature {W.TEMPERATURE}, float32")
    md = header_lines("GRPO step time: jaxrl vs TRL vs Tunix", command, [
        workload,
        f"steps: {a.steps} per run; the first {W.WARMUP_STEPS} (warm-up: compilation, caches) dropped, "
        f"then median (min-max) over the other {a.steps - W.WARMUP_STEPS}; seconds of wall time per GRPO step",
        "step s = the whole GRPO step (generation, reward, log-probs, advantages, update, weight sync); "
        "gen / logprob / update = its phases as each framework measures them (- = not exposed); "
        "step time / jaxrl > 1 means slower than jaxrl",
        f"frameworks run back to back per model, each in its own process (peers in their venvs: "
        f"{', '.join(f'{fw.venv}' for fw in frameworks if fw.venv) or 'none'})",
    ])
    notes: list[str] = []
    for model, model_dir in model_dirs.items():
        sec, n = model_section(model, model_dir, [r for r in records if r["model"] == model])
        md.extend(sec)
        notes.extend(n)
    if notes:
        md.extend(["Notes:", ""])
        for n in notes:  # a multi-line note (an error) = its first line, then the rest as a code block
            first, *rest = n.splitlines()
            md.append(f"- {first}")
            if rest:
                md.extend(["  ```", *[f"  {ln}" for ln in rest], "  ```"])
        md.append("")
    md.append(f"Harness wall time: {time.perf_counter() - t_start:.0f} s.")
    md_path, js_path = write_section("grpo_step", md, {"command": command, "workload": workload, "records": records})
    print("\n".join(md))
    print(f"[grpo_step] wrote {md_path.relative_to(ROOT)} and {js_path.relative_to(ROOT)}", flush=True)
    return 0 if all(not r["error"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
