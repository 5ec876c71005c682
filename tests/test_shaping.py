"""Tests for jaxrl.rewards.shaping: format reward, length penalties and reward composition."""

import time

import jax
import numpy as np
import pytest

from jaxrl.rewards.shaping import (
    ComposedRewards,
    compose,
    dapo_overlong_penalty,
    format_reward,
    length_penalty,
    truncation_mask,
)

# ---------------------------------------------------------------------------
# format_reward
# ---------------------------------------------------------------------------

FORMAT_CASES = [
    # (completion, expected, description)
    ("<think>2+2 is 4</think><answer>4</answer>", 1.0, "good, no whitespace"),
    ("  \n<think>\nreason\n</think>\n\n<answer> 4 </answer>\n ", 1.0, "good, whitespace around/between"),
    ("<think></think><answer>4</answer>", 1.0, "empty think is allowed"),
    ("<answer>4</answer>", 0.0, "missing think"),
    ("<think>x</think>", 0.0, "missing answer"),
    ("<think>x</think><answer>4", 0.0, "missing </answer>"),
    ("<think>x<answer>4</answer>", 0.0, "missing </think>"),
    ("<think>a</think><think>b</think><answer>4</answer>", 0.0, "repeated think"),
    ("<think>a</think><answer>4</answer><answer>5</answer>", 0.0, "repeated answer"),
    ("<think>a</think><answer>4</answer></answer>", 0.0, "extra close tag"),
    ("Sure! <think>a</think><answer>4</answer>", 0.0, "text before"),
    ("<think>a</think>so<answer>4</answer>", 0.0, "text between"),
    ("<think>a</think><answer>4</answer> done", 0.0, "text after"),
    ("<think>a</think><answer>   </answer>", 0.0, "blank answer"),
    ("<think>a</think><answer></answer>", 0.0, "empty answer"),
    ("<think>a<think>b</think>c</think><answer>4</answer>", 0.0, "nested think"),
    ("<think>a<answer>4</answer></think>", 0.0, "answer nested in think"),
    ("<think><answer>5</think></answer>", 0.0, "answer opened inside think, closed after it"),
    ("<think>a<answer>5</think>b</answer>", 0.0, "blocks interleaved"),
    ("<answer>4</answer><think>a</think>", 0.0, "wrong order"),
    ("</think>a<think><answer>4</answer>", 0.0, "think tags reversed"),
    ("<THINK>a</THINK><ANSWER>4</ANSWER>", 0.0, "tags are case-sensitive"),
    ("", 0.0, "empty string"),
]


@pytest.mark.parametrize("completion,expected,desc", FORMAT_CASES, ids=[c[2] for c in FORMAT_CASES])
def test_format_reward_cases(completion, expected, desc):
    assert format_reward(completion) == expected


def test_format_reward_answer_only_pattern():
    assert format_reward("<answer>4</answer>", pattern="answer") == 1.0
    assert format_reward("<think>a</think><answer>4</answer>", pattern="answer") == 0.0


def test_format_reward_unknown_pattern_and_non_string():
    with pytest.raises(ValueError, match="unknown format pattern 'xml'"):
        format_reward("<answer>4</answer>", pattern="xml")
    assert format_reward(None) == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    [
        "<think>" * 200_000,  # ~1.4 MB of repeated open tags
        "<" * 1_000_000,
        "<think>" + "a" * 1_000_000 + "</think><answer>" + "b" * 1_000_000 + "</answer>",
    ],
    ids=["repeated-open-tags", "angle-brackets", "huge-valid"],
)
def test_format_reward_megabyte_inputs_are_fast(text):
    start = time.perf_counter()
    result = format_reward(text)
    assert time.perf_counter() - start < 0.5
    assert result == (1.0 if text.endswith("</answer>") else 0.0)


# ---------------------------------------------------------------------------
# Length penalties and truncation mask
# ---------------------------------------------------------------------------


def test_dapo_overlong_penalty_boundaries():
    # max_length=100, cache_length=20: soft window is (80, 100].
    lengths = np.array([0, 79, 80, 81, 90, 99, 100, 101, 10_000])
    expected = np.array([0, 0, 0, -1 / 20, -10 / 20, -19 / 20, -1, -1, -1], dtype=np.float32)
    got = dapo_overlong_penalty(lengths, max_length=100, cache_length=20)
    assert got.dtype == np.float32 and got.shape == (9,)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-7)


def test_dapo_overlong_penalty_cache_equals_max():
    got = dapo_overlong_penalty(np.array([0, 1, 4, 5]), max_length=4, cache_length=4)
    np.testing.assert_allclose(got, [0, -0.25, -1, -1])


@pytest.mark.parametrize("cache_length", [0, -1, 101])
def test_dapo_overlong_penalty_rejects_bad_cache(cache_length):
    with pytest.raises(ValueError, match="cache_length"):
        dapo_overlong_penalty(np.array([1]), max_length=100, cache_length=cache_length)


def test_truncation_mask():
    got = truncation_mask(np.array([0, 1, 0, 1], dtype=np.int32))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, [1, 0, 1, 0])
    np.testing.assert_array_equal(truncation_mask(np.array([2, 1]), length_finish=2), [0, 1])


def test_length_penalty():
    got = length_penalty(np.array([0, 50, 100, 150, 300]), target_length=100, coef=0.5)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, [0, 0, 0, -0.25, -1.0])
    with pytest.raises(ValueError, match="target_length"):
        length_penalty(np.array([1]), target_length=0, coef=1.0)


@pytest.mark.parametrize("target_length, coef, field", [
    (float("nan"), 1.0, "target_length"), (100, float("inf"), "coef"), (100, float("nan"), "coef")])
def test_length_penalty_refuses_what_would_give_nan(target_length, coef, field):
    # Each gave NaN penalties (inf * 0 excess, comparisons with NaN), which compose only reported later as
    # non-finite values of the "length" component.
    with pytest.raises(ValueError, match=field):
        length_penalty(np.array([10, 200]), target_length=target_length, coef=coef)


# ---------------------------------------------------------------------------
# compose
# ---------------------------------------------------------------------------


def test_compose_sums_and_metrics():
    correct = np.array([1.0, 0.0, 1.0, 0.0])
    fmt = np.array([1.0, 1.0, 0.0, 0.0])
    overlong = np.array([0.0, -0.5, 0.0, -1.0])
    out = compose({"correct": correct, "format": fmt, "overlong": overlong},
                  {"correct": 1.0, "format": 0.1, "overlong": 1.0})
    assert isinstance(out, ComposedRewards)
    assert out.total.dtype == np.float32 and out.total.shape == (4,)
    np.testing.assert_allclose(out.total, [1.1, -0.4, 1.0, -1.0], rtol=1e-6)
    np.testing.assert_array_equal(out.components["format"], fmt)  # unweighted
    metrics = out.metrics()
    assert metrics.keys() == {"reward/total", "reward/correct", "reward/format", "reward/overlong"}
    assert metrics["reward/total"] == pytest.approx(0.175)
    assert metrics["reward/correct"] == pytest.approx(0.5)
    assert metrics["reward/overlong"] == pytest.approx(-0.375)
    assert all(isinstance(v, float) for v in metrics.values())
    assert set(out.metrics(prefix="r_")) == {"r_total", "r_correct", "r_format", "r_overlong"}


def test_compose_orders_components_as_the_weights():
    """The loop stacks `components` into `[B, K]` columns that line up with `weights`' values; a pytree pass
    (`jax.tree.map`, the multi-process gather) sorts dict keys, so compose must restore the weights' order."""
    weights = {"correct": 1.0, "format": 0.1, "overlong": 0.5, "length": 1.0}
    sorted_components = {k: np.full(2, i, np.float32) for i, k in enumerate(sorted(weights))}
    out = compose(jax.tree.map(np.asarray, sorted_components), weights)
    assert list(out.components) == list(weights)
    np.testing.assert_array_equal(out.components["overlong"], sorted_components["overlong"])


def test_compose_unknown_weight():
    with pytest.raises(ValueError, match=r"unknown components \['typo'\].*without a weight \[\]"):
        compose({"a": np.zeros(2)}, {"a": 1.0, "typo": 1.0})


def test_compose_missing_weight():
    with pytest.raises(ValueError, match=r"unknown components \[\].*without a weight \['b'\]"):
        compose({"a": np.zeros(2), "b": np.zeros(2)}, {"a": 1.0})


def test_compose_length_mismatch():
    with pytest.raises(ValueError, match=r"different lengths: \{'a': 2, 'b': 3\}"):
        compose({"a": np.zeros(2), "b": np.zeros(3)}, {"a": 1.0, "b": 1.0})


def test_compose_not_1d():
    with pytest.raises(ValueError, match=r"1-D.*'a': \(2, 2\)"):
        compose({"a": np.zeros((2, 2))}, {"a": 1.0})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_compose_non_finite(bad):
    with pytest.raises(ValueError, match=r"component 'b' has non-finite values at indices \[1\]"):
        compose({"a": np.zeros(3), "b": np.array([0.0, bad, 0.0])}, {"a": 1.0, "b": 1.0})
    with pytest.raises(ValueError, match=r"weight for 'a' is not finite"):
        compose({"a": np.zeros(3)}, {"a": bad})


def test_compose_float32_overflow():
    # Finite as float64, but the total is float32: a weight of 1e39 is inf there, and 2 x 3e38 overflows.
    with pytest.raises(ValueError, match=r"weight for 'a' is not finite in float32"):
        compose({"a": np.ones(3)}, {"a": 1e39})
    with pytest.raises(ValueError, match=r"overflows float32 at indices \[1\]"):
        compose({"a": np.array([0.0, 3e38, 1.0]), "b": np.ones(3)}, {"a": 2.0, "b": 1.0})
    out = compose({"a": np.array([3e38, -3e38])}, {"a": 1.0})  # large but finite is fine
    assert np.all(np.isfinite(out.total))


def test_compose_empty():
    with pytest.raises(ValueError, match="at least one"):
        compose({}, {})
