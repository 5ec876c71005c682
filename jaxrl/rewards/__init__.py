"""Host-side verifiable rewards: math answer checking, sandboxed code execution, format and length
shaping, a worker pool with hard timeouts, and the scoring of a batch with every reward a config names
(`jaxrl.rewards.scoring`).

Importing this package is cheap (no jax/flax; sympy is imported lazily the
first time a symbolic comparison is needed).
"""

from jaxrl.rewards.math import (
    arithmetic_reward,
    extract_answer,
    is_equivalent,
    math_verify,
    normalize_answer,
)
from jaxrl.rewards.pool import RewardPool, RewardResult, item_deadline
from jaxrl.rewards.scoring import RewardScorer, ScoredBatch
from jaxrl.rewards.self_rewarding import answer_key, majority_answer, rent, self_certainty, ttrl
from jaxrl.rewards.sandbox import CodeResult, SandboxLimits, code_reward, extract_code, run_program, run_tests
from jaxrl.rewards.shaping import (
    ComposedRewards,
    compose,
    dapo_overlong_penalty,
    format_reward,
    length_penalty,
    truncation_mask,
)

__all__ = [
    "CodeResult",
    "ComposedRewards",
    "RewardPool",
    "RewardResult",
    "RewardScorer",
    "SandboxLimits",
    "ScoredBatch",
    "answer_key",
    "arithmetic_reward",
    "code_reward",
    "compose",
    "dapo_overlong_penalty",
    "extract_answer",
    "extract_code",
    "format_reward",
    "is_equivalent",
    "item_deadline",
    "length_penalty",
    "majority_answer",
    "math_verify",
    "normalize_answer",
    "rent",
    "run_program",
    "run_tests",
    "self_certainty",
    "truncation_mask",
    "ttrl",
]
