"""Long responses from the embedded sampler: the decode in segments over a growing cache vs one loop over it all.

A decode step attends over every slot of the cache it is given, so with one loop every step of a 512-token response
reads the slots of tokens not generated yet too. ``JaxSampler(max_decode_segments=K)`` runs the decode in up to
``K`` segments, each over a cache just long enough for it (``jaxrl/rollout/jax_sampler.py``). This benchmark times
both on the same prompts in one process, the variants alternating call by call:

* model: SmolLM2-135M (``bench/models.py``), float32, the GSM8K chat prompts of ``bench/workload.py`` (verl's
  instruction; 72-157 tokens with SmolLM2's chat template), cycled to the batch;
* ``max_new_tokens`` per row with ``ignore_eos`` (every row runs to the end: both variants do the same steps),
  temperature 1;
* per variant: one warm-up call (compiles), then ``--repeats`` timed ``generate`` calls; tokens/s = rows x new tokens
  / wall time of the call (prefill included); the ratio is the median of the per-round ratios.

Run: ``python bench/long_decode.py [--batches 8,32] [--new-tokens 512] [--repeats 3]``; writes
``bench/results/long_decode.{md,json}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fmt_stats, header_lines, stats, write_section  # noqa: E402

VARIANTS = {"one loop": 1, "segments": 4}  # max_decode_segments


def gsm8k_prompt_ids(tokenizer, rows: int) -> list[list[int]]:
    """``rows`` GSM8K chat prompts (``bench.workload.gsm8k_messages``) as token ids, the first 16 cycled."""
    from bench.workload import gsm8k_messages

    base = []
    for m in gsm8k_messages(16):
        ids = tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
        base.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return [base[i % len(base)] for i in range(rows)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,32", help="comma list of rows per generate call")
    ap.add_argument("--new-tokens", type=int, default=512, help="tokens generated per row")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per variant and batch after one warm-up")
    a = ap.parse_args(argv)
    batches = [int(x) for x in a.batches.split(",") if x]

    from bench.models import MODELS_DIR, complete
    from jaxrl.models import load_pretrained
    from jaxrl.rollout import JaxSampler
    from jaxrl.rollout.base import SamplingParams

    model_dir = MODELS_DIR / "smollm2-135m"
    if not complete(model_dir):
        raise SystemExit(f"{model_dir} is missing: run `python bench/models.py` first")
    pre = load_pretrained(str(model_dir))
    tok = pre.tokenizer
    prompts = gsm8k_prompt_ids(tok, max(batches))
    longest = max(len(p) for p in prompts)
    samplers = {name: JaxSampler.from_model(pre.model, pre.config, pad_token_id=int(tok.pad_token_id or 0),
                                            eos_token_ids=tuple(pre.config.eos_token_id), max_prompt_length=256,
                                            max_decode_segments=k) for name, k in VARIANTS.items()}
    sp = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=a.new_tokens, ignore_eos=True)

    def call(name: str, b: int, seed: int) -> float:
        t0 = time.perf_counter()
        out = samplers[name].generate(prompts[:b], sp, rng_seed=seed)
        dt = time.perf_counter() - t0
        if int(out.response_mask.sum()) != b * a.new_tokens:
            raise RuntimeError(f"{name}: {int(out.response_mask.sum())} tokens, expected {b} x {a.new_tokens}")
        return dt

    t_start = time.perf_counter()
    records = []
    for b in batches:
        warm = {name: call(name, b, 0) for name in VARIANTS}
        times = {name: [] for name in VARIANTS}
        for rep in range(a.repeats):
            order = list(VARIANTS) if rep % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                times[name].append(call(name, b, rep + 1))
        tps = {name: [b * a.new_tokens / t for t in ts] for name, ts in times.items()}
        ratios = [s / o for s, o in zip(tps["segments"], tps["one loop"])]
        records.append({"batch": b, "new_tokens": a.new_tokens, "warmup_s": warm,
                        "seconds": {n: stats(ts) for n, ts in times.items()},
                        "tokens_per_s": {n: stats(v) for n, v in tps.items()},
                        "ratio_segments_over_one_loop": {"median": statistics.median(ratios), "min": min(ratios),
                                                         "max": max(ratios)}})
        print(records[-1], flush=True)
    total = time.perf_counter() - t_start

    cmd = "python bench/long_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = header_lines(
        "Long responses: decode in segments over a growing cache vs one loop", cmd.strip(),
        [f"model: SmolLM2-135M float32; GSM8K chat prompts ({min(len(p) for p in prompts)}-{longest} tokens, prompt "
         f"width {-(-longest // 32) * 32}); {a.new_tokens} new tokens per row (ignore_eos), temperature 1",
         f"variants: `max_decode_segments` {VARIANTS['one loop']} (one loop over the whole cache) and "
         f"{VARIANTS['segments']} (segment ends: {_ends(a.new_tokens)}); one warm-up call each, then {a.repeats} "
         "timed calls each, alternating; cells: median (min-max); ratio: median (min-max) of the per-round ratios",
         f"total wall time: {total:.0f} s"])
    lines += ["| batch | one loop tok/s | segments tok/s | segments / one loop | one loop s | segments s |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        ratio = r["ratio_segments_over_one_loop"]
        lines.append(f"| {r['batch']} | {fmt_stats(r['tokens_per_s']['one loop'], 1)} | "
                     f"{fmt_stats(r['tokens_per_s']['segments'], 1)} | {ratio['median']:.2f}x "
                     f"({ratio['min']:.2f}-{ratio['max']:.2f}) | {fmt_stats(r['seconds']['one loop'])} | "
                     f"{fmt_stats(r['seconds']['segments'])} |")
    md, js = write_section("long_decode", lines, records)
    print(f"wrote {md} and {js} ({total:.0f} s)")


def _ends(r: int) -> str:
    from jaxrl.rollout.jax_sampler import decode_segment_ends

    return ", ".join(map(str, decode_segment_ends(r, VARIANTS["segments"])))


if __name__ == "__main__":
    main()
