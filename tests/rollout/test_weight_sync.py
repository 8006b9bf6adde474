"""The weight-sync boundary: WeightSync's report, its one error type, and the engines' declared weight formats.

8 simulated CPU devices (tests/conftest.py). vLLM's own engines are covered in tests/vllm_rollout; here their
formats (``hf_device`` / ``hf_host``) are checked without vLLM.
"""

from __future__ import annotations

import ast
import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from jaxrl.models.hf import to_hf_tensors
from jaxrl.rollout.base import SamplingParams, WeightFormatError, WeightSyncError
from jaxrl.rollout.jax_sampler import JaxSampler
from jaxrl.rollout.weight_format import WeightFormat
from jaxrl.rollout.weight_sync import WeightSync, make_translator
from sharding import DEFAULT_RULES, make_mesh, param_shardings, shard_state, split_devices
from tests.source_trees import tree as source_tree

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, bos_token_id=1, eos_token_id=(2,),
                  pad_token_id=0)
PROMPTS = [[1, 5, 9, 33], [1, 40, 41, 42]]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def policy():
    graphdef, state = nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)))
    return graphdef, state


def _sampler(graphdef, params, **kw):
    return JaxSampler(CFG, graphdef, params, pad_token_id=0, eos_token_ids=(), max_prompt_length=8,
                      prompt_length_bucket=8, **kw)


def _greedy(sampler):
    return sampler.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=4)).response_ids


def _shift(state, by: float):
    return jax.tree.map(lambda x: x + by, state)


def test_failing_jax_sampler_sync_is_a_weight_sync_error(policy):
    """The JAX sampler's own refusal (a ValueError) reaches the trainer as WeightSyncError naming the sync and the
    engine, the original chained; the sampler keeps its weights, and a good sync afterwards goes through."""
    graphdef, state = policy
    sampler = _sampler(graphdef, state)
    sync = WeightSync(sampler)  # one device: no translator, the params are taken as they are
    before = jax.tree.leaves(sampler.params)
    wrong = nnx.state(Decoder(dataclasses.replace(CFG, intermediate_size=48), rngs=nnx.Rngs(0)))
    with pytest.raises(WeightSyncError, match=r"^weight sync #1 into jax sampler failed: ValueError: update_weights: "
                                              r"leaf shape/dtype mismatch .*gate_proj") as err:
        sync.sync(wrong)
    assert isinstance(err.value.__cause__, ValueError)
    assert all(a is b for a, b in zip(jax.tree.leaves(sampler.params), before, strict=True))
    assert sync.num_syncs == 0

    report = sync.sync(_shift(state, 0.01))
    assert sync.num_syncs == 1 and report.bytes_moved == 0 and report.num_tensors == len(before)
    assert not np.array_equal(np.asarray(jax.tree.leaves(sampler.params)[0]), np.asarray(before[0]))


def test_engine_errors_of_every_kind_become_weight_sync_errors(policy):
    """Any engine failure is wrapped (type and text kept); an engine's own WeightSyncError passes unchanged."""
    graphdef, state = policy

    class Failing:
        weight_format = WeightFormat.jax()
        engine_name = "failing engine"

        def __init__(self, error):
            self.error = error

        def update_weights(self, params):
            raise self.error

    with pytest.raises(WeightSyncError, match=r"^weight sync #1 into failing engine failed: RuntimeError: boom$"):
        WeightSync(Failing(RuntimeError("boom"))).sync(state)
    own = WeightSyncError("weight sync #1 into failing engine timed out")
    with pytest.raises(WeightSyncError) as err:
        WeightSync(Failing(own)).sync(state)
    assert err.value is own


def test_mesh_sampler_sync_report_counts_bytes_and_seconds(policy):
    """Split placement: every byte of every target shard lands on a device that held none of it, so the report's
    bytes equal the sum of the rollout shards' sizes (counted here from the sampler's own arrays); colocated on
    the same devices fewer bytes move; the seconds cover the sync."""
    graphdef, state = policy
    train, rollout = split_devices(4, 4)
    train_mesh, rollout_mesh = make_mesh(1, 4, 1, devices=train), make_mesh(2, 1, 2, devices=rollout)
    params = shard_state(state, param_shardings(state, train_mesh, DEFAULT_RULES))
    sync = WeightSync.start(WeightFormat.jax(rollout_mesh), params,
                            lambda initial: _sampler(graphdef, initial, mesh=rollout_mesh))
    sampler = sync.engine
    np.testing.assert_array_equal(_greedy(sampler), _greedy(_sampler(graphdef, state)))

    new = _shift(params, 0.01)
    t0 = time.perf_counter()
    report = sync.sync(new)
    wall = time.perf_counter() - t0
    shard_bytes = sum(s.data.nbytes for x in jax.tree.leaves(sampler.params) for s in x.addressable_shards)
    assert report.bytes_moved == shard_bytes == sync.initial_report.bytes_moved > 0
    assert report.num_tensors == len(jax.tree.leaves(state))
    assert 0 < report.seconds <= wall
    np.testing.assert_array_equal(_greedy(sampler), _greedy(_sampler(graphdef, _shift(state, 0.01))))

    colocated = make_mesh(2, 1, 2, devices=train)  # the train devices themselves: some shards already in place
    co = WeightSync.start(WeightFormat.jax(colocated), params, lambda w: _sampler(graphdef, w, mesh=colocated))
    assert 0 < co.sync(new).bytes_moved < report.bytes_moved


def test_hf_format_report_on_one_device(policy):
    """The "hf" plan onto the device the params already live on moves nothing (what the vLLM runs log as
    sync/bytes 0) and hands over every checkpoint tensor."""
    graphdef, state = policy
    seen = {}

    class HfEngine:
        weight_format = WeightFormat.hf_on_device(jax.devices()[0])

        def update_weights(self, tensors):
            self.weight_format.check(tensors, "hf engine")
            seen.update(tensors)

    sync = WeightSync.for_engine(HfEngine(), state, model_cfg=CFG)
    report = sync.sync(state)
    expected = to_hf_tensors(nnx.merge(graphdef, state))
    assert report.bytes_moved == 0 and report.num_tensors == len(expected) and report.seconds > 0
    assert sorted(seen) == sorted(expected)
    for name, arr in expected.items():
        np.testing.assert_array_equal(np.asarray(seen[name]), arr)


def test_engines_refuse_formats_they_did_not_declare(policy):
    graphdef, state = policy
    sampler = _sampler(graphdef, state)
    hf = to_hf_tensors(nnx.merge(graphdef, state))
    with pytest.raises(WeightFormatError, match=r"jax sampler takes the policy's nnx.State .*; got a mapping of "
                                                rf"{len(hf)} tensors"):
        sampler.update_weights(hf)
    assert issubclass(WeightFormatError, TypeError)

    mesh = make_mesh(2, 1, 2, devices=jax.devices()[:4])
    on_mesh = shard_state(state, param_shardings(state, mesh, DEFAULT_RULES))
    mesh_sampler = _sampler(graphdef, on_mesh, mesh=mesh)
    with pytest.raises(WeightFormatError, match=r"on mesh data=2 x fsdp=1 x tensor=2 \(devices \[0, 1, 2, 3\]\); "
                                                r"got arrays elsewhere: embed_tokens on cpu:0, "):
        mesh_sampler.update_weights(jax.device_put(state, jax.devices()[0]))
    with pytest.raises(WeightFormatError, match="got arrays elsewhere"):  # the constructor checks the start weights
        _sampler(graphdef, state, mesh=make_mesh(2, 1, 2, devices=jax.devices()[4:]))
    # Through WeightSync the refusal is a WeightSyncError naming the sync, the refusal chained.
    with pytest.raises(WeightSyncError, match=r"^weight sync #1 into jax sampler failed: WeightFormatError: jax "
                                              r"sampler takes the policy's nnx.State") as err:
        WeightSync(sampler).sync(hf)
    assert isinstance(err.value.__cause__, WeightFormatError)

    device1 = WeightFormat.hf_on_device(jax.devices()[1])
    with pytest.raises(WeightFormatError, match=r"takes Hugging Face tensors .* on device cpu:1; got an nnx"):
        device1.check(state, "engine")
    with pytest.raises(WeightFormatError, match=r"got tensors elsewhere: model.embed_tokens.weight as ndarray"):
        device1.check(hf, "engine")
    with pytest.raises(WeightFormatError, match=r"model.embed_tokens.weight on cpu:0"):
        device1.check({k: jax.device_put(v, jax.devices()[0]) for k, v in hf.items()}, "engine")
    device1.check({k: jax.device_put(v, jax.devices()[1]) for k, v in hf.items()}, "engine")  # its own: accepted

    host = WeightFormat.hf_on_host()
    host.check(hf, "worker")  # numpy arrays are host memory
    host.check({k: jnp.asarray(v) for k, v in hf.items()}, "worker")  # so are arrays on a CPU device
    with pytest.raises(WeightFormatError, match=r"worker takes Hugging Face tensors \{hf_name: array\} in host "
                                                r"memory; got an nnx.State"):
        host.check(state, "worker")


def test_a_translator_must_produce_the_engines_format(policy):
    graphdef, state = policy
    mesh = make_mesh(2, 1, 2, devices=jax.devices()[:4])
    on_mesh = shard_state(state, param_shardings(state, mesh, DEFAULT_RULES))
    sampler = _sampler(graphdef, on_mesh, mesh=mesh)
    hf_translator = make_translator(WeightFormat.hf_on_device(), on_mesh, model_cfg=CFG)
    with pytest.raises(ValueError, match=r"jax sampler on mesh .* takes the policy's nnx.State on mesh .*, but the "
                                         r"translator makes a 'hf' plan"):
        WeightSync(sampler, hf_translator)
    with pytest.raises(ValueError, match="no translator was given"):
        WeightSync(sampler)
    with pytest.raises(ValueError, match="declares the weight format .*expected"):
        WeightSync.start(WeightFormat.jax(mesh), on_mesh, lambda w: _sampler(graphdef, state))
    with pytest.raises(TypeError, match="declares no weight_format"):
        WeightSync(object())


def test_update_weights_has_one_caller_and_rollout_never_imports_trainer_or_workers():
    """grep: outside tests only WeightSync calls ``.update_weights(``; rollout engines import neither the trainer
    nor the workers."""
    callers = []
    for path in sorted((REPO / "jaxrl").rglob("*.py")) + sorted((REPO / "sharding").rglob("*.py")):
        for node in ast.walk(source_tree(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update_weights":
                callers.append(str(path.relative_to(REPO)))
    assert callers == ["jaxrl/rollout/weight_sync.py"]
    for path in sorted((REPO / "jaxrl" / "rollout").glob("*.py")):
        for node in ast.walk(source_tree(path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if n.startswith(("jaxrl.trainer", "jaxrl.workers"))]
            assert not bad, f"{path.name} imports {bad}"
