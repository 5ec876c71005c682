"""Reward shaping: format rewards, length penalties and weighted composition.

Everything here is a pure host-side function on strings or NumPy arrays (no jax). Per-sample outputs are
float32 arrays of shape `[N]`; lengths are token counts (any integer or float array of shape `[N]`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

__all__ = [
    "ComposedRewards",
    "compose",
    "dapo_overlong_penalty",
    "format_reward",
    "length_penalty",
    "truncation_mask",
]

# Tag sequences for `format_reward`: the completion must be exactly these tagged blocks, in order.
_FORMAT_PATTERNS: dict[str, tuple[str, ...]] = {
    "think_answer": ("think", "answer"),
    "answer": ("answer",),
}


def format_reward(completion: str, *, pattern: str = "think_answer") -> float:
    """1.0 iff `completion` is exactly the pattern's tagged blocks, else 0.0.

    For `"think_answer"`: `<think>...</think>` then `<answer>...</answer>`, each tag exactly once (so no
    nesting or repeats), only whitespace around and between the blocks, and a non-blank answer. Tags are
    case-sensitive. Uses only `str.count`/`str.find`, so it is linear-time in `len(completion)`.
    """
    if pattern not in _FORMAT_PATTERNS:
        raise ValueError(f"unknown format pattern {pattern!r}; supported: {', '.join(_FORMAT_PATTERNS)}")
    if not isinstance(completion, str):
        return 0.0
    text = completion.strip()
    pos = 0
    content = ""
    for name in _FORMAT_PATTERNS[pattern]:
        open_tag, close_tag = f"<{name}>", f"</{name}>"
        if text.count(open_tag) != 1 or text.count(close_tag) != 1:
            return 0.0
        start = text.find(open_tag)
        if start < pos or text[pos:start].strip():  # inside the previous block, or text before this one
            return 0.0
        end = text.find(close_tag, start)
        if end < 0:  # the close tag comes before the open tag
            return 0.0
        content = text[start + len(open_tag) : end]
        pos = end + len(close_tag)
    if pos != len(text) or not content.strip():  # trailing text, or an empty final block
        return 0.0
    return 1.0


def dapo_overlong_penalty(lengths: np.ndarray, max_length: int, cache_length: int) -> np.ndarray:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), float32 `[N]` in `[-1, 0]`.

    With `L_max = max_length`, `L_cache = cache_length`: 0 for `L <= L_max - L_cache`; a linear ramp
    `(L_max - L_cache - L) / L_cache` inside the cache window; -1 for `L > L_max`.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got cache_length={cache_length}, "
                         f"max_length={max_length}")
    lengths = np.asarray(lengths, dtype=np.float64)
    soft_start = max_length - cache_length
    ramp = (soft_start - lengths) / cache_length
    penalty = np.where(lengths <= soft_start, 0.0, np.where(lengths <= max_length, ramp, -1.0))
    return penalty.astype(np.float32)


def truncation_mask(finish_reason: np.ndarray, length_finish: int = 1) -> np.ndarray:
    """float32 `[N]`: 1.0 where a sequence ended normally, 0.0 where it was truncated.

    `finish_reason` is the int `[N]` code from sampling (`jaxrl.sampling.FINISH_LENGTH == 1` means it hit the
    length limit). Multiply per-sample losses by this to mask overlong samples out.
    """
    return (np.asarray(finish_reason) != length_finish).astype(np.float32)


def length_penalty(lengths: np.ndarray, target_length: int, coef: float) -> np.ndarray:
    """float32 `[N]`: `-coef * max(0, L - target_length) / target_length` (0 up to the target).

    Raises ValueError unless `target_length > 0` and `coef` is finite (an infinite one makes 0 excess NaN).
    """
    if not target_length > 0:  # NaN too
        raise ValueError(f"length penalty target_length must be > 0, got {target_length}")
    if not math.isfinite(coef):
        raise ValueError(f"length penalty coef must be finite, got {coef}")
    excess = np.maximum(0.0, np.asarray(lengths, dtype=np.float64) - target_length)
    return (-coef * excess / target_length).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class ComposedRewards:
    """Weighted sum of named reward components, keeping each component for logging."""

    total: np.ndarray  # [N] float32 = sum_i weight_i * component_i
    components: dict[str, np.ndarray]  # name -> [N] float32, unweighted

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Means over the batch: `{prefix}total` and `{prefix}<name>` for each (unweighted) component."""
        out = {f"{prefix}total": float(np.mean(self.total))}
        out.update({f"{prefix}{name}": float(np.mean(v)) for name, v in self.components.items()})
        return out


def compose(components: Mapping[str, np.ndarray], weights: Mapping[str, float]) -> ComposedRewards:
    """`total = sum_i weights[i] * components[i]`, every component a finite `[N]` array. The result's
    components come in the order of `weights`, whatever the order of `components`.

    Raises ValueError if the weight names differ from the component names, if the component lengths
    differ, if a component holds a non-finite value (NaN/inf), if a weight is not finite as a float32
    (e.g. 1e39, finite as a float64, is inf in float32), or if the total overflows float32: the total is
    always finite.
    """
    if not components:
        raise ValueError("compose needs at least one reward component")
    unknown = sorted(set(weights) - set(components))
    missing = sorted(set(components) - set(weights))
    if unknown or missing:
        raise ValueError(f"reward weights do not match components: weights for unknown components {unknown}, "
                         f"components without a weight {missing}")
    arrays = {name: np.asarray(components[name], dtype=np.float32) for name in weights}  # in weights' order
    not_1d = {name: a.shape for name, a in arrays.items() if a.ndim != 1}
    if not_1d:
        raise ValueError(f"reward components must be 1-D [N] arrays, got shapes {not_1d}")
    lengths = {name: a.shape[0] for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"reward components have different lengths: {lengths}")
    for name, a in arrays.items():
        if not np.all(np.isfinite(a)):
            bad = np.flatnonzero(~np.isfinite(a))
            raise ValueError(f"reward component {name!r} has non-finite values at indices {bad[:8].tolist()}")
        with np.errstate(over="ignore"):  # the total is computed in float32: check the weight there
            weight32 = np.float32(weights[name])
        if not np.isfinite(weight32):  # NaN and inf stay so in float32
            raise ValueError(f"reward weight for {name!r} is not finite in float32: {weights[name]}")
    n = next(iter(lengths.values()))
    total = np.zeros(n, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # checked below
        for name, a in arrays.items():
            total += np.float32(weights[name]) * a
    if not np.all(np.isfinite(total)):
        bad = np.flatnonzero(~np.isfinite(total))
        raise ValueError(f"the weighted reward total overflows float32 at indices {bad[:8].tolist()}; "
                         f"weights {dict(weights)}")
    return ComposedRewards(total=total, components=arrays)
