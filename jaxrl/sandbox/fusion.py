"""A client for a Sandbox Fusion server (https://github.com/bytedance/SandboxFusion): the same ``run_code`` call as
:class:`jaxrl.sandbox.LocalSandbox`, executed by the server. verl's ``reward_model.sandbox_fusion.url`` names it.
Standard library only (``urllib``).

The request is Sandbox Fusion's ``POST /run_code`` body, as verl sends it (``verl/utils/reward_score/
sandbox_fusion/utils.py``)::

    {"code": ..., "stdin": ..., "language": "python", "compile_timeout": s, "run_timeout": s,
     "memory_limit_MB": mb, "files": {}, "fetch_files": []}

and the response is ``{"status": "Success" | "Failed" | "SandboxError", "message": str, "compile_result": null |
R, "run_result": null | R, ...}`` with ``R = {"status": "Finished" | "TimeLimitExceeded" | "Error",
"execution_time": s, "return_code": int | null, "stdout": str, "stderr": str}``. Like verl, a ``504 Gateway
Timeout`` is retried (:data:`MAX_TRIES` attempts, 1 s, 2 s apart); any other HTTP or connection error, an
undecodable answer or a ``SandboxError`` is a :class:`~jaxrl.sandbox.SandboxResult` with ``error`` set (never a
verdict on the code).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from jaxrl.sandbox.limits import Limits, SandboxResult

MAX_TRIES = 3
RETRY_DELAY_S = 1.0  # attempt k waits k * this before the next
API_SLACK_S = 10.0  # the HTTP timeout is compile + run timeout + this (verl's API_TIMEOUT)


def request_body(code: str, stdin: str, limits: Limits, language: str = "python") -> dict:
    """The ``/run_code`` request for one run (``compile_timeout`` = ``run_timeout`` = ``limits.wall_s``, as
    verl sends one timeout for both)."""
    return {
        "code": code, "stdin": stdin, "language": language, "compile_timeout": limits.wall_s,
        "run_timeout": limits.wall_s, "memory_limit_MB": limits.memory_mb, "files": {}, "fetch_files": [],
    }


def result_from_response(resp: dict, seconds: float) -> SandboxResult:
    """A :class:`SandboxResult` from a ``/run_code`` response (module docstring).

    ``run_result.status == "TimeLimitExceeded"`` is ``limit="wall_time"``; a failed compile step (compiled
    languages) is the program's failure, with the compiler's output; a negative ``return_code`` is a signal.
    """
    status = resp.get("status")
    run = resp.get("run_result") or None
    comp = resp.get("compile_result") or None
    if status == "SandboxError" or status not in ("Success", "Failed"):
        why = resp.get("message") or (run or {}).get("stderr") or ""
        return SandboxResult(seconds=seconds, backend="fusion",
                             error=f"Sandbox Fusion status {status!r}: {' '.join(str(why).split())[:500]}")
    step = run
    if comp is not None and (comp.get("status") != "Finished" or comp.get("return_code") not in (0, None)):
        step = comp  # the compile step failed: the program never ran
    if step is None:
        return SandboxResult(seconds=seconds, backend="fusion",
                             error=f"Sandbox Fusion answered {status!r} without a run or compile result")
    out, err = step.get("stdout") or "", step.get("stderr") or ""
    exec_s = step.get("execution_time")
    took = float(exec_s) if isinstance(exec_s, (int, float)) else seconds
    if step.get("status") == "TimeLimitExceeded":
        return SandboxResult(stdout=out, stderr=err, seconds=took, backend="fusion", limit="wall_time")
    if step.get("status") != "Finished":
        return SandboxResult(stdout=out, stderr=err, seconds=took, backend="fusion",
                             error=f"Sandbox Fusion run status {step.get('status')!r}: {err.strip()[-300:]}")
    rc = step.get("return_code")
    if not isinstance(rc, int):
        return SandboxResult(stdout=out, stderr=err, seconds=took, backend="fusion",
                             error=f"Sandbox Fusion gave return_code {rc!r}")
    from jaxrl.sandbox.process import limit_from_failure

    code, sig = (rc, None) if rc >= 0 else (None, -rc)
    return SandboxResult(stdout=out, stderr=err, exit_code=code, signal=sig, seconds=took, backend="fusion",
                         limit=limit_from_failure(code, sig, err))


@dataclass(frozen=True)
class FusionSandbox:
    """Runs programs on a Sandbox Fusion server.

    Attributes:
        url: the server's ``run_code`` endpoint, e.g. ``http://127.0.0.1:8080/run_code`` (verl's
            ``reward_model.sandbox_fusion.url``; posted to as given).
        language: Sandbox Fusion's language name for the programs (``"python"``).
    """

    url: str
    language: str = "python"

    def __post_init__(self):
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"sandbox_fusion.url={self.url!r} is not valid; use http(s)://HOST:PORT/run_code")

    @property
    def backend(self) -> str:
        return "fusion"

    def check(self) -> None:
        """Nothing to check before the first call (the server may start later); errors come back per call."""

    def run_code(self, code: str, stdin: str = "", limits: Limits | None = None) -> SandboxResult:
        """Run ``code`` on the server (see :meth:`jaxrl.sandbox.LocalSandbox.run_code`; the server enforces the
        wall time and memory of ``limits``, the rest is its own configuration).

        Returns:
            A :class:`SandboxResult` (``backend="fusion"``; ``error`` set when the server failed or did not
            answer after :data:`MAX_TRIES` tries of a 504).
        """
        limits = limits or Limits()
        body = json.dumps(request_body(code, stdin, limits, self.language)).encode()
        timeout = 2 * limits.wall_s + API_SLACK_S
        t0 = time.monotonic()
        last = None
        for attempt in range(MAX_TRIES):
            req = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    raw = r.read()
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code} {e.reason}"
                if e.code == 504 and attempt + 1 < MAX_TRIES:
                    time.sleep(RETRY_DELAY_S * (attempt + 1))
                    continue
                break
            except (urllib.error.URLError, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
                break
            try:
                resp = json.loads(raw)
            except ValueError as e:
                last = f"an answer that is not JSON ({e}): {raw[:200]!r}"
                break
            if not isinstance(resp, dict):
                last = f"an answer that is not a JSON object: {raw[:200]!r}"
                break
            return result_from_response(resp, time.monotonic() - t0)
        return SandboxResult(seconds=time.monotonic() - t0, backend="fusion",
                             error=f"Sandbox Fusion at {self.url} failed: {last}")
