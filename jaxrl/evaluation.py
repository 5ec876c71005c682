"""Sampled evaluation metrics: pass@k (the unbiased estimator of Chen et al., 2021) and maj@k.

Pure functions over per-problem correctness flags `[problems, n]` and extracted answers; the loop samples
the n completions and scores them (`jaxrl.loop.evaluate_sampled`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np


def pass_at_k(num_samples: int, num_correct: np.ndarray | Sequence[int], k: int) -> np.ndarray:
    """Unbiased pass@k of each problem from `num_correct` correct among `num_samples` samples:
    `1 - C(n - c, k) / C(n, k)`, computed as `1 - prod_{i = n - c + 1}^{n} (1 - k / i)` (no huge binomials).

    Returns `[problems]` float64 in [0, 1]. Raises `ValueError` if `k` is not in [1, n] or a count is outside
    [0, n].
    """
    n = int(num_samples)
    correct = np.asarray(num_correct, dtype=np.int64)
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n; got k={k}, n={n} samples per problem")
    if correct.size and (correct.min() < 0 or correct.max() > n):
        raise ValueError(f"correct counts must lie in [0, {n}], got {correct.min()}..{correct.max()}")
    out = np.empty(correct.shape, np.float64)
    for index, c in np.ndenumerate(correct):
        if n - c < k:  # every draw of k samples holds a correct one
            out[index] = 1.0
        else:
            out[index] = 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64))
    return out


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Whether the most common answer among `answers` (None: no answer, never a vote) is a correct one.
    Ties go to the answer seen first; no answer at all is wrong."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)
    return any(ok for a, ok in zip(answers, correct) if a == winner)


def sampled_metrics(correct: np.ndarray, ks: Sequence[int], answers: Sequence[Sequence[str | None]] | None = None,
                    prefix: str = "eval/") -> dict[str, float]:
    """`{prefix}pass@k` (mean over problems) for each k in `ks` from `correct [problems, n]` bool, and
    `{prefix}maj@k` (majority vote over the first k samples) when `answers [problems][n]` are given."""
    correct = np.asarray(correct, bool)
    problems, n = correct.shape
    metrics = {f"{prefix}pass@{k}": float(pass_at_k(n, correct.sum(1), k).mean()) for k in ks}
    if answers is not None:
        if len(answers) != problems or any(len(a) != n for a in answers):
            raise ValueError(f"answers must be [{problems}][{n}] like the correctness flags")
        for k in ks:
            votes = [majority_correct(answers[p][:k], correct[p, :k]) for p in range(problems)]
            metrics[f"{prefix}maj@{k}"] = float(np.mean(votes))
    return metrics
