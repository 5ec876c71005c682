"""Multi-turn episodes: the KV cache kept across turns (`jaxrl.multiturn`) and the host driver
(`jaxrl.loop.episodes`) with an in-process environment."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import models, multiturn, sampling
from jaxrl.envs import EnvConfig, EnvStep
from jaxrl.loop import episodes as episodes_lib
from jaxrl.loop.generate import Generator
from jaxrl.sharding import make_mesh
from jaxrl.tokenizer import train_tokenizer

CONFIG = models.ModelConfig(vocab_size=32, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=128, max_position_embeddings=256)
STOP = 3


@pytest.fixture(scope="module")
def policy():
    return models.init(CONFIG, 0)


def _prompts(rng, num_prompts, length):
    tokens = rng.integers(4, 32, (num_prompts, length)).astype(np.int32)
    valid = np.ones((num_prompts, length), bool)
    valid[0, :3] = False
    tokens[0, :3] = 0
    return tokens, valid


def _history(tokens, valid, group, episodes):
    """Each row's whole history (prompt + episode so far), left-padded: the from-scratch prompt."""
    rows = [list(t[v]) for t, v in zip(np.repeat(tokens, group, 0), np.repeat(valid, group, 0))]
    lengths, ids = np.asarray(episodes.length), np.asarray(episodes.tokens)
    rows = [r + list(ids[b, :lengths[b]]) for b, r in enumerate(rows)]
    width = max(map(len, rows))
    out, out_valid = np.zeros((len(rows), width), np.int32), np.zeros((len(rows), width), bool)
    for b, r in enumerate(rows):
        out[b, width - len(r):], out_valid[b, width - len(r):] = r, True
    return out, out_valid


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decoding_after_an_observation_equals_decoding_the_history_from_scratch(policy, temperature):
    rng = np.random.default_rng(0)
    group, turn_tokens = 3, 6
    tokens, valid = _prompts(rng, 2, 8)
    config = sampling.SamplingConfig(max_new_tokens=8, temperature=temperature, top_k=20, top_p=0.95)
    ep = multiturn.start(policy, tokens, valid, group_size=group, capacity=40, spare=8, pad_id=0)
    active = jnp.ones(6, bool)
    ep, _ = multiturn.decode_turn(policy, ep, active, jax.random.key(1), config, (STOP,), 0, turn_tokens=5)
    observation_len = np.array([3, 0, 2, 3, 1, 3], np.int32)
    observation = rng.integers(4, 32, (6, 8)).astype(np.int32)
    ep = multiturn.append_observation(policy, ep, jnp.asarray(observation), jnp.asarray(observation_len))
    lengths = np.asarray(ep.length)
    history, history_valid = _history(tokens, valid, group, ep)
    key = jax.random.key(7)
    resumed, why = multiturn.decode_turn(policy, ep, active, key, config, (STOP,), 0, turn_tokens=turn_tokens)
    scratch = multiturn.start(policy, history, history_valid, group_size=1, capacity=2 * turn_tokens, spare=8,
                              pad_id=0)
    scratch, why_scratch = multiturn.decode_turn(policy, scratch, active, key, config, (STOP,), 0,
                                                 turn_tokens=turn_tokens)
    new_tokens = np.stack([np.asarray(resumed.tokens)[b, lengths[b]:lengths[b] + turn_tokens] for b in range(6)])
    new_logp = np.stack([np.asarray(resumed.sampler_logp)[b, lengths[b]:lengths[b] + turn_tokens] for b in range(6)])
    np.testing.assert_array_equal(new_tokens, np.asarray(scratch.tokens)[:, :turn_tokens])
    np.testing.assert_allclose(new_logp, np.asarray(scratch.sampler_logp)[:, :turn_tokens], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(why), np.asarray(why_scratch))
    # the observation's tokens are in the episode, outside the model mask
    mask = np.asarray(resumed.model_mask)
    for b in range(6):
        turn1 = int(np.asarray(ep.length)[b] - observation_len[b])
        np.testing.assert_array_equal(np.asarray(ep.tokens)[b, turn1:turn1 + observation_len[b]],
                                      observation[b, :observation_len[b]])
        assert not mask[b, turn1:turn1 + observation_len[b]].any()
        assert mask[b, :turn1].all()


def test_first_turn_equals_the_single_turn_sampler(policy):
    rng = np.random.default_rng(1)
    tokens, valid = _prompts(rng, 2, 8)
    key = jax.random.key(3)
    config = sampling.SamplingConfig(max_new_tokens=7, temperature=1.0, decode_segments=1)
    ep = multiturn.start(policy, tokens, valid, group_size=4, capacity=20, spare=8, pad_id=0)
    ep, _ = multiturn.decode_turn(policy, ep, jnp.ones(8, bool), key, config, (STOP,), 0, turn_tokens=7)
    single = sampling.sample(policy, tokens, valid, key, config, STOP, 0, group_size=4)
    mask = np.asarray(single.completion_mask)
    np.testing.assert_array_equal(np.asarray(ep.model_mask)[:, :7], mask)
    np.testing.assert_array_equal(np.asarray(ep.tokens)[:, :7] * mask, np.asarray(single.completion_tokens) * mask)
    np.testing.assert_allclose(np.asarray(ep.sampler_logp)[:, :7], np.asarray(single.sampler_logp), atol=1e-5)


def test_waiting_rows_are_left_exactly_as_they_are(policy):
    rng = np.random.default_rng(2)
    tokens, valid = _prompts(rng, 2, 8)
    config = sampling.SamplingConfig(max_new_tokens=8, temperature=1.0)
    ep = multiturn.start(policy, tokens, valid, group_size=2, capacity=20, spare=8, pad_id=0)
    ep, _ = multiturn.decode_turn(policy, ep, jnp.ones(4, bool), jax.random.key(0), config, (STOP,), 0,
                                  turn_tokens=4)
    active = jnp.asarray([True, False, True, False])
    after, _ = multiturn.decode_turn(policy, ep, active, jax.random.key(1), config, (STOP,), 0, turn_tokens=4)
    for field in ("length", "tokens", "model_mask", "sampler_logp", "logits"):
        np.testing.assert_array_equal(np.asarray(getattr(after, field))[1::2], np.asarray(getattr(ep, field))[1::2])
    assert (np.asarray(after.length)[::2] > np.asarray(ep.length)[::2]).all()


# --------------------------------------------------------------------------- the host driver


class _CountingPool:
    """An in-process stand-in for `EnvPool`: every turn but the `answer_at`-th gets the observation "=7;",
    and a reward part; the state counts the turns."""

    stop_strings = tuple("0123456789+-=;")  # every character ends a turn: a random policy's turns are short

    def __init__(self, answer_at):
        self.answer_at, self.steps = answer_at, []

    def reset(self, rows):
        return [(0, None) for _ in rows]

    def step(self, states, turns):
        self.steps.append(list(turns))
        return [EnvStep(None if s + 1 >= self.answer_at else "=7;", {"turn": 1.0}, s + 1, tool_calls=1)
                for s in states]


@dataclasses.dataclass(frozen=True)
class _Problem:
    prompt: str
    reference: str = "7"


def _driver(pool, tokenizer, **limits):
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    generate = Generator(tokenizer, (16,), mesh)
    settings = dict(max_turns=3, max_tokens=48, turn_tokens=6, observation_tokens=8)
    settings.update(limits)
    return episodes_lib.EpisodeGenerator(generate, pool, EnvConfig(**settings))


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["1+2+4=7;", "3+4=7;", "5-1=4;", "=7;"] * 50, 24)


def test_episodes_alternate_model_turns_and_observations_with_holes_in_the_mask(policy, tokenizer):
    pool = _CountingPool(answer_at=3)
    driver = _driver(pool, tokenizer)
    config = sampling.SamplingConfig(max_new_tokens=8, temperature=1.0)
    out = driver(policy, [_Problem("1+2+4="), _Problem("3+4=")], jax.random.key(0), config, group_size=2)
    observation_ids = tokenizer.encode("=7;")
    mask, tokens = out.local.completion_mask, out.local.completion_tokens
    prompt_len = out.local.prompt_valid.shape[1]
    assert out.local.tokens.shape[1] == prompt_len + 48
    for b, episode in enumerate(out.episodes):
        kinds = [k for k, _ in episode.turns]
        model_turns = kinds.count("model")
        assert kinds[0] == "model" and all(a != b for a, b in zip(kinds, kinds[1:]))
        # every stopped turn got "=7;" until the third, which ended the episode (or a budget ended it first)
        if episode.finish == episodes_lib.ANSWERED:
            assert model_turns == 3 and kinds.count("observation") == 2
        # the observation tokens sit in the episode, outside the mask; the model tokens inside it
        position = 0
        for kind, text in episode.turns:
            ids = observation_ids if kind == "observation" else None
            if ids is not None:
                np.testing.assert_array_equal(tokens[b, position:position + len(ids)], ids)
                assert not mask[b, position:position + len(ids)].any()
                position += len(ids)
            else:
                n = int(mask[b, position:].cumprod().sum())  # the model's run of tokens
                assert n >= 1
                position += n
        assert not mask[b, position:].any()
        assert out.texts[b] == episode.model_text
        assert "=7;" not in out.texts[b] or "=7;" in "".join(t for k, t in episode.turns if k == "model")
    metrics = episodes_lib.episode_metrics(out.episodes, mask.sum(1))
    assert metrics["episode/tool_use_rate"] == np.mean([e.tool_calls > 0 for e in out.episodes]) > 0.5
    assert metrics["episode/finish_answer_frac"] > 0.5
    assert 1.0 <= metrics["episode/turns_mean"] <= 3.0


def test_only_observation_tokens_are_prefilled(policy, tokenizer):
    pool = _CountingPool(answer_at=2)
    driver = _driver(pool, tokenizer, max_turns=2, turn_tokens=4)
    config = sampling.SamplingConfig(max_new_tokens=8, temperature=0.0)
    out = driver(policy, [_Problem("1+2+4=")], jax.random.key(0), config, group_size=2)
    # turn budget 4 ends turns without a stop unless the model stops: every stopped row got one observation,
    # appended as one bucket of 8 slots per row, and nothing else was run through the model again
    stepped = len(pool.steps[0]) if pool.steps else 0
    assert driver.prefilled_tokens == (2 * episodes_lib.OBSERVATION_BUCKET if stepped else 0)
    del out


def test_turn_credit_arrays_place_each_turns_reward_at_its_end():
    first = episodes_lib.Episode(spans=[(0, 3), (5, 7)], turn_rewards=[{"a": 0.5}, {"a": 0.25, "b": 1.0}])
    empty = episodes_lib.Episode(spans=[(0, 0)], turn_rewards=[{}])
    budget = episodes_lib.Episode(spans=[(0, 4)], turn_rewards=[{}])
    token_rewards, turn_ids = episodes_lib.turn_credit_arrays([first, empty, budget], np.array([2.75, 0.0, 1.0]), 8)
    np.testing.assert_allclose(token_rewards[0], [0, 0, 0.5, 0, 0, 0, 0.25 + 1.0 + 1.0, 0])  # 2.75 - 1.75 env
    np.testing.assert_array_equal(turn_ids[0], [0, 0, 0, -1, -1, 1, 1, -1])
    assert not token_rewards[1].any() and (turn_ids[1] == -1).all()
    np.testing.assert_allclose(token_rewards[2], [0, 0, 0, 1, 0, 0, 0, 0])
    np.testing.assert_allclose(token_rewards.sum(1), [2.75, 0.0, 1.0])
