"""Benchmark on one GPU (an H100 on 2026-11-25, an H200 on 2026-12-04): a Qwen3-1.7B-shaped jaxrl model at the seed
recipe's shapes.

Random init (no Qwen weights offline): :class:`jaxrl.models.ModelConfig` with Qwen3-1.7B's shape (hidden 2048,
28 layers, 16 heads / 8 KV heads, head_dim 128, intermediate 6144, vocab 151936, tied embeddings, qk-norm) and
:class:`jaxrl.models.decoder.Decoder`.

1. **bf16 matmul peak**: jitted ``jnp.dot`` of two ``n x n`` bfloat16 matrices, ``n`` in (4096, 8192); ``k``
   back-to-back products per run, median of ``--repeats`` runs; TFLOP/s = ``2 n^3 k / s``; peak = best median.
2. **HBM bandwidth**: jitted ``x * 2`` over a 4 GiB bfloat16 array; bytes = read + written (2 x 4 GiB); median.
3. **Actor update**: :meth:`jaxrl.workers.actor.ActorWorker.update` (GRPO clipped loss, AdamW, grad clip 1.0),
   float32 params (master weights + AdamW state) with bfloat16 compute (``Decoder(dtype=bfloat16)``), over ``B``
   rows x ``T = 512 + 1024`` tokens (random ids, every token valid); tokens/s = ``B T / s``; MFU = model FLOPs / s
   / bf16 peak, model FLOPs per token ``6 N + 12 L nH D T`` (``bench._jaxrl_bench.train_flops_per_token``;
   "+head" adds ``6 V H`` per response token).
4. **Sampler decode**: :class:`jaxrl.rollout.JaxSampler`, bfloat16 params, bfloat16 compute, bfloat16 KV cache,
   prompts of 512 random ids, ``--new-tokens`` tokens per row (``ignore_eos``); whole ``generate`` wall time and
   the prefill alone (the sampler's own jitted prefill on the same shapes), decode = whole - prefill;
   decode tok/s = ``batch x new / decode s``. Roofline = ``batch x HBM B/s / bytes per decode step``, bytes per step
   = bf16 params (all, the tied embedding read once as the LM head) + the KV cache live on average over the
   generation (``batch x (512 + new/2) x L x 2 x nKV x D x 2`` bytes); given for the measured copy bandwidth and
   for the nominal HBM bandwidth of the card (``--nominal-tbps``). The device's allocator peak after each batch
   (``memory_stats()["peak_bytes_in_use"]``) shows what the decode loop holds beside the cache.
   ``--decode-forms reduce@96,matmul@96`` repeats one batch with decode attention as :func:`_decode_gqa_attention`'s
   reductions (the default on XLA:CPU only) and as the two batched matmuls (the default elsewhere). The decode runs
   in ``--decode-segments`` (4) segments over a growing cache (``JaxSampler(max_decode_segments=...)``; each segment
   one more compiled decode program: plan for that on a card where one took 100 s); 1 = one loop over the whole
   cache, as the 2026-11-25 and 2026-12-04 runs did.
5. **GRPO step** (32 prompts x n=3): weight sync (fp32 -> bf16 cast + ``update_weights``) + ``generate`` +
   ``ActorWorker.compute_log_probs`` (old log-probs) + ``ActorWorker.update``; wall seconds of each.

Run: ``PYTHONPATH=. python bench/gpu.py --out DIR --name gpu_h200``; prints one JSON per phase and writes
``DIR/NAME.json``. Phases run in the order above; one that raises is recorded with its error and the next runs;
with ``--deadline S`` a phase is skipped (and recorded so) once ``S`` seconds have passed since the start.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS: dict = {}
OUT: Path | None = None
NAME = "gpu"
START = time.perf_counter()
DEADLINE: float | None = None


def _save(key, value):
    RESULTS[key] = value
    print(json.dumps({key: value}), flush=True)
    if OUT is not None:
        (OUT / f"{NAME}.json").write_text(json.dumps(RESULTS, indent=1))


def _device_memory():
    """The first device's allocator counters in GB (``{}`` where the backend keeps none, as XLA:CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return {name: stats[key] / 1e9 for name, key in (("in_use_gb", "bytes_in_use"), ("peak_gb", "peak_bytes_in_use"))
            if key in stats}


def _phase(name, fn, *args, **kwargs):
    """Run one phase: ``None`` (recorded as skipped) past the deadline, the error recorded when it raises."""
    elapsed = time.perf_counter() - START
    if DEADLINE is not None and elapsed > DEADLINE:
        _save(f"skipped_{name}", f"deadline: {elapsed:.0f} s > {DEADLINE:.0f} s")
        return None
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a benchmark run records a failed phase and goes on
        import traceback

        traceback.print_exc()
        _save(f"error_{name}", f"{type(e).__name__}: {str(e)[:600]}")
        return None
    finally:
        # a phase's workers hold reference cycles (nnx modules): collected now, not when Python next counts enough
        # new objects, or the next phase starts with the last one's parameters and optimizer state on the card
        gc.collect()
        print(json.dumps({"phase": name, "seconds": round(time.perf_counter() - t0, 1),
                          "since_start": round(time.perf_counter() - START, 1), **_device_memory()}), flush=True)


def _median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def qwen3_1p7b_config(tiny=False):
    from jaxrl.models.config import ModelConfig

    if tiny:  # CPU smoke test of this script only
        return ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           tie_word_embeddings=True, qk_norm=True, eos_token_id=(1,), pad_token_id=0)

    return ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                       tie_word_embeddings=True, qk_norm=True, eos_token_id=(151645,), pad_token_id=151643)


def build_model(cfg, param_dtype, remat=False):
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.models.decoder import Decoder

    return Decoder(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=jnp.bfloat16, remat=remat)


def matmul_peak(repeats):
    import jax
    import jax.numpy as jnp

    res = {}
    for n in ((4096, 8192) if jax.default_backend() == "gpu" else (256,)):
        a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
        b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
        dot = jax.jit(jnp.dot)
        dot(a, b).block_until_ready()
        t0 = time.perf_counter()
        dot(a, b).block_until_ready()
        one = max(time.perf_counter() - t0, 1e-6)
        k = max(1, min(500, int(0.3 / one)))
        raw = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(k):
                c = dot(a, b)
            c.block_until_ready()
            raw.append(2 * n**3 * k / (time.perf_counter() - t0) / 1e12)
        res[n] = {"k": k, "tflops_median": _median(raw), "tflops_max": max(raw)}
    peak = max(v["tflops_median"] for v in res.values())
    _save("matmul_bf16", {"sizes": res, "peak_tflops": peak})
    return peak


def hbm_bandwidth(repeats):
    import jax
    import jax.numpy as jnp

    n = 2 * 1024**3 if jax.default_backend() == "gpu" else 2**24  # 2 Gi bf16 elements = 4 GiB on the GPU
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda v: v * 2)
    f(x).block_until_ready()
    raw = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        raw.append(2 * n * 2 / (time.perf_counter() - t0))
    del x
    bw = _median(raw)
    _save("hbm_copy", {"bytes_moved": 4 * n, "read_plus_write_TBps_median": bw / 1e12,
                       "TBps_max": max(raw) / 1e12})
    return bw


def make_actor(model, rows, micro, remat):
    from flax import nnx

    from bench._jaxrl_bench import actor_config
    from jaxrl.workers.actor import ActorWorker

    graphdef, params = nnx.split(model)
    cfg, plan = actor_config(rows, micro, remat=remat)
    actor = ActorWorker(graphdef, params, cfg, plan=plan, temperature=1.0, total_training_steps=1000)
    actor.init_optimizer()
    return actor


def random_batch(rows, p, r, vocab, seed=0, response_ids=None, old=None):
    import numpy as np

    from jaxrl.batch import RLBatch

    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(0, vocab, size=(rows, p), dtype=np.int32)
    resp = rng.integers(0, vocab, size=(rows, r), dtype=np.int32) if response_ids is None else response_ids
    if old is None:
        old = -rng.uniform(0.5, 5.0, size=(rows, r)).astype(np.float32)
    adv = np.repeat(rng.standard_normal((rows, 1)).astype(np.float32), r, axis=1)
    return RLBatch(prompt_ids=prompt_ids, prompt_mask=np.ones((rows, p), np.int32), response_ids=resp,
                   response_mask=np.ones((rows, r), np.int32), group_ids=np.arange(rows, dtype=np.int32) // 3,
                   rollout_log_probs=old, old_log_probs=old, advantages=adv)


def bench_update(cfg, rows, micro, remat, p, r, repeats, peak_tflops):
    import jax

    from bench._jaxrl_bench import train_flops_per_token
    from bench.common import timed_calls

    model = build_model(cfg, jax.numpy.float32, remat)
    actor = make_actor(model, rows, micro, remat)
    del model
    batch = random_batch(rows, p, r, cfg.vocab_size)
    warm, times = timed_calls(lambda: actor.update(batch), repeats)  # update returns host floats: blocks
    s = _median(times)
    fm = train_flops_per_token(cfg, p + r)
    tokens = rows * (p + r)
    flops = fm.base * tokens
    flops_head = flops + fm.head * rows * r
    rec = {"rows": rows, "micro_rows": micro, "remat": remat, "T": p + r, "seconds_median": s,
           "seconds_all": times, "warmup_s": warm, "tokens_per_s": tokens / s,
           "n_nonembedding": fm.n_nonembedding, "flops_per_token_6N_attn": fm.base,
           "achieved_tflops": flops / s / 1e12, "mfu": flops / s / 1e12 / peak_tflops,
           "mfu_with_head": flops_head / s / 1e12 / peak_tflops}
    return actor, rec


DECODE_SEGMENTS = 4  # JaxSampler(max_decode_segments=...) of every sampler here (--decode-segments)


def make_sampler(cfg, p, max_batch_size=None):
    """A :class:`JaxSampler` over a bf16 Decoder (bf16 KV cache, :data:`DECODE_SEGMENTS` decode segments); returns
    ``(sampler, param bytes)``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.rollout import JaxSampler

    model = build_model(cfg, jnp.bfloat16)
    sampler = JaxSampler.from_model(model, cfg, pad_token_id=cfg.pad_token_id, eos_token_ids=cfg.eos_token_id,
                                    max_prompt_length=p, cache_dtype=jnp.bfloat16, max_batch_size=max_batch_size,
                                    max_decode_segments=DECODE_SEGMENTS)
    param_bytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    return sampler, param_bytes


def bench_sampler(cfg, batches, p, new, repeats, bw, nominal_bw, key="sampler", decode_form=None):
    """Time ``generate`` and its prefill per batch size (see the module docstring); ``decode_form`` None keeps the
    decoder's choice, ``"reduce"`` / ``"matmul"`` force :func:`_decode_gqa_attention` or the batched matmuls for
    every decode step of this sampler, on any backend (``decoder.decode_attention_form``, which the decoder looks up
    when the decode program is traced, answers that form while this sampler is built and first called)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.models import decoder
    from jaxrl.rollout.base import SamplingParams
    from jaxrl.rollout.jax_sampler import decode_segment_ends

    default_form = decoder.decode_attention_form
    if decode_form is not None:
        decoder.decode_attention_form = lambda rows, platform: decode_form
    try:
        sampler, param_bytes = make_sampler(cfg, p)
        sp = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=new, ignore_eos=True)
        rng = np.random.default_rng(0)
        prompts = rng.integers(0, cfg.vocab_size, size=(max(batches), p)).tolist()
        kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
        ends = decode_segment_ends(new, sampler.max_decode_segments, sampler.decode_segment_min_tokens)
        first = ends[0]  # the prefill's cache holds the first decode segment's slots
        out = {}
        for b in batches:
            t0 = time.perf_counter()
            res = sampler.generate(prompts[:b], sp, rng_seed=1)
            warm = time.perf_counter() - t0
            assert int(res.response_mask.sum()) == b * new, "sampler generated fewer tokens than asked"
            del res
            ids = jnp.asarray(np.asarray(prompts[:b], np.int32))
            mask = jnp.ones((b, p), jnp.int32)
            pre = []
            for _ in range(max(repeats, 2)):
                t0 = time.perf_counter()
                c = sampler._prefill(sampler._params, ids, mask, max_new_tokens=first)  # generate's prefill
                jax.block_until_ready(c)
                pre.append(time.perf_counter() - t0)
                del c
            whole = []
            for i in range(repeats):
                t0 = time.perf_counter()
                sampler.generate(prompts[:b], sp, rng_seed=2 + i)
                whole.append(time.perf_counter() - t0)
            w, pf = _median(whole), min(pre)
            dec = w - pf
            step_bytes = param_bytes + b * (p + new / 2) * kv_per_token
            cache_bytes = b * (p + new - 1) * kv_per_token
            roof = {name: b * bwv / step_bytes for name, bwv in (("measured", bw), ("nominal", nominal_bw))}
            out[b] = {"new_tokens": new, "whole_s": w, "whole_all": whole, "prefill_s": pf, "decode_s": dec,
                      "warmup_s": warm, "tok_s_whole": b * new / w, "tok_s_decode": b * new / dec,
                      "ms_per_step": 1e3 * dec / new, "bytes_per_step": step_bytes, "param_bytes": param_bytes,
                      "kv_cache_bytes": cache_bytes, "roofline_tok_s": roof,
                      "frac_of_roofline_measured": b * new / dec / roof["measured"],
                      "frac_of_roofline_nominal": b * new / dec / roof["nominal"], "decode_form": decode_form,
                      "decode_segment_ends": list(ends), "device_memory_after": _device_memory()}
            print(json.dumps({key + "_batch": b, **out[b]}), flush=True)
            RESULTS[key] = out
        _save(key, out)
        return sampler
    finally:
        decoder.decode_attention_form = default_form


def grpo_step(cfg, sampler, actor, p, new, steps):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.rollout.base import SamplingParams

    sp = SamplingParams(n=3, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=new, ignore_eos=True)
    rng = np.random.default_rng(5)
    prompts = rng.integers(0, cfg.vocab_size, size=(32, p)).tolist()
    recs = []
    for s in range(steps):
        t = {}
        t0 = time.perf_counter()
        bf = jax.tree.map(lambda x: x.astype(jnp.bfloat16), actor.params)
        sampler.update_weights(bf)
        jax.block_until_ready(sampler._params)
        t["sync"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = sampler.generate(prompts, sp, rng_seed=100 + s)
        t["generate"] = time.perf_counter() - t0
        resp = np.asarray(res.response_ids, np.int32)
        batch = random_batch(96, p, new, cfg.vocab_size, seed=s, response_ids=resp)
        batch = dataclasses.replace(batch, prompt_ids=np.repeat(np.asarray(prompts, np.int32), 3, axis=0))
        t0 = time.perf_counter()
        old, _ = actor.compute_log_probs(batch)
        t["old_log_prob"] = time.perf_counter() - t0
        batch = dataclasses.replace(batch, old_log_probs=np.asarray(old, np.float32))
        t0 = time.perf_counter()
        actor.update(batch)
        t["update"] = time.perf_counter() - t0
        t["total"] = sum(t.values())
        recs.append(t)
        print(json.dumps({"grpo_step": s, **t}), flush=True)
    _save("grpo_step", {"rows": 96, "prompts": 32, "n": 3, "P": p, "R": new, "steps": recs,
                        "note": "first step includes compiles"})


def main():
    global OUT, NAME, DEADLINE, DECODE_SEGMENTS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--name", default="gpu", help="results file NAME.json under --out")
    ap.add_argument("--deadline", type=float, default=None, help="skip phases that start after this many seconds")
    ap.add_argument("--nominal-tbps", type=float, default=3.35, help="the card's nominal HBM bandwidth (H200: 4.8)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--update-cases", default="8:2:0", help="rows:micro:remat,... (the first before --decode-forms)")
    ap.add_argument("--batches", default="8,32,96")
    ap.add_argument("--decode-forms", default="", help="e.g. matmul@96: the sampler again at batch 96, that form")
    ap.add_argument("--grpo-steps", type=int, default=2)
    ap.add_argument("--grpo-micro", type=int, default=2)
    ap.add_argument("--grpo-gen-chunk", type=int, default=32, help="sampler max_batch_size in the GRPO step (0: all)")
    ap.add_argument("--skip", default="")
    ap.add_argument("--decode-segments", type=int, default=DECODE_SEGMENTS,
                    help="JaxSampler max_decode_segments (1: one decode loop over the whole cache)")
    ap.add_argument("--tiny", action="store_true", help="tiny model, CPU smoke test of this script")
    ap.add_argument("--layers", type=int, default=None,
                    help="fewer decoder layers, same widths (quick per-layer A/Bs; MFU and rooflines count them)")
    a = ap.parse_args()
    OUT, NAME, DEADLINE, DECODE_SEGMENTS = Path(a.out), a.name, a.deadline, a.decode_segments
    OUT.mkdir(parents=True, exist_ok=True)
    import jax

    env = {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__}
    try:
        import jaxlib
        import flax
        import optax

        env.update(jaxlib=jaxlib.__version__, flax=flax.__version__, optax=optax.__version__)
        env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                            "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except Exception as e:  # noqa: BLE001 - environment description only
        env["env_error"] = repr(e)
    _save("env", env)
    cfg = qwen3_1p7b_config(a.tiny)
    if a.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=a.layers)
    _save("model", {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size})
    skip = set(a.skip.split(","))
    peak = _phase("matmul", matmul_peak, a.repeats) or float("nan")
    bw = _phase("hbm", hbm_bandwidth, a.repeats) or float("nan")
    nominal = a.nominal_tbps * 1e12
    batches = [int(b) for b in a.batches.split(",")]
    if "sampler" not in skip:
        _phase("sampler", bench_sampler, cfg, batches, a.prompt, a.new_tokens, a.repeats, bw, nominal)
    cases = [tuple(int(x) for x in c.split(":")) for c in a.update_cases.split(",") if c]
    recs = []

    def update_case(rows, micro, remat):
        try:
            _, rec = bench_update(cfg, rows, micro, bool(remat), a.prompt, a.response, a.repeats, peak)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: record and go on
            rec = {"rows": rows, "micro_rows": micro, "remat": bool(remat),
                   "error": f"{type(e).__name__}: {str(e)[:300]}"}
        recs.append(rec)
        print(json.dumps({"update_case": rec}), flush=True)
        _save("actor_update", recs)

    if "update" not in skip and cases:
        _phase("update_" + ":".join(map(str, cases[0])), update_case, *cases[0])
    for spec in filter(None, a.decode_forms.split(",")):
        form, b = spec.split("@")
        _phase(f"sampler_{form}_{b}", bench_sampler, cfg, [int(b)], a.prompt, a.new_tokens, a.repeats, bw, nominal,
               key=f"sampler_{form}_{b}", decode_form=form)
    if "update" not in skip:
        for case in cases[1:]:
            _phase("update_" + ":".join(map(str, case)), update_case, *case)
    if "grpo" not in skip and a.grpo_steps > 0:
        # the step's own sampler: 96 rows generated in chunks of --grpo-gen-chunk rows (0: all at once); the fp32
        # actor and its AdamW state share the card
        def grpo():
            sampler, _ = make_sampler(cfg, a.prompt, a.grpo_gen_chunk or None)
            actor = make_actor(build_model(cfg, jax.numpy.float32, False), 96, a.grpo_micro, False)
            grpo_step(cfg, sampler, actor, a.prompt, a.new_tokens, a.grpo_steps)

        _phase("grpo", grpo)
    _save("total_seconds", time.perf_counter() - START)


if __name__ == "__main__":
    main()
