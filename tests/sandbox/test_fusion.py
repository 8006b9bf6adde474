"""The Sandbox Fusion client against a local fake server (127.0.0.1) that runs jaxrl's own sandbox, plus the
response mapping on Sandbox Fusion's documented shapes."""

from __future__ import annotations

import signal
import time

import pytest

from jaxrl.sandbox import Limits
from jaxrl.sandbox.fusion import FusionSandbox, request_body, result_from_response
from tests.sandbox.fake_fusion import FakeFusionServer


def test_request_body_is_verls():
    body = request_body("print(1)", "x", Limits(wall_s=7, memory_mb=512))
    assert body == {"code": "print(1)", "stdin": "x", "language": "python", "compile_timeout": 7,
                    "run_timeout": 7, "memory_limit_MB": 512, "files": {}, "fetch_files": []}


def test_client_runs_code_on_the_server(bwrap_sandbox):
    with FakeFusionServer(bwrap_sandbox) as server:
        client = FusionSandbox(server.url)
        res = client.run_code("import sys\nprint(sys.stdin.read()[::-1])", "abc")
        assert (res.stdout, res.exit_code, res.backend, res.error, res.status) == ("cba\n", 0, "fusion", None, "ok")
        res = client.run_code("raise SystemExit(4)")
        assert (res.exit_code, res.status) == (4, "failed")
        res = client.run_code("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
        assert (res.exit_code, res.signal) == (None, signal.SIGKILL)
        t0 = time.monotonic()
        res = client.run_code("import time\ntime.sleep(60)", limits=Limits(wall_s=1))
        assert res.limit == "wall_time" and res.status == "limit:wall_time" and time.monotonic() - t0 < 10
        res = client.run_code("x = bytearray(1 << 30)", limits=Limits(memory_mb=128))
        assert res.limit == "memory", res
        assert [r["run_timeout"] for r in server.requests] == [10.0, 10.0, 10.0, 1, 10.0]
        assert server.requests[-1]["memory_limit_MB"] == 128


def test_gateway_timeouts_are_retried_then_reported(bwrap_sandbox, monkeypatch):
    monkeypatch.setattr("jaxrl.sandbox.fusion.RETRY_DELAY_S", 0.01)
    with FakeFusionServer(bwrap_sandbox, gateway_timeouts=2) as server:
        res = FusionSandbox(server.url).run_code("print(5)")
        assert res.ok and res.stdout == "5\n" and len(server.requests) == 3
    with FakeFusionServer(bwrap_sandbox, gateway_timeouts=5) as server:
        res = FusionSandbox(server.url).run_code("print(5)")
        assert res.status == "sandbox_error" and "HTTP 504" in res.error and len(server.requests) == 3


def test_unreachable_server_and_sandbox_errors_are_errors_not_verdicts(bwrap_sandbox):
    with FakeFusionServer(bwrap_sandbox) as server:
        url = server.url
        res = FusionSandbox(url, language="cobol").run_code("DISPLAY 'HI'.")
        assert res.status == "sandbox_error" and "unsupported language" in res.error
        res = FusionSandbox(url.replace("/run_code", "/nope")).run_code("print(1)")
        assert res.status == "sandbox_error" and "HTTP 404" in res.error
    res = FusionSandbox(url).run_code("print(1)")  # the server is gone
    assert res.status == "sandbox_error" and "Connection refused" in res.error and res.exit_code is None


def test_response_mapping():
    finished = {"status": "Finished", "execution_time": 0.5, "return_code": 0, "stdout": "hi\n", "stderr": ""}
    res = result_from_response({"status": "Success", "message": "", "run_result": finished}, 9.0)
    assert (res.ok, res.stdout, res.seconds) == (True, "hi\n", 0.5)
    compile_fail = {"status": "Finished", "execution_time": 0.1, "return_code": 1, "stdout": "", "stderr": "err"}
    res = result_from_response({"status": "Failed", "compile_result": compile_fail, "run_result": None}, 1.0)
    assert (res.exit_code, res.stderr, res.status) == (1, "err", "failed")
    res = result_from_response({"status": "Failed", "run_result": {**finished, "status": "TimeLimitExceeded",
                                                                    "return_code": None}}, 1.0)
    assert res.limit == "wall_time"
    res = result_from_response({"status": "SandboxError", "message": "pod died"}, 1.0)
    assert res.status == "sandbox_error" and "pod died" in res.error
    res = result_from_response({"status": "Failed", "run_result": {**finished, "status": "Error"}}, 1.0)
    assert res.status == "sandbox_error"


def test_url_is_checked():
    with pytest.raises(ValueError, match="sandbox_fusion.url='localhost:8080'"):
        FusionSandbox("localhost:8080")
