"""``python -m jaxrl.sft --config FILE [--print-config] [key=value ...]``: supervised fine-tuning.

verl's SFT config (``verl/trainer/config/sft_trainer.yaml``: ``data.prompt_key`` / ``response_key`` /
``*_dict_keys``, ``data.multiturn``, ``model.partial_pretrain``, ``optim.*``, ``trainer.*``), so a verl
``fsdp_sft_trainer`` command line runs with the module name swapped. The loss is on the response (assistant) tokens
only; the run has the RL trainer's mesh, checkpoints (exact resume), logging and HF export. Exit status and errors:
:mod:`jaxrl.offline.cli`; the README's "SFT" section.
"""

from __future__ import annotations

import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxrl.sft``; returns the exit status (0 ok, 1 a bad file or runtime failure, 2 a config error)."""
    from jaxrl.offline.cli import main as offline_main

    return offline_main("sft", argv)


if __name__ == "__main__":
    sys.exit(main())
