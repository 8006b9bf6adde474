"""Value checks of a loaded config: every key's range / choice, the documented derived defaults, the rewards.

Each check raises :class:`~jaxrl.config.errors.ConfigError` naming the full dotted key, the bad value and what
would be valid. Checks that tie sections together (verl's batch arithmetic, the mesh, the options of the chosen
estimator / loss) are :mod:`jaxrl.config.cross`. No jax import.
"""

from __future__ import annotations

import importlib.util
import math
import re
import typing
from typing import Any, Iterable, Optional

from jaxrl.algorithms import registry
from jaxrl.config import schema
from jaxrl.config.errors import ConfigError
from jaxrl.config.parse import type_name
from jaxrl.config.schema import JaxRLConfig

__all__ = ["Checks", "get", "import_external_libs", "is_int", "normalise", "normalise_prime", "real",
           "validate_rewards", "validate_sections"]

_MAX_SEED = 2**32


# ------------------------------------------------------------------------------ validation
def get(cfg: JaxRLConfig, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Checks:
    """Small predicates; each raises ConfigError naming the key, the value and what is valid."""

    def __init__(self, cfg: JaxRLConfig):
        self.cfg = cfg

    def fail(self, key: str, expected: str) -> typing.NoReturn:
        raise ConfigError(f"{key}={get(self.cfg, key)!r} is invalid; expected {expected}")

    def choice(self, key: str, choices: Iterable[str]) -> None:
        choices = tuple(choices)
        if get(self.cfg, key) not in choices:
            self.fail(key, "one of " + ", ".join(repr(c) for c in choices))

    def int_at_least(self, key: str, lo: int, *, off: Optional[int] = None, nullable: bool = False) -> None:
        v = get(self.cfg, key)
        if nullable and v is None:
            return
        if off is not None and v == off and is_int(v):
            return
        if not (is_int(v) and v >= lo):
            extra = (f" or {off} (off)" if off is not None else "") + (" or null" if nullable else "")
            self.fail(key, f"an int >= {lo}{extra}")

    def real(self, key: str, lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False) -> None:
        v = get(self.cfg, key)
        ok = real(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        if not ok:
            lb, rb = ("(" if lo_open else "["), (")" if hi_open else "]")
            self.fail(key, f"a finite number in {lb}{lo}, {hi}{rb}".replace("inf]", "inf)"))

    def text(self, key: str, *, nullable: bool = False) -> None:
        v = get(self.cfg, key)
        if nullable and v is None:
            return
        if not (isinstance(v, str) and v.strip()):
            self.fail(key, "a non-empty string" + (" or null" if nullable else ""))

    def files(self, key: str, *, nullable: bool) -> None:
        v = get(self.cfg, key)
        if nullable and v is None:
            return
        if not (isinstance(v, list) and v and all(isinstance(f, str) and f.strip() for f in v)):
            self.fail(key, "a file path or a non-empty list of file paths" + (" (or null)" if nullable else ""))

    def optim(self, prefix: str) -> None:
        """An :class:`~jaxrl.config.schema.OptimConfig` section at ``prefix``."""
        self.real(f"{prefix}.lr", 0.0, lo_open=True)
        self.real(f"{prefix}.lr_warmup_steps_ratio", 0.0, 1.0)
        self.int_at_least(f"{prefix}.lr_warmup_steps", 0, off=-1)
        self.real(f"{prefix}.weight_decay", 0.0)
        betas = get(self.cfg, f"{prefix}.betas")
        if not (len(betas) == 2 and all(real(b) and 0.0 <= b < 1.0 for b in betas)):
            self.fail(f"{prefix}.betas", "two numbers in [0, 1), e.g. [0.9, 0.999]")
        self.real(f"{prefix}.eps", 0.0, lo_open=True)
        self.real(f"{prefix}.min_lr_ratio", 0.0, 1.0)
        self.choice(f"{prefix}.lr_scheduler_type", schema.LR_SCHEDULER_CHOICES)

    def lora(self, prefix: str) -> None:
        """The LoRA keys of a model section (``lora_rank``, ``lora_alpha``, ``target_modules``, ``exclude_modules``
        where the section has it): whether a pattern selects anything is checked against the model at build."""
        self.int_at_least(f"{prefix}.lora_rank", 0)
        if get(self.cfg, f"{prefix}.lora_rank") == 0:
            return
        self.real(f"{prefix}.lora_alpha", 0.0, lo_open=True)
        for name in ("target_modules", "exclude_modules"):
            key = f"{prefix}.{name}"
            section = get(self.cfg, prefix)
            if not hasattr(section, name):
                continue
            v = getattr(section, name)
            if v is None and name == "exclude_modules":
                continue
            if isinstance(v, (list, tuple)) and v and all(isinstance(x, str) and x.strip() for x in v):
                bad = [x for x in v if x.split(".")[-1] in ("embed_tokens", "lm_head")]
                if bad:
                    self.fail(key, f"projection names (LoRA on {', '.join(bad)} is not supported): q_proj, k_proj, "
                                   "v_proj, o_proj, gate_proj, up_proj, down_proj, or 'all-linear'")
                continue
            if isinstance(v, str) and v.strip():
                try:
                    re.compile(v)
                except re.error as e:
                    self.fail(key, f"'all-linear', a regular expression ({e}) or a list of module names")
                continue
            self.fail(key, "'all-linear', a regular expression over module names, or a list of module names"
                           + (" (or null)" if name == "exclude_modules" else ""))

    def preference_loss(self, prefix: str) -> None:
        """A :class:`~jaxrl.config.schema.PreferenceLossConfig` section at ``prefix`` (``algorithm.dpo``): a
        registered ``loss_type``, ``beta`` > 0, ``label_smoothing`` in ``[0, 0.5]`` (``robust``: ``[0, 0.5)``)."""
        self.choice(f"{prefix}.loss_type", registry.PREFERENCE_LOSSES.names())  # built-in + external_lib's
        self.real(f"{prefix}.beta", 0.0, lo_open=True)
        robust = get(self.cfg, f"{prefix}.loss_type") == "robust"
        self.real(f"{prefix}.label_smoothing", 0.0, 0.5, hi_open=robust)

    def real_or_off(self, key: str, *, off: float) -> None:
        """A finite number > 0, or exactly ``off`` (the documented "disabled" value)."""
        v = get(self.cfg, key)
        if not (real(v) and (v > 0 or v == off)):
            self.fail(key, f"a finite number > 0, or {off} (off)")

    def sampling(self, prefix: str) -> None:
        self.int_at_least(f"{prefix}.n", 1)
        self.real(f"{prefix}.temperature", 0.0)
        self.real(f"{prefix}.top_p", 0.0, 1.0, lo_open=True)
        self.int_at_least(f"{prefix}.top_k", -1)

def normalise_data_files_and_seed(cfg) -> None:
    """``data.train_files`` / ``data.val_files`` as lists (a single path becomes a one-item list) and ``data.seed``
    defaulting to ``trainer.seed``: shared by the RL and the offline configs."""
    d = cfg.data
    for name in ("train_files", "val_files"):
        v = getattr(d, name)
        if isinstance(v, str):
            setattr(d, name, [v])
        elif isinstance(v, (list, tuple)):
            setattr(d, name, list(v))
    if d.seed is None:
        d.seed = cfg.trainer.seed


def normalise(cfg: JaxRLConfig) -> None:
    """Fill the documented derived defaults and normalise file lists (see :func:`load_config`)."""
    normalise_data_files_and_seed(cfg)
    d = cfg.data
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    if actor.clip_ratio_low is None:
        actor.clip_ratio_low = actor.clip_ratio
    if actor.clip_ratio_high is None:
        actor.clip_ratio_high = actor.clip_ratio
    if rollout.max_new_tokens is None:
        rollout.max_new_tokens = d.max_response_length
    if rollout.seed is None:
        rollout.seed = cfg.trainer.seed
    if d.gen_batch_size is None:
        d.gen_batch_size = d.train_batch_size
    critic, model = cfg.critic, cfg.actor_rollout_ref.model
    for name in ("enable_gradient_checkpointing", "recompute_granularity", "dtype", "param_dtype",
                 "use_remove_padding"):
        if getattr(critic.model, name) is None:
            setattr(critic.model, name, getattr(model, name))
    # verl's dynamic-batch defaults (oc.select): the log-prob / reference / critic switches follow the actor's,
    # their budgets the actor's (the critic's forward its update budget)
    for section in (rollout, cfg.actor_rollout_ref.ref):
        if section.log_prob_use_dynamic_bsz is None:
            section.log_prob_use_dynamic_bsz = actor.use_dynamic_bsz
        if section.log_prob_max_token_len_per_gpu is None:
            section.log_prob_max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    if critic.use_dynamic_bsz is None:
        critic.use_dynamic_bsz = actor.use_dynamic_bsz
    if critic.forward_max_token_len_per_gpu is None:
        critic.forward_max_token_len_per_gpu = critic.ppo_max_token_len_per_gpu
    if critic.ppo_mini_batch_size is None:
        critic.ppo_mini_batch_size = actor.ppo_mini_batch_size
    if critic.ppo_epochs is None:
        critic.ppo_epochs = actor.ppo_epochs
    if critic.forward_micro_batch_size_per_gpu is None:
        critic.forward_micro_batch_size_per_gpu = critic.ppo_micro_batch_size_per_gpu
    libs = cfg.algorithm.external_lib
    if isinstance(libs, str):
        cfg.algorithm.external_lib = [libs]
    elif isinstance(libs, (list, tuple)):
        cfg.algorithm.external_lib = list(libs)


def normalise_prime(cfg: JaxRLConfig) -> None:
    """PRIME's derived defaults (after ``algorithm.external_lib`` is imported, so a registered estimator that reads
    ``rm_scores`` counts): under an estimator that needs the implicit PRM the null ``data.filter_accuracy`` /
    ``oversample_factor`` / ``filter_truncate`` take verl's recipe values (True / 4.0 / True), otherwise the
    filter is off (False / 1.0 / False); under PRIME ``reward_model.mini_batch_size`` null -> the value of
    ``actor_rollout_ref.actor.ppo_mini_batch_size`` (verl's recipe interpolation; it counts responses)."""
    name = cfg.algorithm.adv_estimator
    prime = name in registry.ADV_ESTIMATORS.names() and registry.needs_prm(name)
    d = cfg.data
    if d.filter_accuracy is None:
        d.filter_accuracy = prime
    if d.oversample_factor is None:
        d.oversample_factor = 4.0 if prime else 1.0
    if d.filter_truncate is None:
        d.filter_truncate = prime
    if prime and cfg.reward_model.mini_batch_size is None:
        cfg.reward_model.mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size


def import_external_libs(cfg: JaxRLConfig) -> None:
    """Import ``algorithm.external_lib`` (module names or ``.py`` files), so what they register with
    :mod:`jaxrl.algorithms.registry` is a valid ``algorithm.adv_estimator`` / ``policy_loss.loss_mode``.

    Raises:
      ConfigError: not a string / list of strings, or a module that cannot be imported (missing, a syntax error,
        an exception while importing, a name registered twice); the message names the module and the cause.
    """
    key = "algorithm.external_lib"
    libs = cfg.algorithm.external_lib
    if libs is None:
        return
    if not (isinstance(libs, list) and libs and all(isinstance(x, str) and x.strip() for x in libs)):
        Checks(cfg).fail(key, "a module name or .py file (or a list of them) that registers advantage estimators / "
                              "policy losses, or null")
    for lib in libs:
        try:
            registry.import_external_libs([lib])
        except Exception as e:  # noqa: BLE001 -- any failure of the user's module is a config error, on one line
            cause = (str(e).strip().splitlines() or [""])[0]
            raise ConfigError(
                f"{key}={lib!r} cannot be imported ({type(e).__name__}: {cause}); expected a module on sys.path or "
                "a .py file whose @register_adv_estimator / @register_policy_loss (jaxrl.algorithms.registry) run "
                "on import"
            ) from None

def validate_sections(cfg: JaxRLConfig, c: Checks) -> None:
    """Ranges and choices of every key in ``data``, ``actor_rollout_ref``, ``algorithm``, ``critic`` and ``trainer``
    (the mesh keys aside: :func:`jaxrl.config.cross.validate_mesh`)."""
    # data
    c.files("data.train_files", nullable=False)
    c.files("data.val_files", nullable=True)
    c.int_at_least("data.train_batch_size", 1)
    c.int_at_least("data.gen_batch_size", 1)
    c.int_at_least("data.val_batch_size", 1, nullable=True)
    c.int_at_least("data.val_max_samples", 1, off=-1)
    c.int_at_least("data.train_max_samples", 1, off=-1)
    c.int_at_least("data.max_prompt_length", 1)
    c.int_at_least("data.max_response_length", 1)
    c.choice("data.truncation", schema.TRUNCATION_CHOICES)
    c.text("data.prompt_key")
    c.int_at_least("data.seed", 0)
    # model
    c.text("actor_rollout_ref.model.path")
    c.text("actor_rollout_ref.model.tokenizer_path", nullable=True)
    c.choice("actor_rollout_ref.model.dtype", schema.DTYPE_CHOICES)
    c.choice("actor_rollout_ref.model.param_dtype", schema.DTYPE_CHOICES)
    c.choice("actor_rollout_ref.model.recompute_granularity", schema.RECOMPUTE_GRANULARITY_CHOICES)
    c.lora("actor_rollout_ref.model")
    # optimizer
    c.optim("actor_rollout_ref.actor.optim")
    # actor
    a = "actor_rollout_ref.actor"
    c.real(f"{a}.grad_clip", -math.inf)
    c.int_at_least(f"{a}.ppo_mini_batch_size", 1)
    c.int_at_least(f"{a}.ppo_micro_batch_size_per_gpu", 1, nullable=True)
    c.int_at_least(f"{a}.ppo_epochs", 1)
    c.int_at_least(f"{a}.ppo_max_token_len_per_gpu", 1)
    c.real(f"{a}.kl_loss_coef", 0.0)
    c.choice(f"{a}.kl_loss_type", schema.KL_LOSS_TYPE_CHOICES)
    c.real(f"{a}.entropy_coeff", 0.0)
    c.real(f"{a}.clip_ratio", 0.0, lo_open=True)
    c.real(f"{a}.clip_ratio_low", 0.0, 1.0, lo_open=True, hi_open=True)
    c.real(f"{a}.clip_ratio_high", 0.0, lo_open=True)
    c.real(f"{a}.clip_ratio_c", 1.0, lo_open=True)
    c.choice(f"{a}.loss_agg_mode", schema.LOSS_AGG_MODE_CHOICES)
    c.choice(f"{a}.policy_loss.loss_mode", registry.POLICY_LOSSES.names())  # built-in + external_lib's
    c.real(f"{a}.policy_loss.clip_cov_ratio", 0.0, 1.0, lo_open=True)
    c.real(f"{a}.policy_loss.clip_cov_lb", -math.inf)
    c.real(f"{a}.policy_loss.clip_cov_ub", -math.inf)
    pl = cfg.actor_rollout_ref.actor.policy_loss
    if not pl.clip_cov_lb < pl.clip_cov_ub:
        c.fail(f"{a}.policy_loss.clip_cov_ub", f"a number > {a}.policy_loss.clip_cov_lb={pl.clip_cov_lb!r}")
    c.real(f"{a}.policy_loss.kl_cov_ratio", 0.0, 1.0, lo_open=True)
    c.real(f"{a}.policy_loss.ppo_kl_coef", 0.0)
    c.real_or_off(f"{a}.tis_imp_ratio_cap", off=-1)
    # rollout
    r = "actor_rollout_ref.rollout"
    c.choice(f"{r}.name", schema.ROLLOUT_NAME_CHOICES)
    if get(cfg, f"{r}.dtype") not in (None, *schema.DTYPE_CHOICES):
        c.fail(f"{r}.dtype", "null (the model's dtype) or one of " + ", ".join(map(repr, schema.DTYPE_CHOICES)))
    c.sampling(r)
    c.sampling(f"{r}.val_kwargs")
    c.int_at_least(f"{r}.prompt_length", 1)
    c.int_at_least(f"{r}.response_length", 1)
    c.int_at_least(f"{r}.max_new_tokens", 1)
    c.int_at_least(f"{r}.log_prob_micro_batch_size_per_gpu", 1, nullable=True)
    c.int_at_least(f"{r}.micro_batch_size", 1, nullable=True)
    c.int_at_least(f"{r}.max_num_seqs", 1, nullable=True)
    c.int_at_least(f"{r}.max_decode_segments", 1)
    c.int_at_least(f"{r}.tensor_model_parallel_size", 1)
    c.real(f"{r}.gpu_memory_utilization", 0.0, 1.0, lo_open=True)
    if not all(is_int(t) and t >= 0 for t in cfg.actor_rollout_ref.rollout.stop_token_ids):
        c.fail(f"{r}.stop_token_ids", "a list of non-negative token ids")
    if not (is_int(cfg.actor_rollout_ref.rollout.seed) and 0 <= cfg.actor_rollout_ref.rollout.seed < _MAX_SEED):
        c.fail(f"{r}.seed", f"an int in [0, {_MAX_SEED}) or null (= trainer.seed)")
    mt = f"{r}.multi_turn"
    c.int_at_least(f"{mt}.max_assistant_turns", 1, nullable=True)
    c.int_at_least(f"{mt}.max_user_turns", 0, nullable=True)
    c.int_at_least(f"{mt}.max_parallel_calls", 1)
    c.int_at_least(f"{mt}.max_tool_response_length", 1)
    c.choice(f"{mt}.tool_response_truncate_side", ("left", "right", "middle"))
    c.choice(f"{mt}.format", ("hermes",))
    mtc = cfg.actor_rollout_ref.rollout.multi_turn
    if mtc.enable and not mtc.tool_config_path and not mtc.env_class:
        c.fail(f"{mt}.tool_config_path", "a tool-config YAML path (or set multi_turn.env_class) when "
               "multi_turn.enable=true")
    if mtc.enable and cfg.actor_rollout_ref.rollout.name != "jax":
        c.fail(f"{mt}.enable", "false with rollout.name != 'jax' (multi-turn runs on the embedded jax sampler only)")
    c.int_at_least("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", 1, nullable=True)
    c.int_at_least(f"{r}.log_prob_max_token_len_per_gpu", 1)
    c.int_at_least("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", 1)
    # algorithm
    c.choice("algorithm.adv_estimator", registry.ADV_ESTIMATORS.names())  # built-in + external_lib's
    c.real("algorithm.gamma", 0.0, 1.0)
    c.real("algorithm.lam", 0.0, 1.0)
    c.real("algorithm.adv_std_epsilon", 0.0, lo_open=True)
    c.choice("algorithm.kl_penalty", schema.KL_PENALTY_CHOICES)
    c.choice("algorithm.kl_ctrl.type", schema.KL_CTRL_TYPE_CHOICES)
    c.real("algorithm.kl_ctrl.kl_coef", 0.0)
    c.real("algorithm.kl_ctrl.target_kl", 0.0, lo_open=True)
    c.int_at_least("algorithm.kl_ctrl.horizon", 1)
    c.choice("algorithm.filter_groups.metric", schema.FILTER_GROUPS_METRIC_CHOICES)
    c.int_at_least("algorithm.filter_groups.max_num_gen_batches", 0)
    c.preference_loss("algorithm.dpo")
    # critic
    k = "critic"
    c.text(f"{k}.model.path", nullable=True)
    c.choice(f"{k}.model.dtype", schema.DTYPE_CHOICES)
    c.choice(f"{k}.model.param_dtype", schema.DTYPE_CHOICES)
    c.choice(f"{k}.model.recompute_granularity", schema.RECOMPUTE_GRANULARITY_CHOICES)
    c.lora(f"{k}.model")
    c.optim(f"{k}.optim")
    c.int_at_least(f"{k}.ppo_mini_batch_size", 1)
    c.int_at_least(f"{k}.ppo_micro_batch_size_per_gpu", 1, nullable=True)
    c.int_at_least(f"{k}.forward_micro_batch_size_per_gpu", 1, nullable=True)
    c.int_at_least(f"{k}.ppo_epochs", 1)
    c.int_at_least(f"{k}.ppo_max_token_len_per_gpu", 1)
    c.int_at_least(f"{k}.forward_max_token_len_per_gpu", 1)
    c.real(f"{k}.cliprange_value", 0.0)
    c.real(f"{k}.grad_clip", -math.inf)
    c.choice(f"{k}.loss_agg_mode", schema.LOSS_AGG_MODE_CHOICES)
    # trainer
    c.int_at_least("trainer.total_epochs", 1)
    c.int_at_least("trainer.total_training_steps", 1, nullable=True)
    c.int_at_least("trainer.test_freq", 1, off=-1)
    c.int_at_least("trainer.save_freq", 1, off=-1)
    loggers = cfg.trainer.logger
    if not loggers or any(x not in schema.LOGGER_CHOICES for x in loggers) or len(set(loggers)) != len(loggers):
        c.fail("trainer.logger", "a non-empty list without repeats of " + ", ".join(map(repr, schema.LOGGER_CHOICES)))
    c.text("trainer.project_name")
    c.text("trainer.experiment_name")
    c.text("trainer.default_local_dir")
    c.int_at_least("trainer.n_gpus_per_node", 1)
    c.int_at_least("trainer.nnodes", 1)
    c.int_at_least("trainer.critic_warmup", 0)
    if not (0 <= cfg.trainer.seed < _MAX_SEED):
        c.fail("trainer.seed", f"an int in [0, {_MAX_SEED})")
    c.int_at_least("trainer.log_val_generations", 0)
    c.choice("trainer.resume_mode", schema.RESUME_MODE_CHOICES)
    c.text("trainer.resume_from_path", nullable=True)
    if cfg.trainer.resume_mode == "resume_path" and cfg.trainer.resume_from_path is None:
        c.fail("trainer.resume_from_path", "a path when trainer.resume_mode='resume_path' (a run's checkpoint "
               "directory or one of its global_step_<N> folders)")
    c.int_at_least("trainer.max_actor_ckpt_to_keep", 1, off=0, nullable=True)
    c.int_at_least("trainer.max_critic_ckpt_to_keep", 1, off=0, nullable=True)
    c.int_at_least("trainer.max_nonfinite_steps", 1)
    if cfg.trainer.launcher is not None:
        c.choice("trainer.launcher", schema.LAUNCHER_CHOICES)
    c.int_at_least("trainer.max_restarts", 0)
    c.choice("trainer.ray.resource", schema.RAY_RESOURCE_CHOICES)
    c.int_at_least("trainer.ray.placement_timeout_s", 1)
    topology = cfg.trainer.ray.tpu_topology
    if topology is not None and not (isinstance(topology, str) and re.fullmatch(r"\d+(x\d+){1,2}", topology.strip())):
        c.fail("trainer.ray.tpu_topology", "a TPU topology such as '2x2x2' or '4x4', or null (the TPU nodes' label)")
    c.text("trainer.ray.tpu_accelerator", nullable=True)


def validate_rewards(cfg: JaxRLConfig, c: Checks) -> None:
    """Ranges and choices of ``reward_model`` and ``custom_reward_function``."""
    _validate_reward_model(cfg, c)
    c.choice("reward_model.reward_manager", schema.REWARD_MANAGER_CHOICES)
    c.real("reward_model.timeout_s", 0.0, lo_open=True)
    c.int_at_least("reward_model.num_workers", 0, nullable=True)
    if cfg.reward_model.max_error_fraction is not None:
        c.real("reward_model.max_error_fraction", 0.0, 1.0)
    c.choice("reward_model.math_verifier", schema.MATH_VERIFIER_CHOICES)
    if cfg.reward_model.math_verifier == "math_verify" and importlib.util.find_spec("math_verify") is None:
        c.fail("reward_model.math_verifier", "'rule', or install math-verify: pip install 'math-verify[antlr4_13_2]'")
    c.real("reward_model.overlong_buffer.penalty_factor", 0.0)
    c.choice("reward_model.sandbox.isolation", schema.SANDBOX_ISOLATION_CHOICES)
    c.choice("reward_model.sandbox.score", schema.CODE_SCORE_CHOICES)
    c.real("reward_model.sandbox.wall_s", 0.0, lo_open=True)
    c.real("reward_model.sandbox.cpu_s", 0.0, lo_open=True)
    c.int_at_least("reward_model.sandbox.max_processes", 1)
    c.int_at_least("reward_model.sandbox.max_output_bytes", 1)
    c.int_at_least("reward_model.sandbox.tmp_mb", 1)
    c.text("reward_model.sandbox_fusion.url", nullable=True)
    url = cfg.reward_model.sandbox_fusion.url
    if url is not None and not str(url).startswith(("http://", "https://")):
        c.fail("reward_model.sandbox_fusion.url",
               "null or a Sandbox Fusion run_code endpoint: http(s)://HOST:PORT/run_code")
    c.int_at_least("reward_model.sandbox_fusion.max_concurrent", 1)
    c.int_at_least("reward_model.sandbox_fusion.memory_limit_mb", 16)
    ob = cfg.reward_model.overlong_buffer
    if ob.enable and not (is_int(ob.len) and 1 <= ob.len <= cfg.data.max_response_length):
        c.fail(
            "reward_model.overlong_buffer.len",
            f"an int in [1, data.max_response_length={cfg.data.max_response_length}] when "
            "reward_model.overlong_buffer.enable=True (the penalty ramps over the last `len` tokens)",
        )
    _validate_reward_kwargs(cfg)
    c.text("custom_reward_function.path", nullable=True)
    if not (isinstance(cfg.custom_reward_function.name, str) and cfg.custom_reward_function.name.isidentifier()):
        c.fail("custom_reward_function.name", "a Python function name, e.g. 'compute_score'")
    for key, value in cfg.custom_reward_function.reward_kwargs.items():
        if not (isinstance(key, str) and key.isidentifier()):
            raise ConfigError(
                f"custom_reward_function.reward_kwargs has the key {key!r}={value!r}; expected keyword-argument "
                "names (Python identifiers)"
            )


_DAPO_OVERLONG_TYPES = {"enable": bool, "len": int, "penalty_factor": float, "log": bool}


def _validate_reward_kwargs(cfg: JaxRLConfig) -> None:
    """``reward_model.reward_kwargs`` by manager, as verl's managers take them: ``dapo`` knows
    ``overlong_buffer_cfg.{enable,len,penalty_factor,log}`` and ``max_resp_len``; ``batch`` passes them to the
    custom function (checked against its signature at start); ``naive`` / ``prime`` take none."""
    rm = cfg.reward_model
    kw = rm.reward_kwargs
    prefix = "reward_model.reward_kwargs"
    if rm.reward_manager == "batch" and not cfg.custom_reward_function.path:
        raise ConfigError(
            "reward_model.reward_manager='batch' needs custom_reward_function.path: a function "
            "compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs) returning one "
            "score per response (or use reward_manager=naive for the built-in scorers)"
        )
    if not kw:
        return
    if rm.reward_manager == "batch":
        for key in kw:
            if not (isinstance(key, str) and key.isidentifier()):
                raise ConfigError(f"{prefix} has the key {key!r}; expected keyword-argument names for the function")
        return
    if rm.reward_manager != "dapo":
        raise ConfigError(
            f"{prefix}={dict(kw)!r} is not used by reward_model.reward_manager={rm.reward_manager!r} (verl's "
            f"{rm.reward_manager} manager takes no arguments); expected reward_manager='dapo' (overlong_buffer_cfg, "
            "max_resp_len) or 'batch' (keyword arguments for the function), or no reward_kwargs"
        )
    unknown = sorted(set(kw) - {"overlong_buffer_cfg", "max_resp_len"})
    if unknown:
        raise ConfigError(
            f"{prefix}.{unknown[0]}={kw[unknown[0]]!r} is not an argument of the dapo reward manager; "
            "valid: overlong_buffer_cfg.{enable,len,penalty_factor,log}, max_resp_len"
        )
    ob_cfg = kw.get("overlong_buffer_cfg") or {}
    if not isinstance(ob_cfg, dict):
        raise ConfigError(f"{prefix}.overlong_buffer_cfg={ob_cfg!r} is invalid; expected a mapping with keys "
                          "enable, len, penalty_factor, log")
    for key, value in ob_cfg.items():
        tp = _DAPO_OVERLONG_TYPES.get(key)
        if tp is None:
            raise ConfigError(
                f"{prefix}.overlong_buffer_cfg.{key}={value!r} is not a setting of the overlong buffer; "
                f"valid: {', '.join(_DAPO_OVERLONG_TYPES)}"
            )
        ok = (isinstance(value, bool) if tp is bool else is_int(value) if tp is int else real(value))
        if not ok:
            raise ConfigError(f"{prefix}.overlong_buffer_cfg.{key}={value!r} is invalid; expected {type_name(tp)}")
    ob = cfg.reward_model.overlong_buffer
    enable = ob_cfg.get("enable", ob.enable)
    length = ob_cfg.get("len", ob.len)
    factor = ob_cfg.get("penalty_factor", ob.penalty_factor)
    max_resp_len = kw.get("max_resp_len")
    if max_resp_len is not None and not (is_int(max_resp_len) and max_resp_len >= 1):
        raise ConfigError(f"{prefix}.max_resp_len={max_resp_len!r} is invalid; expected an int >= 1 (tokens)")
    if enable:
        horizon = max_resp_len if max_resp_len is not None else cfg.data.max_response_length
        if not 1 <= length <= horizon:
            raise ConfigError(
                f"{prefix}.overlong_buffer_cfg.len={length!r} is invalid; expected an int in [1, max_resp_len="
                f"{horizon}] (verl: max_resp_len must be larger than overlong_buffer.len)"
            )
        if factor < 0:
            raise ConfigError(f"{prefix}.overlong_buffer_cfg.penalty_factor={factor!r} is invalid; expected >= 0")


def _validate_prime(cfg: JaxRLConfig, c: Checks) -> None:
    """PRIME's keys (verl's ``recipe/prime``): the implicit PRM under ``reward_model.*`` and the accuracy filter
    under ``data.*``; checked under an estimator that reads the PRM's rewards (elsewhere the filter keys are refused
    by :mod:`jaxrl.config.cross` and the PRM keys unused, as the reward model's keys are while it is off)."""
    c.real("data.accuracy_lower_bound", 0.0, 1.0)
    c.real("data.accuracy_upper_bound", cfg.data.accuracy_lower_bound, 1.0)
    c.real("data.oversample_factor", 1.0)
    m = "reward_model.model"
    if cfg.reward_model.model.update == "reverse":
        c.fail(f"{m}.update", "'before', 'after' or 'none' ('reverse' serves verl's detached dpo / bon losses, which "
               "jaxrl does not implement)")
    c.choice(f"{m}.update", PRM_UPDATE_CHOICES)
    if cfg.reward_model.model.loss_type != "ce":
        c.fail(f"{m}.loss_type", "'ce' (the paper's cross-entropy loss; verl's detached 'dpo' / 'bon_acc' / 'bon_rm' "
               "are not implemented)")
    c.choice(f"{m}.ref_type", ("freeze",))
    c.real(f"{m}.beta_train", 0.0, lo_open=True)
    c.text(f"{m}.ref_path", nullable=True)
    c.optim(f"{m}.optim")
    c.real(f"{m}.optim.grad_clip", -math.inf)
    c.int_at_least("reward_model.mini_batch_size", 1)
    c.int_at_least("reward_model.micro_batch_size_per_gpu", 1, nullable=True)
    c.choice("reward_model.prime_granularity", PRIME_GRANULARITY_CHOICES)
    c.choice("reward_model.prime_norm", PRIME_NORM_CHOICES)


PRM_UPDATE_CHOICES: tuple[str, ...] = ("before", "after", "none")  # reward_model.model.update
PRIME_GRANULARITY_CHOICES: tuple[str, ...] = ("token", "whole")  # = jaxrl.algorithms.prime.GRANULARITIES
PRIME_NORM_CHOICES: tuple[str, ...] = ("batch_norm", "none")  # = jaxrl.algorithms.prime.PRIME_NORMS


def _validate_reward_model(cfg: JaxRLConfig, c: Checks) -> None:
    """``reward_model.*`` of the model reward model: checked only when ``reward_model.enable`` (under PRIME the
    section configures the implicit PRM instead: :func:`_validate_prime`)."""
    if registry.needs_prm(cfg.algorithm.adv_estimator):
        _validate_prime(cfg, c)
        return
    if not cfg.reward_model.enable:
        return
    if cfg.reward_model.model.path is None:
        c.fail("reward_model.model.path", "the reward model checkpoint when reward_model.enable=True: a Hugging Face "
               "Llama/Qwen2/Qwen3 *ForSequenceClassification directory")
    c.text("reward_model.model.path")
    c.text("reward_model.model.input_tokenizer", nullable=True)
    c.int_at_least("reward_model.micro_batch_size_per_gpu", 1, nullable=True)
    c.int_at_least("reward_model.max_length", 1, nullable=True)
    c.choice("reward_model.combine", schema.RM_COMBINE_CHOICES)
