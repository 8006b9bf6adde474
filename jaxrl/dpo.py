"""``python -m jaxrl.dpo --config FILE [--print-config] [key=value ...]``: DPO on preference pairs.

Pairs come from parquet / jsonl files with TRL's columns (``prompt``, ``chosen``, ``rejected``: text or chat
messages; without ``prompt``, whole conversations sharing their first turns); the loss is ``algorithm.dpo.loss_type``
(``sigmoid`` = DPO, with ``label_smoothing`` cDPO; ``ipo``; ``hinge``; ``robust``) with ``algorithm.dpo.beta``
against the frozen initial model. The config has the layout of ``python -m jaxrl.sft``'s. Online DPO (pairs from the
policy's own samples scored by a reward) is ``python -m jaxrl.train`` with ``algorithm.dpo.enable=true``. Exit status
and errors: :mod:`jaxrl.offline.cli`; the README's "DPO" section.
"""

from __future__ import annotations

import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxrl.dpo``; returns the exit status (0 ok, 1 a bad file or runtime failure, 2 a config error)."""
    from jaxrl.offline.cli import main as offline_main

    return offline_main("dpo", argv)


if __name__ == "__main__":
    sys.exit(main())
