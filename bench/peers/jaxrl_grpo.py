"""jaxrl's side of ``bench/grpo_step.py``: the shared GRPO workload run through jaxrl's real CLI.

Usage (the peer contract every ``bench/peers/<fw>_grpo.py`` follows)::

    python bench/peers/jaxrl_grpo.py --model-dir outputs/bench/models/tiny-qwen2 --model-name tiny-qwen2 \
        --steps 5 --out outputs/bench/grpo_step/tiny-qwen2/jaxrl.json

It writes, under ``<out dir>/jaxrl-<model-name>/``, the workload's prompts as a verl-format jsonl dataset
(``train.jsonl``) and a reward file (``reward_fn.py``) whose verl-style ``compute_score`` calls
:func:`bench.workload.reward`, then runs ``python -m jaxrl.train --config configs/quickstart.yaml <overrides>``
with overrides that turn the quickstart into the workload of :mod:`bench.workload` (8 prompts x group 4, exactly
32 response tokens with ``rollout.ignore_eos``, GRPO clip 0.2, no KL and so no reference model, one AdamW step
per GRPO step over all 32 rows in micro-batches of 8, lr 1e-6, weight decay 0, grad clip 1.0, float32, no
validation, no checkpoints). Per-step wall times (seconds) come from the run's ``metrics.jsonl``:
``timing_s/step`` (total), ``timing_s/gen``, ``timing_s/old_log_prob`` (logprob), ``timing_s/update_actor``
(update); response tokens per step are ``response_length/mean x rows``. ``--steps`` counts every step, the
warm-up included (the harness drops the first ``bench.workload.WARMUP_STEPS``).

``--workload gsm8k``: the dataset rows hold the GSM8K chat messages (jaxrl applies the tokenizer's chat template
with the generation prompt), prompts <= 256 tokens, responses stop at EOS or 128 tokens (no ``ignore_eos``),
padded rows and micro-batches of 8 rows spelled out (``use_remove_padding=false``, ``use_dynamic_bsz=false``).
``--packed`` turns on packed rows and token-budget micro-batches instead (``use_remove_padding=true``,
``use_dynamic_bsz=true``, ``ppo_max_token_len_per_gpu`` and the rollout's ``log_prob_max_token_len_per_gpu``
1024, ``log_prob_use_dynamic_bsz=true``). ``--prefix-grouper`` adds ``actor.use_prefix_grouper=true`` (each
prompt's forward once for its group's responses, in the update and the old-log-prob pass).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from bench import workload as W  # noqa: E402

CONFIG = ROOT / "configs" / "quickstart.yaml"
IGNORE_EOS_KEY = "actor_rollout_ref.rollout.ignore_eos"
DATA_SOURCE = "bench/distinct_words"

REWARD_FILE = f'''"""Reward of the jaxrl GRPO benchmark (written by bench/peers/jaxrl_grpo.py): bench.workload.reward."""
import sys

sys.path.insert(0, {str(ROOT)!r})

from bench.workload import reward


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl signature; the distinct-word ratio of the response in [0, 1] (data_source/ground_truth unused)."""
    return reward(solution_str)
'''


def write_dataset(path: Path, workload: W.Workload = W.FIXED) -> int:
    """Write the workload's prompts to ``path`` as verl-format jsonl rows (``prompt``: the text, or the chat
    messages for a chat workload); returns the row count."""
    rows = [
        {"data_source": DATA_SOURCE, "prompt": prompt, "ability": "math" if workload.chat else "story",
         "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"index": i}}
        for i, prompt in enumerate(workload.prompts())
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return len(rows)


PADDED = ["actor_rollout_ref.model.use_remove_padding=false", "actor_rollout_ref.actor.use_dynamic_bsz=false"]
PACKED = ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
          f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={W.GSM8K_TOKEN_BUDGET}",
          "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
          f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={W.GSM8K_TOKEN_BUDGET}"]
PREFIX_GROUPER = "actor_rollout_ref.actor.use_prefix_grouper=true"


def overrides(model_dir: Path, run_dir: Path, steps: int, *, ignore_eos: bool, old_pass: bool = True,
              workload: W.Workload = W.FIXED, packed: bool = False, prefix_grouper: bool = False) -> list[str]:
    """The ``key=value`` overrides that turn ``configs/quickstart.yaml`` into the shared workload (``packed``:
    :data:`PACKED` rows and token-budget micro-batches; a non-fixed workload without it spells out :data:`PADDED`)."""
    ov = [
        f"data.train_files={run_dir / 'train.jsonl'}",
        "data.val_files=null",
        f"data.train_batch_size={W.NUM_PROMPTS}",
        f"data.max_prompt_length={workload.max_prompt_length}",
        f"data.max_response_length={workload.response_length}",
        "data.shuffle=false",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.dtype=float32",
        "actor_rollout_ref.model.param_dtype=float32",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        f"actor_rollout_ref.actor.optim.lr={W.LEARNING_RATE}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
        f"actor_rollout_ref.actor.grad_clip={W.MAX_GRAD_NORM}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={W.NUM_PROMPTS}",  # prompts: one optimizer step per GRPO step
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={W.MICRO_BATCH}",  # rows
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.actor.clip_ratio={W.CLIP_EPS}",
        f"actor_rollout_ref.actor.clip_ratio_low={W.CLIP_EPS}",
        f"actor_rollout_ref.actor.clip_ratio_high={W.CLIP_EPS}",
        "actor_rollout_ref.rollout.name=jax",
        f"actor_rollout_ref.rollout.n={W.GROUP_SIZE}",
        f"actor_rollout_ref.rollout.temperature={W.TEMPERATURE}",
        "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={W.MICRO_BATCH}",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        f"custom_reward_function.path={run_dir / 'reward_fn.py'}",
        "custom_reward_function.name=compute_score",
        f"trainer.total_training_steps={steps}",
        f"trainer.total_epochs={steps}",  # one step per epoch (8 prompts, batch 8); total_training_steps stops first
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={run_dir / 'run'}",
        "trainer.project_name=bench_grpo_step",
        f"trainer.experiment_name=jaxrl_{model_dir.name}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
    ]
    if ignore_eos:
        ov.append(f"{IGNORE_EOS_KEY}=true")
    if not old_pass:  # on-policy: the loss uses stop_gradient(current log-probs) as pi_old, like TRL/Tunix here
        ov.append("actor_rollout_ref.actor.recompute_old_log_prob=false")
    if packed:
        ov += PACKED
    elif workload is not W.FIXED:  # the fixed workload's overrides stay what they always were
        ov += PADDED
    if prefix_grouper:
        ov.append(PREFIX_GROUPER)
    return ov


def steps_from_metrics(metrics_path: Path, rows: int) -> list[dict]:
    """The workload-schema step records of a run's ``metrics.jsonl`` (training steps only, in order).

    Raises:
      ValueError: the file has no record with ``timing_s/step``.
    """
    from jaxrl.metrics import read_metrics

    out = []
    for r in read_metrics(metrics_path):
        if "timing_s/step" not in r:
            continue  # a validation-only record
        out.append({
            "step": int(r["step"]),
            "total_s": float(r["timing_s/step"]),
            "gen_s": r.get("timing_s/gen"),
            "logprob_s": r.get("timing_s/old_log_prob"),
            "update_s": r.get("timing_s/update_actor"),
            "response_tokens": int(round(float(r["response_length/mean"]) * rows)),
            "reward_s": r.get("timing_s/reward"),
            "sync_s": r.get("timing_s/sync"),
            "score_mean": r.get("critic/score/mean"),
        })
    if not out:
        raise ValueError(f"{metrics_path} holds no training step (no 'timing_s/step' key)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, type=Path, help="Hugging Face model directory")
    p.add_argument("--model-name", required=True, help="short model name for the report (e.g. tiny-qwen2)")
    p.add_argument("--steps", type=int, default=W.WARMUP_STEPS + W.MEASURED_STEPS,
                   help="GRPO steps in all, warm-up included (default %(default)s)")
    p.add_argument("--out", required=True, type=Path, help="result JSON file (workload schema)")
    p.add_argument("--workload", choices=tuple(W.WORKLOADS), default="fixed", help="bench.workload (default fixed)")
    p.add_argument("--packed", action="store_true",
                   help="packed rows + token-budget micro-batches (use_remove_padding, use_dynamic_bsz, "
                        f"{W.GSM8K_TOKEN_BUDGET} tokens)")
    p.add_argument("--prefix-grouper", action="store_true",
                   help=f"{PREFIX_GROUPER}: each prompt's forward once for its group (packed rows)")
    p.add_argument("--ignore-eos", choices=("on", "off"), default=None,
                   help="pass rollout.ignore_eos=true so every response has the workload's length (default: on for "
                        "the fixed workload, off for gsm8k)")
    p.add_argument("--no-old-log-prob", action="store_true",
                   help="actor_rollout_ref.actor.recompute_old_log_prob=false: no separate old-log-prob pass "
                        "(what TRL and Tunix do with num_iterations=1)")
    p.add_argument("--timeout-s", type=float, default=2400.0, help="limit for the training run, seconds")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    model_dir = args.model_dir.resolve()
    if not (model_dir / "config.json").is_file():
        p.error(f"--model-dir {str(model_dir)!r} is not a Hugging Face model directory (no config.json)")

    notes: list[str] = []
    workload = W.get(args.workload)
    ignore_eos = args.ignore_eos == "on" if args.ignore_eos else workload.exact_length
    if not ignore_eos and workload.exact_length:
        notes.append(f"{IGNORE_EOS_KEY} not set: responses may end at EOS before {workload.response_length} tokens")

    out = args.out.resolve()
    run_dir = out.parent / f"{out.stem}-{args.model_name}"
    if (run_dir / "run").exists():
        shutil.rmtree(run_dir / "run")  # a fresh run: no stale metrics, no resume
    run_dir.mkdir(parents=True, exist_ok=True)
    write_dataset(run_dir / "train.jsonl", workload)
    (run_dir / "reward_fn.py").write_text(REWARD_FILE, encoding="utf-8")

    cmd = [sys.executable, "-m", "jaxrl.train", "--config", str(CONFIG),
           *overrides(model_dir, run_dir, args.steps, ignore_eos=ignore_eos, old_pass=not args.no_old_log_prob,
                      workload=workload, packed=args.packed, prefix_grouper=args.prefix_grouper)]
    log_path = run_dir / "train.log"
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(" ".join(cmd) + "\n\n")
        log.flush()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout_s,
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                      [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
        except subprocess.TimeoutExpired:
            print(f"jaxrl_grpo: jaxrl.train ran past {args.timeout_s:.0f} s; log: {log_path}", file=sys.stderr)
            return 1
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-30:]
        print("\n".join(tail), file=sys.stderr)
        print(f"jaxrl_grpo: jaxrl.train exited {proc.returncode}; full log: {log_path}", file=sys.stderr)
        return 1

    rows = W.NUM_PROMPTS * W.GROUP_SIZE
    steps = steps_from_metrics(run_dir / "run" / "metrics.jsonl", rows)
    if len(steps) != args.steps:
        raise ValueError(f"jaxrl.train logged {len(steps)} training steps, expected --steps={args.steps}")
    import jaxrl

    notes.append(f"python -m jaxrl.train --config configs/quickstart.yaml + {len(cmd) - 5} overrides "
                 f"(see {log_path.relative_to(ROOT) if log_path.is_relative_to(ROOT) else log_path}); "
                 f"process wall {wall:.1f} s incl. model load, compile and final export")
    notes.append("total_s = timing_s/step: gen + reward + old_log_prob + adv + update_actor + sync "
                 "(no ref: KL off)" + ("; recompute_old_log_prob=false: no old_log_prob phase" if args.no_old_log_prob
                                       else "") + (f"; {PREFIX_GROUPER}" if args.prefix_grouper else ""))
    if not workload.exact_length:
        notes.append(f"{workload.name}: prompts = chat messages in the dataset, rendered by jaxrl with the "
                     f"tokenizer's chat template (generation prompt on); responses stop at EOS or "
                     f"{workload.response_length} tokens; " + (
                         "packed rows + token-budget micro-batches: " + ", ".join(PACKED) if args.packed else
                         f"padded rows, micro-batches of {W.MICRO_BATCH} rows: " + ", ".join(PADDED)))
        notes.append("loss aggregation: jaxrl's default loss_agg_mode 'token-mean' (verl's)")
    W.write_result(out, "jaxrl", f"jaxrl {jaxrl.__version__}", args.model_name, steps, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
