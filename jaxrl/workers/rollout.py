"""The rollout role: picks the engine named by ``actor_rollout_ref.rollout.name``."""

from __future__ import annotations

ENGINES = ("jax",)
PLANNED = {"vllm": "the vLLM backend (GPU)", "jetstream": "the JetStream backend (TPU)"}


def make_rollout_engine(cfg, model_cfg, graphdef, params, tokenizer):
    """Build the rollout engine for a run.

    Args:
      cfg: the full run config; reads ``actor_rollout_ref.rollout`` and ``data.max_prompt_length``.
      model_cfg: the policy's :class:`jaxrl.models.ModelConfig`.
      graphdef, params: ``nnx.split`` of the policy (the engine starts on these weights).
      tokenizer: supplies the pad id (falls back to the model's eos).

    Raises:
      ValueError: ``rollout.name`` is not an engine this installation provides (names the valid ones).
    """
    rc = cfg.actor_rollout_ref.rollout
    if rc.name == "jax":
        from jaxrl.rollout.jax_sampler import JaxSampler

        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else model_cfg.eos_token_id[0]
        return JaxSampler(
            model_cfg, graphdef, params, pad_token_id=int(pad), eos_token_ids=tuple(model_cfg.eos_token_id),
            max_prompt_length=cfg.data.max_prompt_length, max_batch_size=rc.micro_batch_size or None,
        )
    if rc.name in PLANNED:
        raise ValueError(
            f"actor_rollout_ref.rollout.name={rc.name!r}: {PLANNED[rc.name]} is not part of this release yet; "
            f"valid here: {', '.join(ENGINES)}"
        )
    raise ValueError(f"actor_rollout_ref.rollout.name={rc.name!r} is unknown; valid: {', '.join(ENGINES)}")
