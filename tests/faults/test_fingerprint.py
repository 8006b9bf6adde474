"""Checkpoint fingerprints (jaxrl.fingerprint): what makes a checkpoint resumable, and the ``key: old -> new``
list a resume prints when it is not (new checkpoints and ones written before fingerprints existed)."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl.fingerprint import differences, fingerprint, legacy_fingerprint, tree_signature
from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder

HF = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "bos_token_id": 1, "eos_token_id": 2}


def _state(hf: dict, clip: bool = True):
    """The model config and ``{"actor": {"params", "opt_state"}}`` as abstract trees (shapes and dtypes only)."""
    return _abstract_state(json.dumps(hf, sort_keys=True), clip)


@functools.lru_cache(maxsize=None)
def _abstract_state(hf_json: str, clip: bool):
    cfg = ModelConfig.from_hf_config(json.loads(hf_json))

    def build():
        _, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)) if clip else optax.adamw(1e-3)
        return {"actor": {"params": params, "opt_state": tx.init(params)}}

    return cfg, jax.eval_shape(build)


def _fp(hf=HF, *, batch=4, files="a.parquet", digest="d1", clip=True, critic=False):
    cfg, arrays = _state(hf, clip)
    roles = ["actor", "critic"] if critic else ["actor"]
    if critic:
        arrays["critic"] = arrays["actor"]
    data = {"data.train_batch_size": batch, "data.seed": 1, "data.shuffle": True, "data.drop_last": True,
            "data.num_prompts": 120, "data.prompts_sha256": digest}
    context = {"data.train_files": files, "data.max_prompt_length": 64}
    model = {"hf_config": cfg.to_hf_config(), "path": "m", "param_dtype": "float32"}
    return fingerprint(model=model, roles=roles, arrays=arrays, data=data, context=context)


def test_same_run_has_no_differences_and_survives_json():
    a = _fp()
    assert differences(json.loads(json.dumps(a)), _fp()) == []


def test_batch_size_change_is_named_with_both_values():
    assert differences(_fp(batch=4), _fp(batch=2)) == ["data.train_batch_size: 4 -> 2"]


def test_another_model_lists_the_config_keys_and_array_shapes():
    diffs = differences(_fp(), _fp({**HF, "hidden_size": 32, "intermediate_size": 64}))
    assert diffs[:2] == ["model.hidden_size: 16 -> 32", "model.intermediate_size: 32 -> 64"]
    params = [d for d in diffs if d.startswith("actor.params: ")]
    assert len(params) == 1 and "arrays changed shape/dtype (e.g. embed_tokens.value: float32[32,16] -> " \
                                "float32[32,32])" in params[0]


def test_optimizer_structure_and_roles_are_compared():
    diffs = differences(_fp(clip=True), _fp(clip=False))
    assert len(diffs) == 1 and diffs[0].startswith("actor.opt_state: ") and "only in the checkpoint" in diffs[0]
    diffs = differences(_fp(), _fp(critic=True))
    assert diffs[0] == "roles: 'actor' -> 'actor,critic'" and "critic.params: not saved -> needed" in diffs


def test_moved_data_files_are_fine_but_changed_prompts_name_the_files():
    assert differences(_fp(files="a.parquet"), _fp(files="/new/place/a.parquet")) == []
    diffs = differences(_fp(files="a.parquet", digest="d1"), _fp(files="b.parquet", digest="d2"))
    assert diffs == ["data.prompts_sha256: 'd1' -> 'd2'", "data.train_files: 'a.parquet' -> 'b.parquet'"]


def test_checkpoint_without_fingerprint_is_compared_on_its_meta():
    cfg = ModelConfig.from_hf_config(HF)
    meta = {"step": 2, "data_state": {"version": 1, "epoch": 0, "step_in_epoch": 2, "seed": 1, "shuffle": True,
                                      "num_rows": 120, "batch_size": 4, "drop_last": True},
            "kl_ctrl": {"value": 0.001}, "actor": {"num_updates": 4, "rng": {}},
            "model": {"hf_config": cfg.to_hf_config(), "path": "m", "param_dtype": "float32"}}
    old = legacy_fingerprint(meta, array_signatures=None, batch_key="data.train_batch_size")
    assert differences(old, _fp(), only_common=True) == []  # resumable as before
    assert differences(old, _fp(batch=2), only_common=True) == ["data.train_batch_size: 4 -> 2"]
    assert differences(old, _fp({**HF, "num_hidden_layers": 3}), only_common=True) == [
        "model.num_hidden_layers: 2 -> 3"]
    assert differences(old, _fp(critic=True), only_common=True) == ["roles: 'actor' -> 'actor,critic'"]


def test_tree_signature_is_the_same_for_live_and_abstract_trees():
    params = {"layer": {"kernel": jnp.zeros((4, 3)), "bias": jnp.zeros((3,), jnp.bfloat16)}}
    arrays = {"actor": {"params": params, "opt_state": optax.adamw(1e-3).init(params)}}  # NamedTuples inside
    live = tree_signature(arrays)
    assert live == tree_signature(jax.eval_shape(lambda: arrays))
    assert live["actor.opt_state.0.count"] == "int32[]" and live["actor.opt_state.0.mu.layer.bias"] == "bfloat16[3]"
    assert live["actor.params.layer.kernel"] == "float32[4,3]"


def test_a_per_layer_checkpoint_against_stacked_layers_says_why_and_what_to_do():
    """Checkpoints saved before trained roles stored their layers stacked (jaxrl.models.scan_layout) hold per-layer
    arrays: the refusal says so and names the export as the way forward; two stacked fingerprints agree."""
    from jaxrl.models.scan_layout import stack_layers

    cfg = ModelConfig.from_hf_config(HF)

    def fp(scan: bool):
        def build():
            graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0), remat=True))
            if scan:
                params = stack_layers(graphdef, params)[1]
            return {"actor": {"params": params, "opt_state": optax.adamw(1e-3).init(params)}}

        model = {"hf_config": cfg.to_hf_config(), "path": "m", "param_dtype": "float32"}
        return fingerprint(model=model, roles=["actor"], arrays=jax.eval_shape(build), data={}, context={})

    diffs = differences(json.loads(json.dumps(fp(scan=False))), fp(scan=True))
    assert "layers.0." in diffs[0] + diffs[1] and "layers.block." in diffs[0] + diffs[1]
    assert diffs[-1].startswith("layout: the checkpoint holds the decoder layers one by one") and "jaxrl.export" in \
        diffs[-1]
    assert differences(json.loads(json.dumps(fp(scan=True))), fp(scan=True)) == []
    assert not any(d.startswith("layout:") for d in differences(fp(scan=True), fp(scan=False)))
