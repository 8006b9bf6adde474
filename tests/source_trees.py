"""Syntax trees of the project's own sources, for the tests that check rules on the code (import rules, single
callers).

They are parsed once, in a fresh single-threaded interpreter: CPython 3.11.7's ``ast.parse`` shares one recursion
counter between threads (cpython#106905) and raised "AST constructor recursion depth mismatch" in CI once, when a
thread left by an earlier test of the session parsed at the same time."""

from __future__ import annotations

import ast
import functools
import pickle
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PARSE_ALL = """
import ast, pickle, sys
from pathlib import Path
root = Path(sys.argv[1])
trees = {str(p): ast.parse(p.read_text(), filename=str(p))
         for pkg in ("jaxrl", "sharding", "launchers") for p in sorted((root / pkg).rglob("*.py"))}
sys.stdout.buffer.write(pickle.dumps(trees))
"""


@functools.lru_cache(maxsize=1)
def _trees() -> dict[str, ast.Module]:
    out = subprocess.run([sys.executable, "-c", _PARSE_ALL, str(ROOT)], capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    return pickle.loads(out.stdout)


def tree(path: Path) -> ast.Module:
    """The module syntax tree of ``path`` (a file under jaxrl/, sharding/ or launchers/); KeyError otherwise."""
    return _trees()[str(Path(path).resolve())]
