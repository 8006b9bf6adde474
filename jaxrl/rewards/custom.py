"""Load a user reward function from a Python file (verl's ``custom_reward_function.path`` / ``.name`` /
``.reward_kwargs``), check how it can be called, and hand back a picklable callable.

The file is imported once here (so a syntax error, a missing function or a signature that cannot take
verl's arguments is a one-line :class:`CustomRewardError` at start, before the model loads), and again
inside every scoring process (:mod:`jaxrl.rewards.pool`): the returned :class:`CustomRewardFn` carries
only the file, the function name, the keyword arguments and the call style.

Call styles, chosen once from the function's signature:

* ``"verl"`` -- verl's reward-manager signature ``compute_score(data_source, solution_str, ground_truth,
  extra_info=None, **kwargs)``: called with those keywords (``extra_info`` only when the function takes
  it or ``**kwargs``);
* ``"scorer"`` -- verl's scorer-file signature ``compute_score(solution_str, ground_truth, ...)``
  (``verl/utils/reward_score/gsm8k.py``, ``math_reward.py``, ``math_verify.py``, ...): no ``data_source``
  parameter; the response and the ground truth go to the first two positional parameters, whatever their
  names (``extra_info`` as a keyword when the function has such a parameter). The log says so;
* ``"batch"`` -- for ``reward_model.reward_manager=batch`` (verl's ``BatchRewardManager``):
  ``compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)`` -> a list.

``reward_kwargs`` go to every call as keyword arguments (verl's ``get_custom_reward_fn``:
``{**call_kwargs, **reward_kwargs}``); each key must be a parameter of the function (or it takes
``**kwargs``). ``async def`` functions are run to completion with :func:`asyncio.run`.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import logging
import sys
import traceback
from pathlib import Path
from typing import Any

from jaxrl.paths import expand_shared

logger = logging.getLogger(__name__)

VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
STYLES = ("verl", "scorer", "batch")
_EXPECTED = (
    "expected verl's compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) "
    "or a verl scorer file's compute_score(solution_str, ground_truth, ...)"
)
_EXPECTED_BATCH = (
    "expected verl's batch signature compute_score(data_sources, solution_strs, ground_truths, extra_infos, "
    "**kwargs) returning one score per response (reward_model.reward_manager=batch)"
)

# (file, name) -> function, per process: a worker imports the file once.
_LOADED: dict[tuple[str, str], Any] = {}


class CustomRewardError(ValueError):
    """The custom reward file cannot be used: a syntax error, an error while importing it, no function of
    that name, or a signature that cannot take verl's arguments. The message is one line naming the file
    (and line) and what to fix."""


def _module_name(file: Path) -> str:
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:10]
    return f"jaxrl_custom_reward_{file.stem}_{digest}"


def _import_file(file: Path):
    """Execute ``file`` as a module (registered in ``sys.modules`` under a name derived from its path)."""
    module_name = _module_name(file)
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise CustomRewardError(
            f"custom reward file {str(file)!r} cannot be imported as a Python module; "
            "custom_reward_function.path must name a .py file"
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(module_name, None)
        where = f"{e.filename or file}, line {e.lineno}" if e.lineno else str(e.filename or file)
        raise CustomRewardError(
            f"custom reward file {where}: {type(e).__name__}: {e.msg}; fix the file "
            "(custom_reward_function.path)"
        ) from None
    except Exception as e:  # noqa: BLE001 - whatever the file's top level raises
        sys.modules.pop(module_name, None)
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == file]
        where = f"{file}, line {lines[-1]}" if lines else str(file)
        raise CustomRewardError(
            f"custom reward file {where}: importing it raised {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}; fix the file or install what it imports"
        ) from None
    return module


def _function(file: Path, name: str):
    """The function ``name`` of ``file`` (imported once per process)."""
    key = (str(file), name)
    if key in _LOADED:
        return _LOADED[key]
    module = _import_file(file)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        defined = sorted(
            f"{k} (line {v.__code__.co_firstlineno})"
            for k, v in vars(module).items()
            if inspect.isfunction(v) and not k.startswith("_") and v.__module__ == module.__name__
        )
        what = "has no function" if fn is None else f"has {name!r} but it is a {type(fn).__name__}, not"
        raise CustomRewardError(
            f"custom reward file {str(file)!r} {what} {name!r} (custom_reward_function.name); "
            f"functions defined there: {', '.join(defined) or 'none'}"
        )
    _LOADED[key] = fn
    return fn


def _describe(fn, name: str, file: Path) -> str:
    try:
        line = inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        line = getattr(getattr(fn, "__code__", None), "co_firstlineno", "?")
    try:
        sig = str(inspect.signature(fn))
    except (TypeError, ValueError):
        sig = "(...)"
    return f"{name}{sig} at {file}:{line}"


def _call_style(fn, *, batch: bool, reward_kwargs: dict) -> tuple[str, bool, str | None]:
    """``(style, pass_extra_info, problem)`` from ``fn``'s signature; ``problem`` says why it cannot be used."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: trust it takes verl's keywords
        return ("batch" if batch else "verl"), True, None
    kinds = inspect.Parameter
    var_kw = any(p.kind is kinds.VAR_KEYWORD for p in params.values())
    named = {k for k, p in params.items() if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    positional = [k for k, p in params.items() if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind is kinds.VAR_POSITIONAL for p in params.values())
    if batch:
        missing = [a for a in BATCH_ARGS if a not in named and not var_kw]
        if missing:
            return "batch", True, f"it has no parameter {', '.join(missing)}; {_EXPECTED_BATCH}"
        style, supplied, extra_info = "batch", set(BATCH_ARGS), True
    elif var_kw or all(a in named for a in VERL_ARGS[:3]):
        extra_info = var_kw or "extra_info" in named
        style, supplied = "verl", set(VERL_ARGS[:3]) | ({"extra_info"} if extra_info else set())
    elif "data_source" not in named and (len(positional) >= 2 or var_pos):
        extra_info = "extra_info" in named and "extra_info" not in positional[:2]
        style, supplied = "scorer", set(positional[:2]) | ({"extra_info"} if extra_info else set())
    else:
        return "verl", False, _EXPECTED
    taken = set(VERL_ARGS) | set(BATCH_ARGS) | supplied
    for key in reward_kwargs:
        if key in taken:
            return style, extra_info, f"reward_kwargs key {key!r} would replace an argument the trainer passes"
        if key not in named and not var_kw:
            return style, extra_info, (
                f"reward_kwargs key {key!r} is not one of its parameters and it takes no **kwargs"
            )
    for k, p in params.items():
        if p.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD) or p.default is not kinds.empty:
            continue
        if k not in supplied and k not in reward_kwargs:
            return style, extra_info, (
                f"its parameter {k!r} has no default and no argument is passed for it; "
                + (_EXPECTED_BATCH if batch else _EXPECTED)
            )
    return style, extra_info, None


class CustomRewardFn:
    """A picklable handle on a custom reward function: the file is imported lazily in each process.

    Call it as the reward manager does: ``fn(data_source=..., solution_str=..., ground_truth=...,
    extra_info=...)`` (styles ``"verl"`` / ``"scorer"``) or ``fn(data_sources=..., solution_strs=...,
    ground_truths=..., extra_infos=...)`` (style ``"batch"``); it forwards in the function's own style,
    adding :attr:`reward_kwargs`. Returns what the function returns (a coroutine is run to completion).

    Attributes:
        path: the resolved ``.py`` file.
        name: the function's name in it.
        style: ``"verl"``, ``"scorer"`` or ``"batch"`` (see the module docstring).
        pass_extra_info: whether ``extra_info`` (``extra_infos``) is passed.
        reward_kwargs: extra keyword arguments for every call.
    """

    def __init__(self, path: str, name: str, style: str, pass_extra_info: bool, reward_kwargs: dict | None = None):
        if style not in STYLES:
            raise ValueError(f"style={style!r} is not valid; use one of {STYLES}")
        self.path, self.name, self.style = str(path), name, style
        self.pass_extra_info = pass_extra_info
        self.reward_kwargs = dict(reward_kwargs or {})

    def prepare(self):
        """Import the file now (scoring processes call this once at start, outside any call's timeout)."""
        return _function(Path(self.path), self.name)

    def __call__(self, **kw):
        fn = self.prepare()
        if self.style == "batch":
            args = {k: kw[k] for k in BATCH_ARGS[:3]}
            if self.pass_extra_info:
                args["extra_infos"] = kw.get("extra_infos")
            out = fn(**args, **self.reward_kwargs)
        elif self.style == "verl":
            args = {k: kw[k] for k in VERL_ARGS[:3]}
            if self.pass_extra_info:
                args["extra_info"] = kw.get("extra_info")
            out = fn(**args, **self.reward_kwargs)
        else:
            extra = {"extra_info": kw.get("extra_info")} if self.pass_extra_info else {}
            out = fn(kw["solution_str"], kw["ground_truth"], **extra, **self.reward_kwargs)
        if inspect.isawaitable(out):
            out = asyncio.run(_await(out))
        return out

    def __repr__(self) -> str:
        return f"CustomRewardFn({self.path!r}, {self.name!r}, style={self.style!r})"


async def _await(awaitable):
    return await awaitable


def load_custom_reward_fn(
    path: str, name: str = "compute_score", *, reward_kwargs: dict | None = None, batch: bool = False
) -> CustomRewardFn:
    """Import the file at ``path``, check its function ``name`` can be called, and return a handle on it.

    Args:
        path: a ``.py`` file; ``~`` and ``${JAXRL_SHARED}`` are expanded.
        name: the function's name in that file (``custom_reward_function.name``).
        reward_kwargs: keyword arguments added to every call (``custom_reward_function.reward_kwargs``, and
            for the batch manager also ``reward_model.reward_kwargs``).
        batch: the function takes whole lists (``reward_model.reward_manager=batch``).

    Returns:
        A picklable :class:`CustomRewardFn` (scoring processes re-import the file themselves).

    Raises:
        FileNotFoundError: ``path`` does not exist (names the resolved path).
        CustomRewardError: a syntax error (file and line), an exception while importing the file (file, line,
            exception), no callable ``name`` (lists the file's functions), or a signature that cannot take the
            arguments (names the signature and what is expected) -- always one line.
    """
    reward_kwargs = dict(reward_kwargs or {})
    file = Path(expand_shared(str(path))).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"custom reward function file {str(file)!r} does not exist (from path={path!r})")
    _LOADED.pop((str(file), name), None)  # (re)load: the file may have changed since an earlier run
    fn = _function(file, name)
    style, pass_extra_info, problem = _call_style(fn, batch=batch, reward_kwargs=reward_kwargs)
    if problem is not None:
        raise CustomRewardError(
            f"custom reward function {_describe(fn, name, file)} cannot be used: {problem}"
        )
    if style == "scorer":
        params = list(inspect.signature(fn).parameters)
        logger.info(
            "custom reward %s has verl's scorer-file signature: calling it as %s(solution_str, ground_truth%s%s) "
            "(its parameters %s take the response and the ground truth; data_source is not passed)",
            _describe(fn, name, file), name, ", extra_info=..." if pass_extra_info else "",
            "".join(f", {k}=..." for k in reward_kwargs), params[:2],
        )
    return CustomRewardFn(str(file), name, style, pass_extra_info, reward_kwargs)
