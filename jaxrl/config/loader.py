"""Load, merge and validate a jaxrl config: schema defaults <- YAML file <- ``key=value`` overrides.

Overrides use verl's (Hydra's) command-line spelling: ``a.b.c=value`` where ``value`` is parsed as
YAML by OmegaConf (``1e-6``, ``True``, ``[console,jsonl]``, ``null``, ``${trainer.project_name}``).
Every problem raises :class:`ConfigError` whose message names the full dotted key, the bad value and
what would be valid. Nothing here imports jax, so ``python -m jaxrl.train`` rejects a bad config in
well under a second.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jaxrl.config import compat, schema
from jaxrl.config.schema import JaxRLConfig
from jaxrl.paths import expand_shared

_MAX_SEED = 2**32


class ConfigError(ValueError):
    """A config key, value or combination is invalid; the message says which and what is valid."""


@dataclass(frozen=True)
class LoadedConfig:
    """Result of :func:`load_config_with_notes`: the validated config and the compat notes
    (one per accepted verl key that has no JAX meaning, in first-seen order)."""

    config: JaxRLConfig
    notes: tuple[compat.CompatNote, ...]


# ------------------------------------------------------------------------------ key lookups
_LEAVES, _SECTIONS = schema.schema_keys()
# Free-form mapping fields (``reward_model.reward_kwargs``): ``field.a.b=value`` sets a key inside them,
# as Hydra's ``+reward_model.reward_kwargs.max_resp_len=...`` does in verl.
_MAPPING_LEAVES = tuple(k for k, tp in _LEAVES.items() if typing.get_origin(tp) is dict)


def _mapping_leaf(key: str) -> str | None:
    """The mapping field ``key`` points inside (``'reward_model.reward_kwargs.x.y'`` -> its field), or None."""
    return next((m for m in _MAPPING_LEAVES if key.startswith(m + ".")), None)


def _type_name(tp: Any) -> str:
    """Human name of a schema field type, e.g. ``Optional[int]`` -> ``'int or null'``."""
    if tp is Any:
        return "a str or a list of str"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_type_name(a) for a in inner) + " or null"
    if origin is list:
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if origin is dict:
        return "a mapping (key: value, ...)"
    return {int: "int", float: "float", bool: "bool (True/False)", str: "str"}.get(tp, getattr(tp, "__name__", str(tp)))


def _suggest(key: str) -> str | None:
    """Closest valid leaf key to an unknown ``key``.

    Order: the same last segment in another section (a key put in the wrong section), then the
    closest sibling in the same (valid) section, then the closest full dotted key whose last
    segment also resembles the given one.
    """
    parent, _, last = key.rpartition(".")
    same_name = [k for k in _LEAVES if k.rpartition(".")[2] == last]
    if same_name:
        return difflib.get_close_matches(key, same_name, n=1, cutoff=0.0)[0]
    if parent == "" or parent in _SECTIONS:
        siblings = [k.rpartition(".")[2] for k in _LEAVES if k.rpartition(".")[0] == parent]
        match = difflib.get_close_matches(last, siblings, n=1, cutoff=0.6)
        if match:
            return f"{parent}.{match[0]}" if parent else match[0]
    candidates = [
        k for k in _LEAVES if difflib.SequenceMatcher(None, last, k.rpartition(".")[2]).ratio() >= 0.6
    ]
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def _unknown_key_message(key: str, source: str) -> str:
    guess = _suggest(key)
    if guess is not None:
        return f"Unknown config key '{key}'; did you mean '{guess}'? (from {source})"
    parent = key.rpartition(".")[0]
    while parent and parent not in _SECTIONS:
        parent = parent.rpartition(".")[0]
    if parent:
        under = sorted(k[len(parent) + 1 :] for k in _LEAVES if k.startswith(parent + "."))
        where = f"valid keys under '{parent}': {', '.join(under)}"
    else:
        where = "valid top-level sections: " + ", ".join(s for s in _SECTIONS if "." not in s)
    return f"Unknown config key '{key}' (from {source}); {where}"


# ---------------------------------------------------------------------------- raw inputs
def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist (--config expects a YAML file)")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def _parse_override(item: str) -> tuple[str, Any]:
    """``'a.b=value'`` -> ``('a.b', parsed value)`` with OmegaConf's YAML value grammar."""
    if item.lstrip().startswith("~"):
        raise ConfigError(f"override '{item}': deleting keys ('~key') is not supported; every key has a default")
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value (e.g. data.train_batch_size=16)")
    key, raw = item.split("=", 1)
    key = key.strip()
    key = key.lstrip("+")  # Hydra's '+key=' / '++key=': every jaxrl key already exists
    if not key or not all(part.strip() for part in key.split(".")):
        raise ConfigError(f"override '{item}' has an empty key segment; expected e.g. trainer.total_epochs=3")
    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]), resolve=False)["v"]
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"override '{item}': cannot parse the value {raw!r}: {e}") from None
    return key, value


def _flatten(key: str, value: Any, source: str, out: list[tuple[str, Any, str]]) -> None:
    """Append ``(full dotted leaf key, value, source)`` for ``value`` placed at ``key``."""
    if key in _SECTIONS:
        if value is None:  # an empty YAML section ("data:" with everything commented out)
            return
        if not isinstance(value, dict):
            raise ConfigError(
                f"'{key}' is a config section; expected a mapping of its keys, got {value!r} (from {source})"
            )
        for k, v in value.items():
            _flatten(f"{key}.{k}", v, source, out)
    elif isinstance(value, dict) and value and key not in _LEAVES:
        for k, v in value.items():  # an unknown (or compat-only) mapping: check each leaf inside it
            _flatten(f"{key}.{k}", v, source, out)
    else:
        out.append((key, value, source))


def _raw_pairs(config_path: str | Path | None, overrides: Sequence[str]) -> list[tuple[str, Any, str]]:
    pairs: list[tuple[str, Any, str]] = []
    if config_path is not None:
        path = Path(config_path).expanduser()
        raw = _read_yaml(path)
        for k, v in raw.items():
            if str(k) == "defaults":
                raise ConfigError(
                    f"'defaults' (a Hydra defaults list) in {path} is not supported: jaxrl does not compose "
                    "config groups; write the keys you change in one file (the schema fills the rest)"
                )
            _flatten(str(k), v, f"config file {path}", pairs)
    for item in overrides:
        key, value = _parse_override(item)
        _flatten(key, value, f"override '{item}'", pairs)
    return pairs


def _classify(pairs: list[tuple[str, Any, str]]) -> tuple[list[tuple[str, Any, str]], list[compat.CompatNote]]:
    """Split raw pairs into schema assignments and compat notes; raise on unknown keys."""
    kept: list[tuple[str, Any, str]] = []
    notes: dict[str, compat.CompatNote] = {}
    for key, value, source in pairs:
        if key in _LEAVES or _mapping_leaf(key) is not None:
            note = compat.lookup_note(key, schema_field=True)
            if note is not None:
                notes[key] = compat.CompatNote(key, value, note)
            kept.append((key, value, source))
        elif key in compat.RENAMES:
            notes[key] = compat.CompatNote(key, value, compat.rename_note(key))
            kept.append((compat.RENAMES[key], value, source))
        else:
            note = compat.lookup_note(key, schema_field=False)
            if note is None:
                raise ConfigError(_unknown_key_message(key, source))
            bad = compat.unsupported_value(key, value)
            if bad is not None:
                raise ConfigError(f"{bad} (from {source})")
            notes[key] = compat.CompatNote(key, value, note)
    return kept, list(notes.values())


# ------------------------------------------------------------------------------- merging
def _prepare(key: str, value: Any) -> Any:
    """Expand ``${JAXRL_SHARED}`` in strings; wrap a scalar given for a list field into a list."""
    if isinstance(value, str):
        value = expand_shared(value)
    elif isinstance(value, list):
        value = [expand_shared(v) if isinstance(v, str) else v for v in value]
    if key not in _LEAVES:  # a key inside a mapping field: any value
        return value
    if typing.get_origin(_LEAVES[key]) is list and value is not None and not isinstance(value, list):
        value = [value]
    return value


def _assign(cfg: Any, kept: list[tuple[str, Any, str]]) -> None:
    for key, value, source in kept:
        value = _prepare(key, value)
        try:
            OmegaConf.update(cfg, key, value, merge=False)
        except OmegaConfBaseException:
            expected = _type_name(_LEAVES.get(key) or _LEAVES[_mapping_leaf(key)])
            if value is None:
                raise ConfigError(f"{key}=null is invalid; expected {expected} (from {source})") from None
            raise ConfigError(
                f"{key}={value!r} has the wrong type ({type(value).__name__}); expected {expected} (from {source})"
            ) from None


_MISSING_INTERP = re.compile(r"Interpolation key '([^']+)' not found")


def _resolve(cfg: Any) -> JaxRLConfig:
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        try:
            raw = OmegaConf.to_container(cfg, resolve=False)
            for part in key.split("."):
                raw = raw[part]
        except (KeyError, TypeError):
            raw = None
        msg = f"{key}={raw!r}: cannot resolve the interpolation: {getattr(e, 'msg', str(e)).splitlines()[0]}"
        missing = _MISSING_INTERP.search(str(e))
        if missing:
            guess = _suggest(missing.group(1))
            if guess is not None:
                msg += f"; did you mean '{guess}'?"
        raise ConfigError(msg) from None


# ------------------------------------------------------------------------------ validation
def _get(cfg: JaxRLConfig, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _Checks:
    """Small predicates; each raises ConfigError naming the key, the value and what is valid."""

    def __init__(self, cfg: JaxRLConfig):
        self.cfg = cfg

    def fail(self, key: str, expected: str) -> typing.NoReturn:
        raise ConfigError(f"{key}={_get(self.cfg, key)!r} is invalid; expected {expected}")

    def choice(self, key: str, choices: Iterable[str]) -> None:
        choices = tuple(choices)
        if _get(self.cfg, key) not in choices:
            self.fail(key, "one of " + ", ".join(repr(c) for c in choices))

    def int_at_least(self, key: str, lo: int, *, off: Optional[int] = None, nullable: bool = False) -> None:
        v = _get(self.cfg, key)
        if nullable and v is None:
            return
        if off is not None and v == off and _is_int(v):
            return
        if not (_is_int(v) and v >= lo):
            extra = (f" or {off} (off)" if off is not None else "") + (" or null" if nullable else "")
            self.fail(key, f"an int >= {lo}{extra}")

    def real(self, key: str, lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False) -> None:
        v = _get(self.cfg, key)
        ok = _real(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        if not ok:
            lb, rb = ("(" if lo_open else "["), (")" if hi_open else "]")
            self.fail(key, f"a finite number in {lb}{lo}, {hi}{rb}".replace("inf]", "inf)"))

    def text(self, key: str, *, nullable: bool = False) -> None:
        v = _get(self.cfg, key)
        if nullable and v is None:
            return
        if not (isinstance(v, str) and v.strip()):
            self.fail(key, "a non-empty string" + (" or null" if nullable else ""))

    def files(self, key: str, *, nullable: bool) -> None:
        v = _get(self.cfg, key)
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
        betas = _get(self.cfg, f"{prefix}.betas")
        if not (len(betas) == 2 and all(_real(b) and 0.0 <= b < 1.0 for b in betas)):
            self.fail(f"{prefix}.betas", "two numbers in [0, 1), e.g. [0.9, 0.999]")
        self.real(f"{prefix}.eps", 0.0, lo_open=True)
        self.real(f"{prefix}.min_lr_ratio", 0.0, 1.0)
        self.choice(f"{prefix}.lr_scheduler_type", schema.LR_SCHEDULER_CHOICES)

    def real_or_off(self, key: str, *, off: float) -> None:
        """A finite number > 0, or exactly ``off`` (the documented "disabled" value)."""
        v = _get(self.cfg, key)
        if not (_real(v) and (v > 0 or v == off)):
            self.fail(key, f"a finite number > 0, or {off} (off)")

    def sampling(self, prefix: str) -> None:
        self.int_at_least(f"{prefix}.n", 1)
        self.real(f"{prefix}.temperature", 0.0)
        self.real(f"{prefix}.top_p", 0.0, 1.0, lo_open=True)
        self.int_at_least(f"{prefix}.top_k", -1)


def _normalise(cfg: JaxRLConfig) -> None:
    """Fill the documented derived defaults and normalise file lists (see :func:`load_config`)."""
    d = cfg.data
    for name in ("train_files", "val_files"):
        v = getattr(d, name)
        if isinstance(v, str):
            setattr(d, name, [v])
        elif isinstance(v, (list, tuple)):
            setattr(d, name, list(v))
    if d.seed is None:
        d.seed = cfg.trainer.seed
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
    for name in ("enable_gradient_checkpointing", "dtype", "param_dtype"):
        if getattr(critic.model, name) is None:
            setattr(critic.model, name, getattr(model, name))
    if critic.ppo_mini_batch_size is None:
        critic.ppo_mini_batch_size = actor.ppo_mini_batch_size
    if critic.ppo_epochs is None:
        critic.ppo_epochs = actor.ppo_epochs
    if critic.forward_micro_batch_size_per_gpu is None:
        critic.forward_micro_batch_size_per_gpu = critic.ppo_micro_batch_size_per_gpu


def _validate(cfg: JaxRLConfig) -> None:
    """Ranges, choices, then verl's batch arithmetic and cross-field rules."""
    c = _Checks(cfg)
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
    # optimizer
    c.optim("actor_rollout_ref.actor.optim")
    # actor
    a = "actor_rollout_ref.actor"
    c.real(f"{a}.grad_clip", -math.inf)
    c.int_at_least(f"{a}.ppo_mini_batch_size", 1)
    c.int_at_least(f"{a}.ppo_micro_batch_size_per_gpu", 1, nullable=True)
    c.int_at_least(f"{a}.ppo_epochs", 1)
    c.real(f"{a}.kl_loss_coef", 0.0)
    c.choice(f"{a}.kl_loss_type", schema.KL_LOSS_TYPE_CHOICES)
    c.real(f"{a}.entropy_coeff", 0.0)
    c.real(f"{a}.clip_ratio", 0.0, lo_open=True)
    c.real(f"{a}.clip_ratio_low", 0.0, 1.0, lo_open=True, hi_open=True)
    c.real(f"{a}.clip_ratio_high", 0.0, lo_open=True)
    c.real(f"{a}.clip_ratio_c", 1.0, lo_open=True)
    c.choice(f"{a}.loss_agg_mode", schema.LOSS_AGG_MODE_CHOICES)
    c.choice(f"{a}.policy_loss.loss_mode", schema.POLICY_LOSS_MODE_CHOICES)
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
    c.sampling(r)
    c.sampling(f"{r}.val_kwargs")
    c.int_at_least(f"{r}.prompt_length", 1)
    c.int_at_least(f"{r}.response_length", 1)
    c.int_at_least(f"{r}.max_new_tokens", 1)
    c.int_at_least(f"{r}.log_prob_micro_batch_size_per_gpu", 1, nullable=True)
    c.int_at_least(f"{r}.micro_batch_size", 1, nullable=True)
    c.int_at_least(f"{r}.tensor_model_parallel_size", 1)
    c.real(f"{r}.gpu_memory_utilization", 0.0, 1.0, lo_open=True)
    if not all(_is_int(t) and t >= 0 for t in cfg.actor_rollout_ref.rollout.stop_token_ids):
        c.fail(f"{r}.stop_token_ids", "a list of non-negative token ids")
    if not (_is_int(cfg.actor_rollout_ref.rollout.seed) and 0 <= cfg.actor_rollout_ref.rollout.seed < _MAX_SEED):
        c.fail(f"{r}.seed", f"an int in [0, {_MAX_SEED}) or null (= trainer.seed)")
    c.int_at_least("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", 1, nullable=True)
    # algorithm
    c.choice("algorithm.adv_estimator", schema.ADV_ESTIMATOR_CHOICES)
    c.real("algorithm.gamma", 0.0, 1.0)
    c.real("algorithm.lam", 0.0, 1.0)
    c.choice("algorithm.kl_penalty", schema.KL_PENALTY_CHOICES)
    c.choice("algorithm.kl_ctrl.type", schema.KL_CTRL_TYPE_CHOICES)
    c.real("algorithm.kl_ctrl.kl_coef", 0.0)
    c.real("algorithm.kl_ctrl.target_kl", 0.0, lo_open=True)
    c.int_at_least("algorithm.kl_ctrl.horizon", 1)
    c.choice("algorithm.filter_groups.metric", schema.FILTER_GROUPS_METRIC_CHOICES)
    c.int_at_least("algorithm.filter_groups.max_num_gen_batches", 0)
    # critic
    k = "critic"
    c.text(f"{k}.model.path", nullable=True)
    c.choice(f"{k}.model.dtype", schema.DTYPE_CHOICES)
    c.choice(f"{k}.model.param_dtype", schema.DTYPE_CHOICES)
    c.optim(f"{k}.optim")
    c.int_at_least(f"{k}.ppo_mini_batch_size", 1)
    c.int_at_least(f"{k}.ppo_micro_batch_size_per_gpu", 1, nullable=True)
    c.int_at_least(f"{k}.forward_micro_batch_size_per_gpu", 1, nullable=True)
    c.int_at_least(f"{k}.ppo_epochs", 1)
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
    _validate_mesh(cfg, c)
    # rewards
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
    ob = cfg.reward_model.overlong_buffer
    if ob.enable and not (_is_int(ob.len) and 1 <= ob.len <= cfg.data.max_response_length):
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
    _validate_cross(cfg)


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
        ok = (isinstance(value, bool) if tp is bool else _is_int(value) if tp is int else _real(value))
        if not ok:
            raise ConfigError(f"{prefix}.overlong_buffer_cfg.{key}={value!r} is invalid; expected {_type_name(tp)}")
    ob = cfg.reward_model.overlong_buffer
    enable = ob_cfg.get("enable", ob.enable)
    length = ob_cfg.get("len", ob.len)
    factor = ob_cfg.get("penalty_factor", ob.penalty_factor)
    max_resp_len = kw.get("max_resp_len")
    if max_resp_len is not None and not (_is_int(max_resp_len) and max_resp_len >= 1):
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


def _validate_reward_model(cfg: JaxRLConfig, c: _Checks) -> None:
    """``reward_model.*`` of the model reward model: checked only when ``reward_model.enable``."""
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


def _validate_cross(cfg: JaxRLConfig) -> None:
    """verl's batch arithmetic (``ray_trainer._validate_config``, ``fsdp_workers``, ``ActorConfig.validate``)
    and other rules that tie two sections together."""
    d, t = cfg.data, cfg.trainer
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    world = t.n_gpus_per_node * t.nnodes
    world_s = f"trainer.n_gpus_per_node={t.n_gpus_per_node} x trainer.nnodes={t.nnodes}"
    n = rollout.n
    if not actor.recompute_old_log_prob:
        off_policy = []
        if actor.ppo_epochs != 1:
            off_policy.append(f"actor_rollout_ref.actor.ppo_epochs={actor.ppo_epochs} (needs 1)")
        if actor.ppo_mini_batch_size != d.train_batch_size:
            off_policy.append(f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} (needs "
                              f"data.train_batch_size={d.train_batch_size}: one mini-batch per step)")
        if cfg.algorithm.use_kl_in_reward:
            off_policy.append("algorithm.use_kl_in_reward=True (the reward's KL needs the old log-probs)")
        if off_policy:
            raise ConfigError(
                "actor_rollout_ref.actor.recompute_old_log_prob=False is only exact when every update is on-policy; "
                f"got {'; '.join(off_policy)}. Set recompute_old_log_prob=True or change those keys"
            )
    if (d.train_batch_size * n) % world:
        raise ConfigError(
            f"data.train_batch_size={d.train_batch_size} x actor_rollout_ref.rollout.n={n} = "
            f"{d.train_batch_size * n} responses must split evenly over {world_s} = {world} devices"
        )
    _check_mini_batches(cfg, "actor_rollout_ref.actor", actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu)
    if cfg.algorithm.adv_estimator in schema.CRITIC_ADV_ESTIMATORS:
        critic = cfg.critic
        _check_mini_batches(cfg, "critic", critic.ppo_mini_batch_size, critic.ppo_micro_batch_size_per_gpu)
    if d.gen_batch_size != d.train_batch_size:
        if not cfg.algorithm.filter_groups.enable:
            raise ConfigError(
                f"data.gen_batch_size={d.gen_batch_size} differs from data.train_batch_size={d.train_batch_size} "
                "but algorithm.filter_groups.enable=False; generation rounds of a different size only make "
                "sense with DAPO group filtering: set algorithm.filter_groups.enable=True or data.gen_batch_size=null"
            )
        if (d.gen_batch_size * n) % world:
            raise ConfigError(
                f"data.gen_batch_size={d.gen_batch_size} x actor_rollout_ref.rollout.n={n} = "
                f"{d.gen_batch_size * n} responses must split evenly over {world_s} = {world} devices"
            )
    if rollout.max_new_tokens > d.max_response_length:
        raise ConfigError(
            f"actor_rollout_ref.rollout.max_new_tokens={rollout.max_new_tokens} is invalid; expected "
            f"<= data.max_response_length={d.max_response_length} (the response buffer)"
        )
    if rollout.name in ("vllm", "jetstream") and world % rollout.tensor_model_parallel_size:
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} must "
            f"divide the {world} devices ({world_s}) for rollout.name={rollout.name!r}"
        )
    if d.val_files is None and (t.val_before_train or t.test_freq > 0):
        raise ConfigError(
            f"data.val_files=None but validation is on (trainer.val_before_train={t.val_before_train}, "
            f"trainer.test_freq={t.test_freq}); set data.val_files, or trainer.val_before_train=False "
            "and trainer.test_freq=-1"
        )
    vk = rollout.val_kwargs
    if vk.do_sample and vk.temperature <= 0:
        raise ConfigError(
            "actor_rollout_ref.rollout.val_kwargs.do_sample=True needs "
            f"actor_rollout_ref.rollout.val_kwargs.temperature > 0; got {vk.temperature!r}"
        )


# ------------------------------------------------------------------------------ device mesh
def mesh_enabled(cfg: JaxRLConfig) -> bool:
    """True when the run trains on a device mesh: any ``trainer.mesh`` axis is set, or ``trainer.placement`` is
    ``"split"``. False = every role on one device (the single-device run)."""
    m = cfg.trainer.mesh
    return cfg.trainer.placement == "split" or any(v is not None for v in (m.data, m.fsdp, m.tensor))


def mesh_sizes(cfg: JaxRLConfig) -> dict[str, int]:
    """``trainer.mesh`` with unset axes filled: ``{"data": d, "fsdp": f, "tensor": t}``.

    Unset (null) axes are 1, except ``fsdp``, which is -1 (fill the remaining devices) unless another axis is -1.
    """
    m = cfg.trainer.mesh
    data = 1 if m.data is None else m.data
    tensor = 1 if m.tensor is None else m.tensor
    fsdp = m.fsdp if m.fsdp is not None else (1 if -1 in (data, tensor) else -1)
    return {"data": data, "fsdp": fsdp, "tensor": tensor}


_DEFAULT_BATCH_AXES: tuple[str, ...] = ("data", "fsdp")  # sharding.rules.DEFAULT_RULES["batch"]


def batch_mesh_axes(cfg: JaxRLConfig) -> tuple[str, ...]:
    """The mesh axes that split batch rows: ``trainer.sharding_rules["batch"]`` if given, else ``(data, fsdp)``."""
    rules = cfg.trainer.sharding_rules or {}
    if "batch" not in rules:
        return _DEFAULT_BATCH_AXES
    v = rules["batch"]
    return () if v is None else ((v,) if isinstance(v, str) else tuple(v))


def check_mesh_batch_sizes(cfg: JaxRLConfig, sizes: dict[str, int]) -> None:
    """Every micro-batch of a trained role must split evenly over the mesh's batch axes.

    With a mesh, a ``*_micro_batch_size_per_gpu`` value counts the rows of one micro-batch on the whole mesh;
    its rows are split over the batch axes (``data x fsdp`` by default), so it must be a multiple of their product.
    Unset micro-batch sizes fall back as the roles do (the actor's and the critic's to their mini-batch rows).

    Args:
      cfg: the loaded config.
      sizes: resolved mesh sizes ``{"data", "fsdp", "tensor"}`` (no -1).

    Raises:
      ConfigError: names the key, its value, the mesh sizes and the valid multiple.
    """
    axes = batch_mesh_axes(cfg)
    shards = math.prod(sizes[a] for a in axes)
    if shards <= 1:
        return
    arr, n = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout.n
    actor_rows = arr.actor.ppo_micro_batch_size_per_gpu or arr.actor.ppo_mini_batch_size * n
    checks = [
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor_rows),
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", arr.rollout.log_prob_micro_batch_size_per_gpu),
        ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", arr.ref.log_prob_micro_batch_size_per_gpu),
    ]
    if cfg.reward_model.enable:
        checks.append(("reward_model.micro_batch_size_per_gpu", cfg.reward_model.micro_batch_size_per_gpu))
    if cfg.algorithm.adv_estimator in schema.CRITIC_ADV_ESTIMATORS:
        k = cfg.critic
        critic_rows = k.ppo_micro_batch_size_per_gpu or (k.ppo_mini_batch_size or arr.actor.ppo_mini_batch_size) * n
        checks += [
            ("critic.ppo_micro_batch_size_per_gpu", critic_rows),
            ("critic.forward_micro_batch_size_per_gpu", k.forward_micro_batch_size_per_gpu or critic_rows),
        ]
    mesh_s = " x ".join(f"{a}={sizes[a]}" for a in axes)
    for key, rows in checks:
        if rows is not None and rows % shards:
            raise ConfigError(
                f"{key}={rows} rows per micro-batch do not split over the {shards} batch shards of the train mesh "
                f"(trainer.mesh {mesh_s}; each device takes micro-batch / {shards} rows); "
                f"valid: a multiple of {shards}, e.g. {max(shards, rows - rows % shards)}"
            )


def _validate_mesh(cfg: JaxRLConfig, c: _Checks) -> None:
    """``trainer.mesh``, ``trainer.placement``, ``trainer.rollout_devices``, ``trainer.sharding_rules``: the checks
    that need no devices (device counts are checked when the run is built, by ``jaxrl.workers.placement``)."""
    t = cfg.trainer
    c.choice("trainer.placement", schema.PLACEMENT_CHOICES)
    for axis in schema.MESH_AXIS_CHOICES:
        c.int_at_least(f"trainer.mesh.{axis}", 1, off=-1, nullable=True)
    sizes = mesh_sizes(cfg)
    if sum(v == -1 for v in sizes.values()) > 1:
        raise ConfigError(
            f"trainer.mesh {sizes} (unset axes filled) has more than one axis set to -1; at most one axis may fill "
            "the remaining devices"
        )
    if t.placement == "split" and cfg.actor_rollout_ref.rollout.name not in ("jax", "vllm"):
        c.fail("trainer.placement", f"'colocated' with actor_rollout_ref.rollout.name="
               f"{cfg.actor_rollout_ref.rollout.name!r} (split placement runs the embedded jax sampler on its own "
               "devices, or vLLM as a separate worker process)")
    if t.placement == "split":
        v = t.rollout_devices
        if not (_is_int(v) and v >= 1):
            c.fail("trainer.rollout_devices", "an int >= 1 with trainer.placement='split' (how many devices, taken "
                   "from the end of jax.devices(), the rollout engine gets)")
    elif t.rollout_devices is not None:
        c.fail("trainer.rollout_devices", "null unless trainer.placement='split' (colocated rollout uses the train "
               "devices)")
    _validate_sharding_rules(t.sharding_rules)
    if mesh_enabled(cfg) and all(sizes[a] != -1 for a in batch_mesh_axes(cfg)):
        check_mesh_batch_sizes(cfg, sizes)


def _validate_sharding_rules(rules: Any) -> None:
    key = "trainer.sharding_rules"
    if rules is None:
        return
    if not isinstance(rules, dict):
        raise ConfigError(f"{key}={rules!r} is invalid; expected a mapping {{logical axis: mesh axis | [mesh axes] "
                          "| null}}, e.g. {embed: null}")
    axes = ", ".join(repr(a) for a in schema.MESH_AXIS_CHOICES)
    for name, value in rules.items():
        if name not in schema.LOGICAL_AXIS_CHOICES:
            guess = difflib.get_close_matches(str(name), schema.LOGICAL_AXIS_CHOICES, n=1)
            hint = f"did you mean {guess[0]!r}? " if guess else ""
            raise ConfigError(f"{key} has an unknown logical axis {name!r}; {hint}valid: "
                              + ", ".join(repr(a) for a in schema.LOGICAL_AXIS_CHOICES))
        items = [] if value is None else ([value] if isinstance(value, str) else value)
        if not isinstance(items, list) or any(a not in schema.MESH_AXIS_CHOICES for a in items) \
                or len(set(items)) != len(items):
            raise ConfigError(f"{key}.{name}={value!r} is invalid; expected null (replicated), a mesh axis "
                              f"({axes}) or a list of distinct mesh axes")


def _check_mini_batches(cfg: JaxRLConfig, section: str, mini: int, micro: Optional[int]) -> None:
    """verl's mini/micro-batch arithmetic for one trained role (``actor_rollout_ref.actor`` or ``critic``)."""
    d, t = cfg.data, cfg.trainer
    n = cfg.actor_rollout_ref.rollout.n
    world = t.n_gpus_per_node * t.nnodes
    world_s = f"trainer.n_gpus_per_node={t.n_gpus_per_node} x trainer.nnodes={t.nnodes}"
    if d.train_batch_size < mini:
        raise ConfigError(
            f"{section}.ppo_mini_batch_size={mini} is invalid; expected "
            f"<= data.train_batch_size={d.train_batch_size} (both count prompts)"
        )
    per_device = mini * n // world
    if per_device < 1:
        raise ConfigError(
            f"{section}.ppo_mini_batch_size={mini} x "
            f"actor_rollout_ref.rollout.n={n} = {mini * n} responses per mini-batch is fewer "
            f"than the {world} devices ({world_s}); expected at least one response per device"
        )
    if micro is not None and per_device % micro:
        raise ConfigError(
            f"{section}.ppo_micro_batch_size_per_gpu={micro} must divide the per-device mini-batch "
            f"{section}.ppo_mini_batch_size={mini} x "
            f"actor_rollout_ref.rollout.n={n} / {world} devices = {per_device} responses; "
            f"valid: a divisor of {per_device}"
        )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _uneven_mini_batch_notes(cfg: JaxRLConfig) -> list[compat.CompatNote]:
    """One note per trained role whose ``ppo_mini_batch_size`` does not divide ``data.train_batch_size``.

    verl's FSDP actor/critic accept it (``DataProto.split`` leaves a smaller last mini-batch; verl's own
    Qwen3-1.7B GSM8K recipe uses 1024 / 80), its Megatron workers refuse it (``DataProto.make_iterator`` asserts
    divisibility). jaxrl runs it like verl's FSDP workers but says so: the last update of every step is made from
    fewer prompts. The note lists the mini-batch sizes that split the batch evenly and pass the micro-batch rules.
    """
    notes = []
    roles = [("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor)]
    if cfg.algorithm.adv_estimator in schema.CRITIC_ADV_ESTIMATORS:
        roles.append(("critic", cfg.critic))
    tbs = cfg.data.train_batch_size
    for section, role in roles:
        mini = role.ppo_mini_batch_size
        if tbs % mini == 0:
            continue
        valid = []
        for k in _divisors(tbs):
            try:
                _check_mini_batches(cfg, section, k, role.ppo_micro_batch_size_per_gpu)
            except ConfigError:
                continue
            valid.append(k)
        fix = (f"for equal updates use one of {valid}" if valid else
               f"no divisor of {tbs} also fits {section}.ppo_micro_batch_size_per_gpu="
               f"{role.ppo_micro_batch_size_per_gpu}; change it too")
        notes.append(compat.CompatNote(
            f"{section}.ppo_mini_batch_size", mini,
            f"does not divide data.train_batch_size={tbs}: each step makes {tbs // mini} update(s) of {mini} prompts "
            f"and a last one of {tbs % mini} (as verl's FSDP workers do; its Megatron workers refuse this); {fix}",
        ))
    return notes


def check_context_length(cfg: JaxRLConfig, max_position_embeddings: Optional[int], *, model: str) -> None:
    """Prompt + generated tokens must fit the model's context.

    A sequence is at most ``data.max_prompt_length + actor_rollout_ref.rollout.max_new_tokens`` tokens
    (``max_new_tokens`` is filled from ``data.max_response_length``); a model is trained for
    ``max_position_embeddings`` positions (vLLM refuses a longer ``max_model_len`` for the same reason).

    Args:
      cfg: the validated config.
      max_position_embeddings: the model's context length (from its ``config.json`` / GGUF / llama2.c header);
        None skips the check.
      model: how to name the model in the message (its key, path and config file).

    Raises:
      ConfigError: the sum exceeds ``max_position_embeddings`` (names both keys, their values and the limit).
    """
    if max_position_embeddings is None:
        return
    d, rollout = cfg.data, cfg.actor_rollout_ref.rollout
    new = rollout.max_new_tokens
    new_key = ("data.max_response_length" if new == d.max_response_length
               else "actor_rollout_ref.rollout.max_new_tokens")
    total = d.max_prompt_length + new
    if total > max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_length={d.max_prompt_length} + {new_key}={new} = {total} tokens exceed the model's "
            f"context of {max_position_embeddings} tokens (max_position_embeddings of {model}); lower them so the "
            f"sum is at most {max_position_embeddings}"
        )


# ------------------------------------------------------------------------------- public API
def load_config_with_notes(config_path: str | Path | None, overrides: Sequence[str] = ()) -> LoadedConfig:
    """Load and validate a config, also returning the compat notes.

    Args:
      config_path: a YAML file (verl-style sections), or None for schema defaults only.
      overrides: ``"a.b.c=value"`` strings applied after the file, in order (later wins).

    Returns:
      :class:`LoadedConfig` with the validated :class:`JaxRLConfig` and one
      :class:`~jaxrl.config.compat.CompatNote` per accepted verl key with no JAX meaning, plus one per trained
      role whose ``ppo_mini_batch_size`` does not divide ``data.train_batch_size`` (accepted, as verl's FSDP
      workers do; the note gives the sizes that divide it).

    Raises:
      ConfigError: missing/invalid YAML file, malformed override, unknown key (with a "did you
        mean" suggestion), wrong type, unresolvable interpolation, value out of range or not one of
        the choices, verl batch arithmetic violated, or an unsupported feature requested.
    """
    pairs = _raw_pairs(config_path, list(overrides))
    kept, notes = _classify(pairs)
    cfg = OmegaConf.structured(JaxRLConfig)
    _assign(cfg, kept)
    obj = _resolve(cfg)
    _normalise(obj)
    _validate(obj)
    notes.extend(_uneven_mini_batch_notes(obj))
    return LoadedConfig(config=obj, notes=tuple(notes))


def load_config(config_path: str | Path | None, overrides: Sequence[str] = ()) -> JaxRLConfig:
    """Schema defaults <- YAML file <- ``key=value`` overrides, validated, as a :class:`JaxRLConfig`.

    Interpolations (``${trainer.project_name}``, ``${oc.env:HOME}``) are resolved, and
    ``${JAXRL_SHARED}`` in a string expands to :func:`jaxrl.paths.shared_dir`. Derived defaults
    filled in the returned object: ``data.train_files``/``val_files`` become ``list[str]``;
    ``data.seed`` and ``actor_rollout_ref.rollout.seed`` null -> ``trainer.seed``;
    ``actor.clip_ratio_low``/``clip_ratio_high`` null -> ``actor.clip_ratio``;
    ``rollout.max_new_tokens`` null -> ``data.max_response_length``; ``data.gen_batch_size`` null ->
    ``data.train_batch_size``; ``critic.model.{enable_gradient_checkpointing,dtype,param_dtype}`` null ->
    ``actor_rollout_ref.model``'s; ``critic.ppo_mini_batch_size``/``ppo_epochs`` null -> the actor's;
    ``critic.forward_micro_batch_size_per_gpu`` null -> ``critic.ppo_micro_batch_size_per_gpu``.

    Raises:
      ConfigError: see :func:`load_config_with_notes`.
    """
    return load_config_with_notes(config_path, overrides).config


def config_to_dict(cfg: JaxRLConfig) -> dict:
    """The config as plain nested dicts/lists (for logging, e.g. into a run's ``config.yaml``)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def config_to_yaml(cfg: JaxRLConfig) -> str:
    """The resolved config as YAML text; loading it back gives an equal config."""
    return OmegaConf.to_yaml(OmegaConf.create(config_to_dict(cfg)))
