"""Rollout engines behind one small protocol (:class:`RolloutEngine`), fed through one weight-sync boundary.

``base`` (the protocol, :class:`SamplingParams`, :class:`RolloutOutput`, the errors) imports only numpy, so
config code can use it before jax is imported; :class:`JaxSampler` (the embedded JAX engine,
``actor_rollout_ref.rollout.name=jax``), ``sampling``, :class:`WeightSync` (the only caller of
``engine.update_weights``) and :class:`WeightFormat` (what each engine declares it accepts) are loaded on first
use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jaxrl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from jaxrl.rollout import sampling
    from jaxrl.rollout.jax_sampler import JaxSampler
    from jaxrl.rollout.weight_format import WeightFormat
    from jaxrl.rollout.weight_sync import WeightSync

__all__ = ["JaxSampler", "RolloutEngine", "RolloutOutput", "SamplingParams", "WeightFormat", "WeightSync", "sampling"]

_LAZY = {
    "JaxSampler": "jaxrl.rollout.jax_sampler",
    "WeightFormat": "jaxrl.rollout.weight_format",
    "WeightSync": "jaxrl.rollout.weight_sync",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "sampling":
        return importlib.import_module("jaxrl.rollout.sampling")
    raise AttributeError(f"module 'jaxrl.rollout' has no attribute {name!r}")
