"""Actor and reference roles: log-prob recompute and the PPO/GRPO policy update.

Both roles hold the decoder functionally (``graphdef`` + ``params`` from ``nnx.split``) so every phase is a
pure jitted function of arrays. Rows are processed in fixed-size micro-batches (the last one padded with
fully masked rows), so XLA compiles one program per phase regardless of the batch size; with
``model.use_remove_padding`` on packed rows and with ``*_use_dynamic_bsz`` in token-budget micro-batches
(:mod:`jaxrl.workers.seqlen`, :mod:`jaxrl.workers.packing`), one program per bucketed shape.

The update is verl's ``DataParallelPPOActor.update_policy`` re-expressed in JAX; the epochs x shuffled
mini-batches loop, the optimizer, the mesh placement and the metric averaging are the trained-role base's
(:class:`jaxrl.workers.trained_role.TrainedRole`); this module holds the policy loss of one micro-batch
(the registered policy loss + KL loss - entropy bonus) and the log-prob forward.

On a device mesh (``mesh=...``, see :mod:`jaxrl.workers.placement`) the log-prob forward has explicit
``in_shardings`` / ``out_shardings`` (params by the rules, batch rows over the ``"batch"`` rule's axes,
``data x fsdp``; log-probs replicated), and each micro-batch's rows are split over those axes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.algorithms import agg_loss, entropy_from_logits, head_log_probs, kl_penalty, log_probs_from_logits
from jaxrl.algorithms.policy_loss import tis_weights
from jaxrl.algorithms.registry import POLICY_LOSSES
from jaxrl.batch import RLBatch
from jaxrl.config.batch_plan import RolePlan
from jaxrl.distributed import to_host
from jaxrl.workers.microbatch import check_row_shards, pad_rows, row_chunks
from jaxrl.workers.packing import (PACKED_KEYS, at_scores, micro_layout, prompt_sharing, real_lengths, scatter_rows,
                                   to_slots)
from jaxrl.workers.seqlen import plan_slots
from jaxrl.workers.placement import activation_sharding, batch_shards, jit_sharded, rows_sharding
from jaxrl.workers.trained_role import TrainedRole
from sharding import DEFAULT_RULES, param_shardings, shard_state


def _response_hidden(graphdef, params, input_ids, positions, attention_mask, prompt_width, activation_sharding=None,
                     remat=None):
    """``(model, hidden)``: the merged decoder and its final-normed hidden states ``[B, R, H]`` at the positions
    that score the ``R`` response tokens (arguments as :func:`_forward_response`)."""
    model = nnx.merge(graphdef, params)
    hidden, _ = model(input_ids, positions, attention_mask, return_hidden=True, activation_sharding=activation_sharding,
                      remat=remat)
    r = input_ids.shape[1] - prompt_width
    # The LM head only on the R scoring positions: no [B, P, V] prompt-position logits (their matmul and its
    # backward would be wasted work, a large share of a small model's FLOPs with a 50-150k vocabulary).
    return model, jax.lax.dynamic_slice_in_dim(hidden, prompt_width - 1, r, axis=1)


def _forward_response(
    graphdef, params, input_ids, positions, attention_mask, prompt_width, temperature, activation_sharding=None,
    remat=None,
):
    """Logits of the response positions.

    Args:
      input_ids, positions, attention_mask: ``[B, P + R]`` int32.
      prompt_width: ``P`` (static). Logits at position ``t`` predict token ``t + 1``, so the response token
        ``j`` (at ``P + j``) is scored by the logits at ``P + j - 1``.
      temperature: logits are divided by it (as verl does) so log-probs match the sampling distribution.
      activation_sharding: on a mesh, the residual stream's sharding at block boundaries (rows over the batch
        axes; see :func:`activation_sharding`), else None.
      remat: the decoder's ``remat=`` (None = the model's setting; False for a forward never differentiated).

    Returns:
      float32 logits ``[B, R, V]`` (callers that need only log-probs and entropies use
      :func:`response_log_probs`, which never holds them all).
    """
    model, hidden = _response_hidden(graphdef, params, input_ids, positions, attention_mask, prompt_width,
                                     activation_sharding, remat)
    return model.logits(hidden) / temperature


forward_response = _forward_response  # public name: the offline roles (jaxrl.workers.sft / preference) use it too


def response_log_probs(graphdef, params, input_ids, positions, attention_mask, response_ids, prompt_width,
                       temperature, activation_sharding=None, remat=None, with_entropy=False):
    """Log-probs (and entropies) of the response tokens ``response_ids`` ``[B, R]``: :func:`_forward_response`'s
    logits put through :func:`~jaxrl.algorithms.logprob.head_log_probs`, so the LM head and the log-softmax run in
    position chunks and the whole ``[B, R, V]`` logits are never held (the same values).

    Returns:
      ``(log_probs, entropy)`` float32 ``[B, R]`` (``entropy`` None unless ``with_entropy``).
    """
    model, hidden = _response_hidden(graphdef, params, input_ids, positions, attention_mask, prompt_width,
                                     activation_sharding, remat)
    return head_log_probs(hidden, response_ids, lambda h: model.logits(h) / temperature, with_entropy=with_entropy)


def _packed_hidden(graphdef, params, micro, activation_sharding=None, remat=None):
    """``(model, hidden)``: the merged decoder and the hidden states ``[G, K, H]`` at packed rows' scoring columns
    (arguments as :func:`_forward_packed`)."""
    model = nnx.merge(graphdef, params)
    seg = micro["segment_ids"]
    hidden, _ = model(micro["input_ids"], micro["positions"], seg != 0, return_hidden=True,
                      activation_sharding=activation_sharding, segment_ids=seg, remat=remat,
                      segment_cols=micro.get("segment_cols"))
    # the LM head only on the K scoring columns (real response tokens), as the padded path takes only R columns
    return model, at_scores(hidden, micro["score_cols"])


def _forward_packed(graphdef, params, micro, temperature, activation_sharding=None, remat=None):
    """Logits at the scoring columns of packed rows (:func:`jaxrl.workers.packing.packed_micro`).

    Args:
      micro: ``input_ids`` / ``positions`` / ``segment_ids`` ``[G, T]``, ``segment_cols`` ``[G, S, L]`` and
        ``score_cols`` ``[G, K]`` int32.
      temperature: logits are divided by it.
      remat: the decoder's ``remat=`` (None = the model's setting; False for a forward never differentiated).

    Returns:
      float32 logits ``[G, K, V]``: row ``g``'s ``k``-th entry predicts the response token at ``score_cols + 1``.
    """
    model, hidden = _packed_hidden(graphdef, params, micro, activation_sharding, remat)
    return model.logits(hidden) / temperature


def _packed_log_probs(graphdef, params, micro, temperature, activation_sharding=None, remat=None, with_entropy=False):
    """Log-probs (and entropies) ``[G, K]`` of ``micro["score_ids"]`` at packed rows' scoring columns, through
    :func:`~jaxrl.algorithms.logprob.head_log_probs` (:func:`_forward_packed`'s values, in position chunks)."""
    model, hidden = _packed_hidden(graphdef, params, micro, activation_sharding, remat)
    return head_log_probs(hidden, micro["score_ids"], lambda h: model.logits(h) / temperature,
                          with_entropy=with_entropy)


class LogProbComputer:
    """Per-token log-probs (and entropies) of responses under a fixed set of params.

    Args:
      graphdef: the decoder's ``nnx.GraphDef``.
      micro_batch_size: rows per jitted call over all devices (the plan's ``forward_rows`` /
        ``ref_log_prob_rows``: ``log_prob_micro_batch_size_per_gpu`` x the mesh's batch shards); on a mesh they
        are split over its batch axes.
      temperature: rollout temperature (logits are divided by it).
      mesh: the train mesh, or None (single device: the params' own placement decides).
      rules: logical-axis rules on ``mesh`` (default :data:`sharding.rules.DEFAULT_RULES`).
      remove_padding: run on packed rows (``model.use_remove_padding``; :mod:`jaxrl.workers.packing`).
      share_prompts: packed rows lay each distinct prompt once for all its responses (``actor.use_prefix_grouper``;
        implies ``remove_padding``).
      max_token_len: a token budget, real tokens per data-parallel device per call (``log_prob_use_dynamic_bsz``:
        ``log_prob_max_token_len_per_gpu``), replacing ``micro_batch_size``; None = fixed row counts.
      max_token_key: the budget's config key (messages).

    Raises:
      ValueError: ``micro_batch_size <= 0``, or on a mesh not a multiple of its batch shards.
    """

    def __init__(self, graphdef, *, micro_batch_size: int, temperature: float, mesh=None, rules=None,
                 remove_padding: bool = False, share_prompts: bool = False, max_token_len: int | None = None,
                 max_token_key: str = ""):
        if micro_batch_size <= 0:
            raise ValueError(f"log-prob micro batch size must be > 0, got {micro_batch_size}")
        self.graphdef = graphdef
        self.micro_batch_size = micro_batch_size
        self.temperature = float(temperature)
        self.mesh = mesh
        self.rules = DEFAULT_RULES if rules is None else rules
        self.activation_sharding = activation_sharding(mesh, self.rules)
        self.remove_padding = bool(remove_padding or share_prompts)
        self.share_prompts = bool(share_prompts)
        self.max_token_len = max_token_len
        self.max_token_key = max_token_key or "log_prob_max_token_len_per_gpu"
        self.shards = 1 if mesh is None else batch_shards(mesh, self.rules)
        if mesh is None:
            # one module-level jitted program per (graphdef, temperature, layout): the actor's old-log-prob pass
            # and the reference's share its compiled executables (same model, same shapes) instead of compiling twice
            program = _packed_log_probs_program if self.remove_padding else _log_probs_program
            self._fn = functools.partial(program, self.graphdef, temperature=self.temperature)
        else:
            if max_token_len is None and not self.remove_padding:
                check_row_shards(micro_batch_size, self.shards, "the log-prob micro-batch")
            self._fn = None  # built for the params' tree on the first call (explicit shardings need it)
            self._fn_tree = None

    @property
    def slotted(self) -> bool:
        """Calls are planned as slots (packed rows or a token budget) rather than fixed row chunks."""
        return self.remove_padding or self.max_token_len is not None

    def _jitted(self, params):
        """The jitted log-prob program; on a mesh with explicit shardings for ``params``' tree."""
        if self.mesh is None:
            return self._fn
        tree = jax.tree.structure(params)
        if self._fn is None or tree != self._fn_tree:
            rows = rows_sharding(self.mesh, self.rules)
            replicated = NamedSharding(self.mesh, PartitionSpec())
            shardings = param_shardings(params, self.mesh, self.rules)
            if self.remove_padding:
                self._fn = jit_sharded(
                    self._log_probs_packed, static_kwarg="prompt_width", in_shardings=(shardings, rows),
                    out_shardings=(replicated, replicated),
                )
            else:
                self._fn = jit_sharded(
                    self._log_probs, static_kwarg="prompt_width",
                    in_shardings=(shardings, rows, rows, rows, rows),
                    out_shardings=(replicated, replicated),
                )
            self._fn_tree = tree
        return self._fn

    def _log_probs(self, params, input_ids, positions, attention_mask, response_ids, *, prompt_width):
        return response_log_probs(self.graphdef, params, input_ids, positions, attention_mask, response_ids,
                                  prompt_width, self.temperature, self.activation_sharding, remat=False,
                                  with_entropy=True)

    def _log_probs_packed(self, params, micro, *, prompt_width=0):
        lp, ent = _packed_log_probs(self.graphdef, params, micro, self.temperature, self.activation_sharding,
                                    remat=False, with_entropy=True)
        mask = micro["response_mask"]
        return to_slots(lp, micro["slot_index"], mask), to_slots(ent, micro["slot_index"], mask)

    def __call__(self, params, batch: RLBatch) -> tuple[np.ndarray, np.ndarray]:
        """Returns ``(log_probs, entropy)``, float32 ``[N, R]`` each, zeroed where ``response_mask`` is 0."""
        if self.slotted:
            return self._call_slotted(params, batch)
        ids, pos, mask = batch.input_ids(), batch.positions(), batch.attention_mask()
        mb = self.micro_batch_size
        fn = self._jitted(params)
        outs_lp, outs_ent = [], []
        for sl, n in row_chunks(batch.size, mb):
            lp, ent = fn(
                params,
                pad_rows(ids[sl], mb),
                pad_rows(pos[sl], mb),
                pad_rows(mask[sl], mb),
                pad_rows(batch.response_ids[sl], mb),
                prompt_width=batch.prompt_width,
            )
            lp, ent = to_host((lp, ent))
            outs_lp.append(lp[:n])
            outs_ent.append(ent[:n])
        rmask = batch.response_mask.astype(np.float32)
        return np.concatenate(outs_lp) * rmask, np.concatenate(outs_ent) * rmask

    def _call_slotted(self, params, batch: RLBatch) -> tuple[np.ndarray, np.ndarray]:
        """Packed rows and / or token-budget calls: slots planned over the whole batch, results put back in order."""
        arrays = batch.sequence_arrays()
        rows = np.arange(batch.size)
        slot_list = plan_slots(rows, real_lengths(arrays["attention_mask"]), shards=self.shards,
                               micro_rows=self.micro_batch_size, budget=self.max_token_len,
                               packed=self.remove_padding, key=self.max_token_key,
                               **prompt_sharing(arrays, batch.prompt_width, self.share_prompts))
        fn = self._jitted(params)
        outs_lp, outs_ent = [], []
        for slots in slot_list:
            micro = micro_layout(arrays, slots, batch.prompt_width, packed=self.remove_padding,
                                 max_row_tokens=self.max_token_len, share_prompts=self.share_prompts)
            if self.remove_padding:
                packed = {k: micro[k] for k in PACKED_KEYS + ("response_mask",)}
                lp, ent = fn(params, packed, prompt_width=0)
            else:
                lp, ent = fn(params, micro["input_ids"], micro["positions"], micro["attention_mask"],
                             micro["response_ids"], prompt_width=batch.prompt_width)
            lp, ent = to_host((lp, ent))
            outs_lp.append(np.asarray(lp))
            outs_ent.append(np.asarray(ent))
        rmask = batch.response_mask.astype(np.float32)
        lp = scatter_rows(outs_lp, slot_list, batch.size)
        ent = scatter_rows(outs_ent, slot_list, batch.size)
        return lp * rmask, ent * rmask


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "prompt_width"))
def _log_probs_program(graphdef, params, input_ids, positions, attention_mask, response_ids, *, temperature,
                       prompt_width):
    """Log-probs and entropies ``[B, R]`` of padded rows on one device (:class:`LogProbComputer` without a mesh)."""
    return response_log_probs(graphdef, params, input_ids, positions, attention_mask, response_ids, prompt_width,
                              temperature, remat=False, with_entropy=True)


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "prompt_width"))
def _packed_log_probs_program(graphdef, params, micro, *, temperature, prompt_width=0):
    """Log-probs and entropies ``[G x S, R]`` of packed rows on one device (:class:`LogProbComputer` without a
    mesh)."""
    lp, ent = _packed_log_probs(graphdef, params, micro, temperature, remat=False, with_entropy=True)
    mask = micro["response_mask"]
    return to_slots(lp, micro["slot_index"], mask), to_slots(ent, micro["slot_index"], mask)


class ActorWorker(TrainedRole):
    """The trainable policy.

    Args:
      graphdef, params: ``nnx.split`` of the decoder.
      actor_cfg: the ``actor_rollout_ref.actor`` config section (:class:`jaxrl.config.schema.ActorConfig`): the loss
        keys (clip ratios, ``loss_agg_mode``, ``policy_loss``, KL loss, entropy bonus, TIS cap), ``optim``,
        ``grad_clip``, ``shuffle``, ``recompute_old_log_prob``.
      plan: the actor's batch sizes (``BatchPlan.from_config(cfg, batch_shards=...).actor`` for the mesh's batch
        shards; its ``forward_rows`` are the log-prob micro-batch over all devices).
      temperature: rollout temperature used to scale logits.
      total_training_steps: RL steps in the run (learning-rate schedule).
      seed: for mini-batch shuffling when ``actor.shuffle`` is true.
      ref_params: the frozen reference policy; required for ``kl_loss_type="full"`` (the exact KL needs the
        reference's whole distribution inside the loss), unused otherwise.
      mesh: the train mesh (:class:`jax.sharding.Mesh` with the rules' axes), or None for one device. With a mesh,
        ``params`` (and ``ref_params``) are placed by the rules, the optimizer state too, and every micro-batch is
        split over the batch axes.
      rules: logical-axis rules on ``mesh`` (default :data:`sharding.rules.DEFAULT_RULES`).
      frozen, lora: LoRA (:mod:`jaxrl.models.lora`): ``params`` are the adapters (the only trained and checkpointed
        arrays), ``frozen`` the base weights, ``lora`` the :class:`~jaxrl.models.lora.LoraInfo` (``graphdef`` is the
        model with adapters, ``lora.base_graphdef`` without). The reference policy is then the base with the
        adapters off: ``frozen`` under ``lora.base_graphdef`` (``ref_params`` unused, no second copy), and
        :meth:`merged_params` gives the rollout engine and the export ``W + (alpha / r) A B``. Both None: full
        fine-tuning.
      fused_lm_head: the update's LM head and log-softmax run in position chunks, rematerialised
        (``actor_rollout_ref.model.use_fused_kernels``; :func:`~jaxrl.algorithms.logprob.head_log_probs`): the
        ``[B, R, V]`` logits and their gradient are never held whole (0.24 GB less on SmolLM2, micro-batches of 8
        x 128 response tokens) for one more LM-head matmul in the backward (5% of the update there). The same
        values and gradient. Not with ``kl_loss_type="full"``, whose loss needs the whole distribution. The
        no-grad log-prob passes always run in chunks (no extra work).

    Raises:
      ValueError: ``kl_loss_type="full"`` without ``ref_params`` (full fine-tuning); only one of ``frozen`` /
        ``lora``; an unknown ``policy_loss.loss_mode``; sizes that do not fit (see
        :class:`~jaxrl.workers.trained_role.TrainedRole`).
    """

    name = "actor"

    def __init__(
        self,
        graphdef,
        params,
        actor_cfg,
        *,
        plan: RolePlan,
        temperature: float,
        total_training_steps: int,
        seed: int = 0,
        ref_params=None,
        mesh=None,
        rules=None,
        frozen=None,
        lora=None,
        fused_lm_head: bool = False,
    ):
        if (frozen is None) != (lora is None):
            raise ValueError("LoRA needs both frozen= (the base weights) and lora= (jaxrl.models.lora.LoraInfo)")
        full_kl = actor_cfg.use_kl_loss and actor_cfg.kl_loss_type == "full"
        if full_kl and ref_params is None and lora is None:
            raise ValueError("actor.kl_loss_type='full' needs the reference params (ref_params=...)")
        super().__init__(graphdef, params, plan=plan, optim=actor_cfg.optim, grad_clip=actor_cfg.grad_clip,
                         shuffle=actor_cfg.shuffle, total_training_steps=total_training_steps, seed=seed, mesh=mesh,
                         rules=rules, frozen=frozen)
        self.cfg = actor_cfg
        self.lora = lora
        self.fused_lm_head = bool(fused_lm_head)
        if lora is not None:  # the model without adapters (the reference's graph; the merged weights' tree)
            self.base_graphdef = lora.base_graphdef
        self._merge_fn = None
        # The reference params, needed inside the loss only for the exact ("full") KL over the vocabulary; with LoRA
        # the frozen base itself (the base model with the adapters off)
        if lora is not None:
            self.ref_params = self.frozen if full_kl else None
        else:
            self.ref_params = ref_params if full_kl else None
            if self.ref_params is not None and mesh is not None:
                self.ref_params = shard_state(self.ref_params, self.base_param_shardings)
        self.temperature = float(temperature)
        entry = POLICY_LOSSES.entry(actor_cfg.policy_loss.loss_mode)
        self._policy_loss = entry.load()
        # the loss's own options, by the names it declares (jaxrl.algorithms.registry), from actor.policy_loss
        self._loss_options = {name: getattr(actor_cfg.policy_loss, name) for name in entry.options}
        # recompute_old_log_prob=False: pi_old = stop_gradient(current log-probs) in the loss (see the schema)
        self.on_policy_ratio = not actor_cfg.recompute_old_log_prob
        self.log_prob = LogProbComputer(self.graphdef, micro_batch_size=plan.forward_rows, temperature=temperature,
                                        mesh=mesh, rules=rules, remove_padding=plan.remove_padding,
                                        share_prompts=plan.share_prompts, max_token_len=plan.forward_max_token_len,
                                        max_token_key=plan.forward_max_token_key)

    def _update_extra(self):
        return self.ref_params

    def _extra_shardings(self):
        if self.ref_params is None:
            return None
        return self.base_param_shardings if self.lora is None else self.frozen_shardings

    # -- phases ----------------------------------------------------------------------------------------------

    def compute_log_probs(self, batch: RLBatch) -> tuple[np.ndarray, np.ndarray]:
        """``(old_log_probs, entropy)`` float32 ``[N, R]`` under the current params."""
        return self.log_prob(self.model_state(), batch)

    def merged_params(self):
        """The policy's weights in the base model's tree (``nnx.State`` for :attr:`base_graphdef`): what the rollout
        engine and the Hugging Face export take. Full fine-tuning: :attr:`params` itself. LoRA: the base with every
        adapted kernel ``W + (alpha / r) A @ B`` (:func:`jaxrl.models.lora.merge_lora`, one jitted call; on a mesh
        laid out like the base)."""
        if self.lora is None:
            return super().merged_params()
        if self._merge_fn is None:
            from functools import partial

            from jaxrl.models.lora import merge_lora

            merge = partial(merge_lora, scale=self.lora.spec.scale)
            self._merge_fn = (jax.jit(merge) if self.mesh is None else
                              jax.jit(merge, in_shardings=(self.param_shardings, self.frozen_shardings),
                                      out_shardings=self.frozen_shardings))
        return self._merge_fn(self.params, self.frozen)

    def _micro_loss(self, params, micro, num_tokens, num_seqs, prompt_width, ref_params=None):
        c = self.cfg
        mask = micro["response_mask"]
        full_kl = c.use_kl_loss and c.kl_loss_type == "full"
        if "segment_ids" in micro:  # packed rows: per-token values at the scoring columns, then the padded layout
            model, hidden = _packed_hidden(self.graphdef, params, micro, self.activation_sharding)
            labels = micro["score_ids"]
            per_token = lambda x: to_slots(x, micro["slot_index"], mask)  # noqa: E731
        else:
            model, hidden = _response_hidden(self.graphdef, params, micro["input_ids"], micro["positions"],
                                             micro["attention_mask"], prompt_width, self.activation_sharding)
            labels = micro["response_ids"]
            per_token = lambda x: x  # noqa: E731
        head = lambda h: model.logits(h) / self.temperature  # noqa: E731
        if full_kl:  # the KL needs the whole distribution: keep the logits
            logits = head(hidden)
            log_prob = log_probs_from_logits(logits, labels)
            entropy = entropy_from_logits(logits) if c.entropy_coeff != 0 else None
        else:  # fused_lm_head: in position chunks, never the whole [B, R, V] logits and their gradient
            log_prob, entropy = head_log_probs(hidden, labels, head, with_entropy=c.entropy_coeff != 0,
                                               chunked=self.fused_lm_head)
        log_prob = per_token(log_prob)
        # recompute_old_log_prob=False: on-policy, pi_old is the current policy (ratio 1, gradient of the
        # surrogate = advantage x grad log-prob); otherwise the old pass's log-probs.
        old_log_prob = jax.lax.stop_gradient(log_prob) if self.on_policy_ratio else micro["old_log_probs"]
        norms = dict(num_tokens=num_tokens, num_seqs=num_seqs)
        is_weights = None
        if c.tis_imp_ratio_cap > 0:
            is_weights = tis_weights(old_log_prob, micro["rollout_log_probs"], c.tis_imp_ratio_cap)
        pg_loss, pg_metrics = self._policy_loss(
            old_log_prob, log_prob, micro["advantages"], mask,
            clip_ratio_low=c.clip_ratio_low, clip_ratio_high=c.clip_ratio_high, clip_ratio_c=c.clip_ratio_c,
            loss_agg_mode=c.loss_agg_mode, rollout_is_weights=is_weights, **norms, **self._loss_options,
        )
        loss = pg_loss
        metrics = {"actor/pg_loss": pg_loss}
        if c.entropy_coeff != 0:
            # Only when it is in the loss (verl's ``calculate_entropy = entropy_coeff != 0``): an exp and a sum over
            # [B, R, V] per micro-batch. Otherwise actor/entropy comes from the old-log-prob pass (the trainer).
            entropy_loss = agg_loss(per_token(entropy), mask, c.loss_agg_mode, **norms)
            loss = loss - c.entropy_coeff * entropy_loss
            metrics["actor/entropy"] = entropy_loss
        if full_kl:
            # Exact KL over the vocabulary: the reference's whole distribution, recomputed on this micro-batch.
            if "segment_ids" in micro:
                ref_logits = jax.lax.stop_gradient(_forward_packed(
                    self.base_graphdef, ref_params, micro, self.temperature, self.activation_sharding, remat=False))
            else:
                ref_logits = jax.lax.stop_gradient(_forward_response(
                    self.base_graphdef, ref_params, micro["input_ids"], micro["positions"], micro["attention_mask"],
                    prompt_width, self.temperature, self.activation_sharding, remat=False,
                ))
            kld = per_token(kl_penalty(jax.nn.log_softmax(logits, -1), jax.nn.log_softmax(ref_logits, -1), "full"))
            kl_loss = agg_loss(kld, mask, c.loss_agg_mode, **norms)
            loss = loss + c.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss
        elif c.use_kl_loss:
            # old_log_prob: the importance-weighted k3 ("low_var_kl_is") weights by pi/pi_old; the others ignore it
            kld = kl_penalty(log_prob, micro["ref_log_probs"], c.kl_loss_type, old_log_prob=old_log_prob)
            kl_loss = agg_loss(kld, mask, c.loss_agg_mode, **norms)
            loss = loss + c.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss
        # Ratio-type metrics are means over the micro-batch: weight them by its token count.
        tokens = jnp.sum(mask)
        weighted = {f"actor/{k}": v * tokens for k, v in pg_metrics.items()}
        return loss, (metrics, weighted, tokens)

    def minibatch_arrays(self, batch: RLBatch) -> dict[str, np.ndarray]:
        """The per-row arrays the loss reads, ``[N, ...]`` each (without an old pass, ``old_log_probs`` holds the
        rollout's log-probs as a placeholder the loss never reads)."""
        if batch.old_log_probs is None:
            if not self.on_policy_ratio:
                raise ValueError("actor update needs batch.old_log_probs, which is not set")
            batch = dataclasses.replace(batch, old_log_probs=batch.rollout_log_probs)
        return {
            **batch.sequence_arrays(),
            "old_log_probs": batch.old_log_probs,
            "advantages": batch.advantages,
            "ref_log_probs": batch.ref_log_probs if batch.ref_log_probs is not None else batch.old_log_probs,
            "rollout_log_probs": (
                batch.rollout_log_probs if batch.rollout_log_probs is not None else batch.old_log_probs
            ),
        }

    def update(self, batch: RLBatch) -> dict[str, float]:
        """Run ``ppo_epochs`` passes of mini-batch updates over ``batch``; returns averaged metrics.

        Requires ``old_log_probs`` and ``advantages`` (and ``ref_log_probs`` when ``use_kl_loss``).

        Returns:
          ``actor/pg_loss``, the loss's ratio metrics (``actor/pg_clipfrac``, ``actor/ppo_kl``, ...),
          ``actor/kl_loss`` and ``actor/kl_coef`` (KL loss), ``actor/entropy`` (entropy bonus),
          ``actor/grad_norm`` (means over the updates), ``actor/nonfinite_grad`` (skipped updates), ``actor/lr``.

        Raises:
          ValueError: a needed batch field is missing; ``recompute_old_log_prob=False`` with more than one update.
        """
        c = self.cfg
        needed = (["advantages"] + ([] if self.on_policy_ratio else ["old_log_probs"])
                  + (["ref_log_probs"] if c.use_kl_loss else []))
        if self.on_policy_ratio and (c.ppo_epochs != 1 or batch.size > self.mini_batch_rows):
            raise ValueError(
                f"recompute_old_log_prob=False needs one on-policy update per step, but ppo_epochs="
                f"{c.ppo_epochs} and {batch.size} rows make "
                f"{c.ppo_epochs * -(-batch.size // self.mini_batch_rows)} updates"
            )
        for name in needed:
            if getattr(batch, name) is None:
                raise ValueError(f"actor update needs batch.{name}, which is not set")
        out = self.run_updates(batch)
        if c.use_kl_loss:
            out["actor/kl_coef"] = c.kl_loss_coef
        return out
