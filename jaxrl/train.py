"""Command-line front: ``python -m jaxrl.train --config FILE [--print-config] [key=value ...]``.

The config is loaded and validated before jax (or anything heavy) is imported, so a misspelled key
fails in well under a second. Overrides use verl's spelling (``actor_rollout_ref.actor.optim.lr=1e-6``),
so a verl ``main_ppo`` command line works with the module name swapped.

Exit status (one-line message on stderr, ``jaxrl: error: ...`` / ``jaxrl: config error: ...``):

* 0: success (``--print-config`` prints the resolved YAML to stdout);
* 1: a bad file or a runtime failure: a missing, empty or malformed data file, a truncated or corrupt model file,
  processes of a multi-process run that could not join (``jaxrl.distributed``) or whose replicas diverged,
  a missing ``trainer.resume_from_path``, an output folder that cannot be written, diverged training, a failed
  weight sync, a reward function that failed on a whole batch (its first traceback follows the message), no
  readable checkpoint to resume from, or a final checkpoint that could not be saved (the message names the
  newest complete checkpoint);
* 2: a config or usage error (``jaxrl: config error:``), an unusable custom reward file or function, a run folder
  (``trainer.default_local_dir``) in use by another run, or a checkpoint written by an incompatible
  configuration (the message lists what changed and the ways out); also a world the config cannot run
  (``trainer.nnodes`` / ``n_gpus_per_node`` against the processes, split placement or vLLM with several processes,
  a run folder the processes do not all see: :mod:`jaxrl.distributed`).

Several processes (``python -m jaxrl.launch``, the ``JAXRL_*`` variables or ``trainer.distributed.mode=auto``) each
run this same command; see the README's "Multi-host".
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from jaxrl.cli_common import (ExitRule, check_run_folder, exit_status, fail, load_and_announce, parse_command_line,
                              run_errors)
from jaxrl.config import load_config_with_notes

_EPILOG = """\
overrides:
  key=value pairs in verl's dotted form, applied after --config in order, e.g.
    data.train_batch_size=16 actor_rollout_ref.rollout.n=8 trainer.logger=[console,jsonl]
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxrl.train",
        description="Train an LLM policy with RL (GRPO) in JAX from a verl-style config.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", default=None, help="YAML config (default: schema defaults only)")
    p.add_argument(
        "--print-config", action="store_true", help="print the resolved, validated config as YAML and exit"
    )
    return p


def _checkpoint_hint(cfg) -> str:
    """Where a stopped run can resume from: the newest complete checkpoint in ``trainer.default_local_dir``."""
    from jaxrl.checkpoint import latest_complete_step

    root = cfg.trainer.default_local_dir
    try:
        step = latest_complete_step(root)
    except (OSError, ValueError):
        step = None
    if step is None:
        return f"no checkpoint was saved in {root} yet (trainer.save_freq={cfg.trainer.save_freq})"
    return (f"the newest complete checkpoint is {root}/global_step_{step} (untouched by the failed sync); "
            "fix the cause and rerun the same command to resume from it")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), load the config, then print it or train.

    A process of a multi-process run (:mod:`jaxrl.distributed`) that fails leaves at once with its exit status
    (after its message or traceback): a normal exit would wait in jax's shutdown barrier for processes that will not
    come, and its launcher (or its peers' heartbeat) must see it gone to stop the others.

    Returns the process exit status (0 ok, 1 a missing/unreadable model or data file, an unwritable
    ``trainer.default_local_dir``, diverged training or a reward function failing on a whole batch, 2 config/usage
    error, incl. an unusable custom reward function, a data source with no reward function, or prompt + response
    lengths beyond the model's context). Compat notes (verl keys with no JAX meaning, uneven mini-batches) go to
    stderr, one line each. Training is ``jaxrl.trainer.run_training(cfg)``,
    imported only after the config is valid.
    """
    from jaxrl.distributed import run_guarded

    return run_guarded(_main, argv)


def _main(argv: Sequence[str] | None) -> int:
    parsed = parse_command_line(_parser(), argv)
    if isinstance(parsed, int):
        return parsed
    args, overrides = parsed
    loaded = load_and_announce(lambda: load_config_with_notes(args.config, overrides), args.print_config)
    if isinstance(loaded, int):
        return loaded
    cfg = loaded.config
    from jaxrl.ray_backend import uses_rollout_pool

    hybrid = uses_rollout_pool(cfg)  # a rollout pool of its own: this process is the controller of two groups
    if cfg.trainer.launcher == "ray" and not hybrid:  # this process only places and supervises the hosts' processes
        from jaxrl.ray_backend.driver import run_driver

        return run_driver(cfg, list(sys.argv[1:] if argv is None else argv))
    status = _check_reward_and_tools(cfg)
    if status is None:
        status = check_run_folder(cfg)
    if status is not None:
        return status
    if hybrid:
        return _run_hybrid(cfg)
    from jaxrl.trainer import run_training  # heavy (jax); only after the config is valid

    return exit_status(lambda: run_training(cfg), [*run_errors(), *_rl_errors(cfg)])


def _run_hybrid(cfg) -> int:
    """The hybrid controller (:mod:`jaxrl.hybrid`): this process drives a train group and a rollout group on the
    Ray cluster. A lost member is ``jaxrl: error: ...`` naming the group and its host, exit 1."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return fail("actor_rollout_ref.rollout.nnodes > 0 (the hybrid controller) needs Ray: pip install "
                    "'jaxrl[ray]'", 2)
    from jaxrl.hybrid.controller import run_hybrid
    from jaxrl.hybrid.groups import GroupFailure
    from jaxrl.ray_backend.pool import PlacementTimeoutError

    return exit_status(lambda: run_hybrid(cfg), [
        *run_errors(), *_rl_errors(cfg),
        ExitRule((GroupFailure,), 1, more=lambda e: f"jaxrl: {_checkpoint_hint(cfg)}"),
        ExitRule((PlacementTimeoutError, ConnectionError), 1)])


def _check_reward_and_tools(cfg) -> int | None:
    """The custom reward file and the multi-turn tool config, checked before jax loads: an exit status (1 a missing
    file or no sandbox for the tools, 2 an unusable reward function or tool config), or None when both are fine."""
    from jaxrl.rewards.custom import CustomRewardError
    from jaxrl.rewards.factory import check_custom_reward
    from jaxrl.sandbox import SandboxUnavailableError

    try:
        check_custom_reward(cfg)
    except FileNotFoundError as e:
        return fail(e, 1)
    except CustomRewardError as e:  # the custom reward file or its signature: a usage error
        return fail(e, 2)
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:  # the tool YAML and its classes
        from jaxrl.agent.tool_config import ToolConfigError, check_multi_turn

        try:
            check_multi_turn(cfg.actor_rollout_ref.rollout.multi_turn)
        except (FileNotFoundError, SandboxUnavailableError) as e:
            return fail(e, 1)
        except ToolConfigError as e:
            return fail(e, 2, "config error")
    return None


def _rl_errors(cfg) -> list[ExitRule]:
    """The RL run's own errors, after the shared :func:`jaxrl.cli_common.run_errors`."""
    from jaxrl.distributed import DistributedError
    from jaxrl.rewards import UnknownDataSourceError
    from jaxrl.rewards.custom import CustomRewardError
    from jaxrl.rewards.manager import RewardError
    from jaxrl.rewards.pool import WorkerStartError
    from jaxrl.rollout.base import WeightSyncError
    from jaxrl.sandbox import SandboxUnavailableError

    def scorer_traceback(e) -> str | None:
        tb = getattr(e, "traceback", None)
        return f"jaxrl: the first failure's traceback (in the scoring process):\n{tb.rstrip()}" if tb else None

    return [
        ExitRule((SandboxUnavailableError,), 1),  # code rows and no sandbox: the message says what to install
        ExitRule((CustomRewardError,), 2),  # the custom reward file (changed since the check) or its signature
        ExitRule((RewardError, WorkerStartError), 1, more=scorer_traceback),  # failed on a whole batch: no silent 0
        ExitRule((UnknownDataSourceError,), 2),  # rows no reward function can score, found before the model loads
        # the rollout engine could not take the new weights: stop, keep the checkpoints, say which one to resume from
        ExitRule((WeightSyncError,), 1, more=lambda e: f"jaxrl: {_checkpoint_hint(cfg)}"),
        ExitRule((DistributedError,), 1),  # the processes could not join, or their replicas diverged
    ]


if __name__ == "__main__":
    sys.exit(main())
