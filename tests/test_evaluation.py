"""pass@k and maj@k against hand-computed cases."""

import math
from itertools import combinations

import numpy as np
import pytest

from jaxrl.evaluation import majority_correct, pass_at_k, sampled_metrics


@pytest.mark.parametrize("n,c,k,expected", [
    (1, 1, 1, 1.0), (1, 0, 1, 0.0),
    (4, 1, 1, 0.25),                     # one right in four: pass@1 is the accuracy
    (4, 1, 2, 0.5),                      # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 2, 0.7),                      # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 1 - 21 / 252),            # C(7,5) = 21, C(10,5) = 252
    (8, 0, 8, 0.0), (8, 1, 8, 1.0), (8, 7, 2, 1.0),
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, [c], k)[0] == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_mean_over_all_k_subsets():
    """The estimator equals the share of k-subsets of the n samples that hold a correct one."""
    flags = [True, False, False, True, False, False, False]
    n, c = len(flags), sum(flags)
    for k in range(1, n + 1):
        subsets = list(combinations(flags, k))
        exact = sum(any(s) for s in subsets) / math.comb(n, k)
        assert pass_at_k(n, [c], k)[0] == pytest.approx(exact, abs=1e-12)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="1 <= k <= n; got k=5, n=4"):
        pass_at_k(4, [1], 5)
    with pytest.raises(ValueError, match=r"correct counts must lie in \[0, 4\]"):
        pass_at_k(4, [5], 1)


def test_majority_vote():
    assert majority_correct(["7", "7", "3"], [True, True, False])
    assert not majority_correct(["3", "7", "3"], [False, True, False])
    assert majority_correct(["3", "7"], [True, False])  # a tie goes to the answer seen first
    assert not majority_correct([None, None], [False, False])
    assert majority_correct([None, None, "2"], [False, False, True])  # no answer is not a vote


def test_sampled_metrics():
    correct = np.array([[True, False, False, False], [False, False, False, False], [True, True, True, False]])
    answers = [["1", "2", "2", "2"], ["5", None, "6", "6"], ["4", "4", "4", "9"]]
    metrics = sampled_metrics(correct, ks=(1, 4), answers=answers)
    assert metrics["eval/pass@1"] == pytest.approx((0.25 + 0 + 0.75) / 3)
    assert metrics["eval/pass@4"] == pytest.approx(2 / 3)
    assert metrics["eval/maj@1"] == pytest.approx(2 / 3)  # first samples: right, wrong, right
    assert metrics["eval/maj@4"] == pytest.approx(1 / 3)  # majorities: "2" (wrong), "6" (wrong), "4" (right)
