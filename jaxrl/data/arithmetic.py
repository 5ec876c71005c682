"""Built-in verifiable reasoning task: chains of additions and subtractions solved step by step.

A problem is `"23+8-5+9="`; a worked solution writes every intermediate result and the final answer after
`####`: `"23+8=31,31-5=26,26+9=35 #### 35"`. The reward checks only the final answer.

The warm-start demonstrations come from a *sloppy teacher*: at a step whose ones digits carry (23+8) or
borrow (31-5), it forgets the carry with probability `teacher_carry_error_rate` and continues from its
wrong value. Supervised learning imitates that habit faithfully; only the verifiable reward tells the
policy that carrying is right, so the accuracy gained after the warm start is the work of RL.

The tool variant (`configs/tools.yaml`): the teacher calls the calculator instead of working the chain out on
every chain of at least `tool_min_steps` steps, and on any other with chance `tool_rate` (so the warm-started
policy calls it greedily on the long chains and, sampling, sometimes on the others: RL's exploration). Such
a demonstration is a multi-turn episode of segments (`tool_solution`): the model's call
`<tool_call>{"name":"calculator","arguments":{"expression":"23+8-5+9"}}</tool_call>`, the environment's
observation `<tool_response>35</tool_response>` (trained on as context only: a hole in the completion mask)
and the model's answer `#### 35`. Chains long enough that the sloppy head solution is rarely right leave RL
an easy way up: call the calculator where it pays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from jaxrl.envs.tool_calls import ToolCall, format_tool_call, plain_observation


@dataclasses.dataclass(frozen=True)
class ArithmeticTaskConfig:
    min_steps: int = dataclasses.field(default=2, metadata={"ge": 1})
    max_steps: int = dataclasses.field(default=4, metadata={"ge": 1})
    max_start: int = dataclasses.field(default=30, metadata={"ge": 1})  # first number in [1, max_start]
    max_operand: int = dataclasses.field(default=9, metadata={"ge": 1})  # later numbers in [1, max_operand]
    max_value: int = dataclasses.field(default=99, metadata={"ge": 1})  # running totals stay in [0, max_value]
    teacher_carry_error_rate: float = dataclasses.field(default=0.6, metadata={"ge": 0, "le": 1})
    num_eval: int = dataclasses.field(default=256, metadata={"gt": 0})  # held-out problems
    num_train: int = dataclasses.field(default=20_000, metadata={"gt": 0})  # distinct training problems
    # the teacher calls the calculator (hermes format) on every chain of >= tool_min_steps steps (0: none) and
    # on any other chain with chance tool_rate
    tool_min_steps: int = dataclasses.field(default=0, metadata={"ge": 0})
    tool_rate: float = dataclasses.field(default=0.0, metadata={"ge": 0, "le": 1})

    @property
    def uses_tools(self) -> bool:
        return bool(self.tool_min_steps or self.tool_rate)

    def validate(self) -> None:
        if self.tool_min_steps > self.max_steps:
            raise ValueError(f"tool_min_steps ({self.tool_min_steps}) > max_steps ({self.max_steps}): no chain "
                             "is that long; use 0 for none")
        if self.min_steps > self.max_steps:
            raise ValueError(f"min_steps ({self.min_steps}) > max_steps ({self.max_steps})")
        if self.max_start > self.max_value:
            raise ValueError(f"max_start ({self.max_start}) > max_value ({self.max_value})")
        if 2 * self.max_operand > self.max_value + 1:  # else a total near max_value / 2 fits neither way
            raise ValueError(f"max_operand ({self.max_operand}) > (max_value + 1) / 2 ({(self.max_value + 1) / 2:g}): "
                             f"a running total near max_value / 2 could neither add nor subtract it and stay in "
                             f"[0, max_value]")


@dataclasses.dataclass(frozen=True)
class Problem:
    start: int
    steps: tuple[tuple[str, int], ...]  # (op, operand), op in "+-"

    @property
    def prompt(self) -> str:
        return str(self.start) + "".join(f"{op}{x}" for op, x in self.steps) + "="

    @property
    def answer(self) -> int:
        return self.start + sum(x if op == "+" else -x for op, x in self.steps)

    @property
    def reference(self) -> str:
        """What the reward compares against (as `PromptRecord.reference` of a prompt file)."""
        return str(self.answer)


def random_problem(rng: np.random.Generator, config: ArithmeticTaskConfig) -> Problem:
    """A problem whose running total stays in `[0, max_value]`."""
    total = int(rng.integers(1, config.max_start + 1))
    start, steps = total, []
    for _ in range(int(rng.integers(config.min_steps, config.max_steps + 1))):
        x = int(rng.integers(1, config.max_operand + 1))
        op = "+" if rng.random() < 0.5 else "-"
        if op == "-" and total - x < 0:
            op = "+"
        if op == "+" and total + x > config.max_value:
            op = "-"
        total += x if op == "+" else -x
        steps.append((op, x))
    return Problem(start, tuple(steps))


def carries(total: int, op: str, x: int) -> bool:
    """Whether `total op x` carries into (or borrows from) the tens digit: the ones digits decide."""
    return (total % 10 + x % 10 >= 10) if op == "+" else (total % 10 < x % 10)


def solution(problem: Problem, carry_error_rate: float = 0.0, rng: np.random.Generator | None = None) -> str:
    """Worked solution; with `carry_error_rate > 0` each carrying step forgets the carry with that chance."""
    total, parts = problem.start, []
    for op, x in problem.steps:
        result = total + x if op == "+" else total - x
        if carry_error_rate and carries(total, op, x) and rng.random() < carry_error_rate:
            result += -10 if op == "+" else 10
        parts.append(f"{total}{op}{x}={result}")
        total = result
    return ",".join(parts) + f" #### {total}"


MODEL, OBSERVATION = "model", "observation"  # the kinds of an episode's segments (`tokenizer.encode_examples`)
TOOL_FORMAT = "hermes"
CALCULATOR = "calculator"


def expression(problem: Problem) -> str:
    """The problem's expression, as the calculator reads it: the prompt without its `=`."""
    return problem.prompt[:-1]


def tool_solution(problem: Problem) -> tuple[tuple[str, str], ...]:
    """The calculator episode: `((MODEL, call), (OBSERVATION, "<tool_response>N</tool_response>"), (MODEL,
    "#### N"))`, the exact texts of `jaxrl.envs.tool_calls` (hermes format, no chat template)."""
    call = format_tool_call(ToolCall(CALCULATOR, {"expression": expression(problem)}), TOOL_FORMAT)
    return ((MODEL, call), (OBSERVATION, plain_observation([str(problem.answer)], TOOL_FORMAT)),
            (MODEL, f"#### {problem.answer}"))


def tokenizer_symbols(config: ArithmeticTaskConfig) -> tuple[str, ...]:
    """Pieces the task's tokenizer must keep whole (`train_tokenizer(user_symbols=...)`): the tags and the
    fixed JSON around the expression of a calculator call, so that a call costs about as many tokens as the
    expression (none for the task without tools)."""
    if not config.uses_tools:
        return ()
    call = format_tool_call(ToolCall(CALCULATOR, {"expression": "@"}), TOOL_FORMAT)
    head, tail = call.split('"@"')
    head, tail = head + '"', '"' + tail  # '<tool_call>{"name":...:"', '"}}</tool_call>'
    tag = "<tool_call>"
    return (tag, head.removeprefix(tag), tail.removesuffix("</tool_call>"), "</tool_call>", "<tool_response>",
            "</tool_response>")


def make_splits(config: ArithmeticTaskConfig, seed: int) -> tuple[list[Problem], list[Problem]]:
    """Disjoint `(train, held_out)` problem lists (no held-out prompt appears in train), deterministic."""
    rng = np.random.default_rng([seed, 1])
    held_out: dict[str, Problem] = {}
    attempts = 0
    while len(held_out) < config.num_eval:
        attempts += 1
        if attempts > 50 * config.num_eval:
            raise ValueError(f"the task has too few distinct problems for num_eval={config.num_eval} "
                             f"(found {len(held_out)} in {attempts - 1} draws)")
        p = random_problem(rng, config)
        held_out.setdefault(p.prompt, p)
    train: dict[str, Problem] = {}
    attempts = 0
    while len(train) < config.num_train:
        attempts += 1
        if attempts > 50 * config.num_train:
            raise ValueError(f"the task has too few distinct problems for num_train={config.num_train} "
                             f"(found {len(train)} in {attempts - 1} draws, besides the {len(held_out)} held out)")
        p = random_problem(rng, config)
        if p.prompt not in held_out:
            train.setdefault(p.prompt, p)
    return list(train.values()), list(held_out.values())


def calls_tool(problem: Problem, config: ArithmeticTaskConfig, rng: np.random.Generator) -> bool:
    """Whether the teacher calls the calculator on `problem` (draws from `rng` only for a chance call)."""
    if config.tool_min_steps and len(problem.steps) >= config.tool_min_steps:
        return True
    return bool(config.tool_rate) and rng.random() < config.tool_rate


def teacher_examples(
    problems: list[Problem], config: ArithmeticTaskConfig, seed: int
) -> Iterator[tuple[str, str | tuple[tuple[str, str], ...]]]:
    """Endless `(prompt, sloppy-teacher solution)` pairs for the warm start, deterministic for `seed`: the
    solution is a worked-solution string, or with `config.uses_tools` sometimes a calculator episode
    (`tool_solution`'s segments)."""
    rng = np.random.default_rng([seed, 2])
    while True:
        p = problems[int(rng.integers(len(problems)))]
        if calls_tool(p, config, rng):
            yield p.prompt, tool_solution(p)
        else:
            yield p.prompt, solution(p, config.teacher_carry_error_rate, rng)


def tokenizer_corpus(problems: list[Problem], config: ArithmeticTaskConfig | None = None) -> list[str]:
    """Texts covering every symbol the task uses (prompts and solutions, and with `config.uses_tools` the
    calculator episodes' texts)."""
    texts = [p.prompt for p in problems] + [solution(p) for p in problems]
    if config is not None and config.uses_tools:
        texts += ["".join(text for _, text in tool_solution(p)) for p in problems]
    return texts
