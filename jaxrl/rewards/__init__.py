"""Host-side verifiable rewards: math answer checking and a sandboxed scoring pool.

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
from jaxrl.rewards.pool import RewardPool, RewardResult

__all__ = [
    "RewardPool",
    "RewardResult",
    "arithmetic_reward",
    "extract_answer",
    "is_equivalent",
    "math_verify",
    "normalize_answer",
]
