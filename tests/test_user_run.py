"""End to end, as a user brings them: a tiny HF checkpoint, a chat `messages` JSONL with assistant answers, rewards
of their own (batched and stateful, per item with the row), and what the run logs (metrics.jsonl, samples.jsonl),
through `loop.run` and `jaxrl train` (--dry-run, --print-config)."""

import importlib
import json
import os

import numpy as np
import pytest

from jaxrl import loop
from jaxrl.cli import main
from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.loop.generate import Generator
from jaxrl.metrics import read_metrics
from jaxrl.tiny import write_tiny_checkpoint

warm_start_module = importlib.import_module("jaxrl.loop.warm_start")  # jaxrl.loop.warm_start is also a function

SYSTEM = "Answer with the number only."


def _chat_row(a: int, b: int) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{a}+{b}="},
                         {"role": "assistant", "content": str(a + b)}], "question": f"{a}+{b}="}


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    """The smallest tiny checkpoint, and chat train/eval files (system + user + assistant answer per row)."""
    tmp = tmp_path_factory.mktemp("user_run")
    tiny = write_tiny_checkpoint(tmp / "tiny", layers=1, hidden=16)
    for name, pairs in (("train", [(a, b) for a in range(1, 5) for b in range(1, 3)]), ("eval", [(7, 1), (2, 6)])):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(_chat_row(a, b)) + "\n" for a, b in pairs))
    return tmp, tiny


def _overrides(tmp, tiny, output_dir, *more):
    return [f"pretrained.path={tiny}", "pretrained.dtype=float32", "pretrained.attention_impl=xla",
            f"data.train_file={tmp / 'train.jsonl'}", f"data.eval_file={tmp / 'eval.jsonl'}",
            "data.format=messages", "data.chat_template=true", "sft.steps=0", "sft.batch_size=4", "rl.steps=2",
            "rl.prompts_per_step=2", "rl.group_size=2", "rl.sampling.max_new_tokens=4", "eval.every=0",
            "eval.batch_size=2", "checkpoint.every=0", "reward.function=math", "reward.num_workers=1",
            "progress=false", "log.samples_every=0", f"output_dir={output_dir}", *more]


def _run(tmp, tiny, output_dir, *more):
    return loop.run(load_config(Config, None, _overrides(tmp, tiny, output_dir, *more)))


def _rendered(row: dict) -> str:
    """ChatML of a chat row's conversation before its answer, ending with the assistant's generation prompt."""
    turns = row["messages"][:-1]
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in turns) + "<|im_start|>assistant\n"


def _lines(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_a_chat_file_gives_a_warm_start_then_rl(chat_files, tmp_path, monkeypatch):
    """Acceptance: a JSONL of chat `messages` with assistant answers gives a supervised warm start and then RL on
    the same file. The warm start learns the assistant answers after the ChatML-rendered conversations; the
    sampler sees those conversations too."""
    tmp, tiny = chat_files
    rows = _lines(tmp / "train.jsonl")
    answers = {_rendered(r): r["messages"][-1]["content"] for r in rows}
    examples, rendered = [], []
    encode = warm_start_module.encode_examples
    render = Generator.render

    def spy_encode(tokenizer, prompts, solutions, *args, **kwargs):
        examples.extend(zip(prompts, solutions))
        return encode(tokenizer, prompts, solutions, *args, **kwargs)

    def spy_render(self, item):
        text = render(self, item)
        rendered.append(text)
        return text

    monkeypatch.setattr(warm_start_module, "encode_examples", spy_encode)
    monkeypatch.setattr(Generator, "render", spy_render)
    summary = _run(tmp, tiny, tmp_path / "run", "sft.steps=3", "sft.optim.learning_rate=0.01")

    # The warm start: 3 steps of 4 demonstrations, each the rendered conversation -> its assistant answer.
    assert len(examples) == 3 * 4
    for prompt, solution in examples:
        assert answers[prompt] == solution
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    sft = [r for r in records if r.get("phase") == "sft"]
    assert [r["step"] for r in sft] == [1, 3] and all(np.isfinite(r["loss"]) for r in sft)
    assert sft[-1]["loss"] < sft[0]["loss"]  # lr 0.01 on 8 short answers: the loss falls within 3 steps
    # Then RL on the same file: both steps ran, and every prompt the sampler rendered is a train or eval
    # conversation through the chat template (the system turn is the row's own).
    updates = [r["step"] for r in records if r.get("phase") == "rl" and "train/loss" in r]
    assert updates == [1, 2] and summary["eval_reward"] == "math" and "accuracy_after_rl" in summary
    eval_prompts = {_rendered(r) for r in _lines(tmp / "eval.jsonl")}
    assert set(rendered) <= set(answers) | eval_prompts
    assert set(answers) & set(rendered) and eval_prompts <= set(rendered)
    assert all(text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n") for text in rendered)
