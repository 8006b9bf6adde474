"""GRPO step time, jaxrl against TRL and Tunix, side by side in one run on one machine.

Usage::

    python bench/grpo_step.py [--workload fixed|gsm8k] [--models tiny-qwen2,smollm2-135m]
                              [--frameworks jaxrl,trl,tunix] [--steps 5]

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

``--workload gsm8k`` runs the ragged workload instead (:data:`bench.workload.GSM8K`: the first 8 real GSM8K train
questions as chat turns, responses stopping at EOS or 128 tokens), by default with ``jaxrl`` (padded rows,
fixed micro-batches), ``jaxrl-packed`` (``use_remove_padding`` + ``use_dynamic_bsz`` with a 1024-token budget for
the update and the log-prob forward), TRL and Tunix. Sampling differs per framework, so the response tokens per
step differ too: the report adds the step time per 1,000 response tokens and gives the goal ratios (jaxrl / TRL
<= 0.5, jaxrl / Tunix <= 0.7) both for the step time and per response token. Results:
``bench/results/grpo_step_gsm8k.{md,json}``; raw peer JSON and logs: ``outputs/bench/grpo_step_gsm8k/<model>/``.
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
    extra: tuple[str, ...] = ()  # extra peer-script arguments

    def python(self) -> Path:
        """The interpreter that runs this framework's peer script."""
        return Path(sys.executable) if self.venv is None else ROOT / self.venv / "bin" / "python"


FRAMEWORKS = {
    "jaxrl": Framework("jaxrl", "jaxrl", "bench/peers/jaxrl_grpo.py"),
    # the same without the old-log-prob pass (recompute_old_log_prob=false), the work TRL and Tunix do here
    "jaxrl-onpolicy": Framework("jaxrl-onpolicy", "jaxrl, no old-log-prob pass", "bench/peers/jaxrl_grpo.py",
                                extra=("--no-old-log-prob",)),
    # packed rows + token-budget micro-batches (use_remove_padding, use_dynamic_bsz), meant for ragged responses
    "jaxrl-packed": Framework("jaxrl-packed", "jaxrl, packed + dynamic batch", "bench/peers/jaxrl_grpo.py",
                              extra=("--packed",)),
    # each prompt's forward once for its group's responses (actor.use_prefix_grouper: packed rows, prompts shared)
    "jaxrl-pg": Framework("jaxrl-pg", "jaxrl, prefix grouper", "bench/peers/jaxrl_grpo.py",
                          extra=("--prefix-grouper",)),
    "jaxrl-pg-onpolicy": Framework("jaxrl-pg-onpolicy", "jaxrl, prefix grouper, no old-log-prob pass",
                                   "bench/peers/jaxrl_grpo.py", extra=("--prefix-grouper", "--no-old-log-prob")),
    # everything a ragged GRPO batch can use: shared prompts, token-budget micro-batches, no old-log-prob pass
    "jaxrl-pg-packed-onpolicy": Framework(
        "jaxrl-pg-packed-onpolicy", "jaxrl, prefix grouper + dynamic batch, no old-log-prob pass",
        "bench/peers/jaxrl_grpo.py", extra=("--prefix-grouper", "--packed", "--no-old-log-prob")),
    "trl": Framework("trl", "TRL", "bench/peers/trl_grpo.py", "scripts/setup_bench_trl.sh", ".venv-bench-trl"),
    "tunix": Framework("tunix", "Tunix", "bench/peers/tunix_grpo.py", "scripts/setup_bench_tunix.sh",
                       ".venv-bench-tunix"),
}
# the jaxrl variants the goal lines are given for
JAXRL_KEYS = ("jaxrl", "jaxrl-onpolicy", "jaxrl-packed", "jaxrl-pg", "jaxrl-pg-onpolicy", "jaxrl-pg-packed-onpolicy")
# claims per workload: jaxrl step time / the framework's <= goal
GOALS = {"fixed": {"trl": 0.5, "tunix": 1.0}, "gsm8k": {"trl": 0.5, "tunix": 0.7}}
DEFAULT_FRAMEWORKS = {"fixed": ("jaxrl", "jaxrl-onpolicy", "trl", "tunix"),
                      "gsm8k": ("jaxrl", "jaxrl-packed", "trl", "tunix")}
SECTIONS = {"fixed": "grpo_step", "gsm8k": "grpo_step_gsm8k"}  # bench/results/<section>.{md,json}


def out_dir(workload: str) -> Path:
    """Where a workload's peer JSON, logs and runs go: ``outputs/bench/<section>/``."""
    return WORK_DIR / SECTIONS[workload]


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


def setup_framework(fw: Framework, timeout_s: float, skip: bool, logs: Path = OUT_DIR) -> str | None:
    """Create or reuse ``fw``'s venv with its setup script (its log in ``logs``); returns None when usable, else the
    error text."""
    if fw.setup is None:
        return None
    py = fw.python()
    if skip:
        return None if py.is_file() else f"--skip-setup and no venv interpreter at {py}"
    script = ROOT / fw.setup
    if not script.is_file():
        return f"setup script {fw.setup} not found (and so no venv {fw.venv})"
    log = logs / f"setup-{fw.key}.log"
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


def per_1k_tokens(steps: list[dict]) -> dict | None:
    """Stats of each step's ``total_s`` per 1,000 response tokens (``1000 * total_s / response_tokens``, one value
    per step, then median/min/max); None when a step has no token count or none at all."""
    toks = [s.get("response_tokens") for s in steps]
    if not steps or any(not t for t in toks):
        return None
    return stats([1000.0 * s["total_s"] / t for s, t in zip(steps, toks)])


def summarize(result: dict, steps_requested: int, workload: W.Workload = W.FIXED) -> dict:
    """Stats over the measured steps of a peer's JSON (first ``WARMUP_STEPS`` dropped, ordered by ``step``).

    Returns ``{"phases": {key: stats | None}, "response_tokens": stats | None, "n_steps": int, "warnings": [..]}``,
    and for a workload of ragged lengths also ``"s_per_1k_tokens"`` (:func:`per_1k_tokens`). A token count off the
    workload (not exactly ``rows x RESPONSE_LENGTH`` for ``fixed``; none or over the cap for ``gsm8k``) is a warning.

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
    expected = workload.max_response_tokens()
    out = {"phases": phases, "response_tokens": tok_stats, "n_steps": len(steps), "warnings": warnings}
    if workload.exact_length:
        if tok_stats and (tok_stats["min"] != expected or tok_stats["max"] != expected):
            warnings.append(f"response tokens/step {tok_stats['min']:.0f}-{tok_stats['max']:.0f}, "
                            f"workload is {expected}")
        return out
    if tok_stats and (tok_stats["min"] <= 0 or tok_stats["max"] > expected):
        warnings.append(f"response tokens/step {tok_stats['min']:.0f}-{tok_stats['max']:.0f}, workload allows "
                        f"1-{expected}")
    return {**out, "s_per_1k_tokens": per_1k_tokens(measured)}


def run_framework(fw: Framework, model: str, model_dir: Path, steps: int, timeout_s: float,
                  setup_error: str | None, workload: W.Workload = W.FIXED) -> dict:
    """Run one framework on one model and workload; returns its record (``error`` set, no stats, when it failed)."""
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
    base = out_dir(workload.name) / model
    out = base / f"{fw.key}.json"
    log = base / f"{fw.key}.log"
    out.unlink(missing_ok=True)  # never read a stale result
    args = [fw.script, "--model-dir", str(model_dir), "--model-name", model, "--steps", str(steps), "--out", str(out),
            *fw.extra]
    if workload is not W.FIXED:  # the fixed workload's command stays what it always was
        args += ["--workload", workload.name]
    rec["command"] = " ".join(shlex.quote(str(a)) for a in [fw.python(), *args])
    print(f"[grpo_step] {model} / {fw.label}: {rec['command']}", flush=True)
    t0 = time.perf_counter()
    try:
        run_in_venv(fw.python(), args, timeout_s=timeout_s, log_path=log, env={"PYTHONPATH": str(ROOT)})
        result = json.loads(out.read_text(encoding="utf-8"))
        rec.update(summarize(result, steps, workload))
        rec["version"] = result.get("version")
        rec["notes"] = [str(n) for n in result.get("notes", [])]
        rec["steps"] = result["steps"]
    except Exception as e:  # noqa: BLE001 - one peer's failure must not stop the others
        rec["error"] = "\n".join(_error_lines(e)) + f"\n(log: {log.relative_to(ROOT)})"
    rec["wall_s"] = time.perf_counter() - t0
    status = "failed" if rec["error"] else f"step median {rec['phases']['total_s']['median']:.3f} s"
    print(f"[grpo_step] {model} / {fw.label}: {status} ({rec['wall_s']:.0f} s)", flush=True)
    return rec


def _median(rec: dict | None, key: str = "total_s") -> float | None:
    """The median step time (``total_s``) or, with ``key="s_per_1k_tokens"``, the median s per 1k response tokens of
    a record; None when it failed or lacks the value."""
    if not rec or rec.get("error"):
        return None
    s = rec["phases"]["total_s"] if key == "total_s" else rec.get(key)
    return s["median"] if s else None


def _verdict(x: float, goal: float) -> str:
    return f"goal <= {goal}: {'met' if x <= goal else 'not met'}"


def goal_lines(records: list[dict], goals: dict[str, float], per_token: bool = False) -> list[str]:
    """One line per (jaxrl variant present, framework with a goal in ``goals``): ``jaxrl / TRL = 0.42 (goal <= 0.5:
    met)``, ``n/a`` naming the failed run when either failed. With ``per_token`` (ragged responses) the line also
    gives the ratio of the s per 1k response tokens and its own verdict."""
    by_fw = {r["framework"]: r for r in records}
    lines = []
    for jkey in JAXRL_KEYS:
        jrec = by_fw.get(jkey)
        if jrec is None:
            continue
        j_med = _median(jrec)
        for r in records:
            goal = goals.get(r["framework"])
            if goal is None:
                continue
            label = FRAMEWORKS[r["framework"]].label
            peer_med = _median(r)
            if j_med is None or peer_med is None:
                why = "; ".join(f"{x['label']} failed" for x in (jrec, r) if x and x["error"])
                lines.append(f"- {jrec['label']} / {label} = n/a ({why}) (goal <= {goal}: not measured)")
                continue
            x = j_med / peer_med
            line = f"- {jrec['label']} / {label} = {x:.2f} ({_verdict(x, goal)})"
            if per_token:
                jn, pn = _median(jrec, "s_per_1k_tokens"), _median(r, "s_per_1k_tokens")
                if jn is None or pn is None:
                    line += "; per 1k response tokens: n/a (no token count)"
                else:
                    line += f"; per 1k response tokens = {jn / pn:.2f} ({_verdict(jn / pn, goal)})"
            lines.append(line)
    return lines


def model_section(model: str, model_dir: Path, records: list[dict],
                  workload: W.Workload = W.FIXED) -> tuple[list[str], list[str]]:
    """The markdown table and goal lines for one model, and its notes (ragged workloads: with the s per 1k response
    tokens column and per-token goal ratios)."""
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    by_fw = {r["framework"]: r for r in records}
    jax_med = _median(by_fw.get("jaxrl"))
    ragged = not workload.exact_length
    extra_head = " s per 1k response tokens |" if ragged else ""
    lines = [
        f"### {model} ({cfg.get('model_type')}, {num_params(model_dir) / 1e6:.1f} M params)", "",
        "| framework | version | step s | gen s | logprob s | update s | response tokens/step |" + extra_head
        + " step time / jaxrl |",
        "|---|---|---|---|---|---|---|---|" + ("---|" if ragged else ""),
    ]
    notes: list[str] = []
    for r in records:
        if r["error"]:
            first = r["error"].splitlines()
            msg = first[-2] if len(first) > 1 and first[-1].startswith("(log:") else first[-1]
            lines.append(f"| {r['label']} | {r['version'] or '-'} | failed: {_cell(msg)} | - | - | - | - | - |"
                         + (" - |" if ragged else ""))
            notes.append(f"{model} / {r['label']} failed:\n" + "\n".join(r["error"].splitlines()[:10]))
            continue
        ph = r["phases"]
        med = ph["total_s"]["median"]
        ratio = f"{med / jax_med:.2f}x" if jax_med else "-"
        toks = fmt_stats(r["response_tokens"], 0)
        per_1k = f" {fmt_stats(r.get('s_per_1k_tokens'), 3)} |" if ragged else ""
        lines.append(f"| {r['label']} | {r['version'] or '-'} | " + " | ".join(fmt_stats(ph[k], 3) for k, _ in PHASES)
                     + f" | {toks} |{per_1k} {ratio} |")
        notes.extend(f"{model} / {r['label']}: {n}" for n in [*r["notes"], *r["warnings"]])
    lines.append("")
    lines.extend(goal_lines(records, GOALS[workload.name], per_token=ragged))
    lines.append("")
    return lines, notes


def workload_lines(workload: W.Workload) -> list[str]:
    """The header lines that describe ``workload`` (the ``fixed`` one exactly as it always read)."""
    common = (f"distinct-word reward, GRPO clip {W.CLIP_EPS}, no KL (no reference model), one AdamW step "
              f"(lr {W.LEARNING_RATE:g}, weight decay 0) per GRPO step over all rows in micro-batches of "
              f"{W.MICRO_BATCH}, grad clip {W.MAX_GRAD_NORM}, temperature {W.TEMPERATURE}, float32")
    rows = f"{W.NUM_PROMPTS} prompts x group {W.GROUP_SIZE} = {W.NUM_PROMPTS * W.GROUP_SIZE} rows"
    if workload.exact_length:
        return [f"workload: {rows}, exactly {workload.response_length} response tokens (EOS ignored), prompts <= "
                f"{workload.max_prompt_length} tokens, " + common]
    return [
        f"workload: {workload.name}: the first {W.NUM_PROMPTS} GSM8K train questions + verl's instruction "
        f"('{W.GSM8K_INSTRUCTION}') as one user turn, rendered by each framework's own tokenizer chat template with "
        f"the generation prompt; {rows}, responses stop at EOS or after {workload.response_length} new tokens, "
        f"prompts <= {workload.max_prompt_length} tokens, " + common.replace(
            f"micro-batches of {W.MICRO_BATCH}",
            f"micro-batches of {W.MICRO_BATCH} rows (jaxrl packed: of <= {W.GSM8K_TOKEN_BUDGET} real tokens)"),
        "response lengths are ragged and sampling differs per framework (engines, random streams), so each "
        "framework generates a different number of response tokens per step: the step-time ratios compare different "
        "token counts; s per 1k response tokens (median over the measured steps of 1000 x step s / response "
        "tokens) normalises for that, and the goal lines give both ratios",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=tuple(W.WORKLOADS), default="fixed",
                   help="fixed: story prompts, exactly 32 tokens; gsm8k: real GSM8K chat prompts, responses to EOS "
                        "(default %(default)s)")
    p.add_argument("--models", default=",".join(MODEL_NAMES),
                   type=lambda v: _csv(v, MODEL_NAMES, "--models"), help="comma list (default: %(default)s)")
    p.add_argument("--frameworks", default=None, type=lambda v: _csv(v, tuple(FRAMEWORKS), "--frameworks"),
                   help="comma list of " + ", ".join(FRAMEWORKS) + " (default: " + "; ".join(
                       f"{k}: {','.join(v)}" for k, v in DEFAULT_FRAMEWORKS.items()) + ")")
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

    wl = W.get(a.workload)
    if wl.chat:
        wl.prompts()  # the prompts must exist before any framework runs (FileNotFoundError names the fix)
    model_dirs = ensure_models(a.models)
    frameworks = [FRAMEWORKS[k] for k in (a.frameworks or DEFAULT_FRAMEWORKS[wl.name])]
    setup_errors = {fw.key: setup_framework(fw, a.setup_timeout_min * 60, a.skip_setup, out_dir(wl.name))
                    for fw in frameworks}

    records: list[dict] = []
    for model, model_dir in model_dirs.items():
        for fw in frameworks:
            records.append(run_framework(fw, model, model_dir, a.steps, a.timeout_min * 60, setup_errors[fw.key],
                                         wl))

    workload, *workload_notes = workload_lines(wl)
    title = "GRPO step time: jaxrl vs TRL vs Tunix" + ("" if wl is W.FIXED else f", {wl.name} workload (ragged)")
    md = header_lines(title, command, [
        workload,
        *workload_notes,
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
        sec, n = model_section(model, model_dir, [r for r in records if r["model"] == model], wl)
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
    md_path, js_path = write_section(SECTIONS[wl.name], md, {"command": command, "workload": workload,
                                                              "records": records})
    print("\n".join(md))
    print(f"[grpo_step] wrote {md_path.relative_to(ROOT)} and {js_path.relative_to(ROOT)}", flush=True)
    return 0 if all(not r["error"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
