"""``python -m jaxrl.sandbox``: say which bubblewrap is used and whether it can create the sandbox here (exit 0), or
why not and what to install (exit 1). Runs one small program in the sandbox."""

from __future__ import annotations

import os
import sys


def main() -> int:
    from jaxrl.sandbox import Limits, LocalSandbox, SandboxUnavailableError
    from jaxrl.sandbox.bwrap import bwrap_version, check_bwrap, find_bwrap

    path, where = find_bwrap()
    version = bwrap_version(path) if path else None
    print(f"bwrap: {path or 'not found'} ({where})" + (f", version {'.'.join(map(str, version))}" if version else ""))
    print(f"caller: uid {os.getuid()}" + (" (root: no user namespace; programs run as a random unprivileged uid)"
                                            if os.getuid() == 0 else " (programs run in a user namespace)"))
    try:
        check_bwrap()
    except SandboxUnavailableError as e:
        print(f"jaxrl.sandbox: error: {e}", file=sys.stderr)
        return 1
    res = LocalSandbox("bwrap").run_code("import os, socket\nprint(os.getuid(), socket.gethostname())",
                                         limits=Limits(wall_s=30))
    print(f"sandbox works: a test program ran as uid {res.stdout.split()[0]} on host {res.stdout.split()[1]!r} "
          f"in {res.seconds * 1000:.0f} ms (network, pid, ipc, uts namespaces; read-only system and Python; "
          "private /tmp)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
