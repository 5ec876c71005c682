"""The built-in arithmetic task: problem generation, worked solutions, the sloppy teacher, splits."""

import itertools

import numpy as np
import pytest

from jaxrl.config import Config
from jaxrl.configlib import ConfigError, load_config
from jaxrl.data import arithmetic
from jaxrl.data.arithmetic import ArithmeticTaskConfig, Problem


def running_totals(problem: Problem) -> list[int]:
    totals = [problem.start]
    for op, x in problem.steps:
        totals.append(totals[-1] + (x if op == "+" else -x))
    return totals


@pytest.mark.parametrize("config", [
    ArithmeticTaskConfig(),
    ArithmeticTaskConfig(max_value=5, max_start=5, max_operand=3, min_steps=4, max_steps=8),
    ArithmeticTaskConfig(max_value=20, max_start=1, max_operand=10, min_steps=1, max_steps=1),
])
def test_running_totals_stay_in_range_and_the_answer_is_the_last(config):
    config.validate()
    rng = np.random.default_rng(0)
    for _ in range(2000):
        p = arithmetic.random_problem(rng, config)
        totals = running_totals(p)
        assert 1 <= p.start <= config.max_start
        assert config.min_steps <= len(p.steps) <= config.max_steps
        assert all(0 <= t <= config.max_value for t in totals), p.prompt
        assert all(1 <= x <= config.max_operand for _, x in p.steps)
        assert p.answer == totals[-1] and p.reference == str(totals[-1])


def test_solution_writes_every_step_and_the_final_answer():
    p = Problem(23, (("+", 8), ("-", 5), ("+", 9)))
    assert p.prompt == "23+8-5+9="
    assert arithmetic.solution(p) == "23+8=31,31-5=26,26+9=35 #### 35"


def test_sloppy_teacher_forgets_only_carries():
    p = Problem(23, (("+", 8), ("-", 5), ("+", 1)))  # 23+8 carries, 31-5 borrows, 26+1 does neither
    assert arithmetic.carries(23, "+", 8) and arithmetic.carries(31, "-", 5) and not arithmetic.carries(26, "+", 1)
    # operands of two digits (max_operand > 9): the ones digits decide
    assert not arithmetic.carries(23, "+", 15) and not arithmetic.carries(27, "-", 15)
    assert arithmetic.carries(28, "+", 15) and arithmetic.carries(23, "-", 15)
    always = arithmetic.solution(p, carry_error_rate=1.0, rng=np.random.default_rng(0))
    assert always == "23+8=21,21-5=26,26+1=27 #### 27"  # forgets the carry (21), then the borrow (26, not 16)
    seen = {arithmetic.solution(p, 0.5, np.random.default_rng(s)) for s in range(64)}
    assert arithmetic.solution(p) in seen and always in seen


def test_splits_are_disjoint_distinct_and_deterministic():
    config = ArithmeticTaskConfig(num_train=500, num_eval=64)
    train, held_out = arithmetic.make_splits(config, seed=3)
    assert len(train) == 500 and len(held_out) == 64
    prompts = [p.prompt for p in train]
    assert len(set(prompts)) == 500 and not set(prompts) & {p.prompt for p in held_out}
    again = arithmetic.make_splits(config, seed=3)
    assert again == (train, held_out) and arithmetic.make_splits(config, seed=4) != (train, held_out)


def test_teacher_examples_are_deterministic_for_a_seed():
    train, _ = arithmetic.make_splits(ArithmeticTaskConfig(num_train=50, num_eval=8), seed=0)
    config = ArithmeticTaskConfig()
    first = list(itertools.islice(arithmetic.teacher_examples(train, config, seed=1), 20))
    assert first == list(itertools.islice(arithmetic.teacher_examples(train, config, seed=1), 20))
    assert all(prompt.endswith("=") and " #### " in sol for prompt, sol in first)


@pytest.mark.parametrize("overrides,match", [
    (["task.num_eval=256", "task.min_steps=1", "task.max_steps=1", "task.max_start=2", "task.max_operand=2",
      "task.max_value=3"], "too few distinct problems for num_eval=256"),
    (["task.num_train=5000", "task.num_eval=8", "task.min_steps=1", "task.max_steps=1", "task.max_start=9",
      "task.max_operand=9", "task.max_value=99"], "too few distinct problems for num_train=5000"),
])
def test_a_task_too_small_for_its_splits_is_an_error_not_a_hang(overrides, match):
    """The held-out split too: 2 starts x 2 operands x 2 ops cannot give 256 distinct problems."""
    config = load_config(Config, None, overrides)
    with pytest.raises(ValueError, match=match):
        arithmetic.make_splits(config.task, seed=0)


def test_an_operand_that_cannot_keep_totals_in_range_is_a_config_error():
    with pytest.raises(ConfigError, match=r"task.*max_operand \(8\) > \(max_value \+ 1\) / 2 \(3\)"):
        load_config(Config, None, ["task.max_value=5", "task.max_start=5", "task.max_operand=8"])
