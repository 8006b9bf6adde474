"""vLLM rollout engine vs the embedded JAX sampler and the trainer's log-prob recompute (CPU, vllm-cpu).

Runs only in the venv built by ``scripts/setup_vllm_cpu.sh`` (``.venv-vllm/bin/python -m pytest -q tests/vllm``).
Models: tiny random Qwen2 (untied) / Qwen3 (tied embeddings) decoders (head_dim 32, vLLM's CPU attention
minimum) and the real
SmolLM2-135M-Instruct (GGUF in the shared assets). One vLLM engine per model, shared by the tests of a module.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU (default is larger)

import pytest

pytest.importorskip("vllm")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.models.decoder import Decoder  # noqa: E402
from jaxrl.models.hf import to_hf_tensors  # noqa: E402
from jaxrl.rollout import JaxSampler, RolloutEngine, SamplingParams, WeightSync  # noqa: E402
from jaxrl.rollout.base import WeightFormatError  # noqa: E402
from jaxrl.rollout.vllm_engine import VllmEngine, WeightSyncError  # noqa: E402
from vllm_tiny import BOS, EOS, P, PAD, PROMPTS, R  # noqa: E402
from vllm_tiny import assert_same_rollout, recompute_log_probs, scaled, tiny_cfg  # noqa: E402


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    cfg = tiny_cfg(request.param)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    state = scaled(state, 4.0, seed=1)
    sampler = JaxSampler(cfg, graphdef, state, pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=P)
    engine = VllmEngine(
        cfg, graphdef, state, None, rollout_cfg={"seed": 0, "update_weights_timeout_s": 120.0},
        max_prompt_length=P, max_response_length=R, work_dir=tmp_path_factory.mktemp(request.param),
    )
    yield cfg, graphdef, state, sampler, engine, WeightSync.for_engine(engine, state, model_cfg=cfg)
    engine.shutdown()


def test_greedy_matches_jax_sampler_and_follows_weight_syncs(tiny):
    cfg, graphdef, state, sampler, engine, sync = tiny
    assert isinstance(engine, RolloutEngine)
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=R)
    sync.sync(state)  # a sync of the initial weights through WeightSync (what the trainer does after resume)
    v0, j0 = engine.generate(PROMPTS, greedy), sampler.generate(PROMPTS, greedy)
    assert v0.response_ids.shape == (6, R) and v0.prompt_ids.shape == (6, P)
    assert_same_rollout(v0, j0, logprob_atol=1e-4)

    new = scaled(state, 1.0, seed=7)  # another policy: the engine must not keep the old weights
    sync.sync(new)
    sampler.update_weights(new)
    v1, j1 = engine.generate(PROMPTS, greedy), sampler.generate(PROMPTS, greedy)
    assert_same_rollout(v1, j1, logprob_atol=1e-4)
    assert not np.array_equal(v1.response_ids, v0.response_ids)
    assert engine.num_syncs == 2

    sync.sync(state)  # and back: identical to the first rollout (prefix cache was reset)
    sampler.update_weights(state)
    assert_same_rollout(engine.generate(PROMPTS, greedy), v0, logprob_atol=1e-5)


def test_sampled_log_probs_match_trainer_recompute_and_seeds(tiny):
    cfg, graphdef, state, sampler, engine, sync = tiny
    sync.sync(state)
    sp = SamplingParams(n=4, temperature=0.8, max_new_tokens=R)
    out = engine.generate(PROMPTS, sp, rng_seed=11)
    assert out.num_generated_tokens > 0
    ref = recompute_log_probs(graphdef, state, out, temperature=0.8)
    gap = float(np.max(np.abs(out.rollout_log_probs - ref)))
    print(f"vLLM vs trainer recompute, T=0.8: max |log-prob gap| = {gap:.2e} over {out.num_generated_tokens} tokens")
    assert gap < 1e-3, gap
    assert np.all(out.rollout_log_probs[out.response_mask == 0] == 0)
    # Every row stops at its first eos (inclusive) and is pad after it.
    for ids, m in zip(out.response_ids, out.response_mask):
        n = int(m.sum())
        assert np.all(m[:n] == 1) and np.all(ids[n:] == PAD)
        assert EOS not in ids[: n - 1].tolist()
    again = engine.generate(PROMPTS, sp, rng_seed=11)
    np.testing.assert_array_equal(again.response_ids, out.response_ids)
    other = engine.generate(PROMPTS, sp, rng_seed=12)
    assert not np.array_equal(other.response_ids, out.response_ids)
    # The n rows of one prompt get different seeds.
    assert len({tuple(r) for r in out.response_ids[:4]}) > 1


def test_data_parallel_shares_with_their_first_row_merge_into_the_whole_batch(tiny):
    """vLLM per host (the hybrid rollout group): each engine samples a share of the prompts with the seeds of its
    rows in the whole batch; the merged shares are the batch one engine samples (tokens exactly, log-probs 1e-5),
    and a share without its first_row samples other tokens."""
    from jaxrl.hybrid.dispatch import merge_outputs, split_prompts

    cfg, graphdef, state, sampler, engine, sync = tiny
    sync.sync(state)
    sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=R)
    whole = engine.generate(PROMPTS, sp, rng_seed=5)
    ranges = split_prompts(len(PROMPTS), 2)  # [(0, 2), (2, 3)]: the shares' prompt widths differ
    shares = [engine.generate(PROMPTS[a:b], sp, rng_seed=5, first_row=a * sp.n) for a, b in ranges]
    merged = merge_outputs(shares, first_prompts=[a for a, _ in ranges], pad_token_id=PAD)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "prompt_index"):
        np.testing.assert_array_equal(getattr(merged, name), getattr(whole, name), err_msg=name)
    np.testing.assert_allclose(merged.rollout_log_probs, whole.rollout_log_probs, atol=1e-5)
    unshifted = engine.generate(PROMPTS[2:3], sp, rng_seed=5)  # seeds of rows 0..2 instead of 6..8
    assert not np.array_equal(unshifted.response_ids, whole.response_ids[6:9])
    with pytest.raises(ValueError, match="first_row=-1"):
        engine.generate(PROMPTS, sp, rng_seed=5, first_row=-1)


def test_top_k_log_probs_are_renormalised_over_the_kept_tokens(tiny):
    """Documented gap: with top-k on, vLLM's processed log-probs are >= jaxrl's un-truncated ones."""
    cfg, graphdef, state, sampler, engine, sync = tiny
    sync.sync(state)
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, top_k=3, max_new_tokens=R), rng_seed=3)
    ref = recompute_log_probs(graphdef, state, out, temperature=1.0)
    m = out.response_mask.astype(bool)
    assert np.all(out.rollout_log_probs[m] >= ref[m] - 1e-4)
    print(f"top_k=3: vLLM minus un-truncated log-prob, max {np.max(out.rollout_log_probs[m] - ref[m]):.3f} nats")


def test_bad_weights_and_timeouts_raise_clear_errors(tiny):
    cfg, graphdef, state, sampler, engine, sync = tiny
    greedy = SamplingParams(do_sample=False, max_new_tokens=R)
    sync.sync(state)
    before = engine.generate(PROMPTS, greedy)

    def widen_final_norm(path, x):
        key = jax.tree_util.keystr(path)
        return jnp.zeros((cfg.hidden_size + 1,), x.dtype) if "norm" in key and "layers" not in key else x

    bad_state = jax.tree_util.tree_map_with_path(widen_final_norm, state)
    with pytest.raises(WeightSyncError, match=r"weight sync #\d+ into vllm .*norm.*keeps its previous weights"):
        sync.sync(bad_state)
    hf = {"model.norm.weight": np.ones((cfg.hidden_size,), np.float32),
          "model.embed_tokens.weight": np.zeros((cfg.vocab_size + 3, cfg.hidden_size), np.float32)}
    with pytest.raises(WeightSyncError, match=r"failed: ValueError: .*wrong shapes \['model.embed_tokens.weight: "
                                              r"expected \(256, 64\), got \(259, 64\)'\].*keeps its previous"):
        engine.load_hf_weights(hf)
    assert_same_rollout(engine.generate(PROMPTS, greedy), before, logprob_atol=1e-5)  # nothing was sent

    engine.sync_timeout_s = 1e-4
    with pytest.raises(WeightSyncError, match=r"did not finish within 0.0001 s"):
        sync.sync(state)
    with pytest.raises(WeightSyncError, match="timed out; refusing to generate"):
        engine.generate(PROMPTS, greedy)
    engine.sync_timeout_s = 120.0
    sync.sync(state)  # waits for the timed-out sync, then recovers
    assert_same_rollout(engine.generate(PROMPTS, greedy), before, logprob_atol=1e-5)


def test_engine_accepts_only_hf_tensors_on_its_device(tiny):
    """The in-process engine declares HF tensors on jax.devices()[0]; an nnx.State (the JAX layout), host numpy
    arrays or a list are refused before anything reaches vLLM, and WeightSync turns the refusal into a
    WeightSyncError naming the sync."""
    cfg, graphdef, state, sampler, engine, sync = tiny
    greedy = SamplingParams(do_sample=False, max_new_tokens=R)
    sync.sync(state)
    before, syncs = engine.generate(PROMPTS, greedy), engine.num_syncs
    assert engine.weight_format.kind == "hf_device" and engine.weight_format.device == jax.devices()[0]
    with pytest.raises(WeightFormatError, match=r"takes Hugging Face tensors .* on device .*got an nnx.State"):
        engine.update_weights(state)
    with pytest.raises(WeightFormatError, match=r"got tensors elsewhere: model.embed_tokens.weight as ndarray"):
        engine.update_weights(to_hf_tensors(nnx.merge(graphdef, scaled(state, 1.0, seed=7))))
    with pytest.raises(WeightFormatError, match="got a list"):
        engine.update_weights([1, 2])
    assert engine.num_syncs == syncs  # nothing was loaded
    assert_same_rollout(engine.generate(PROMPTS, greedy), before, logprob_atol=1e-5)
    on_device = {k: jnp.asarray(v) for k, v in to_hf_tensors(nnx.merge(graphdef, state)).items()}
    engine.update_weights(on_device)  # the declared format (what WeightSync's "hf" plan makes): loaded
    assert engine.num_syncs == syncs + 1
    assert_same_rollout(engine.generate(PROMPTS, greedy), before, logprob_atol=1e-5)


def test_rejects_bad_requests(tiny):
    cfg, graphdef, state, sampler, engine, sync = tiny
    with pytest.raises(ValueError, match="max_new_tokens=13 exceeds"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=R + 1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[BOS, 999]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="more than max_prompt_length"):
        engine.generate([[BOS] * (P + 1)], SamplingParams(max_new_tokens=2))


def test_failure_inside_vllm_makes_the_engine_refuse_everything(tiny):
    """A tensor vLLM rejects mid-reload (simulated by skipping jaxrl's pre-check) leaves vLLM's layers half
    reloaded; the engine must then refuse generate and later syncs with a clear error instead of serving mixed
    weights. Runs last for its engine (the engine is unusable afterwards)."""
    cfg, graphdef, state, sampler, engine, sync = tiny
    hf = to_hf_tensors(nnx.merge(graphdef, state))
    hf["model.embed_tokens.weight"] = np.zeros((cfg.vocab_size + 3, cfg.hidden_size), np.float32)
    engine._check_hf = lambda where, tensors: None  # let the bad tensor reach vLLM
    with pytest.raises(WeightSyncError, match=r"weight sync #\d+ into vllm .* failed: AssertionError.*unusable"):
        engine.load_hf_weights(hf)
    with pytest.raises(WeightSyncError, match="failed inside vLLM .* refusing to generate"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    with pytest.raises(WeightSyncError, match="refused, .*failed inside vLLM"):
        sync.sync(state)


def test_rollout_dtype_bfloat16_runs_vllm_in_bfloat16_and_follows_syncs(tmp_path):
    """``actor_rollout_ref.rollout.dtype=bfloat16`` reaches vLLM through the run's factory: its model computes in
    bfloat16, takes the trainer's float32 weights at a sync, and samples what the policy's float32 recompute scores
    within bfloat16 rounding."""
    import torch
    from types import SimpleNamespace

    from jaxrl.config import load_config
    from jaxrl.rollout.factory import make_rollout_engine

    cfg = tiny_cfg("qwen2")
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    state = scaled(state, 4.0, seed=1)
    run = load_config(None, ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=bfloat16",
                             "actor_rollout_ref.model.dtype=float32", f"data.max_prompt_length={P}",
                             f"data.max_response_length={R}", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                             f"trainer.default_local_dir={tmp_path}"])
    engine = make_rollout_engine(run, cfg, graphdef, state, SimpleNamespace(pad_token_id=PAD))
    try:
        assert isinstance(engine, VllmEngine)
        assert engine.llm.llm_engine.model_config.dtype == torch.bfloat16
        sync = WeightSync.for_engine(engine, state, model_cfg=cfg)
        greedy = SamplingParams(n=1, do_sample=False, max_new_tokens=R)
        new = scaled(state, 1.0, seed=7)
        sync.sync(new)  # float32 weights into the bfloat16 engine
        out = engine.generate(PROMPTS, greedy)
        ref = recompute_log_probs(graphdef, new, out, temperature=1.0)
        gap = np.abs(out.rollout_log_probs - ref)[out.response_mask.astype(bool)]
        print(f"bfloat16 vLLM vs float32 recompute: max |log-prob gap| {gap.max():.2e}, median {np.median(gap):.2e}")
        assert out.num_generated_tokens > 0 and np.median(gap) < 0.05 and gap.max() > 1e-5, gap
    finally:
        engine.shutdown()


# ------------------------------------------------------------------------------------------- real model
def test_smollm2_greedy_matches_jax_sampler_across_syncs(shared, tmp_path):
    from jaxrl.models import load_pretrained

    gguf = shared / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    pre = load_pretrained(str(gguf))
    tok = pre.tokenizer
    texts = ["What is 12 plus 7?", "Name a colour of the sky.", "Write one word: hello"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
               for t in texts]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    graphdef, state = nnx.split(pre.model)
    cfg = pre.config
    pad = tok.pad_token_id if tok.pad_token_id is not None else cfg.eos_token_id[0]
    sampler = JaxSampler(cfg, graphdef, state, pad_token_id=int(pad), eos_token_ids=cfg.eos_token_id,
                         max_prompt_length=64)
    engine = VllmEngine(cfg, graphdef, state, tok, rollout_cfg={"seed": 0}, max_prompt_length=64,
                        max_response_length=16, work_dir=tmp_path)
    sync = WeightSync.for_engine(engine, state, model_cfg=cfg)
    try:
        greedy = SamplingParams(do_sample=False, max_new_tokens=16)
        v0, j0 = engine.generate(prompts, greedy), sampler.generate(prompts, greedy)
        assert_same_rollout(v0, j0, logprob_atol=2e-3)
        gap0 = float(np.max(np.abs(v0.rollout_log_probs - j0.rollout_log_probs)))

        # Perturb every matrix by 2% noise: a different policy both engines must follow.
        new = scaled(state, 1.0, seed=5)
        new = jax.tree.map(lambda a, b: a + (b - a) * 0.066, state, new)
        sync.sync(new)
        sampler.update_weights(new)
        v1, j1 = engine.generate(prompts, greedy), sampler.generate(prompts, greedy)
        assert_same_rollout(v1, j1, logprob_atol=2e-3)
        assert not np.allclose(v1.rollout_log_probs, v0.rollout_log_probs, atol=1e-3)
        sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=16)
        s = engine.generate(prompts, sp, rng_seed=1)
        gap = float(np.max(np.abs(s.rollout_log_probs - recompute_log_probs(graphdef, new, s, 1.0))))
        print(f"SmolLM2-135M: greedy log-prob gap vs JaxSampler {gap0:.2e}; sampled vs trainer recompute {gap:.2e}")
        assert gap < 5e-3, gap
    finally:
        engine.shutdown()


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_tensor_parallel_2_follows_syncs(model_type, tmp_path, monkeypatch):
    """tensor_model_parallel_size=2: vLLM starts two CPU workers (one core each, VLLM_CPU_OMP_THREADS_BIND), each
    cuts its own shard from the checkpoint-format tensors of every sync; greedy tokens equal the JAX sampler's."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vLLM's CPU TP binds one worker per core/NUMA node
    cfg = tiny_cfg(model_type)
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    state = scaled(state, 4.0, seed=1)
    sampler = JaxSampler(cfg, graphdef, state, pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=P)
    engine = VllmEngine(
        cfg, graphdef, state, None, rollout_cfg={"seed": 0, "tensor_model_parallel_size": 2,
                                                 "update_weights_timeout_s": 300.0},
        max_prompt_length=P, max_response_length=R, work_dir=tmp_path,
    )
    sync = WeightSync.for_engine(engine, state, model_cfg=cfg)
    try:
        assert "tp=2" in engine.engine_name
        greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=R)
        assert_same_rollout(engine.generate(PROMPTS, greedy), sampler.generate(PROMPTS, greedy), logprob_atol=1e-4)
        new = scaled(state, 1.0, seed=7)
        before = engine.generate(PROMPTS, greedy)
        sync.sync(new)
        sampler.update_weights(new)
        after = engine.generate(PROMPTS, greedy)
        assert_same_rollout(after, sampler.generate(PROMPTS, greedy), logprob_atol=1e-4)
        assert not np.array_equal(after.response_ids, before.response_ids)
    finally:
        engine.shutdown()
