"""Run model-written code: locally in bubblewrap (or, opted into, unisolated) or on a Sandbox Fusion server.
Standard library only (no jax), so reward scoring processes and tools import it cheaply.

* :func:`run_code` / :class:`LocalSandbox` -- a Python program in bubblewrap on this machine
  (:mod:`jaxrl.sandbox.bwrap` says what is isolated and how);
* :class:`FusionSandbox` -- the same call against a Sandbox Fusion server's ``/run_code`` (verl's
  ``reward_model.sandbox_fusion.url``);
* :class:`Limits` / :class:`SandboxResult` -- what a run may use and what it gives.
"""

from jaxrl.sandbox.errors import SandboxUnavailableError
from jaxrl.sandbox.limits import LIMITS, Limits, SandboxResult
from jaxrl.sandbox.local import ISOLATIONS, LocalSandbox, run_code

__all__ = ["ISOLATIONS", "LIMITS", "Limits", "LocalSandbox", "SandboxResult", "SandboxUnavailableError", "run_code"]
