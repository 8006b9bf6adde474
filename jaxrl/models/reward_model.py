"""Sequence-classification reward model: a :class:`~jaxrl.models.decoder.Decoder` body plus a linear ``score``
head read at the last non-pad token, the model of Hugging Face ``LlamaForSequenceClassification`` /
``Qwen2ForSequenceClassification`` / ``Qwen3ForSequenceClassification`` (transformers'
``GenericForSequenceClassification``), which is what verl's ``reward_model.model.path`` loads.

``logits[b] = final_norm(hidden)[b, last[b]] @ score`` with ``last[b]`` the rightmost position whose token is not
``pad_token_id`` (transformers: ``argmax(arange(T) * (input_ids != pad_token_id))``; it handles left and right
padding). Here the attention mask is also honoured (``last`` is the rightmost position that is unmasked *and* not
the pad id), so a batch whose padding slots hold some other id reads the same token as transformers reads on the
properly padded batch. Without a ``pad_token_id`` in the config the rightmost unmasked token is read (transformers
reads position -1 there and refuses batches of more than one row).

Parameters beyond the body's (see :mod:`jaxrl.models.decoder` for those; the body has no LM head)::

    score   [H, num_labels]   ("embed", None)      HF ``score.weight`` [num_labels, H] transposed, no bias
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models import parse_dtype
from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder

__all__ = ["SEQ_CLS_ARCHITECTURES", "RewardModel", "last_token_index", "load_reward_model", "reward_model_from_hf"]

#: model_type -> the transformers class whose checkpoints load here.
SEQ_CLS_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
}
SCORE_WEIGHT = "score.weight"  # the head's Hugging Face name (torch layout [num_labels, H])


def last_token_index(input_ids: jax.Array, attention_mask: jax.Array, pad_token_id: int | None) -> jax.Array:
    """Position of the token a sequence classifier reads, ``[B]`` int32.

    The rightmost position ``t`` with ``attention_mask[b, t] != 0`` and ``input_ids[b, t] != pad_token_id``
    (``pad_token_id=None``: only the mask); 0 when there is none (transformers' ``argmax`` of an all-zero row).

    Args:
      input_ids: ``[B, T]`` int token ids.
      attention_mask: ``[B, T]`` (nonzero = real token).
      pad_token_id: the classifier config's pad id, or None.
    """
    valid = attention_mask != 0
    if pad_token_id is not None:
        valid = valid & (input_ids != pad_token_id)
    positions = jnp.arange(input_ids.shape[-1], dtype=jnp.int32)
    return jnp.argmax(positions[None, :] * valid.astype(jnp.int32), axis=-1).astype(jnp.int32)


class RewardModel(nnx.Module):
    """A decoder body and a bias-free linear ``score`` head pooled at the last non-pad token.

    Args:
      backbone: the body (its ``lm_head`` must be None; build it with ``hf.from_hf_tensors(..., lm_head=False)``).
      score: ``[H, num_labels]`` head weights (stored in the body's ``param_dtype``).

    Raises:
      ValueError: the body still has an LM head, or ``score`` is not ``[H, num_labels]``.
    """

    def __init__(self, backbone: Decoder, score: jax.Array):
        if backbone.lm_head is not None:
            raise ValueError("the reward model's backbone must have no LM head (from_hf_tensors(..., lm_head=False))")
        h = backbone.cfg.hidden_size
        if score.ndim != 2 or score.shape[0] != h:
            raise ValueError(f"score head must be [hidden={h}, num_labels]; got shape {tuple(score.shape)}")
        self.cfg = backbone.cfg
        self.pad_token_id = backbone.cfg.pad_token_id
        self.num_labels = int(score.shape[1])
        self.backbone = backbone
        self.score = nnx.Param(jnp.asarray(score, backbone.param_dtype), out_sharding=("embed", None),
                               eager_sharding=False)

    def token_logits(self, input_ids, positions, attention_mask, activation_sharding=None) -> jax.Array:
        """Head logits at every position, ``[B, T, num_labels]`` float32 (transformers' ``self.score(hidden)``)."""
        hidden, _ = self.backbone(  # frozen, never differentiated: the plain layer loop (no remat scan)
            input_ids, positions, attention_mask, return_hidden=True, activation_sharding=activation_sharding,
            remat=False,
        )
        return jnp.einsum("bth,hl->btl", hidden.astype(jnp.float32), self.score[...].astype(jnp.float32))

    def __call__(self, input_ids, positions, attention_mask, activation_sharding=None) -> jax.Array:
        """Sequence logits (transformers' ``SequenceClassifierOutputWithPast.logits``).

        Args:
          input_ids: ``[B, T]`` int token ids.
          positions: ``[B, T]`` int RoPE positions (``cumsum(mask) - 1`` for left padding, as verl passes them).
          attention_mask: ``[B, T]`` key mask (nonzero = real token).
          activation_sharding: optional sharding of the body's residual stream (see ``Decoder``).

        Returns:
          ``[B, num_labels]`` float32, read at :func:`last_token_index`.
        """
        logits = self.token_logits(input_ids, positions, attention_mask, activation_sharding)
        last = last_token_index(input_ids, attention_mask, self.pad_token_id)
        return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0, :]


def _num_labels(hf_config: dict, score: np.ndarray) -> int:
    """``num_labels`` from the head's shape, checked against the config's ``id2label`` / ``num_labels``."""
    n = int(score.shape[0])
    declared = hf_config.get("num_labels")
    if declared is None and isinstance(hf_config.get("id2label"), dict):
        declared = len(hf_config["id2label"])
    if declared is not None and int(declared) != n:
        raise ValueError(f"{SCORE_WEIGHT} has {n} rows but the config declares num_labels={declared}")
    return n


def reward_model_from_hf(
    hf_config: dict, tensors: dict[str, np.ndarray], *, param_dtype="float32", dtype="float32"
) -> RewardModel:
    """A :class:`RewardModel` from a ``*ForSequenceClassification`` config and its tensors (HF names).

    The body goes through the one weight table (:func:`jaxrl.models.hf.from_hf_tensors` with ``lm_head=False``);
    ``score.weight`` ``[num_labels, H]`` becomes the head.

    Raises:
      ValueError: no ``score.weight`` (the message names the checkpoint's architectures: a causal-LM checkpoint
        is not a reward model), a wrong head shape, a ``num_labels`` mismatch, or any body tensor problem
        (missing / unexpected / wrong shape, e.g. a ``score.bias``).
    """
    from jaxrl.models.hf import from_hf_tensors

    cfg = ModelConfig.from_hf_config(hf_config)
    if SCORE_WEIGHT not in tensors:
        arch = hf_config.get("architectures")
        raise ValueError(
            f"checkpoint (architectures={arch}) has no {SCORE_WEIGHT!r}: a reward model must be a "
            f"sequence-classification checkpoint, one of {sorted(SEQ_CLS_ARCHITECTURES.values())}"
        )
    body = dict(tensors)
    score = np.asarray(body.pop(SCORE_WEIGHT))
    if score.ndim != 2 or score.shape[1] != cfg.hidden_size:
        raise ValueError(f"{SCORE_WEIGHT} must be [num_labels, hidden={cfg.hidden_size}]; got {score.shape}")
    _num_labels(hf_config, score)
    pdt, cdt = parse_dtype(param_dtype), parse_dtype(dtype)
    backbone = from_hf_tensors(cfg, body, param_dtype=pdt, dtype=cdt, lm_head=False)
    return RewardModel(backbone, jnp.asarray(np.ascontiguousarray(score.T), pdt))


def load_reward_model(path: str | os.PathLike, *, param_dtype="float32", dtype="float32") -> RewardModel:
    """Load a Hugging Face ``*ForSequenceClassification`` directory (``reward_model.model.path``).

    Args:
      path: anything :func:`jaxrl.models.resolve.resolve_model_path` accepts that resolves to a directory with
        ``config.json`` and safetensors weights.
      param_dtype, dtype: dtype names (``"float32"`` / ``"bfloat16"``).

    Raises:
      FileNotFoundError: the path does not resolve to a model directory (a ``.gguf`` / llama2.c file holds no
        classification head).
      ValueError: see :func:`reward_model_from_hf`; an unsupported ``model_type``.
    """
    from jaxrl.models.hf import load_hf_dir
    from jaxrl.models.resolve import resolve_model_path

    resolved = resolve_model_path(str(path))
    if not os.path.isdir(resolved):
        raise FileNotFoundError(
            f"reward model {str(path)!r} resolved to {resolved!r}, which is not a Hugging Face model directory; "
            f"a reward model is a safetensors directory of one of {sorted(SEQ_CLS_ARCHITECTURES.values())}"
        )
    hf_config, tensors = load_hf_dir(resolved)
    try:
        return reward_model_from_hf(hf_config, tensors, param_dtype=param_dtype, dtype=dtype)
    except ValueError as e:
        raise ValueError(f"reward model {resolved!r}: {e}") from None
