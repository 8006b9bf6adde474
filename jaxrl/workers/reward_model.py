"""Reward-model role: a frozen sequence-classification model scores whole responses (verl's
``RewardModelWorker.compute_rm_score``).

Inputs, as verl builds them:

* **Same tokens** (``reward_model.model.input_tokenizer=null``): the RM reads the policy's ids as they are,
  prompt and response side by side (``[N, P + R]``, left-padded prompt, right-padded response), positions
  ``cumsum(mask) - 1``. The RM must share the policy's tokenizer.
* **Re-tokenized** (``input_tokenizer`` set; verl's default is the policy's path): each response is decoded with
  the input (policy) tokenizer, its EOS text removed, appended to the row's raw prompt as an assistant message,
  rendered with the RM tokenizer's chat template (``add_generation_prompt=False``) and encoded without extra
  special tokens (verl's ``_switch_chat_template``); right-padded and, past ``reward_model.max_length`` (default:
  the batch's ``P + R``), truncated on the right as verl does. jaxrl extension: an RM tokenizer *without* a chat
  template reads the plain text of prompt and response (the policy's prompt + response ids decoded together,
  special tokens dropped) encoded with its default special tokens (e.g. BOS).

Scoring runs in micro-batches of ``reward_model.micro_batch_size_per_gpu`` rows per data-parallel device (verl's
meaning: on the train mesh a call takes that x its batch shards rows; the last one padded with masked rows; null =
the whole batch in one call), one jitted program per input width. On the train mesh (``mesh=``) the params
are placed by the logical-axis rules like the critic's and rows are split over the ``"batch"`` axes; scores come
back replicated. The params are never updated or donated.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.batch import RLBatch, positions_from_mask
from jaxrl.config.batch_plan import BatchPlan
from jaxrl.distributed import to_global, to_host
from jaxrl.workers.microbatch import check_row_shards, pad_rows, row_chunks
from jaxrl.workers.placement import activation_sharding, batch_shards, rows_sharding, shard_tree
from sharding import DEFAULT_RULES

__all__ = [
    "RewardModelOutput",
    "RewardModelWorker",
    "build_reward_model_worker",
    "check_same_tokenizer",
    "retokenize_for_reward_model",
]

log = logging.getLogger("jaxrl")


@dataclasses.dataclass
class RewardModelOutput:
    """Scores of one batch: ``scores`` ``[N]`` float32 (the RM's logit) and ``num_truncated`` (re-tokenized rows cut
    at ``max_length``; 0 on the same-tokens path)."""

    scores: np.ndarray
    num_truncated: int = 0


def _as_messages(prompt) -> list[dict]:
    """A raw prompt as chat messages: a string is one user message; a message list is copied."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def retokenize_for_reward_model(
    raw_prompts: list,
    batch: RLBatch,
    *,
    input_tokenizer,
    rm_tokenizer,
    max_length: int | None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """The RM's own token ids for each (prompt, response) pair (see the module docstring).

    Args:
      raw_prompts: ``N`` raw prompts (the data rows' prompt field: a string or chat messages), row ``i`` of
        ``batch``'s prompt.
      batch: the step's responses (``response_ids`` / ``response_mask`` ``[N, R]``; prompt ids for the
        no-template path).
      input_tokenizer: the tokenizer that produced ``batch``'s ids (the policy's).
      rm_tokenizer: the reward model's tokenizer (its ``pad_token_id`` pads, else 0).
      max_length: width of the result; None = ``P + R``.

    Returns:
      ``(input_ids, attention_mask, num_truncated)``: int32 ``[N, max_length]`` right-padded, and how many rows
      were longer than ``max_length`` (cut on the right).

    Raises:
      ValueError: ``len(raw_prompts) != N`` or ``max_length < 1``.
    """
    n = batch.size
    if len(raw_prompts) != n:
        raise ValueError(f"got {len(raw_prompts)} raw prompts for {n} responses")
    width = batch.prompt_width + batch.response_width if max_length is None else int(max_length)
    if width < 1:
        raise ValueError(f"reward_model.max_length must be >= 1, got {max_length}")
    responses = [row[m.astype(bool)].tolist() for row, m in zip(batch.response_ids, batch.response_mask)]
    if getattr(rm_tokenizer, "chat_template", None):
        eos = input_tokenizer.eos_token
        texts = []
        for prompt, resp in zip(raw_prompts, responses):
            answer = input_tokenizer.decode(resp)
            if eos:
                answer = answer.replace(eos, "")
            chat = _as_messages(prompt) + [{"role": "assistant", "content": answer}]
            texts.append(rm_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False))
        encoded = rm_tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        prompts = [row[m.astype(bool)].tolist() for row, m in zip(batch.prompt_ids, batch.prompt_mask)]
        texts = input_tokenizer.batch_decode([p + r for p, r in zip(prompts, responses)], skip_special_tokens=True)
        encoded = rm_tokenizer(texts, add_special_tokens=True)["input_ids"]
    pad = rm_tokenizer.pad_token_id if rm_tokenizer.pad_token_id is not None else 0
    ids = np.full((n, width), pad, np.int32)
    mask = np.zeros((n, width), np.int32)
    truncated = 0
    for i, seq in enumerate(encoded):
        truncated += len(seq) > width
        seq = seq[:width]
        ids[i, : len(seq)] = seq
        mask[i, : len(seq)] = 1
    return ids, mask, truncated


def check_same_tokenizer(rm_vocab_size: int, policy_vocab_size: int, rm_tokenizer, policy_tokenizer, path: str):
    """The same-tokens path needs the RM to read the policy's ids: an embedding that covers them and, when the RM
    directory ships a tokenizer, the same vocabulary.

    Raises:
      ValueError: naming ``reward_model.model.path`` and the way out (``reward_model.model.input_tokenizer``).
    """
    hint = ("set reward_model.model.input_tokenizer (e.g. to actor_rollout_ref.model.path) so responses are decoded "
            "and re-tokenized for the reward model")
    if rm_vocab_size < policy_vocab_size:
        raise ValueError(f"reward_model.model.path={path!r} has vocab_size={rm_vocab_size} < the policy's "
                         f"{policy_vocab_size} and reward_model.model.input_tokenizer=null: it cannot read the "
                         f"policy's token ids; {hint}")
    if rm_tokenizer is not None and rm_tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        raise ValueError(f"reward_model.model.path={path!r} has a different tokenizer than the policy and "
                         f"reward_model.model.input_tokenizer=null, so it would read ids of another vocabulary; "
                         f"{hint}")


class RewardModelWorker:
    """Frozen reward model scoring responses.

    Args:
      graphdef, params: ``nnx.split`` of a :class:`~jaxrl.models.reward_model.RewardModel` (``num_labels == 1``).
      micro_batch_size: rows per jitted call over all devices (the plan's ``reward_model_rows``:
        ``reward_model.micro_batch_size_per_gpu`` x the mesh's batch shards); None = the whole batch (rounded up to
        the mesh's batch shards).
      mesh: the train mesh, or None (one device).
      rules: logical-axis rules on ``mesh`` (default :data:`sharding.rules.DEFAULT_RULES`).
      input_tokenizer, rm_tokenizer: both set = the re-tokenized path; None = the same-tokens path.
      max_length: re-tokenized width (None = ``P + R``).

    Raises:
      ValueError: ``num_labels != 1``, ``micro_batch_size < 1``, on a mesh one that is not a multiple of the batch
        shards, or only one of the two tokenizers given.
    """

    def __init__(self, graphdef, params, *, micro_batch_size: int | None = None, mesh=None, rules=None,
                 input_tokenizer=None, rm_tokenizer=None, max_length: int | None = None):
        model = nnx.merge(graphdef, params)
        if model.num_labels != 1:
            raise ValueError(f"a reward model has one output (num_labels=1); this checkpoint has num_labels="
                         f"{model.num_labels}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"the reward model's micro-batch must be >= 1 rows, got {micro_batch_size}")
        if (input_tokenizer is None) != (rm_tokenizer is None):
            raise ValueError("re-tokenizing needs both the input (policy) tokenizer and the reward model's tokenizer")
        self.graphdef = graphdef
        self.micro_batch_size = micro_batch_size
        self.input_tokenizer, self.rm_tokenizer, self.max_length = input_tokenizer, rm_tokenizer, max_length
        self.mesh = mesh
        self.rules = DEFAULT_RULES if rules is None else rules
        self.activation_sharding = activation_sharding(mesh, self.rules)
        self.row_shards = 1
        self._rows = None  # on a mesh: the rows' sharding
        if mesh is None:
            self.params = params
            self._fn = jax.jit(self._scores)
        else:
            self.row_shards = batch_shards(mesh, self.rules)
            if micro_batch_size is not None:
                check_row_shards(micro_batch_size, self.row_shards, "the reward model's micro-batch")
            self.params, shardings = shard_tree(params, mesh, self.rules)
            rows = self._rows = rows_sharding(mesh, self.rules)
            self._fn = jax.jit(self._scores, in_shardings=(shardings, rows, rows, rows),
                               out_shardings=NamedSharding(mesh, PartitionSpec()))

    @property
    def retokenizes(self) -> bool:
        """True when responses are decoded and re-tokenized for the RM (``input_tokenizer`` set)."""
        return self.rm_tokenizer is not None

    def _scores(self, params, input_ids, positions, attention_mask):
        model = nnx.merge(self.graphdef, params)
        return model(input_ids, positions, attention_mask, activation_sharding=self.activation_sharding)[:, 0]

    def compute_scores(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """RM scores of ``N`` sequences.

        Args:
          input_ids, attention_mask: int ``[N, T]`` (any padding side; positions are ``cumsum(mask) - 1``).

        Returns:
          float32 ``[N]``: the logit at each row's last non-pad token.
        """
        n = input_ids.shape[0]
        mb = self.micro_batch_size or max(1, math.ceil(n / self.row_shards) * self.row_shards)
        ids = np.asarray(input_ids, np.int32)
        mask = np.asarray(attention_mask, np.int32)
        pos = positions_from_mask(mask)
        out = []
        for sl, k in row_chunks(n, mb):
            rows = (pad_rows(ids[sl], mb), pad_rows(pos[sl], mb), pad_rows(mask[sl], mb))
            if self._rows is not None:  # on the mesh: host rows -> global arrays (every process holds the same)
                rows = to_global(rows, self._rows)
            s = self._fn(self.params, *rows)
            out.append(to_host(s).astype(np.float32)[:k])
        return np.concatenate(out) if out else np.zeros((0,), np.float32)

    def score(self, batch: RLBatch, raw_prompts: list | None = None) -> RewardModelOutput:
        """Score each response of ``batch`` (its prompt included).

        Args:
          batch: the step's ids and masks.
          raw_prompts: ``N`` raw prompts (row ``i`` = response ``i``'s prompt), needed on the re-tokenized path.

        Raises:
          ValueError: re-tokenizing without ``raw_prompts`` (or a count mismatch).
        """
        if not self.retokenizes:
            return RewardModelOutput(self.compute_scores(batch.input_ids(), batch.attention_mask()))
        if raw_prompts is None:
            raise ValueError("the reward model re-tokenizes (reward_model.model.input_tokenizer is set) and needs "
                             "each response's raw prompt")
        ids, mask, truncated = retokenize_for_reward_model(
            raw_prompts, batch, input_tokenizer=self.input_tokenizer, rm_tokenizer=self.rm_tokenizer,
            max_length=self.max_length,
        )
        return RewardModelOutput(self.compute_scores(ids, mask), truncated)


def build_reward_model_worker(cfg, policy_cfg, tokenizer, *, mesh=None, rules=None) -> RewardModelWorker:
    """The run's reward model from ``reward_model.*``: the frozen ``model.path`` classifier in the policy's dtypes
    (``actor_rollout_ref.model.{param_dtype,dtype}``), reading the policy's ids (``model.input_tokenizer=null``) or
    re-tokenized text (decoded with ``tokenizer`` when ``input_tokenizer`` is the policy's path, else with the
    tokenizer at that path).

    Args:
      cfg: the run config; policy_cfg: the policy's :class:`~jaxrl.models.ModelConfig`; tokenizer: the policy's.
      mesh, rules: the train mesh and its rules, or None (one device); ``reward_model.micro_batch_size_per_gpu``
        is per device, so a call takes it x the mesh's batch shards rows.

    Raises:
      FileNotFoundError: no checkpoint at the path, or no tokenizer beside it when it must re-tokenize.
      jaxrl.config.loader.ConfigError: not a sequence-classification checkpoint, ``num_labels != 1``, or ids it
        cannot read (see :func:`check_same_tokenizer`); ``python -m jaxrl.train`` exits 2 with it.
    """
    from jaxrl.models.reward_model import load_reward_model
    from jaxrl.models.resolve import resolve_model_path
    from jaxrl.models.tokenizer import load_tokenizer

    from jaxrl.config.loader import ConfigError

    rc, model_cfg = cfg.reward_model, cfg.actor_rollout_ref.model
    path = resolve_model_path(rc.model.path)
    try:
        model = load_reward_model(path, param_dtype=model_cfg.param_dtype, dtype=model_cfg.dtype)
    except ValueError as e:  # a checkpoint that is no reward model: the setting is wrong
        raise ConfigError(f"reward_model.model.path={rc.model.path!r}: {e}") from None
    if model.num_labels != 1:
        raise ConfigError(f"reward_model.model.path={rc.model.path!r} has num_labels={model.num_labels}; a reward "
                          "model has one output (num_labels=1)")
    try:
        rm_tokenizer = load_tokenizer(path)
    except FileNotFoundError:
        rm_tokenizer = None
    inputs: dict = {}
    if rc.model.input_tokenizer is None:
        try:
            check_same_tokenizer(model.cfg.vocab_size, policy_cfg.vocab_size, rm_tokenizer, tokenizer,
                                 rc.model.path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        if rm_tokenizer is None:
            raise FileNotFoundError(
                f"reward_model.model.path={rc.model.path!r} has no tokenizer, which re-tokenizing responses needs "
                f"(reward_model.model.input_tokenizer={rc.model.input_tokenizer!r}); add the reward model's "
                "tokenizer files, or set reward_model.model.input_tokenizer=null to read the policy's token ids"
            )
        same = rc.model.input_tokenizer == model_cfg.path
        input_tokenizer = tokenizer if same else load_tokenizer(resolve_model_path(rc.model.input_tokenizer))
        inputs = dict(input_tokenizer=input_tokenizer, rm_tokenizer=rm_tokenizer, max_length=rc.max_length)
    graphdef, params = nnx.split(model)
    shards = 1 if mesh is None else batch_shards(mesh, DEFAULT_RULES if rules is None else rules)
    rows = BatchPlan.from_config(cfg, batch_shards=shards).reward_model_rows  # per device x shards, as verl means it
    worker = RewardModelWorker(graphdef, params, micro_batch_size=rows, mesh=mesh, rules=rules, **inputs)
    log.info("reward model %s (%s, %d layers): %s inputs, combined with the rule reward by %r", path,
             model.cfg.model_type, model.cfg.num_hidden_layers, "re-tokenized" if inputs else "policy-token",
             rc.combine)
    return worker
