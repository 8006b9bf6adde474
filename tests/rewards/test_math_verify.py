"""Math-Verify scorer (jaxrl.rewards.math_verify, reward_model.math_verifier=math_verify): symbolic equivalence
inside the real reward manager, and never a silent 0 when Math-Verify's signal-based timeouts cannot run."""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
import sys
import textwrap
import threading

import pytest

from jaxrl.rewards import RewardManager, default_compute_score
from jaxrl.rewards import math_verify as mv_reward
from jaxrl.paths import REPO_ROOT

pytest.importorskip("math_verify")

MATH500 = "HuggingFaceH4/MATH-500"
SYMBOLIC = functools.partial(default_compute_score, math_verifier="math_verify")

# (response, ground truth): right only up to symbolic / numeric equivalence
EQUIVALENT = [
    (r"So $\boxed{0.5}$.", r"\frac{1}{2}"),
    (r"So $\boxed{\frac{1}{2}}$.", "0.5"),
    (r"So $\boxed{2\sqrt{2}}$.", r"\sqrt{8}"),
    (r"So $\boxed{\sqrt{8}}$.", r"2\sqrt{2}"),
    (r"So $\boxed{0.50}$.", r"\frac{1}{2}"),
    (r"So $\boxed{\frac{2}{4}}$.", r"\frac{1}{2}"),
    (r"So $\boxed{x^2 + 2x + 1}$.", r"(x+1)^2"),
    (r"The final answer is $\frac{1}{2}$.", "0.5"),  # no box: Math-Verify finds the final LaTeX answer
]
WRONG = [
    (r"So $\boxed{0.51}$.", r"\frac{1}{2}"),
    (r"So $\boxed{3\sqrt{2}}$.", r"\sqrt{8}"),
    (r"So $\boxed{-3}$.", "3"),
    ("I do not know.", "3"),  # nothing parseable: a wrong answer, not an error
]


def _score(manager: RewardManager, pairs):
    return manager.score([MATH500] * len(pairs), [r for r, _ in pairs], [g for _, g in pairs], [None] * len(pairs))


def test_symbolic_equivalence_scores_one_inside_the_reward_manager():
    fn = pickle.loads(pickle.dumps(SYMBOLIC))  # what a process-based manager sends to its workers
    out = _score(RewardManager(fn, timeout_s=60, num_workers=2), EQUIVALENT + WRONG)
    assert out.num_errors == 0 and out.num_timeouts == 0, out.first_error
    assert out.scores.tolist() == [1.0] * len(EQUIVALENT) + [0.0] * len(WRONG)
    assert out.extra["acc"] == [1.0] * len(EQUIVALENT) + [0.0] * len(WRONG)
    assert out.extra["pred"][2] == r"2\sqrt{2}"


def test_rule_verifier_does_not_see_these_equivalences():
    """The cases above need Math-Verify: the string-normalising rule scorer misses them."""
    out = _score(RewardManager(default_compute_score, timeout_s=60, num_workers=1), EQUIVALENT[2:])
    assert out.scores.tolist() == [0.0] * len(EQUIVALENT[2:])


def test_right_answer_scores_one_off_the_main_thread():
    """verl's math_verify scorer returns 0 here (signal.alarm raises off the main thread and it swallows that)."""
    result = {}

    def run():
        result["usable"] = mv_reward.signal_timeouts_usable()
        result["out"] = mv_reward.compute_score(r"$\boxed{2\sqrt{2}}$", r"\sqrt{8}")

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert result == {"usable": False, "out": {"score": 1.0, "acc": 1.0, "pred": r"2\sqrt{2}"}}


def test_unparseable_ground_truth_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        mv_reward.compute_score(r"\boxed{1}", "")
    out = _score(RewardManager(SYMBOLIC, timeout_s=60, num_workers=1), [(r"\boxed{1}", ""), (r"\boxed{1}", "1")])
    assert out.num_errors == 1 and "cannot parse the ground truth" in out.first_error
    assert out.scores.tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="ground_truth is None"):
        mv_reward.compute_score(r"\boxed{1}", None)


def test_bad_math_verifier_value():
    with pytest.raises(ValueError, match=r"math_verifier='sympy'.*'rule', 'math_verify'"):
        default_compute_score(MATH500, r"\boxed{1}", "1", math_verifier="sympy")


def test_main_thread_uses_math_verify_timeouts_and_keeps_an_outer_timer():
    """In a fresh process (no pytest-timeout timer): on the main thread Math-Verify's own timeout is armed and
    a runaway comparison raises TimeoutError (not a 0); with a SIGALRM timer already armed by the caller,
    Math-Verify's timeouts are left off so that timer survives the call."""
    script = textwrap.dedent(r"""
        import signal, time
        from jaxrl.rewards import math_verify as m
        assert m.signal_timeouts_usable()
        assert m.compute_score(r"$\boxed{2\sqrt{2}}$", r"\sqrt{8}")["score"] == 1.0
        t0 = time.monotonic()
        try:
            m.compute_score(r"$\boxed{2^{2^{2^{2^{2^{100}}}}}}$", "3", timeout_s=1)
        except TimeoutError as e:
            print("TIMEOUT", round(time.monotonic() - t0, 1), e)
        else:
            print("NO TIMEOUT")
        signal.signal(signal.SIGALRM, lambda *a: None)
        signal.setitimer(signal.ITIMER_REAL, 100.0)
        assert not m.signal_timeouts_usable()
        assert m.compute_score(r"$\boxed{0.5}$", r"\frac{1}{2}")["score"] == 1.0
        print("OUTER TIMER LEFT", signal.getitimer(signal.ITIMER_REAL)[0] > 90)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("TIMEOUT") and "longer than 1 s" in lines[0], proc.stdout
    assert float(lines[0].split()[1]) < 10
    assert lines[1] == "OUTER TIMER LEFT True", proc.stdout
