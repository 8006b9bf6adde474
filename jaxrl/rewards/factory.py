"""Build the run's :class:`~jaxrl.rewards.manager.RewardManager` from a validated config (verl's
``load_reward_manager`` + ``get_custom_reward_fn``). No jax import."""

from __future__ import annotations

import functools
from collections.abc import Callable

from jaxrl.rewards.code import CodeRewardSettings
from jaxrl.rewards.custom import load_custom_reward_fn
from jaxrl.rewards.manager import OverlongBuffer, RewardManager, default_num_workers

CODE_BUDGET_FRACTION = 0.8  # a response's test cases share this fraction of reward_model.timeout_s

OVERLONG_KEYS = ("enable", "len", "penalty_factor", "log")


def overlong_settings(cfg) -> OverlongBuffer | None:
    """DAPO's overlong-buffer settings of a config, or None when the penalty is off.

    ``reward_model.reward_kwargs.overlong_buffer_cfg.<key>`` (verl's ``DAPORewardManager`` spelling, read with
    ``reward_manager=dapo``) wins key by key over ``reward_model.overlong_buffer.<key>`` (verl's DAPO recipe
    spelling, read with every manager). The horizon is ``reward_model.reward_kwargs.max_resp_len`` when given,
    else the batch's response width (``data.max_response_length`` unless ``rollout.max_new_tokens`` says
    otherwise).
    """
    rm = cfg.reward_model
    kwargs = dict(rm.reward_kwargs or {})
    merged = {k: getattr(rm.overlong_buffer, k) for k in OVERLONG_KEYS}
    if rm.reward_manager == "dapo":
        merged.update({k: v for k, v in dict(kwargs.get("overlong_buffer_cfg") or {}).items() if k in OVERLONG_KEYS})
    if not merged["enable"]:
        return None
    max_resp_len = kwargs.get("max_resp_len") if rm.reward_manager == "dapo" else None
    return OverlongBuffer(
        len=int(merged["len"]), penalty_factor=float(merged["penalty_factor"]), log=bool(merged["log"]),
        max_resp_len=None if max_resp_len is None else int(max_resp_len),
    )


def code_settings(cfg) -> CodeRewardSettings:
    """How the built-in code scorers run programs: a Sandbox Fusion server when ``reward_model.sandbox_fusion.url``
    is set, else this machine's sandbox (``reward_model.sandbox.isolation``); each test case limited by
    ``reward_model.sandbox.*`` and ``sandbox_fusion.memory_limit_mb``; a response's cases share
    :data:`CODE_BUDGET_FRACTION` of ``reward_model.timeout_s``.

    Raises:
        ValueError: a limit out of range (the config loader refuses it first).
    """
    from jaxrl.sandbox import Limits, make_sandbox

    rm = cfg.reward_model
    sb = rm.sandbox
    limits = Limits(wall_s=float(sb.wall_s), cpu_s=float(sb.cpu_s), memory_mb=int(rm.sandbox_fusion.memory_limit_mb),
                    max_processes=int(sb.max_processes), max_output_bytes=int(sb.max_output_bytes),
                    tmp_mb=int(sb.tmp_mb))
    return CodeRewardSettings(
        sandbox=make_sandbox(isolation=sb.isolation, fusion_url=rm.sandbox_fusion.url), limits=limits,
        score=sb.score, budget_s=CODE_BUDGET_FRACTION * float(rm.timeout_s),
    )


def scoring_workers(cfg) -> int | None:
    """``reward_model.num_workers``, capped by ``reward_model.sandbox_fusion.max_concurrent`` while a Sandbox Fusion
    server is set (each scoring process has at most one request in flight)."""
    rm = cfg.reward_model
    n = rm.num_workers
    if rm.sandbox_fusion.url and n != 0:
        n = min(default_num_workers() if n is None else n, int(rm.sandbox_fusion.max_concurrent))
    return n


def check_sandbox(cfg, data_sources) -> None:
    """Fail at start when rows scored by running code (:func:`jaxrl.rewards.needs_sandbox`) cannot run here: the
    local sandbox is probed (bubblewrap creates a sandbox and runs a program); ``isolation=none`` logs its loud
    warning; a Sandbox Fusion server is not contacted. Nothing is checked with a custom reward function.

    Raises:
        jaxrl.sandbox.SandboxUnavailableError: bubblewrap is missing or cannot create the sandbox here.
    """
    from jaxrl.rewards import needs_sandbox

    if cfg.custom_reward_function.path or not needs_sandbox(data_sources):
        return
    code_settings(cfg).sandbox.check()


def check_custom_reward(cfg) -> None:
    """Import the custom reward file (if any) and check its function's signature, without starting anything:
    ``python -m jaxrl.train`` calls this before importing jax, so a bad file fails in about a second.

    Raises:
        FileNotFoundError / jaxrl.rewards.custom.CustomRewardError: as :func:`build_reward_manager`.
    """
    rm, cf = cfg.reward_model, cfg.custom_reward_function
    if cf.path:
        batch = rm.reward_manager == "batch"
        load_custom_reward_fn(cf.path, cf.name, reward_kwargs=_custom_kwargs(cfg), batch=batch)


def _custom_kwargs(cfg) -> dict:
    rm, cf = cfg.reward_model, cfg.custom_reward_function
    batch_kwargs = dict(rm.reward_kwargs or {}) if rm.reward_manager == "batch" else {}
    return {**batch_kwargs, **dict(cf.reward_kwargs or {})}


def build_reward_manager(cfg, default_compute_score: Callable | None = None) -> RewardManager:
    """The reward manager of a run: the custom function (``custom_reward_function.path``) or
    ``default_compute_score`` (the built-in scorers by data source), under ``reward_model.reward_manager``.

    The custom file is imported and its signature checked here, so call this before anything slow. Its
    keyword arguments are ``custom_reward_function.reward_kwargs``; the ``batch`` manager also passes
    ``reward_model.reward_kwargs`` (verl's ``BatchRewardManager(**reward_kwargs)``), the custom ones winning.
    The scoring processes start on :meth:`RewardManager.start` or the first score.

    Raises:
        FileNotFoundError: the custom reward file does not exist.
        jaxrl.rewards.custom.CustomRewardError: the custom reward file or function cannot be used (one line).
        ValueError: no custom function with ``reward_manager=batch`` (the config loader refuses that first).
    """
    rm, cf = cfg.reward_model, cfg.custom_reward_function
    batch = rm.reward_manager == "batch"
    if cf.path:
        fn = load_custom_reward_fn(cf.path, cf.name, reward_kwargs=_custom_kwargs(cfg), batch=batch)
    elif batch:
        raise ValueError("reward_model.reward_manager=batch needs custom_reward_function.path")
    else:
        if default_compute_score is None:
            from jaxrl.rewards import default_compute_score
        # the built-ins by data source; the MATH family compared by reward_model.math_verifier, code rows run as
        # reward_model.sandbox / sandbox_fusion say (a picklable partial)
        fn = functools.partial(default_compute_score, math_verifier=rm.math_verifier, code=code_settings(cfg))
    return RewardManager(
        fn, reward_manager=rm.reward_manager, timeout_s=rm.timeout_s, num_workers=scoring_workers(cfg),
        max_error_fraction=rm.max_error_fraction, overlong=overlong_settings(cfg),
    )
