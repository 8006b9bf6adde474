"""The sandbox's errors. Standard library only."""

from __future__ import annotations


class SandboxUnavailableError(RuntimeError):
    """No isolation tool works on this machine, so model-written code is not run (one-line message that says
    what to install, what the probe saw, and the trusted-code-only opt-out)."""
