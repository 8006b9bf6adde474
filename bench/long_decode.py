"""Long responses from the embedded sampler: decode in segments over a growing cache; finished rows compacted away.

Two cases, each a baseline and a change timed on the same prompts in one process, alternating call by call:

* ``segments``: a decode step attends over every slot of the cache it is given, so with one loop every step of a
  512-token response reads the slots of tokens not generated yet too. ``JaxSampler(max_decode_segments=4)`` runs the
  decode in up to 4 segments, each over a cache just long enough for it; baseline ``max_decode_segments=1``. Every
  row runs to the end (``ignore_eos``).
* ``compaction``: rows stop at EOS; ``compact_finished_rows=True`` gathers the live rows into a smaller batch once at
  most half are live; baseline ``False`` (every row runs to the longest's end). The same seeds give both the same
  samples (checked: the same token counts).

Common to both:

* model: SmolLM2-135M (``bench/models.py``), float32, the GSM8K chat prompts of ``bench/workload.py`` (verl's
  instruction; 72-157 tokens with SmolLM2's chat template), cycled to the batch;
* up to ``--new-tokens`` per row, temperature 1;
* per sampler: one warm-up call (compiles), then ``--repeats`` timed ``generate`` calls; tokens/s = generated
  tokens / wall time of the call (prefill included); the speedup is the median of the per-round ratios of the call
  times.

Run: ``python bench/long_decode.py [--batches 8,32] [--new-tokens 512] [--repeats 3] [--cases ...]``; writes
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

# (case, sampler kwargs of the baseline, of the change, whether every row runs to the end)
CASES = (
    ("segments", {"max_decode_segments": 1}, {"max_decode_segments": 4}, True),
    ("compaction", {"compact_finished_rows": False}, {"compact_finished_rows": True}, False),
)


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
    ap.add_argument("--new-tokens", type=int, default=512, help="tokens generated per row (at most, to EOS)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per variant and batch after one warm-up")
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES), help="comma list of " +
                    ", ".join(c[0] for c in CASES))
    a = ap.parse_args(argv)
    batches = [int(x) for x in a.batches.split(",") if x]
    cases = [c for c in CASES if c[0] in a.cases.split(",")]

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

    def sampler(**kw):
        return JaxSampler.from_model(pre.model, pre.config, pad_token_id=int(tok.pad_token_id or 0),
                                     eos_token_ids=tuple(pre.config.eos_token_id), max_prompt_length=256, **kw)

    t_start = time.perf_counter()
    records = []
    for case, base_kw, new_kw, to_end in cases:
        samplers = {"baseline": sampler(**base_kw), "change": sampler(**new_kw)}
        sp = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=a.new_tokens,
                            ignore_eos=to_end)

        def call(name: str, b: int, seed: int) -> tuple[float, list[int]]:
            t0 = time.perf_counter()
            out = samplers[name].generate(prompts[:b], sp, rng_seed=seed)
            dt = time.perf_counter() - t0
            lengths = out.response_mask.sum(axis=1).tolist()
            if to_end and sum(lengths) != b * a.new_tokens:
                raise RuntimeError(f"{case} {name}: {sum(lengths)} tokens, expected {b} x {a.new_tokens}")
            return dt, lengths

        for b in batches:
            warm = {name: call(name, b, 0)[0] for name in samplers}
            times = {name: [] for name in samplers}
            tokens = {name: [] for name in samplers}
            lengths = []
            for rep in range(a.repeats):
                order = list(samplers) if rep % 2 == 0 else list(reversed(samplers))
                for name in order:
                    dt, lens = call(name, b, rep + 1)
                    times[name].append(dt)
                    tokens[name].append(sum(lens))
                    if name == "change":
                        lengths.append(lens)
            # same seeds, same samples (up to float32 summation order in a differently shaped batch, which can flip a
            # near-tie): recorded, not assumed
            same = tokens["baseline"] == tokens["change"]
            ratios = [o / c for o, c in zip(times["baseline"], times["change"])]
            flat = sorted(x for lens in lengths for x in lens)
            records.append({"case": case, "batch": b, "new_tokens": a.new_tokens, "to_the_end": to_end,
                            "baseline": base_kw, "change": new_kw, "warmup_s": warm, "same_token_counts": same,
                            "token_counts": tokens,
                            "seconds": {n: stats(ts) for n, ts in times.items()},
                            "tokens_per_s": {n: stats([t / s for t, s in zip(tokens[n], times[n])])
                                             for n in samplers},
                            "response_tokens": {"min": flat[0], "median": flat[len(flat) // 2], "max": flat[-1],
                                                "at_cap": sum(x == a.new_tokens for x in flat) / len(flat)},
                            "speedup": {"median": statistics.median(ratios), "min": min(ratios),
                                        "max": max(ratios)}})
            print(records[-1], flush=True)
    total = time.perf_counter() - t_start

    cmd = "python bench/long_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = header_lines(
        "Long responses: decode in segments over a growing cache; finished rows compacted away", cmd.strip(),
        [f"model: SmolLM2-135M float32; GSM8K chat prompts ({min(len(p) for p in prompts)}-{longest} tokens, prompt "
         f"width {-(-longest // 32) * 32}); up to {a.new_tokens} new tokens per row, temperature 1",
         f"segments: `max_decode_segments` 1 (one loop over the whole cache) vs 4 (segment ends: "
         f"{_ends(a.new_tokens)}), every row to the end (ignore_eos); compaction: `compact_finished_rows` false vs "
         "true (both in segments), rows stopping at EOS (the same seeds, so the same samples in both: "
         "the JSON's same_token_counts says whether every call's token count matched)",
         f"one warm-up call per sampler, then {a.repeats} timed calls each, alternating; cells: median (min-max); "
         "speedup: median (min-max) of the per-round ratios of the call times",
         f"total wall time: {total:.0f} s"])
    lines += ["| case | batch | response tokens min / median / max (at the cap) | baseline tok/s | change tok/s | "
              "speedup | baseline s | change s |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in records:
        x, lt = r["speedup"], r["response_tokens"]
        lines.append(f"| {r['case']} | {r['batch']} | {lt['min']} / {lt['median']} / {lt['max']} "
                     f"({100 * lt['at_cap']:.0f}%) | {fmt_stats(r['tokens_per_s']['baseline'], 1)} | "
                     f"{fmt_stats(r['tokens_per_s']['change'], 1)} | {x['median']:.2f}x ({x['min']:.2f}-"
                     f"{x['max']:.2f}) | {fmt_stats(r['seconds']['baseline'])} | {fmt_stats(r['seconds']['change'])} |")
    md, js = write_section("long_decode", lines, records)
    print(f"wrote {md} and {js} ({total:.0f} s)")


def _ends(r: int) -> str:
    from jaxrl.rollout.jax_sampler import decode_segment_ends

    return ", ".join(map(str, decode_segment_ends(r, 4)))


if __name__ == "__main__":
    main()
