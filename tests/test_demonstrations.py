"""jaxrl.data.demonstrations: (record, solution) pairs for a supervised warm start from a data file, and the
config rule that allows sft.steps with a prompt file that gives demonstrations."""

import itertools
import json

import pytest

from jaxrl.config import Config
from jaxrl.configlib import ConfigError, load_config
from jaxrl.data.demonstrations import NoDemonstrations, demonstration_batches, demonstrations
from jaxrl.data.prompts import DataError, PromptFields, PromptRecord, load_prompts


def _records(n, every=2):
    """n records; every `every`-th has a solution."""
    return [PromptRecord(f"p{i}", str(i), f"f:{i + 1}", solution=f"s{i}" if i % every == 0 else None)
            for i in range(n)]


def _take(iterator, k):
    return [(r.source, s) for r, s in itertools.islice(iterator, k)]


def test_pairs_are_the_records_with_a_solution_shuffled_and_endless():
    records = _records(12)
    first = _take(demonstrations(records, seed=0), 18)
    assert sorted(first[:6]) == sorted((r.source, r.solution) for r in records if r.solution)  # an epoch
    assert sorted(first[6:12]) == sorted(first[:6]) and first[6:12] != first[:6]  # then a new order
    solutions = {r.source: r.solution for r in records}
    assert all(solutions[source] == solution for source, solution in first)  # each pair is one record's


def test_same_seed_same_order_and_restorable():
    records = _records(20)
    assert _take(demonstrations(records, seed=3), 25) == _take(demonstrations(records, seed=3), 25)
    assert _take(demonstrations(records, seed=4), 25) != _take(demonstrations(records, seed=3), 25)
    it = demonstrations(records, seed=3)
    _take(it, 7)
    state = it.get_state()
    rest = _take(it, 9)
    again = demonstrations(records, seed=3)
    again.set_state(state)
    assert _take(again, 9) == rest


def test_batches():
    batches = demonstration_batches(_records(10), batch_size=4, seed=0)
    batch = next(batches)
    assert len(batch) == 4 and all(r.solution == s for r, s in batch)
    assert [[r.source for r, _ in next(demonstration_batches(_records(10), 4, 0))]] == [[r.source for r, _ in batch]]


def test_no_demonstrations_is_a_clear_error():
    with pytest.raises(NoDemonstrations, match="data.train_file: the supervised warm start .* none of its 3 "
                                               "records has one: set data.solution_field"):
        demonstrations(_records(4, every=99)[1:], seed=0)  # record 0 has one
    assert issubclass(NoDemonstrations, DataError)


def test_from_a_messages_file(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": f"{i + 1}"}]}
            for i in range(3)] + [{"messages": [{"role": "user", "content": "open?"}], "answer": "x"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, _ = load_prompts(path, PromptFields(format="messages"))
    pairs = _take(demonstrations(records, seed=0), 3)
    assert sorted(pairs) == [(f"{path}:{i + 1}", str(i + 1)) for i in range(3)]  # the unanswered row has none


SFT_WITH_FILES = ["data.train_file=t.jsonl", "data.eval_file=e.jsonl", "sft.steps=10"]


def test_config_allows_a_warm_start_from_demonstrations():
    with pytest.raises(ConfigError, match="gives the warm start no demonstrations: set data.solution_field"):
        load_config(Config, None, SFT_WITH_FILES)
    assert load_config(Config, None, [*SFT_WITH_FILES, "data.solution_field=solution"]).sft.steps == 10
    assert load_config(Config, None, [*SFT_WITH_FILES, "data.format=messages", "data.chat_template=true"])
    assert load_config(Config, None, ["sft.steps=10"]).data.train_file is None  # the built-in teacher


def test_a_chat_file_gives_warm_start_examples(tmp_path):
    """The warm start's path, short of the model: chat rows -> demonstrations -> render_prompt -> encode_examples
    (the tiny checkpoint's ChatML tokenizer): the tokens are the conversation, then the answer and EOS."""
    from jaxrl.data.render import render_prompt
    from jaxrl.tiny import write_tiny_checkpoint
    from jaxrl.tokenizer import encode_examples, load_tokenizer

    tokenizer = load_tokenizer(write_tiny_checkpoint(tmp_path / "tiny", layers=1, hidden=16))
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+1?"},
                          {"role": "assistant", "content": f"{i + 1}"}]} for i in range(4)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, _ = load_prompts(path, PromptFields(format="messages"))
    (record, solution), = itertools.islice(demonstrations(records, seed=0), 1)
    prompt = render_prompt(record, tokenizer, chat_template=True)
    tokens, prompt_valid, mask = encode_examples(tokenizer, [prompt], [solution], 64, templated=True)
    i = int(solution) - 1
    assert prompt == (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{i}+1?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert tokens[0, :64][prompt_valid[0]].tolist() == tokenizer.encode(prompt)
    assert tokens[0, 64:][mask[0]].tolist() == [*tokenizer.encode(solution), tokenizer.eos_id]
