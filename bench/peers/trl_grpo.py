"""TRL's side of ``bench/grpo_step.py``: the shared GRPO workload run through TRL's real ``GRPOTrainer``.

Usage (the peer contract every ``bench/peers/<fw>_grpo.py`` follows; run with the TRL venv of
``scripts/setup_bench_trl.sh``)::

    .venv-bench-trl/bin/python bench/peers/trl_grpo.py --model-dir outputs/bench/models/tiny-qwen2 \
        --model-name tiny-qwen2 --steps 5 --out outputs/bench/grpo_step/tiny-qwen2/trl.json

The workload of :mod:`bench.workload` as a ``GRPOConfig``: 8 prompts x ``num_generations`` 4 = 32 completions
per step, generated once per optimizer step (``generation_batch_size`` 32 = ``per_device_train_batch_size`` 8 x
``steps_per_generation`` 4) and trained in ``gradient_accumulation_steps`` 4 micro-batches of 8 rows, so one
TRL global step = one GRPO step = one AdamW step; exactly 32 completion tokens (``min_new_tokens`` 32 =
``max_completion_length``: EOS is suppressed), temperature 1, top-p 1, no top-k, ``beta`` 0 (no reference
model), ``epsilon`` 0.2, ``num_iterations`` 1, ``loss_type`` ``"grpo"`` (per-sequence token mean, then batch
mean), lr 1e-6 constant, AdamW betas (0.9, 0.999) eps 1e-8, weight decay 0, grad-norm clip 1.0, float32, CPU, no
vLLM, no gradient checkpointing, no logging/saving.

Per-step wall times come from a ``GRPOTrainer`` subclass that times TRL's own methods around ``super()`` calls
(nothing in the library is patched): ``total_s`` from the step's batch fetch (``get_batch_samples``) to
``on_step_end``; ``gen_s`` = ``_generate`` (prompt tokenization + ``model.generate`` + decoding);
``logprob_s`` = no-grad ``_get_per_token_logps_and_entropies`` calls (old-policy log-probs: TRL skips them when
generation and optimizer steps are aligned, as here, so this is 0); ``update_s`` = forward+backward of the 4
micro-batches (``training_step`` less its ``_prepare_inputs``) + grad clip + ``optimizer.step`` + zero_grad;
``reward_s`` = ``_calculate_rewards``. ``--steps`` counts every step, the warm-up included (the harness drops
the first ``bench.workload.WARMUP_STEPS``).

``--workload gsm8k``: the dataset's prompts are the GSM8K chat messages (``[{"role": "user", ...}]``, TRL's
conversational format: ``GRPOTrainer`` applies the tokenizer's chat template with the generation prompt and hands
the reward function assistant messages), ``max_completion_length`` 128 and no ``min_new_tokens``: responses stop
at EOS (``generate`` stops when every row has ended). Response tokens per step = the ``completion_mask`` sum (the
EOS token included).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from bench import workload as W  # noqa: E402

ROWS = W.NUM_PROMPTS * W.GROUP_SIZE
GRAD_ACCUM = ROWS // W.MICRO_BATCH  # micro-batches per optimizer step


def completion_text(completion) -> str:
    """The text of one TRL completion: a string (standard format) or, for conversational prompts, the list of
    generated messages (``[{"role": "assistant", "content": ...}]``), whose contents are joined."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion)


def reward_fn(completions: list, **kwargs) -> list[float]:
    """TRL reward function: :func:`bench.workload.reward` of each completion's text (:func:`completion_text`)."""
    return [W.reward(completion_text(c)) for c in completions]


def prompt_lengths(tok, prompts: list) -> list[int]:
    """Token counts of the prompts as ``GRPOTrainer`` tokenizes them: plain text as is, chat messages through the
    tokenizer's chat template with the generation prompt."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(len(tok(p)["input_ids"]))
        else:
            ids = tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
            out.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def build_trainer(model_dir: Path, steps: int, work_dir: Path, workload: W.Workload = W.FIXED):
    """The timed ``GRPOTrainer`` (and its timing callback) for ``workload`` on ``model_dir``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimes(TrainerCallback):
        """Closes each step's timers at ``on_step_end`` (after clip, optimizer step, lr step and zero_grad)."""

        def __init__(self):
            self.trainer = None

        def on_step_end(self, args, state, control, **kwargs):
            self.trainer._close_step(state.global_step)
            return control

    class TimedGRPOTrainer(GRPOTrainer):
        """``GRPOTrainer`` that records per-step wall times of its phases (see the module docstring)."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.step_records: list[dict] = []
            self._reset_timers()

        def _reset_timers(self):
            self._t_step = None
            self._t_last_train_end = None
            self._acc = {"gen_s": 0.0, "logprob_s": 0.0, "reward_s": 0.0, "prepare_s": 0.0, "train_step_s": 0.0}
            self._tokens = 0
            self._rewards: list[float] = []

        def get_batch_samples(self, *a, **kw):
            if self._t_step is None:
                self._t_step = time.perf_counter()
            return super().get_batch_samples(*a, **kw)

        def training_step(self, *a, **kw):
            t0 = time.perf_counter()
            out = super().training_step(*a, **kw)
            self._t_last_train_end = time.perf_counter()
            self._acc["train_step_s"] += self._t_last_train_end - t0
            return out

        def _prepare_inputs(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return super()._prepare_inputs(*a, **kw)
            finally:
                self._acc["prepare_s"] += time.perf_counter() - t0

        def _generate(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return super()._generate(*a, **kw)
            finally:
                self._acc["gen_s"] += time.perf_counter() - t0

        def _calculate_rewards(self, *a, **kw):
            t0 = time.perf_counter()
            rewards = super()._calculate_rewards(*a, **kw)
            self._acc["reward_s"] += time.perf_counter() - t0
            self._rewards.extend(rewards.sum(dim=1).tolist())
            return rewards

        def _get_per_token_logps_and_entropies(self, *a, **kw):
            if torch.is_grad_enabled():  # the loss's own forward: part of the update
                return super()._get_per_token_logps_and_entropies(*a, **kw)
            t0 = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(*a, **kw)
            finally:
                self._acc["logprob_s"] += time.perf_counter() - t0

        def _generate_and_score_completions(self, *a, **kw):
            out = super()._generate_and_score_completions(*a, **kw)
            self._tokens += int(out["completion_mask"].sum().item())
            return out

        def _close_step(self, global_step: int):
            end = time.perf_counter()
            if self._t_step is None or self._t_last_train_end is None:
                raise RuntimeError(f"step {global_step} ended without a timed batch fetch / training_step")
            acc = self._acc
            optimizer_s = end - self._t_last_train_end  # clip + optimizer.step + lr step + zero_grad
            self.step_records.append({
                "step": global_step,
                "total_s": end - self._t_step,
                "gen_s": acc["gen_s"],
                "logprob_s": acc["logprob_s"],
                "update_s": acc["train_step_s"] - acc["prepare_s"] + optimizer_s,
                "response_tokens": self._tokens,
                "reward_s": acc["reward_s"],
                "optimizer_s": optimizer_s,
                "score_mean": statistics.fmean(self._rewards) if self._rewards else None,
            })
            self._reset_timers()

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    prompts = workload.prompts()
    dataset = Dataset.from_dict({"prompt": prompts})
    too_long = [n for n in prompt_lengths(tok, prompts) if n > workload.max_prompt_length]
    if too_long:  # TRL 1.x has no max_prompt_length: the workload's prompts must fit as they are
        raise ValueError(f"prompts of {too_long} tokens exceed max_prompt_length={workload.max_prompt_length}")

    config = GRPOConfig(
        output_dir=str(work_dir),
        use_cpu=True,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,  # TRL defaults gradient_checkpointing (its deprecated alias) to True
        seed=0,
        max_steps=steps,
        per_device_train_batch_size=W.MICRO_BATCH,
        gradient_accumulation_steps=GRAD_ACCUM,
        steps_per_generation=GRAD_ACCUM,  # generation_batch_size = 8 x 4 = 32 = all rows: one generation per step
        num_generations=W.GROUP_SIZE,
        num_iterations=1,
        max_completion_length=workload.response_length,
        # fixed: EOS suppressed, exactly 32 tokens; gsm8k: nothing, responses stop at EOS
        generation_kwargs={"min_new_tokens": workload.response_length} if workload.exact_length else None,
        temperature=W.TEMPERATURE,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=W.CLIP_EPS,
        loss_type="grpo",
        mask_truncated_completions=False,  # fixed: all end at the limit; gsm8k: truncated ones train (as jaxrl)
        learning_rate=W.LEARNING_RATE,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=W.MAX_GRAD_NORM,
        use_vllm=False,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if config.activation_checkpointing or config.gradient_checkpointing:
        raise ValueError("GRPOConfig resolved activation checkpointing on; the workload runs without it")
    if config.generation_batch_size != ROWS:
        raise ValueError(f"GRPOConfig resolved generation_batch_size={config.generation_batch_size}, expected {ROWS}")
    cb = StepTimes()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward_fn, args=config, train_dataset=dataset,
                               processing_class=tok, callbacks=[cb])
    cb.trainer = trainer
    return trainer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, type=Path, help="Hugging Face model directory")
    p.add_argument("--model-name", required=True, help="short model name for the report (e.g. tiny-qwen2)")
    p.add_argument("--steps", type=int, default=W.WARMUP_STEPS + W.MEASURED_STEPS,
                   help="GRPO steps in all, warm-up included (default %(default)s)")
    p.add_argument("--out", required=True, type=Path, help="result JSON file (workload schema)")
    p.add_argument("--workload", choices=tuple(W.WORKLOADS), default="fixed", help="bench.workload (default fixed)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    model_dir = args.model_dir.resolve()
    if not (model_dir / "config.json").is_file():
        p.error(f"--model-dir {str(model_dir)!r} is not a Hugging Face model directory (no config.json)")

    import torch
    import transformers
    import trl

    out = args.out.resolve()
    work_dir = out.parent / f"trl-{args.model_name}"
    workload = W.get(args.workload)
    t0 = time.perf_counter()
    trainer = build_trainer(model_dir, args.steps, work_dir, workload)
    t_built = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    steps = trainer.step_records
    if len(steps) != args.steps:
        raise ValueError(f"GRPOTrainer ran {len(steps)} optimizer steps, expected --steps={args.steps}")
    cap = workload.max_response_tokens(ROWS)
    if workload.exact_length:
        bad = [s["response_tokens"] for s in steps if s["response_tokens"] != cap]
        if bad:
            raise ValueError(f"response tokens per step {bad}, expected {cap} ({ROWS} x {workload.response_length})")
    else:
        bad = [s["response_tokens"] for s in steps if not 0 < s["response_tokens"] <= cap]
        if bad:
            raise ValueError(f"response tokens per step {bad}, expected 1-{cap} "
                             f"({ROWS} x <= {workload.response_length})")

    cfg = trainer.args
    notes = [
        f"trl {trl.__version__} GRPOTrainer (subclassed only to time its phases), transformers "
        f"{transformers.__version__}, torch {torch.__version__}, torch.get_num_threads()={torch.get_num_threads()} "
        "(torch default)",
        f"GRPOConfig: per_device_train_batch_size={cfg.per_device_train_batch_size}, gradient_accumulation_steps="
        f"{cfg.gradient_accumulation_steps}, steps_per_generation={cfg.steps_per_generation}, generation_batch_size="
        f"{cfg.generation_batch_size}, num_generations={cfg.num_generations}, num_iterations={cfg.num_iterations}, "
        f"beta={cfg.beta}, epsilon={cfg.epsilon}, loss_type={cfg.loss_type!r}, scale_rewards={cfg.scale_rewards!r}, "
        f"max_completion_length={cfg.max_completion_length}, generation_kwargs={cfg.generation_kwargs}, "
        f"optim={getattr(cfg.optim, 'value', cfg.optim)!r}, lr={cfg.learning_rate} "
        f"({getattr(cfg.lr_scheduler_type, 'value', cfg.lr_scheduler_type)}), max_grad_norm={cfg.max_grad_norm}, "
        f"activation_checkpointing={cfg.activation_checkpointing}, fp32 (bf16={cfg.bf16}), use_cpu={cfg.use_cpu}",
        ("loss_type 'grpo' = per-sequence token mean then batch mean (all completions are 32 tokens, so 'bnpo'/'dapo' "
         "would give the same loss)" if workload.exact_length else
         "loss_type 'grpo' = per-sequence token mean then batch mean (with ragged lengths not jaxrl's token-mean: "
         "the same work, a different weighting)")
        + "; advantages = (r - group mean) / group std (scale_rewards='group')",
        "logprob_s: TRL computes no separate old-policy log-prob pass when generation and optimizer steps are aligned "
        "(num_iterations=1, steps_per_generation == gradient_accumulation_steps): the ratio uses the loss forward's "
        "own detached log-probs, so logprob_s is 0 and that work is inside update_s",
        "gen_s = GRPOTrainer._generate (tokenize + HF model.generate with KV cache, sdpa attention + decode); "
        "update_s = 4 micro-batch forward+backward + grad clip + AdamW step; total_s also holds reward, "
        "advantages, batch split/shuffle and the dataloader fetch",
        f"max_prompt_length: TRL 1.x has no such option; the {W.NUM_PROMPTS} prompts are <= "
        f"{max(prompt_lengths(trainer.processing_class, workload.prompts()))} tokens, under the workload's "
        f"{workload.max_prompt_length}",
        f"process wall {wall:.1f} s (trainer build incl. model load {t_built - t0:.1f} s)",
    ]
    if workload.chat:
        notes.append(f"{workload.name}: conversational prompts ([{{'role': 'user', ...}}]); GRPOTrainer applies the "
                     "tokenizer's chat template with the generation prompt; generate stops at EOS "
                     f"(max_completion_length {workload.response_length}); response tokens = completion_mask sum "
                     "(EOS included)")
    W.write_result(out, "trl", f"trl {trl.__version__}", args.model_name, steps, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
