"""The built-in tool task: calculator demonstrations as segments, masks with holes on observations, the
tokenizer's tool symbols, the teacher's tool share, and the recipe file."""

import dataclasses

import numpy as np
import pytest

from jaxrl import configlib
from jaxrl.config import Config
from jaxrl.data import arithmetic as A
from jaxrl.loop import setup
from jaxrl.tokenizer import encode_completion, encode_examples, train_tokenizer

TOOLS = A.ArithmeticTaskConfig(min_steps=3, max_steps=8, tool_min_steps=7)
PROBLEM = A.Problem(23, (("+", 58), ("-", 19)))


@pytest.fixture(scope="module")
def tokenizer():
    train, _ = A.make_splits(dataclasses.replace(TOOLS, num_train=2000, num_eval=16), 0)
    return train_tokenizer(A.tokenizer_corpus(train, TOOLS), 32, user_symbols=A.tokenizer_symbols(TOOLS))


def test_tool_solution_is_the_exact_episode_text():
    assert A.tool_solution(PROBLEM) == (
        ("model", '<tool_call>{"name":"calculator","arguments":{"expression":"23+58-19"}}</tool_call>'),
        ("observation", "<tool_response>62</tool_response>"),
        ("model", "#### 62"))
    # the call parses back to the problem's expression, and the answer scores 1 under the task's reward
    from jaxrl.envs.tool_calls import parse_tool_calls
    from jaxrl.rewards.math import arithmetic_reward
    (call,) = parse_tool_calls(A.tool_solution(PROBLEM)[0][1], "hermes")
    assert (call.name, dict(call.arguments)) == ("calculator", {"expression": "23+58-19"})
    assert arithmetic_reward("".join(t for _, t in A.tool_solution(PROBLEM)), "62") == 1.0


def test_symbols_are_single_pieces_and_episodes_encode_piecewise(tokenizer):
    symbols = A.tokenizer_symbols(TOOLS)
    assert symbols == ("<tool_call>", '{"name":"calculator","arguments":{"expression":"', '"}}', "</tool_call>",
                       "<tool_response>", "</tool_response>")
    for s in symbols:
        assert len(tokenizer.encode(s)) == 1, s
    assert A.tokenizer_symbols(dataclasses.replace(TOOLS, tool_min_steps=0)) == ()
    assert A.tokenizer_symbols(dataclasses.replace(TOOLS, tool_min_steps=0, tool_rate=0.1)) == symbols
    segments = A.tool_solution(PROBLEM)
    whole = PROBLEM.prompt + "".join(t for _, t in segments)
    pieces = tokenizer.encode(PROBLEM.prompt) + [i for _, t in segments for i in tokenizer.encode(t)]
    assert pieces == tokenizer.encode(whole)
    assert tokenizer.decode(tokenizer.encode(whole)) == whole
    # the call: 4 fixed pieces + one per character of the expression (digits are split one per token)
    assert len(tokenizer.encode(segments[0][1])) == 4 + len("23+58-19")
    assert tokenizer.vocab_size <= 32


def test_user_symbols_are_checked():
    with pytest.raises(ValueError, match="whitespace"):
        train_tokenizer(["1+2=3"] * 20, 24, user_symbols=("<a b>",))


def test_encode_examples_masks_observation_tokens_out(tokenizer):
    segments = A.tool_solution(PROBLEM)
    plain = "23+58=81,81-19=62 #### 62"
    tokens, prompt_valid, mask = encode_examples(tokenizer, [PROBLEM.prompt, PROBLEM.prompt], [segments, plain], 16)
    # reference, by hand: each segment encoded alone, then EOS; trained = model segments and EOS
    call, obs, answer = (tokenizer.encode(t) for _, t in segments)
    expected = call + obs + answer + [tokenizer.eos_id]
    expected_mask = [True] * len(call) + [False] * len(obs) + [True] * (len(answer) + 1)
    width = tokens.shape[1] - 16
    assert width % 8 == 0 and width >= len(expected)
    np.testing.assert_array_equal(tokens[0, 16:16 + len(expected)], expected)
    np.testing.assert_array_equal(mask[0], expected_mask + [False] * (width - len(expected)))
    assert (tokens[0, 16 + len(expected):] == tokenizer.pad_id).all()
    assert len(obs) == 4 and not mask[0, len(call):len(call) + len(obs)].any()  # <tool_response> 6 2 </...>
    # a text completion: every token trained, as before
    text_ids = tokenizer.encode(plain) + [tokenizer.eos_id]
    np.testing.assert_array_equal(tokens[1, 16:16 + len(text_ids)], text_ids)
    assert mask[1].sum() == len(text_ids) and mask[1, :len(text_ids)].all()
    assert encode_completion(tokenizer, plain) == (text_ids, [True] * len(text_ids))


def test_segments_must_end_with_a_model_segment_and_be_well_formed(tokenizer):
    with pytest.raises(ValueError, match="last segment is 'observation'"):
        encode_completion(tokenizer, (("model", "<tool_call>"), ("observation", "<tool_response>1</tool_response>")))
    with pytest.raises(ValueError, match="segment 0 must be"):
        encode_completion(tokenizer, (("tool", "1"),))
    with pytest.raises(ValueError, match="at least one segment"):
        encode_completion(tokenizer, ())


def test_teacher_calls_the_calculator_on_long_chains_and_by_chance_on_others():
    train, _ = A.make_splits(dataclasses.replace(TOOLS, num_train=3000, num_eval=16), 0)
    stream = A.teacher_examples(train, TOOLS, seed=3)
    by_prompt = {p.prompt: p for p in train}
    examples = [next(stream) for _ in range(3000)]
    calls = [isinstance(s, tuple) for _, s in examples]
    long = [len(by_prompt[p].steps) >= 7 for p, _ in examples]
    assert calls == long  # tool_rate 0: exactly the chains of >= tool_min_steps steps
    assert 0.25 < np.mean(calls) < 0.42  # 2 of the 6 lengths 3..8
    for prompt, s in examples[:200]:
        if isinstance(s, tuple):
            assert s == A.tool_solution(by_prompt[prompt])
    half = A.teacher_examples(train, dataclasses.replace(TOOLS, tool_rate=0.5), seed=3)
    drawn = [next(half) for _ in range(4000)]
    is_long = np.array([len(by_prompt[p].steps) >= 7 for p, _ in drawn])
    called = np.array([isinstance(s, tuple) for _, s in drawn])
    assert called[is_long].all()
    assert abs(called[~is_long].mean() - 0.5) < 0.04  # the others: by chance


def test_without_tools_the_teacher_stream_is_unchanged():
    """tool_rate=0 (the default recipe): the same draws as the single-turn teacher (reference: its loop)."""
    config = A.ArithmeticTaskConfig(num_train=500, num_eval=16)
    train, _ = A.make_splits(config, 0)
    rng = np.random.default_rng([5, 2])
    reference = []
    for _ in range(300):
        p = train[int(rng.integers(len(train)))]
        reference.append((p.prompt, A.solution(p, config.teacher_carry_error_rate, rng)))
    stream = A.teacher_examples(train, config, seed=5)
    assert [next(stream) for _ in range(300)] == reference
    assert A.tokenizer_corpus(train) == A.tokenizer_corpus(train, config)


def test_tool_fields_are_checked():
    with pytest.raises(configlib.ConfigError, match="tool_min_steps"):
        configlib.load_config(Config, None, ["task.max_steps=4", "task.tool_min_steps=5"])
    with pytest.raises(configlib.ConfigError, match="tool_rate"):
        configlib.load_config(Config, None, ["task.tool_rate=1.5"])


def _recipe(tmp_path, *overrides) -> Config:
    return configlib.load_config(Config, "configs/tools.yaml", list(overrides))


def test_recipe_tokenizer_fits_the_model_and_keeps_the_symbols(tmp_path):
    config = _recipe(tmp_path, "task.num_train=4000", "task.num_eval=64")
    train, held_out, corpus, _ = setup.load_task(config)
    assert setup.tokenizer_symbols(config) == A.tokenizer_symbols(config.task) != ()
    tokenizer = train_tokenizer(corpus, config.tokenizer.vocab_size, user_symbols=setup.tokenizer_symbols(config))
    assert tokenizer.vocab_size <= config.model.vocab_size
    longest = max(len(encode_completion(tokenizer, A.solution(p))[0]) for p in train + held_out)
    episode = max(len(encode_completion(tokenizer, A.tool_solution(p))[0]) for p in train + held_out)
    assert episode < longest  # a calculator episode is shorter than a worked solution
    # the episode's token limits hold the longest worked solution and a call
    assert longest <= config.env.turn_tokens <= config.env.max_tokens
    assert max(len(tokenizer.encode(A.tool_solution(p)[1][1])) for p in held_out) <= config.env.observation_tokens
    with_file = dataclasses.replace(config, data=dataclasses.replace(config.data, train_file="x.jsonl"))
    assert setup.tokenizer_symbols(with_file) == ()
