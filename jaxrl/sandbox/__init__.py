"""Run model-written code: locally in bubblewrap (or, opted into, unisolated) or on a Sandbox Fusion server.
Standard library only (no jax), so reward scoring processes and tools import it cheaply.

* :func:`run_code` / :class:`LocalSandbox` -- a Python program in bubblewrap on this machine
  (:mod:`jaxrl.sandbox.bwrap` says what is isolated and how);
* :class:`FusionSandbox` -- the same ``run_code(code, stdin, limits)`` against a Sandbox Fusion server's
  ``/run_code`` (verl's ``reward_model.sandbox_fusion.url``);
* :func:`make_sandbox` -- the one a config asks for;
* :class:`Limits` / :class:`SandboxResult` -- what a run may use and what it gives.
"""

from __future__ import annotations

from jaxrl.sandbox.errors import SandboxUnavailableError
from jaxrl.sandbox.fusion import FusionSandbox
from jaxrl.sandbox.limits import LIMITS, Limits, SandboxResult
from jaxrl.sandbox.local import ISOLATIONS, LocalSandbox, run_code


def make_sandbox(*, isolation: str = "bwrap", fusion_url: str | None = None) -> LocalSandbox | FusionSandbox:
    """A :class:`FusionSandbox` when ``fusion_url`` is set, else a :class:`LocalSandbox` with ``isolation``.

    Raises:
        ValueError: an unknown ``isolation`` or a ``fusion_url`` that is not ``http(s)://...``.
    """
    if fusion_url:
        return FusionSandbox(fusion_url)
    return LocalSandbox(isolation)


__all__ = [
    "ISOLATIONS",
    "LIMITS",
    "FusionSandbox",
    "Limits",
    "LocalSandbox",
    "SandboxResult",
    "SandboxUnavailableError",
    "make_sandbox",
    "run_code",
]
