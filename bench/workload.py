"""The GRPO workloads every framework runs in ``bench/grpo_step.py`` (pure Python: importable from any venv).

Two workloads (:data:`WORKLOADS`, ``--workload`` of the harness and of every peer script):

* ``fixed`` (the default), below: story prompts, exactly ``RESPONSE_LENGTH`` tokens per response;
* ``gsm8k`` (:func:`gsm8k_messages`, :data:`GSM8K`): the first ``NUM_PROMPTS`` questions of the real GSM8K train
  split as one user chat turn each (question + verl's gsm8k instruction :data:`GSM8K_INSTRUCTION`), rendered by
  each framework's own tokenizer chat template with the generation prompt; responses stop at EOS or after
  ``GSM8K_RESPONSE_LENGTH`` (128) new tokens, so their lengths are ragged and differ between frameworks. The rest
  (group, temperature, reward, GRPO clip, no KL, one AdamW step per GRPO step, float32) is the fixed workload's.

The ``fixed`` workload, the same work for jaxrl, TRL and Tunix:

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
"logprob_s", "update_s", "response_tokens"}], "notes": [..]}`` (a split it cannot expose is ``null``;
``response_tokens``: the step's generated response tokens, a stopping EOS included).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
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

# the ragged GSM8K workload (configs/gsm8k_grpo_smollm2_135m.yaml's lengths)
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's gsm8k.py
GSM8K_RESPONSE_LENGTH = 128  # at most this many new tokens; a response ends at EOS
GSM8K_MAX_PROMPT_LENGTH = 256
GSM8K_TOKEN_BUDGET = 1024  # jaxrl-packed: real tokens per micro-batch (update and log-prob forward)
GSM8K_RELPATH = Path("data") / "gsm8k" / "train.jsonl"  # under the shared-assets folder

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Workload:
    """What differs between the workloads: the prompts and the response / prompt lengths."""

    name: str
    max_prompt_length: int  # every framework's prompt cap (tokens, chat template included)
    response_length: int  # fixed: every response's exact length; gsm8k: the cap on new tokens
    exact_length: bool  # True: EOS ignored / suppressed, every response is ``response_length`` tokens
    chat: bool  # True: prompts are chat messages, each framework applies its tokenizer's chat template

    def prompts(self) -> list:
        """The workload's ``NUM_PROMPTS`` prompts: texts (``fixed``) or one-turn chat message lists (``gsm8k``)."""
        return gsm8k_messages() if self.name == "gsm8k" else prompts()

    def max_response_tokens(self, rows: int = NUM_PROMPTS * GROUP_SIZE) -> int:
        """The most response tokens one step can hold (``rows x response_length``; exact for ``fixed``)."""
        return rows * self.response_length


FIXED = Workload("fixed", MAX_PROMPT_LENGTH, RESPONSE_LENGTH, exact_length=True, chat=False)
GSM8K = Workload("gsm8k", GSM8K_MAX_PROMPT_LENGTH, GSM8K_RESPONSE_LENGTH, exact_length=False, chat=True)
WORKLOADS = {w.name: w for w in (FIXED, GSM8K)}


def get(name: str) -> Workload:
    """The :class:`Workload` called ``name``.

    Raises:
      ValueError: no such workload.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def shared_dir() -> Path:
    """The shared-assets folder: ``$JAXRL_SHARED`` if set, else ``<repo>/../shared`` (as ``jaxrl.paths``, which the
    peer venvs cannot import without jax)."""
    env = os.environ.get("JAXRL_SHARED")
    return Path(env).expanduser().resolve() if env else (REPO_ROOT.parent / "shared").resolve()


def gsm8k_messages(n: int = NUM_PROMPTS, path: Path | None = None) -> list[list[dict]]:
    """The first ``n`` GSM8K train questions as chat messages, verl's gsm8k preprocessing:
    ``[{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}]`` each.

    Args:
      n: how many questions (file order).
      path: the GSM8K ``train.jsonl`` (fields ``question``, ``answer``); default ``<shared>/data/gsm8k/train.jsonl``.

    Raises:
      FileNotFoundError: no such file (set ``JAXRL_SHARED``).
      ValueError: fewer than ``n`` rows, or a row without a text ``question``.
    """
    path = Path(path) if path is not None else shared_dir() / GSM8K_RELPATH
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K train split not found at {path}; set JAXRL_SHARED to the shared assets folder")
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(out) == n:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            q = row.get("question")
            if not isinstance(q, str) or not q.strip():
                raise ValueError(f"{path}: row {len(out)} has no text 'question': {str(row)[:200]}")
            out.append([{"role": "user", "content": q + " " + GSM8K_INSTRUCTION}])
    if len(out) < n:
        raise ValueError(f"{path} has {len(out)} rows; the workload needs {n}")
    return out


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
