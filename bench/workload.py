"""The one GRPO workload every framework runs in ``bench/grpo_step.py`` (pure Python: importable from any venv).

Same work for jaxrl, TRL and Tunix:

* prompts: the first ``NUM_PROMPTS`` story openings of ``jaxrl/data/builtin/story_prompts.jsonl`` (raw text, no
  chat template), tokenized by the model directory's own tokenizer;
* ``GROUP_SIZE`` responses per prompt (GRPO group), sampled at temperature 1.0, top-p 1, no top-k;
* every response is exactly ``RESPONSE_LENGTH`` tokens (EOS is ignored / suppressed so all frameworks generate
  the same number of tokens);
* reward :func:`reward` (distinct-word ratio, pure Python, cheap);
* GRPO loss with clip epsilon 0.2, no KL term (beta 0: no reference model), one optimizer step per GRPO step
  (mini-batch = all ``NUM_PROMPTS * GROUP_SIZE`` rows), gradient accumulation over micro-batches of
  ``MICRO_BATCH`` rows, AdamW(lr 1e-6, betas (0.9, 0.999), eps 1e-8, weight decay 0), global grad-norm clip 1.0,
  float32 everywhere.
* ``WARMUP_STEPS`` un-timed steps (compilation, caches), then the median over the measured steps.

Every peer script writes JSON: ``{"framework", "version", "model", "steps": [{"step", "total_s", "gen_s",
"logprob_s", "update_s", "response_tokens"}], "notes": [..]}`` (a split it cannot expose is ``null``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

NUM_PROMPTS = 8
GROUP_SIZE = 4
RESPONSE_LENGTH = 32
MAX_PROMPT_LENGTH = 64
MICRO_BATCH = 8
LEARNING_RATE = 1e-6
CLIP_EPS = 0.2
MAX_GRAD_NORM = 1.0
WARMUP_STEPS = 1
MEASURED_STEPS = 4
TEMPERATURE = 1.0

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "jaxrl" / "data" / "builtin" / "story_prompts.jsonl"


def prompts(n: int = NUM_PROMPTS) -> list[str]:
    """The first ``n`` prompt texts of the built-in story openings.

    Raises:
      ValueError: the file has fewer than ``n`` rows or a row without a text prompt.
    """
    out = []
    with open(PROMPTS_FILE, encoding="utf-8") as f:
        for line in f:
            if len(out) == n:
                break
            row = json.loads(line)
            text = row.get("prompt")
            if isinstance(text, list):  # chat format: the user turn's content
                text = text[-1]["content"]
            if not isinstance(text, str):
                raise ValueError(f"{PROMPTS_FILE}: row {len(out)} has no text prompt: {row}")
            out.append(text)
    if len(out) < n:
        raise ValueError(f"{PROMPTS_FILE} has {len(out)} rows; the workload needs {n}")
    return out


def reward(completion: str) -> float:
    """Distinct-word ratio of ``completion`` in [0, 1]: ``len(set(words)) / max(1, len(words))``."""
    words = completion.split()
    return len(set(words)) / max(1, len(words))


def write_result(out: Path, framework: str, version: str | None, model: str, steps: list[dict], notes: list[str],
                 error: str | None = None) -> None:
    """Write one peer's result JSON in the schema above to ``out`` (parents created) and print a summary line.

    Args:
      out: the JSON path the harness passed as ``--out``.
      framework, version, model: identify the run; ``steps``: the step records; ``notes``: free text.
      error: the failure message when the run failed (then ``steps`` may be empty).
    """
    result = {"framework": framework, "version": version, "model": model, "steps": steps, "notes": notes}
    if error is not None:
        result["error"] = error
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if steps:
        med = statistics.median(s["total_s"] for s in steps)
        print(f"{framework}_grpo: {len(steps)} steps, total_s {[round(s['total_s'], 3) for s in steps]} "
              f"(median {med:.3f} s) -> {out}", flush=True)
