"""Per-target translation tables: :func:`build_plan` writes the :class:`~sharding.plan.Plan` for one engine.

Targets
-------
``"jax"``: the embedded sampler's parameters - the same tree and names as the source ``nnx.State`` (``sync``
returns an ``nnx.State`` when given one), re-laid-out by logical-axis rules (default
:data:`~sharding.rules.TENSOR_PARALLEL_RULES`) or explicit shardings, on the same devices (colocated) or on other
devices (split placement); optional dtype cast.

``"vllm"``: vLLM's parameter names and fused tensor-parallel layouts (``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``, ``models/llama.py``), torch ``[out, in]`` layout:

================================================  ========================  ===========================
name                                              global shape              sharded (rank r = device r)
================================================  ========================  ===========================
``model.embed_tokens.weight``                     ``[Vp, E]``               rows (vocab)
``lm_head.weight`` (untied models only)           ``[Vp, E]``               rows (vocab)
``model.norm.weight``                             ``[E]``                   replicated
``model.layers.{i}.input_layernorm.weight``       ``[E]``                   replicated
``model.layers.{i}.post_attention_layernorm.weight`` ``[E]``                replicated
``model.layers.{i}.self_attn.qkv_proj.weight``    ``[tp*(qh+2kh)*D, E]``    rows: rank r's q|k|v block
``model.layers.{i}.self_attn.qkv_proj.bias``      ``[tp*(qh+2kh)*D]``       (Qwen2) as the weight
``model.layers.{i}.self_attn.o_proj.weight``      ``[E, nH*D]``             columns (row-parallel)
``model.layers.{i}.self_attn.{q,k}_norm.weight``  ``[D]``                   (Qwen3) replicated
``model.layers.{i}.mlp.gate_up_proj.weight``      ``[2I, E]``               rows: rank r's gate|up block
``model.layers.{i}.mlp.down_proj.weight``         ``[E, I]``                columns (row-parallel)
================================================  ========================  ===========================

Each value is one global ``jax.Array`` on a ``("tensor",)`` mesh of ``tp`` devices, sharded so that device ``r``
of the mesh holds exactly rank ``r``'s shard (:func:`rank_shards` lists them in rank order). ``qh, kh`` are
vLLM's per-rank head counts (:func:`sharding.ops.kv_layout`); when ``tp > nKV`` each rank holds a copy of kv head
``r // (tp/nKV)``, so the fused global tensor is larger than q+k+v. ``Vp`` is the vocabulary padded with zero
rows to a multiple of ``vocab_pad_multiple`` (vLLM's ``DEFAULT_VOCAB_PADDING_SIZE`` = 64). Tied models have no
``lm_head.weight`` (vLLM ties it to the embedding).

``"hf"``: Hugging Face checkpoint format - what ``transformers`` state dicts hold and what vLLM's
``model.load_weights`` / ``Worker.reload_weights(is_checkpoint_format=True)`` consume: unfused, unpadded, torch
``[out, in]`` layout, every tensor whole (``model.embed_tokens.weight [V, E]``,
``model.layers.{i}.self_attn.{q,k,v}_proj.weight [n*D, E]`` (+ ``.bias [n*D]`` for Qwen2),
``model.layers.{i}.self_attn.o_proj.weight [E, nH*D]``, ``model.layers.{i}.self_attn.{q,k}_norm.weight [D]``
(Qwen3), ``model.layers.{i}.mlp.{gate,up}_proj.weight [I, E]``, ``model.layers.{i}.mlp.down_proj.weight [E, I]``,
the layer norms, ``model.norm.weight``, ``lm_head.weight [V, E]`` (untied only)), replicated over the target
mesh - normally one device, the inference engine's rank-0 device, from which the engine's own weight loaders cut
their tensor-parallel shards (``stacked_params_mapping`` in vLLM's ``models/{llama,qwen2,qwen3}.py``). Names
and layouts come from the one table in :mod:`sharding.hf_layout`, which ``jaxrl.models.hf`` (import/export) reads
too. Consumed zero-copy through DLPack by ``jaxrl.rollout.vllm_engine``.

``"jetstream"``: a MaxText parameter tree (what JetStream's MaxText engine serves), scanned layers with the
layer axis at position 1 (``param_scan_axis=1``), as written by MaxText's ``llama_or_mistral_ckpt.py`` and read
by ``integration/tunix/weight_mapping/{llama3,qwen3}.py`` (AI-Hypercomputer/maxtext)::

    params.token_embedder.embedding                              [V, E]       (vocab, embed)
    params.decoder.decoder_norm.scale                            [E]          (embed,)
    params.decoder.logits_dense.kernel        (untied only)      [E, V]       (embed, vocab)
    params.decoder.layers.pre_self_attention_layer_norm.scale    [E, L]       (embed, layers)
    params.decoder.layers.post_self_attention_layer_norm.scale   [E, L]
    params.decoder.layers.self_attention.query.kernel            [E, L, nH, D] (embed, layers, heads, head_dim)
    params.decoder.layers.self_attention.{key,value}.kernel      [E, L, nKV, D]
    params.decoder.layers.self_attention.out.kernel              [nH, L, D, E] (heads, layers, head_dim, embed)
    params.decoder.layers.self_attention.{query,key,value}.bias  [n, L, D]    (Qwen2)
    params.decoder.layers.self_attention.{query,key}_norm.scale  [D, L]       (Qwen3)
    params.decoder.layers.mlp.wi_0.kernel / wi_1.kernel          [E, L, I]    (embed, layers, mlp)  gate / up
    params.decoder.layers.mlp.wo.kernel                          [I, L, E]    (mlp, layers, embed)

``sync`` returns it as nested dicts. MaxText's Llama conversion also divides the query kernel by
``sqrt(head_dim)`` and may permute q/k to the interleaved RoPE layout; ``TargetSpec(scale_query=True,
interleave_rope=True)`` does the same (off by default).

"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from sharding import ops
from sharding.hf_layout import hf_table
from sharding.plan import (
    ModelInfo,
    Plan,
    Rule,
    SourceParam,
    Step,
    TargetSpec,
    _dtype,
    _flat_state,
    _is_description,
    _named,
    _pad,
    _reshape,
    _stack_layers,
    _transpose,
    _with_cast,
    describe_source,
    validate_plan,
)
from sharding.rules import TENSOR_PARALLEL_RULES, logical_to_pspec

__all__ = ["build_plan"]

# ----------------------------------------------------------------------------------------------- builders
def _explicit_shardings(shardings: Any) -> dict[str, jax.sharding.Sharding]:
    if isinstance(shardings, nnx.State):
        out = {}
        for name, _, leaf in _flat_state(shardings):
            out[name] = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        return out
    if isinstance(shardings, Mapping):
        return {str(k): v for k, v in shardings.items()}
    raise ValueError(f"TargetSpec.shardings must be a dict name -> Sharding or an nnx.State of shardings; "
                     f"got {type(shardings).__name__}")


def _build_jax(src: Mapping[str, SourceParam], target: TargetSpec, mesh: Mesh) -> tuple[list[Rule], dict]:
    rules_table = target.rules if target.rules is not None else TENSOR_PARALLEL_RULES
    explicit = _explicit_shardings(target.shardings) if target.shardings is not None else None
    rules, expected = [], {}
    for name, p in src.items():
        if explicit is not None:
            if name not in explicit:
                raise ValueError(f"TargetSpec.shardings has no entry for source {name!r}")
            sh = explicit[name]
            if not isinstance(sh, NamedSharding):
                raise ValueError(f"TargetSpec.shardings[{name!r}] is a {type(sh).__name__}; use a NamedSharding")
        elif p.names is not None:
            sh = NamedSharding(mesh, logical_to_pspec(p.names, rules_table, mesh, p.shape))
        else:
            sh = _named(mesh)
        rules.append(Rule(name, (name,), _with_cast([], p.dtype, target), sh))
        expected[name] = jax.ShapeDtypeStruct(p.shape, _dtype(target, p.dtype))
    return rules, expected


def _src_dtype(src, name):
    return src[name].dtype if name in src else np.dtype(np.float32)


def _build_vllm(src, target: TargetSpec, mesh: Mesh, tp: int, info: ModelInfo) -> tuple[list[Rule], dict]:
    e, i, d = info.hidden, info.intermediate, info.head_dim
    nh, nkv = info.num_heads, info.num_kv_heads
    qh, kh, _ = ops.kv_layout(nh, nkv, tp)
    if i % tp:
        raise ValueError(f"tensor-parallel size {tp} must divide intermediate_size={i}")
    if "embed_tokens" not in src:
        raise ValueError("source has no 'embed_tokens'; a vllm plan needs the decoder's parameter names")
    vocab = src["embed_tokens"].shape[0]
    m = int(target.vocab_pad_multiple)
    vp = -(-vocab // m) * m
    if vp % tp:
        raise ValueError(f"padded vocabulary {vp} (vocab {vocab}, vocab_pad_multiple {m}) is not divisible by "
                         f"tp={tp}; choose a vocab_pad_multiple that is a multiple of {tp}")
    rows, cols, rep = _named(mesh, "tensor", None), _named(mesh, None, "tensor"), _named(mesh)
    rvec = _named(mesh, "tensor")
    has_bias = "layers.0.self_attn.q_bias" in src
    has_qk_norm = "layers.0.self_attn.q_norm.scale" in src
    rules: list[Rule] = []
    expected: dict[str, jax.ShapeDtypeStruct] = {}

    def add(tname, sources, steps, sharding, shape):
        dt = _dtype(target, _src_dtype(src, sources[0]))
        rules.append(Rule(tname, tuple(sources), _with_cast(steps, _src_dtype(src, sources[0]), target), sharding))
        expected[tname] = jax.ShapeDtypeStruct(tuple(shape), dt)

    add("model.embed_tokens.weight", ["embed_tokens"], [_pad(vp, 0)], rows, (vp, e))
    if not info.tie_word_embeddings:
        add("lm_head.weight", ["lm_head"], [_transpose((1, 0)), _pad(vp, 0)], rows, (vp, e))
    add("model.norm.weight", ["norm.scale"], [], rep, (e,))
    fuse_qkv = Step("fuse_qkv_per_rank", ops.fuse_qkv_per_rank, {"num_heads": nh, "num_kv_heads": nkv, "tp": tp})
    fuse_gu = Step("fuse_gate_up_per_rank", ops.fuse_gate_up_per_rank, {"tp": tp})
    qkv_rows = tp * (qh + 2 * kh) * d
    for li in range(info.num_layers):
        s, t = f"layers.{li}.", f"model.layers.{li}."
        add(t + "input_layernorm.weight", [s + "input_layernorm.scale"], [], rep, (e,))
        add(t + "post_attention_layernorm.weight", [s + "post_attention_layernorm.scale"], [], rep, (e,))
        a = s + "self_attn."
        # [E, n, D] -> HF [n*D, E], then fuse per rank.
        add(t + "self_attn.qkv_proj.weight", [a + "q_proj", a + "k_proj", a + "v_proj"],
            [_reshape((e, -1)), _transpose((1, 0)), fuse_qkv], rows, (qkv_rows, e))
        if has_bias:
            add(t + "self_attn.qkv_proj.bias", [a + "q_bias", a + "k_bias", a + "v_bias"],
                [_reshape((-1,)), fuse_qkv], rvec, (qkv_rows,))
        # [nH, D, E] -> HF [E, nH*D]
        add(t + "self_attn.o_proj.weight", [a + "o_proj"], [_reshape((nh * d, e)), _transpose((1, 0))], cols,
            (e, nh * d))
        if has_qk_norm:
            add(t + "self_attn.q_norm.weight", [a + "q_norm.scale"], [], rep, (d,))
            add(t + "self_attn.k_norm.weight", [a + "k_norm.scale"], [], rep, (d,))
        mm = s + "mlp."
        add(t + "mlp.gate_up_proj.weight", [mm + "gate_proj", mm + "up_proj"], [_transpose((1, 0)), fuse_gu], rows,
            (2 * i, e))
        add(t + "mlp.down_proj.weight", [mm + "down_proj"], [_transpose((1, 0))], cols, (e, i))
    return rules, expected


def _build_hf(src, target: TargetSpec, mesh: Mesh, info: ModelInfo) -> tuple[list[Rule], dict]:
    if "embed_tokens" not in src:
        raise ValueError("source has no 'embed_tokens'; an hf plan needs the decoder's parameter names")
    rep = _named(mesh)
    rules: list[Rule] = []
    expected: dict[str, jax.ShapeDtypeStruct] = {}
    table = hf_table(info, vocab_size=src["embed_tokens"].shape[0],
                     attention_bias="layers.0.self_attn.q_bias" in src,
                     qk_norm="layers.0.self_attn.q_norm.scale" in src)
    for entry in table:  # the one HF name/layout table (sharding.hf_layout), also read by jaxrl.models.hf
        src_dtype = _src_dtype(src, entry.source)
        rules.append(Rule(entry.name, (entry.source,), _with_cast(list(entry.to_hf), src_dtype, target), rep))
        expected[entry.name] = jax.ShapeDtypeStruct(entry.shape, _dtype(target, src_dtype))
    return rules, expected


def _build_jetstream(src, target: TargetSpec, mesh: Mesh, info: ModelInfo) -> tuple[list[Rule], dict]:
    rules_table = target.rules if target.rules is not None else TENSOR_PARALLEL_RULES
    e, i, d, n_l = info.hidden, info.intermediate, info.head_dim, info.num_layers
    nh, nkv = info.num_heads, info.num_kv_heads
    if "embed_tokens" not in src:
        raise ValueError("source has no 'embed_tokens'; a jetstream plan needs the decoder's parameter names")
    vocab = src["embed_tokens"].shape[0]
    has_bias = "layers.0.self_attn.q_bias" in src
    has_qk_norm = "layers.0.self_attn.q_norm.scale" in src
    if target.scale_query and has_qk_norm:
        raise ValueError("scale_query=True with q/k-norm (Qwen3) would be undone by the norm; MaxText does not "
                         "pre-scale Qwen3 queries - leave scale_query=False")
    rules: list[Rule] = []
    expected: dict[str, jax.ShapeDtypeStruct] = {}

    def add(tname, sources, steps, names, shape):
        dt = _dtype(target, _src_dtype(src, sources[0]))
        sh = NamedSharding(mesh, logical_to_pspec(names, rules_table, mesh, shape))
        rules.append(Rule(tname, tuple(sources), _with_cast(steps, _src_dtype(src, sources[0]), target), sh))
        expected[tname] = jax.ShapeDtypeStruct(tuple(shape), dt)

    def stack(axis=1):
        return Step("stack_layers", _stack_layers, {"axis": axis})

    def layers(suffix):
        return [f"layers.{li}.{suffix}" for li in range(n_l)]

    qscale = [Step("scale", ops.scale, {"factor": 1.0 / math.sqrt(d)}, each=True, moves_only=False)] \
        if target.scale_query else []

    def rope(axis=-1):
        return [Step("rope_halves_to_interleaved", ops.rope_halves_to_interleaved, {"axis": axis}, each=True)] \
            if target.interleave_rope else []

    p, dec, lay = "params.", "params.decoder.", "params.decoder.layers."
    add(p + "token_embedder.embedding", ["embed_tokens"], [], ("vocab", "embed"), (vocab, e))
    add(dec + "decoder_norm.scale", ["norm.scale"], [], ("embed",), (e,))
    if not info.tie_word_embeddings:
        add(dec + "logits_dense.kernel", ["lm_head"], [], ("embed", "vocab"), (e, vocab))
    add(lay + "pre_self_attention_layer_norm.scale", layers("input_layernorm.scale"), [stack()], ("embed", "layers"),
        (e, n_l))
    add(lay + "post_self_attention_layer_norm.scale", layers("post_attention_layernorm.scale"), [stack()],
        ("embed", "layers"), (e, n_l))
    sa = lay + "self_attention."
    add(sa + "query.kernel", layers("self_attn.q_proj"), rope() + qscale + [stack()],
        ("embed", "layers", "heads", "head_dim"), (e, n_l, nh, d))
    add(sa + "key.kernel", layers("self_attn.k_proj"), rope() + [stack()], ("embed", "layers", "kv_heads", "head_dim"),
        (e, n_l, nkv, d))
    add(sa + "value.kernel", layers("self_attn.v_proj"), [stack()], ("embed", "layers", "kv_heads", "head_dim"),
        (e, n_l, nkv, d))
    add(sa + "out.kernel", layers("self_attn.o_proj"), [stack()], ("heads", "layers", "head_dim", "embed"),
        (nh, n_l, d, e))
    if has_bias:
        add(sa + "query.bias", layers("self_attn.q_bias"), rope() + qscale + [stack()], ("heads", "layers", "head_dim"),
            (nh, n_l, d))
        add(sa + "key.bias", layers("self_attn.k_bias"), rope() + [stack()], ("kv_heads", "layers", "head_dim"),
            (nkv, n_l, d))
        add(sa + "value.bias", layers("self_attn.v_bias"), [stack()], ("kv_heads", "layers", "head_dim"), (nkv, n_l, d))
    if has_qk_norm:
        add(sa + "query_norm.scale", layers("self_attn.q_norm.scale"), rope() + [stack()], ("head_dim", "layers"),
            (d, n_l))
        add(sa + "key_norm.scale", layers("self_attn.k_norm.scale"), rope() + [stack()], ("head_dim", "layers"),
            (d, n_l))
    add(lay + "mlp.wi_0.kernel", layers("mlp.gate_proj"), [stack()], ("embed", "layers", "mlp"), (e, n_l, i))
    add(lay + "mlp.wi_1.kernel", layers("mlp.up_proj"), [stack()], ("embed", "layers", "mlp"), (e, n_l, i))
    add(lay + "mlp.wo.kernel", layers("mlp.down_proj"), [stack()], ("mlp", "layers", "embed"), (i, n_l, e))
    return rules, expected


def build_plan(source: Any, target: TargetSpec, model_info: ModelInfo | None = None) -> Plan:
    """Write the translation table from ``source`` to ``target`` and validate it.

    Args:
        source: the trainer's ``nnx.State`` (or its :func:`describe_source` / a dict name -> array or
            ``ShapeDtypeStruct``; the ``"jax"`` target needs logical names, i.e. a State, unless
            ``target.shardings`` is given).
        target: the :class:`TargetSpec`.
        model_info: required for ``"hf"``, ``"vllm"`` and ``"jetstream"`` (:meth:`ModelInfo.from_config`).

    Returns:
        a validated :class:`Plan`.

    Raises:
        ValueError: missing ``model_info``; a tensor-parallel size the model does not allow (names the sizes); or
            any :func:`validate_plan` problem (e.g. the source is not a decoder state of this architecture).
    """
    src = source if _is_description(source) else describe_source(source)
    mesh, tp = target.resolve_mesh()
    if target.kind == "jax":
        rules, expected = _build_jax(src, target, mesh)
    else:
        if not isinstance(model_info, ModelInfo):
            raise ValueError(f"a {target.kind!r} plan needs model_info=ModelInfo(...); got {model_info!r}")
        if target.kind == "vllm":
            rules, expected = _build_vllm(src, target, mesh, tp, model_info)
        elif target.kind == "hf":
            rules, expected = _build_hf(src, target, mesh, model_info)
        else:
            rules, expected = _build_jetstream(src, target, mesh, model_info)
    plan = Plan(target.kind, tuple(rules), dict(expected), dict(src), target, mesh)
    validate_plan(plan)
    return plan

