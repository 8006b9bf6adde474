"""Rollout engines behind one small protocol (:class:`RolloutEngine`).

``base`` (the protocol, :class:`SamplingParams`, :class:`RolloutOutput`) imports only numpy, so
config code can use it before jax is imported; :class:`JaxSampler` (the embedded JAX engine,
``actor_rollout_ref.rollout.name=jax``) and ``sampling`` are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jaxrl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from jaxrl.rollout import sampling
    from jaxrl.rollout.jax_sampler import JaxSampler

__all__ = ["JaxSampler", "RolloutEngine", "RolloutOutput", "SamplingParams", "sampling"]


def __getattr__(name: str):
    if name == "JaxSampler":
        return importlib.import_module("jaxrl.rollout.jax_sampler").JaxSampler
    if name == "sampling":
        return importlib.import_module("jaxrl.rollout.sampling")
    raise AttributeError(f"module 'jaxrl.rollout' has no attribute {name!r}")
