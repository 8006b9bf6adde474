"""Symbolic math reward with Hugging Face's Math-Verify library (``pip install 'math-verify[antlr4_13_2]'``):
``\\frac{1}{2}`` == ``0.5``, ``\\sqrt{8}`` == ``2\\sqrt{2}``, ``(3, \\frac{\\pi}{2})`` == ``\\left( 3, ... \\right)``.

Same extraction as verl ``verl/utils/reward_score/math_verify.py``: the reference is parsed as LaTeX inside
``\\boxed{...}``; the response is searched for LaTeX and plain expressions (the last ``\\boxed{}`` first, then
"the answer is ...", then the last number / formula), and the two are compared by ``math_verify.verify``
(string, numeric to 6 places, then sympy simplification; sets, intervals, matrices and equations handled).

Timeouts and errors, never a silent 0 (unlike verl's copy, which catches every exception and scores 0):

* Math-Verify bounds its parse/verify steps with ``signal.alarm``, which only works on the main thread of the
  main interpreter. On the main thread (the reward manager's worker processes call scorers there) this module
  passes ``timeout_s`` to Math-Verify and a timeout raises :class:`TimeoutError`. Elsewhere (a thread), or
  when a ``SIGALRM`` timer is already running (an outer timeout the caller set, e.g. pytest-timeout), it calls
  Math-Verify with its timeouts disabled and relies on the caller's per-call timeout (the reward manager's
  ``reward_model.timeout_s``) to stop a runaway call.
* Math-Verify is called with ``raise_on_error=True``: an exception inside it propagates (the reward manager
  counts it in ``reward/num_errors``). A response with nothing parseable is a wrong answer (0.0), not an error;
  a reference that Math-Verify cannot parse is an error (a data problem).

``math_verify`` is imported on first use (it pulls in sympy). No jax import.
"""

from __future__ import annotations

import signal
import threading

DEFAULT_TIMEOUT_S = 5


def signal_timeouts_usable() -> bool:
    """True if Math-Verify's ``signal.alarm`` timeouts can run here without breaking anything.

    They need the main thread of the main interpreter, and must not replace a ``SIGALRM`` timer the caller
    already armed (``signal.alarm(0)`` at the end of Math-Verify's call would cancel it).
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    return signal.getitimer(signal.ITIMER_REAL)[0] == 0.0


def _import_math_verify():
    try:
        import math_verify
        from math_verify.errors import TimeoutException
    except ImportError as e:
        raise ImportError(
            "reward_model.math_verifier='math_verify' needs the math-verify package: "
            "pip install 'math-verify[antlr4_13_2]'"
        ) from e
    return math_verify, TimeoutException


def compute_score(solution_str: str, ground_truth, timeout_s: int = DEFAULT_TIMEOUT_S) -> dict:
    """1.0 if the response's final answer is mathematically equal to ``ground_truth`` by Math-Verify, else 0.0.

    Args:
        solution_str: the decoded response.
        ground_truth: the reference answer as LaTeX without ``$``/``\\boxed`` (``reward_model.ground_truth``, e.g.
            ``"\\frac{14}{3}"``); a number is read as its ``str``.
        timeout_s: Math-Verify's limit in whole seconds for each parse and each comparison, used where its
            ``signal.alarm`` timeouts work (see :func:`signal_timeouts_usable`); elsewhere the caller's timeout
            applies.

    Returns:
        ``{"score": 1.0 | 0.0, "acc": 1.0 | 0.0, "pred": str}``: ``pred`` is the extracted answer as written in
        the response (``""`` when nothing could be extracted).

    Raises:
        ValueError: ``ground_truth`` is None, or Math-Verify cannot parse it.
        TimeoutError: a Math-Verify step ran longer than ``timeout_s``.
        ImportError: math-verify is not installed (names the pip command).
        Exception: whatever Math-Verify raises.
    """
    if ground_truth is None:
        raise ValueError("ground_truth is None: the row has no reward_model.ground_truth to compare with")
    mv, timeout_exc = _import_math_verify()
    limit = int(timeout_s) if signal_timeouts_usable() else None
    gold_cfg = (mv.LatexExtractionConfig(),)
    pred_cfg = (mv.ExprExtractionConfig(), mv.LatexExtractionConfig())
    try:
        gold = mv.parse("\\boxed{" + str(ground_truth) + "}", gold_cfg, parsing_timeout=limit, raise_on_error=True)
        if not gold:
            raise ValueError(f"math-verify cannot parse the ground truth {str(ground_truth)!r}")
        pred = mv.parse(solution_str, pred_cfg, parsing_timeout=limit, raise_on_error=True)
        ok = bool(pred) and mv.verify(gold, pred, timeout_seconds=limit, raise_on_error=True)
    except timeout_exc as e:  # a BaseException in math-verify; re-raised as the builtin TimeoutError
        raise TimeoutError(f"math-verify took longer than {limit} s on ground truth {str(ground_truth)!r}") from e
    # parse returns [sympy object, the matched string]; the string is the answer as the response wrote it
    written = next((p for p in reversed(pred) if isinstance(p, str)), "") if pred else ""
    return {"score": float(ok), "acc": float(ok), "pred": written}
