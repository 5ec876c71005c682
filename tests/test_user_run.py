"""End to end, as a user brings them: a tiny HF checkpoint, a chat `messages` JSONL with assistant answers, rewards
of their own (batched and stateful, per item with the row), and what the run logs (metrics.jsonl, samples.jsonl),
through `loop.run` and `jaxrl train` (--dry-run, --print-config)."""

import importlib
import json
import os
import shutil

import numpy as np
import pytest

from jaxrl import loop
from jaxrl.cli import main
from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.metrics import read_metrics
from jaxrl.tiny import write_tiny_checkpoint
from jaxrl.tokenizer import encode_prompt, load_tokenizer

# jaxrl.loop.warm_start is also a function, jaxrl.loop.generate the module of the Generator
warm_start_module = importlib.import_module("jaxrl.loop.warm_start")
generate_module = importlib.import_module("jaxrl.loop.generate")

SYSTEM = "Answer with the number only."


def _chat_row(a: int, b: int) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{a}+{b}="},
                         {"role": "assistant", "content": str(a + b)}], "question": f"{a}+{b}=", "level": a}


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
            "progress=false", "data.prompt_buckets=1", "log.samples_every=0", f"output_dir={output_dir}", *more]


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
    sampler's prompt tokens are those conversations too (the row's own system turn first)."""
    tmp, tiny = chat_files
    rows = _lines(tmp / "train.jsonl")
    answers = {_rendered(r): r["messages"][-1]["content"] for r in rows}
    examples, sampled = [], []
    encode, sample = warm_start_module.encode_examples, generate_module.sample

    def spy_encode(tokenizer, prompts, solutions, *args, **kwargs):
        examples.extend(zip(prompts, solutions))
        return encode(tokenizer, prompts, solutions, *args, **kwargs)

    def spy_sample(policy, tokens, valid, *args, **kwargs):
        tokens, valid = np.asarray(tokens), np.asarray(valid)
        sampled.extend(tuple(row[keep].tolist()) for row, keep in zip(tokens, valid))
        return sample(policy, tokens, valid, *args, **kwargs)

    monkeypatch.setattr(warm_start_module, "encode_examples", spy_encode)
    monkeypatch.setattr(generate_module, "sample", spy_sample)
    summary = _run(tmp, tiny, tmp_path / "run", "sft.steps=3", "sft.optim.learning_rate=0.01")

    # The warm start: 3 steps of 4 demonstrations, each the rendered conversation -> its assistant answer.
    assert len(examples) == 3 * 4
    for prompt, solution in examples:
        assert answers[prompt] == solution
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    sft = [r for r in records if r.get("phase") == "sft"]
    assert [r["step"] for r in sft] == [1, 3] and all(np.isfinite(r["loss"]) for r in sft)
    assert sft[-1]["loss"] < sft[0]["loss"]  # lr 0.01 on 8 short answers: the loss falls within 3 steps
    # Then RL on the same file: both steps ran, and every prompt the sampler was given is the tokens of a train or
    # eval conversation through ChatML (written out in `_rendered`, the row's own system turn first).
    updates = [r["step"] for r in records if r.get("phase") == "rl" and "train/loss" in r]
    assert updates == [1, 2] and summary["eval_reward"] == "math" and "accuracy_after_rl" in summary
    tokenizer = load_tokenizer(tiny)

    def ids(texts):
        return {tuple(encode_prompt(tokenizer, text, templated=True)) for text in texts}

    train_ids, eval_ids = ids(answers), ids(_rendered(r) for r in _lines(tmp / "eval.jsonl"))
    assert train_ids.isdisjoint(eval_ids)
    # 2 held-out evaluations of 2 problems, 2 RL steps of 2 prompts (each prefilled once for its 2 samples)
    assert len(sampled) == 2 * 2 + 2 * 2 and set(sampled) <= train_ids | eval_ids
    assert set(sampled) >= eval_ids and len(set(sampled) & train_ids) >= 2


SAMPLE_KEYS = {"step", "prompt", "completion", "reference", "rewards", "reward", "advantage", "length",
               "finish_reason"}


def test_samples_jsonl_holds_the_configured_rows_and_a_resume_keeps_it_consistent(chat_files, tmp_path):
    """log.samples_every=1, log.samples_per_step=3: 3 rows per RL step, each complete. A run stopped after
    step 3 wrote its samples but before its checkpoint (checkpoint 3 removed) resumes from checkpoint 2: the
    file again holds steps 1-3 once each, the first two steps' rows untouched, step 3's sampled again alike."""
    tmp, tiny = chat_files
    out = tmp_path / "run"
    more = ["rl.steps=3", "checkpoint.every=2", "log.samples_every=1", "log.samples_per_step=3"]
    _run(tmp, tiny, out, *more)
    first = _lines(out / "samples.jsonl")
    assert [r["step"] for r in first] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    questions = {r["question"]: r for r in _lines(tmp / "train.jsonl")}
    for record in first:
        assert set(record) == SAMPLE_KEYS and set(record["rewards"]) == {"correct"}
        row = questions[record["prompt"]]  # the row's prompt text (its last user message), not the ChatML
        assert record["reference"] == row["messages"][-1]["content"]
        assert record["finish_reason"] in ("eos", "length") and 1 <= record["length"] <= 4
        assert record["reward"] == record["rewards"]["correct"] and np.isfinite(record["advantage"])
    assert len({r["prompt"] for r in first if r["step"] == 1}) == 2  # one of each group first, then the second

    assert sorted(int(d) for d in os.listdir(out / "checkpoints") if d.isdigit()) == [2, 3]
    shutil.rmtree(out / "checkpoints" / "3")
    _run(tmp, tiny, out, *more, "resume=true")
    assert _lines(out / "samples.jsonl") == first


def test_batched_stateful_and_row_rewards_in_a_run(chat_files, tmp_path, monkeypatch):
    """reward.function takes prompt and row; reward.extra holds a batched reward class (one instance per worker)
    and a per-item reward of the row: each is logged as reward/<name> in metrics.jsonl and samples.jsonl.
    log.samples_every=2 over 3 steps logs step 2 alone."""
    tmp, tiny = chat_files
    instances = tmp_path / "judges"
    monkeypatch.setenv("REWARD_FNS_INSTANCES", str(instances))
    out = tmp_path / "run"
    summary = _run(tmp, tiny, out, "rl.steps=3", "reward.function=reward_fns:prompt_is_question",
                   "reward.extra={reward_fns:CountingJudge: 0.1, reward_fns:row_level: 0.5}",
                   "log.samples_every=2", "log.samples_per_step=3")
    updates = [r for r in read_metrics(str(out / "metrics.jsonl")) if "train/loss" in r]
    assert [r["step"] for r in updates] == [1, 2, 3]
    for record in updates:
        # Every completion's prompt is its row's question: the reward saw each item's own prompt and row.
        assert record["reward/correct"] == 1.0 and record["reward/reward_fns:CountingJudge"] == 1.0
        assert 1.0 <= record["reward/reward_fns:row_level"] <= 4.0
        assert record["reward/errors"] == 0.0 and record["reward/timeouts"] == 0.0
    # One judge in the extra's one worker, called with one chunk per step.
    (pid,) = instances.read_text().split()
    assert (tmp_path / "judges.calls").read_text().split("\n")[:-1] == [f"{pid} {n}" for n in (1, 2, 3)]

    samples = _lines(out / "samples.jsonl")
    assert [r["step"] for r in samples] == [2, 2, 2]
    for record in samples:
        level = float(record["prompt"].split("+")[0])  # the row's `level` is its first operand
        assert record["rewards"] == {"correct": 1.0, "reward_fns:CountingJudge": 1.0,
                                     "reward_fns:row_level": level}
        assert record["reward"] == pytest.approx(1.0 + 0.1 + 0.5 * level)
    # The held-out metric is named after the (non-binary) evaluation reward, which scores the eval rows.
    assert summary["eval_reward"] == "reward_fns:prompt_is_question"
    assert summary["reward_before_rl"] == summary["reward_after_rl"] == 1.0
    assert "accuracy_after_rl" not in summary


def _chat_recipe(tmp, tiny, output_dir):
    recipe = tmp / "chat.yaml"
    recipe.write_text("\n".join([
        "pretrained:", f"  path: {tiny}", "data:", f"  train_file: {tmp / 'train.jsonl'}",
        f"  eval_file: {tmp / 'eval.jsonl'}", "  format: messages", "  chat_template: true",
        "reward:", "  function: math", "sft:", "  steps: 2", f"output_dir: {output_dir}", ""]))
    return recipe


def test_dry_run_and_print_config_of_a_chat_recipe(chat_files, tmp_path, capsys):
    """`jaxrl train RECIPE --dry-run` prints the first conversation through the chat template and exits 0 without
    creating output_dir; `--print-config` shows data.format."""
    tmp, tiny = chat_files
    recipe = _chat_recipe(tmp_path, tiny, tmp_path / "out")
    shutil.copy(tmp / "train.jsonl", tmp_path / "train.jsonl")
    shutil.copy(tmp / "eval.jsonl", tmp_path / "eval.jsonl")
    assert main(["train", str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    first = _rendered(_lines(tmp / "train.jsonl")[0])
    assert "\n".join(f"    | {line}" for line in first.split("\n")) in out
    assert main(["train", str(recipe), "--print-config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith('  format: "messages"  # ') and '(changed)' in line for line in lines)
    assert not (tmp_path / "out").exists()


def test_a_conversation_that_ends_with_the_user_is_all_prompt(chat_files, tmp_path):
    """A multi-turn chat row whose last message is the user's (history, then the question to answer) is a prompt
    as a whole: its earlier assistant turn is history, neither the answer nor the reference. (It was cut to the
    turns before that assistant message, the trailing question dropped.) A chat row with a final answer and a
    null reference field (a Parquet column's gap) takes its reference from the answer (it was a bad row)."""
    from jaxrl.data.prompts import PromptFields, load_prompts
    from jaxrl.data.render import render_prompt
    from jaxrl.tokenizer import load_tokenizer

    _, tiny = chat_files
    turns = [{"role": "user", "content": "2+3="}, {"role": "assistant", "content": "5"},
             {"role": "user", "content": "times 4="}]
    path = tmp_path / "multi.jsonl"
    path.write_text(json.dumps({"messages": turns, "answer": "20"}) + "\n" +
                    json.dumps({"messages": [*turns, {"role": "assistant", "content": "20"}], "answer": None}) + "\n")
    (open_ended, answered), _ = load_prompts(path, PromptFields(format="messages"))
    for record in (open_ended, answered):  # a null reference field is no reference: the answer is
        assert (record.messages, record.prompt, record.reference) == (tuple(turns), "times 4=", "20")
    assert (open_ended.solution, answered.solution) == (None, "20")
    assert render_prompt(open_ended, load_tokenizer(tiny), chat_template=True) == (
        "<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n<|im_start|>user\ntimes 4=<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_dry_run_refuses_a_warm_start_without_demonstrations(chat_files, tmp_path, capsys):
    """sft.steps > 0 on a chat file without assistant answers: the run refuses it (NoDemonstrations, before any
    model loads), so the dry run should fail too, rather than report every check passed."""
    tmp, tiny = chat_files
    recipe = _chat_recipe(tmp_path, tiny, tmp_path / "out")
    rows = [{"messages": r["messages"][:-1], "answer": r["messages"][-1]["content"]}
            for r in _lines(tmp / "train.jsonl")]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.copy(tmp / "eval.jsonl", tmp_path / "eval.jsonl")
    assert main(["train", str(recipe), "--dry-run"]) == 2
    assert "needs demonstrations" in capsys.readouterr().out
