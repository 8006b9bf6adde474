"""Code rewards: run a response's program against the row's test cases in the sandbox (:mod:`jaxrl.sandbox`).
No jax import.

Two row kinds (dispatched from :func:`jaxrl.rewards.default_compute_score`):

* **test cases** (verl's ``codecontests`` / ``apps`` / ``codeforces`` / ``taco`` rows, MBPP-style rows):
  ``reward_model.ground_truth`` is a dict or its JSON text with ``inputs`` and ``outputs`` (one per case), and
  optionally ``fn_name`` (call-based: each input is the call's arguments, one JSON value per line, and the output
  is the JSON return value; APPS/LeetCode style, a ``Solution`` class method is found too) or ``assert_case`` (one
  Python snippet per case, appended to the program; the case passes when the program then exits 0; Sandbox
  Fusion's MBPP form). Without either, the program reads the input on stdin and its stdout is compared with the
  output: equal after stripping, or line by line after stripping each line and dropping empty ones, or token by
  token with floats equal within ``1e-8 + 1e-5 * |expected|`` (``numpy.allclose``'s default; verl's
  ``prime_code`` checks). Each case is one sandboxed run with ``limits``.
* **HumanEval** (``openai/openai_humaneval``): the ground truth holds the problem's ``prompt``, ``test`` and
  ``entry_point`` (:func:`humaneval_ground_truth`); the program is the prompt + the completion (or, when the
  response defines ``entry_point`` itself, the prompt followed by the response's code) + the test +
  ``check(entry_point)``; 1.0 when it exits 0 within the limits, else 0.0 (HumanEval's ``check_correctness``).

The program of a response is its last fenced code block (```` ```python ```` preferred), or the whole response when
it has none (verl ``prime_code``). Test-case programs get a prelude of standard-library imports (``typing``,
``collections``, ``math``, ``itertools``, ...) before the response's code, as verl's ``prime_code`` does.

Scores (``reward_model.sandbox.score``): ``"fraction"`` (verl's ``default_compute_score``, ``continuous=True``):
the fraction of the first :data:`FRACTION_CASES` cases that pass; ``"all_pass"``: 1.0 when every case passes,
else 0.0 (stops at the first failure). A case that hits a limit fails. A sandbox failure (the sandbox could not
run the program; a Sandbox Fusion server did not answer) raises :class:`CodeSandboxError`, which the reward
manager counts as an error, never as a zero score. When ``budget_s`` is set, the cases of one response share
that much wall time (each case gets ``min(limits.wall_s, what is left)``), so a response of slow programs ends
before the reward manager's ``timeout_s``; cases left when it is spent fail (status ``"budget"``).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

from jaxrl.sandbox import Limits, LocalSandbox, SandboxResult, make_sandbox

CODE_SCORES = ("fraction", "all_pass")
FRACTION_CASES = 10  # verl's continuous score: the first 10 test cases
MIN_CASE_S = 0.5  # a case is not started with less than this much budget left
CALL_MARKER = "__jaxrl_call_result__:"
# verl prime_code's prelude (the same modules; `from builtins import *` last restores what `math` shadows, e.g. pow)
PRELUDE = (
    "import sys, math, re, string, collections, heapq, bisect, itertools, functools, operator, copy, json, random\n"
    "from typing import *\nfrom collections import *\nfrom heapq import *\nfrom bisect import *\n"
    "from itertools import *\nfrom functools import *\nfrom operator import *\nfrom math import *\n"
    "from builtins import *\n"
)
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)


class CodeSandboxError(RuntimeError):
    """The sandbox failed on a response (not the response's fault): the reward call is an error, not a zero."""


@dataclass(frozen=True)
class CodeRewardSettings:
    """How code rows are scored (``reward_model.sandbox.*`` / ``reward_model.sandbox_fusion.*``).

    Attributes:
        sandbox: where programs run (:class:`jaxrl.sandbox.LocalSandbox` or :class:`jaxrl.sandbox.FusionSandbox`).
        limits: one test case's limits.
        score: ``"fraction"`` or ``"all_pass"`` (module docstring).
        budget_s: wall seconds all cases of one response may take together, or None for no budget.
    """

    sandbox: Any = field(default_factory=LocalSandbox)
    limits: Limits = field(default_factory=Limits)
    score: str = "fraction"
    budget_s: float | None = None

    def __post_init__(self):
        if self.score not in CODE_SCORES:
            raise ValueError(f"code score {self.score!r} is not valid; use one of {CODE_SCORES}")
        if self.budget_s is not None and not self.budget_s > 0:
            raise ValueError(f"code budget_s={self.budget_s!r} is not valid; use seconds > 0 or None")


def settings_for(sandbox_fusion_url: str | None = None, memory_limit_mb: int | None = None) -> CodeRewardSettings:
    """Settings from verl's ``default_compute_score`` keywords (a custom reward calling ours the verl way)."""
    limits = Limits(memory_mb=int(memory_limit_mb)) if memory_limit_mb else Limits()
    return CodeRewardSettings(sandbox=make_sandbox(fusion_url=sandbox_fusion_url), limits=limits)


# ------------------------------------------------------------------------------------------------ programs
def extract_code(response: str) -> str:
    """The program in a response: its last ```` ```python ```` block, else its last fenced block, else all of it."""
    blocks = _FENCE.findall(response)
    py = [body for lang, body in blocks if lang.strip().lower() in ("python", "py", "python3")]
    if py:
        return py[-1]
    if blocks:
        return blocks[-1][1]
    return response


@dataclass(frozen=True)
class TestCases:
    """A row's test cases (``[n]`` each); see the module docstring."""

    inputs: list
    outputs: list
    fn_name: str | None = None
    assert_cases: list[str] | None = None


def parse_test_cases(ground_truth) -> TestCases:
    """The test cases of ``reward_model.ground_truth`` (a dict or its JSON text).

    Raises:
        ValueError: not a dict / JSON object, no ``inputs`` + ``outputs`` (nor ``assert_case``), lists of different
            lengths, or no case at all (the message names what is wrong; a data error, never a zero score).
    """
    gt = ground_truth
    if isinstance(gt, (str, bytes)):
        try:
            gt = json.loads(gt)
        except ValueError as e:
            raise ValueError(f"code ground_truth is not JSON ({e}); expected {{'inputs': [...], 'outputs': [...]}}")
    if not isinstance(gt, dict):
        raise ValueError(f"code ground_truth must be a dict with inputs/outputs, got {type(gt).__name__}")
    asserts = gt.get("assert_case")
    if asserts is not None:
        if not isinstance(asserts, list) or not all(isinstance(a, str) for a in asserts):
            raise ValueError("code ground_truth assert_case must be a list of Python snippets")
        inputs = list(gt.get("inputs") or [""] * len(asserts))
        outputs = list(gt.get("outputs") or [None] * len(asserts))
    else:
        if "inputs" not in gt or "outputs" not in gt:
            raise ValueError(f"code ground_truth needs 'inputs' and 'outputs' (or 'assert_case'); keys: {sorted(gt)}")
        inputs, outputs = list(gt["inputs"]), list(gt["outputs"])
    n = len(asserts) if asserts is not None else len(inputs)
    if len(inputs) != n or len(outputs) != n:
        raise ValueError(f"code ground_truth has {len(inputs)} inputs, {len(outputs)} outputs"
                         + (f" and {len(asserts)} assert cases" if asserts is not None else "") + "; they must match")
    if n == 0:
        raise ValueError("code ground_truth has no test case")
    fn_name = gt.get("fn_name") or None
    return TestCases(inputs=inputs, outputs=outputs, fn_name=fn_name, assert_cases=asserts)


def call_harness(fn_name: str) -> str:
    """Code appended to a call-based program: read the arguments (one JSON value per stdin line), call
    ``fn_name`` (a function, or a method of a ``Solution`` instance), print :data:`CALL_MARKER` + the JSON result."""
    return (
        "\n\ndef __jaxrl_call():\n"
        "    import json as _json, sys as _sys\n"
        "    _args = [_json.loads(_l) for _l in _sys.stdin.read().split('\\n') if _l.strip()]\n"
        f"    _fn = globals().get({fn_name!r})\n"
        "    if _fn is None and 'Solution' in globals():\n"
        f"        _fn = getattr(globals()['Solution'](), {fn_name!r})\n"
        "    if _fn is None:\n"
        f"        raise NameError({fn_name!r} + ' is not defined')\n"
        "    _out = _fn(*_args)\n"
        f"    _sys.stdout.write('\\n' + {CALL_MARKER!r} + _json.dumps(_out) + '\\n')\n"
        "\n__jaxrl_call()\n"
    )


def _as_stdin(value, call_based: bool) -> str:
    if value is None:
        return ""
    if call_based and isinstance(value, list):  # raw APPS: the argument list itself
        return "\n".join(json.dumps(v) for v in value)
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


def _is_float(s: str) -> bool:
    try:
        return math.isfinite(float(s))
    except ValueError:
        return False


def outputs_match(actual: str, expected) -> bool:
    """A program's stdout against a case's expected output (module docstring: stripped, line-wise, token-wise with
    float tolerance). ``expected`` may be a list of lines."""
    if isinstance(expected, list):
        expected = "\n".join(str(e) for e in expected)
    expected = str(expected)
    if actual.strip() == expected.strip():
        return True
    lines = [ln.strip() for ln in actual.splitlines() if ln.strip()]
    want = [ln.strip() for ln in expected.splitlines() if ln.strip()]
    if lines == want:
        return True
    got, ref = actual.split(), expected.split()
    if len(got) != len(ref) or not got:
        return False
    for g, r in zip(got, ref):
        if g == r:
            continue
        if not (_is_float(g) and _is_float(r)) or abs(float(g) - float(r)) > 1e-8 + 1e-5 * abs(float(r)):
            return False
    return True


def _call_result_matches(stdout: str, expected) -> bool:
    marks = [ln for ln in stdout.splitlines() if ln.startswith(CALL_MARKER)]
    if not marks:
        return False
    try:
        got = json.loads(marks[-1][len(CALL_MARKER):])
    except ValueError:  # the program printed a marker line of its own
        return False
    if isinstance(expected, str):
        try:
            expected = json.loads(expected)
        except ValueError:
            pass
    expected = json.loads(json.dumps(expected))  # tuples -> lists, as the result went through JSON
    return got == expected or (isinstance(expected, list) and len(expected) > 0 and got == expected[0])


# ------------------------------------------------------------------------------------------------ scoring
@dataclass
class CaseResult:
    """One test case: ``passed``, and ``status`` (``"passed"``, ``"wrong_answer"``, ``"runtime_error"``,
    ``"limit:<name>"`` or ``"budget"``)."""

    passed: bool
    status: str


def _run(settings: CodeRewardSettings, code: str, stdin: str, wall_s: float) -> SandboxResult:
    limits = settings.limits if wall_s >= settings.limits.wall_s else replace(settings.limits, wall_s=wall_s)
    res = settings.sandbox.run_code(code, stdin, limits)
    if res.error is not None:
        raise CodeSandboxError(f"the sandbox ({res.backend}) could not run a test: {res.error}")
    return res


def _verdict(res: SandboxResult, ok: bool) -> CaseResult:
    if res.limit is not None:
        return CaseResult(False, f"limit:{res.limit}")
    if res.exit_code != 0:
        return CaseResult(False, "runtime_error")
    return CaseResult(ok, "passed" if ok else "wrong_answer")


def run_test_cases(solution: str, cases: TestCases, settings: CodeRewardSettings, *, count: int | None = None,
                   stop_at_failure: bool = False) -> list[CaseResult]:
    """Run the first ``count`` cases (all when None) of ``cases`` on ``solution``, one sandboxed run each.

    Raises:
        CodeSandboxError: the sandbox could not run a case.
    """
    n = len(cases.inputs) if count is None else min(count, len(cases.inputs))
    t0 = time.monotonic()
    call = cases.fn_name is not None and cases.assert_cases is None
    program = PRELUDE + solution + (call_harness(cases.fn_name) if call else "")
    results: list[CaseResult] = []
    for i in range(n):
        wall = settings.limits.wall_s
        if settings.budget_s is not None:
            wall = min(wall, settings.budget_s - (time.monotonic() - t0))
            if wall < MIN_CASE_S:
                results += [CaseResult(False, "budget")] * (n - i)
                break
        stdin = _as_stdin(cases.inputs[i], call)
        expected = cases.outputs[i]
        if cases.assert_cases is not None:
            res = _run(settings, program + "\n\n" + cases.assert_cases[i] + "\n", stdin, wall)
            verdict = _verdict(res, expected is None or outputs_match(res.stdout, expected))
        elif call:
            res = _run(settings, program, stdin, wall)
            verdict = _verdict(res, res.exit_code == 0 and _call_result_matches(res.stdout, expected))
        else:
            res = _run(settings, program, stdin, wall)
            verdict = _verdict(res, outputs_match(res.stdout, expected))
        results.append(verdict)
        if stop_at_failure and not verdict.passed:
            break
    return results


def compute_score(solution_str: str, ground_truth, settings: CodeRewardSettings | None = None) -> dict:
    """Score a response on a test-case row (module docstring).

    Args:
        solution_str: the decoded response.
        ground_truth: the row's ``reward_model.ground_truth`` (dict or JSON text).
        settings: sandbox, limits, score mode, budget (default: local bubblewrap, default limits, ``"fraction"``).

    Returns:
        ``{"score": float in [0, 1], "acc": 1.0 if every case run passed else 0.0, "passed": int, "total": int}``
        (``total`` = the cases that count: the first :data:`FRACTION_CASES` for ``"fraction"``).

    Raises:
        ValueError: a malformed ground truth (:func:`parse_test_cases`).
        CodeSandboxError: the sandbox could not run a case.
        jaxrl.sandbox.SandboxUnavailableError: no working bubblewrap here.
    """
    settings = settings or CodeRewardSettings()
    cases = parse_test_cases(ground_truth)
    solution = extract_code(solution_str)
    if settings.score == "fraction":
        total = min(FRACTION_CASES, len(cases.inputs))
        results = run_test_cases(solution, cases, settings, count=total)
        passed = sum(r.passed for r in results)
        score = passed / total
    else:
        total = len(cases.inputs)
        results = run_test_cases(solution, cases, settings, stop_at_failure=True)
        passed = sum(r.passed for r in results)
        score = float(passed == total)
    return {"score": float(score), "acc": float(passed == total), "passed": passed, "total": total}


# ------------------------------------------------------------------------------------------------ HumanEval
def humaneval_ground_truth(problem: dict) -> str:
    """The ``reward_model.ground_truth`` of a HumanEval problem (JSON text: ``prompt``, ``test``, ``entry_point``)."""
    return json.dumps({k: problem[k] for k in ("prompt", "test", "entry_point")})


def humaneval_program(response: str, problem: dict) -> str:
    """The program HumanEval runs for a response: ``prompt + completion + test + check(entry_point)``.

    The completion is the response's code (:func:`extract_code`). When that code defines ``entry_point`` at the top
    level it is a whole function: it follows the prompt on a new line (the prompt's own stub, a ``def`` with its
    docstring, is valid Python and is replaced); otherwise it continues the prompt (the function's body).
    """
    code = extract_code(response)
    whole = re.search(rf"^(async\s+)?def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE)
    body = ("\n" + code) if whole else code
    return f"{problem['prompt']}{body}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def compute_humaneval_score(solution_str: str, ground_truth, settings: CodeRewardSettings | None = None) -> dict:
    """Score a response to a HumanEval problem: 1.0 when its program (:func:`humaneval_program`) passes the tests.

    Returns:
        ``{"score": 1.0 | 0.0, "acc": same, "status": SandboxResult.status}``.

    Raises:
        ValueError: the ground truth lacks ``prompt`` / ``test`` / ``entry_point``.
        CodeSandboxError: the sandbox could not run the program.
    """
    settings = settings or CodeRewardSettings()
    problem = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if not isinstance(problem, dict) or not all(isinstance(problem.get(k), str) for k in ("prompt", "test",
                                                                                          "entry_point")):
        raise ValueError("HumanEval ground_truth must hold 'prompt', 'test' and 'entry_point' strings "
                         "(python -m jaxrl.data.prepare humaneval writes it)")
    wall = settings.limits.wall_s if settings.budget_s is None else min(settings.limits.wall_s, settings.budget_s)
    res = _run(settings, humaneval_program(solution_str, problem), "", wall)
    score = float(res.ok)
    return {"score": score, "acc": score, "status": res.status}
