"""`math_verify(..., timeout=...)` and `call_with_timeout`: a direct call never outlives its budget."""

import os
import subprocess
import sys
import threading
import time

import pytest

from jaxrl.rewards import math_verify
from jaxrl.rewards.timeout import call_with_timeout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reward_fns  # noqa: E402


def _timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def test_main_thread_alarm_stops_a_busy_call_at_the_deadline():
    result, seconds = _timed(call_with_timeout, reward_fns.spin, (30.0,), 0.3, -1.0)
    assert result == -1.0 and 0.25 < seconds < 1.5
    assert call_with_timeout(reward_fns.spin, (0.01,), 2.0, -1.0) == 0.01  # in time: the real result
    result, seconds = _timed(call_with_timeout, reward_fns.spin, (30.0,), 0.2, -1.0)  # the alarm is re-armable
    assert result == -1.0 and seconds < 1.5


def test_other_threads_use_a_killed_process():
    out = {}

    def worker():
        out["hang"] = _timed(call_with_timeout, reward_fns.spin, (30.0,), 1.0, -1.0)
        out["fast"] = call_with_timeout(reward_fns.spin, (0.01,), 20.0, -1.0)
        out["crash"] = call_with_timeout(reward_fns.crash, (0.0,), 20.0, -1.0)
        out["correct"] = math_verify(r"so \boxed{\frac{1}{2}}", "0.5", timeout=20.0)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(120)
    result, seconds = out["hang"]
    assert result == -1.0 and seconds < 30  # start-up (a fresh interpreter) + the 1 s budget
    assert out["fast"] == 0.01 and out["crash"] == -1.0 and out["correct"] == 1.0


@pytest.mark.parametrize("completion, reference, expected", [
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    ("the answer is 1,000", "1000", 1.0),
    (r"\boxed{3}", "4", 0.0),
    ("10**10**10", "1", 0.0),
    ("{" * 10_000 + "1", "1", 1.0),
    ("x" * 1_000_000, "1", 0.0),
    (r"\boxed{\frac{1}{0}}", "1", 0.0),
])
def test_math_verify_with_timeout_agrees_with_the_plain_call_and_stays_in_budget(completion, reference, expected):
    result, seconds = _timed(lambda: math_verify(completion, reference, timeout=2.0))
    assert result == expected == math_verify(completion, reference) and seconds < 2.5


def test_bad_timeout_is_an_error():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        call_with_timeout(reward_fns.spin, (0.0,), 0.0, -1.0)


def test_a_deadline_never_breaks_an_import_in_progress():
    # The first math_verify imports sympy (~1 s): an alarm that interrupted that import left sympy half
    # initialised for the rest of the process, and trigonometric identities then scored 0.
    code = ("import sys; from jaxrl.rewards import math_verify, is_equivalent; "
            "assert 'sympy' not in sys.modules; "
            "first = math_verify(r'\\boxed{\\sqrt{2}\\cdot\\sqrt{2}}', '2', timeout=float(sys.argv[1])); "
            "print(first, is_equivalent(r'\\sin(x)^2+\\cos(x)^2', '1'))")
    for timeout_s in (0.005, 0.03):  # both well inside the import
        out = subprocess.run([sys.executable, "-c", code, str(timeout_s)], capture_output=True, text=True,
                             timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert out.returncode == 0, out.stderr
        first, after = out.stdout.split()
        assert first in ("0.0", "1.0") and after == "True", (timeout_s, out.stdout)
