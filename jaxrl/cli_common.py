"""What the training commands share (``python -m jaxrl.train``, ``jaxrl.sft``, ``jaxrl.dpo``): the command line up to
a loaded config, the run-folder check before anything slow, and the map from a run's errors to one line on stderr
and an exit status.

Nothing here imports jax: the heavy error classes are imported by :func:`run_errors`, which a command calls only
once its config is valid. Exit statuses are the commands' (their module docstrings): 0 success, 1 a bad file or a
runtime failure (``jaxrl: error: ...``), 2 a config or usage error (``jaxrl: config error: ...``, or a run folder
that cannot take this run).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from jaxrl.config import ConfigError, config_to_yaml

__all__ = ["ExitRule", "parse_command_line", "load_and_announce", "check_run_folder", "run_errors", "exit_status",
           "fail"]


@dataclass(frozen=True)
class ExitRule:
    """Errors of ``types`` end the command with ``status`` and one line ``jaxrl: <label>: <message>``; ``more``
    (optional) gives further stderr text for the error (e.g. a traceback from a scoring process), or None."""

    types: tuple[type[BaseException], ...]
    status: int
    label: str = "error"
    more: Callable[[BaseException], str | None] | None = None


def fail(message: object, status: int, label: str = "error") -> int:
    """Print ``jaxrl: <label>: <message>`` on stderr; returns ``status`` (for ``return fail(...)``)."""
    print(f"jaxrl: {label}: {message}", file=sys.stderr)
    return status


def parse_command_line(parser: argparse.ArgumentParser,
                       argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]] | int:
    """``(args, overrides)`` from ``argv`` (default ``sys.argv[1:]``): the parser's flags, then ``key=value``
    overrides. An unknown flag prints the usage and one error line; returns 2 then."""
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    flags = [a for a in extra if a.startswith("-")]
    if flags:
        parser.print_usage(sys.stderr)
        return fail(f"unrecognized arguments: {' '.join(flags)}", 2)
    return args, extra


def load_and_announce(load: Callable[[], Any], print_config: bool) -> Any | int:
    """``load()`` (a config loader returning ``.config`` and ``.notes``), its notes printed as ``jaxrl: note:``
    lines. Returns the loaded result, or an exit status: 2 for a :class:`ConfigError` (one line), 0 after printing
    the resolved YAML when ``print_config``."""
    try:
        loaded = load()
    except ConfigError as e:
        return fail(e, 2, "config error")
    for note in loaded.notes:
        print(f"jaxrl: note: {note}", file=sys.stderr)
    if print_config:
        sys.stdout.write(config_to_yaml(loaded.config))
        sys.stdout.flush()
        return 0
    return loaded


def check_run_folder(cfg) -> int | None:
    """1 (after one error line) when ``trainer.default_local_dir`` cannot be created or written, else None: checked
    before anything slow, since a read-only run folder would otherwise fail at the run's first write."""
    from jaxrl.paths import OutputDirError, ensure_writable_dir

    try:
        ensure_writable_dir(cfg.trainer.default_local_dir, "trainer.default_local_dir")
    except OutputDirError as e:
        return fail(e, 1)
    return None


def run_errors() -> list[ExitRule]:
    """The errors every training command maps the same way (imports the checkpoint, data, model and loop modules):

    * 2: the run folder cannot take this run (another run holds it; its checkpoints come from an incompatible
      configuration), or a setting only checkable once jax is up (mesh sizes vs devices, the model's context);
    * 1: a missing file, a malformed data or model file, diverged training, no readable checkpoint to resume from,
      a final checkpoint that could not be saved (each message names the culprit and the fix).
    """
    from jaxrl.checkpoint import CheckpointIncompatibleError, CheckpointRestoreError, CheckpointSaveError
    from jaxrl.data.sources import DataFileError
    from jaxrl.loop import NonFiniteTrainingError
    from jaxrl.models.files import ModelFileError
    from jaxrl.runlock import RunLockError

    return [
        ExitRule((RunLockError, CheckpointIncompatibleError), 2),
        ExitRule((ConfigError,), 2, "config error"),
        ExitRule((FileNotFoundError, DataFileError, ModelFileError, NonFiniteTrainingError, CheckpointRestoreError,
                  CheckpointSaveError), 1),
    ]


def exit_status(run: Callable[[], object], rules: Sequence[ExitRule]) -> int:
    """Run ``run()``; 0 when it returns, else the status of the first rule whose types match the error (its line and
    ``more`` text on stderr). An error no rule names propagates (a traceback: a bug, not a user's mistake)."""
    try:
        run()
    except Exception as e:
        for rule in rules:
            if isinstance(e, rule.types):
                fail(e, rule.status, rule.label)
                extra = rule.more(e) if rule.more else None
                if extra:
                    print(extra, file=sys.stderr)
                return rule.status
        raise
    return 0
