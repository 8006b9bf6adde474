"""Load a user reward function from a Python file (verl's ``custom_reward_function.path`` / ``.name``)."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

from jaxrl.paths import expand_shared


def load_custom_reward_fn(path: str, name: str = "compute_score") -> Callable:
    """Import the file at ``path`` as a module and return its function ``name``.

    The function should follow verl's signature
    ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``
    (a dict must hold ``"score"``); the :class:`~jaxrl.rewards.manager.RewardManager` calls it with
    those keyword arguments. The module is registered in ``sys.modules`` under a name derived from
    the file's absolute path, so loading the same file twice re-executes it under the same name.

    Args:
        path: a ``.py`` file; ``~`` and ``${JAXRL_SHARED}`` are expanded.
        name: the function's name in that file.

    Returns:
        The callable.

    Raises:
        FileNotFoundError: ``path`` does not exist (names the resolved path).
        AttributeError: the module has no attribute ``name`` (names the path and lists the callables
            the file defines).
        TypeError: ``name`` exists but is not callable.
        Exception: whatever executing the file raises, with a note naming the file.
    """
    file = Path(expand_shared(str(path))).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(
            f"custom reward function file {str(file)!r} does not exist (from path={path!r})"
        )
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:10]
    module_name = f"jaxrl_custom_reward_{file.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {str(file)!r} as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        sys.modules.pop(module_name, None)
        if isinstance(e, Exception):
            e.add_note(f"while importing custom reward file {str(file)!r}")
        raise
    if not hasattr(module, name):
        callables = sorted(
            k
            for k, v in vars(module).items()
            if callable(v)
            and not k.startswith("_")
            and not inspect.ismodule(v)
            and getattr(v, "__module__", module_name) == module_name
        )
        raise AttributeError(
            f"custom reward file {str(file)!r} has no function {name!r}; "
            f"callables defined there: {callables}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(
            f"{name!r} in custom reward file {str(file)!r} is a {type(fn).__name__}, not a function"
        )
    return fn
