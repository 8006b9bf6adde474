"""A small Sandbox Fusion server on 127.0.0.1 for tests: ``POST /run_code`` with Sandbox Fusion's request and
response shapes (``sandbox/server/sandbox_api.py`` of bytedance/SandboxFusion), executed by jaxrl's own bubblewrap
sandbox. Only ``language="python"``; ``gateway_timeouts`` answers the first N requests with HTTP 504."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jaxrl.sandbox import Limits, LocalSandbox


def response_for(result) -> dict:
    """A ``RunCodeResponse`` from a :class:`jaxrl.sandbox.SandboxResult`."""
    if result.error is not None:
        return {"status": "SandboxError", "message": result.error, "compile_result": None, "run_result": None,
                "executor_pod_name": None, "files": {}}
    if result.limit == "wall_time":
        run_status, rc = "TimeLimitExceeded", None
    else:
        run_status = "Finished"
        rc = result.exit_code if result.exit_code is not None else -(result.signal or 9)
    run = {"status": run_status, "execution_time": result.seconds, "return_code": rc, "stdout": result.stdout,
           "stderr": result.stderr}
    ok = run_status == "Finished" and rc == 0
    return {"status": "Success" if ok else "Failed", "message": "", "compile_result": None, "run_result": run,
            "executor_pod_name": None, "files": {}}


class FakeFusionServer:
    """``with FakeFusionServer(sandbox) as server: server.url`` -> ``http://127.0.0.1:PORT/run_code``."""

    def __init__(self, sandbox: LocalSandbox, gateway_timeouts: int = 0):
        self.sandbox = sandbox
        self.gateway_timeouts = gateway_timeouts
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_POST(self):
                if self.path != "/run_code":
                    self.send_error(404)
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer._lock:
                    outer.requests.append(body)
                    if outer.gateway_timeouts > 0:
                        outer.gateway_timeouts -= 1
                        self.send_error(504, "Gateway Timeout")
                        return
                if body.get("language") != "python":
                    reply = {"status": "SandboxError", "message": f"unsupported language {body.get('language')!r}",
                             "compile_result": None, "run_result": None, "files": {}}
                else:
                    mem = body.get("memory_limit_MB", -1)
                    limits = Limits(wall_s=float(body.get("run_timeout", 10)), cpu_s=float(body.get("run_timeout", 10)),
                                    **({"memory_mb": int(mem)} if mem and mem > 0 else {}))
                    reply = response_for(self.server_sandbox.run_code(body["code"], body.get("stdin") or "", limits))
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            @property
            def server_sandbox(self):
                return outer.sandbox

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-fusion", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/run_code"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(10)
