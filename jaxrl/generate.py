"""``python -m jaxrl.generate``: sample text from a model with the embedded JAX sampler.

Example (the llama2.c golden check)::

    python -m jaxrl.generate --model $JAXRL_SHARED/models/stories260K --prompt "" --greedy \\
        --max-new-tokens 255 --output-ids

Prompt handling: an empty ``--prompt`` means the BOS token alone; otherwise the tokenizer encodes
the text and adds BOS itself when its config says so (``add_bos_token``); ``--chat`` wraps the
prompt as one user turn with the tokenizer's chat template and ``add_generation_prompt=True``.

Output: by default the decoded text (prompt + continuation; with ``--chat`` the assistant reply
only), one sample per block. With ``--output-ids``, one JSON list per sample of the whole token
sequence, prompt ids (BOS included) followed by the generated ids up to but excluding the first
eos/stop token — the format of llama2.c's golden ``greedy_from_bos_256_ids.json``.

Exit status: 0 on success; 2 on a bad argument (including ``--max-new-tokens`` that, with the prompt, exceeds
the model's context ``max_position_embeddings``); 1 on a model that cannot be loaded (missing, truncated or
corrupt files). Errors are one line on stderr, prefixed ``jaxrl: error:``.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxrl.cli_common import fail

__all__ = ["build_parser", "context_error", "encode_prompt", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m jaxrl.generate", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", required=True,
        help="HF model dir, .gguf file, llama2.c .bin, alias (stories260K), or a training checkpoint folder",
    )
    p.add_argument("--prompt", required=True, help='prompt text; "" = BOS only')
    p.add_argument("--greedy", action="store_true", help="argmax decoding (ignores temperature/top-p/top-k)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature > 0 (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (default -1 = off)")
    p.add_argument("--n", type=int, default=1, help="samples to draw (default 1)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed in [0, 2**32) (default 0)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompt")
    p.add_argument("--output-ids", action="store_true", help="print token ids as JSON lists instead of text")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="parameter/compute dtype")
    return p


def encode_prompt(tokenizer, text: str, *, chat: bool, bos_token_id: int | None) -> list[int]:
    """Token ids for ``text``.

    Args:
      tokenizer: a ``transformers`` tokenizer, or None (then only an empty non-chat prompt works).
      text: the prompt; ``""`` (without ``chat``) means ``[bos_token_id]``.
      chat: wrap ``text`` as a single user message with ``apply_chat_template(...,
        add_generation_prompt=True)``.
      bos_token_id: the model's BOS id (may be None).
    Returns:
      list[int] of token ids.
    Raises:
      ValueError: empty prompt without a BOS id, text prompt without a tokenizer, or ``chat`` with
        a tokenizer that has no chat template.
    """
    if text == "" and not chat:
        if bos_token_id is None:
            raise ValueError("an empty --prompt means BOS only, but the model has no bos_token_id")
        return [int(bos_token_id)]
    if tokenizer is None:
        raise ValueError("the model has no tokenizer, so only an empty --prompt (BOS only) can be used")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat was given but the tokenizer has no chat_template")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text)["input_ids"]]


def _params_from_args(args: argparse.Namespace):
    from jaxrl.rollout.base import SamplingParams

    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        do_sample=not args.greedy,
        seed=args.seed,
    )


def context_error(prompt_len: int | None, max_new_tokens: int, limit: int | None, source: str) -> str | None:
    """Why ``prompt_len + max_new_tokens`` tokens do not fit a model with ``limit`` positions, or None if they do.

    Args:
      prompt_len: prompt tokens (BOS included); None before the prompt is encoded (then at least 1 is assumed).
      max_new_tokens: ``--max-new-tokens``.
      limit: the model's ``max_position_embeddings`` (None: unknown, no check).
      source: where the limit was read (named in the message).
    """
    need = (1 if prompt_len is None else prompt_len) + max_new_tokens
    if limit is None or need <= limit:
        return None
    where = f"the model's context of {limit} tokens (max_position_embeddings of {source})"
    if prompt_len is None:
        return (f"--max-new-tokens={max_new_tokens} plus the prompt exceed {where}; use --max-new-tokens <= "
                f"{limit - 1} minus the prompt's length")
    return (f"--max-new-tokens={max_new_tokens} + the prompt's {prompt_len} token(s) = {need} exceed {where}; "
            f"use --max-new-tokens <= {max(limit - prompt_len, 0)}")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        sampling = _params_from_args(args)
    except ValueError as e:
        return fail(str(e), 2)

    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.checkpoint import CheckpointError
    from jaxrl.export import ExportError, is_checkpoint_path, load_checkpoint_policy
    from jaxrl.models import ModelFileError, load_pretrained, read_model_config
    from jaxrl.rollout.jax_sampler import JaxSampler

    source = args.model
    try:
        if is_checkpoint_path(args.model):  # a training run's checkpoint folder (or one global_step_N)
            _, pre = load_checkpoint_policy(args.model)
        else:
            found = read_model_config(args.model, cheap_only=True)  # config only: refuse before the weights load
            if found is not None:
                source = found[1]
                why = context_error(None, args.max_new_tokens, found[0].get("max_position_embeddings"), source)
                if why:
                    return fail(why, 2)
            pre = load_pretrained(args.model, param_dtype=args.dtype, dtype=args.dtype)
    except (OSError, ModelFileError, ExportError, CheckpointError) as e:  # each names the file
        return fail(f"cannot load model {args.model!r}: {e}", 1)
    cfg, tok = pre.config, pre.tokenizer
    try:
        prompt = encode_prompt(tok, args.prompt, chat=args.chat, bos_token_id=cfg.bos_token_id)
    except ValueError as e:
        return fail(str(e), 2)
    if not prompt:
        return fail("the prompt encodes to zero tokens", 2)
    why = context_error(len(prompt), args.max_new_tokens, cfg.max_position_embeddings, source)
    if why:
        return fail(why, 2)

    eos = set(cfg.eos_token_id)
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        eos.add(int(tok.eos_token_id))
    pad = cfg.pad_token_id
    if pad is None and tok is not None:
        pad = getattr(tok, "pad_token_id", None)
    if pad is None:
        pad = min(eos) if eos else 0

    graphdef, params = nnx.split(pre.model)
    sampler = JaxSampler(
        cfg,
        graphdef,
        params,
        pad_token_id=int(pad),
        eos_token_ids=tuple(sorted(eos)),
        max_prompt_length=len(prompt),
        cache_dtype=jnp.dtype(args.dtype),
    )
    out = sampler.generate([prompt], sampling)

    stops = eos | set(sampling.stop_token_ids)
    for i, row in enumerate(out.response_token_lists()):
        if row and row[-1] in stops:
            row = row[:-1]
        if args.output_ids:
            print(json.dumps(prompt + row))
            continue
        if tok is None:
            return fail("the model has no tokenizer to decode text; use --output-ids", 2)
        if args.n > 1:
            print(f"--- sample {i} ---")
        text = tok.decode(row if args.chat else prompt + row, skip_special_tokens=True)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
