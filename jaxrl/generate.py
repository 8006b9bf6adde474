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

Exit status: 0 on success, 2 on a bad argument or a model that cannot be loaded (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["build_parser", "encode_prompt", "main"]


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


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        sampling = _params_from_args(args)
    except ValueError as e:
        return _fail(str(e))

    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.models import load_pretrained
    from jaxrl.rollout.jax_sampler import JaxSampler

    from jaxrl.export import is_checkpoint_path, load_checkpoint_policy

    try:
        if is_checkpoint_path(args.model):  # a training run's checkpoint folder (or one global_step_N)
            _, pre = load_checkpoint_policy(args.model)
        else:
            pre = load_pretrained(args.model, param_dtype=args.dtype, dtype=args.dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        return _fail(f"cannot load model {args.model!r}: {e}")
    cfg, tok = pre.config, pre.tokenizer
    try:
        prompt = encode_prompt(tok, args.prompt, chat=args.chat, bos_token_id=cfg.bos_token_id)
    except ValueError as e:
        return _fail(str(e))
    if not prompt:
        return _fail("the prompt encodes to zero tokens")

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
            return _fail("the model has no tokenizer to decode text; use --output-ids")
        if args.n > 1:
            print(f"--- sample {i} ---")
        text = tok.decode(row if args.chat else prompt + row, skip_special_tokens=True)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
