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


# -- rewards that take other arguments than (completion, reference) --------------------------------------------


def echo_prompt(prompt: str, completion: str) -> float:
    """1.0 when the completion repeats the prompt."""
    return float(completion == prompt)


def completion_length(completion: str) -> float:
    """The completion's length in characters: a reward of the completion alone."""
    return float(len(completion))


def row_bonus(completion: str, row: dict) -> float:
    """The row's `bonus` field, plus 1 when the completion names the row's `answer` field."""
    return float(row["bonus"]) + float(completion == str(row["answer"]))


def every_argument(prompt, completion, reference, row) -> float:
    """1.0 when the prompt + completion spell the reference and the row holds the prompt."""
    return float(prompt + completion == reference and row["question"] == prompt)


def any_argument(**arguments) -> float:
    """How many of the four arguments were passed (a `**kwargs` reward gets all of them)."""
    return float(len(arguments))


def batch_lengths(prompts, completions):
    """Batched: len(prompt) + len(completion) per item, as a numpy array; "hang" in a completion hangs the
    chunk, "raise" raises, "short" returns one value too few, "dict" returns a mapping, "nan" is NaN for that
    item alone and "text" is a string for that item alone."""
    import numpy as np

    if "hang" in completions:
        while True:
            time.sleep(1.0)
    if "raise" in completions:
        raise RuntimeError("the judge is down")
    if "dict" in completions:
        return {c: 1.0 for c in completions}
    values = [float(len(p) + len(c)) for p, c in zip(prompts, completions)]
    if "short" in completions:
        return values[:-1]
    values = [float("nan") if c == "nan" else "text" if c == "text" else v for c, v in zip(completions, values)]
    if any(isinstance(v, str) for v in values):
        return values
    return np.asarray(values, dtype=np.float32)


def batch_rows(completions, rows):
    """Batched: each row's `bonus` field."""
    return [float(row["bonus"]) for row in rows]


class CountingJudge:
    """A stateful batched reward, like a reward model loaded once per worker: its constructor appends its pid to
    the file named by $REWARD_FNS_INSTANCES; each call appends "<pid> <number of chunks this instance scored>" to
    $REWARD_FNS_INSTANCES.calls and scores every completion 1.0 ("hang" hangs)."""

    def __init__(self):
        with open(os.environ["REWARD_FNS_INSTANCES"], "a") as f:
            f.write(f"{os.getpid()}\n")
        self.chunks = 0

    def __call__(self, completions, references):
        self.chunks += 1
        with open(os.environ["REWARD_FNS_INSTANCES"] + ".calls", "a") as f:
            f.write(f"{os.getpid()} {self.chunks}\n")
        if "hang" in completions:
            while True:
                time.sleep(1.0)
        return [1.0] * len(completions)


class BrokenJudge:
    """A reward class whose constructor fails (a missing model file)."""

    def __init__(self):
        raise FileNotFoundError("reward_model.safetensors")

    def __call__(self, completions):
        return [0.0] * len(completions)


def brevity(completion: str) -> float:
    """An extra shaping reward: minus the completion's length in hundreds of characters."""
    return -len(completion) / 100


def batch_seconds_left(completions):
    """Batched: the time the pool gives this chunk, as seen from the worker, for each item."""
    from jaxrl.rewards import item_deadline

    return [item_deadline() - time.monotonic()] * len(completions)


class ByteModel:
    """A tiny stateful reward model, loaded once per worker: a linear score of each completion's byte histogram,
    with weights drawn from a fixed seed in the constructor (where a real one would read its checkpoint)."""

    def __init__(self):
        import numpy as np

        self.weights = np.random.default_rng(0).normal(size=256).astype(np.float32)  # [256]

    def __call__(self, completions):
        """completions: B strings -> [B] float32 scores."""
        import numpy as np

        features = np.zeros((len(completions), 256), np.float32)  # [B, 256] byte frequencies
        for i, text in enumerate(completions):
            data = np.frombuffer(text.encode(), np.uint8)
            features[i] = np.bincount(data, minlength=256) / max(len(data), 1)
        return features @ self.weights


def prompt_is_question(prompt: str, completion: str, row: dict) -> float:
    """1.0 when the prompt is the row's `question` field (whatever the completion): a reward that sees its own
    row, and no other."""
    return float(prompt == row["question"])


def row_level(completion: str, row: dict) -> float:
    """The row's `level` field (whatever the completion): a per-item reward of the data row."""
    return float(row["level"])


def length_parity_answers(completion: str, reference: str) -> float:
    """`length_parity`, registered (below) as a right-or-wrong reward with extractable answers: the smoke
    runs of the presets whose estimators need binary rewards or answer clusters (bnpo, passk, seed_grpo, ...)."""
    return length_parity(completion, reference)


from jaxrl import registry  # noqa: E402

registry.register("reward", "test_length_parity_answers", binary=True, answers=True)(length_parity_answers)
