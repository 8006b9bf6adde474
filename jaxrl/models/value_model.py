"""The PPO value model: a :class:`~jaxrl.models.decoder.Decoder` backbone plus a scalar value head.

``values = final_norm(hidden) @ value_head + value_bias`` per position, the same shape of model as verl's
critic (``AutoModelForTokenClassification`` with ``num_labels=1``: the LM head replaced by a
``hidden -> 1`` linear layer) and OpenRLHF's ``CriticModel``.

Parameters beyond the backbone's (see :mod:`jaxrl.models.decoder` for those)::

    value_head   [H, 1]   ("embed", None)
    value_bias   [1]      (None,)

The backbone's LM head is dropped (set to ``None``): it is never used for values, and keeping it would
hold a ``[H, V]`` matrix and its optimizer state for nothing. With tied embeddings there is none anyway.

Head initialisation (``head_init``): ``"normal"`` draws ``value_head ~ N(0, std^2)`` with
``std = 1 / (H + 1)`` (OpenRLHF ``CriticModel`` value-head init), so initial values are close to 0
but the backbone receives gradient from the first update; ``"zeros"`` starts at exactly 0 (the backbone
then gets no gradient until the head has moved). ``value_bias`` starts at 0 in both cases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import Pretrained, load_pretrained, parse_dtype
from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder

HEAD_INITS: tuple[str, ...] = ("normal", "zeros")


def _head_value(key: jax.Array | None, hidden: int, param_dtype, head_init: str) -> jax.Array:
    """Initial ``value_head`` ``[H, 1]`` in ``param_dtype`` (see the module docstring)."""
    if head_init not in HEAD_INITS:
        raise ValueError(f"head_init={head_init!r}; valid: {list(HEAD_INITS)}")
    if head_init == "zeros":
        return jnp.zeros((hidden, 1), param_dtype)
    std = 1.0 / (hidden + 1)
    return (jax.random.normal(key, (hidden, 1), jnp.float32) * std).astype(param_dtype)


class ValueModel(nnx.Module):
    """Per-token state values ``V(s_t)`` from a decoder backbone.

    Args:
      cfg: backbone architecture.
      rngs: initialisation streams (``rngs.params`` for the backbone and the value head).
      param_dtype: parameter storage dtype (a ``jnp`` dtype or a name accepted by ``parse_dtype``).
      dtype: compute dtype of the backbone; the head is always applied in float32.
      remat: rematerialise each backbone block in the backward pass (``jax.checkpoint``): False, True / ``"full"``
        or ``"selective"`` (:data:`jaxrl.models.decoder.REMAT_POLICIES`).
      head_init: ``"normal"`` (std ``1/(H+1)``) or ``"zeros"``.

    Raises:
      TypeError: ``cfg`` is not a :class:`ModelConfig`.
      ValueError: unknown ``head_init`` or dtype name.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        dtype=jnp.float32,
        remat: bool | str = False,
        head_init: str = "normal",
    ):
        pdt, cdt = parse_dtype(param_dtype), parse_dtype(dtype)
        head = _head_value(None if head_init == "zeros" else rngs.params(), cfg.hidden_size, pdt, head_init)
        self.cfg = cfg
        self.backbone = Decoder(cfg, rngs=rngs, param_dtype=pdt, dtype=cdt, remat=remat)
        self.backbone.lm_head = None  # values never use the LM head
        self.value_head = nnx.Param(head, out_sharding=("embed", None), eager_sharding=False)
        self.value_bias = nnx.Param(jnp.zeros((1,), pdt), out_sharding=(None,), eager_sharding=False)

    def __call__(
        self, input_ids: jax.Array, positions: jax.Array, attention_mask: jax.Array, activation_sharding=None,
        segment_ids: jax.Array | None = None, remat: bool | None = None, segment_cols: jax.Array | None = None,
    ) -> jax.Array:
        """Values at every position.

        Args:
          input_ids: ``[B, T]`` int token ids.
          positions: ``[B, T]`` int RoPE positions.
          attention_mask: ``[B, T]`` key mask (nonzero = real token); causal masking is added inside.
          activation_sharding: optional sharding of the backbone's residual stream (see ``Decoder``).
          segment_ids: optional ``[B, T]`` int: packed rows, attention kept inside each segment (see ``Decoder``).
          remat: the backbone's ``remat=`` (None = its setting; False for a forward never differentiated).
          segment_cols: optional ``[B, S, L]`` int32 with ``segment_ids``: attention per segment (see ``Decoder``).

        Returns:
          ``[B, T]`` float32: ``V`` at position ``t`` is the value of the state after reading tokens
          ``0..t`` (i.e. before emitting token ``t + 1``).
        """
        hidden, _ = self.backbone(
            input_ids, positions, attention_mask, return_hidden=True, activation_sharding=activation_sharding,
            segment_ids=segment_ids, remat=remat, segment_cols=segment_cols,
        )
        head = self.value_head[...].astype(jnp.float32)
        values = jnp.einsum("bth,ho->bto", hidden.astype(jnp.float32), head)[..., 0]
        return values + self.value_bias[...].astype(jnp.float32)[0]

    @classmethod
    def from_pretrained(
        cls,
        pretrained: Pretrained,
        *,
        param_dtype=None,
        dtype=None,
        remat: bool | str | None = None,
        seed: int = 0,
        head_init: str = "normal",
    ) -> "ValueModel":
        """A value model whose backbone is a copy of ``pretrained.model``'s weights (LM head dropped).

        The copy owns new buffers, so donating the policy's params in a jitted update never invalidates
        the critic's (and vice versa). Only the value head is freshly initialised (from ``seed``).

        Args:
          pretrained: the loaded policy (or any decoder checkpoint).
          param_dtype, dtype, remat: for the value model; ``None`` = the same as ``pretrained.model``.
          seed: PRNG seed of the value-head initialisation.
          head_init: ``"normal"`` or ``"zeros"`` (see the module docstring).

        Raises:
          ValueError: unknown ``head_init`` or dtype name.
        """
        src: Decoder = pretrained.model
        pdt = src.param_dtype if param_dtype is None else parse_dtype(param_dtype)
        cdt = src.dtype if dtype is None else parse_dtype(dtype)
        rm = (src.remat_policy if src.remat else False) if remat is None else remat
        if head_init not in HEAD_INITS:
            raise ValueError(f"head_init={head_init!r}; valid: {list(HEAD_INITS)}")
        # Skeleton without computing a random backbone, then fill it.
        model = nnx.eval_shape(
            lambda: cls(pretrained.config, rngs=nnx.Rngs(seed), param_dtype=pdt, dtype=cdt, remat=rm,
                        head_init=head_init)
        )
        weights = nnx.to_pure_dict(nnx.state(src, nnx.Param))
        weights.pop("lm_head", None)
        weights = jax.tree.map(lambda x: jnp.array(x, dtype=pdt, copy=True), weights)
        target = nnx.state(model.backbone, nnx.Param)
        nnx.replace_by_pure_dict(target, weights)
        nnx.update(model.backbone, target)
        model.value_head.set_value(
            _head_value(jax.random.key(seed), pretrained.config.hidden_size, pdt, head_init)
        )
        model.value_bias.set_value(jnp.zeros((1,), pdt))
        return model


def build_value_model(
    path: str | None,
    policy: Pretrained,
    *,
    param_dtype="float32",
    dtype="float32",
    remat: bool | str = False,
    seed: int = 0,
    head_init: str = "normal",
) -> ValueModel:
    """The critic's value model from ``critic.model.path`` (verl: ``critic.model.path``).

    Args:
      path: ``None`` = initialise the backbone from the policy checkpoint (``policy``); otherwise any
        model spec :func:`~jaxrl.models.load_pretrained` accepts (HF dir, ``.gguf``, llama2.c ``.bin``,
        alias); its LM head is dropped and a value head added.
      policy: the loaded policy; its vocabulary is what the critic will read.
      param_dtype, dtype: dtype names (``"float32"``/``"bfloat16"`` ...).
      remat: gradient checkpointing of the backbone blocks (``critic.model.enable_gradient_checkpointing``, with
        ``critic.model.recompute_granularity`` as the policy name when on).
      seed: value-head initialisation seed.
      head_init: ``"normal"`` or ``"zeros"``.

    Returns:
      A :class:`ValueModel` with its own parameter buffers.

    Raises:
      ValueError: the critic checkpoint's vocabulary is smaller than the policy's (it could not embed every
        token the policy samples), bad dtype name or ``head_init``.
      FileNotFoundError: ``path`` does not resolve to a checkpoint.
    """
    if path is None:
        return ValueModel.from_pretrained(
            policy, param_dtype=param_dtype, dtype=dtype, remat=remat, seed=seed, head_init=head_init
        )
    pre = load_pretrained(path, param_dtype=param_dtype, dtype=dtype, remat=remat, load_tokenizer=False)
    if pre.config.vocab_size < policy.config.vocab_size:
        raise ValueError(
            f"critic.model.path={path!r} has vocab_size={pre.config.vocab_size} < the policy's "
            f"{policy.config.vocab_size}: it cannot read every token the policy generates; use a checkpoint "
            "with the policy's tokenizer, or critic.model.path=null to start from the policy"
        )
    return ValueModel.from_pretrained(pre, seed=seed, head_init=head_init)
