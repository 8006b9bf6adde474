"""Every advantage estimator, policy loss, KL variant and TIS inside the real RL loop, each shown to DO something.

Short runs of the real quickstart (stories260K, configs/quickstart.yaml) through ``run_training``; the checks read
the runs' ``metrics.jsonl``. Each option is compared with a baseline run of the same seed, so step 1 trains on the
same rollouts (asserted: equal score and length statistics) and only the option's effect differs; where a closed
form is cheap, the logged value is recomputed from other logged values. Every assertion would fail if the option
were silently ignored (the run would then log the baseline's numbers). The numerics of each function against
numpy are in tests/algorithms; this file checks that the config reaches them in the loop.

The batch is built so the closed forms are simple:
- ``rollout.n=2``: a group's advantages are +-(s_a - s_b) / 2 times the estimator's scale (GRPO: +-1/sqrt(2)).
- ``rollout.stop_token_ids=[<".">]``: responses end at their first sentence, so lengths differ and token-weighted
  means (``critic/advantages/mean``, the token-mean loss) differ from sequence means.
- ``ppo_mini_batch_size = train_batch_size`` with one micro-batch: one optimizer update per step, at which the
  policy equals pi_old (ratio 1), so e.g. the vanilla loss is exactly ``-critic/advantages/mean``; the KL runs use
  ``ppo_epochs=2`` so their second update sees a policy that moved away from the reference.

All runs share a persistent XLA compilation cache (one per module, restored afterwards), so only the programs an
option changes are compiled again. 23 catalogue runs + 2 PPO runs, about 4-6 minutes on 2 cores: marked slow.
"""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from jaxrl.config.loader import load_config
from jaxrl.trainer import run_training

pytestmark = pytest.mark.slow

N = 2  # responses per prompt
PROMPTS = 8
ROWS = PROMPTS * N  # responses per step (the batch size the estimators and the KL controller see)
A = "actor_rollout_ref.actor"


def _tiny(stop_id: int) -> list[str]:
    return [
        f"data.train_batch_size={PROMPTS}", "data.max_response_length=24", "data.val_max_samples=4",
        f"actor_rollout_ref.rollout.n={N}", f"actor_rollout_ref.rollout.stop_token_ids=[{stop_id}]",
        f"{A}.ppo_mini_batch_size={PROMPTS}", f"{A}.ppo_micro_batch_size_per_gpu={ROWS}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={ROWS}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={ROWS}",
        f"{A}.use_kl_loss=false",
        "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
    ]


KL_BASE = [f"{A}.ppo_epochs=2", f"{A}.kl_loss_coef=1.0"]

RUNS = {
    # estimators (vanilla loss)
    "grpo": [],
    "drgrpo": ["algorithm.norm_adv_by_std_in_grpo=false"],
    "grpo_eps": ["algorithm.adv_std_epsilon=1.0"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "rf++": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "rf++b": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    "remax": ["algorithm.adv_estimator=remax"],
    "passk": ["algorithm.adv_estimator=grpo_passk"],
    "opo": ["algorithm.adv_estimator=opo"],
    "gpg_adv": ["algorithm.adv_estimator=gpg"],
    # policy losses (grpo advantages)
    "gspo": [f"{A}.policy_loss.loss_mode=gspo"],
    "cispo": [f"{A}.policy_loss.loss_mode=cispo"],
    "clip_cov": [f"{A}.policy_loss.loss_mode=clip_cov", f"{A}.policy_loss.clip_cov_ratio=0.05",
                 f"{A}.policy_loss.clip_cov_lb=-1000", f"{A}.policy_loss.clip_cov_ub=1000"],
    "kl_cov": [f"{A}.policy_loss.loss_mode=kl_cov", f"{A}.policy_loss.kl_cov_ratio=0.1"],
    "gpg_loss": [f"{A}.policy_loss.loss_mode=gpg"],
    "tis": [f"{A}.tis_imp_ratio_cap=0.5"],
    # KL loss variants: two updates on the step's batch
    "kl_none": KL_BASE,
    "kl_k3": KL_BASE + [f"{A}.use_kl_loss=true", f"{A}.kl_loss_type=low_var_kl"],
    "kl_k3+": KL_BASE + [f"{A}.use_kl_loss=true", f"{A}.kl_loss_type=low_var_kl+"],
    "kl_k3_is": KL_BASE + [f"{A}.use_kl_loss=true", f"{A}.kl_loss_type=low_var_kl_is"],
    "kl_full": KL_BASE + [f"{A}.use_kl_loss=true", f"{A}.kl_loss_type=full"],
    "kl_k1": KL_BASE + [f"{A}.use_kl_loss=true", f"{A}.kl_loss_type=k1"],
    # KL in the reward with the adaptive controller: two steps
    "kl_reward": [
        "trainer.total_training_steps=2", "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=low_var_kl",
        "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.5", "algorithm.kl_ctrl.target_kl=0.01",
        "algorithm.kl_ctrl.horizon=100",
    ],
}


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """A persistent XLA compilation cache for this module's runs (each run builds fresh jitted functions; the
    cache lets a run reuse the programs an earlier run compiled). The previous settings are restored."""
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old = {k: getattr(jax.config, k) for k in keys}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()
    yield
    for k, v in old.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def stop_id(shared):
    """The stories260K token id of "." (responses end at their first sentence, so lengths differ)."""
    from jaxrl.models.resolve import resolve_model_path
    from jaxrl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(resolve_model_path("stories260K")))
    tid = tok.convert_tokens_to_ids(".")
    assert tok.decode([tid]) == "."
    return tid


@pytest.fixture(scope="module")
def runs(shared, compile_cache, stop_id, tmp_path_factory):
    """``runs(name)`` -> the run's metrics.jsonl records (one per step); each named run happens once per module."""
    done: dict[str, list[dict]] = {}

    def get(name: str) -> list[dict]:
        if name not in done:
            out = tmp_path_factory.mktemp(name.replace("+", "p"))
            overrides = _tiny(stop_id) + RUNS[name] + [f"trainer.default_local_dir={out}"]
            run_training(load_config("configs/quickstart.yaml", overrides))
            done[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in done[name]] == list(range(1, len(done[name]) + 1))
            for r in done[name]:
                assert r["actor/nonfinite_grad"] == 0
        return done[name]

    return get


BATCH_KEYS = [f"critic/score/{s}" for s in ("mean", "max", "min")] + [
    f"response_length/{s}" for s in ("mean", "max", "min")
]


def step1(runs, name: str, like: str = "grpo") -> dict:
    """Step 1's metrics of run ``name``, after checking it trained on the same rollouts as run ``like``."""
    rec, ref = runs(name)[0], runs(like)[0]
    assert {k: rec[k] for k in BATCH_KEYS} == {k: ref[k] for k in BATCH_KEYS}, "not the same step-1 rollouts"
    return rec


def adv(rec: dict) -> np.ndarray:
    """(mean, max, min) of the token-level advantages."""
    return np.array([rec[f"critic/advantages/{s}"] for s in ("mean", "max", "min")])


def n_tokens(rec: dict) -> int:
    return round(rec["response_length/mean"] * ROWS)


def top_k_fraction(ratio: float, n: int) -> float:
    """Share of ``n`` valid tokens selected by Clip-Cov / KL-Cov: ``max(int(ratio * n), 1) / n`` (verl)."""
    return max(int(ratio * n + 1e-6), 1) / n


def differs(a: float, b: float, rel: float = 1e-2) -> bool:
    """``a`` and ``b`` differ by more than rounding could explain."""
    return abs(a - b) > rel * max(abs(a), abs(b), 1e-3)


# ----------------------------------------------------------------------------- the batch itself


def test_batch_has_what_the_closed_forms_need(runs):
    g = runs("grpo")[0]
    assert g["response_length/min"] < g["response_length/max"]  # the stop token ends responses at different lengths
    assert g["critic/score/min"] < g["critic/score/max"]
    assert abs(g["critic/advantages/mean"]) > 1e-3  # token mean != sequence mean (0 for GRPO)


# ----------------------------------------------------------------------------- advantage estimators


def test_grpo_advantages_are_group_standardised(runs):
    g = step1(runs, "grpo")
    # n = 2: (s - mean) / std(ddof=1) = +-1/sqrt(2) in every group whose two scores differ, 0 in the others.
    assert g["critic/advantages/max"] == pytest.approx(1 / math.sqrt(2), rel=1e-5)
    assert g["critic/advantages/min"] == pytest.approx(-1 / math.sqrt(2), rel=1e-5)
    np.testing.assert_allclose([g[f"critic/returns/{s}"] for s in ("mean", "max", "min")], adv(g), rtol=1e-6)


def test_dr_grpo_does_not_divide_by_the_std(runs):
    g, d = step1(runs, "grpo"), step1(runs, "drgrpo")
    # Dr. GRPO: s - mean = +-(s_a - s_b) / 2, which is not the unit-scaled +-1/sqrt(2) of GRPO.
    assert differs(d["critic/advantages/max"], g["critic/advantages/max"])
    assert differs(d["critic/advantages/mean"], g["critic/advantages/mean"])
    assert d["critic/advantages/max"] > 0 and d["critic/advantages/min"] < 0


def test_grpo_std_epsilon_reaches_the_estimator(runs):
    d, e = step1(runs, "drgrpo"), step1(runs, "grpo_eps")
    # A = (s - mean) / (std + eps) = +-(g / 2) / (g / sqrt(2) + eps) for a group gap g, largest at the largest gap,
    # whose Dr. GRPO advantage is m = g / 2: A_max = m / (sqrt(2) m + eps), with eps = algorithm.adv_std_epsilon = 1.
    m = d["critic/advantages/max"]
    assert e["critic/advantages/max"] == pytest.approx(m / (math.sqrt(2) * m + 1.0), rel=1e-5)
    assert e["critic/advantages/max"] < 0.99 / math.sqrt(2)  # not GRPO's +-1/sqrt(2) at eps = 1e-6


def test_rloo_is_leave_one_out(runs):
    d, r = step1(runs, "drgrpo"), step1(runs, "rloo")
    # s_i - mean_{j != i} s_j = n / (n - 1) * (s_i - mean_g): per token exactly 2x Dr. GRPO's for n = 2.
    np.testing.assert_allclose(adv(r), N / (N - 1) * adv(d), rtol=1e-5, atol=1e-7)


def test_grpo_passk_rewards_only_the_best_response(runs):
    g, p = step1(runs, "grpo"), step1(runs, "passk")
    # best: (s_max - s_second) / std = |s_a - s_b| / (|s_a - s_b| / sqrt(2)) = 2x GRPO's; every other response: 0.
    assert p["critic/advantages/max"] == pytest.approx(2 * g["critic/advantages/max"], rel=1e-5)
    assert p["critic/advantages/min"] == 0.0
    assert g["critic/advantages/min"] < 0


def test_opo_baseline_is_length_weighted(runs):
    d, o = step1(runs, "drgrpo"), step1(runs, "opo")
    # b_g = sum L_i s_i / sum L_i, so sum_i L_i (s_i - b_g) = 0: the token-weighted advantage mean is exactly 0,
    # while the plain group mean (Dr. GRPO) leaves a non-zero token mean when lengths differ.
    assert abs(o["critic/advantages/mean"]) < 1e-7
    assert abs(d["critic/advantages/mean"]) > 1e-3
    assert differs(o["critic/advantages/max"], d["critic/advantages/max"])


def test_gpg_advantage_is_rescaled_by_the_share_of_non_zero_scores(runs):
    d, p = step1(runs, "drgrpo"), step1(runs, "gpg_adv")
    # A = alpha (s - mean_g) with alpha = B / #{score != 0}: every statistic is alpha x Dr. GRPO's.
    alpha = p["critic/advantages/max"] / d["critic/advantages/max"]
    np.testing.assert_allclose(adv(p), alpha * adv(d), rtol=1e-5, atol=1e-7)
    nonzero = ROWS / alpha
    assert nonzero == pytest.approx(round(nonzero), abs=1e-4) and 1 <= round(nonzero) < ROWS, alpha


def test_reinforce_plus_plus_whitens_the_return_over_the_batch(runs):
    r = step1(runs, "rf++")
    ret = {s: r[f"critic/returns/{s}"] for s in ("mean", "max", "min")}
    # gamma = 1: every token's return is its response's score; advantages = (return - mu) / sigma over tokens,
    # mu = the token mean of the returns: token mean 0 and the same 1/sigma at both ends.
    assert ret["max"] == r["critic/score/max"] and ret["min"] == r["critic/score/min"]
    assert abs(r["critic/advantages/mean"]) < 1e-6
    inv_sigma = r["critic/advantages/max"] / (ret["max"] - ret["mean"])
    assert r["critic/advantages/min"] / (ret["min"] - ret["mean"]) == pytest.approx(inv_sigma, rel=1e-4)
    assert differs(inv_sigma, 1.0)  # the whitening really rescaled


def test_reinforce_plus_plus_baseline_whitens_group_centred_scores(runs):
    d, b, r = step1(runs, "drgrpo"), step1(runs, "rf++b"), step1(runs, "rf++")
    # (s - mean_g) per token (Dr. GRPO's advantages), whitened over the batch's tokens.
    assert abs(b["critic/advantages/mean"]) < 1e-6
    inv_sigma = b["critic/advantages/max"] / (d["critic/advantages/max"] - d["critic/advantages/mean"])
    low = b["critic/advantages/min"] / (d["critic/advantages/min"] - d["critic/advantages/mean"])
    assert low == pytest.approx(inv_sigma, rel=1e-4)
    assert differs(b["critic/advantages/max"], r["critic/advantages/max"])  # the group baseline matters


def test_remax_subtracts_the_greedy_rollouts_score(runs):
    m, r = step1(runs, "remax"), step1(runs, "rf++")
    assert m["timing_s/gen_max"] > 0  # the greedy baseline rollout ran
    # returns = undiscounted reward-to-go = the score on every token (as REINFORCE++'s with gamma = 1) ...
    for s in ("mean", "max", "min"):
        assert m[f"critic/returns/{s}"] == pytest.approx(r[f"critic/returns/{s}"], rel=1e-6)
    # ... and the advantages are the returns minus the greedy response's score, not the returns themselves.
    assert differs(m["critic/advantages/mean"], m["critic/returns/mean"])


# ----------------------------------------------------------------------------- policy losses (at ratio 1)


def test_vanilla_loss_at_ratio_one_is_minus_the_token_mean_advantage(runs):
    g = step1(runs, "grpo")
    # pi = pi_old at the step's single update: max(-A r, -A clip(r)) = -A, token-mean over the batch.
    assert g["actor/pg_loss"] == pytest.approx(-g["critic/advantages/mean"], abs=1e-6)
    assert g["actor/pg_clipfrac"] == 0 and g["actor/pg_clipfrac_lower"] == 0
    assert abs(g["actor/ppo_kl"]) < 1e-5


def test_gspo_is_a_sequence_mean(runs):
    g, s = step1(runs, "grpo"), step1(runs, "gspo")
    # GSPO aggregates seq-mean-token-mean: -mean_i A_i, which is 0 for GRPO (each group's advantages sum to 0),
    # unlike vanilla's token mean.
    assert abs(s["actor/pg_loss"]) < 1e-6
    assert abs(g["actor/pg_loss"]) > 1e-3


def test_cispo_and_gpg_losses_weight_log_probs(runs):
    g, c, p = step1(runs, "grpo"), step1(runs, "cispo"), step1(runs, "gpg_loss")
    # CISPO: -sg(clip(r)) A log pi; GPG: -A log pi. At r = 1 both are -mean(A log pi), not vanilla's -mean(A).
    assert differs(c["actor/pg_loss"], g["actor/pg_loss"], rel=0.1)
    assert c["actor/pg_loss"] == pytest.approx(p["actor/pg_loss"], rel=1e-5)
    # ... while all three have the gradient -A grad log pi there (PPO's: -A grad r = -A r grad log pi).
    assert c["actor/grad_norm"] == pytest.approx(g["actor/grad_norm"], rel=1e-5)
    assert p["actor/grad_norm"] == pytest.approx(g["actor/grad_norm"], rel=1e-5)
    assert c["actor/pg_clipfrac"] == 0  # r = 1 is inside the clip range


def test_clip_cov_cuts_the_configured_share_of_tokens(runs):
    g, c = step1(runs, "grpo"), step1(runs, "clip_cov")
    # clip_cov_ratio=0.05 with a covariance band that admits every token: int(0.05 n) tokens lose their gradient.
    assert c["actor/pg_clipfrac"] == pytest.approx(top_k_fraction(0.05, n_tokens(c)), rel=1e-5)
    assert g["actor/pg_clipfrac"] == 0
    assert differs(c["actor/pg_loss"], g["actor/pg_loss"])
    assert differs(c["actor/grad_norm"], g["actor/grad_norm"])


def test_kl_cov_penalises_the_configured_share_of_tokens(runs):
    g, k = step1(runs, "grpo"), step1(runs, "kl_cov")
    assert k["actor/kl_cov_frac"] == pytest.approx(top_k_fraction(0.1, n_tokens(k)), rel=1e-5)
    assert k["actor/ppo_kl_abs"] < 1e-5  # |log r| at r = 1: the penalty is ~0 on the first update
    assert "actor/kl_cov_frac" not in g and "actor/ppo_kl_abs" not in g


def test_tis_weights_scale_the_loss(runs):
    g, t = step1(runs, "grpo"), step1(runs, "tis")
    # The embedded sampler and the trainer agree on the log-probs (ratio pi_old / pi_rollout ~ 1), so with
    # cap 0.5 every weight min(ratio, cap) is 0.5: loss and gradient are exactly half the uncorrected run's.
    assert g["training/rollout_probs_diff_max"] < 1e-4
    assert t["actor/pg_loss"] == pytest.approx(0.5 * g["actor/pg_loss"], rel=1e-4)
    assert t["actor/grad_norm"] == pytest.approx(0.5 * g["actor/grad_norm"], rel=1e-4)


# ----------------------------------------------------------------------------- KL loss (two updates per step)


def test_no_kl_loss_logs_no_kl(runs):
    none = step1(runs, "kl_none")
    assert "actor/kl_loss" not in none and "actor/kl_coef" not in none
    assert none["actor/ppo_kl"] != 0  # the second update saw a policy that had moved


def test_low_var_kl_loss(runs):
    none, k3 = step1(runs, "kl_none"), step1(runs, "kl_k3")
    assert k3["actor/kl_coef"] == 1.0
    assert k3["actor/kl_loss"] > 1e-4
    # k3's gradient is 0 at pi = pi_ref (first update): same first update, same pg_loss; the second differs.
    assert k3["actor/pg_loss"] == pytest.approx(none["actor/pg_loss"], rel=1e-4)
    assert differs(k3["actor/grad_norm"], none["actor/grad_norm"])


def test_straight_through_kl_keeps_the_value_and_changes_the_gradient(runs):
    k3, st = step1(runs, "kl_k3"), step1(runs, "kl_k3+")
    # low_var_kl+: the value is k3's, the gradient k2's (d log pi instead of (1 - pi_ref/pi) log pi).
    assert st["actor/kl_loss"] == pytest.approx(k3["actor/kl_loss"], rel=1e-5)
    assert differs(st["actor/grad_norm"], k3["actor/grad_norm"])


def test_importance_weighted_kl_reaches_the_loss(runs):
    none, k3, st, iw = (step1(runs, n) for n in ("kl_none", "kl_k3", "kl_k3+", "kl_k3_is"))
    # First update at pi = pi_old = pi_ref: d = 0, no KL gradient, so the second starts from the same params as
    # without KL and pg_loss is the same.
    assert iw["actor/pg_loss"] == pytest.approx(none["actor/pg_loss"], rel=1e-4)
    # Second update off-policy (pi_old = pi_ref at step 1): the value is k3 x pi / pi_old, not k3, and the gradient
    # (pi / pi_old) d, neither k3's (1 - pi_ref / pi) nor k3+'s d.
    assert iw["actor/kl_loss"] > 1e-5 and differs(iw["actor/kl_loss"], k3["actor/kl_loss"])
    assert differs(iw["actor/grad_norm"], st["actor/grad_norm"])
    assert differs(iw["actor/grad_norm"], k3["actor/grad_norm"])


def test_full_kl_is_the_exact_kl_over_the_vocabulary(runs):
    none, k3, full = step1(runs, "kl_none"), step1(runs, "kl_k3"), step1(runs, "kl_full")
    assert full["actor/kl_loss"] > 1e-5  # an exact KL, >= 0
    assert differs(full["actor/kl_loss"], k3["actor/kl_loss"])  # not the sampled-token estimate
    assert full["actor/pg_loss"] == pytest.approx(none["actor/pg_loss"], rel=1e-4)  # zero gradient at pi = pi_ref
    assert differs(full["actor/grad_norm"], none["actor/grad_norm"])


def test_k1_kl_is_the_mean_log_ratio(runs):
    none, k1 = step1(runs, "kl_none"), step1(runs, "kl_k1")
    # At step 1 pi_old = pi_ref, so k1 = mean(log pi - log pi_ref) = -ppo_kl on both updates (0 on the first).
    assert k1["actor/kl_loss"] == pytest.approx(-k1["actor/ppo_kl"], rel=1e-4, abs=1e-7)
    assert abs(k1["actor/kl_loss"]) > 1e-4
    # k1's gradient is not 0 at pi = pi_ref: already the first update differs from the run without KL.
    assert differs(k1["actor/pg_loss"], none["actor/pg_loss"])


# ----------------------------------------------------------------------------- KL in the reward, adaptive beta


def test_adaptive_kl_in_reward(runs):
    first, second = runs("kl_reward")
    assert first["actor/reward_kl_penalty_coeff"] == 0.5  # kl_ctrl.kl_coef
    # Step 1: pi_old = pi_ref, no penalty; the controller then moves beta (Ziegler et al. 2019, verl):
    # beta * (1 + clip(kl / target - 1, -0.2, 0.2) * batch / horizon).
    assert first["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-7)
    assert first["critic/rewards/mean"] == pytest.approx(first["critic/score/mean"], abs=1e-7)
    err = min(max(first["actor/reward_kl_penalty"] / 0.01 - 1, -0.2), 0.2)
    assert second["actor/reward_kl_penalty_coeff"] == pytest.approx(0.5 * (1 + err * ROWS / 100), rel=1e-6)
    # Step 2: the policy moved; every response's reward is its score minus beta * (its summed per-token k3), so
    # the mean gap lies between beta * kl * shortest and beta * kl * longest response.
    kl, beta = second["actor/reward_kl_penalty"], second["actor/reward_kl_penalty_coeff"]
    gap = second["critic/score/mean"] - second["critic/rewards/mean"]
    assert kl > 1e-5
    assert beta * kl * second["response_length/min"] * (1 - 1e-3) <= gap
    assert gap <= beta * kl * second["response_length/max"] * (1 + 1e-3)


# ----------------------------------------------------------------------------- PPO with a critic


TINY_PPO = [
    "data.train_batch_size=4", "data.max_response_length=10", "data.val_max_samples=4",
    "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_ppo_with_critic_runs_in_the_loop(shared, compile_cache, tmp_path):
    cfg = load_config("configs/ppo_quickstart.yaml", TINY_PPO + [
        "critic.ppo_micro_batch_size_per_gpu=2", "critic.forward_micro_batch_size_per_gpu=8",
        f"trainer.default_local_dir={tmp_path}",
    ])
    run_training(cfg)
    records = _records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("critic/vf_loss", "critic/vf_explained_var", "critic/values/mean", "timing_s/update_critic"):
            assert math.isfinite(r[key]), key


def test_critic_warmup_holds_the_actor(shared, compile_cache, tmp_path):
    cfg = load_config("configs/ppo_quickstart.yaml", TINY_PPO + [
        "critic.ppo_micro_batch_size_per_gpu=2", "trainer.critic_warmup=1", f"trainer.default_local_dir={tmp_path}",
    ])
    run_training(cfg)
    first, second = _records(tmp_path / "metrics.jsonl")
    assert "actor/pg_loss" not in first and "critic/vf_loss" in first
    assert "actor/pg_loss" in second
