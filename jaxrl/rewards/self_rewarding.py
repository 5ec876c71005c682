"""Self-rewarding signals: rewards computed from the policy's own samples or its own token distribution,
without the reference answer. Each is a `reward` registered with `self_reward=` info and selected under
`reward.extra` like any extra reward (`{name: weight}`), so it combines with the verifiable reward by the same
weighted sum (`jaxrl.rewards.compose`); `reward.function_weight: 0` trains on the self-rewards alone (the
verifiable reward is still scored and logged as `reward/correct`, for the accuracy of the samples and the
pseudo-labels, but no longer enters the total).

- `ttrl` (`self_reward="group"`): majority vote over each group of samples of one prompt; computed on the host
  from the completions alone (no worker pool: it needs the whole group, which a pool's chunks can split).
- `rent` and `self_certainty` (`self_reward="token"`): a completion's mean over its tokens of a per-token
  quantity of the distribution it was sampled from (entropy; KL(U || p)). The RL loop computes the per-token
  quantity on the accelerator, in the same jitted program as the rollout's `old_logp` (`jaxrl.loop.self_rewards`),
  and calls these functions with it.

    reward: {function: arithmetic, function_weight: 0, extra: {ttrl: 1.0}}        # TTRL alone
    reward: {function: arithmetic, extra: {self_certainty: 0.1}}                  # verifiable + INTUITOR

Host-side and jax-free, like the rest of `jaxrl.rewards`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from jaxrl.registry import register
from jaxrl.rewards.math import extract_answer, normalize_answer

__all__ = ["answer_key", "majority_answer", "masked_token_mean", "rent", "self_certainty", "ttrl",
           "ttrl_metrics", "SELF_REWARD_KINDS", "TOKEN_STATISTICS"]

# `self_reward` info values: computed over each prompt's group on the host, or from per-token model quantities.
SELF_REWARD_KINDS = ("group", "token")
# Per-token statistics the token self-rewards read (`statistic=` info), computed by the RL loop on the device.
TOKEN_STATISTICS = ("entropy", "self_certainty")


def answer_key(completion: str) -> str | None:
    """The answer a completion votes with: its extracted final answer (`extract_answer`), normalised
    (`normalize_answer`), exactly as maj@k votes (`jaxrl.loop.held_out`); None when it gives no answer. Two
    completions agree when their keys are equal."""
    answer = extract_answer(completion)
    return None if answer is None else normalize_answer(answer)


def majority_answer(keys: Sequence[str | None]) -> str | None:
    """The most common of `keys` (None never votes); a tie goes to the tied answer that comes first in
    `keys` (as maj@k's `evaluation.majority_correct`); None when no key is given."""
    votes = Counter(k for k in keys if k is not None)
    if not votes:
        return None
    top = max(votes.values())
    return next(k for k in keys if k is not None and votes[k] == top)


@register("reward", "ttrl", self_reward="group", binary=True)
def ttrl(completions: Sequence[str], group_size: int | None = None) -> list[float]:
    """TTRL's majority-vote reward ("TTRL: Test-Time Reinforcement Learning", Zuo et al., arXiv 2504.16084).

    Within each group of `group_size` consecutive completions (the samples of one prompt; None: all of
    `completions` are one group), the majority-voted answer `y*` is the pseudo-label, and
    `r_i = 1 if answer(y_i) == y* else 0`.

    Choices the paper leaves open: answers are compared as maj@k compares them (`answer_key`: the extracted,
    normalised final answer, equal strings agree); a tie goes to the tied answer sampled first (samples come
    in random order, so this is a uniformly random tie-break among equally frequent answers); a completion
    with no extractable answer neither votes nor earns the reward (0); a group where no completion has an
    answer gets 0 everywhere. The vote is over the training group itself (the paper votes over more samples
    than it trains on; here the group's `rl.group_size` samples are both). The reference answer is never
    read.

    Returns `[len(completions)]` floats in {0, 1}. Raises ValueError if `group_size` does not divide the
    number of completions or is below 2 (a group of one always agrees with itself: no vote).
    """
    n = len(completions)
    size = n if group_size is None else int(group_size)
    if size < 2 and n:
        raise ValueError(f"ttrl needs groups of at least 2 completions to vote, got group size {size}")
    if n % max(size, 1):
        raise ValueError(f"ttrl: {n} completions do not split into groups of {size}")
    keys = [answer_key(c) for c in completions]
    rewards = []
    for start in range(0, n, max(size, 1)):
        group = keys[start:start + size]
        label = majority_answer(group)
        rewards += [1.0 if label is not None and k == label else 0.0 for k in group]
    return rewards


def masked_token_mean(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """`[B]` float32 mean of `values [B, N]` over each row's completion tokens (`mask [B, N]`, holes allowed);
    0 for a row without any (an empty completion: no token, no evidence either way)."""
    values, mask = np.asarray(values, np.float64), np.asarray(mask, bool)
    if values.shape != mask.shape or values.ndim != 2:
        raise ValueError(f"values {values.shape} and mask {mask.shape} must be the same [B, N]")
    count = mask.sum(1)
    total = np.where(mask, values, 0.0).sum(1)
    return np.where(count > 0, total / np.maximum(count, 1), 0.0).astype(np.float32)


def _token_arrays(name: str, completions: Sequence[str], values, mask) -> tuple[np.ndarray, np.ndarray]:
    if values is None or mask is None:
        raise ValueError(f"{name} is a self-reward computed by the RL loop from the policy's per-token "
                         "distribution: name it under reward.extra (it cannot score text alone)")
    values, mask = np.asarray(values), np.asarray(mask)
    if values.shape[:1] != (len(completions),):
        raise ValueError(f"{name}: {len(completions)} completions but per-token values of shape {values.shape}")
    return values, mask


@register("reward", "rent", self_reward="token", statistic="entropy")
def rent(completions: Sequence[str], token_entropy=None, completion_mask=None) -> np.ndarray:
    """RENT's entropy-minimisation reward ("Maximizing Confidence Alone Improves Reasoning", Prabhudesai et al.,
    arXiv 2505.22660): `r(y) = -(1/|y|) sum_t H(p_t)`, `H(p_t) = -sum_v p_t(v) log p_t(v)` the entropy in nats
    of the policy's next-token distribution at completion token t, under the policy that sampled `y` (at the
    sampling temperature).

    Which tokens: all completion tokens (`completion_mask`; a multi-turn episode's model tokens, not its
    observations). The paper's base formula averages over every response token; its ablation finds the
    last chunk of the response correlates best with accuracy, but the split it uses depends on long
    chain-of-thought responses, so the plain mean is implemented. `completions` only sets the batch size.

    Args:
      token_entropy: `[B, N]` per-token entropy (nats), from the RL loop.
      completion_mask: `[B, N]` bool, the completion tokens.
    Returns `[B]` float32, <= 0 (0 for an empty completion).
    """
    values, mask = _token_arrays("rent", completions, token_entropy, completion_mask)
    return -masked_token_mean(values, mask)


@register("reward", "self_certainty", self_reward="token", statistic="self_certainty")
def self_certainty(completions: Sequence[str], token_self_certainty=None, completion_mask=None) -> np.ndarray:
    """INTUITOR's self-certainty reward ("Learning to Reason without External Rewards", Zhao et al.,
    arXiv 2505.19590): `r(y) = (1/|y|) sum_t KL(U || p_t)`, with
    `KL(U || p_t) = -log V - (1/V) sum_v log p_t(v)` over the V tokens of the policy's output vocabulary
    (its LM head's rows), `p_t` the next-token distribution at completion token t under the policy that
    sampled `y` (at the sampling temperature; the paper's `p_{pi_theta}(.|q, o_<i)`).

    `completions` only sets the batch size. Args: `token_self_certainty [B, N]` (nats, >= 0, from the RL
    loop), `completion_mask [B, N]` bool. Returns `[B]` float32, >= 0 (0 for an empty completion).
    """
    values, mask = _token_arrays("self_certainty", completions, token_self_certainty, completion_mask)
    return masked_token_mean(values, mask)


def ttrl_metrics(ttrl_rewards: np.ndarray, correct: np.ndarray, group_size: int,
                 prefix: str = "ttrl/") -> dict[str, float]:
    """How well TTRL's pseudo-labels track the truth in a batch of `[P * G]` samples (rows `p * G + g`),
    from its rewards and the verifiable reward `correct` (1 right, 0 wrong; scored but not trained on):

    - `label_accuracy`: share of prompts whose majority answer is right, judged as maj@k judges it: some
      sample that voted for it (TTRL reward 1) is correct; a prompt without an answer counts as wrong;
    - `reward_accuracy`: share of samples whose TTRL reward equals their verifiable reward.
    """
    votes = np.asarray(ttrl_rewards, np.float64).reshape(-1, group_size) > 0.5
    right = np.asarray(correct, np.float64).reshape(-1, group_size) > 0.5
    return {f"{prefix}label_accuracy": float((votes & right).any(axis=1).mean()),
            f"{prefix}reward_accuracy": float((votes == right).mean())}


def self_rewards_of(extra: Mapping[str, float], pieces: Mapping) -> dict[str, object]:
    """Name -> registry entry of each self-reward among `reward.extra`'s names (`pieces`: `Config.pieces()`)."""
    return {name: pieces[f"reward.extra.{name}"] for name in extra
            if pieces[f"reward.extra.{name}"].info.get("self_reward")}
