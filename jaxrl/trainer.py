"""The single controller: the RL loop, phase by phase.

Read :meth:`Trainer.train_step` top to bottom; it is the whole algorithm::

    gen -> reward -> old_log_prob -> ref -> adv -> update_actor -> sync

Everything it calls is a role (``jaxrl.workers``), a rollout engine (``jaxrl.rollout``), a reward
manager (``jaxrl.rewards``) or a pure function (``jaxrl.algorithms``). :func:`build` wires them from the
config; :func:`run_training` is what ``python -m jaxrl.train`` calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import signal
import threading
import time
from pathlib import Path

import numpy as np

from jaxrl.batch import RLBatch, concat_batches
from jaxrl.metrics import MetricsLogger, _stats, batch_metrics, plot_rewards, timed, validation_metrics
from jaxrl.rewards.manager import RewardOutput
from jaxrl.rewards.shaping import groups_with_signal

log = logging.getLogger("jaxrl")


@dataclasses.dataclass
class Components:
    """Everything a run is made of, built from the config by :func:`build`."""

    cfg: object
    tokenizer: object
    model_cfg: object
    actor: object
    ref: object | None
    rollout: object
    reward: object
    train_data: object
    val_rows: list | None
    logger: MetricsLogger
    out_dir: Path
    total_training_steps: int
    store: object  # jaxrl.checkpoint.CheckpointStore over trainer.default_local_dir
    model_meta: dict  # what jaxrl.export needs to rebuild the policy from a checkpoint
    critic: object | None = None
    placement: object | None = None  # jaxrl.workers.placement.Placement; None = every role on one device
    weight_sync: object | None = None  # jaxrl.rollout.WeightSync: actor params -> the rollout engine's format
    reward_model: object | None = None  # jaxrl.workers.reward_model.RewardModelWorker (reward_model.enable)
    lock: object | None = None  # jaxrl.runlock.RunLock on out_dir, held until run_training ends
    resume_from: tuple | None = None  # find_resume_checkpoint's answer: (root, step | None), or None = fresh start


def _sampling_params(rollout_cfg, max_new_tokens: int, *, validation: bool, seed: int):
    from jaxrl.rollout.base import SamplingParams

    if validation:
        vk = rollout_cfg.val_kwargs
        greedy = (not vk.do_sample) or vk.temperature == 0
        return SamplingParams(
            n=vk.n, temperature=1.0 if greedy else vk.temperature, top_p=vk.top_p, top_k=vk.top_k,
            max_new_tokens=max_new_tokens, do_sample=not greedy,
            stop_token_ids=tuple(rollout_cfg.stop_token_ids or ()), seed=seed,
        )
    return SamplingParams(
        n=rollout_cfg.n, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k,
        max_new_tokens=max_new_tokens, do_sample=rollout_cfg.do_sample,
        stop_token_ids=tuple(rollout_cfg.stop_token_ids or ()), seed=seed, ignore_eos=rollout_cfg.ignore_eos,
    )


def _call_with_supported_kwargs(fn, *args, **kwargs):
    """Call ``fn`` passing only the keyword arguments its signature declares (estimators differ)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(*args, **kwargs)
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


def decode_responses(tokenizer, response_ids: np.ndarray, response_mask: np.ndarray) -> list[str]:
    """Detokenise the valid part of each response (special tokens such as EOS dropped)."""
    seqs = [row[m.astype(bool)].tolist() for row, m in zip(response_ids, response_mask)]
    return tokenizer.batch_decode(seqs, skip_special_tokens=True)


def score_responses(reward, rows: list[dict], prompt_index: np.ndarray, texts: list[str]):
    """Run the reward manager on decoded responses; ``rows[prompt_index[i]]`` is response ``i``'s data row."""
    rs = [rows[i] for i in prompt_index]
    return reward.score(
        [r.get("data_source", "") for r in rs],
        texts,
        [(r.get("reward_model") or {}).get("ground_truth") for r in rs],
        [r.get("extra_info") for r in rs],
    )


def score_with_reward_model(rm, reward, rows: list[dict], prompt_index: np.ndarray, batch: RLBatch,
                            texts: list[str], metrics: dict, *, combine: str, prompt_key: str) -> RewardOutput:
    """Sequence scores of a round with a reward model, combined with the rule reward as ``reward_model.combine`` says.

    * ``"replace"`` (verl: with ``reward_model.enable`` its reward managers return the RM's ``rm_scores`` and do not
      call the rule function): score = RM score. Rows whose ``reward_model.style`` is ``"rule"`` (or unset) are
      still rule-scored, for the log and for ``acc`` (dynamic sampling); rows marked ``"model"`` (verl's marker for
      data with no rule, e.g. full_hh_rlhf) are not.
    * ``"sum"``: score = RM score + rule score; every row is rule-scored.

    Args:
      rm: a :class:`jaxrl.workers.reward_model.RewardModelWorker`.
      reward: the rule :class:`jaxrl.rewards.RewardManager`.
      rows, prompt_index, texts: as :func:`score_responses` takes them; ``rows[prompt_index[i]]`` is response ``i``'s.
      batch: the round's ids and masks ``[N, P]`` / ``[N, R]``.
      metrics: gets ``reward/rm_score/{mean,max,min}``, ``reward/rule_score/{mean,max,min}`` (over rule-scored rows)
        and, when the RM re-tokenizes, ``reward/rm_num_truncated`` (inputs cut at ``reward_model.max_length``).
      combine: ``"replace"`` or ``"sum"``.
      prompt_key: the rows' raw-prompt field (re-tokenized RM inputs are built from it).

    Returns:
      a :class:`RewardOutput` whose ``scores`` ``[N]`` float32 are the combined scores; errors, timeouts and extra
      outputs (``None`` for rows not rule-scored) are the rule function's.
    """
    rs = [rows[i] for i in prompt_index]
    out = rm.score(batch, [r.get(prompt_key) for r in rs] if rm.retokenizes else None)
    metrics.update(_stats("reward/rm_score", out.scores))
    if rm.retokenizes:
        metrics["reward/rm_num_truncated"] = metrics.get("reward/rm_num_truncated", 0) + out.num_truncated
    ruled = np.ones(len(rs), bool) if combine == "sum" else np.asarray(
        [((r.get("reward_model") or {}).get("style") or "rule") != "model" for r in rs], bool)
    idx = np.flatnonzero(ruled)
    scores = out.scores.astype(np.float32)
    if idx.size == 0:
        return RewardOutput(scores=scores, num_errors=0, num_timeouts=0, first_error=None)
    rule = score_responses(reward, rows, np.asarray(prompt_index)[idx], [texts[i] for i in idx])
    metrics.update(_stats("reward/rule_score", rule.scores.astype(np.float32)))
    if combine == "sum":
        scores = scores + rule.scores.astype(np.float32)
    extra = {}
    for key, values in rule.extra.items():
        full = [None] * len(rs)
        for i, v in zip(idx, values):
            full[i] = v
        extra[key] = full
    return RewardOutput(scores=scores, num_errors=rule.num_errors, num_timeouts=rule.num_timeouts,
                        first_error=rule.first_error, extra=extra, first_traceback=rule.first_traceback)


def _extra_as_array(rew, key: str, default: np.ndarray) -> np.ndarray:
    """A numeric extra output of the reward function (e.g. ``acc``) as ``[N]`` float32; failed calls give 0."""
    values = rew.extra.get(key)
    if values is None:
        return np.asarray(default, np.float32)
    return np.asarray([0.0 if v is None else float(v) for v in values], np.float32)


def _add(metrics: dict, key: str, value: float) -> None:
    metrics[key] = metrics.get(key, 0) + value


def rollout_mismatch_metrics(batch: RLBatch, entropy: np.ndarray) -> dict[str, float]:
    """How far the rollout engine's token probabilities are from the trainer's recompute (same weights).

    ``training/rollout_probs_diff_{mean,max}`` = |p_trainer - p_rollout| over valid tokens; nonzero gaps come
    from numerics (bf16 kernels, another engine). ``actor/entropy_old`` is the pre-update token entropy (token
    mean); it is also ``actor/entropy`` unless the update computes its own (``entropy_coeff != 0``), as verl
    logs the old-log-prob pass's entropy.
    """
    mask = batch.response_mask.astype(bool)
    if not mask.any():
        return {"training/rollout_probs_diff_mean": 0.0, "training/rollout_probs_diff_max": 0.0, "actor/entropy": 0.0}
    gap = np.abs(np.exp(batch.old_log_probs) - np.exp(batch.rollout_log_probs))[mask]
    token_entropy = float(entropy[mask].mean())
    return {
        "training/rollout_probs_diff_mean": float(gap.mean()),
        "training/rollout_probs_diff_max": float(gap.max()),
        "actor/entropy_old": token_entropy,
        "actor/entropy": token_entropy,
    }


def place_scores_on_last_token(scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """Token-level scores ``[N, R]``: each sequence score sits on its last valid response token (verl)."""
    out = np.zeros(response_mask.shape, np.float32)
    last = np.maximum(response_mask.sum(-1) - 1, 0)
    has = response_mask.sum(-1) > 0
    out[np.arange(len(scores))[has], last[has]] = scores[has]
    return out


class Trainer:
    """Runs GRPO/PPO-family training over :class:`Components`."""

    def __init__(self, c: Components):
        from jaxrl.algorithms import get_kl_controller

        self.c = c
        cfg = c.cfg
        self.rollout_cfg = cfg.actor_rollout_ref.rollout
        self.max_new_tokens = self.rollout_cfg.max_new_tokens or cfg.data.max_response_length
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = get_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon)
        self.step = 0
        self.nonfinite_in_a_row = 0
        self._fingerprint: dict | None = None  # see fingerprint()

    # -- one RL step -----------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One RL step; returns its metrics (verl names)."""
        c, cfg = self.c, self.c.cfg
        t: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with timed("step", t):
            batch = self._collect_batch(t, metrics)  # phases gen + reward (DAPO: several rounds)

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

            with timed("adv", t):
                batch.token_level_rewards = self._apply_kl_in_reward(batch, metrics)
                batch.advantages, batch.returns = self._advantages(batch)

            if c.critic is not None:
                with timed("update_critic", t):
                    metrics.update(c.critic.update(batch))

            if self.step > cfg.trainer.critic_warmup:  # PPO: let the critic learn first
                with timed("update_actor", t):
                    metrics.update(c.actor.update(batch))
                with timed("sync", t):
                    metrics["sync/bytes"] = self.sync_rollout()

        metrics.update(batch_metrics(batch))
        metrics.update({f"timing_s/{k}": v for k, v in t.items()})
        n_tokens = int(batch.response_mask.sum() + batch.prompt_mask.sum())
        metrics["perf/total_num_tokens"] = n_tokens
        metrics["perf/throughput"] = n_tokens / max(t["step"], 1e-9)
        metrics["training/epoch"] = c.train_data.epoch
        return metrics

    def sync_rollout(self) -> int:
        """Give the rollout engine the actor's current weights through its ``WeightSync``; returns the bytes moved
        between devices (``sync/bytes``; a failure raises ``WeightSyncError``)."""
        return self.c.weight_sync.sync(self.c.actor.params).bytes_moved

    def _collect_batch(self, t: dict, metrics: dict) -> RLBatch:
        """Generate and score the step's responses.

        Without ``algorithm.filter_groups`` this is one round over the next prompt batch. With it, DAPO's
        dynamic sampling (arXiv 2503.14476, Sec. 3.2; verl ``filter_groups``): groups whose
        ``filter_groups.metric`` is the same for every response are dropped and further prompt batches are
        generated until ``data.train_batch_size`` groups are kept or ``max_num_gen_batches`` rounds ran
        (then the step trains on what it has, with a warning).
        """
        fg = self.c.cfg.algorithm.filter_groups
        if not fg.enable:
            batch, _ = self._generate_and_score(self.c.train_data.next_batch(), t, metrics)
            return batch
        target = self.c.cfg.data.train_batch_size
        kept: list[RLBatch] = []
        n_kept = n_dropped = rounds = 0
        while n_kept < target and not (0 < fg.max_num_gen_batches <= rounds):
            rounds += 1
            batch, seq = self._generate_and_score(self.c.train_data.next_batch(), t, metrics)
            keep = groups_with_signal(seq[fg.metric], batch.group_ids)
            n_dropped += len(np.unique(batch.group_ids[~keep]))
            n_kept += len(np.unique(batch.group_ids[keep]))
            if keep.any():
                kept.append(batch.select(np.flatnonzero(keep)))
        metrics["train/num_gen_batches"] = rounds
        metrics["train/num_dropped_groups"] = n_dropped
        if not kept:  # every group flat: train on the last round (zero advantages, a no-op update)
            log.warning("dynamic sampling kept no group in %d rounds; this step will not move the policy", rounds)
            return batch
        if n_kept < target:
            log.warning("dynamic sampling kept %d of %d groups after %d rounds", n_kept, target, rounds)
        batch = concat_batches(kept)
        first_groups = np.unique(batch.group_ids)[:target]
        return batch.select(np.flatnonzero(np.isin(batch.group_ids, first_groups)))

    def _generate_and_score(self, prompts, t: dict, metrics: dict) -> tuple[RLBatch, dict[str, np.ndarray]]:
        """One round of phases gen + reward for a prompt batch.

        Returns the batch with ``token_level_scores`` set and the per-response values dynamic sampling can
        filter on: ``score`` (reward function), ``acc`` (its ``acc`` output, else the score), ``seq_reward``
        and ``seq_final_reward`` (score after overlong shaping; the in-reward KL is applied after filtering).
        """
        c, cfg = self.c, self.c.cfg
        with timed("gen", t):
            sp = _sampling_params(self.rollout_cfg, self.max_new_tokens, validation=False, seed=self._seed())
            out = c.rollout.generate(prompts.prompt_ids, sp)
        batch = RLBatch(
            prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, response_ids=out.response_ids,
            response_mask=out.response_mask, group_ids=out.prompt_index, rollout_log_probs=out.rollout_log_probs,
        )
        with timed("reward", t):
            texts = decode_responses(c.tokenizer, batch.response_ids, batch.response_mask)
            rew = self._score(prompts.rows, out.prompt_index, batch, texts, metrics)
            _add(metrics, "reward/num_errors", rew.num_errors)
            _add(metrics, "reward/num_timeouts", rew.num_timeouts)
            scores = rew.scores.astype(np.float32)
            penalty = c.reward.overlong_penalty(batch.response_mask.sum(-1), batch.response_width)
            if penalty is not None:  # DAPO's soft overlong punishment (reward_model.overlong_buffer / dapo kwargs)
                metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
                if c.reward.overlong.log:
                    metrics["reward/overlong_ratio"] = float((penalty < 0).mean())
                scores = scores + penalty
            batch.token_level_scores = place_scores_on_last_token(scores, batch.response_mask)
        if cfg.algorithm.adv_estimator == "remax":
            with timed("gen_max", t):  # ReMax's baseline: the score of a greedy response to the same prompt
                greedy = dataclasses.replace(sp, n=1, do_sample=False)
                base_out = c.rollout.generate(prompts.prompt_ids, greedy)
                base_texts = decode_responses(c.tokenizer, base_out.response_ids, base_out.response_mask)
                base_batch = RLBatch(prompt_ids=base_out.prompt_ids, prompt_mask=base_out.prompt_mask,
                                     response_ids=base_out.response_ids, response_mask=base_out.response_mask,
                                     group_ids=base_out.prompt_index)
                base = self._score(prompts.rows, base_out.prompt_index, base_batch, base_texts, {}).scores
            batch.reward_baselines = np.asarray(base, np.float32)[out.prompt_index]
        seq = {
            "score": rew.scores,
            "acc": _extra_as_array(rew, "acc", default=rew.scores),
            "seq_reward": scores,
            "seq_final_reward": scores,
        }
        return batch, seq

    def _score(self, rows, prompt_index, batch: RLBatch, texts, metrics: dict) -> RewardOutput:
        """Sequence scores of a round: the rule reward, or with ``reward_model.enable`` the reward model's combined
        with it (:func:`score_with_reward_model`)."""
        c = self.c
        if c.reward_model is None:
            return score_responses(c.reward, rows, prompt_index, texts)
        return score_with_reward_model(c.reward_model, c.reward, rows, prompt_index, batch, texts, metrics,
                                       combine=c.cfg.reward_model.combine, prompt_key=c.cfg.data.prompt_key)

    def _seed(self) -> int:
        return int(self.c.cfg.trainer.seed) * 1_000_003 + self.step

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
        from jaxrl.algorithms import get_adv_estimator

        alg = self.c.cfg.algorithm
        fn = get_adv_estimator(alg.adv_estimator)
        adv, ret = _call_with_supported_kwargs(
            fn,
            batch.token_level_rewards,
            batch.response_mask.astype(np.float32),
            batch.group_ids.astype(np.int32),
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
            gamma=alg.gamma,
            lam=alg.lam,
            values=batch.values,
            reward_baselines=batch.reward_baselines,
        )
        return np.asarray(adv, np.float32), np.asarray(ret, np.float32)

    # -- validation ------------------------------------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        """Score the validation set with ``rollout.val_kwargs``: ``val-core/<data_source>/<reward|acc>/mean@n``
        (and best@n / worst@n / maj@n when ``val_kwargs.n > 1``; see :func:`jaxrl.metrics.validation_metrics`)."""
        c, cfg = self.c, self.c.cfg
        if not c.val_rows:
            return {}
        sp = _sampling_params(self.rollout_cfg, self.max_new_tokens, validation=True, seed=self._seed() + 7)
        bs = cfg.data.val_batch_size or len(c.val_rows)
        sources, prompt_ids, samples, preds = [], [], [], []
        values: dict[str, list] = {"reward": []}
        for start in range(0, len(c.val_rows), bs):
            chunk = c.val_rows[start : start + bs]
            out = c.rollout.generate([r["prompt_ids"] for r in chunk], sp)
            texts = decode_responses(c.tokenizer, out.response_ids, out.response_mask)
            rew = score_responses(c.reward, [r["row"] for r in chunk], out.prompt_index, texts)
            values["reward"].extend(rew.scores.tolist())
            if "acc" in rew.extra:
                values.setdefault("acc", []).extend(_extra_as_array(rew, "acc", default=rew.scores).tolist())
            preds.extend(rew.extra.get("pred", [None] * len(texts)))
            sources.extend(chunk[i]["row"].get("data_source", "unknown") for i in out.prompt_index)
            prompt_ids.extend((start + out.prompt_index).tolist())
            samples.extend(zip(texts, rew.scores))
        has_preds = any(p is not None for p in preds)
        metrics = validation_metrics(
            sources, np.asarray(prompt_ids), {k: np.asarray(v) for k, v in values.items()},
            [str(p) for p in preds] if has_preds else None, sp.n,
        )
        shown = samples[: cfg.trainer.log_val_generations]
        if shown:
            with open(c.out_dir / "val_generations.jsonl", "a") as f:
                for text, score in shown:
                    log.info("val sample (score %.3f): %r", score, text[:300])
                    f.write(json.dumps({"step": self.step, "score": float(score), "response": text}) + "\n")
        return metrics

    # -- the loop --------------------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        """Train to ``total_training_steps``: resume if a checkpoint says so, validate every ``test_freq`` steps
        and at the end, checkpoint every ``save_freq`` steps and at the end, stop cleanly on SIGTERM."""
        from tqdm import tqdm

        c, cfg = self.c, self.c.cfg
        total = c.total_training_steps
        resumed = self.resume()
        if not resumed:
            c.logger.truncate_after(-1)  # a fresh run starts a fresh metrics.jsonl in a reused folder
        if resumed and self.step >= total:
            log.info("the checkpoint is already at step %d of %d: nothing left to train", self.step, total)
        if cfg.trainer.val_before_train and c.val_rows and not resumed:
            t: dict[str, float] = {}
            with timed("testing", t):
                val = self.validate()
            c.logger.log(0, {**val, "timing_s/testing": t["testing"]})
        last: dict[str, float] = {}
        bar = tqdm(total=total, initial=self.step, desc="jaxrl", unit="step", dynamic_ncols=True)
        with _sigterm_flag() as stop:
            try:
                while self.step < total and not stop.is_set():
                    self.step += 1
                    last = self._step_validate_log()
                    self._check_finite(last)
                    if self._save_due():
                        self.save_checkpoint()
                    bar.set_postfix(score=f"{last['critic/score/mean']:.3f}")
                    bar.update(1)
                final = self.step if self._save_due() else None  # the save that ends the run, if any
                if stop.is_set():
                    log.warning("SIGTERM: stopping after step %d", self.step)
                    if final is None:
                        self.save_checkpoint()
                        final = self.step
                check_final_checkpoint(c.store, final)
                if stop.is_set():
                    log.warning("rerun the same command to resume from step %d", self.step)
            finally:
                bar.close()
                c.store.close()  # waits for an asynchronous save (a failure is logged), ends orbax's threads
        return last

    def _step_validate_log(self) -> dict[str, float]:
        """One training step, then validation when due, then logging."""
        c, cfg = self.c, self.c.cfg
        metrics = self.train_step()
        metrics["training/global_step"] = self.step
        test_freq = cfg.trainer.test_freq
        if c.val_rows and test_freq > 0 and (self.step % test_freq == 0 or self.step == c.total_training_steps):
            t: dict[str, float] = {}
            with timed("testing", t):
                metrics.update(self.validate())
            metrics["timing_s/testing"] = t["testing"]
        c.logger.log(self.step, metrics)
        if any(k.startswith("val-core/") for k in metrics) and c.logger.jsonl_path.exists():
            plot_rewards(c.logger.jsonl_path, c.out_dir / "reward.png")  # the plot follows the run
        return metrics

    def _check_finite(self, metrics: dict) -> None:
        """Count consecutive steps whose update was skipped for a non-finite loss/gradient; abort past the limit."""
        bad = metrics.get("actor/nonfinite_grad", 0) > 0 or metrics.get("critic/nonfinite_grad", 0) > 0
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if bad else 0
        if bad:
            log.warning("step %d: non-finite loss or gradient, update skipped (%d in a row)",
                        self.step, self.nonfinite_in_a_row)
        limit = self.c.cfg.trainer.max_nonfinite_steps
        if self.nonfinite_in_a_row >= limit:
            raise NonFiniteTrainingError(
                f"{self.nonfinite_in_a_row} consecutive steps ending at step {self.step} had a non-finite loss or "
                f"gradient (trainer.max_nonfinite_steps={limit}); the non-finite updates were skipped (params and "
                f"optimizer state kept). Check the rewards and the learning rate; "
                f"{_latest_checkpoint_text(self.c.store)}"
            )

    # -- checkpoints -----------------------------------------------------------------------------------------

    def _save_due(self) -> bool:
        freq = self.c.cfg.trainer.save_freq
        return freq > 0 and (self.step % freq == 0 or self.step == self.c.total_training_steps)

    def state_arrays(self) -> dict:
        """The device state a checkpoint holds: params and optimizer states of every trained role."""
        c = self.c
        arrays = {"actor": {"params": c.actor.params, "opt_state": c.actor.opt_state}}
        if c.critic is not None:
            arrays["critic"] = {"params": c.critic.params, "opt_state": c.critic.opt_state}
        return arrays

    def state_meta(self) -> dict:
        """The host state a checkpoint holds (JSON): step, data position, RNGs, KL controller, model info."""
        c = self.c
        meta = {
            "step": self.step,
            "data_state": c.train_data.get_state(),
            "kl_ctrl": {k: float(v) for k, v in self.kl_ctrl._asdict().items()},
            "actor": {"num_updates": c.actor.num_updates, "rng": c.actor.rng.bit_generator.state},
            "model": c.model_meta,
        }
        if c.critic is not None:
            meta["critic"] = {"num_updates": c.critic.num_updates, "rng": c.critic.rng.bit_generator.state}
        meta["fingerprint"] = self.fingerprint()
        return meta

    def fingerprint(self) -> dict:
        """What a checkpoint of this run needs in a run that resumes it (:mod:`jaxrl.fingerprint`): the model
        config, trained roles, array shapes/dtypes and the data settings the iterator position depends on.
        Constant over a run (computed once)."""
        if self._fingerprint is None:
            from jaxrl.fingerprint import fingerprint

            c, d = self.c, self.c.cfg.data
            state = c.train_data.get_state()
            arrays = self.state_arrays()
            data = {
                self._batch_key(): state["batch_size"], "data.seed": state["seed"], "data.shuffle": state["shuffle"],
                "data.drop_last": state["drop_last"], "data.num_prompts": state["num_rows"],
                "data.prompts_sha256": c.train_data.prompts_digest(),
            }
            model = c.cfg.actor_rollout_ref.model
            context = {
                "data.train_files": d.train_files, "data.train_max_samples": d.train_max_samples,
                "data.max_prompt_length": d.max_prompt_length,
                "data.filter_overlong_prompts": d.filter_overlong_prompts,
                "data.truncation": d.truncation, "data.prompt_key": d.prompt_key,
                "actor_rollout_ref.model.path": model.path,
                "actor_rollout_ref.model.tokenizer_path": model.tokenizer_path,
            }
            self._fingerprint = fingerprint(model=c.model_meta, roles=list(arrays), arrays=arrays, data=data,
                                            context=context)
        return self._fingerprint

    def _batch_key(self) -> str:
        """The config key that sets the prompt pipeline's batch size: ``data.gen_batch_size`` under DAPO dynamic
        sampling when it is set, else ``data.train_batch_size`` (so toggling dynamic sampling alone keeps it)."""
        cfg = self.c.cfg
        dynamic = cfg.algorithm.filter_groups.enable and cfg.data.gen_batch_size
        return "data.gen_batch_size" if dynamic else "data.train_batch_size"

    def _check_resumable(self, step: int, meta: dict) -> None:
        """Raise CheckpointIncompatibleError when checkpoint ``step`` was written by an incompatible configuration.

        Checkpoints with a fingerprint are compared on all of it; older ones on what their meta holds (model
        config, roles, data-iterator settings; the store then compares the array shapes orbax stored).
        """
        from jaxrl.checkpoint import CheckpointIncompatibleError
        from jaxrl.fingerprint import differences, legacy_fingerprint, summary

        now = self.fingerprint()
        saved = meta.get("fingerprint")
        if isinstance(saved, dict):
            diffs = differences(saved, now)
        else:
            diffs = differences(legacy_fingerprint(meta, array_signatures=None, batch_key=self._batch_key()), now,
                                only_common=True)
        if diffs:  # the store fills in the checkpoint's path
            raise CheckpointIncompatibleError(f"written by another configuration: {summary(diffs)}", step=step,
                                              path=None, differences=diffs)

    def save_checkpoint(self) -> bool:
        """Save the full training state at the current step; a failed save is logged, training goes on.

        Every call attempts its own save (an earlier asynchronous failure does not block it); whether the run's
        final checkpoint made it to disk is checked by :meth:`fit`.
        """
        from jaxrl.checkpoint import CheckpointSaveError

        try:
            return self.c.store.save(self.step, arrays=self.state_arrays(), meta=self.state_meta())
        except CheckpointSaveError as e:
            log.error("checkpoint not saved (training state intact, earlier checkpoints kept): %s", e)
            return False

    def resume(self) -> bool:
        """Restore the checkpoint ``trainer.resume_mode`` names (``Components.resume_from``); True if one was.

        The candidate's fingerprint is compared with this run's before any array is read; a corrupt newest
        checkpoint in the run folder is moved aside and the previous one used. Checkpoints in the run folder
        that this run would otherwise collide with (a fresh start, or newer than the step resumed) are moved
        aside as ``.superseded-<ts>`` (kept).

        Raises:
          CheckpointIncompatibleError: the checkpoint was written by an incompatible configuration (the message
            lists each change and the two ways out); nothing was restored or moved.
          CheckpointRestoreError: no checkpoint could be read.
        """
        from jaxrl.checkpoint import CheckpointIncompatibleError, CheckpointStore

        c = self.c
        if c.resume_from is None:
            c.store.supersede_after(None)
            return False
        root, step = c.resume_from
        own = Path(root).resolve() == c.out_dir.resolve()
        store = c.store if own else CheckpointStore(root, max_to_keep=None, read_only=True)
        try:
            step, arrays, meta = store.restore(step, like=self.state_arrays(), check=self._check_resumable)
        except CheckpointIncompatibleError as e:
            from jaxrl.fingerprint import summary

            raise CheckpointIncompatibleError(
                f"cannot resume from {e.path}: it was written by a run with another configuration: "
                f"{summary(e.differences)}. Either start over with trainer.resume_mode=disable (this folder's "
                "checkpoints are then moved aside, not deleted) or set another trainer.default_local_dir",
                step=e.step, path=e.path, differences=e.differences) from None
        finally:
            if not own:
                store.close()
        c.store.supersede_after(step if own else None)
        c.actor.params, c.actor.opt_state = arrays["actor"]["params"], arrays["actor"]["opt_state"]
        c.actor.num_updates = meta["actor"]["num_updates"]
        c.actor.rng.bit_generator.state = meta["actor"]["rng"]
        if c.critic is not None:
            c.critic.params, c.critic.opt_state = arrays["critic"]["params"], arrays["critic"]["opt_state"]
            c.critic.num_updates = meta["critic"]["num_updates"]
            c.critic.rng.bit_generator.state = meta["critic"]["rng"]
        c.train_data.set_state(meta["data_state"])
        self.kl_ctrl = self.kl_ctrl._replace(value=meta["kl_ctrl"]["value"])  # target/horizon: this run's config
        self.step = step
        self.sync_rollout()  # the params were restored onto the train shardings (like=state_arrays())
        c.logger.truncate_after(step)  # steps logged after this checkpoint will be logged again
        log.info("resumed from %s at step %d", store.step_path(step), step)
        return True


def check_final_checkpoint(store, step: int | None) -> None:
    """Wait for ``store``'s saves and make sure the run's final checkpoint ``step`` (the last step's or the SIGTERM
    one; None: the run ends without one) is complete on disk.

    Raises:
      CheckpointSaveError: it is not; the one-line message gives the reason (free space needed and available, or
        the write error) and the newest complete checkpoint to resume from.
    """
    from jaxrl.checkpoint import CheckpointSaveError

    try:
        store.wait()
    except CheckpointSaveError:
        pass  # logged and recorded in store.save_errors by the store
    if step is None or step in store.steps():
        return
    err = store.save_errors.get(step)
    reason = err.reason if err is not None else "it is not on disk"
    newest = store.latest_step()
    where = (f"the newest complete checkpoint is {store.step_path(newest)} (step {newest})" if newest is not None
             else f"no complete checkpoint exists in {store.directory}")
    raise CheckpointSaveError(
        f"the final checkpoint (step {step}) was not saved: {reason}; {where}; fix the cause (e.g. free disk "
        "space) and rerun the same command to resume from it",
        step=step, directory=store.directory, reason=reason)


def _latest_checkpoint_text(store) -> str:
    step = store.latest_step()
    return "no checkpoint was saved yet." if step is None else f"the last checkpoint is {store.step_path(step)}."


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient (``trainer.max_nonfinite_steps``)."""


@contextlib.contextmanager
def _sigterm_flag():
    """A ``threading.Event`` set by SIGTERM while the block runs (main thread only; elsewhere never set)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- wiring ------------------------------------------------------------------------------------------------


def _jnp_dtype(name: str):
    import jax.numpy as jnp

    return {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}[name]


def build(cfg) -> Components:
    """Construct every role of a run from a validated config (heavy imports happen here).

    First of all the run folder (``trainer.default_local_dir``) is locked (:class:`jaxrl.runlock.RunLock`: a
    second run there fails at once) and the checkpoint to resume from is located (a missing
    ``trainer.resume_from_path`` fails here). The device placement (``trainer.mesh`` / ``placement``) is checked
    next, then the model's context length (from its config alone) and the data files, so a mesh that does not fit
    the devices, prompt + response lengths beyond the model's context, a missing, empty or malformed file, or a
    data source no reward function scores fail before the (slow) model load. The lock is released by
    :func:`run_training` (or here, if building fails).

    Raises:
      jaxrl.runlock.RunLockError: another run holds the folder.
    """
    from jaxrl.checkpoint import find_resume_checkpoint
    from jaxrl.runlock import RunLock

    out_dir = Path(cfg.trainer.default_local_dir)
    lock = RunLock(out_dir).acquire()  # before any write into the folder (multi-process: the primary only)
    try:
        t = cfg.trainer
        resume_from = find_resume_checkpoint(t.resume_mode, out_dir, t.resume_from_path)
        return dataclasses.replace(_build_components(cfg, out_dir), lock=lock, resume_from=resume_from)
    except BaseException:
        lock.release()
        raise


def _build_components(cfg, out_dir: Path) -> Components:
    """:func:`build` after the lock: every role, the metrics logger and the checkpoint store."""
    from flax import nnx

    from jaxrl.checkpoint import CheckpointStore, max_to_keep_from_config, model_meta
    from jaxrl.config.loader import config_to_dict
    from jaxrl.workers.placement import placement_from_config

    arr = cfg.actor_rollout_ref
    reward = _build_reward(cfg)  # a bad custom reward file fails here, first (scoring processes start later)
    placement = placement_from_config(cfg)  # device counts checked before anything slow
    if placement is not None:
        log.info("placement %s", placement.describe())

    train_rows, val_rows = _read_rows(cfg.data)
    _check_data_sources(cfg, train_rows, val_rows)  # no built-in scorer and no custom reward: fail before the model
    _check_context_lengths(cfg)  # from the model's config alone (cheap), before its weights load
    pre, tokenizer = _load_policy(arr.model)
    _check_context_lengths(cfg, pre.config)  # GGUF: its context is known only now, still before any compile
    reward_model = None
    if cfg.reward_model.enable:  # verl's RewardModelWorker, frozen, on the train mesh
        from jaxrl.workers.reward_model import build_reward_model_worker

        reward_model = build_reward_model_worker(cfg, pre.config, tokenizer, **_mesh_args(placement))
    graphdef, params = nnx.split(pre.model)
    train_data, val_examples = _prompt_pipelines(
        cfg.data, tokenizer, train_rows, val_rows, dynamic_sampling=cfg.algorithm.filter_groups.enable
    )
    total = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * train_data.steps_per_epoch

    actor, ref = _build_actor_and_reference(cfg, graphdef, params, total, placement)
    critic = _build_critic(cfg, pre, total, placement) if cfg.algorithm.adv_estimator == "gae" else None
    rollout, weight_sync = _build_rollout(cfg, pre.config, graphdef, params, tokenizer, actor, placement)
    logger = MetricsLogger(
        cfg.trainer.logger, out_dir, project_name=cfg.trainer.project_name,
        experiment_name=cfg.trainer.experiment_name, config=config_to_dict(cfg),
    )
    store = CheckpointStore(
        out_dir, async_save=cfg.trainer.checkpoint_async,
        max_to_keep=max_to_keep_from_config(
            cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep, has_critic=critic is not None
        ),
    )
    try:
        store.save_tokenizer(tokenizer)
    except BaseException:
        store.close()  # ends orbax's background threads before the error propagates
        raise
    return Components(
        cfg=cfg, tokenizer=tokenizer, model_cfg=pre.config, actor=actor, ref=ref, rollout=rollout, reward=reward,
        train_data=train_data, val_rows=val_examples, logger=logger, out_dir=out_dir, total_training_steps=total,
        store=store, model_meta=model_meta(pre.config, path=arr.model.path, param_dtype=arr.model.param_dtype),
        critic=critic, placement=placement, weight_sync=weight_sync, reward_model=reward_model,
    )


def _read_rows(d):
    """Raw train / validation rows as ``LoadedRows`` (``data.*_max_samples`` applied); a split without a usable row
    raises ``DataFileError``."""
    from jaxrl.data.sources import load_split

    common = dict(skip_malformed=d.skip_malformed, prompt_key=d.prompt_key)
    train = load_split(d.train_files, split="train", max_samples=d.train_max_samples, **common)
    val = load_split(d.val_files, split="val", max_samples=d.val_max_samples, **common) if d.val_files else None
    return train, val


def _check_context_lengths(cfg, policy_config=None) -> None:
    """Prompt + response lengths must fit the policy's (and a separate critic's) context; raises ``ConfigError``
    naming the model's limit. Without ``policy_config`` (before any load) only configs that are cheap to read
    (``config.json``, a llama2.c header; not GGUF) are checked; with it, the loaded policy's."""
    from jaxrl.config.loader import check_context_length
    from jaxrl.models.files import read_model_config

    path = cfg.actor_rollout_ref.model.path
    if policy_config is not None:
        check_context_length(cfg, policy_config.max_position_embeddings,
                             model=f"actor_rollout_ref.model.path={path!r}")
        return
    paths = [("actor_rollout_ref.model.path", path)]
    if cfg.algorithm.adv_estimator == "gae" and cfg.critic.model.path:
        paths.append(("critic.model.path", cfg.critic.model.path))
    for key, p in paths:
        found = read_model_config(p, cheap_only=True)
        if found is not None:
            check_context_length(cfg, found[0].get("max_position_embeddings"), model=f"{key}={p!r} ({found[1]})")


def _check_data_sources(cfg, train_rows, val_rows) -> None:
    """``jaxrl.rewards.check_data_sources`` on the first rows of the train and validation files."""
    from jaxrl.rewards import CHECKED_ROWS, check_data_sources

    custom = bool(cfg.custom_reward_function.path)
    # with a reward model that replaces the rule reward, rows marked style="model" never reach a rule function
    rm_only = cfg.reward_model.enable and cfg.reward_model.combine == "replace"
    for key, loaded in (("train_files", train_rows), ("val_files", val_rows)):
        rows = loaded.rows if loaded is not None else []
        sources = (r.get("data_source") for r in rows[:CHECKED_ROWS]
                   if not (rm_only and (r.get("reward_model") or {}).get("style") == "model"))
        check_data_sources(sources, custom_reward=custom, origin=f"data.{key}={getattr(cfg.data, key)!r}")


def _load_policy(model_cfg):
    """The pretrained policy and its tokenizer (``model.tokenizer_path`` overrides the model's own)."""
    from jaxrl.models import load_pretrained

    pre = load_pretrained(
        model_cfg.path, param_dtype=model_cfg.param_dtype, dtype=model_cfg.dtype,
        remat=model_cfg.enable_gradient_checkpointing,
    )
    tokenizer = pre.tokenizer
    if model_cfg.tokenizer_path:
        from jaxrl.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_cfg.tokenizer_path)
    if tokenizer is None:
        raise ValueError(f"no tokenizer found for model {model_cfg.path!r}; set actor_rollout_ref.model.tokenizer_path")
    return pre, tokenizer


def _prompt_pipelines(d, tokenizer, train_rows, val_rows, *, dynamic_sampling: bool = False):
    """The training prompt pipeline and the tokenised validation examples (``{"prompt_ids", "row"}``) from the
    ``LoadedRows`` of each split.

    With DAPO dynamic sampling each generation round reads ``data.gen_batch_size`` prompts.
    """
    from jaxrl.data.pipeline import PromptPipeline

    common = dict(
        max_prompt_length=d.max_prompt_length, prompt_key=d.prompt_key,
        filter_overlong_prompts=d.filter_overlong_prompts, truncation=d.truncation, seed=d.seed,
    )
    batch_size = (d.gen_batch_size or d.train_batch_size) if dynamic_sampling else d.train_batch_size
    train = PromptPipeline(train_rows.rows, tokenizer, batch_size=batch_size, shuffle=d.shuffle,
                           origins=train_rows.origins, split="train", **common)
    if val_rows is None:
        return train, None
    val = PromptPipeline(val_rows.rows, tokenizer, batch_size=1, shuffle=False, origins=val_rows.origins,
                         split="val", **common)
    examples = [
        {"prompt_ids": ids, "row": row}
        for b in val.iter_batches_once(batch_size=64)
        for ids, row in zip(b.prompt_ids, b.rows)
    ]
    return train, examples


def _mesh_args(placement) -> dict:
    """``mesh=`` / ``rules=`` for a trained role: the train mesh and rules, or nothing (one device)."""
    return {} if placement is None else {"mesh": placement.train_mesh, "rules": placement.rules}


def _build_actor_and_reference(cfg, graphdef, params, total_training_steps, placement=None):
    """The actor, and the frozen reference (a copy of the initial params) when a KL term needs it.

    With a placement both live on the train mesh; the reference's params take the actor's shardings.
    """
    import jax

    from jaxrl.workers.actor import ActorWorker, LogProbComputer

    arr = cfg.actor_rollout_ref
    rollout_cfg = arr.rollout
    ref_params = None
    if arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        ref_params = jax.tree.map(lambda x: x.copy(), params)  # frozen copy: the actor's buffers are updated
    actor = ActorWorker(
        graphdef, params, arr.actor, rollout_n=rollout_cfg.n, temperature=rollout_cfg.temperature,
        log_prob_micro_batch_size=rollout_cfg.log_prob_micro_batch_size_per_gpu,
        total_training_steps=total_training_steps, seed=cfg.trainer.seed, ref_params=ref_params,
        **_mesh_args(placement),
    )
    actor.init_optimizer(cfg.data.train_batch_size * rollout_cfg.n)  # now, so a checkpoint always has its state
    if ref_params is None:
        return actor, None
    if placement is not None:
        from sharding import shard_state

        ref_params = shard_state(ref_params, actor.param_shardings)
    micro = arr.ref.log_prob_micro_batch_size_per_gpu or rollout_cfg.log_prob_micro_batch_size_per_gpu
    ref = _Reference(LogProbComputer(graphdef, micro_batch_size=micro, temperature=rollout_cfg.temperature,
                                     **_mesh_args(placement)), ref_params)
    return actor, ref


def _build_rollout(cfg, model_cfg, graphdef, params, tokenizer, actor, placement):
    """The rollout engine and the ``WeightSync`` that feeds it (:func:`jaxrl.rollout.factory.start_rollout`): with a
    placement the engine starts on the actor's params (the JAX sampler: translated onto the rollout mesh by the
    initial sync), without one on the policy's own single-device params."""
    from jaxrl.rollout.factory import start_rollout

    weight_sync = start_rollout(
        cfg, model_cfg, graphdef, actor.params if placement else params, tokenizer,
        mesh=placement.rollout_mesh if placement else None, rules=placement.rollout_rules if placement else None,
        split=placement is not None and placement.kind == "split",
    )
    return weight_sync.engine, weight_sync


def _build_critic(cfg, policy, total_training_steps, placement=None):
    """PPO's critic: a value model from ``critic.model.path`` or, when unset, from the policy's weights."""
    from flax import nnx

    from jaxrl.models.value_model import build_value_model
    from jaxrl.workers.critic import CriticWorker

    cc = cfg.critic
    model = build_value_model(
        cc.model.path, policy, param_dtype=cc.model.param_dtype, dtype=cc.model.dtype,
        remat=cc.model.enable_gradient_checkpointing, seed=cfg.trainer.seed,
    )
    graphdef, params = nnx.split(model)
    critic = CriticWorker(
        graphdef, params, cc, rollout_n=cfg.actor_rollout_ref.rollout.n, total_training_steps=total_training_steps,
        seed=cfg.trainer.seed, **_mesh_args(placement),  # the critic follows the actor's mesh
    )
    critic.init_optimizer(cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n)
    return critic


def _build_reward(cfg):
    """The reward manager (``reward_model.reward_manager``) around the custom ``compute_score`` (imported and its
    signature checked now) or the built-in dispatcher; its scoring processes start with :meth:`start`."""
    from jaxrl.rewards import default_compute_score
    from jaxrl.rewards.factory import build_reward_manager

    return build_reward_manager(cfg, default_compute_score)


@dataclasses.dataclass
class _Reference:
    """The frozen reference policy: a :class:`LogProbComputer` bound to the initial params."""

    log_prob: object
    params: object

    def compute_log_probs(self, batch: RLBatch):
        return self.log_prob(self.params, batch)


def run_training(cfg) -> dict[str, float]:
    """Build the run, train, write the reward plot and export the final model; returns the last metrics."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU found" noise on CPU/GPU
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save progress lines
    t0 = time.perf_counter()
    c = build(cfg)
    try:
        log.info(
            "run: %d steps, %d prompts x n=%d per step, output in %s",
            c.total_training_steps, cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, c.out_dir,
        )
        trainer = Trainer(c)
        try:
            c.reward.start()  # scoring processes import the reward function while the first rollout compiles
            last = trainer.fit()
        finally:
            c.reward.close()  # no scoring process outlives the run
            c.logger.close()
            shutdown = getattr(c.rollout, "shutdown", None)  # vLLM: its engine (and worker process, if any)
            if shutdown is not None:
                shutdown()
        if c.logger.jsonl_path.exists():
            png = plot_rewards(c.logger.jsonl_path, c.out_dir / "reward.png")
            log.info("reward plot: %s", png)
        from flax import nnx

        from jaxrl.models.hf import save_hf

        export_dir = c.out_dir / "hf_model"
        save_hf(nnx.merge(c.actor.graphdef, c.actor.params), c.model_cfg, export_dir, tokenizer=c.tokenizer)
        log.info("final model exported to %s (load with transformers or jaxrl.generate --model)", export_dir)
        log.info("done in %.1f s", time.perf_counter() - t0)
        return last
    finally:
        c.store.close()  # idempotent; also on errors, so orbax's threads never outlive the run
        if c.lock is not None:
            c.lock.release()
