"""Self-rewarding signals (issue 35): TTRL, RENT and INTUITOR's self-certainty against independent references
written from the papers' formulas (plain loops), their loop plumbing, and the config checks that refuse them
where they cannot work."""

from __future__ import annotations

import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import models, registry
from jaxrl.config import Config
from jaxrl.configlib import ConfigError, load_config
from jaxrl.loop import self_rewards
from jaxrl.loop.rollout import rollout_batch
from jaxrl.rewards import RewardResult, ScoredBatch
from jaxrl.rewards.scoring import reward_functions
from jaxrl.rewards.self_rewarding import majority_answer, rent, self_certainty, ttrl, ttrl_metrics
from jaxrl.sharding import layout_from
from jaxrl.train import completion_logprobs

DEFAULT = "configs/default.yaml"


# ---------------------------------------------------------------------------------------------------------------
# Independent references (plain Python / numpy loops from the papers' formulas)
# ---------------------------------------------------------------------------------------------------------------

def ref_ttrl(completions, group_size):
    """TTRL (arXiv 2504.16084): within each group the most frequent answer is the pseudo-label (ties: the one
    sampled first), reward 1 for agreeing with it; answers are the text after '####' (the only answer form the
    test completions use); no answer: no vote, reward 0."""
    out = []
    for start in range(0, len(completions), group_size):
        answers = []
        for text in completions[start:start + group_size]:
            m = re.search(r"####\s*(-?\d+)\s*$", text)
            answers.append(str(int(m.group(1))) if m else None)
        counts = {}
        for a in answers:
            if a is not None:
                counts[a] = counts.get(a, 0) + 1
        label = None
        for a in answers:  # first seen among the most frequent
            if a is not None and counts[a] == max(counts.values()) and label is None:
                label = a
        out += [1.0 if a is not None and a == label else 0.0 for a in answers]
    return out


def ref_token_mean(values, mask):
    out = []
    for row, m in zip(values, mask):
        picked = [float(v) for v, keep in zip(row, m) if keep]
        out.append(sum(picked) / len(picked) if picked else 0.0)
    return np.array(out)


def ref_entropy_and_certainty(hidden, unembedding, temperature, softcap):
    """Per token: H(p) = -sum_v p log p and KL(U || p) = sum_v (1/V) log((1/V) / p_v), from full float64 logits."""
    b, n, _ = hidden.shape
    vocab = unembedding.shape[0]
    entropy, certainty = np.zeros((b, n)), np.zeros((b, n))
    for i in range(b):
        for t in range(n):
            z = unembedding.astype(np.float64) @ hidden[i, t].astype(np.float64)
            if softcap is not None:
                z = softcap * np.tanh(z / softcap)
            z = z / temperature
            p = np.exp(z - z.max())
            p /= p.sum()
            entropy[i, t] = -sum(pv * math.log(pv) for pv in p)
            certainty[i, t] = sum((1.0 / vocab) * math.log((1.0 / vocab) / pv) for pv in p)
    return entropy, certainty


def _completions(rng, groups, group_size, pool=(3, 7, 12, -4)):
    texts = []
    for _ in range(groups * group_size):
        r = rng.random()
        if r < 0.15:
            texts.append("I do not know")  # no number anywhere: no answer
        else:
            texts.append(f"3+4 = 7 ... #### {rng.choice(pool)}")
    return texts


# ---------------------------------------------------------------------------------------------------------------
# TTRL
# ---------------------------------------------------------------------------------------------------------------

def test_ttrl_matches_reference_on_random_groups():
    rng = np.random.default_rng(0)
    for group_size in (2, 3, 8):
        texts = _completions(rng, 40, group_size)
        assert ttrl(texts, group_size=group_size) == ref_ttrl(texts, group_size)


def test_ttrl_ties_no_answers_and_one_group():
    # tie between 5 and 6: the one sampled first wins
    assert ttrl(["#### 6", "#### 5", "#### 5", "#### 6"], group_size=4) == [1.0, 0.0, 0.0, 1.0]
    assert ttrl(["#### 5", "#### 6", "#### 6", "#### 5"], group_size=4) == [1.0, 0.0, 0.0, 1.0]
    # a completion without an answer neither votes nor scores; a group without any answer scores 0
    assert ttrl(["#### 5", "no idea", "no idea", "no idea"], group_size=2) == [1.0, 0.0, 0.0, 0.0]
    # answers compare as maj@k compares them (normalised strings): 1,234 and 1234 agree, 4.0 and 4 do not
    assert ttrl(["#### 1,234", "#### 1234", "#### 9"], group_size=3) == [1.0, 1.0, 0.0]
    assert ttrl(["#### 4.0", "#### 4", "#### 4", "#### 4.0", "#### 4.0"], group_size=5) == [1.0, 0.0, 0.0, 1.0, 1.0]
    # group_size None: the whole list is one group
    assert ttrl(["#### 1", "#### 2", "#### 2"]) == [0.0, 1.0, 1.0]
    assert majority_answer([None, "b", "a", "a", "b"]) == "b" and majority_answer([None]) is None


def test_ttrl_refuses_groups_without_a_vote():
    with pytest.raises(ValueError, match="at least 2"):
        ttrl(["#### 1", "#### 2"], group_size=1)
    with pytest.raises(ValueError, match="do not split"):
        ttrl(["#### 1", "#### 2", "#### 3"], group_size=2)


def test_ttrl_never_sees_the_reference():
    """The registered reward takes the completions only: neither the pool nor the loop can hand it the
    reference answers (the loop calls it as fn(completions, group_size=G))."""
    entry = registry.resolve("reward", "ttrl", "reward.extra.ttrl")
    names, batched = registry.reward_arguments(entry.fn, "reward.extra.ttrl")
    assert names == ("completions",) and batched
    assert entry.info["self_reward"] == "group"


def test_ttrl_metrics_match_reference():
    rng = np.random.default_rng(1)
    g = 4
    texts = _completions(rng, 30, g, pool=(3, 7))
    rewards = np.array(ttrl(texts, group_size=g))
    truth = np.array([1.0 if t.endswith("#### 7") else 0.0 for t in texts])  # the true answer is 7
    got = ttrl_metrics(rewards, truth, g)
    labels_right, agree = [], []
    for p in range(30):
        answers = [t.rsplit("#### ", 1)[1] if "####" in t else None for t in texts[p * g:(p + 1) * g]]
        counts = Counter(a for a in answers if a is not None)
        label = next((a for a in answers if a is not None and counts[a] == max(counts.values())), None)
        labels_right.append(label == "7")
        agree += [rewards[p * g + i] == truth[p * g + i] for i in range(g)]
    assert got["ttrl/label_accuracy"] == pytest.approx(np.mean(labels_right))
    assert got["ttrl/reward_accuracy"] == pytest.approx(np.mean(agree))


# ---------------------------------------------------------------------------------------------------------------
# RENT and self-certainty: the host reductions, and the per-token statistics computed on the device
# ---------------------------------------------------------------------------------------------------------------

def test_rent_and_self_certainty_reduce_over_completion_tokens():
    rng = np.random.default_rng(2)
    values = rng.random((6, 9)) * 3
    mask = rng.random((6, 9)) < 0.6  # holes anywhere (multi-turn observations)
    mask[2] = False  # an empty completion
    texts = ["x"] * 6
    np.testing.assert_allclose(rent(texts, token_entropy=values, completion_mask=mask),
                               -ref_token_mean(values, mask), rtol=1e-6)
    np.testing.assert_allclose(self_certainty(texts, token_self_certainty=values, completion_mask=mask),
                               ref_token_mean(values, mask), rtol=1e-6)
    assert rent(texts, token_entropy=values, completion_mask=mask)[2] == 0.0
    with pytest.raises(ValueError, match="reward.extra"):
        rent(texts)  # scored as text alone (a pool): refused
    with pytest.raises(ValueError, match="5 completions"):
        self_certainty(texts[:5], token_self_certainty=values, completion_mask=mask)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_token_self_certainty_matches_full_logits(softcap):
    rng = np.random.default_rng(3)
    hidden = rng.normal(size=(3, 7, 8)).astype(np.float32)
    unembedding = rng.normal(size=(11, 8)).astype(np.float32)
    # chunk_size 8 over 3 rows: 2 positions per chunk, a padded last chunk; 1024: one chunk
    for chunk_size in (8, 1024):
        got = np.asarray(self_rewards.token_self_certainty(jnp.asarray(hidden), jnp.asarray(unembedding), 0.7,
                                                           softcap, chunk_size=chunk_size))
        _, want = ref_entropy_and_certainty(hidden, unembedding, 0.7, softcap)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        assert (got >= -1e-5).all()


def test_logprob_pass_with_certainty_matches_the_plain_pass_and_the_reference():
    config = models.ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                head_dim=8, intermediate_size=32)
    policy = models.init(config, 0)
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(3, 32, (4, 5 + 6)), jnp.int32)
    prompt_valid = jnp.asarray(np.arange(5)[None] >= np.array([[0], [2], [1], [3]]))
    @jax.jit  # one program (one compile): the pass with the certainty, the plain pass, the full logits
    def passes(policy, tokens, prompt_valid):
        return (self_rewards.completion_logprobs_with_certainty(policy, tokens, prompt_valid, 0.8),
                completion_logprobs(policy, tokens, prompt_valid, 0.8), _full_logits(policy, tokens, prompt_valid))

    (logp, entropy, certainty), (plain_logp, plain_entropy), full_logits = passes(policy, tokens, prompt_valid)
    np.testing.assert_allclose(np.asarray(logp), np.asarray(plain_logp), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(entropy), np.asarray(plain_entropy), rtol=1e-6, atol=1e-6)
    # the reference from the full logits of the same model: log-softmax over the vocabulary
    logits = np.asarray(full_logits, np.float64) / 0.8
    logq = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want_certainty = -np.log(32) - logq.mean(-1)
    want_entropy = -(np.exp(logq) * logq).sum(-1)
    np.testing.assert_allclose(np.asarray(certainty), want_certainty, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(entropy), want_entropy, rtol=1e-4, atol=1e-4)


def _full_logits(policy, tokens, prompt_valid):
    from jaxrl.train import _completion_hidden
    hidden = _completion_hidden(policy, tokens, prompt_valid)
    return jnp.einsum("bnd,vd->bnv", hidden.astype(jnp.float32), models.unembedding(policy).astype(jnp.float32))


# ---------------------------------------------------------------------------------------------------------------
# Loop plumbing: the scorer leaves them out, the loop adds them as components
# ---------------------------------------------------------------------------------------------------------------

def _scored(n):
    correct = np.zeros(n, np.float32)
    return ScoredBatch({"correct": correct}, {"correct": RewardResult(correct, 0, 0, 0.1)}, 0, 0, 0.1)


def test_loop_adds_group_and_token_self_rewards():
    config = load_config(Config, DEFAULT, ["reward.extra={ttrl: 1.0, rent: 0.5, self_certainty: 0.2}",
                                           "rl.group_size=4", "rl.prompts_per_step=2"])
    assert list(reward_functions(config)) == ["correct"]  # no worker pool for a self-reward
    assert self_rewards.token_statistics(config) == ("entropy", "self_certainty")
    texts = ["#### 1", "#### 1", "#### 2", "none", "#### 3", "#### 4", "#### 4", "#### 4"]
    scored = self_rewards.with_group_rewards(_scored(8), texts, config)
    np.testing.assert_array_equal(scored.components["ttrl"], ref_ttrl(texts, 4))
    rng = np.random.default_rng(5)
    mask = jnp.asarray(rng.random((8, 5)) < 0.7)
    stats = {"entropy": jnp.asarray(rng.random((8, 5)), jnp.float32),
             "self_certainty": jnp.asarray(rng.random((8, 5)), jnp.float32)}
    mesh = layout_from(config.mesh).mesh
    scored = self_rewards.with_token_rewards(scored, {"token_stats": stats, "completion_mask": mask}, texts,
                                             config, mesh)
    assert list(scored.components) == ["correct", "ttrl", "rent", "self_certainty"]
    np.testing.assert_allclose(scored.components["rent"], -ref_token_mean(np.asarray(stats["entropy"]),
                                                                          np.asarray(mask)), rtol=1e-6)
    np.testing.assert_allclose(scored.components["self_certainty"],
                               ref_token_mean(np.asarray(stats["self_certainty"]), np.asarray(mask)), rtol=1e-6)
    weights = config.component_weights()
    assert weights == {"correct": 1.0, "ttrl": 1.0, "rent": 0.5, "self_certainty": 0.2}
    metrics = self_rewards.step_metrics(scored.components, scored.rewards, config)
    assert set(metrics) == {"ttrl/label_accuracy", "ttrl/reward_accuracy"}


def test_rollout_batch_keeps_the_token_statistics_of_the_same_pass():
    class Rollout:
        tokens = jnp.zeros((2, 5), jnp.int32)
        prompt_valid = jnp.ones((2, 2), bool)
        completion_mask = jnp.ones((2, 3), bool)
        sampler_logp = jnp.zeros((2, 3))
        finish_reason = jnp.zeros((2,), jnp.int32)

    calls = []

    def logprob_fn(policy, tokens, prompt_valid, temperature):
        calls.append(1)
        return jnp.full((2, 3), -1.0), jnp.full((2, 3), 2.0), jnp.full((2, 3), 0.5)

    class State:
        policy, critic = None, None

    config = load_config(Config, DEFAULT, [])
    controls = type("C", (), {"temperature": 1.0})()
    batch = rollout_batch(State, logprob_fn, None, Rollout, config.rl.loss, controls,
                          token_stats=("entropy", "self_certainty"))
    assert len(calls) == 1 and "entropy" not in batch  # the dapo loss needs no entropy
    assert float(batch["token_stats"]["entropy"][0, 0]) == 2.0
    assert float(batch["token_stats"]["self_certainty"][0, 0]) == 0.5
    assert "token_stats" not in rollout_batch(State, logprob_fn, None, Rollout, config.rl.loss, controls)


def test_defaults_unchanged():
    config = load_config(Config, DEFAULT, [])
    assert config.reward.function_weight == 1.0
    assert config.component_weights() == {"correct": 1.0}
    assert self_rewards.token_statistics(config) == ()
    ttrl_only = load_config(Config, DEFAULT, ["reward.function_weight=0", "reward.extra={ttrl: 1.0}"])
    assert ttrl_only.component_weights() == {"correct": 0.0, "ttrl": 1.0}
    assert ttrl_only.reward.function == "arithmetic"  # still what the held-out evaluation scores with


# ---------------------------------------------------------------------------------------------------------------
# Bad input: a clear error naming the field
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, field, fragment", [
    (["reward.extra={no_such_reward: 1.0}"], "reward.extra.no_such_reward", "unknown reward"),
    (["reward.function=ttrl"], "reward.function", "is a self-reward"),
    (["eval.reward=rent"], "eval.reward", "is a self-reward"),
    (["reward.extra={ttrl: -1.0}"], "reward.extra.ttrl", ">= 0"),
    (["reward.extra={self_certainty: .nan}"], "reward.extra.self_certainty", None),
    (["reward.function_weight=-0.5"], "reward.function_weight", None),
    (["reward.function_weight=0"], "reward.function_weight", "nothing to train on"),
    (["reward.extra={ttrl: 1.0}", "rl.group_size=1"], "rl.group_size", None),
    (["reward.extra={ttrl: 1.0}", "rl.loss.advantage.estimator=remax"], "rl.loss.advantage.estimator",
     "greedy"),
    (["reward.extra={rent: 1.0}", "rl.dynamic_sampling.enabled=true"], "rl.dynamic_sampling.enabled", None),
    (["reward.extra={self_certainty: 1.0}", "rl.packing.enabled=true"], "rl.packing.enabled", None),
])
def test_bad_self_reward_configs_name_the_field(overrides, field, fragment):
    with pytest.raises(ConfigError) as error:
        load_config(Config, DEFAULT, overrides)
    message = str(error.value)
    assert field in message, message
    if fragment is not None:
        assert fragment in message, message


def test_ttrl_group_size_check_without_the_loader():
    """`rl.group_size`'s bound is checked by the loader; a Config built in Python meets the TTRL check."""
    import dataclasses
    config = load_config(Config, DEFAULT, ["reward.extra={ttrl: 1.0}"])
    config = dataclasses.replace(config, rl=dataclasses.replace(config.rl, group_size=1))
    with pytest.raises(registry.RegistryError, match="rl.group_size: .* no vote"):
        config.check_pieces()
