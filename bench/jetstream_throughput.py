"""Benchmark: generated tokens/s of the JetStream engine (continuous batching) vs the embedded JaxSampler (fixed
batches) on ragged response lengths.

Workload: the first ``N`` GSM8K test questions (``N = --requests-per-slot x batch``, default 4 x batch, or
``--prompts``) (``$JAXRL_SHARED/data/gsm8k/test.jsonl``) as verl's GSM8K
prompt (question + ``jaxrl.data.prepare.GSM8K_INSTRUCTION``) in SmolLM2-135M-Instruct's chat template, at most
``--max-new-tokens`` (256) new tokens, stop at EOS (``<|im_end|>``), temperature 1, top-p 1, no top-k, one sample
per prompt, float32, seed 0: a GRPO rollout's ragged lengths (short answers next to rows that hit the cap).

Concurrency ``batch`` (``--batches``, default 32 and 64), the same for both engines:

* **sampler**: :class:`jaxrl.rollout.JaxSampler` with ``max_batch_size=batch`` generates the requests in consecutive
  chunks of ``batch`` rows; a chunk decodes until its longest row ends (finished rows idle until then);
* **jetstream**: :class:`jaxrl.rollout.jetstream_rollout.JetStreamRollout` with ``batch`` decode slots; a slot
  whose row ends is refilled with the next request at once.

Both engines draw row ``i``'s tokens from the same stream (``fold_in(fold_in(key(seed), i), t)``), so they generate
the same tokens (the script counts the rows that agree, and the largest log-prob gap on them): the same work, timed
two ways.
tokens/s = generated tokens (response-mask sum) / wall seconds of one whole ``generate`` call over all requests
(prefill, host-side slot refill and output assembly included; compilation excluded: one un-timed warm-up call
first: one chunk of the same shapes for the sampler, whose programs depend on ``max_new_tokens``, and one new
token per request for the engine, whose programs do not). ``slot use`` = generated tokens / (decode steps x batch): the
share of the decode work that produced a token.

Continuous batching pays when a slot serves several requests of unequal length: with ``N = batch`` both engines
run one wave and do the same decode steps. Run: ``python bench/jetstream_throughput.py`` (4 requests per slot,
batches 32 and 64: over an hour on a 2-core CPU), ``--requests-per-slot 2`` for less, or ``--quick`` (16 prompts,
batch 8, 64 new tokens) to check it works. Writes
``bench/results/jetstream_throughput.{md,json}``; ``python bench/report.py`` then rebuilds ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fmt_stats, header_lines, stats, write_section  # noqa: E402

MAX_PROMPT_LENGTH = 256


def gsm8k_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first ``count`` GSM8K test questions with verl's instruction, chat-templated token ids.

    Raises:
      FileNotFoundError: the shared GSM8K file is missing (set ``JAXRL_SHARED``).
      ValueError: a prompt longer than :data:`MAX_PROMPT_LENGTH` tokens.
    """
    from jaxrl.data.prepare import GSM8K_INSTRUCTION
    from jaxrl.paths import shared_dir

    path = shared_dir() / "data" / "gsm8k" / "test.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K test file not found at {path}; set JAXRL_SHARED to the shared assets folder")
    rows = [json.loads(line) for line in path.read_text().splitlines()[:count]]
    out = []
    for r in rows:
        chat = [{"role": "user", "content": r["question"] + " " + GSM8K_INSTRUCTION}]
        ids = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
        if len(ids) > MAX_PROMPT_LENGTH:
            raise ValueError(f"GSM8K prompt of {len(ids)} tokens exceeds {MAX_PROMPT_LENGTH}")
        out.append(ids)
    return out


def _load(avg) -> str:
    return "/".join(f"{x:.1f}" for x in avg)


def _timed(engine, prompts, sp, seed: int):
    t0 = time.perf_counter()
    out = engine.generate(prompts, sp, rng_seed=seed)
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests-per-slot", type=int, default=4,
                    help="requests per call = this x batch (the first GSM8K test questions)")
    ap.add_argument("--prompts", type=int, default=None,
                    help="requests per call for every batch (overrides --requests-per-slot)")
    ap.add_argument("--batches", default="32,64", help="comma list of concurrencies (sampler batch = engine slots)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="response cap (rows stop earlier at EOS)")
    ap.add_argument("--repeats", type=int, default=1, help="timed calls per cell after one warm-up call")
    ap.add_argument("--quick", action="store_true", help="small run: 16 prompts, batch 8, 64 new tokens")
    a = ap.parse_args(argv)
    if a.quick:
        a.prompts, a.batches, a.max_new_tokens = 16, "8", 64
    batches = sorted({int(x) for x in a.batches.split(",") if x})
    if ((a.prompts is not None and a.prompts < 1) or a.requests_per_slot < 1 or not batches or min(batches) < 1
            or a.max_new_tokens < 1 or a.repeats < 1):
        ap.error("need --prompts / --requests-per-slot >= 1, batches >= 1, --max-new-tokens >= 1, --repeats >= 1")

    from flax import nnx

    from jaxrl.models import load_pretrained
    from jaxrl.paths import shared_dir
    from jaxrl.rollout import JaxSampler, SamplingParams
    from jaxrl.rollout.jetstream_rollout import JetStreamRollout

    t_start, load_start = time.perf_counter(), os.getloadavg()
    gguf = shared_dir() / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    pre = load_pretrained(str(gguf))
    tok, cfg = pre.tokenizer, pre.config
    graphdef, params = nnx.split(pre.model)
    counts = {b: a.prompts or a.requests_per_slot * b for b in batches}
    all_prompts = gsm8k_prompts(tok, max(counts.values()))
    pad = tok.pad_token_id if tok.pad_token_id is not None else cfg.eos_token_id[0]
    kw = dict(pad_token_id=int(pad), eos_token_ids=tuple(cfg.eos_token_id), max_prompt_length=MAX_PROMPT_LENGTH)
    sp = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=a.max_new_tokens)
    print(f"SmolLM2-135M, GSM8K prompts of {min(map(len, all_prompts))}-{max(map(len, all_prompts))} tokens, "
          f"<= {a.max_new_tokens} new tokens, stop at eos {cfg.eos_token_id}", flush=True)

    records = []
    for b in batches:
        prompts = all_prompts[: counts[b]]
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        # The sampler's programs depend on the call's prompt width (its longest prompt), the chunk size and
        # max_new_tokens: one chunk holding the longest prompt compiles them all.
        others = [p for i, p in enumerate(prompts) if i != longest][: b - 1]
        warm_prompts = {"sampler": [prompts[longest], *others], "jetstream": prompts}
        sampler = JaxSampler(cfg, graphdef, params, max_batch_size=b, **kw)
        rollout = JetStreamRollout(cfg, graphdef, params, max_new_tokens=a.max_new_tokens, slots=b, **kw)
        rec = {"batch": b, "prompts": len(prompts), "max_new_tokens": a.max_new_tokens}
        outs = {}
        engines = {"sampler": sampler, "jetstream": rollout}
        warm = {}
        for name, engine in engines.items():
            t0 = time.perf_counter()
            # Warm-up: compiles every program this workload uses. The sampler: one chunk of the same shapes. The
            # engine's programs do not depend on max_new_tokens (fixed slots and cache): one token per request.
            engine.generate(warm_prompts[name], sp if name == "sampler" else dataclasses.replace(sp, max_new_tokens=1),
                            rng_seed=0)
            warm[name] = time.perf_counter() - t0
        # Timed calls back to back, the order alternating (per repeat and per batch size) so a change in the
        # machine's load does not always land on the same engine; the 1-minute load average after each is kept.
        runs = {name: [] for name in engines}
        for r in range(a.repeats):
            order = list(engines) if (r + batches.index(b)) % 2 == 0 else list(engines)[::-1]
            for name in order:
                steps0 = rollout.engine.num_decode_steps
                out, dt = _timed(engines[name], prompts, sp, 0)
                runs[name].append((out, dt, rollout.engine.num_decode_steps - steps0, os.getloadavg()[0]))
        for name, done in runs.items():
            out = done[-1][0]
            tokens = int(out.response_mask.sum())
            lengths = out.response_lengths
            if name == "sampler":  # chunk c decodes until its longest row ends
                steps = sum(int(lengths[i: i + b].max()) for i in range(0, len(lengths), b))
            else:
                steps = done[-1][2]
            tps = [tokens / dt for _, dt, _, _ in done]
            rec[name] = {**stats(tps), "raw_tps": tps, "seconds": [dt for _, dt, _, _ in done],
                         "load_1min_after": [ld for *_, ld in done], "warmup_s": warm[name], "tokens": tokens,
                         "decode_steps": steps, "slot_use": tokens / (steps * b)}
            outs[name] = out
            print(f"  batch {b:3d} {name:9s}: {fmt_stats(stats(tps), 1)} tok/s, {tokens} tokens, {steps} decode steps, "
                  f"slot use {tokens / (steps * b):.0%} (warm-up {warm[name]:.0f} s, load after "
                  f"{', '.join(f'{ld:.1f}' for *_, ld in done)})", flush=True)
        # Same streams, so the same tokens, up to a sampled token flipping where float32 rounding moves the
        # distribution across the uniform draw (then that row and its length differ): counted, not hidden.
        agree = np.all(outs["sampler"].response_ids == outs["jetstream"].response_ids, axis=1)
        same_rows = int(agree.sum())
        diff = np.abs(outs["sampler"].rollout_log_probs - outs["jetstream"].rollout_log_probs)[agree]
        gap = float(np.max(diff, initial=0.0))
        lengths = outs["jetstream"].response_lengths
        rec.update(same_rows=same_rows, max_log_prob_gap=gap, lengths={"min": int(lengths.min()),
                   "median": float(np.median(lengths)), "max": int(lengths.max()),
                   "at_cap": int((lengths == a.max_new_tokens).sum())},
                   jetstream_over_sampler=rec["jetstream"]["median"] / rec["sampler"]["median"])
        records.append(rec)
    wall = time.perf_counter() - t_start

    cmd = " ".join(["python bench/jetstream_throughput.py", *(sys.argv[1:] if argv is None else argv)])
    ln = records[-1]["lengths"]
    used = all_prompts[: max(counts.values())]
    lines = header_lines(
        "JetStream engine (continuous batching) vs embedded JaxSampler on ragged GSM8K responses", cmd,
        [f"workload: SmolLM2-135M-Instruct (GGUF Q4_1 dequantized, float32), the first N GSM8K test questions "
         f"(N in the table) with verl's instruction in the chat template ({min(map(len, used))}-"
         f"{max(map(len, used))} tokens), <= {a.max_new_tokens} new tokens, stop at eos, temperature 1, seed 0; "
         f"response lengths of the largest N: min {ln['min']} / median {ln['median']:.0f} / max {ln['max']}, "
         f"{ln['at_cap']} of {records[-1]['prompts']} rows at the cap",
         "batch = the sampler's max_batch_size (requests in consecutive fixed batches) = the JetStream engine's "
         "decode slots (refilled as rows end)",
         "tokens/s = generated tokens / wall time of one generate call over all requests (prefill and host loop "
         f"included); median (min-max) of {a.repeats} call(s) per engine after one warm-up call each, the two "
         "engines' calls back to back in alternating order; load after = the machine's 1-minute load average "
         "right after each timed call; same rows = rows whose tokens "
         "both engines generated identically (same per-row random streams)",
         "decode steps: device decode steps (the sampler: the sum over its batches of the longest row); slot use = "
         "tokens / (decode steps x batch)",
         f"total wall time: {wall:.0f} s; load average (1/5/15 min) at start {_load(load_start)}, at end "
         f"{_load(os.getloadavg())} on {os.cpu_count()} logical CPUs (other jobs on the machine slow both "
         "engines)"])
    lines += ["| batch | requests N | sampler tok/s | jetstream tok/s | jetstream / sampler | "
              "sampler steps (slot use) | jetstream steps (slot use) | same rows | max log-prob gap | load after "
              "(sampler / jetstream) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        s, j = r["sampler"], r["jetstream"]
        lines.append(f"| {r['batch']} | {r['prompts']} | {fmt_stats(s, 1)} | {fmt_stats(j, 1)} | "
                     f"{r['jetstream_over_sampler']:.2f}x | "
                     f"{s['decode_steps']} ({s['slot_use']:.0%}) | {j['decode_steps']} ({j['slot_use']:.0%}) | "
                     f"{r['same_rows']}/{r['prompts']} | {r['max_log_prob_gap']:.1e} | "
                     f"{_load(s['load_1min_after'])} / {_load(j['load_1min_after'])} |")
    lines.append("")
    md, js = write_section("jetstream_throughput", lines, records)
    print("\n".join(lines))
    print(f"wrote {md} and {js} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
