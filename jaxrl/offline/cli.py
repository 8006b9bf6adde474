"""The command line of the offline trainers: ``python -m jaxrl.sft`` and ``python -m jaxrl.dpo``
(``--config FILE [--print-config] [key=value ...]``), parsed and validated as ``python -m jaxrl.train`` does: the
config is loaded before jax is imported, overrides use verl's dotted spelling (``optim.lr=1e-5``), and every failure
is one line on stderr.

Exit status:

* 0: success (``--print-config`` prints the resolved YAML);
* 1: a bad file or a runtime failure (``jaxrl: error: ...``): a missing, empty or malformed data file (the message
  names the file and line), a sequence longer than ``data.max_length`` with ``data.truncation=error``, a corrupt
  model file, an output folder that cannot be written, diverged training, no readable checkpoint to resume from, a
  final checkpoint that could not be saved;
* 2: a config or usage error (``jaxrl: config error: ...``), a run folder in use by another run, or a checkpoint
  written by an incompatible configuration.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from jaxrl.cli_common import check_run_folder, exit_status, load_and_announce, parse_command_line, run_errors
from jaxrl.config.offline_loader import load_offline_config_with_notes

_DESCRIPTION = {
    "sft": "Supervised fine-tuning of an LLM in JAX from a verl-style SFT config (verl's sft_trainer.yaml keys).",
    "dpo": "DPO of an LLM in JAX on preference pairs (TRL's prompt/chosen/rejected columns) from a jaxrl config.",
}
_EPILOG = """\
overrides:
  key=value pairs in verl's dotted form, applied after --config in order, e.g.
    {example}
"""
_EXAMPLE = {"sft": "data.train_batch_size=32 optim.lr=1e-5 trainer.total_epochs=2",
            "dpo": "algorithm.dpo.beta=0.1 algorithm.dpo.loss_type=ipo data.train_batch_size=16"}


def _parser(kind: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m jaxrl.{kind}", description=_DESCRIPTION[kind],
                                epilog=_EPILOG.format(example=_EXAMPLE[kind]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", default=None, help="YAML config (default: schema defaults only)")
    p.add_argument("--print-config", action="store_true", help="print the resolved, validated config as YAML and exit")
    return p


def main(kind: str, argv: Sequence[str] | None = None) -> int:
    """Run ``python -m jaxrl.<kind>`` (``kind``: ``"sft"`` or ``"dpo"``) on ``argv`` (default ``sys.argv[1:]``);
    returns the exit status (module docstring)."""
    parsed = parse_command_line(_parser(kind), argv)
    if isinstance(parsed, int):
        return parsed
    args, overrides = parsed
    loaded = load_and_announce(lambda: load_offline_config_with_notes(kind, args.config, overrides),
                               args.print_config)
    if isinstance(loaded, int):
        return loaded
    status = check_run_folder(loaded.config)
    if status is not None:
        return status
    from jaxrl.offline.trainer import run_offline  # heavy (jax); only after the config is valid

    return exit_status(lambda: run_offline(loaded.config, kind), run_errors())
