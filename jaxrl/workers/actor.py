"""Actor and reference roles: log-prob recompute and the PPO/GRPO policy update.

Both roles hold the decoder functionally (``graphdef`` + ``params`` from ``nnx.split``) so every phase is a
pure jitted function of arrays. Rows are processed in fixed-size micro-batches (the last one padded with
fully masked rows), so XLA compiles one program per phase regardless of the batch size.

The update is verl's ``DataParallelPPOActor.update_policy`` re-expressed in JAX: for each of ``ppo_epochs``
epochs the batch is split into mini-batches of ``ppo_mini_batch_size x rollout.n`` responses; each
mini-batch is one optimizer update whose gradient is accumulated over micro-batches of
``ppo_micro_batch_size_per_gpu`` responses inside a single ``jax.jit`` (``lax.scan``). Loss
normalisers (token / sequence counts) are those of the whole mini-batch, so gradient accumulation is
exactly the full-mini-batch gradient.

On a device mesh (``mesh=...``, see :mod:`jaxrl.workers.placement`) the same functions run SPMD: params and
optimizer state are sharded by the logical-axis rules, every jitted phase has explicit ``in_shardings`` /
``out_shardings`` (params and optimizer state by the rules, batch rows over the ``"batch"`` rule's axes,
``data x fsdp``; metrics and log-probs replicated), and each micro-batch's rows are split over those axes.
Without a mesh (``mesh=None``) nothing of this runs: the programs are the single-device ones.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.algorithms import agg_loss, entropy_from_logits, get_policy_loss, kl_penalty, log_probs_from_logits
from jaxrl.algorithms.policy_loss import tis_weights
from jaxrl.batch import RLBatch
from jax.sharding import NamedSharding, PartitionSpec

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
from sharding import DEFAULT_RULES, param_shardings, shard_state


def _forward_response(
    graphdef, params, input_ids, positions, attention_mask, prompt_width, temperature, activation_sharding=None
):
    """Logits of the response positions.

    Args:
      input_ids, positions, attention_mask: ``[B, P + R]`` int32.
      prompt_width: ``P`` (static). Logits at position ``t`` predict token ``t + 1``, so the response token
        ``j`` (at ``P + j``) is scored by the logits at ``P + j - 1``.
      temperature: logits are divided by it (as verl does) so log-probs match the sampling distribution.
      activation_sharding: on a mesh, the residual stream's sharding at block boundaries (rows over the batch
        axes; see :func:`activation_sharding`), else None.

    Returns:
      float32 logits ``[B, R, V]``.
    """
    model = nnx.merge(graphdef, params)
    hidden, _ = model(input_ids, positions, attention_mask, return_hidden=True, activation_sharding=activation_sharding)
    r = input_ids.shape[1] - prompt_width
    # The LM head only on the R scoring positions: no [B, P, V] prompt-position logits (their matmul and its
    # backward would be wasted work, a large share of a small model's FLOPs with a 50-150k vocabulary).
    hidden = jax.lax.dynamic_slice_in_dim(hidden, prompt_width - 1, r, axis=1)
    return model.logits(hidden) / temperature


def _loss_options(policy_loss_cfg) -> tuple:
    """The policy loss's own options (``actor.policy_loss.*`` except ``loss_mode``) as a hashable tuple."""
    fields = dataclasses.asdict(policy_loss_cfg) if dataclasses.is_dataclass(policy_loss_cfg) else vars(policy_loss_cfg)
    return tuple(sorted((k, v) for k, v in fields.items() if k != "loss_mode"))


def _supported(fn, options: dict) -> dict:
    """The subset of ``options`` that ``fn`` declares as keyword parameters."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in options.items() if k in params}


class LogProbComputer:
    """Per-token log-probs (and entropies) of responses under a fixed set of params.

    Args:
      graphdef: the decoder's ``nnx.GraphDef``.
      micro_batch_size: rows per jitted call (``log_prob_micro_batch_size_per_gpu``); on a mesh, the rows of one
        call on the whole mesh, split over its batch axes.
      temperature: rollout temperature (logits are divided by it).
      mesh: the train mesh, or None (single device: the params' own placement decides).
      rules: logical-axis rules on ``mesh`` (default :data:`sharding.rules.DEFAULT_RULES`).

    Raises:
      ValueError: ``micro_batch_size <= 0``, or on a mesh not a multiple of its batch shards.
    """

    def __init__(self, graphdef, *, micro_batch_size: int, temperature: float, mesh=None, rules=None):
        if micro_batch_size <= 0:
            raise ValueError(f"log-prob micro batch size must be > 0, got {micro_batch_size}")
        self.graphdef = graphdef
        self.micro_batch_size = micro_batch_size
        self.temperature = float(temperature)
        self.mesh = mesh
        self.rules = DEFAULT_RULES if rules is None else rules
        self.activation_sharding = activation_sharding(mesh, self.rules)
        if mesh is None:
            self._fn = jax.jit(self._log_probs, static_argnames=("prompt_width",))
        else:
            check_row_shards(micro_batch_size, batch_shards(mesh, self.rules), "log_prob_micro_batch_size_per_gpu")
            self._fn = None  # built for the params' tree on the first call (explicit shardings need it)
            self._fn_tree = None

    def _jitted(self, params):
        """The jitted log-prob program; on a mesh with explicit shardings for ``params``' tree."""
        if self.mesh is None:
            return self._fn
        tree = jax.tree.structure(params)
        if self._fn is None or tree != self._fn_tree:
            rows = rows_sharding(self.mesh, self.rules)
            replicated = NamedSharding(self.mesh, PartitionSpec())
            self._fn = jit_sharded(
                self._log_probs, static_kwarg="prompt_width",
                in_shardings=(param_shardings(params, self.mesh, self.rules), rows, rows, rows, rows),
                out_shardings=(replicated, replicated),
            )
            self._fn_tree = tree
        return self._fn

    def _log_probs(self, params, input_ids, positions, attention_mask, response_ids, *, prompt_width):
        logits = _forward_response(
            self.graphdef, params, input_ids, positions, attention_mask, prompt_width, self.temperature,
            self.activation_sharding,
        )
        return log_probs_from_logits(logits, response_ids), entropy_from_logits(logits)

    def __call__(self, params, batch: RLBatch) -> tuple[np.ndarray, np.ndarray]:
        """Returns ``(log_probs, entropy)``, float32 ``[N, R]`` each, zeroed where ``response_mask`` is 0."""
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
            outs_lp.append(np.asarray(lp)[:n])
            outs_ent.append(np.asarray(ent)[:n])
        rmask = batch.response_mask.astype(np.float32)
        return np.concatenate(outs_lp) * rmask, np.concatenate(outs_ent) * rmask


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """The loss knobs of ``actor_rollout_ref.actor`` (verl names)."""

    loss_mode: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    tis_imp_ratio_cap: float = -1.0  # > 0: truncated importance sampling against the rollout engine's log-probs
    options: tuple = ()  # the loss's own options, ((name, value), ...) from actor.policy_loss


class ActorWorker:
    """The trainable policy.

    Args:
      graphdef, params: ``nnx.split`` of the decoder.
      actor_cfg: the ``actor_rollout_ref.actor`` config section.
      rollout_n: responses per prompt (mini-batch size in rows is ``ppo_mini_batch_size * rollout_n``).
      temperature: rollout temperature used to scale logits.
      log_prob_micro_batch_size: rows per call when recomputing old log-probs.
      total_training_steps: RL steps in the run (learning-rate schedule).
      seed: for mini-batch shuffling when ``actor.shuffle`` is true.
      ref_params: the frozen reference policy; required for ``kl_loss_type="full"`` (the exact KL needs the
        reference's whole distribution inside the loss), unused otherwise.
      mesh: the train mesh (:class:`jax.sharding.Mesh` with the rules' axes), or None for one device. With a mesh,
        ``params`` (and ``ref_params``) are placed by the rules, the optimizer state too, and every micro-batch
        (``ppo_micro_batch_size_per_gpu`` rows, ``log_prob_micro_batch_size`` rows) is split over the batch axes.
      rules: logical-axis rules on ``mesh`` (default :data:`sharding.rules.DEFAULT_RULES`).

    Raises:
      ValueError: ``kl_loss_type="full"`` without ``ref_params``; a micro-batch that does not divide the
        mini-batch; on a mesh, a micro-batch that is not a multiple of the batch shards.
    """

    def __init__(
        self,
        graphdef,
        params,
        actor_cfg,
        *,
        rollout_n: int,
        temperature: float,
        log_prob_micro_batch_size: int,
        total_training_steps: int,
        seed: int = 0,
        ref_params=None,
        mesh=None,
        rules=None,
    ):
        self.graphdef = graphdef
        self.params = params
        self.cfg = actor_cfg
        self.mesh = mesh
        self.rules = DEFAULT_RULES if rules is None else rules
        self.activation_sharding = activation_sharding(mesh, self.rules)
        self.mini_batch_rows = actor_cfg.ppo_mini_batch_size * rollout_n
        self.micro_batch_rows = actor_cfg.ppo_micro_batch_size_per_gpu
        # The reference params, needed inside the loss only for the exact ("full") KL over the vocabulary.
        self.ref_params = ref_params if actor_cfg.use_kl_loss and actor_cfg.kl_loss_type == "full" else None
        if actor_cfg.use_kl_loss and actor_cfg.kl_loss_type == "full" and ref_params is None:
            raise ValueError("actor.kl_loss_type='full' needs the reference params (ref_params=...)")
        if self.mini_batch_rows % self.micro_batch_rows:
            raise ValueError(
                f"ppo_mini_batch_size*rollout.n = {self.mini_batch_rows} must be divisible by "
                f"ppo_micro_batch_size_per_gpu = {self.micro_batch_rows}"
            )
        self.param_shardings = None  # mesh only: the params' NamedShardings (also the jit in/out shardings)
        self.opt_shardings = None
        if mesh is not None:
            check_row_shards(self.micro_batch_rows, batch_shards(mesh, self.rules),
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
            self.params, self.param_shardings = shard_tree(params, mesh, self.rules)
            if self.ref_params is not None:
                self.ref_params = shard_state(self.ref_params, self.param_shardings)
        self.temperature = float(temperature)
        self.loss_cfg = PolicyLossConfig(
            loss_mode=actor_cfg.policy_loss.loss_mode,
            clip_ratio_low=actor_cfg.clip_ratio_low,
            clip_ratio_high=actor_cfg.clip_ratio_high,
            clip_ratio_c=actor_cfg.clip_ratio_c,
            loss_agg_mode=actor_cfg.loss_agg_mode,
            entropy_coeff=actor_cfg.entropy_coeff,
            use_kl_loss=actor_cfg.use_kl_loss,
            kl_loss_coef=actor_cfg.kl_loss_coef,
            kl_loss_type=actor_cfg.kl_loss_type,
            tis_imp_ratio_cap=actor_cfg.tis_imp_ratio_cap,
            options=_loss_options(actor_cfg.policy_loss),
        )
        self._policy_loss = get_policy_loss(self.loss_cfg.loss_mode)
        # recompute_old_log_prob=False: pi_old = stop_gradient(current log-probs) in the loss (see the schema)
        self.on_policy_ratio = not getattr(actor_cfg, "recompute_old_log_prob", True)
        self.rng = np.random.default_rng(seed)
        self.log_prob = LogProbComputer(graphdef, micro_batch_size=log_prob_micro_batch_size, temperature=temperature,
                                        mesh=mesh, rules=rules)
        # The schedule counts optimizer updates; verl counts RL steps: pass updates per step so they agree.
        self.updates_per_step = actor_cfg.ppo_epochs  # x mini-batches, fixed once the batch size is known
        self._tx = None
        self.opt_state = None
        self.num_updates = 0  # optimizer updates applied so far (the schedule's count)
        self._total_training_steps = total_training_steps
        if mesh is None:
            self._update_fn = jax.jit(self._update_minibatch, donate_argnums=(0, 1), static_argnames=("prompt_width",))
        else:
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
        """Build the optimizer once the number of responses per RL step is known."""
        n_mini = math.ceil(rows_per_step / self.mini_batch_rows)
        self.updates_per_step = self.cfg.ppo_epochs * n_mini
        self._tx, self.schedule = make_optimizer(
            self.cfg.optim,
            grad_clip=self.cfg.grad_clip,
            total_training_steps=self._total_training_steps,
            updates_per_step=self.updates_per_step,
        )
        self.opt_state = self._tx.init(self.params)
        if self.mesh is not None:
            self.opt_state, self.opt_shardings = shard_tree(self.opt_state, self.mesh, self.rules)
            self._update_fn = self._sharded_update_fn()

    def _sharded_update_fn(self):
        """The mini-batch update as one jit with explicit shardings: params / optimizer state by the rules, the
        stacked ``[num_micro, micro_rows, ...]`` batch with rows (dim 1) over the batch axes, scalars and metrics
        replicated."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        rows = rows_sharding(self.mesh, self.rules, row_dim=1)
        ref = None if self.ref_params is None else self.param_shardings
        return jit_sharded(
            self._update_minibatch, donate_argnums=(0, 1), static_kwarg="prompt_width",
            in_shardings=(self.param_shardings, self.opt_shardings, rows, replicated, replicated, ref),
            out_shardings=(self.param_shardings, self.opt_shardings, replicated),
        )

    # -- phases ----------------------------------------------------------------------------------------------

    def compute_log_probs(self, batch: RLBatch) -> tuple[np.ndarray, np.ndarray]:
        """``(old_log_probs, entropy)`` float32 ``[N, R]`` under the current params."""
        return self.log_prob(self.params, batch)

    def _micro_loss(self, params, micro, num_tokens, num_seqs, prompt_width, ref_params=None):
        c = self.loss_cfg
        logits = _forward_response(
            self.graphdef, params, micro["input_ids"], micro["positions"], micro["attention_mask"], prompt_width,
            self.temperature, self.activation_sharding,
        )
        mask = micro["response_mask"]
        log_prob = log_probs_from_logits(logits, micro["response_ids"])
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
            loss_agg_mode=c.loss_agg_mode, rollout_is_weights=is_weights, **norms,
            **_supported(self._policy_loss, dict(c.options)),
        )
        loss = pg_loss
        metrics = {"actor/pg_loss": pg_loss}
        if c.entropy_coeff != 0:
            # Only when it is in the loss (verl's ``calculate_entropy = entropy_coeff != 0``): an exp and a sum over
            # [B, R, V] per micro-batch. Otherwise actor/entropy comes from the old-log-prob pass (the trainer).
            entropy_loss = agg_loss(entropy_from_logits(logits), mask, c.loss_agg_mode, **norms)
            loss = loss - c.entropy_coeff * entropy_loss
            metrics["actor/entropy"] = entropy_loss
        if c.use_kl_loss and c.kl_loss_type == "full":
            # Exact KL over the vocabulary: the reference's whole distribution, recomputed on this micro-batch.
            ref_logits = jax.lax.stop_gradient(_forward_response(
                self.graphdef, ref_params, micro["input_ids"], micro["positions"], micro["attention_mask"],
                prompt_width, self.temperature, self.activation_sharding,
            ))
            kld = kl_penalty(jax.nn.log_softmax(logits, -1), jax.nn.log_softmax(ref_logits, -1), "full")
            kl_loss = agg_loss(kld, mask, c.loss_agg_mode, **norms)
            loss = loss + c.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss
        elif c.use_kl_loss:
            kld = kl_penalty(log_prob, micro["ref_log_probs"], c.kl_loss_type)
            kl_loss = agg_loss(kld, mask, c.loss_agg_mode, **norms)
            loss = loss + c.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss
        # Ratio-type metrics are means over the micro-batch: weight them by its token count.
        tokens = jnp.sum(mask)
        weighted = {f"actor/{k}": v * tokens for k, v in pg_metrics.items()}
        return loss, (metrics, weighted, tokens)

    def accumulate_grads(self, params, minibatch, num_tokens, num_seqs, *, prompt_width, ref_params=None):
        """Gradient of the mini-batch loss, accumulated over its micro-batches with ``lax.scan``.

        Args:
          minibatch: dict of arrays stacked ``[num_micro, micro_rows, ...]`` (see :meth:`update`).
          num_tokens, num_seqs: float32 scalars, valid tokens / sequences of the whole mini-batch (the loss
            normalisers, so the sum over micro-batches equals the full mini-batch loss exactly).

        Returns:
          ``(grads, metrics)``: grads with the params' structure; loss terms summed over micro-batches,
          ratio metrics (clip fractions, ppo_kl) token-weighted means.
        """
        return scan_accumulate(
            lambda p, micro: self._micro_loss(p, micro, num_tokens, num_seqs, prompt_width, ref_params),
            params, minibatch,
        )

    def _update_minibatch(self, params, opt_state, minibatch, num_tokens, num_seqs, ref_params, *, prompt_width):
        """One optimizer update from a mini-batch stacked as ``[num_micro, micro_rows, ...]``."""
        grads, metrics = self.accumulate_grads(
            params, minibatch, num_tokens, num_seqs, prompt_width=prompt_width, ref_params=ref_params
        )
        new_params, new_opt_state, grad_norm, finite = guarded_update(self._tx, grads, opt_state, params)
        metrics["actor/grad_norm"] = grad_norm
        metrics["actor/nonfinite_grad"] = 1.0 - finite.astype(jnp.float32)
        return new_params, new_opt_state, metrics

    def minibatch_arrays(self, batch: RLBatch) -> dict[str, np.ndarray]:
        """The per-row arrays the loss reads, ``[N, ...]`` each (without an old pass, ``old_log_probs`` holds the
        rollout's log-probs as a placeholder the loss never reads)."""
        if batch.old_log_probs is None:
            if not self.on_policy_ratio:
                raise ValueError("actor update needs batch.old_log_probs, which is not set")
            batch = dataclasses.replace(batch, old_log_probs=batch.rollout_log_probs)
        return {
            "input_ids": batch.input_ids(),
            "positions": batch.positions(),
            "attention_mask": batch.attention_mask(),
            "response_ids": batch.response_ids,
            "response_mask": batch.response_mask.astype(np.float32),
            "old_log_probs": batch.old_log_probs,
            "advantages": batch.advantages,
            "ref_log_probs": batch.ref_log_probs if batch.ref_log_probs is not None else batch.old_log_probs,
            "rollout_log_probs": (
                batch.rollout_log_probs if batch.rollout_log_probs is not None else batch.old_log_probs
            ),
        }

    stack_micro = staticmethod(stack_micro)

    def update(self, batch: RLBatch) -> dict[str, float]:
        """Run ``ppo_epochs`` passes of mini-batch updates over ``batch``; returns averaged metrics.

        Requires ``old_log_probs`` and ``advantages`` (and ``ref_log_probs`` when ``use_kl_loss``).
        """
        if self._tx is None:
            self.init_optimizer(batch.size)
        needed = (["advantages"] + ([] if self.on_policy_ratio else ["old_log_probs"])
                  + (["ref_log_probs"] if self.loss_cfg.use_kl_loss else []))
        if self.on_policy_ratio and (self.cfg.ppo_epochs != 1 or batch.size > self.mini_batch_rows):
            raise ValueError(
                f"recompute_old_log_prob=False needs one on-policy update per step, but ppo_epochs="
                f"{self.cfg.ppo_epochs} and {batch.size} rows make "
                f"{self.cfg.ppo_epochs * math.ceil(batch.size / self.mini_batch_rows)} updates"
            )
        for name in needed:
            if getattr(batch, name) is None:
                raise ValueError(f"actor update needs batch.{name}, which is not set")
        arrays = self.minibatch_arrays(batch)
        mini, micro = self.mini_batch_rows, self.micro_batch_rows
        history: list[dict] = []
        for _ in range(self.cfg.ppo_epochs):
            order = self.rng.permutation(batch.size) if self.cfg.shuffle else np.arange(batch.size)
            for start in range(0, batch.size, mini):
                idx = order[start : start + mini]
                stacked, num_tokens, num_seqs = self.stack_micro(arrays, idx, mini, micro)
                self.params, self.opt_state, metrics = self._update_fn(
                    self.params, self.opt_state, stacked, num_tokens, num_seqs, self.ref_params,
                    prompt_width=batch.prompt_width,
                )
                history.append(metrics)
                self.num_updates += 1
        out = {k: float(np.mean([float(h[k]) for h in history])) for k in history[0]}
        out["actor/nonfinite_grad"] = float(np.sum([float(h["actor/nonfinite_grad"]) for h in history]))
        out["actor/lr"] = float(self.schedule(self.num_updates - 1))
        if self.loss_cfg.use_kl_loss:
            out["actor/kl_coef"] = self.loss_cfg.kl_loss_coef
        return out
