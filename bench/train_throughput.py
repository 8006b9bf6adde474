"""Benchmark: jaxrl's actor update (tokens/s, MFU against this machine's measured fp32 matmul peak) + a profile.

1. **Matmul peak**: jitted float32 ``jnp.dot`` of two ``n x n`` matrices, ``n`` in ``--matmul-sizes``; each size is
   timed after a warm-up as the median of ``--repeats`` runs of ``k`` back-to-back products (``k`` chosen so a run
   lasts about half a second); GFLOP/s = ``2 n^3 k / seconds``. **peak** = the best of the per-size medians.
2. **Actor update**: the trainer's own path, :meth:`jaxrl.workers.actor.ActorWorker.update` (one optimizer update:
   GRPO/PPO clipped loss, gradient accumulated over micro-batches with ``lax.scan``, AdamW, grad clip 1.0,
   float32), over a batch of ``B`` rows x ``T = P + R`` tokens (``P`` prompt width, left-padded workload prompts;
   ``R`` response tokens, all valid). The actor config comes from the trainer's config loader (verl keys). One
   un-timed update (compile), then the median (min-max) of ``--repeats`` timed updates.
   ``tokens/s = B * T / seconds``; ``MFU = model FLOPs / seconds / peak`` with model FLOPs per token
   ``6 N + 12 L nH D T`` (``N`` = non-embedding parameters; PaLM, Chowdhery et al. 2022, Appendix B; Kaplan et
   al. 2020, Sec. 2.1); the column "MFU +head" adds the LM-head matmul, ``6 V H`` per scored (response) token,
   which these small models spend a large share of their FLOPs on (vocab 49152). "XLA GFLOP" is the compiled update's own count
   (``Compiled.cost_analysis()``, which counts the micro-batch scan's body once: multiplied by the number of
   micro-batches), for comparison.
3. **Profile** (first model, largest single-micro-batch case without remat): (a) the update taken apart into
   jitted pieces on the same micro-batch -- decoder body forward (hidden states), + LM head (the actor's
   ``_forward_response``), + loss (log-probs, entropy, clipped loss), forward+backward (``value_and_grad``), and the
   whole update (adds the scan, grad clip and AdamW) -- timed round-robin, increments from each piece's fastest
   call; (b) a ``jax.profiler`` trace of one update (kept under ``outputs/bench/profile/<model>/``, open with
   TensorBoard/xprof) whose XLA op times are attributed to HLO instructions (shape + JAX source op) and summed
   by kind (matmul, copy/transpose, scatter/gather/slice/pad, reduction, elementwise) and phase.

Run: ``python bench/train_throughput.py`` (about 20 min on a quiet 2-core box) or ``--quick`` (2-3 min).
Writes ``bench/results/train_throughput.{md,json}``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, WORK_DIR, fmt_stats, header_lines, stats, write_section  # noqa: E402

# (rows B, prompt width P, response tokens R, micro-batch rows, remat)
FULL_CASES = {
    "smollm2-135m": [(8, 32, 64, 8, False), (16, 32, 64, 16, False), (32, 32, 64, 16, False),
                     (16, 32, 64, 16, True)],
    "tiny-qwen2": [(32, 32, 64, 32, False)],
}
QUICK_CASES = {
    "smollm2-135m": [(4, 32, 32, 4, False)],
    "tiny-qwen2": [(8, 32, 32, 8, False)],
}
PROFILE_DIR = WORK_DIR / "profile"


def _wall_times(fn, repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn`` (which must block until its result is ready)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# ----------------------------------------------------------------------------------------- 1. matmul peak
def matmul_peak(sizes: list[int], repeats: int) -> list[dict]:
    """Sustained float32 matmul GFLOP/s per size: ``[{"n", "k", "gflops": stats, "raw"}]`` (see module doc)."""
    import jax
    import jax.numpy as jnp

    out = []
    for n in sizes:
        ka, kb = jax.random.split(jax.random.key(n))
        a = jax.random.normal(ka, (n, n), jnp.float32)
        b = jax.random.normal(kb, (n, n), jnp.float32)
        dot = jax.jit(jnp.dot)
        dot(a, b).block_until_ready()  # compile
        t0 = time.perf_counter()
        dot(a, b).block_until_ready()
        one = max(time.perf_counter() - t0, 1e-6)
        k = max(1, min(200, int(0.5 / one)))

        def run():
            for _ in range(k):
                c = dot(a, b)
            c.block_until_ready()

        raw = [2 * n**3 * k / t / 1e9 for t in _wall_times(run, repeats)]
        out.append({"n": n, "k": k, "gflops": stats(raw), "raw": raw})
        print(f"  matmul {n}x{n}: {fmt_stats(stats(raw), 1)} GFLOP/s ({k} products per run)", flush=True)
    return out


# ----------------------------------------------------------------------------------------- 2. actor update
def _load(model_dir: Path, remat: bool):
    from jaxrl.models import load_pretrained

    return load_pretrained(str(model_dir), remat=remat)


def _actor(pre, rows: int, micro: int, remat: bool):
    from flax import nnx

    from bench._jaxrl_bench import actor_config
    from jaxrl.workers.actor import ActorWorker

    graphdef, params = nnx.split(pre.model)
    cfg, plan = actor_config(rows, micro, remat=remat)
    actor = ActorWorker(graphdef, params, cfg, plan=plan, temperature=1.0, total_training_steps=1000)
    actor.init_optimizer()
    return actor


def _update_programs(actor, batch):
    """The two compiled programs of one mini-batch update: the gradient (micro-batch scan) and the optimizer step."""
    import numpy as np

    arrays = actor.minibatch_arrays(batch)
    stacked, nt, ns = actor.stack_micro(arrays, np.arange(batch.size), actor.mini_batch_rows, actor.micro_batch_rows)
    grads = actor._grads_fn.lower(actor.params, stacked, nt, ns, actor.ref_params, actor.frozen,
                                  prompt_width=batch.prompt_width).compile()
    step = actor._step_fn.lower(actor.params, actor.opt_state, *grads.out_info).compile()  # (gradient, metrics)
    return grads, step


def _xla_flops(actor, batch) -> float | None:
    """FLOPs XLA counts for the compiled mini-batch update, gradient and optimizer step (None if the backend does
    not report them)."""
    def flops_of(compiled):
        cost = compiled.cost_analysis()
        if isinstance(cost, (list, tuple)):
            cost = cost[0] if cost else {}
        return (cost or {}).get("flops")

    try:
        grads, step = _update_programs(actor, batch)
        f_grads, f_step = flops_of(grads), flops_of(step)
    except Exception as e:  # noqa: BLE001 - a missing cost model is reported as "-", not a failure
        print(f"  (no XLA cost analysis: {type(e).__name__}: {e})", flush=True)
        return None
    if not f_grads:
        return None
    # XLA's cost model counts a while loop's body once: scale the micro-batch scan by its trip count
    n_micro = actor.mini_batch_rows // actor.micro_batch_rows
    return float(f_grads) * n_micro + float(f_step or 0.0)


def bench_update(name: str, model_dir: Path, case: tuple, repeats: int, peak_gflops: float) -> dict:
    """Time ``ActorWorker.update`` for one ``(B, P, R, micro, remat)`` case; returns its record."""
    from bench._jaxrl_bench import synthetic_batch, train_flops_per_token

    rows, p, r, micro, remat = case
    pre = _load(model_dir, remat)
    batch = synthetic_batch(pre.tokenizer, rows, p, r, pre.config.vocab_size)
    actor = _actor(pre, rows, micro, remat)
    xla = _xla_flops(actor, batch)
    t0 = time.perf_counter()
    actor.update(batch)  # compile + first update
    warm = time.perf_counter() - t0
    times = _wall_times(lambda: actor.update(batch), repeats)  # update() returns host floats: it blocks
    tokens = rows * (p + r)
    fm = train_flops_per_token(pre.config, p + r)
    flops = fm.base * tokens  # the goal's formula: 6 N + attention, per token of the B x T batch
    flops_head = flops + fm.head * rows * r  # + the LM head at the B x R scoring positions
    s = stats(times)
    tps = [tokens / t for t in times]
    rec = {
        "model": name, "rows": rows, "prompt_width": p, "response_len": r, "seq_len": p + r, "micro_rows": micro,
        "remat": remat, "tokens": tokens, "seconds": s, "raw_seconds": times, "tokens_per_s": stats(tps),
        "warmup_s": warm, "model_flops": flops, "model_flops_with_head": flops_head,
        "n_nonembedding": fm.n_nonembedding, "n_lm_head": fm.n_lm_head, "xla_flops": xla,
        "achieved_gflops": flops / s["median"] / 1e9,
        "mfu": flops / s["median"] / 1e9 / peak_gflops,
        "mfu_with_head": flops_head / s["median"] / 1e9 / peak_gflops,
    }
    print(f"  {name} B={rows} T={p}+{r} micro={micro} remat={remat}: {fmt_stats(s, 3)} s, "
          f"{rec['tokens_per_s']['median']:.0f} tok/s, MFU {rec['mfu']:.1%} (+head {rec['mfu_with_head']:.1%})",
          flush=True)
    return rec


# ----------------------------------------------------------------------------------------- 3. profile
_HLO_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _hlo_index(hlo_text: str) -> dict[str, dict]:
    """``{instruction name: {"shape", "opcode", "op_name", "ynn"}}`` from an optimized HLO module's text."""
    out = {}
    for line in hlo_text.splitlines():
        m = _HLO_LINE.match(line)
        if not m:
            continue
        op = _OP_NAME.search(line)
        out[m.group(1)] = {"shape": m.group(2).split("{")[0], "opcode": m.group(3),
                           "op_name": op.group(1) if op else "", "ynn": "__ynn_fusion" in line}
    return out


def _clean_op_name(op_name: str) -> str:
    """The JAX source op of an HLO instruction, without the jit/while/closed_call prefix."""
    for prefix in ("jit(accumulate_grads)/", "jit(_step)/", "while/body/", "closed_call/"):
        op_name = op_name.replace(prefix, "")
    return op_name.split(";")[0] or "?"


def _category(name: str, info: dict) -> tuple[str, str]:
    """``(kind, phase)`` of one HLO instruction: kind matmul / copy-transpose / scatter-gather-slice / reduction /
    elementwise; phase forward / backward (inside the micro-batch scan) or optimizer (outside it)."""
    op, opcode = info["op_name"], info["opcode"]
    if "while/" not in op:
        phase = "optimizer + grad-norm (outside the scan)"
    elif "transpose(jvp(" in op:
        phase = "backward"
    else:
        phase = "forward"
    base = name.split(".")[0]
    reduce_like = opcode == "reduce" or "reduce" in base or any(k in op for k in ("reduce_", "argmax", "logsumexp"))
    if opcode in ("dot", "convolution") or op.endswith("dot_general") or (info["ynn"] and not reduce_like):
        kind = "matmul"
    elif opcode in ("copy", "transpose") or base.startswith(("copy", "transpose")) or op.endswith("/transpose"):
        kind = "copy / transpose"
    elif any(k in op for k in ("scatter", "gather", "dynamic_slice", "dynamic_update_slice")) or opcode in (
            "scatter", "gather", "dynamic-slice", "dynamic-update-slice", "pad") or "pad" in base or "scatter" in base:
        kind = "scatter / gather / slice / pad"
    elif reduce_like:
        kind = "reduction"
    else:
        kind = "elementwise"
    return kind, phase


def trace_breakdown(actor, batch, trace_dir: Path, top: int = 12) -> dict:
    """Trace one update with ``jax.profiler`` and attribute XLA op time to HLO instructions.

    The trace's per-op events (XLA CPU thunks on the Eigen threads; they run concurrently, so shares are of the
    summed op time, not of wall time) are matched by name to the compiled update's optimized HLO, which gives each
    op's output shape and its JAX source (``op_name`` metadata, e.g. ``transpose(jvp(bth,vh->btv))/dot_general`` =
    the LM head's backward matmul).

    Returns:
      ``{"total_op_ms", "by_kind_phase": [{"kind", "phase", "ms", "share"}], "top": [{"op", "kind", "phase",
      "shape", "source", "ms", "share", "count"}], "trace_dir"}``.
    """
    import glob
    from collections import defaultdict

    import jax

    grads, step = _update_programs(actor, batch)
    # the optimizer step's instructions where their names are not the gradient program's too (the trace names an op
    # by its instruction only; the step is a few % of the update)
    index = {**_hlo_index(step.as_text()), **_hlo_index(grads.as_text())}
    shutil.rmtree(trace_dir, ignore_errors=True)
    trace_dir.mkdir(parents=True, exist_ok=True)
    actor.update(batch)  # make sure the update is compiled and warm before tracing
    with jax.profiler.trace(str(trace_dir)):
        actor.update(batch)
    files = sorted(glob.glob(str(trace_dir / "**" / "*.xplane.pb"), recursive=True))
    if not files:
        raise RuntimeError(f"jax.profiler wrote no *.xplane.pb under {trace_dir}")
    data = jax.profiler.ProfileData.from_file(files[-1])
    per_op: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for plane in data.planes:
        for line in plane.lines:
            if line.name == "python":
                continue
            for ev in line.events:
                if ev.name in index:
                    per_op[ev.name][0] += ev.duration_ns / 1e6
                    per_op[ev.name][1] += 1
    total = sum(v[0] for v in per_op.values()) or 1.0
    by_kp: dict[tuple, float] = defaultdict(float)
    rows = []
    for name, (ms, count) in per_op.items():
        kind, phase = _category(name, index[name])
        by_kp[(kind, phase)] += ms
        rows.append({"op": name, "kind": kind, "phase": phase, "shape": index[name]["shape"],
                     "source": _clean_op_name(index[name]["op_name"]), "ms": ms, "share": ms / total, "count": count})
    rows.sort(key=lambda r: -r["ms"])
    kp = [{"kind": k, "phase": p, "ms": ms, "share": ms / total} for (k, p), ms in by_kp.items()]
    kp.sort(key=lambda r: -r["ms"])
    return {"total_op_ms": total, "by_kind_phase": kp, "top": rows[:top], "trace_dir": str(trace_dir)}


def profile_update(name: str, model_dir: Path, case: tuple, repeats: int) -> dict:
    """Per-phase times of one update plus an op-level trace breakdown (see module doc and :func:`trace_breakdown`).

    The phase pieces are timed round-robin (one call of each per round, ``repeats + 2`` rounds) so load drift on a
    shared machine hits every piece alike; increments use each piece's fastest call (the least-disturbed one).

    Returns:
      ``{"phases": [{"phase", "seconds": stats, "min_s", "increment_s", "share"}], "trace": trace_breakdown(...)}``.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from bench._jaxrl_bench import synthetic_batch
    from jaxrl.workers.actor import _forward_response

    rows, p, r, micro, remat = case
    pre = _load(model_dir, remat)
    batch = synthetic_batch(pre.tokenizer, rows, p, r, pre.config.vocab_size)
    actor = _actor(pre, rows, micro, remat)
    arrays = actor.minibatch_arrays(batch)
    stacked, nt, ns = actor.stack_micro(arrays, np.arange(rows), rows, micro)
    m0 = jax.tree.map(lambda x: jnp.asarray(x[0]), stacked)  # the first micro-batch
    gd = actor.graphdef

    def body(params, m):
        h, _ = nnx.merge(gd, params)(m["input_ids"], m["positions"], m["attention_mask"], return_hidden=True)
        return jnp.sum(h)

    def logits(params, m):
        return jnp.sum(_forward_response(gd, params, m["input_ids"], m["positions"], m["attention_mask"], p, 1.0))

    def loss(params, m):
        return actor._micro_loss(params, m, nt, ns, p)[0]

    n_micro = rows // micro
    pieces = [
        ("decoder body forward (hidden states)", jax.jit(body)),
        ("+ LM head (_forward_response: logits of the R scoring positions)", jax.jit(logits)),
        ("+ log-probs, entropy, clipped loss", jax.jit(loss)),
        ("forward + backward (value_and_grad of the loss)", jax.jit(jax.value_and_grad(loss))),
    ]
    calls = [lambda fn=fn: jax.block_until_ready(fn(actor.params, m0)) for _, fn in pieces]
    calls.append(lambda: actor.update(batch))  # returns host floats: blocks
    labels = [lbl for lbl, _ in pieces] + [
        f"whole update ({n_micro} micro-batch{'es' if n_micro > 1 else ''} in a scan + grad clip + AdamW)"]
    for c in calls:
        c()  # compile / warm
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats + 2):
        for i, c in enumerate(calls):
            t0 = time.perf_counter()
            c()
            times[i].append(time.perf_counter() - t0)
    phases, prev = [], 0.0
    for i, lbl in enumerate(labels):
        best = min(times[i]) * (n_micro if i < len(pieces) else 1)
        phases.append({"phase": lbl, "seconds": stats(times[i]), "min_s": min(times[i]), "increment_s": best - prev})
        prev = best
    for q in phases:
        q["share"] = q["increment_s"] / prev
        print(f"  {q['phase']}: min {q['min_s']:.3f} s, median {q['seconds']['median']:.3f} s "
              f"(+{q['increment_s']:.3f} s, {q['share']:.0%})", flush=True)
    trace = trace_breakdown(actor, batch, PROFILE_DIR / name)
    for t in trace["by_kind_phase"][:8]:
        print(f"  trace: {t['kind']:32s} {t['phase']:40s} {t['ms']:9.1f} ms {t['share']:5.1%}", flush=True)
    return {"phases": phases, "trace": trace}


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,tiny-qwen2", help="comma list of bench/models.py names")
    ap.add_argument("--matmul-sizes", default="1024,2048,4096", help="comma list of square matrix sizes")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement after one warm-up")
    ap.add_argument("--no-profile", action="store_true", help=f"skip the profile (phases + trace in {PROFILE_DIR})")
    ap.add_argument("--quick", action="store_true", help="small run: matmul 512,1024, small batches")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    if a.quick:
        a.matmul_sizes = "512,1024"
    cases = QUICK_CASES if a.quick else FULL_CASES
    sizes = [int(x) for x in a.matmul_sizes.split(",") if x]

    from bench.models import ensure_models

    t_start = time.perf_counter()
    dirs = ensure_models([m for m in a.models.split(",") if m])
    print("matmul peak (float32, jitted jnp.dot):", flush=True)
    mm = matmul_peak(sizes, a.repeats)
    best = max(mm, key=lambda x: x["gflops"]["median"])
    peak = best["gflops"]["median"]
    print(f"  peak {peak:.1f} GFLOP/s (n={best['n']})", flush=True)
    updates = []
    for name, d in dirs.items():
        for case in cases[name]:
            updates.append(bench_update(name, d, case, a.repeats, peak))
    prof, prof_case, prof_model = None, None, None
    if not a.no_profile:
        prof_model = next(iter(dirs))
        single = [c for c in cases[prof_model] if c[0] == c[3] and not c[4]]
        prof_case = max(single or cases[prof_model], key=lambda c: c[0] * (c[1] + c[2]))
        print(f"profile {prof_model} {prof_case}:", flush=True)
        prof = profile_update(prof_model, dirs[prof_model], prof_case, a.repeats)
    wall = time.perf_counter() - t_start

    cmd = " ".join(["python bench/train_throughput.py", *(sys.argv[1:] if argv is None else argv)])
    lines = header_lines(
        "Actor update throughput and MFU", cmd,
        [f"matmul peak: {peak:.1f} GFLOP/s float32 (jitted jnp.dot, n={best['n']}, median of {a.repeats} runs); "
         "per size: " + ", ".join(f"{m['n']}: {fmt_stats(m['gflops'], 1)}" for m in mm),
         "update: ActorWorker.update, one AdamW step over B rows x T = P + R tokens (P = left-padded prompt width, "
         "R response tokens, all valid), float32, GRPO clipped loss, no KL; median (min-max) of "
         f"{a.repeats} updates after 1 warm-up",
         "model FLOPs per token = 6 N + 12 L nH D T (N = non-embedding params; PaLM App. B / Kaplan et al. 2020); "
         "MFU = model FLOPs / s / peak; 'MFU +head' adds 6 V H per response token (the LM-head matmul, which the "
         "actor runs on the B x R scoring positions only)",
         f"total wall time: {wall:.0f} s"])
    lines += ["| model | B | T = P + R | micro | remat | update s | tokens/s | GFLOP/s (6N+attn) | MFU | MFU +head "
              "| XLA GFLOP / formula GFLOP (+head) |",
              "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for u in updates:
        xla = "-" if not u["xla_flops"] else (
            f"{u['xla_flops'] / 1e9:.0f} / {u['model_flops_with_head'] / 1e9:.0f}")
        lines.append(
            f"| {u['model']} | {u['rows']} | {u['seq_len']} = {u['prompt_width']} + {u['response_len']} | "
            f"{u['micro_rows']} | {'on' if u['remat'] else 'off'} | {fmt_stats(u['seconds'], 3)} | "
            f"{u['tokens_per_s']['median']:.0f} | {u['achieved_gflops']:.1f} | {u['mfu']:.1%} | "
            f"{u['mfu_with_head']:.1%} | {xla} |")
    smol = [u for u in updates if u["model"] == "smollm2-135m"]
    lines.append("")
    if smol:
        at32 = [u for u in smol if u["rows"] == 32]  # the goal's batch; the best case when it was not run
        top = max(at32 or smol, key=lambda u: u["mfu"])
        lines.append(
            f"- goal (issue 19) **actor update >= 55% of measured matmul peak for SmolLM2-135M at B=32**: "
            f"{'met' if top['mfu'] >= 0.55 else 'not met'} ({top['mfu']:.1%}, B={top['rows']}, "
            f"T={top['seq_len']}, micro {top['micro_rows']}, remat {'on' if top['remat'] else 'off'}; "
            f"{top['mfu_with_head']:.1%} counting the LM head).")
    if prof:
        rows, p, r, micro, remat = prof_case
        lines += ["", f"Profile: {prof_model}, B={rows}, T={p}+{r}, micro {micro}, remat {'on' if remat else 'off'}. "
                  "(a) jitted pieces on the same micro-batch, round-robin; increment = the piece's added cost, from "
                  "the fastest call of each", "",
                  "| piece | s median (min-max) | increment s | share of update |", "|---|---:|---:|---:|"]
        for q in prof["phases"]:
            lines.append(f"| {q['phase']} | {fmt_stats(q['seconds'], 3)} | {q['increment_s']:.3f} | "
                         f"{q['share']:.0%} |")
        tr = prof["trace"]
        lines += ["", f"(b) XLA op time of one traced update ({tr['total_op_ms']:.0f} ms summed over the Eigen "
                  f"threads; trace in `{Path(tr['trace_dir']).relative_to(ROOT)}`), by kind and phase:", "",
                  "| kind | phase | ms | share |", "|---|---|---:|---:|"]
        lines += [f"| {t['kind']} | {t['phase']} | {t['ms']:.1f} | {t['share']:.1%} |" for t in tr["by_kind_phase"]]
        lines += ["", "Top HLO ops:", "", "| op | kind | phase | output shape | JAX source | ms | share |",
                  "|---|---|---|---|---|---:|---:|"]
        lines += [f"| {t['op']} | {t['kind']} | {t['phase']} | `{t['shape']}` | `{t['source'][:70]}` | "
                  f"{t['ms']:.1f} | {t['share']:.1%} |" for t in tr["top"]]
    lines.append("")
    records = {"matmul": mm, "peak_gflops": peak, "updates": updates, "profile": prof,
               "profile_case": prof_case, "profile_model": prof_model}
    md, js = write_section("train_throughput", lines, records)
    print("\n".join(lines))
    print(f"wrote {md} and {js} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
