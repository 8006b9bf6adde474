"""MATH rule reward: the last ``\\boxed{}`` of a response against the reference answer, compared after the
Hendrycks-MATH string normalisation (verl ``verl/utils/reward_score/math_reward.py`` semantics).

Reference: Hendrycks et al., "Measuring Mathematical Problem Solving With the MATH Dataset", NeurIPS 2021
(``is_equiv`` / ``strip_string`` in the dataset's release, also used by lm-evaluation-harness and verl).

The normalisation (:func:`normalize_answer`) removes layout-only LaTeX (``\\left``/``\\right``, ``\\!``,
spaces, line breaks, ``^\\circ``, ``\\$``, ``\\%``, trailing units after ``\\text{ ``), writes
``\\dfrac``/``\\tfrac`` as ``\\frac``, braces shorthand arguments (``\\frac12`` -> ``\\frac{1}{2}``,
``\\sqrt3`` -> ``\\sqrt{3}``), turns ``a/b`` of two integers and ``0.5`` into ``\\frac``, adds the leading 0 to
``.5`` and drops a short equation prefix (``k = 5`` -> ``5``). Two answers are equal when their normalised
strings are equal.

Differences from verl, all in the direction of accepting the same answer written differently (and none
accepting a different answer):

* ``\\fbox{...}`` is read like ``\\boxed{...}`` (verl finds it but then always scores 0), and the last box of
  either kind wins; ``\\boxed {5}`` is ``\\boxed{5}``; ``\\boxed 5`` stops at ``$`` or the end of the line;
* thousands separators in a whole number are dropped (``2,000``, ``2{,}000``, ``2,\\!000`` == ``2000``);
  lists such as ``1,-2`` or ``3, 5, 7`` keep their commas;
* a bare ``%`` is dropped like ``\\%``; ``-1/2`` and ``\\frac{-1}{2}`` are written ``-\\frac{1}{2}``;
* two plain decimal numbers are compared as numbers (``2.50`` == ``2.5``);
* ``\\sqrt 3`` (with a space) is ``\\sqrt{3}``;
* the normalisation never raises, so no answer is compared unnormalised (verl compares the raw strings when
  its normalisation fails, e.g. on two ``\\text{ `` or a trailing ``\\sqrt``; here two ``\\text{ `` are
  kept uncut).

No jax import.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

BOX_COMMANDS = ("\\boxed", "\\fbox")

_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL_RE = re.compile(r"-?(?:\d+\.?\d*|\.\d+)")
_INT_SLASH_INT_RE = re.compile(r"(-?)(\d+)/(\d+)")
_NEG_FRAC_RE = re.compile(r"\\frac\{-([^{}]+)\}\{([^{}]+)\}")


def _braced(text: str, open_idx: int) -> tuple[str, int] | None:
    """``(content, index after the closing brace)`` of the brace group opening at ``text[open_idx] == "{"``."""
    depth = 0
    for j in range(open_idx, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[open_idx + 1 : j], j + 1
    return None


def last_boxed_only(text: str) -> str | None:
    """The answer in the last ``\\boxed{...}`` / ``\\fbox{...}`` of ``text`` (nested braces matched), or None.

    ``\\boxed 5$`` (no braces, the MATH solutions' short form) gives the text up to the next ``$`` or line end.
    An unclosed ``\\boxed{`` or an empty box gives None.

    Examples:
        ``"so \\boxed{\\frac{1}{2}}."`` -> ``"\\frac{1}{2}"``; ``"$\\boxed 5$"`` -> ``"5"``; ``"\\boxed{3"`` -> None.
    """
    start, cmd = max((text.rfind(c), c) for c in BOX_COMMANDS)
    if start < 0:
        return None
    i = start + len(cmd)
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        found = _braced(text, i)
        if found is None:
            return None
        content = found[0].strip()
    elif i > start + len(cmd):  # "\boxed 5$": up to "$" or the end of the line
        content = re.split(r"[$\n]", text[i:], maxsplit=1)[0].strip()
    else:
        return None
    return content or None


def _strip_units(s: str) -> str:
    """Cut a unit suffix: everything from ``\\text{ `` (with its space) on, when it occurs exactly once."""
    parts = s.split("\\text{ ")
    return parts[0] if len(parts) == 2 else s


def _brace_sqrt_args(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}`` (a one-character argument)."""
    parts = s.split("\\sqrt")
    out = [parts[0]]
    for seg in parts[1:]:
        out.append(seg if not seg or seg[0] == "{" else "{" + seg[0] + "}" + seg[1:])
    return "\\sqrt".join(out)


def _brace_frac_args(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}`` (one-character arguments)."""
    parts = s.split("\\frac")
    out = [parts[0]]
    for seg in parts[1:]:
        if seg.startswith("{"):
            out.append(seg)
        elif len(seg) < 2:
            return s
        elif seg[1] == "{":
            out.append("{" + seg[0] + "}" + seg[1:])
        else:
            out.append("{" + seg[0] + "}{" + seg[1] + "}" + seg[2:])
    return "\\frac".join(out)


def _slash_to_frac(s: str) -> str:
    """``a/b`` of two integers written canonically (no leading zeros) -> ``\\frac{a}{b}`` (sign in front)."""
    m = _INT_SLASH_INT_RE.fullmatch(s)
    if m is None or any(str(int(g)) != g for g in m.groups()[1:]):
        return s
    return f"{m.group(1)}\\frac{{{m.group(2)}}}{{{m.group(3)}}}"


def normalize_answer(answer: str) -> str:
    """Hendrycks-MATH normal form of an answer string (see the module docstring for every rule).

    Args:
        answer: a final answer, e.g. the content of a ``\\boxed{}``.

    Returns:
        The normalised string, e.g. ``"\\dfrac{1}{2}"`` -> ``"\\frac{1}{2}"``, ``"10\\text{ cm}"`` -> ``"10"``,
        ``"2,\\!000"`` -> ``"2000"``, ``"x = 3"`` -> ``"3"``, ``"1/2"`` -> ``"\\frac{1}{2}"``.
    """
    s = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = _strip_units(s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace("{,}", ",")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    lhs_rhs = s.split("=")
    if len(lhs_rhs) == 2 and len(lhs_rhs[0]) <= 2:  # "k = 5" -> "5"
        s = lhs_rhs[1]
    s = s.replace(" ", "")
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    s = _brace_sqrt_args(s)
    s = _brace_frac_args(s)
    s = _NEG_FRAC_RE.sub(lambda m: f"-\\frac{{{m.group(1)}}}{{{m.group(2)}}}", s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def is_equiv(answer: str, ground_truth: str) -> bool:
    """True if the two answers are equal after :func:`normalize_answer` (plain numbers: equal as decimals)."""
    a, g = normalize_answer(answer), normalize_answer(ground_truth)
    if a == g:
        return True
    if _DECIMAL_RE.fullmatch(a) and _DECIMAL_RE.fullmatch(g):
        try:
            return Decimal(a) == Decimal(g)
        except InvalidOperation:
            return False
    return False


def compute_score(solution_str: str, ground_truth) -> dict:
    """MATH reward of one response: 1.0 if its last ``\\boxed{}`` equals ``ground_truth``, else 0.0.

    Args:
        solution_str: the decoded response.
        ground_truth: the reference answer (``reward_model.ground_truth``, e.g. ``"\\frac{14}{3}"``); a number
            is read as its ``str``.

    Returns:
        ``{"score": 1.0 | 0.0, "acc": 1.0 | 0.0, "pred": str}``: ``pred`` is the normalised boxed answer
        (``""`` when the response has no complete box).

    Raises:
        ValueError: ``ground_truth`` is None (a row without an answer cannot be scored).
    """
    if ground_truth is None:
        raise ValueError("ground_truth is None: the row has no reward_model.ground_truth to compare with")
    boxed = last_boxed_only(solution_str)
    if boxed is None:
        return {"score": 0.0, "acc": 0.0, "pred": ""}
    ok = float(is_equiv(boxed, str(ground_truth)))
    return {"score": ok, "acc": ok, "pred": normalize_answer(boxed)}
