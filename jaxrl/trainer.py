"""The single controller: the RL loop, phase by phase, with validation and the checkpoint cadence.

Read :meth:`Trainer.train_step` top to bottom; it is the whole algorithm::

    gen -> reward -> old_log_prob -> ref -> values -> prm -> adv -> update_critic -> update_actor -> sync

``gen`` and ``reward`` are one call to the experience maker (:mod:`jaxrl.experience`); everything else it calls
is a role (``jaxrl.workers``), the rollout engine (``jaxrl.rollout``) or a pure function (``jaxrl.algorithms``).
:meth:`Trainer.fit` is the loop around it: resume, validation every ``test_freq`` steps, a checkpoint every
``save_freq`` steps (what a checkpoint holds: :mod:`jaxrl.run_checkpoint`), SIGTERM, the non-finite guard.
:func:`jaxrl.build.build` constructs the components; :func:`run_training` (build, fit, export) is what
``python -m jaxrl.train`` calls.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np

from jaxrl import distributed
from jaxrl.batch import RLBatch
from jaxrl.build import Components, build
from jaxrl.compilation_cache import use_compilation_cache
from jaxrl.experience import decode_responses, numeric_extras, sampling_params, score_responses
from jaxrl.host_memory import release_free_memory, set_up_host_memory
from jaxrl.loop import NonFiniteTrainingError, TrainingLoop, export_final_model, setup_run_logging
from jaxrl.metrics import (batch_metrics, compile_clock, memory_metrics, phase_peaks, plot_rewards,
                           rollout_mismatch_metrics, timed, validation_metrics)
from jaxrl.program_budget import ProgramBudget
from jaxrl.run_checkpoint import RunCheckpoints

log = logging.getLogger("jaxrl")

__all__ = ["NonFiniteTrainingError", "Trainer", "run_training"]  # the error is jaxrl.loop's (re-exported)


class Trainer(TrainingLoop):
    """Runs GRPO/PPO-family training over :class:`Components` (the loop itself: :class:`jaxrl.loop.TrainingLoop`)."""

    progress_key, progress_label = "critic/score/mean", "score"
    nonfinite_keys = ("actor/nonfinite_grad", "critic/nonfinite_grad", "reward_model/nonfinite_grad")

    def __init__(self, c: Components):
        from jaxrl.algorithms import get_kl_controller

        super().__init__(c)
        cfg = c.cfg
        self.rollout_cfg = cfg.actor_rollout_ref.rollout
        self.max_new_tokens = self.rollout_cfg.max_new_tokens or cfg.data.max_response_length
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = get_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon)
        self.checkpoints = RunCheckpoints(c)  # what a checkpoint holds; this class decides when
        self.online_dpo = bool(cfg.algorithm.dpo.enable)
        self.pipeline = None  # async_training.staleness > 0: batches generated ahead of training (jaxrl.async_rollout)
        self.program_budget = ProgramBudget(cfg.trainer.max_compiled_prompt_widths)
        if self.program_budget.max_widths is not None and c.memory_metrics is not None:
            raise ValueError(f"trainer.max_compiled_prompt_widths={self.program_budget.max_widths} does not work in a "
                             "hybrid (Ray worker group) run: the programs live in the groups' processes; set it to "
                             "null")
        if cfg.async_training.staleness:
            from jaxrl.async_rollout import AsyncRollout, WholeBatches

            generator = self._staged_rollout() if cfg.async_training.partial_rollout else WholeBatches(self._produce)
            self.pipeline = AsyncRollout(staleness=cfg.async_training.staleness, total_steps=c.total_training_steps,
                                         generator=generator, sync_weights=self.sync_rollout, data=c.train_data)

    # -- one RL step -----------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One RL step; returns its metrics (verl names)."""
        c, cfg = self.c, self.c.cfg
        t: dict[str, float] = {}
        compile_clock.take()  # from here: this step's compiles (validation's, between steps, are not counted)
        with timed("step", t):
            # phases gen + reward (ReMax: + gen_max; DAPO: several rounds): the batch with its token_level_scores
            if self.pipeline is None:
                batch, metrics = c.experience.make_experience(c.train_data, seed=self._seed(), timings=t)
                epoch = c.train_data.epoch
            else:  # generated ahead, by weights at most async_training.staleness steps old
                batch, metrics, epoch = self._take_ready(t)
            # several processes: every replica must train on the same batch (fails loudly, naming the step)
            distributed.check_replicas(self.step, batch.prompt_ids, batch.response_ids, batch.response_mask)

            if self.online_dpo:  # algorithm.dpo.enable: pairs from the samples, the preference loss, no advantages
                self._online_dpo_update(batch, metrics, t)
            else:
                if cfg.actor_rollout_ref.actor.recompute_old_log_prob:  # else on-policy: the update uses its own
                    with timed("old_log_prob", t):
                        batch.old_log_probs, entropy = c.actor.compute_log_probs(batch)
                        metrics.update(rollout_mismatch_metrics(batch, entropy))

                if c.ref is not None:
                    with timed("ref", t):
                        batch.ref_log_probs, _ = c.ref.compute_log_probs(batch)

                if c.critic is not None:
                    with timed("values", t):
                        batch.values = c.critic.compute_values(batch)

                if c.prm is not None:  # PRIME: update the implicit PRM on the outcome labels, score the tokens
                    with timed("prm", t):
                        batch.rm_scores, prm_metrics = c.prm.step(batch)
                        metrics.update(prm_metrics)

                with timed("adv", t):
                    batch.token_level_rewards = self._apply_kl_in_reward(batch, metrics)
                    batch.advantages, batch.returns = self._advantages(batch)

                # a checkpoint save still writing in the background holds a host copy of the state: it finishes
                # before the updates' temporaries (the step's memory peak) are allocated, so the two never add up
                # (it normally has finished during generation; a failure is logged and recorded, as at the next save)
                if c.store.pending is not None:
                    with timed("save_wait", t):
                        c.store.settle()
                # past trainer.max_compiled_prompt_widths, the compiled programs go too (jaxrl.program_budget)
                if self.program_budget.max_widths is not None:
                    with timed("drop_programs", t):
                        self.program_budget.enforce(batch.prompt_width)
                    metrics["perf/compiled_programs_dropped"] = float(self.program_budget.drops)  # so far
                # the rollout's freed buffers back to the OS before the updates' temporaries (the step's peak) are
                # allocated: glibc keeps freed pages mapped otherwise, and they add to that peak
                release_free_memory()
                if c.critic is not None:
                    with timed("update_critic", t):
                        metrics.update(c.critic.update(batch))

                if self.step > cfg.trainer.critic_warmup:  # PPO: let the critic learn first
                    with timed("update_actor", t):
                        metrics.update(c.actor.update(batch))
                    self._sync_phase(metrics, t)

            if self.pipeline is not None:  # wait for the batch in flight, new weights -> engine, launch the next
                with timed("sync", t):
                    metrics.update(self.pipeline.advance(self.step, sync=self.step > cfg.trainer.critic_warmup))

        metrics.update(batch_metrics(batch))
        if self.pipeline is not None:
            metrics["perf/gen_overlap_ratio"] = metrics["timing_s/gen_overlap"] / max(t["step"], 1e-9)
        metrics.update({f"timing_s/{k}": v for k, v in t.items()})
        n_tokens = int(batch.response_mask.sum() + batch.prompt_mask.sum())
        metrics["perf/total_num_tokens"] = n_tokens
        metrics["perf/throughput"] = n_tokens / max(t["step"], 1e-9)
        metrics.update(compile_clock.take())  # how much of timing_s/step was making XLA programs
        release_free_memory()  # the step's freed buffers (and a finished async save's host copy) back to the OS
        # hybrid: the groups' members report their memory and compiles (the driver's replace this process's)
        if c.memory_metrics is not None:
            metrics.update(c.memory_metrics())
            phase_peaks.take()  # (the driver's own phases: not the run's memory)
        else:  # the step-end RSS, the process's peak, and each phase's peak
            metrics.update({**memory_metrics(), **phase_peaks.take()})
        metrics["training/epoch"] = epoch
        return metrics

    def _sync_phase(self, metrics: dict, t: dict) -> None:
        """Phase ``sync`` after an update: the new weights into the rollout engine. With the async pipeline the engine
        may still be generating with the previous weights; :meth:`AsyncRollout.advance` syncs once it is idle."""
        if self.pipeline is None:
            with timed("sync", t):
                metrics["sync/bytes"] = self.sync_rollout()

    def _produce(self, index: int) -> tuple[RLBatch, dict, dict, int]:
        """Phases gen + reward of the batch step ``index`` trains on (the async pipeline's generation thread): the
        batch, its metrics, its timings and its prompts' epoch. Seeded by ``index``, as the synchronous step."""
        c, t = self.c, {}
        batch, metrics = c.experience.make_experience(c.train_data, seed=self._seed(index), timings=t)
        return batch, metrics, t, c.train_data.epoch

    def _staged_rollout(self):
        """Partial rollouts (``async_training.partial_rollout``): each batch generated in ``staleness`` stages, one
        per step (:class:`jaxrl.partial_rollout.StagedRollout`), then scored by the experience maker."""
        import dataclasses

        from jaxrl.partial_rollout import StagedRollout

        c = self.c
        rc = self.rollout_cfg

        def sampling(index: int, stage: int, max_new_tokens: int, n: int | None):
            sp = sampling_params(rc, self.max_new_tokens, validation=False, seed=self._seed(index))
            return dataclasses.replace(sp, max_new_tokens=max_new_tokens, n=sp.n if n is None else n,
                                       seed=(sp.seed + 7919 * stage) % 2**32)

        def finish(index: int, prompts, output, timings: dict):
            metrics: dict = {}
            batch, _ = c.experience.generate_and_score(prompts, seed=self._seed(index), timings=timings,
                                                       metrics=metrics, output=output)
            return batch, metrics, prompts.epoch

        eos = () if rc.ignore_eos else tuple(getattr(c.rollout, "eos_token_ids", ()))
        return StagedRollout(stages=self.c.cfg.async_training.staleness, response_width=self.max_new_tokens,
                             generate=c.rollout.generate, sampling=sampling, draw=c.train_data.next_batch,
                             prompts_of=c.train_data.batch_of, finish=finish,
                             stop_ids=eos + tuple(rc.stop_token_ids or ()))

    def _take_ready(self, t: dict) -> tuple[RLBatch, dict, int]:
        """The async pipeline's batch for this step (started on the first step after a start or resume), with its
        round's metrics and timings and the pipeline's metrics."""
        if not self.pipeline.started:
            self.checkpoints.fingerprint()  # reads the data iterator: before the generation thread draws from it
            self.pipeline.start(self.step - 1)
        ready = self.pipeline.take(self.step)
        t.update(ready.timings)
        metrics = dict(ready.metrics)
        metrics.update(self.pipeline.staleness_metrics(ready, trained_version=self.step - 1))
        return ready.batch, metrics, ready.epoch

    def _online_dpo_update(self, batch: RLBatch, metrics: dict, t: dict) -> None:
        """Online DPO (``algorithm.dpo.enable``): the best and the worst scored sample of each group become a pair
        (:func:`jaxrl.algorithms.best_worst_pairs`; groups whose scores are all equal give none), the frozen
        reference scores both, the actor takes the preference loss, the rollout engine the new weights. A step
        without a pair updates nothing (``dpo/pairs`` = 0)."""
        from jaxrl.algorithms import best_worst_pairs, sequence_log_probs
        from jaxrl.batch import PairBatch

        c = self.c
        batch.token_level_rewards = batch.token_level_scores  # no in-reward KL: DPO's beta is its KL term
        with timed("pairs", t):
            chosen, rejected, tied = best_worst_pairs(batch.token_level_scores.sum(-1), batch.group_ids)
        metrics["dpo/pairs"] = float(len(chosen))
        metrics["dpo/tied_groups"] = float(tied)
        if not len(chosen):
            return
        pairs = PairBatch(batch.select(chosen), batch.select(rejected))
        with timed("ref", t):
            both = pairs.both()
            ref, _ = c.ref.compute_log_probs(both)
            ref = np.asarray(sequence_log_probs(ref, both.response_mask), np.float32)
            pairs.ref_chosen_logps, pairs.ref_rejected_logps = ref[: pairs.size], ref[pairs.size:]
        if self.step > self.c.cfg.trainer.critic_warmup:
            with timed("update_actor", t):
                metrics.update(c.actor.update(pairs))
            self._sync_phase(metrics, t)

    def sync_rollout(self) -> int:
        """Give the rollout engine the actor's current weights through the run's
        :class:`~jaxrl.rollout.weight_sync.WeightSync` (the only caller of ``engine.update_weights``); returns the
        bytes moved between devices. With LoRA the engine gets the merged weights (``ActorWorker.merged_params``).
        With the async pipeline on the train devices (no mesh, or colocated) the engine gets a copy: it generates
        while the next update donates the actor's buffers. Any failure raises ``WeightSyncError``."""
        params = self.c.actor.rollout_params()
        if self.pipeline is not None and (self.c.placement is None or self.c.placement.kind == "colocated"):
            import jax

            params = jax.tree.map(lambda x: x.copy(), params)
        return self.c.weight_sync.sync(params).bytes_moved

    def _seed(self, step: int | None = None) -> int:
        return int(self.c.cfg.trainer.seed) * 1_000_003 + (self.step if step is None else step)

    def _apply_kl_in_reward(self, batch: RLBatch, metrics: dict) -> np.ndarray:
        """``algorithm.use_kl_in_reward``: rewards = scores - beta * KL(old || ref) per token (verl
        ``apply_kl_penalty``); beta comes from the fixed or adaptive controller (``algorithm.kl_ctrl``), which
        is updated with this step's KL."""
        alg = self.c.cfg.algorithm
        if not alg.use_kl_in_reward:
            return batch.token_level_scores
        from jaxrl.algorithms import apply_kl_penalty

        beta = float(self.kl_ctrl.value)
        rewards, current_kl = apply_kl_penalty(
            batch.token_level_scores, batch.old_log_probs, batch.ref_log_probs,
            batch.response_mask.astype(np.float32), beta, alg.kl_penalty,
        )
        self.kl_ctrl = self.kl_ctrl.update(float(current_kl), batch.size)
        metrics["actor/reward_kl_penalty"] = float(current_kl)
        metrics["actor/reward_kl_penalty_coeff"] = beta
        return np.asarray(rewards, np.float32)

    def _advantages(self, batch: RLBatch) -> tuple[np.ndarray, np.ndarray]:
        """The estimator's advantages and returns ``[N, R]`` (:func:`compute_advantages`)."""
        return compute_advantages(self.c.cfg.algorithm, batch)

    # -- validation ------------------------------------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        """Score the validation set with ``rollout.val_kwargs``: ``val-core/<data_source>/<reward|acc>/mean@n``
        (and best@n / worst@n / maj@n when ``val_kwargs.n > 1``; see :func:`jaxrl.metrics.validation_metrics`)."""
        c, cfg = self.c, self.c.cfg
        if not c.val_rows:
            return {}
        if self.pipeline is not None:  # the engine is the generation thread's until its batch is done
            self.pipeline.wait_idle()
        sp = sampling_params(self.rollout_cfg, self.max_new_tokens, validation=True, seed=self._seed() + 7)
        bs = cfg.data.val_batch_size or len(c.val_rows)
        sources, prompt_ids, samples, preds = [], [], [], []
        values: dict[str, list] = {"reward": []}
        for start in range(0, len(c.val_rows), bs):
            chunk = c.val_rows[start : start + bs]
            agent = getattr(c.experience, "agent", None)  # multi_turn.enable: validation runs the same tool loop
            if agent is None:
                out, env_rewards = c.rollout.generate([r["prompt_ids"] for r in chunk], sp), None
            else:
                mt = agent.run([r["row"] for r in chunk], sp, prompt_key=cfg.data.prompt_key)
                out, env_rewards = mt.output, mt.env_rewards
            self.program_budget.note(out.prompt_ids.shape[1])  # its programs count until the next update
            texts = decode_responses(c.tokenizer, out.response_ids, out.response_mask)
            rew = score_responses(c.reward, [r["row"] for r in chunk], out.prompt_index, texts)
            scores = rew.scores if env_rewards is None else rew.scores + env_rewards
            values["reward"].extend(scores.tolist())
            for key, vals in numeric_extras(rew).items():  # acc (val-core), format, ... (val-aux), as verl
                values.setdefault(key, [np.nan] * (len(values["reward"]) - len(scores))).extend(vals.tolist())
            for vals in values.values():  # an extra a chunk did not give: NaN, left out of its means
                vals.extend([np.nan] * (len(values["reward"]) - len(vals)))
            preds.extend(rew.extra.get("pred", [None] * len(texts)))
            sources.extend(chunk[i]["row"].get("data_source", "unknown") for i in out.prompt_index)
            prompt_ids.extend((start + out.prompt_index).tolist())
            samples.extend(zip(texts, scores))
        has_preds = any(p is not None for p in preds)
        metrics = validation_metrics(
            sources, np.asarray(prompt_ids), {k: np.asarray(v) for k, v in values.items()},
            [str(p) for p in preds] if has_preds else None, sp.n,
        )
        shown = samples[: cfg.trainer.log_val_generations]
        if shown and distributed.is_primary():  # one writer
            with open(c.out_dir / "val_generations.jsonl", "a") as f:
                for text, score in shown:
                    log.info("val sample (score %.3f): %r", score, text[:300])
                    f.write(json.dumps({"step": self.step, "score": float(score), "response": text}) + "\n")
        return metrics

    # -- the loop (jaxrl.loop.TrainingLoop.fit) ---------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        """:meth:`jaxrl.loop.TrainingLoop.fit`; the async pipeline's generation thread ends with it."""
        try:
            return super().fit()
        finally:
            if self.pipeline is not None:
                self.pipeline.close()

    def has_validation(self) -> bool:
        return bool(self.c.val_rows)

    def after_log(self, metrics: dict[str, float]) -> None:
        c = self.c
        if any(k.startswith("val-core/") for k in metrics) and c.logger.writes and c.logger.jsonl_path.exists():
            plot_rewards(c.logger.jsonl_path, c.out_dir / "reward.png")  # the plot follows the run

    # -- checkpoints -----------------------------------------------------------------------------------------

    def save_checkpoint(self) -> bool:
        """Save the full training state at the current step (:meth:`RunCheckpoints.save_checkpoint`); a failed
        save is logged and training goes on. Whether the run's final checkpoint made it to disk is checked by
        :meth:`fit`."""
        extra = None
        if self.pipeline is not None and self.pipeline.started:  # the batches generated ahead, the data position
            extra = {"async_rollout": self.pipeline.state()}
        return self.checkpoints.save_checkpoint(self.step, self.kl_ctrl, extra=extra)

    def resume(self) -> bool:
        """Restore the checkpoint ``trainer.resume_mode`` names (:meth:`RunCheckpoints.resume`: roles, data
        position), then this loop's state (step, KL coefficient), the rollout engine's weights and the metrics
        log; True if one was restored.

        Raises:
          CheckpointIncompatibleError: the checkpoint was written by an incompatible configuration; nothing was
            restored or moved.
          CheckpointRestoreError: no checkpoint could be read.
        """
        resumed = self.checkpoints.resume()
        if resumed is None:
            return False
        if resumed.kl_ctrl_value is not None:
            self.kl_ctrl = self.kl_ctrl._replace(value=resumed.kl_ctrl_value)  # target/horizon: this run's config
        self.step = resumed.step
        self.sync_rollout()  # the params were restored onto the train shardings (like=state_arrays())
        if self.pipeline is not None and "async_rollout" in resumed.meta:  # saved before the pipeline started: none
            self.pipeline.load_state(resumed.meta["async_rollout"])
        self.c.logger.truncate_after(resumed.step)  # steps logged after this checkpoint will be logged again
        log.info("resumed from %s at step %d", resumed.path, resumed.step)
        return True


def compute_advantages(algorithm_cfg, batch: RLBatch) -> tuple[np.ndarray, np.ndarray]:
    """The configured estimator's advantages and returns, as the ``adv`` phase computes them.

    The estimator named by ``algorithm.adv_estimator`` gets exactly the options its registry entry declares (from
    ``algorithm.*``, e.g. ``norm_adv_by_std_in_grpo``, ``adv_std_epsilon``) and the batch arrays it reads
    (``values``, ``reward_baselines``), by name.

    Args:
      algorithm_cfg: the ``algorithm`` config section (:class:`jaxrl.config.schema.AlgorithmConfig`).
      batch: needs ``token_level_rewards`` ``[N, R]``, ``response_mask``, ``group_ids`` ``[N]`` and the arrays the
        estimator reads.

    Returns:
      ``(advantages, returns)``, float32 ``[N, R]`` each.

    Raises:
      ValueError: an unknown estimator (the message lists the registered ones) or what the estimator raises.
    """
    from jaxrl.algorithms.registry import ADV_ESTIMATORS

    entry = ADV_ESTIMATORS.entry(algorithm_cfg.adv_estimator)
    options = {name: getattr(algorithm_cfg, name) for name in entry.options}
    inputs = {name: getattr(batch, name) for name in entry.inputs}
    adv, ret = entry.load()(
        batch.token_level_rewards, batch.response_mask.astype(np.float32), batch.group_ids.astype(np.int32),
        **options, **inputs,
    )
    return np.asarray(adv, np.float32), np.asarray(ret, np.float32)


def run_training(cfg) -> dict[str, float]:
    """Join the processes' world (:func:`jaxrl.distributed.initialize`; one process: nothing to join), build the
    run, train, write the reward plot and export the final model; returns the last metrics.

    With several processes every one runs this; only the primary writes the plot and the exported model (the
    others wait for it), and only it logs below WARNING."""
    setup_run_logging()
    t0 = time.perf_counter()
    use_compilation_cache(cfg.trainer.jax_compilation_cache_dir)  # before the first compile
    import jax

    # before any buffer: freed large buffers and a compile's freed memory go back to the OS (jaxrl.host_memory)
    set_up_host_memory(jax.monitoring.register_event_duration_secs_listener)
    distributed.initialize(cfg)
    if not distributed.is_primary():
        logging.getLogger("jaxrl").setLevel(logging.WARNING)  # one log: the primary's (warnings from everyone)
    c = build(cfg)
    try:
        log.info(
            "run: %d steps, %d prompts x n=%d per step, output in %s",
            c.total_training_steps, cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, c.out_dir,
        )
        trainer = Trainer(c)
        try:
            if distributed.is_primary():  # the primary scores for every process (jaxrl.experience.score_responses)
                c.reward.start()  # scoring processes import the reward function while the first rollout compiles
            last = trainer.fit()
        finally:
            c.reward.close()  # no scoring process outlives the run
            c.logger.close()
            shutdown = getattr(c.rollout, "shutdown", None)  # vLLM: its engine (and worker process, if any)
            if shutdown is not None:
                shutdown()
        if c.logger.writes and c.logger.jsonl_path.exists():
            png = plot_rewards(c.logger.jsonl_path, c.out_dir / "reward.png")
            log.info("reward plot: %s", png)
        export_final_model(c, base_model_path=cfg.actor_rollout_ref.model.path)
        log.info("done in %.1f s", time.perf_counter() - t0)
        return last
    finally:
        c.store.close()  # idempotent; also on errors, so orbax's threads never outlive the run
        if c.lock is not None:
            c.lock.release()
