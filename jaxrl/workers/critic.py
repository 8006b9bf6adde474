"""Critic role: value estimates for GAE and the clipped value-function update (PPO).

The :class:`~jaxrl.models.value_model.ValueModel` is held functionally (``graphdef`` + ``params``); values are
computed in fixed-size micro-batches padded with masked rows. The update is verl's
``DataParallelPPOCritic.update_critic`` re-expressed in JAX: the epochs x shuffled mini-batches loop, the optimizer,
the mesh placement and the metric averaging are the trained-role base's
(:class:`jaxrl.workers.trained_role.TrainedRole`); this module holds the value forward and the loss of one
micro-batch, ``jaxrl.algorithms.compute_value_loss(vpreds, values=old values, returns, ...)``.

On a device mesh (``mesh=...``; the critic follows the actor's train mesh and rules) the value forward has explicit
in/out shardings (batch rows over the ``"batch"`` rule's axes, values replicated), as the update does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.algorithms import compute_value_loss, masked_sum
from jaxrl.batch import RLBatch
from jaxrl.config.batch_plan import RolePlan
from jaxrl.distributed import to_host
from jaxrl.workers.microbatch import pad_rows, row_chunks
from jaxrl.workers.packing import PACKED_KEYS, at_scores, micro_layout, real_lengths, scatter_rows, to_slots
from jaxrl.workers.placement import jit_sharded, rows_sharding
from jaxrl.workers.seqlen import plan_slots
from jaxrl.workers.trained_role import TrainedRole


def forward_response_values(
    graphdef, params, input_ids, positions, attention_mask, prompt_width: int, activation_sharding=None, remat=None
) -> jax.Array:
    """Values of the response tokens.

    Args:
      graphdef, params: ``nnx.split`` of a :class:`~jaxrl.models.value_model.ValueModel`.
      input_ids, positions, attention_mask: ``[B, P + R]`` int32 (prompt then response).
      prompt_width: ``P`` (static).
      activation_sharding: on a mesh, the residual stream's sharding at block boundaries, else None.
      remat: the model's ``remat=`` (None = its setting; False for the value pass, never differentiated).

    Returns:
      float32 ``[B, R]``: the value for response token ``j`` is read at position ``P + j - 1``, the state
      *before* emitting token ``j`` (verl's critic: ``values[:, -R - 1:-1]``).
    """
    model = nnx.merge(graphdef, params)
    values = model(input_ids, positions, attention_mask, activation_sharding=activation_sharding, remat=remat)
    r = input_ids.shape[1] - prompt_width
    return jax.lax.dynamic_slice_in_dim(values, prompt_width - 1, r, axis=1)


def forward_packed_values(graphdef, params, micro, activation_sharding=None, remat=None) -> jax.Array:
    """Values of the response tokens from packed rows (:func:`jaxrl.workers.packing.packed_micro`).

    Returns:
      float32 ``[G x S, R]`` in the padded response layout, each read at the column before its token (as
      :func:`forward_response_values`), 0 where ``micro["response_mask"]`` is 0.
    """
    model = nnx.merge(graphdef, params)
    seg = micro["segment_ids"]
    values = model(micro["input_ids"], micro["positions"], seg != 0, activation_sharding=activation_sharding,
                   segment_ids=seg, remat=remat, segment_cols=micro.get("segment_cols"))
    return to_slots(at_scores(values, micro["score_cols"]), micro["slot_index"], micro["response_mask"])


class CriticWorker(TrainedRole):
    """The trainable value function.

    Args:
      graphdef, params: ``nnx.split`` of a :class:`~jaxrl.models.value_model.ValueModel`.
      critic_cfg: the ``critic`` config section (:class:`jaxrl.config.schema.CriticConfig`). Reads ``shuffle``,
        ``cliprange_value``, ``grad_clip``, ``loss_agg_mode``, ``optim``.
      plan: the critic's batch sizes (``BatchPlan.from_config(cfg, batch_shards=...).critic`` for the mesh's batch
        shards; its ``forward_rows`` are the value forward's micro-batch over all devices).
      total_training_steps: RL steps in the run (learning-rate schedule).
      seed: mini-batch shuffling seed (when ``critic.shuffle``).
      mesh: the train mesh, or None for one device. With a mesh, params and optimizer state are placed by
        ``rules`` and the update / forward micro-batches are split over the batch axes.
      rules: logical-axis rules on ``mesh`` (default :data:`sharding.rules.DEFAULT_RULES`).
      frozen: LoRA (``critic.model.lora_rank``): the frozen backbone; ``params`` are then the adapters and the value
        head (the trained and checkpointed arrays). None: full fine-tuning.

    Raises:
      ValueError: ``cliprange_value < 0``; sizes that do not fit (see
        :class:`~jaxrl.workers.trained_role.TrainedRole`).
    """

    name = "critic"

    def __init__(self, graphdef, params, critic_cfg, *, plan: RolePlan, total_training_steps: int, seed: int = 0,
                 mesh=None, rules=None, frozen=None):
        super().__init__(graphdef, params, plan=plan, optim=critic_cfg.optim, grad_clip=critic_cfg.grad_clip,
                         shuffle=critic_cfg.shuffle, total_training_steps=total_training_steps, seed=seed, mesh=mesh,
                         rules=rules, frozen=frozen)
        self.cfg = critic_cfg
        self.cliprange_value = float(critic_cfg.cliprange_value)
        if not self.cliprange_value >= 0:
            raise ValueError(f"critic.cliprange_value must be >= 0, got {critic_cfg.cliprange_value}")
        self.loss_agg_mode = critic_cfg.loss_agg_mode
        self.forward_batch_rows = plan.forward_rows
        if mesh is None:
            self._values_fn = jax.jit(self._values, static_argnames=("prompt_width",))
            self._packed_values_fn = jax.jit(self._packed_values, static_argnames=("prompt_width",))
        else:
            rows = rows_sharding(mesh, self.rules)
            replicated = NamedSharding(mesh, PartitionSpec())
            self._values_fn = jit_sharded(
                self._values, static_kwarg="prompt_width",
                in_shardings=(self.param_shardings, self.frozen_shardings, rows, rows, rows), out_shardings=replicated,
            )
            self._packed_values_fn = jit_sharded(
                self._packed_values, static_kwarg="prompt_width",
                in_shardings=(self.param_shardings, self.frozen_shardings, rows), out_shardings=replicated,
            )

    # -- values ----------------------------------------------------------------------------------------------

    def _values(self, params, frozen, input_ids, positions, attention_mask, *, prompt_width):
        return forward_response_values(
            self.graphdef, self.full_state(params, frozen), input_ids, positions, attention_mask, prompt_width,
            self.activation_sharding, remat=False,
        )

    def _packed_values(self, params, frozen, micro, *, prompt_width=0):
        return forward_packed_values(self.graphdef, self.full_state(params, frozen), micro, self.activation_sharding,
                                     remat=False)

    def compute_values(self, batch: RLBatch) -> np.ndarray:
        """Values of the response tokens under the current params.

        Runs in chunks of the plan's ``forward_rows`` (``forward_micro_batch_size_per_gpu`` per device x the
        mesh's batch shards; the last chunk padded).

        Returns:
          float32 ``[N, R]``; entry ``[i, j]`` is the value of the state before response token ``j`` (read at
          position ``P + j - 1``), 0 where ``response_mask`` is 0.
        """
        ids, pos, mask = batch.input_ids(), batch.positions(), batch.attention_mask()
        if self.plan.remove_padding or self.plan.forward_max_token_len is not None:
            return self._values_slotted(batch, ids, pos, mask)
        mb = self.forward_batch_rows
        out = []
        for sl, n in row_chunks(batch.size, mb):
            v = self._values_fn(
                self.params, self.frozen, pad_rows(ids[sl], mb), pad_rows(pos[sl], mb), pad_rows(mask[sl], mb),
                prompt_width=batch.prompt_width,
            )
            out.append(to_host(v).astype(np.float32)[:n])
        return np.concatenate(out) * batch.response_mask.astype(np.float32)

    def _values_slotted(self, batch: RLBatch, ids, pos, mask) -> np.ndarray:
        """:meth:`compute_values` on packed rows and / or token-budget calls (``forward_max_token_len_per_gpu``)."""
        arrays = {"input_ids": ids, "positions": pos, "attention_mask": mask,
                  "response_mask": batch.response_mask.astype(np.float32)}
        packed, budget = self.plan.remove_padding, self.plan.forward_max_token_len
        slot_list = plan_slots(np.arange(batch.size), real_lengths(mask), shards=self.batch_shards,
                               micro_rows=self.forward_batch_rows, budget=budget, packed=packed,
                               key=self.plan.forward_max_token_key)
        out = []
        for slots in slot_list:
            micro = micro_layout(arrays, slots, batch.prompt_width, packed=packed, max_row_tokens=budget)
            if packed:
                rows_in = {k: micro[k] for k in PACKED_KEYS + ("response_mask",)}
                v = self._packed_values_fn(self.params, self.frozen, rows_in, prompt_width=0)
            else:
                v = self._values_fn(self.params, self.frozen, micro["input_ids"], micro["positions"],
                                    micro["attention_mask"], prompt_width=batch.prompt_width)
            out.append(np.asarray(to_host(v), np.float32))
        return scatter_rows(out, slot_list, batch.size) * batch.response_mask.astype(np.float32)

    # -- update ----------------------------------------------------------------------------------------------

    def _micro_loss(self, params, micro, num_tokens, num_seqs, prompt_width, extra=None):
        mask = micro["response_mask"]
        if "segment_ids" in micro:
            vpreds = forward_packed_values(self.graphdef, params, micro, self.activation_sharding)
        else:
            vpreds = forward_response_values(
                self.graphdef, params, micro["input_ids"], micro["positions"], micro["attention_mask"], prompt_width,
                self.activation_sharding,
            )
        vf_loss, m = compute_value_loss(
            vpreds, micro["values"], micro["returns"], mask,
            cliprange_value=self.cliprange_value, loss_agg_mode=self.loss_agg_mode,
            num_tokens=num_tokens, num_seqs=num_seqs,
        )
        # Ratio-type metrics are means over the micro-batch: weight them by its token count.
        tokens = jnp.sum(mask)
        weighted = {
            "critic/vf_clipfrac": m["vf_clipfrac"] * tokens,
            "critic/vpred_mean": jax.lax.stop_gradient(masked_sum(vpreds, mask)),
        }
        return vf_loss, ({"critic/vf_loss": vf_loss}, weighted, tokens)

    def minibatch_arrays(self, batch: RLBatch) -> dict[str, np.ndarray]:
        """The per-row arrays the value loss reads, ``[N, ...]`` each (needs ``batch.values``/``returns``)."""
        return {
            "input_ids": batch.input_ids(),
            "positions": batch.positions(),
            "attention_mask": batch.attention_mask(),
            "response_mask": batch.response_mask.astype(np.float32),
            "values": np.asarray(batch.values, np.float32),
            "returns": np.asarray(batch.returns, np.float32),
        }

    def update(self, batch: RLBatch) -> dict[str, float]:
        """Run ``ppo_epochs`` passes of mini-batch value updates over ``batch``; returns averaged metrics.

        Requires ``batch.values`` (the critic's values at rollout time, from :meth:`compute_values`) and
        ``batch.returns`` (e.g. GAE returns), float32 ``[N, R]``.

        Returns:
          ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``, ``critic/grad_norm`` (means over
          the updates), ``critic/nonfinite_grad`` (count of skipped updates), ``critic/lr`` (after the last
          update).

        Raises:
          ValueError: ``batch.values`` or ``batch.returns`` is missing or not ``[N, R]``.
        """
        for name in ("values", "returns"):
            arr = getattr(batch, name)
            if arr is None:
                raise ValueError(f"critic update needs batch.{name}, which is not set")
            if np.shape(arr) != batch.response_ids.shape:
                raise ValueError(
                    f"batch.{name} has shape {np.shape(arr)}; expected {batch.response_ids.shape} like response_ids"
                )
        return self.run_updates(batch)
