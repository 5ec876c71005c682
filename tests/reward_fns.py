"""Module-level reward functions for the RewardPool tests.

Spawned workers import these by name, so they must live in an importable
module (tests/ is put on sys.path by pytest and by test_rewards.py, and the
parent's sys.path is passed on to spawned children).
"""

import os
import time


def exact_match(completion: str, reference: str) -> float:
    """1.0 when the stripped strings match."""
    return float(completion.strip() == reference.strip())


def chaos(completion: str, reference: str):
    """Misbehaves on command: "raise", "hang", "exit", "nan", "str", "huge", else exact match."""
    if completion == "raise":
        raise ValueError("boom")
    if completion == "hang":
        while True:
            time.sleep(1.0)
    if completion == "exit":
        os._exit(1)
    if completion == "nan":
        return float("nan")
    if completion == "str":
        return "1.0"
    if completion == "huge":
        return 1e300  # finite, but inf in float32
    return exact_match(completion, reference)


def flaky_arithmetic(completion: str, reference: str) -> float:
    """The default task's reward, except that every third call in a worker raises and every fifth hangs."""
    global _calls
    _calls += 1
    if _calls % 5 == 0:
        while True:
            time.sleep(1.0)
    if _calls % 3 == 0:
        raise RuntimeError("a reward function bug")
    from jaxrl.rewards import arithmetic_reward

    return arithmetic_reward(completion, reference)


_calls = 0


def numpy_match(completion: str, reference: str):
    """Exact match as numpy computes it: an ``np.bool_``, which is no ``numbers.Real``."""
    import numpy as np

    return np.asarray(completion.strip()) == reference.strip()


def length_parity(completion: str, reference: str) -> float:
    """1.0 for completions of even length: a reward with variance inside every group of samples, so that
    smoke tests see non-zero advantages even from an untrained policy."""
    return float(len(completion) % 2 == 0)


def spin(seconds: float) -> float:
    """Busy Python loop for `seconds` (interruptible by a signal), then returns `seconds`."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return seconds


def crash(_: float) -> float:
    """Kills its own process without answering."""
    os._exit(3)


def quarter(completion: str, reference: str) -> float:
    """0.25 for every completion: a reward no built-in function gives, to see which one a run used."""
    return 0.25


def fails_on_odd_length(completion: str, reference: str) -> float:
    """Raises for a completion of odd length (a deterministic reward error), else 1.0."""
    if len(completion) % 2:
        raise ValueError("odd length")
    return 1.0


_warmed_up = False


def _slow_warm_up() -> None:
    global _warmed_up
    time.sleep(1.0)  # longer than the tests' per-item timeout
    _warmed_up = True


def needs_warm_up(completion: str, reference: str) -> float:
    """Exact match, but 0.0 in a process where its (slow) `warm_up` has not run."""
    return exact_match(completion, reference) if _warmed_up else 0.0


needs_warm_up.warm_up = _slow_warm_up


def _failing_warm_up() -> None:
    raise ImportError("a dependency of the reward function is missing")


def broken_dependency(completion: str, reference: str) -> float:
    return 1.0


broken_dependency.warm_up = _failing_warm_up
