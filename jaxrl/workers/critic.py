"""Critic role: value estimates for GAE and the clipped value-function update (PPO).

Structure mirrors :class:`jaxrl.workers.actor.ActorWorker`: the :class:`~jaxrl.models.value_model.ValueModel`
is held functionally (``graphdef`` + ``params``), rows run in fixed-size micro-batches padded with masked
rows, and one optimizer update is one ``jax.jit`` call that accumulates the gradient over the
mini-batch's micro-batches with ``lax.scan``. Loss normalisers (token / sequence counts) are those of the
whole mini-batch, so accumulation gives exactly the full-mini-batch gradient for every ``loss_agg_mode``.

The update is verl's ``DataParallelPPOCritic.update_critic`` re-expressed in JAX: ``ppo_epochs`` passes,
mini-batches of ``critic.ppo_mini_batch_size x rollout.n`` responses, loss
``jaxrl.algorithms.compute_value_loss(vpreds, values=old values, returns, ...)``.

On a device mesh (``mesh=...``; the critic follows the actor's train mesh and rules) params and optimizer state
are sharded by the logical-axis rules and both jitted phases get explicit in/out shardings (batch rows over the
``"batch"`` rule's axes, values and metrics replicated), as in :class:`jaxrl.workers.actor.ActorWorker`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.algorithms import compute_value_loss, masked_sum
from jaxrl.batch import RLBatch
from jaxrl.workers.microbatch import (
    check_row_shards,
    guarded_update,
    pad_rows,
    row_chunks,
    scan_accumulate,
    stack_micro,
)
from jaxrl.workers.optim import make_optimizer
from jaxrl.workers.placement import activation_sharding, batch_shards, jit_sharded, rows_sharding, shard_tree
from sharding import DEFAULT_RULES


def forward_response_values(
    graphdef, params, input_ids, positions, attention_mask, prompt_width: int, activation_sharding=None
) -> jax.Array:
    """Values of the response tokens.

    Args:
      graphdef, params: ``nnx.split`` of a :class:`~jaxrl.models.value_model.ValueModel`.
      input_ids, positions, attention_mask: ``[B, P + R]`` int32 (prompt then response).
      prompt_width: ``P`` (static).
      activation_sharding: on a mesh, the residual stream's sharding at block boundaries, else None.

    Returns:
      float32 ``[B, R]``: the value for response token ``j`` is read at position ``P + j - 1``, the state
      *before* emitting token ``j`` (verl's critic: ``values[:, -R - 1:-1]``).
    """
    model = nnx.merge(graphdef, params)
    values = model(input_ids, positions, attention_mask, activation_sharding=activation_sharding)
    r = input_ids.shape[1] - prompt_width
    return jax.lax.dynamic_slice_in_dim(values, prompt_width - 1, r, axis=1)


class CriticWorker:
    """The trainable value function.

    Args:
      graphdef, params: ``nnx.split`` of a :class:`~jaxrl.models.value_model.ValueModel`.
      critic_cfg: the ``critic`` config section (as filled by the loader: ``ppo_mini_batch_size`` and
        ``ppo_epochs`` set). Reads ``ppo_mini_batch_size``, ``ppo_micro_batch_size_per_gpu`` (None = the
        whole mini-batch), ``forward_micro_batch_size_per_gpu`` (None = the update micro-batch),
        ``ppo_epochs``, ``shuffle``, ``cliprange_value``, ``grad_clip``, ``loss_agg_mode``, ``optim``.
      rollout_n: responses per prompt (mini-batch rows = ``ppo_mini_batch_size * rollout_n``).
      total_training_steps: RL steps in the run (learning-rate schedule).
      seed: mini-batch shuffling seed (when ``critic.shuffle``).
      mesh: the train mesh, or None for one device. With a mesh, params and optimizer state are placed by
        ``rules`` and the update / forward micro-batches are split over the batch axes.
      rules: logical-axis rules on ``mesh`` (default :data:`sharding.rules.DEFAULT_RULES`).

    Raises:
      ValueError: a batch size that is unset, not positive, or a micro-batch that does not divide the
        mini-batch; on a mesh, a micro-batch that is not a multiple of the batch shards.
    """

    def __init__(self, graphdef, params, critic_cfg, *, rollout_n: int, total_training_steps: int, seed: int = 0,
                 mesh=None, rules=None):
        for name in ("ppo_mini_batch_size", "ppo_epochs"):
            v = getattr(critic_cfg, name)
            if v is None or int(v) < 1:
                raise ValueError(
                    f"critic.{name}={v!r}: expected an int >= 1 (load the config with jaxrl.config.load_config, "
                    "which fills null from the actor's value)"
                )
        if rollout_n < 1:
            raise ValueError(f"rollout_n must be >= 1, got {rollout_n}")
        self.graphdef = graphdef
        self.params = params
        self.cfg = critic_cfg
        self.mini_batch_rows = int(critic_cfg.ppo_mini_batch_size) * int(rollout_n)
        micro = critic_cfg.ppo_micro_batch_size_per_gpu
        self.micro_batch_rows = self.mini_batch_rows if micro is None else int(micro)
        if self.micro_batch_rows < 1 or self.mini_batch_rows % self.micro_batch_rows:
            raise ValueError(
                f"critic.ppo_mini_batch_size*rollout.n = {self.mini_batch_rows} must be divisible by "
                f"critic.ppo_micro_batch_size_per_gpu = {self.micro_batch_rows}"
            )
        fwd = getattr(critic_cfg, "forward_micro_batch_size_per_gpu", None)
        self.forward_batch_rows = self.micro_batch_rows if fwd is None else int(fwd)
        if self.forward_batch_rows < 1:
            raise ValueError(f"critic.forward_micro_batch_size_per_gpu must be >= 1, got {fwd}")
        self.mesh = mesh
        self.rules = DEFAULT_RULES if rules is None else rules
        self.activation_sharding = activation_sharding(mesh, self.rules)
        self.param_shardings = self.opt_shardings = None  # mesh only
        if mesh is not None:
            shards = batch_shards(mesh, self.rules)
            check_row_shards(self.micro_batch_rows, shards, "critic.ppo_micro_batch_size_per_gpu")
            check_row_shards(self.forward_batch_rows, shards, "critic.forward_micro_batch_size_per_gpu")
            self.params, self.param_shardings = shard_tree(params, mesh, self.rules)
        self.cliprange_value = float(critic_cfg.cliprange_value)
        if not self.cliprange_value >= 0:
            raise ValueError(f"critic.cliprange_value must be >= 0, got {critic_cfg.cliprange_value}")
        self.loss_agg_mode = critic_cfg.loss_agg_mode
        self.rng = np.random.default_rng(seed)
        self.updates_per_step = int(critic_cfg.ppo_epochs)  # x mini-batches, fixed once the batch size is known
        self._tx = None
        self.schedule = None
        self.opt_state = None
        self.num_updates = 0  # optimizer updates applied so far (the schedule's count)
        self._total_training_steps = total_training_steps
        if mesh is None:
            self._values_fn = jax.jit(self._values, static_argnames=("prompt_width",))
            self._update_fn = jax.jit(self._update_minibatch, donate_argnums=(0, 1), static_argnames=("prompt_width",))
        else:
            rows = rows_sharding(mesh, self.rules)
            self._values_fn = jit_sharded(
                self._values, static_kwarg="prompt_width",
                in_shardings=(self.param_shardings, rows, rows, rows),
                out_shardings=NamedSharding(mesh, PartitionSpec()),
            )
            self._update_fn = None  # init_optimizer builds it (its shardings include the optimizer state's)

    # -- checkpoint state ------------------------------------------------------------------------------------

    def state(self) -> tuple[dict, dict]:
        """What a checkpoint keeps of this role: ``(arrays, meta)``.

        ``arrays`` = ``{"params": nnx.State, "opt_state": optax state}`` (device pytrees, as placed on the mesh);
        ``meta`` = ``{"num_updates": int, "rng": dict}`` (JSON: the optimizer-update count the learning-rate schedule
        reads, and the mini-batch shuffling generator's ``bit_generator.state``).
        """
        return ({"params": self.params, "opt_state": self.opt_state},
                {"num_updates": self.num_updates, "rng": self.rng.bit_generator.state})

    def load_state(self, arrays: dict, meta: dict) -> None:
        """Restore what :meth:`state` returned (arrays already placed like this role's, e.g. by the checkpoint
        store's ``restore(like=...)``).

        Raises:
          KeyError: ``arrays`` lacks ``params`` / ``opt_state`` or ``meta`` lacks ``num_updates`` / ``rng``.
        """
        params, opt_state, num_updates = arrays["params"], arrays["opt_state"], meta["num_updates"]
        self.rng.bit_generator.state = meta["rng"]
        self.params, self.opt_state, self.num_updates = params, opt_state, num_updates

    # -- optimizer -------------------------------------------------------------------------------------------

    def init_optimizer(self, rows_per_step: int) -> None:
        """Build the optimizer (``critic.optim``, ``critic.grad_clip``) once the responses per RL step are known."""
        n_mini = math.ceil(rows_per_step / self.mini_batch_rows)
        self.updates_per_step = int(self.cfg.ppo_epochs) * n_mini
        self._tx, self.schedule = make_optimizer(
            self.cfg.optim,
            grad_clip=self.cfg.grad_clip,
            total_training_steps=self._total_training_steps,
            updates_per_step=self.updates_per_step,
        )
        self.opt_state = self._tx.init(self.params)
        if self.mesh is not None:
            self.opt_state, self.opt_shardings = shard_tree(self.opt_state, self.mesh, self.rules)
            replicated = NamedSharding(self.mesh, PartitionSpec())
            self._update_fn = jit_sharded(
                self._update_minibatch, donate_argnums=(0, 1), static_kwarg="prompt_width",
                in_shardings=(self.param_shardings, self.opt_shardings, rows_sharding(self.mesh, self.rules, row_dim=1),
                              replicated, replicated),
                out_shardings=(self.param_shardings, self.opt_shardings, replicated),
            )

    # -- values ----------------------------------------------------------------------------------------------

    def _values(self, params, input_ids, positions, attention_mask, *, prompt_width):
        return forward_response_values(
            self.graphdef, params, input_ids, positions, attention_mask, prompt_width, self.activation_sharding
        )

    def compute_values(self, batch: RLBatch) -> np.ndarray:
        """Values of the response tokens under the current params.

        Runs in chunks of ``forward_micro_batch_size_per_gpu`` rows (the last one padded).

        Returns:
          float32 ``[N, R]``; entry ``[i, j]`` is the value of the state before response token ``j`` (read at
          position ``P + j - 1``), 0 where ``response_mask`` is 0.
        """
        ids, pos, mask = batch.input_ids(), batch.positions(), batch.attention_mask()
        mb = self.forward_batch_rows
        out = []
        for sl, n in row_chunks(batch.size, mb):
            v = self._values_fn(
                self.params, pad_rows(ids[sl], mb), pad_rows(pos[sl], mb), pad_rows(mask[sl], mb),
                prompt_width=batch.prompt_width,
            )
            out.append(np.asarray(v, np.float32)[:n])
        return np.concatenate(out) * batch.response_mask.astype(np.float32)

    # -- update ----------------------------------------------------------------------------------------------

    def _micro_loss(self, params, micro, num_tokens, num_seqs, prompt_width):
        mask = micro["response_mask"]
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

    def accumulate_grads(self, params, minibatch, num_tokens, num_seqs, *, prompt_width):
        """Gradient of the mini-batch value loss, accumulated over its micro-batches with ``lax.scan``.

        Args:
          minibatch: dict of arrays stacked ``[num_micro, micro_rows, ...]`` (see :meth:`stack_micro`).
          num_tokens, num_seqs: float32 scalars, valid tokens / sequences of the whole mini-batch (the loss
            normalisers, so the sum over micro-batches equals the full mini-batch loss exactly).

        Returns:
          ``(grads, metrics)``: grads with the params' structure; ``critic/vf_loss`` summed over micro-batches
          (= the mini-batch loss), ``critic/vf_clipfrac`` and ``critic/vpred_mean`` token-weighted means.
        """
        return scan_accumulate(
            lambda p, micro: self._micro_loss(p, micro, num_tokens, num_seqs, prompt_width), params, minibatch
        )

    def _update_minibatch(self, params, opt_state, minibatch, num_tokens, num_seqs, *, prompt_width):
        """One optimizer update from a mini-batch stacked as ``[num_micro, micro_rows, ...]``."""
        grads, metrics = self.accumulate_grads(params, minibatch, num_tokens, num_seqs, prompt_width=prompt_width)
        new_params, new_opt_state, grad_norm, finite = guarded_update(self._tx, grads, opt_state, params)
        metrics["critic/grad_norm"] = grad_norm
        metrics["critic/nonfinite_grad"] = 1.0 - finite.astype(jnp.float32)
        return new_params, new_opt_state, metrics

    @staticmethod
    def minibatch_arrays(batch: RLBatch) -> dict[str, np.ndarray]:
        """The per-row arrays the value loss reads, ``[N, ...]`` each (needs ``batch.values``/``returns``)."""
        return {
            "input_ids": batch.input_ids(),
            "positions": batch.positions(),
            "attention_mask": batch.attention_mask(),
            "response_mask": batch.response_mask.astype(np.float32),
            "values": np.asarray(batch.values, np.float32),
            "returns": np.asarray(batch.returns, np.float32),
        }

    stack_micro = staticmethod(stack_micro)

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
        if self._tx is None:
            self.init_optimizer(batch.size)
        arrays = self.minibatch_arrays(batch)
        mini, micro = self.mini_batch_rows, self.micro_batch_rows
        history: list[dict] = []
        for _ in range(int(self.cfg.ppo_epochs)):
            order = self.rng.permutation(batch.size) if self.cfg.shuffle else np.arange(batch.size)
            for start in range(0, batch.size, mini):
                idx = order[start : start + mini]
                stacked, num_tokens, num_seqs = self.stack_micro(arrays, idx, mini, micro)
                self.params, self.opt_state, metrics = self._update_fn(
                    self.params, self.opt_state, stacked, num_tokens, num_seqs, prompt_width=batch.prompt_width
                )
                history.append(metrics)
                self.num_updates += 1
        out = {k: float(np.mean([float(h[k]) for h in history])) for k in history[0]}
        out["critic/nonfinite_grad"] = float(np.sum([float(h["critic/nonfinite_grad"]) for h in history]))
        out["critic/lr"] = float(self.schedule(self.num_updates - 1))
        return out
