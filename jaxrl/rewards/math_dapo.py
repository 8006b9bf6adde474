"""DAPO math reward: the last ``Answer: ...`` line of a response against the reference, compared after the
Minerva answer normalisation (verl ``verl/utils/reward_score/math_dapo.py`` semantics; DAPO's training data
``math_dapo`` and the AIME evaluation sets use it).

Reference: Lewkowycz et al., "Solving Quantitative Reasoning Problems with Language Models" (Minerva), 2022,
appendix D (the final-answer normalisation); Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System
at Scale", 2025 (the +1 / -1 reward on the ``Answer:`` format).

Scoring: only the last :data:`SOLUTION_CLIP_CHARS` characters are searched; the answer is the rest of the
line after the last ``Answer:`` (case-insensitive), ``"[INVALID]"`` when there is none. Correct -> ``score``
1.0, anything else (wrong, no ``Answer:`` line) -> -1.0.

One difference from verl, accepting the same number written differently: a negative number with proper
thousands separators (``-2,000``, not the list ``-2,2``) loses its commas like a positive one. No jax import.
"""

from __future__ import annotations

import re

SOLUTION_CLIP_CHARS = 300  # verl: the longest MATH-500 answer has 159 characters
STRICT_BOX_CLIP_CHARS = 100
INVALID = "[INVALID]"

ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva normalisation tables (appendix D), applied in this order: first the substitutions ...
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
# ... then these words, units and LaTeX fragments are deleted.
_REMOVED: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
_FIRST_MATH_RE = re.compile(r"(.*?)(\$)(.*?)(\$)(.*)")  # keep the first $...$ span
_WRAPPERS_RE = tuple(re.compile(rf"\\{cmd}\{{(.*?)\}}") for cmd in ("text", "textbf", "overline"))
_BOXED_GREEDY_RE = re.compile(r"\\boxed\{(.*)\}")
_FRAC_SHORT_RE = re.compile(r"frac([^{])(.)")  # \fracab -> \frac{a}{b}
_SQRT_SHORT_RE = re.compile(r"sqrt([^{])")  # \sqrta -> \sqrt{a}
_NEGATIVE_THOUSANDS_RE = re.compile(r"-\d{1,3}(?:,\d{3})+")


def normalize_final_answer(final_answer: str) -> str:
    """Minerva normal form of a final answer.

    Keeps the right-hand side of the last ``=``, applies the substitution and removal tables, keeps the first
    ``$...$`` span, unwraps ``\\text{}``/``\\textbf{}``/``\\overline{}``/``\\boxed{}``, braces shorthand
    ``\\frac``/``\\sqrt`` arguments, drops ``$`` and, in a number, thousands commas; then strips whitespace.

    Examples:
        ``"x = \\$2,000"`` -> ``"2000"``; ``"\\dfrac12"`` -> ``"\\dfrac{1}{2}"``; ``"10 cm"`` -> ``"10"``.
    """
    s = final_answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in _REMOVED:
        s = s.replace(expr, "")
    s = _FIRST_MATH_RE.sub(r"$\3$", s)
    for wrapper in _WRAPPERS_RE:
        s = wrapper.sub(r"\1", s)
    s = _BOXED_GREEDY_RE.sub(r"\1", s)
    s = _FRAC_SHORT_RE.sub(r"frac{\1}{\2}", s)
    s = _SQRT_SHORT_RE.sub(r"sqrt{\1}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit() or _NEGATIVE_THOUSANDS_RE.fullmatch(s):  # verl: "1,2,3" -> "123" too
        s = s.replace(",", "")
    return s.strip()


def extract_answer(solution_str: str) -> str:
    """The text after the last ``Answer:`` in ``solution_str`` (to the line end), or ``"[INVALID]"``."""
    found = ANSWER_RE.findall(solution_str)
    return found[-1] if found else INVALID


def _last_boxed_strict(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (braces matched; ``\\fbox`` and ``\\boxed 5`` not accepted)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for j in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : j]
    return None


def compute_score(solution_str: str, ground_truth, strict_box_verify: bool = False) -> dict:
    """DAPO reward of one response.

    Args:
        solution_str: the decoded response (only its last 300 characters are read).
        ground_truth: the reference answer (``reward_model.ground_truth``); a number is read as its ``str``.
        strict_box_verify: verl's strict mode: the last ``\\boxed{}`` in the last 100 characters must equal
            ``ground_truth`` character for character (no normalisation).

    Returns:
        ``{"score": 1.0 | -1.0, "acc": 1.0 | 0.0, "pred": str | None}``: ``pred`` is the normalised answer
        (``"[INVALID]"`` when there is no ``Answer:`` line; in strict mode the raw box content, None without one).

    Raises:
        ValueError: ``ground_truth`` is None.
    """
    if ground_truth is None:
        raise ValueError("ground_truth is None: the row has no reward_model.ground_truth to compare with")
    gt = str(ground_truth)
    text = solution_str[-SOLUTION_CLIP_CHARS:]
    if strict_box_verify:
        pred = _last_boxed_strict(text[-STRICT_BOX_CLIP_CHARS:])
        correct = pred == gt
    else:
        pred = normalize_final_answer(extract_answer(text))
        correct = pred == normalize_final_answer(gt)
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": pred}
