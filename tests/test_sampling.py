"""The jitted KV-cached sampler against a naive reference (full forward pass per step)."""

import jax
import jax.numpy as jnp
import numpy as np

import models
from jaxrl.sampling import FINISH_EOS, FINISH_LENGTH, SamplingConfig, filter_logits, sample

CONFIG = models.ModelConfig(vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=8, intermediate_size=64)
EOS, PAD = 3, 0


def _prompts():
    tokens = np.array([[0, 0, 2, 5, 6, 7], [2, 9, 8, 7, 6, 5], [0, 0, 0, 0, 2, 11]], np.int32)
    return jnp.asarray(tokens), jnp.asarray(tokens != 0)


def _naive_greedy(policy, tokens, valid, max_new):
    """Greedy decoding by re-running the full forward pass for every new token (no cache)."""
    out = []
    for _ in range(max_new):
        logits = models.forward(policy, tokens, valid)[:, -1]
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        out.append(nxt)
        tokens = jnp.concatenate([tokens, nxt[:, None]], 1)
        valid = jnp.concatenate([valid, jnp.ones_like(nxt[:, None], bool)], 1)
    return jnp.stack(out, 1)


def test_greedy_matches_naive_reference():
    policy = models.init(CONFIG, 0)
    tokens, valid = _prompts()
    config = SamplingConfig(max_new_tokens=10, temperature=0.0)
    rollout = sample(policy, tokens, valid, jax.random.key(0), config, eos_id=-1, pad_id=PAD)
    np.testing.assert_array_equal(rollout.completion_tokens, _naive_greedy(policy, tokens, valid, 10))
    assert rollout.completion_mask.all() and (rollout.finish_reason == FINISH_LENGTH).all()


def test_sampled_logps_match_full_forward():
    policy = models.init(CONFIG, 1)
    tokens, valid = _prompts()
    rollout = sample(policy, tokens, valid, jax.random.key(3), SamplingConfig(max_new_tokens=8), EOS, PAD)
    full_valid = jnp.concatenate([valid, jnp.ones(rollout.completion_mask.shape, bool)], 1)
    logp = jax.nn.log_softmax(models.forward(policy, rollout.tokens, full_valid), -1)
    prompt_len = tokens.shape[1]
    expected = jnp.take_along_axis(logp[:, prompt_len - 1:-1], rollout.completion_tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.where(rollout.completion_mask, rollout.sampler_logp, 0),
                               np.where(rollout.completion_mask, expected, 0), atol=1e-5)


def test_sampling_is_reproducible_for_a_seed():
    policy = models.init(CONFIG, 0)
    tokens, valid = _prompts()
    config = SamplingConfig(max_new_tokens=12, temperature=1.0, top_k=10, top_p=0.9)
    a = sample(policy, tokens, valid, jax.random.key(7), config, EOS, PAD)
    b = sample(policy, tokens, valid, jax.random.key(7), config, EOS, PAD)
    c = sample(policy, tokens, valid, jax.random.key(8), config, EOS, PAD)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.tokens, c.tokens)


def test_stops_at_eos_and_masks_after_it():
    policy = models.init(CONFIG, 0)
    tokens, valid = _prompts()
    # Make EOS overwhelmingly likely by making it the greedy choice: use the greedy token as "EOS".
    first = sample(policy, tokens, valid, jax.random.key(0), SamplingConfig(1, 0.0), -1, PAD).completion_tokens
    eos = int(first[0, 0])
    rollout = sample(policy, tokens, valid, jax.random.key(0), SamplingConfig(6, 0.0), eos, PAD)
    assert rollout.finish_reason[0] == FINISH_EOS
    assert rollout.completion_mask[0].tolist() == [True] + [False] * 5
    assert (rollout.completion_tokens[0, 1:] == PAD).all()


def test_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    top2 = filter_logits(logits, SamplingConfig(top_k=2))
    assert np.isfinite(top2[0, :2]).all() and np.isneginf(top2[0, 2:]).all()
    nucleus = filter_logits(logits, SamplingConfig(top_p=0.7))  # 0.5 + 0.3 reaches 0.7
    assert np.isfinite(nucleus[0, :2]).all() and np.isneginf(nucleus[0, 2:]).all()
    tiny = filter_logits(logits, SamplingConfig(top_p=0.01))  # the top token always survives
    assert np.isfinite(tiny[0, 0]) and np.isneginf(tiny[0, 1:]).all()
    hot = filter_logits(logits, SamplingConfig(temperature=2.0))
    np.testing.assert_allclose(hot, logits / 2.0)
