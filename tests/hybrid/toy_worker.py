"""A worker-group member without jax, for tests/hybrid/test_groups.py (imported by the Ray workers by name)."""

from __future__ import annotations

import os
import time

from jaxrl.hybrid.worker import _Member


class ToyWorker(_Member):
    def pid(self) -> int:
        return os.getpid()

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def cwd(self) -> str:
        return os.getcwd()

    def boom(self, value: int) -> None:
        raise ValueError(f"bad value {value}")

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds
