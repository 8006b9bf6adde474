"""bench/common.py's timing helper: one warm-up call, then the timed ones, each timed on its own."""

from __future__ import annotations

import time

from bench.common import timed_calls


def test_timed_calls_warms_up_once_then_times_each_call():
    calls = []

    def fn():
        calls.append(len(calls))
        time.sleep(0.3 if len(calls) == 1 else 0.01)  # the warm-up is the slow one

    warm, times = timed_calls(fn, 3)
    assert calls == [0, 1, 2, 3]
    assert len(times) == 3 and warm >= 0.3
    assert all(0.01 <= t < 0.3 for t in times), times
