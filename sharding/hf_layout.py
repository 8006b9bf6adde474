"""The one Hugging Face name/layout table of the decoder: trainer parameter <-> checkpoint tensor.

Hugging Face checkpoints use torch layouts (``nn.Linear.weight`` is ``[out, in]``) and HF names, e.g.
``model.layers.0.self_attn.q_proj.weight`` ``[nH*D, E]``; the trainer's ``nnx.State`` uses the layouts of
``jaxrl.models.decoder`` (``q_proj [E, nH, D]``, ``o_proj [nH, D, E]``, ``gate_proj [E, I]``, ...) under dotted
names (``layers.0.self_attn.q_proj``). :func:`hf_table` lists, for one architecture, every checkpoint tensor with
its source parameter and the pure moves (transpose / reshape, :mod:`sharding.ops`) that lead from one layout to
the other in each direction. Two readers, so the mapping exists once:

* the translator's ``"hf"`` target (:func:`sharding.targets.build_plan`): ``to_hf`` steps, run under ``jax.jit``
  on the train mesh (what vLLM's weight loaders read);
* ``jaxrl.models.hf``: ``to_hf_tensors`` (export, ``to_hf`` steps on numpy) and ``from_hf_tensors`` (import,
  ``from_hf`` steps), exact inverses of each other because every step only moves elements.

Table order (the order of an exported checkpoint): ``model.embed_tokens.weight``; per layer ``input_layernorm``,
``post_attention_layernorm``, ``q_proj`` (+ bias), ``k_proj`` (+ bias), ``v_proj`` (+ bias), ``o_proj``,
``q_norm``/``k_norm`` (Qwen3), ``gate_proj``, ``up_proj``, ``down_proj``; ``model.norm.weight``; ``lm_head.weight``
(untied models only).
"""

from __future__ import annotations

from typing import NamedTuple

from sharding.plan import ModelInfo, Step, _reshape, _transpose

__all__ = ["HFTensor", "hf_table"]


class HFTensor(NamedTuple):
    """One checkpoint tensor of the table.

    Attributes:
        name: the Hugging Face name, e.g. ``"model.layers.0.self_attn.q_proj.weight"``.
        source: the trainer parameter's dotted ``nnx.State`` path, e.g. ``"layers.0.self_attn.q_proj"``.
        to_hf: steps from the trainer layout to the HF layout (empty: the same layout).
        from_hf: steps from the HF layout back to the trainer layout (the inverse of ``to_hf``).
        shape: the HF shape.
    """

    name: str
    source: str
    to_hf: tuple[Step, ...]
    from_hf: tuple[Step, ...]
    shape: tuple[int, ...]


def hf_table(info: ModelInfo, *, vocab_size: int, attention_bias: bool, qk_norm: bool,
             lm_head: bool = True) -> tuple[HFTensor, ...]:
    """Every Hugging Face checkpoint tensor of a decoder with ``info``'s sizes, in checkpoint order.

    Args:
        info: the architecture numbers (:meth:`ModelInfo.from_config`).
        vocab_size: ``V`` (rows of the embedding / LM head).
        attention_bias: q/k/v projections have biases (Qwen2).
        qk_norm: per-head q/k RMS norms (Qwen3).
        lm_head: False leaves out an untied ``lm_head.weight`` (the body of a ``*ForSequenceClassification``
            checkpoint, which has a ``score`` head instead); tied models never list it.

    Returns:
        the :class:`HFTensor` entries.
    """
    e, i, v, d = info.hidden, info.intermediate, int(vocab_size), info.head_dim
    nh, nkv = info.num_heads, info.num_kv_heads
    same: tuple[Step, ...] = ()
    t = (_transpose((1, 0)),)
    out: list[HFTensor] = []

    def add(name, source, to_hf, from_hf, shape):
        out.append(HFTensor(name, source, tuple(to_hf), tuple(from_hf), tuple(shape)))

    add("model.embed_tokens.weight", "embed_tokens", same, same, (v, e))
    for li in range(info.num_layers):
        s, p = f"layers.{li}.", f"model.layers.{li}."
        add(p + "input_layernorm.weight", s + "input_layernorm.scale", same, same, (e,))
        add(p + "post_attention_layernorm.weight", s + "post_attention_layernorm.scale", same, same, (e,))
        for name, n in (("q", nh), ("k", nkv), ("v", nkv)):
            # ours [E, n, D] <-> HF [n*D, E]
            add(p + f"self_attn.{name}_proj.weight", s + f"self_attn.{name}_proj",
                (_reshape((e, n * d)), _transpose((1, 0))), (_transpose((1, 0)), _reshape((e, n, d))), (n * d, e))
            if attention_bias:  # ours [n, D] <-> HF [n*D]
                add(p + f"self_attn.{name}_proj.bias", s + f"self_attn.{name}_bias", (_reshape((n * d,)),),
                    (_reshape((n, d)),), (n * d,))
        # ours [nH, D, E] <-> HF [E, nH*D]
        add(p + "self_attn.o_proj.weight", s + "self_attn.o_proj", (_reshape((nh * d, e)), _transpose((1, 0))),
            (_transpose((1, 0)), _reshape((nh, d, e))), (e, nh * d))
        if qk_norm:
            add(p + "self_attn.q_norm.weight", s + "self_attn.q_norm.scale", same, same, (d,))
            add(p + "self_attn.k_norm.weight", s + "self_attn.k_norm.scale", same, same, (d,))
        for name in ("gate", "up"):  # ours [E, I] <-> HF [I, E]
            add(p + f"mlp.{name}_proj.weight", s + f"mlp.{name}_proj", t, t, (i, e))
        add(p + "mlp.down_proj.weight", s + "mlp.down_proj", t, t, (e, i))  # ours [I, E] <-> HF [E, I]
    add("model.norm.weight", "norm.scale", same, same, (e,))
    if lm_head and not info.tie_word_embeddings:
        add("lm_head.weight", "lm_head", t, t, (v, e))  # ours [E, V] <-> HF [V, E]
    return tuple(out)
