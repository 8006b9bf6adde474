"""Tunix's side of ``bench/grpo_step.py``: the shared GRPO workload run through Google Tunix's real GRPO.

Usage (the peer contract every ``bench/peers/<fw>_grpo.py`` follows; run with the Tunix venv that
``bash scripts/setup_bench_tunix.sh`` builds)::

    .venv-bench-tunix/bin/python bench/peers/tunix_grpo.py --model-dir outputs/bench/models/tiny-qwen2 \
        --model-name tiny-qwen2 --steps 5 --out outputs/bench/grpo_step/tiny-qwen2/tunix.json

What runs is Tunix's own stack, unmodified: the HF safetensors are loaded by ``tunix.models.<family>.params.
create_model_from_safe_tensors`` (``qwen2`` for Qwen2ForCausalLM, ``llama3`` for LlamaForCausalLM such as SmolLM2),
an ``RLCluster`` (vanilla rollout engine = Tunix's ``Sampler``, actor and rollout colocated on one CPU mesh so they
share the weights, no reference model) drives a ``GRPOLearner`` with ``GRPOConfig(num_generations=4, beta=0,
epsilon=0.2, num_iterations=1)``. The workload knobs of :mod:`bench.workload` map onto Tunix as:

* batch: 8 prompts per step (one ``train_ds`` element = one GRPO step); Tunix counts batch sizes in prompts, so
  ``mini_batch_size=8`` (one optimizer step per GRPO step over all 32 rows) and ``train_micro_batch_size=2``
  (2 prompts x 4 = 8 rows per micro-batch; Tunix derives gradient_accumulation_steps = 4 and wraps the optimizer in
  ``optax.MultiSteps``, which averages the 4 micro-batch gradients before one AdamW update);
  ``rollout_micro_batch_size=8`` so all 32 rows are sampled in one batch;
* sampling: ``RolloutConfig(max_tokens_to_generate=32, max_prompt_length=64, temperature=1.0, top_p=1.0,
  top_k=None, kv_cache_size=96)`` and ``eos_tokens=[-1]`` (an id no token has: Tunix's sampler then never stops
  early, so every response is exactly 32 tokens -- Tunix's knob for the EOS set, no patching);
* optimizer: ``optax.chain(clip_by_global_norm(1.0), adamw(1e-6, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0))``,
  float32 parameters and compute.

Timing (seconds, per GRPO step): the step records come from boundaries reached by subclassing only
(``TimedRLCluster(RLCluster)``, ``TimedGRPOLearner(GRPOLearner)``; no global monkey-patching): ``total_s`` is the
whole ``_run_global_step`` (rollout, rewards/advantages, the 4 micro-batch train steps) ended by a
``block_until_ready`` on the actor weights; ``gen_s`` is ``RLCluster.generate`` (Tunix's sampler returns host
tokens, so it is synchronous); ``update_s`` runs from the first ``update_actor`` call of the step to the end
of the step (the same block); ``logprob_s`` is null: with beta 0 and num_iterations 1 Tunix computes no separate
log-prob pass (its GRPO loss takes the old log-probs as ``stop_gradient`` of the training forward pass).
Tunix's own perf tracer (``PerfMetricsConfig`` with ``PerfMetricsExport.from_cluster_config``) runs too; its
``perf/global_step_time``, ``perf/sum/rollout_time`` and ``perf/sum/actor_train_time`` are added to each step
record as ``tunix_perf_*`` for comparison. ``--steps`` counts every step, the warm-up included (the harness drops
the first ``bench.workload.WARMUP_STEPS``).

``--workload gsm8k``: each GSM8K chat turn is rendered to text by the tokenizer's chat template with the generation
prompt (Tunix's prompts are strings; its sampler re-adds the BOS id the template already starts with and then drops
the duplicate, so the ids are the template's), ``max_tokens_to_generate=128``, ``max_prompt_length=256`` (what
Tunix's sampler picks by itself for these prompts: the next power of 2 of the longest), and the model's real EOS
ids in ``RolloutConfig.eos_tokens``: the decode loop stops once every row has hit one. Response tokens per step
count the generated tokens with the stopping EOS (:func:`generated_tokens`), as TRL's and jaxrl's counts do; Tunix
itself trains on the tokens before the EOS (``response_tokens_trained`` in each step record).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from bench import workload as W  # noqa: E402  (pure Python: importable from this venv)

FAMILIES = {"qwen2": "qwen2", "llama": "llama3"}  # HF config model_type -> tunix.models.<module>


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def eos_ids(model_dir: Path, tokenizer) -> list[int]:
    """The ids that end a response: the model's ``config.json`` / ``generation_config.json`` ``eos_token_id`` (an
    id or a list) and the tokenizer's ``eos_token_id``, sorted.

    Raises:
      ValueError: none is set.
    """
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        f = model_dir / name
        if f.is_file():
            e = json.loads(f.read_text(encoding="utf-8")).get("eos_token_id")
            ids.update([e] if isinstance(e, int) else (e or []))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError(f"{model_dir}: no eos_token_id in config.json, generation_config.json or the tokenizer")
    return sorted(ids)


def generated_tokens(completion_lengths: list[int], cap: int) -> int:
    """Tokens the sampler generated for completions of ``completion_lengths`` tokens (Tunix's ``tokens``: cut before
    the first EOS): a completion shorter than ``cap`` ended at a generated EOS, one more token; one of ``cap`` tokens
    hit the limit."""
    return sum(min(n + 1, cap) for n in completion_lengths)


def model_config(model_dir: Path):
    """``(family, tunix ModelConfig)`` for the HF model in ``model_dir``.

    Raises:
      ValueError: the architecture is not one Tunix's qwen2/llama3 loaders can hold without changing its math.
    """
    hf = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    mtype = hf.get("model_type")
    if mtype not in FAMILIES:
        raise ValueError(f"{model_dir}: model_type {mtype!r} has no Tunix loader here (supported: {sorted(FAMILIES)})")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_dir}: hidden_act {hf.get('hidden_act')!r}; Tunix's {mtype} MLP is SiLU-gated only")
    rope = hf.get("rope_theta")
    if rope is None:
        rope = (hf.get("rope_parameters") or {}).get("rope_theta")
    scaling = hf.get("rope_scaling") or {}
    rope_type = (hf.get("rope_parameters") or {}).get("rope_type", "default")
    if scaling or rope_type not in (None, "default"):
        raise ValueError(f"{model_dir}: rope scaling {scaling or rope_type!r}; Tunix's {FAMILIES[mtype]} model applies "
                         "plain RoPE only (no config field for scaling)")
    if rope is None:
        raise ValueError(f"{model_dir}: config.json has no rope_theta")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    common = dict(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=heads, head_dim=head_dim,
        num_kv_heads=hf.get("num_key_value_heads", heads), rope_theta=int(rope), norm_eps=hf["rms_norm_eps"],
    )
    tied = bool(hf.get("tie_word_embeddings", False))
    if mtype == "qwen2":
        import jax.numpy as jnp
        from tunix.models.qwen2 import model as qwen2_model

        if hf.get("use_sliding_window"):
            raise ValueError(f"{model_dir}: sliding-window attention; Tunix's qwen2 model has full attention only")
        return "qwen2", qwen2_model.ModelConfig(**common, use_tied_embedding=tied, dtype=jnp.float32,
                                                param_dtype=jnp.float32)
    from tunix.models.llama3 import model as llama3_model

    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{model_dir}: attention/MLP biases; Tunix's llama3 model has none")
    return "llama3", llama3_model.ModelConfig(**common, weight_tying=tied)


def load_model(model_dir: Path, family: str, cfg, mesh):
    """The Tunix NNX model with the HF weights of ``model_dir`` (float32), via Tunix's safetensors loader."""
    import jax.numpy as jnp

    if family == "qwen2":
        from tunix.models.qwen2 import params
    else:
        from tunix.models.llama3 import params
    model = params.create_model_from_safe_tensors(str(model_dir), cfg, mesh=mesh, dtype=jnp.float32)
    import jax
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    missing = [x for x in leaves if not isinstance(x, jax.Array)]
    if missing:
        raise ValueError(f"{model_dir}: Tunix's {family} loader left {len(missing)} parameter(s) unloaded")
    bad = sorted({str(x.dtype) for x in leaves if x.dtype != jnp.float32})
    if bad:
        raise ValueError(f"{model_dir}: parameters not float32 after loading: {bad}")
    return model, sum(int(x.size) for x in leaves)


def _dedup_bos(ids: list[int], bos: int | None) -> list[int]:
    """``ids`` without repeats of a leading BOS (Tunix's ``TokenizerAdapter.dedup_bos_ids``)."""
    i = 0
    while bos is not None and i < len(ids) - 1 and ids[i] == ids[i + 1] == bos:
        i += 1
    return ids[i:]


class StepTimes:
    """Per-GRPO-step wall times gathered at the subclass boundaries (thread-safe: rollout runs in a worker)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.steps: list[dict] = []
        self.cur: dict | None = None

    def begin(self, step: int) -> None:
        with self.lock:
            self.cur = {"step": step, "t0": time.perf_counter(), "cpu0": time.process_time(), "gen_s": 0.0,
                        "response_tokens": 0, "response_tokens_trained": 0, "update_t0": None, "rewards": []}

    def add(self, key: str, value) -> None:
        with self.lock:
            if self.cur is None:
                raise RuntimeError(f"timing '{key}' outside a GRPO step")
            self.cur[key] += value

    def mark_update(self) -> None:
        with self.lock:
            if self.cur is not None and self.cur["update_t0"] is None:
                self.cur["update_t0"] = time.perf_counter()

    def end(self) -> None:
        t1, cpu1 = time.perf_counter(), time.process_time()
        with self.lock:
            c, self.cur = self.cur, None
        if c["update_t0"] is None:
            raise RuntimeError(f"GRPO step {c['step']} ran no actor update")
        self.steps.append({
            "step": c["step"],
            "total_s": t1 - c["t0"],
            "gen_s": c["gen_s"],
            "logprob_s": None,
            "update_s": t1 - c["update_t0"],
            "response_tokens": c["response_tokens"],
            "response_tokens_trained": c["response_tokens_trained"],
            "other_s": (c["update_t0"] - c["t0"]) - c["gen_s"],  # data prep, rewards, advantages, host->device
            "cpu_s": cpu1 - c["cpu0"],  # process CPU time (all threads) of the step: > total_s means parallelism
            "score_mean": sum(c["rewards"]) / len(c["rewards"]) if c["rewards"] else None,
        })


def build_classes(times: StepTimes, cap: int):
    """``(TimedRLCluster, TimedGRPOLearner)``: Tunix's classes with timing at their public/step boundaries (``cap``:
    the most tokens a response can have, for :func:`generated_tokens`)."""
    import jax
    from flax import nnx
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner

    class TimedRLCluster(rl_cluster_lib.RLCluster):
        def generate(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super().generate(*args, **kwargs)
            times.add("gen_s", time.perf_counter() - t0)
            lengths = [len(t) for t in out.tokens]
            times.add("response_tokens", generated_tokens(lengths, cap))
            times.add("response_tokens_trained", int(sum(lengths)))
            return out

        def update_actor(self, train_ds, eval_ds, skip_jit=False):
            times.mark_update()
            return super().update_actor(train_ds, eval_ds, skip_jit)

    class TimedGRPOLearner(grpo_learner.GRPOLearner):
        def _run_global_step(self, *args, **kwargs):
            times.begin(len(times.steps))
            out = super()._run_global_step(*args, **kwargs)
            model = self.rl_cluster.actor_trainer.model
            jax.block_until_ready([x for x in jax.tree.leaves(nnx.state(model)) if isinstance(x, jax.Array)])
            times.end()
            return out

    return TimedRLCluster, TimedGRPOLearner


def run(model_dir: Path, model_name: str, steps: int, workload: W.Workload = W.FIXED) -> dict:
    """Run ``steps`` Tunix GRPO steps of ``workload`` on ``model_dir``; returns the result dict (schema)."""
    import jax
    import numpy as np
    import optax
    import transformers
    from tunix.perf import export as perf_export
    from tunix.perf import metrics as perf_metrics
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    t_start = time.perf_counter()
    notes: list[str] = []
    family, cfg = model_config(model_dir)
    devices = jax.devices()
    if devices[0].platform != "cpu":
        notes.append(f"ran on {devices[0].platform}, not CPU")
    mesh = jax.sharding.Mesh(np.array(devices[:1]).reshape(1, 1), ("fsdp", "tp"))
    model, n_params = load_model(model_dir, family, cfg, mesh)
    t_loaded = time.perf_counter()

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    prompts = workload.prompts()
    if workload.chat:  # Tunix takes prompt strings: the chat template's text, generation prompt included
        prompts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
    # Tunix's sampler prepends the BOS id when the tokenizer has one (dropping a duplicate), then left-pads to
    # max_prompt_length.
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id else []
    lens = [len(_dedup_bos(bos + tokenizer.encode(p), tokenizer.bos_token_id)) for p in prompts]
    if max(lens) > workload.max_prompt_length:
        raise ValueError(f"prompt of {max(lens)} tokens > max_prompt_length {workload.max_prompt_length}: Tunix's "
                         "sampler would widen the prompt window instead of truncating")
    eos = eos_ids(model_dir, tokenizer) if not workload.exact_length else [-1]

    def reward_fn(prompts, completions, **kwargs):
        rs = [float(W.reward(c)) for c in completions]
        times.add("rewards", rs)
        return rs

    optimizer = optax.chain(
        optax.clip_by_global_norm(W.MAX_GRAD_NORM),
        optax.adamw(W.LEARNING_RATE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0),
    )
    train_micro_prompts = W.MICRO_BATCH // W.GROUP_SIZE  # Tunix counts micro-batches in prompts
    if train_micro_prompts * W.GROUP_SIZE != W.MICRO_BATCH or W.NUM_PROMPTS % train_micro_prompts:
        raise ValueError(f"micro-batch of {W.MICRO_BATCH} rows is not a whole number of {W.GROUP_SIZE}-row groups "
                         f"dividing {W.NUM_PROMPTS} prompts: Tunix micro-batches whole prompts")
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer,
            eval_every_n_steps=10**9,
            max_steps=steps,
            mini_batch_size=W.NUM_PROMPTS,
            train_micro_batch_size=train_micro_prompts,
            rollout_micro_batch_size=W.NUM_PROMPTS,
            compute_logps_micro_batch_size=W.NUM_PROMPTS,
            metrics_logging_options=None,
            checkpoint_root_directory=None,
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=workload.response_length,
            max_prompt_length=workload.max_prompt_length,
            kv_cache_size=workload.max_prompt_length + workload.response_length,
            temperature=W.TEMPERATURE,
            top_p=1.0,
            top_k=None,
            # fixed: no token has id -1, never stop early, exactly RESPONSE_LENGTH tokens per response; gsm8k: real EOS
            eos_tokens=eos,
        ),
    )
    perf_config = perf_metrics.PerfMetricsConfig(
        custom_export_fn=perf_export.PerfMetricsExport.from_cluster_config(cluster_config))
    times = StepTimes()
    TimedRLCluster, TimedGRPOLearner = build_classes(times, workload.response_length)
    cluster = TimedRLCluster(actor=model, reference=None, tokenizer=tokenizer, cluster_config=cluster_config,
                             perf_config=perf_config)
    tunix_perf: dict[int, dict] = {}

    def keep_perf(buf) -> None:  # RLCluster's external metrics logger: one MetricsBuffer per global step
        m = buf.metrics
        if "perf/global_step_time" not in m:
            return
        # rl_learner buffers a step's perf export after incrementing global_steps: it belongs to step g - 1
        tunix_perf[buf.global_steps - 1] = {
            "tunix_perf_global_step_s": float(np.mean(m["perf/global_step_time"][0])),
            "tunix_perf_rollout_s": float(np.mean(m["perf/sum/rollout_time"][0])),
            "tunix_perf_actor_train_s": float(np.mean(m["perf/sum/actor_train_time"][0])),
        }

    cluster.with_external_metrics_logger(keep_perf)
    algo = grpo_learner.GRPOConfig(
        num_generations=W.GROUP_SIZE, num_iterations=1, beta=0.0, epsilon=W.CLIP_EPS,
    )
    learner = TimedGRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=reward_fn)
    train_ds = [{"prompts": list(prompts)} for _ in range(steps)]
    t_ready = time.perf_counter()
    learner.train(train_ds)
    t_done = time.perf_counter()

    if len(times.steps) != steps:
        raise RuntimeError(f"Tunix ran {len(times.steps)} GRPO steps, {steps} requested")
    for rec in times.steps:
        rec.update(tunix_perf.get(rec["step"], {}))
    tokens = [r["response_tokens"] for r in times.steps]
    rows = W.NUM_PROMPTS * W.GROUP_SIZE
    if workload.exact_length and any(t != rows * workload.response_length for t in tokens):
        notes.append(f"response tokens per step {tokens} != {rows} x {workload.response_length}")
    notes += [
        f"Tunix {_version('google-tunix')} GRPOLearner + RLCluster (vanilla rollout = tunix Sampler, actor/rollout "
        f"colocated on one CPU mesh, no reference model), {family} model loaded from the HF safetensors by "
        f"tunix.models.{family}.params ({n_params / 1e6:.1f} M params, float32)",
        f"jax {jax.__version__}, flax {_version('flax')}, optax {_version('optax')}, backend {jax.default_backend()} "
        f"({len(devices)} device(s), first one used)",
        ("exactly 32 tokens per response via RolloutConfig.eos_tokens=[-1] (no early stop); Tunix pads with the "
         "tokenizer pad id (= EOS id 2 for these tokenizers), so a sampled id 2 inside a response would be masked "
         "out of the loss") if workload.exact_length else
        (f"{workload.name}: prompts = the chat template's text (generation prompt on), RolloutConfig.eos_tokens="
         f"{eos} (the decode loop ends when every row has hit one), max_tokens_to_generate "
         f"{workload.response_length}; response tokens = generated tokens incl. the stopping EOS (Tunix's loss mask "
         f"stops before it: response_tokens_trained {[r['response_tokens_trained'] for r in times.steps]})"),
        "one optimizer step per GRPO step: mini_batch_size 8 prompts, train_micro_batch_size 2 prompts "
        "(= 8 rows) -> optax.MultiSteps over 4 micro-batches (mean of their gradients), then "
        "clip_by_global_norm(1.0) + adamw(1e-6, wd 0)",
        "logprob_s null: with beta 0 and num_iterations 1 Tunix runs no separate old/ref log-prob pass (old "
        "log-probs = stop_gradient of the training forward); that work is inside update_s",
        "loss aggregation: Tunix GRPOConfig default loss_agg_mode 'sequence-mean-token-mean'",
        f"Tunix's sampler prepends the tokenizer's BOS id to each prompt (dropping a duplicate) and left-pads prompts "
        f"to {workload.max_prompt_length} tokens (longest here: {max(lens)}); its "
        "sampling seed is RolloutConfig.seed=None -> PRNGKey(0) every step (timing is unaffected)",
        "total_s/gen_s/update_s: subclass boundaries (step ended by block_until_ready on the weights); "
        "tunix_perf_*: Tunix's own perf tracer (PerfMetricsExport) for comparison; cpu_s: process CPU time "
        "of the step (all threads)",
        f"wall: load {t_loaded - t_start:.1f} s, cluster/learner setup {t_ready - t_loaded:.1f} s, "
        f"train {t_done - t_ready:.1f} s",
    ]
    return {"framework": "tunix", "version": _version("google-tunix"), "model": model_name,
            "steps": times.steps, "notes": notes}  # write_result's keyword arguments


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--model-name", required=True)
    p.add_argument("--steps", type=int, default=W.WARMUP_STEPS + W.MEASURED_STEPS)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workload", choices=tuple(W.WORKLOADS), default="fixed", help="bench.workload (default fixed)")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    try:
        result = run(a.model_dir.resolve(), a.model_name, a.steps, W.get(a.workload))
    except Exception as e:  # noqa: BLE001 - the harness reads the error from the JSON
        traceback.print_exc()
        W.write_result(a.out, "tunix", _version("google-tunix"), a.model_name, [], [], error=f"{type(e).__name__}: {e}")
        return 1
    W.write_result(a.out, **result)
    for s in result["steps"]:
        print(f"[tunix_grpo] {a.model_name} step {s['step']}: total {s['total_s']:.3f} s, gen {s['gen_s']:.3f} s, "
              f"update {s['update_s']:.3f} s, tokens {s['response_tokens']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
