"""What every trained role (the actor, the critic) shares: placement, optimizer, the update loop, metrics, state.

A trained role holds its model functionally (``graphdef`` + ``params`` from ``nnx.split``) and learns with verl's
PPO update scheme (``DataParallelPPOActor.update_policy`` / ``DataParallelPPOCritic.update_critic``): for each of
``ppo_epochs`` epochs the step's rows are (optionally) shuffled and cut into mini-batches of
``ppo_mini_batch_size x rollout.n`` rows; each mini-batch is one optimizer update, its gradient accumulated over
micro-batches inside one ``jax.jit`` (``lax.scan``, :func:`~jaxrl.workers.microbatch.scan_accumulate`) with the
loss normalised by the whole mini-batch's token / sequence counts, so accumulation gives exactly the full
mini-batch gradient. The sizes come from the role's :class:`~jaxrl.config.batch_plan.RolePlan`. With packed rows
(``remove_padding``) or a token budget (``max_token_len``, verl's ``use_dynamic_bsz``) the micro-batches differ in
shape, so each is one jitted accumulation (:meth:`TrainedRole._accumulate`, the same mini-batch-global
normalisers). Either way the optimizer step is a program of its own (:meth:`TrainedRole._step`), compiled once: a
new batch shape compiles only its gradient program (an optimizer step over the hundreds of parameter arrays is
~1,400 XLA kernels, about 0.1 GB of resident code per copy on CPU).

:class:`TrainedRole` holds that scaffolding; a subclass supplies only its loss (:meth:`TrainedRole._micro_loss`),
the per-row arrays the loss reads (:meth:`TrainedRole.minibatch_arrays`) and its forward pass.

Without LoRA a role whose model trains through the rematerialised layer scan holds it in the scan layout (each
decoder's layers stacked ``[L, ...]``, :mod:`jaxrl.models.scan_layout`): the gradient program then reads the stored
weights instead of stacking a copy per call, and the gradient and the AdamW moments are stacked alike;
:meth:`TrainedRole.merged_params` gives the per-layer tree back.

With LoRA (:mod:`jaxrl.models.lora`) the model state is two trees: ``params``, what trains (the adapters, and for
the critic its value head), and ``frozen``, the base weights. Every forward merges them (``nnx.merge_state``, no
copy) and the gradient, the optimizer state and the checkpoint cover ``params`` only; ``frozen`` is never donated
and never updated. Without LoRA ``frozen`` is None and every program is the full fine-tuning one.

On a device mesh (``mesh=...``, see :mod:`jaxrl.workers.placement`) params and optimizer state are sharded by the
logical-axis rules and every program has explicit in/out shardings (params and optimizer state by the rules, the
gradient like the params, the stacked ``[num_micro, micro_rows, ...]`` mini-batch with rows over the ``"batch"``
rule's axes, scalars and metrics replicated). Without a mesh the programs are the single-device ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.config.batch_plan import RolePlan
from jaxrl.distributed import to_global, to_host
from jaxrl.models.scan_layout import stack_layers, unstack_layers, unstacked_copy
from jaxrl.workers.microbatch import check_row_shards, guarded_update, scan_accumulate, stack_micro
from jaxrl.workers.packing import micro_layout, prompt_sharing, real_lengths
from jaxrl.workers.seqlen import plan_slots
from jaxrl.workers.optim import make_optimizer
from jaxrl.workers.placement import activation_sharding, batch_shards, jit_sharded, rows_sharding, shard_tree
from sharding import DEFAULT_RULES
from sharding.rules import param_shardings


class TrainedRole:
    """Base of the actor and the critic.

    Args:
      graphdef, params: ``nnx.split`` of the role's model.
      plan: the role's batch sizes (rows per mini-batch / micro-batch / forward call over all devices, epochs,
        rows per step), derived for this role's data-parallel devices (``plan.batch_shards``).
      optim: the role's ``optim`` config section (AdamW and its schedule, :func:`~jaxrl.workers.optim.make_optimizer`).
      grad_clip: max global gradient norm (``<= 0``: no clipping).
      shuffle: shuffle the rows before cutting mini-batches (every epoch, from ``seed``).
      total_training_steps: RL steps in the run (the learning-rate schedule's horizon).
      seed: the shuffling RNG's seed.
      mesh: the train mesh, or None (one device).
      rules: logical-axis rules on ``mesh`` (default :data:`sharding.rules.DEFAULT_RULES`).
      frozen: the frozen part of the model state (LoRA: the base weights), merged with ``params`` in every
        forward and never trained; None (full fine-tuning) = ``params`` is the whole model.

    Attributes:
      name: the metric prefix (``"actor"``, ``"critic"``).
      params, opt_state: the trained state (``opt_state`` is None until :meth:`init_optimizer`).
      frozen, frozen_shardings: the frozen state and (on a mesh) its shardings, or None.
      lora: the policy's :class:`~jaxrl.models.lora.LoraInfo` when it trains LoRA adapters
        (:class:`~jaxrl.workers.actor.ActorWorker`), else None.
      graphdef: the graph the role's programs merge :attr:`params` into: in the scan layout the model with its
        layers stacked (:func:`jaxrl.models.scan_layout.stack_layers`: full fine-tuning of a model whose training
        forward is the rematerialised scan), else the ``graphdef`` given.
      scan_layout: whether :attr:`params` (and so the gradient and the optimizer state) hold the layers stacked.
      base_graphdef: the graph :meth:`merged_params` merges into: the per-layer ``graphdef`` given, or with LoRA
        adapters on a policy the model without them.
      param_shardings, base_param_shardings: on a mesh the params' shardings in their own layout and in the
        per-layer one (:meth:`merged_params`, a reference's weights); None without a mesh.
      num_updates: optimizer updates applied so far (the schedule's count).
      rng: ``numpy.random.Generator`` of the mini-batch shuffling.

    Raises:
      ValueError: sizes that do not fit (:meth:`RolePlan.check`); a plan derived for another number of
        data-parallel devices than the mesh's batch shards (``data x fsdp``; 1 without a mesh); on a mesh, a
        micro-batch or forward micro-batch that is not a multiple of the batch shards.
    """

    name = "role"
    lora = None

    def __init__(self, graphdef, params, *, plan: RolePlan, optim, grad_clip: float, shuffle: bool,
                 total_training_steps: int, seed: int = 0, mesh=None, rules=None, frozen=None):
        plan.check()
        self.base_graphdef = graphdef
        self.scan_layout = False
        if frozen is None:  # full fine-tuning: the layers stacked for the update's scan (jaxrl.models.scan_layout)
            stacked = stack_layers(graphdef, params)
            if stacked is not None:
                graphdef, params = stacked
                self.scan_layout = True
        self.graphdef = graphdef
        self.params = params
        self.frozen = frozen
        self.frozen_shardings = None
        self.plan = plan
        self.mesh = mesh
        self.rules = DEFAULT_RULES if rules is None else rules
        self.activation_sharding = activation_sharding(mesh, self.rules)
        self.param_shardings = None  # mesh only: the params' NamedShardings (also the jit in/out shardings)
        self.base_param_shardings = None  # mesh only: the same in the per-layer layout (merged_params, a reference)
        self._unstack_fn = None
        self.opt_shardings = None
        shards = 1 if mesh is None else batch_shards(mesh, self.rules)
        if plan.batch_shards != shards:
            raise ValueError(
                f"{plan.section}: the batch plan was derived for {plan.batch_shards} data-parallel device(s) but "
                f"the role runs on {shards} (its *_micro_batch_size_per_gpu values are per device); derive it with "
                f"BatchPlan.from_config(cfg, batch_shards={shards})"
            )
        self.batch_shards = shards
        if mesh is not None:
            if plan.max_token_len is None and not plan.remove_padding:
                check_row_shards(plan.micro_batch_rows, shards, f"the micro-batch of {plan.micro_key}")
            if plan.forward_max_token_len is None and not plan.remove_padding:
                check_row_shards(plan.forward_rows, shards, f"the micro-batch of {plan.forward_key}")
            self.params, self.param_shardings = shard_tree(params, mesh, self.rules)
            self.base_param_shardings = self.param_shardings if not self.scan_layout else param_shardings(
                jax.eval_shape(unstack_layers, params), mesh, self.rules)
            if frozen is not None:
                self.frozen, self.frozen_shardings = shard_tree(frozen, mesh, self.rules)
        self.rng = np.random.default_rng(seed)
        self._optim = optim
        self._grad_clip = grad_clip
        self._shuffle = bool(shuffle)
        self._total_training_steps = total_training_steps
        self._tx = None
        self.schedule = None
        self.opt_state = None
        self.num_updates = 0
        # init_optimizer builds the programs (on a mesh their shardings include the optimizer state's): the mini-batch
        # gradient and the optimizer step; packed rows / token-budget micro-batches: one jitted accumulation per
        # micro-batch, then the step (_apply)
        self._grads_fn = self._step_fn = None
        self._accumulate_fn = self._apply_fn = self._zeros_fn = None

    # -- sizes -----------------------------------------------------------------------------------------------

    @property
    def mini_batch_rows(self) -> int:
        """Rows per optimizer update (``ppo_mini_batch_size x rollout.n``)."""
        return self.plan.mini_batch_rows

    @property
    def micro_batch_rows(self) -> int:
        """Rows per forward/backward of the update."""
        return self.plan.micro_batch_rows

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per RL step (``ppo_epochs x mini-batches``; the schedule counts RL steps with it)."""
        return self.plan.updates_per_step

    # -- optimizer -------------------------------------------------------------------------------------------

    def init_optimizer(self) -> None:
        """Build the optimizer and its state (AdamW, ``optim``'s schedule over ``updates_per_step`` updates per RL
        step) and the jitted update; on a mesh the state is placed by the rules."""
        self._tx, self.schedule = make_optimizer(
            self._optim, grad_clip=self._grad_clip, total_training_steps=self._total_training_steps,
            updates_per_step=self.updates_per_step,
        )
        self.opt_state = self._tx.init(self.params)
        zeros = lambda p: jax.tree.map(jnp.zeros_like, p)  # noqa: E731
        if self.mesh is None:
            self._grads_fn = jax.jit(self.accumulate_grads, static_argnames=("prompt_width",))
            self._step_fn = jax.jit(self._step, donate_argnums=(0, 1))
            self._accumulate_fn = jax.jit(self._accumulate, donate_argnums=(1,), static_argnames=("prompt_width",))
            self._apply_fn = jax.jit(self._apply, donate_argnums=(0, 1))
            self._zeros_fn = jax.jit(zeros)
            return
        self.opt_state, self.opt_shardings = shard_tree(self.opt_state, self.mesh, self.rules)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        self._grads_fn = jit_sharded(
            self.accumulate_grads, static_kwarg="prompt_width",
            in_shardings=(self.param_shardings, rows_sharding(self.mesh, self.rules, row_dim=1), replicated,
                          replicated, self._extra_shardings(), self.frozen_shardings),
            out_shardings=(self.param_shardings, replicated),
        )
        self._step_fn = jax.jit(self._step, donate_argnums=(0, 1),
                                in_shardings=(self.param_shardings, self.opt_shardings, self.param_shardings,
                                              replicated),
                                out_shardings=(self.param_shardings, self.opt_shardings, replicated))
        acc = (self.param_shardings, replicated, replicated, replicated)
        self._accumulate_fn = jit_sharded(
            self._accumulate, donate_argnums=(1,), static_kwarg="prompt_width",
            in_shardings=(self.param_shardings, acc, rows_sharding(self.mesh, self.rules), replicated, replicated,
                          self._extra_shardings(), self.frozen_shardings),
            out_shardings=acc,
        )
        self._apply_fn = jax.jit(self._apply, donate_argnums=(0, 1),
                                 in_shardings=(self.param_shardings, self.opt_shardings, acc),
                                 out_shardings=(self.param_shardings, self.opt_shardings, replicated))
        self._zeros_fn = jax.jit(zeros, in_shardings=(self.param_shardings,), out_shardings=self.param_shardings)

    # -- what a subclass provides ------------------------------------------------------------------------------

    def _micro_loss(self, params, micro, num_tokens, num_seqs, prompt_width, extra):
        """One micro-batch's share of the mini-batch loss: ``(loss, (sums, weighted, tokens))`` as
        :func:`~jaxrl.workers.microbatch.scan_accumulate` takes it (metrics named ``<name>/...``). ``params`` is the
        whole model state (:meth:`full_state`)."""
        raise NotImplementedError

    def minibatch_arrays(self, batch) -> dict[str, np.ndarray]:
        """The per-row arrays the loss reads, ``[N, ...]`` each; must hold ``response_mask`` (float 0/1)."""
        raise NotImplementedError

    def _update_extra(self):
        """Frozen inputs of the loss passed to every update (a pytree of arrays, or None)."""
        return None

    def _extra_shardings(self):
        """Shardings (tree prefix) of :meth:`_update_extra` on the mesh."""
        return None

    # -- the model state -------------------------------------------------------------------------------------

    @staticmethod
    def full_state(params, frozen):
        """The whole model state: ``params`` merged with ``frozen`` (``nnx.merge_state``: the same arrays, no copy;
        traceable), or ``params`` itself when ``frozen`` is None."""
        return params if frozen is None else nnx.merge_state(params, frozen)

    def model_state(self):
        """The current whole model state (:meth:`full_state` of :attr:`params` and :attr:`frozen`)."""
        return self.full_state(self.params, self.frozen)

    def merged_params(self):
        """The model's weights in :attr:`base_graphdef`'s tree, what the Hugging Face export and a rollout engine
        take (``nnx.merge(base_graphdef, merged_params())`` is the model): :meth:`model_state`, in the scan layout
        unstacked into per-layer arrays (one jitted copy, :func:`~jaxrl.models.scan_layout.unstack_layers`); a role
        with LoRA adapters on a policy merges them into the base."""
        if not self.scan_layout:
            return self.model_state()
        if self.mesh is None:  # the layers copied apart; the embedding and norms are the role's own arrays
            return unstacked_copy(self.model_state())
        if self._unstack_fn is None:
            self._unstack_fn = jax.jit(unstack_layers, in_shardings=(self.param_shardings,),
                                       out_shardings=self.base_param_shardings)
        return self._unstack_fn(self.model_state())

    def rollout_params(self):
        """What the rollout engine is synced with: :meth:`model_state` as it is when the role holds the scan layout
        (no copy; :class:`~jaxrl.rollout.weight_sync.WeightSync` unstacks it for an engine that needs per-layer
        arrays, and the JAX sampler does so per ``generate`` call, so no per-layer copy lives through the update),
        else :meth:`merged_params`."""
        return self.model_state() if self.scan_layout else self.merged_params()

    # -- the update ------------------------------------------------------------------------------------------

    def accumulate_grads(self, params, minibatch, num_tokens, num_seqs, extra=None, frozen=None, *, prompt_width):
        """Gradient of the mini-batch loss, accumulated over its micro-batches with ``lax.scan``.

        Args:
          minibatch: dict of arrays stacked ``[num_micro, micro_rows, ...]`` (:meth:`stack_micro`).
          num_tokens, num_seqs: float32 scalars, valid tokens / sequences of the whole mini-batch (the loss
            normalisers, so the sum over micro-batches equals the full mini-batch loss exactly).
          extra: the loss's frozen inputs (:meth:`_update_extra`).
          frozen: the frozen model state (:attr:`frozen`), merged with ``params`` in the forward; None = none.
          prompt_width: the batch's prompt width ``P`` (static).

        Returns:
          ``(grads, metrics)``: grads with the params' structure (the trained part only); summed metrics (loss terms)
          summed over micro-batches, weighted ones (ratios) token-weighted means.
        """
        return scan_accumulate(
            lambda p, micro: self._micro_loss(self.full_state(p, frozen), micro, num_tokens, num_seqs, prompt_width,
                                              extra),
            params, minibatch,
        )

    def _step(self, params, opt_state, grads, metrics):
        """One optimizer update from a mini-batch's gradient (skipped when it is not finite); ``metrics`` plus
        ``<name>/grad_norm`` and ``<name>/nonfinite_grad`` (1.0 when skipped)."""
        new_params, new_opt_state, grad_norm, finite = guarded_update(self._tx, grads, opt_state, params)
        metrics = dict(metrics)
        metrics[f"{self.name}/grad_norm"] = grad_norm
        metrics[f"{self.name}/nonfinite_grad"] = 1.0 - finite.astype(jnp.float32)
        return new_params, new_opt_state, metrics

    stack_micro = staticmethod(stack_micro)

    # -- packed rows / token-budget micro-batches ----------------------------------------------------------------

    @property
    def slotted(self) -> bool:
        """The update runs on slot-planned micro-batches (packed rows and / or a token budget), one jitted
        accumulation each, instead of the fixed-count ``lax.scan``."""
        return self.plan.remove_padding or self.plan.max_token_len is not None

    def _accumulate(self, params, acc, micro, num_tokens, num_seqs, extra, frozen=None, *, prompt_width):
        """``acc`` plus one micro-batch's gradient and metrics (``acc = (grads, sums, weighted, tokens)``, as
        :func:`~jaxrl.workers.microbatch.scan_accumulate` carries them)."""
        grads_acc, sums, wsums, tok = acc

        def loss(p):
            return self._micro_loss(self.full_state(p, frozen), micro, num_tokens, num_seqs, prompt_width, extra)

        (_, (metrics, weighted, tokens)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
        return add(grads_acc, grads), add(sums, metrics), add(wsums, weighted), tok + tokens

    def _apply(self, params, opt_state, acc):
        """:meth:`_step` from accumulated micro-batches ``acc = (grads, sums, weighted, tokens)``: summed metrics as
        they are, weighted ones divided by the tokens."""
        grads, sums, wsums, tok = acc
        metrics = dict(sums)
        metrics.update({k: v / jnp.maximum(tok, 1.0) for k, v in wsums.items()})
        return self._step(params, opt_state, grads, metrics)

    def _replicated(self, tree):
        """Host values on the devices, replicated over the mesh (or on the default device without one)."""
        if self.mesh is None:
            return jax.device_put(tree)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return to_global(tree, replicated)

    def micro_slots(self, idx: np.ndarray, lengths: np.ndarray, sharing: dict | None = None) -> list[np.ndarray]:
        """The micro-batches of one mini-batch (rows ``idx``) as ``[shards, S]`` slot arrays
        (:func:`~jaxrl.workers.seqlen.plan_slots`; ``lengths`` are every batch row's real tokens, ``sharing`` the
        :func:`~jaxrl.workers.packing.prompt_sharing` of the rows ``idx``, in that order)."""
        return plan_slots(idx, lengths[idx], shards=self.batch_shards, micro_rows=self.plan.micro_batch_rows,
                          budget=self.plan.max_token_len, packed=self.plan.remove_padding,
                          key=self.plan.max_token_key, **(sharing or {}))

    def slotted_grads(self, params, arrays, idx, prompt_width, extra=None):
        """The accumulated ``(grads, sums, weighted, tokens)`` of the mini-batch ``idx`` over its slot-planned
        micro-batches, each normalised by the mini-batch's valid tokens and rows (exact under any partition)."""
        lengths = real_lengths(arrays["attention_mask"])
        num_tokens = np.float32(max(arrays["response_mask"][idx].sum(), 1.0))
        num_seqs = np.float32(len(idx))
        packed, share = self.plan.remove_padding, self.plan.share_prompts
        acc = None
        # the shared-prompt groups of this mini-batch's rows only (not the whole batch's again per mini-batch)
        mini = {k: arrays[k][idx] for k in ("input_ids", "attention_mask")} if share else arrays
        for slots in self.micro_slots(idx, lengths, prompt_sharing(mini, prompt_width, share)):
            micro = micro_layout(arrays, slots, prompt_width, packed=packed, max_row_tokens=self.plan.max_token_len,
                                 share_prompts=share)
            if acc is None:
                width = 0 if packed else prompt_width
                _, (m0, w0, _) = jax.eval_shape(
                    lambda p, m, e, f: self._micro_loss(self.full_state(p, f), m, num_tokens, num_seqs, width, e),
                    params, micro, extra, self.frozen)
                zero = lambda tree: {k: np.zeros(v.shape, v.dtype) for k, v in tree.items()}  # noqa: E731
                # on devices like the accumulated outputs, so the first call compiles the same program as the rest
                acc = (self._zeros_fn(params),) + self._replicated((zero(m0), zero(w0), np.float32(0.0)))
            acc = self._accumulate_fn(params, acc, micro, num_tokens, num_seqs, extra, self.frozen,
                                      prompt_width=0 if packed else prompt_width)
        return acc

    def run_updates(self, batch) -> dict[str, float]:
        """``ppo_epochs`` passes of mini-batch updates over ``batch`` (rows shuffled per epoch when ``shuffle``).

        Returns:
          The updates' metrics: each averaged over the updates, ``<name>/nonfinite_grad`` summed (the count of
          skipped updates), and ``<name>/lr`` the learning rate of the last update.
        """
        if self._tx is None:
            self.init_optimizer()
        arrays = self.minibatch_arrays(batch)
        mini, micro = self.plan.mini_batch_rows, self.plan.micro_batch_rows
        extra = self._update_extra()
        history: list[dict] = []
        for _ in range(self.plan.ppo_epochs):
            order = self.rng.permutation(batch.size) if self._shuffle else np.arange(batch.size)
            for start in range(0, batch.size, mini):
                if self.slotted:
                    acc = self.slotted_grads(self.params, arrays, order[start : start + mini], batch.prompt_width,
                                             extra)
                    self.params, self.opt_state, metrics = self._apply_fn(self.params, self.opt_state, acc)
                    history.append(metrics)
                    self.num_updates += 1
                    continue
                stacked, num_tokens, num_seqs = self.stack_micro(arrays, order[start : start + mini], mini, micro)
                # the gradient is held by no name: it is freed as soon as the step has used it
                self.params, self.opt_state, metrics = self._step_fn(
                    self.params, self.opt_state,
                    *self._grads_fn(self.params, stacked, num_tokens, num_seqs, extra, self.frozen,
                                    prompt_width=batch.prompt_width))
                history.append(metrics)
                self.num_updates += 1
        return self.average_metrics(history)

    def average_metrics(self, history: list[dict]) -> dict[str, float]:
        """Means over the updates of a step, the skipped-update count and the last update's learning rate."""
        history = to_host(history)
        out = {k: float(np.mean([float(h[k]) for h in history])) for k in history[0]}
        key = f"{self.name}/nonfinite_grad"
        out[key] = float(np.sum([float(h[key]) for h in history]))
        out[f"{self.name}/lr"] = float(self.schedule(self.num_updates - 1))
        return out

    # -- checkpoint state ----------------------------------------------------------------------------------------

    def state(self) -> tuple[dict, dict]:
        """What a checkpoint holds of this role: ``(arrays, meta)``; arrays ``{"params", "opt_state"}`` (device
        pytrees; with LoRA the trained part only, the frozen base is the model file's), meta ``{"num_updates",
        "rng"}`` (JSON: the update count and the shuffling RNG's state)."""
        arrays = {"params": self.params, "opt_state": self.opt_state}
        return arrays, {"num_updates": self.num_updates, "rng": self.rng.bit_generator.state}

    def load_state(self, arrays: dict, meta: dict) -> None:
        """Restore what :meth:`state` returned (arrays already on this role's shardings). The optimizer is built
        first if it is not yet (so a later update does not replace the restored state with a fresh one)."""
        if self._tx is None:
            self.init_optimizer()
        self.params, self.opt_state = arrays["params"], arrays["opt_state"]
        self.num_updates = int(meta["num_updates"])
        self.rng.bit_generator.state = meta["rng"]
