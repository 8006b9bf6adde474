"""The experience maker: the responses one RL step trains on, generated and scored (OpenRLHF's ``make_experience``).

:meth:`ExperienceMaker.make_experience` is the step's phases ``gen`` and ``reward``::

    prompts -> rollout.generate -> RLBatch (ids, masks, rollout log-probs, group ids)
            -> decode -> rule reward manager (+ reward model: score_with_reward_model) -> overlong shaping
            -> token_level_scores [N, R] (the sequence score on the last response token)
    ReMax:  + a greedy response per prompt, scored the same way -> reward_baselines [N]       (phase gen_max)
    DAPO:   flat groups dropped, further prompt batches until the batch is full (algorithm.filter_groups)

It returns the :class:`~jaxrl.batch.RLBatch` and the round's metrics (``reward/*``, DAPO's ``train/num_gen_batches``
and ``train/num_dropped_groups``); the trainer computes everything after it (log-probs, values, advantages).
The helpers (:func:`decode_responses`, :func:`score_responses`, :func:`sampling_params`) are also what validation
uses.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from jaxrl import distributed
from jaxrl.algorithms.registry import ADV_ESTIMATORS
from jaxrl.batch import RLBatch, concat_batches
from jaxrl.metrics import _stats, timed
from jaxrl.rewards.manager import RewardOutput
from jaxrl.rewards.shaping import accuracy_band_groups, groups_with_signal

log = logging.getLogger("jaxrl")


def sampling_params(rollout_cfg, max_new_tokens: int, *, validation: bool, seed: int):
    """The :class:`~jaxrl.rollout.base.SamplingParams` of a training round (``actor_rollout_ref.rollout``) or of
    validation (``rollout.val_kwargs``; ``do_sample=false`` or temperature 0 = greedy)."""
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


def decode_responses(tokenizer, response_ids: np.ndarray, response_mask: np.ndarray) -> list[str]:
    """Detokenise the valid part of each response (special tokens such as EOS dropped)."""
    seqs = [row[m.astype(bool)].tolist() for row, m in zip(response_ids, response_mask)]
    return tokenizer.batch_decode(seqs, skip_special_tokens=True)


def score_responses(reward, rows: list[dict], prompt_index: np.ndarray, texts: list[str]):
    """Run the reward manager on decoded responses; ``rows[prompt_index[i]]`` is response ``i``'s data row.

    Several processes: the primary scores and every process gets its :class:`RewardOutput` (or its
    ``RewardError``): scores depend on per-call timeouts and worker processes, so they are decided once."""
    rs = [rows[i] for i in prompt_index]
    return distributed.run_on_primary(
        reward.score,
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


def extra_as_array(rew, key: str, default: np.ndarray) -> np.ndarray:
    """A numeric extra output of the reward function (e.g. ``acc``) as ``[N]`` float32; failed calls give 0."""
    values = rew.extra.get(key)
    if values is None:
        return np.asarray(default, np.float32)
    return np.asarray([0.0 if v is None else float(v) for v in values], np.float32)


def numeric_extras(rew) -> dict[str, np.ndarray]:
    """The reward function's numeric extra outputs (every dict key but ``score`` whose values are numbers or bools,
    e.g. GSM8K's ``acc``, ``format``, ``acc_flexible``), each ``[N]`` float64 with NaN where a call failed or gave
    no value. Text extras (``pred``) are left out."""
    out = {}
    for key, values in rew.extra.items():
        if key == "score" or not any(v is not None for v in values):
            continue
        if not all(v is None or isinstance(v, (int, float, bool, np.number)) for v in values):
            continue
        out[key] = np.asarray([np.nan if v is None else float(v) for v in values], np.float64)
    return out


def extra_means(values: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """``reward/<key>/mean`` of each numeric reward extra over every response of a step's rounds (NaN = failed
    call, left out of the mean; a key whose values are all NaN is not logged)."""
    keys = dict.fromkeys(k for v in values for k in v)
    out = {}
    for key in keys:
        vals = np.concatenate([v[key] for v in values if key in v])
        if np.isfinite(vals).any():
            out[f"reward/{key}/mean"] = float(np.nanmean(vals))
    return out


def place_scores_on_last_token(scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """Token-level scores ``[N, R]``: each sequence score sits on its last valid response token (verl): the last
    position where ``response_mask`` is 1 (a multi-turn mask has holes: the last model token)."""
    out = np.zeros(response_mask.shape, np.float32)
    width = response_mask.shape[1]
    last = width - 1 - np.argmax(response_mask[:, ::-1] != 0, axis=1)
    has = response_mask.sum(-1) > 0
    out[np.arange(len(scores))[has], last[has]] = scores[has]
    return out


@dataclasses.dataclass(frozen=True)
class PrimeFilter:
    """PRIME's prompt filter (``data.filter_accuracy`` / ``accuracy_lower_bound`` / ``accuracy_upper_bound`` /
    ``filter_truncate``; :func:`jaxrl.rewards.shaping.accuracy_band_groups`): of the generated groups
    (``data.oversample_factor`` x ``keep`` prompts) the step keeps ``keep``."""

    keep: int
    filter_accuracy: bool
    lower: float
    upper: float
    filter_truncate: bool


def prime_select(batch: RLBatch, seq: dict, pf: PrimeFilter, metrics: dict) -> RLBatch:
    """The rows of ``pf.keep`` groups (:func:`accuracy_band_groups` on ``batch.acc``), group ids renumbered from 0;
    ``metrics`` get ``acc`` (verl's: the mean outcome label over every generated response),
    ``train/score_all_mean`` (the mean score over them: the filter keeps groups by accuracy, so the kept batch's
    ``critic/score/mean`` is not the policy's score) and ``train/num_groups_in_band`` (groups that passed)."""
    metrics["acc"] = float(np.mean(batch.acc))
    metrics["train/score_all_mean"] = float(np.mean(seq["seq_reward"]))
    rows, passing = accuracy_band_groups(
        batch.acc, batch.group_ids, batch.response_mask.sum(-1), keep=pf.keep, filter_accuracy=pf.filter_accuracy,
        lower=pf.lower, upper=pf.upper, filter_truncate=pf.filter_truncate, max_length=batch.response_width)
    metrics["train/num_groups_in_band"] = passing
    kept = batch.select(rows)
    kept.group_ids = np.unique(kept.group_ids, return_inverse=True)[1].astype(np.int32).reshape(-1)
    return kept


def _add(metrics: dict, key: str, value: float) -> None:
    metrics[key] = metrics.get(key, 0) + value


class ExperienceMaker:
    """Generates and scores the responses of one RL step (phases ``gen``, ``reward``, ReMax's ``gen_max``).

    Args:
      rollout: the rollout engine (:class:`jaxrl.rollout.base.RolloutEngine`); ``generate(prompt_ids, params)``.
      tokenizer: decodes responses for the reward function (``batch_decode``).
      reward: the rule :class:`jaxrl.rewards.RewardManager` (``score``, ``overlong_penalty``, ``overlong``).
      rollout_cfg: the ``actor_rollout_ref.rollout`` section (sampling settings).
      max_new_tokens: the response width ``R``.
      algorithm_cfg: the ``algorithm`` section (``adv_estimator``: ReMax's baseline; ``filter_groups``: DAPO).
      train_batch_size: prompt groups a step trains on (``data.train_batch_size``; DAPO fills up to it).
      reward_model: a :class:`jaxrl.workers.reward_model.RewardModelWorker` (``reward_model.enable``), or None.
      reward_model_combine: ``reward_model.combine`` (``"replace"`` / ``"sum"``).
      prompt_key: ``data.prompt_key`` (the raw prompt a re-tokenizing reward model reads).
      prime_filter: PRIME (``algorithm.adv_estimator=prime``): its :class:`PrimeFilter`; every round then sets
        ``batch.acc`` (the outcome labels: the reward's ``acc`` output, else its score, clipped to [0, 1]) and the
        step keeps ``prime_filter.keep`` of the generated groups (:func:`prime_select`). None otherwise.
      agent: ``None`` (single-turn: ``rollout.generate`` on the prompt ids) or, with
        ``rollout.multi_turn.enable``, a :class:`jaxrl.agent.loop.AgentLoop` over the same engine: it generates
        from the rows' raw prompts (``prompt_key``) with tools, its ``multi_turn/*`` metrics join the round's and
        its environment rewards are added to the scores.
    """

    def __init__(self, *, rollout, tokenizer, reward, rollout_cfg, max_new_tokens: int, algorithm_cfg,
                 train_batch_size: int, reward_model=None, reward_model_combine: str = "replace",
                 prompt_key: str = "prompt", agent=None, prime_filter: PrimeFilter | None = None):
        self.agent = agent
        self.prime_filter = prime_filter
        self.rollout = rollout
        self.tokenizer = tokenizer
        self.reward = reward
        self.reward_model = reward_model
        self.rollout_cfg = rollout_cfg
        self.max_new_tokens = int(max_new_tokens)
        self.algorithm = algorithm_cfg
        self.train_batch_size = int(train_batch_size)
        self.reward_model_combine = reward_model_combine
        self.prompt_key = prompt_key

    def make_experience(self, prompts, *, seed: int, timings: dict[str, float]) -> tuple[RLBatch, dict[str, float]]:
        """Generate and score the step's responses.

        Without ``algorithm.filter_groups`` this is one round over the next prompt batch. With it, DAPO's
        dynamic sampling (arXiv 2503.14476, Sec. 3.2; verl ``filter_groups``): groups whose
        ``filter_groups.metric`` is the same for every response are dropped and further prompt batches are
        generated until ``train_batch_size`` groups are kept or ``max_num_gen_batches`` rounds ran (then the step
        trains on what it has, with a warning).

        Args:
          prompts: the prompt source; ``prompts.next_batch()`` gives a :class:`jaxrl.data.pipeline.PromptBatch`
            (token ids + raw rows). Read once per round.
          seed: the sampling seed of every round of this step.
          timings: gets the seconds of ``gen``, ``reward`` (and ``gen_max``) added, summed over rounds.

        Returns:
          ``(batch, metrics)``: the batch ``[N, P]`` / ``[N, R]`` with ``token_level_scores`` (and, for ReMax,
          ``reward_baselines`` ``[N]``) set; metrics ``reward/num_errors``, ``reward/num_timeouts`` (summed over
          rounds), the overlong and reward-model statistics, and with dynamic sampling ``train/num_gen_batches``
          and ``train/num_dropped_groups``.

        Raises:
          jaxrl.rewards.manager.RewardError: the reward function failed on too many responses.
        """
        metrics: dict[str, float] = {}
        fg = self.algorithm.filter_groups
        if not fg.enable:
            batch, seq = self.generate_and_score(prompts.next_batch(), seed=seed, timings=timings, metrics=metrics)
            if self.prime_filter is not None:
                batch = prime_select(batch, seq, self.prime_filter, metrics)
            return batch, metrics
        target = self.train_batch_size
        kept: list[RLBatch] = []
        n_kept = n_dropped = rounds = 0
        extras = []
        while n_kept < target and not (0 < fg.max_num_gen_batches <= rounds):
            rounds += 1
            batch, seq = self.generate_and_score(prompts.next_batch(), seed=seed, timings=timings, metrics=metrics)
            extras.append(seq["extras"])
            keep = groups_with_signal(seq[fg.metric], batch.group_ids)
            n_dropped += len(np.unique(batch.group_ids[~keep]))
            n_kept += len(np.unique(batch.group_ids[keep]))
            if keep.any():
                kept.append(batch.select(np.flatnonzero(keep)))
        metrics["train/num_gen_batches"] = rounds
        metrics["train/num_dropped_groups"] = n_dropped
        metrics.update(extra_means(extras))  # over every round's responses, kept or not (replaces the last round's)
        if not kept:  # every group flat: train on the last round (zero advantages, a no-op update)
            log.warning("dynamic sampling kept no group in %d rounds; this step will not move the policy", rounds)
            return batch, metrics
        if n_kept < target:
            log.warning("dynamic sampling kept %d of %d groups after %d rounds", n_kept, target, rounds)
        batch = concat_batches(kept)
        first_groups = np.unique(batch.group_ids)[:target]
        return batch.select(np.flatnonzero(np.isin(batch.group_ids, first_groups))), metrics

    def generate_and_score(self, prompts, *, seed: int, timings: dict, metrics: dict, output=None
                           ) -> tuple[RLBatch, dict[str, np.ndarray]]:
        """One round of phases gen + reward for a prompt batch (``output``: its responses, already generated, e.g.
        in stages by :mod:`jaxrl.partial_rollout`; then only the reward phase runs).

        Returns the batch with ``token_level_scores`` set and the per-response values ``[N]`` dynamic sampling can
        filter on: ``score`` (reward function), ``acc`` (its ``acc`` output, else the score), ``seq_reward``
        and ``seq_final_reward`` (score after overlong shaping; the in-reward KL is applied after filtering), and
        under ``extras`` the reward function's numeric extra outputs (:func:`numeric_extras`). ``metrics`` gets the
        round's ``reward/<key>/mean`` of those (:func:`extra_means`).
        """
        with timed("gen", timings):
            sp = sampling_params(self.rollout_cfg, self.max_new_tokens, validation=False, seed=seed)
            out, env_rewards = self._generate(prompts, sp, metrics) if output is None else (output, None)
        batch = RLBatch(
            prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, response_ids=out.response_ids,
            response_mask=out.response_mask, group_ids=out.prompt_index, rollout_log_probs=out.rollout_log_probs,
            response_attention_mask=out.response_attention_mask,
        )
        with timed("reward", timings):
            texts = decode_responses(self.tokenizer, batch.response_ids, batch.response_mask)
            rew = self.score(prompts.rows, out.prompt_index, batch, texts, metrics)
            _add(metrics, "reward/num_errors", rew.num_errors)
            _add(metrics, "reward/num_timeouts", rew.num_timeouts)
            scores = rew.scores.astype(np.float32)
            if env_rewards is not None:  # multi-turn environment rewards (jaxrl.agent.env), summed per response
                scores = scores + env_rewards
            penalty = self.reward.overlong_penalty(batch.response_mask.sum(-1), batch.response_width)
            if penalty is not None:  # DAPO's soft overlong punishment (reward_model.overlong_buffer / dapo kwargs)
                metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
                if self.reward.overlong.log:
                    metrics["reward/overlong_ratio"] = float((penalty < 0).mean())
                scores = scores + penalty
            batch.token_level_scores = place_scores_on_last_token(scores, batch.response_mask)
        if "reward_baselines" in ADV_ESTIMATORS.entry(self.algorithm.adv_estimator).inputs:  # ReMax
            with timed("gen_max", timings):  # ReMax's baseline: the score of a greedy response to the same prompt
                greedy = dataclasses.replace(sp, n=1, do_sample=False)
                base_out, base_env = self._generate(prompts, greedy, {})
                base_texts = decode_responses(self.tokenizer, base_out.response_ids, base_out.response_mask)
                base_batch = RLBatch(prompt_ids=base_out.prompt_ids, prompt_mask=base_out.prompt_mask,
                                     response_ids=base_out.response_ids, response_mask=base_out.response_mask,
                                     group_ids=base_out.prompt_index,
                                     response_attention_mask=base_out.response_attention_mask)
                base = self.score(prompts.rows, base_out.prompt_index, base_batch, base_texts, {}).scores
                if base_env is not None:
                    base = base + base_env
            batch.reward_baselines = np.asarray(base, np.float32)[out.prompt_index]
        seq = {
            "score": rew.scores,
            "acc": extra_as_array(rew, "acc", default=rew.scores),
            "seq_reward": scores,
            "seq_final_reward": scores,
            "extras": numeric_extras(rew),
        }
        metrics.update(extra_means([seq["extras"]]))
        if self.prime_filter is not None:  # PRIME: the implicit PRM's labels
            batch.acc = np.clip(seq["acc"], 0.0, 1.0).astype(np.float32)
        return batch, seq

    def _generate(self, prompts, sp, metrics: dict):
        """``(RolloutOutput, env_rewards [N] float32 or None)`` of a round: one engine call (single-turn, the same
        call as before multi-turn existed) or the agent loop (metrics get its ``multi_turn/*``)."""
        if self.agent is None:
            return self.rollout.generate(prompts.prompt_ids, sp), None
        mt = self.agent.run(prompts.rows, sp, prompt_key=self.prompt_key)
        metrics.update(mt.metrics)
        return mt.output, mt.env_rewards

    def score(self, rows, prompt_index, batch: RLBatch, texts, metrics: dict) -> RewardOutput:
        """Sequence scores ``[N]`` of a round: the rule reward, or with a reward model its scores combined with the
        rule reward (:func:`score_with_reward_model`)."""
        if self.reward_model is None:
            return score_responses(self.reward, rows, prompt_index, texts)
        return score_with_reward_model(self.reward_model, self.reward, rows, prompt_index, batch, texts, metrics,
                                       combine=self.reward_model_combine, prompt_key=self.prompt_key)
