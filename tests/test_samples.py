"""samples.jsonl during RL and per-problem completions of an evaluation (jaxrl.samples)."""

import json

import numpy as np
import pytest

from jaxrl.samples import (SampleLog, completion_records, pick_rows, sequence_advantages, truncate_samples,
                           write_completions)


def _columns(batch: int, step: int):
    return dict(prompts=[f"p{i // 2}" for i in range(batch)], completions=[f"c{step}.{i}" for i in range(batch)],
                references=[i // 2 for i in range(batch)],
                components={"correct": [float(i % 2) for i in range(batch)], "format": [0.5] * batch},
                rewards=[float(i % 2) + 0.5 for i in range(batch)], advantages=np.linspace(-1, 1, batch),
                lengths=list(range(3, 3 + batch)), finish_reasons=[i % 2 for i in range(batch)])


def test_pick_rows_takes_one_row_per_group_first():
    assert pick_rows(8, 2, 3) == [0, 2, 4]  # 4 groups of 2: the first member of the first three
    assert pick_rows(8, 2, 6) == [0, 2, 4, 6, 1, 3]  # then the second members
    assert pick_rows(4, 2, 10) == [0, 2, 1, 3]  # never more than the batch


def test_sequence_advantage_is_the_mean_over_completion_tokens():
    per_token = np.array([[1.0, 3.0, 100.0], [2.0, 2.0, 2.0], [5.0, 5.0, 5.0]])
    mask = np.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    np.testing.assert_allclose(sequence_advantages(per_token, mask), [2.0, 2.0, 0.0])
    np.testing.assert_allclose(sequence_advantages(np.array([0.5, -0.5])), [0.5, -0.5])


def test_sample_log_writes_the_configured_rows_every_n_steps_and_resumes(tmp_path):
    path = tmp_path / "samples.jsonl"
    with SampleLog(path, every=2, rows=3, group_size=2) as log:
        for step in range(1, 7):
            log.write(step, **_columns(8, step))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 2, 2, 4, 4, 4, 6, 6, 6]
    assert records[0] == {"step": 2, "prompt": "p0", "completion": "c2.0", "reference": 0,
                          "rewards": {"correct": 0.0, "format": 0.5}, "reward": 0.5, "advantage": -1.0,
                          "length": 3, "finish_reason": "eos"}
    assert [r["completion"] for r in records[:3]] == ["c2.0", "c2.2", "c2.4"]
    with open(path, "a") as f:
        f.write('{"step": 8, "prom')  # a kill mid-write
    truncate_samples(path, 4)  # resumed from the checkpoint after RL step 4
    with SampleLog(path, every=2, rows=3, group_size=2) as log:
        for step in (5, 6):
            log.write(step, **_columns(8, step))
    again = [json.loads(line) for line in path.read_text().splitlines()]
    assert again == records  # the same file as the uninterrupted run's


def test_only_the_primary_process_writes_and_zero_is_off(tmp_path):
    for path, log in ((tmp_path / "a.jsonl", SampleLog(tmp_path / "a.jsonl", 1, 2, 2, primary=False)),
                      (tmp_path / "b.jsonl", SampleLog(tmp_path / "b.jsonl", 0, 2, 2))):
        assert not log.due(1)
        log.write(1, **_columns(4, 1))
        log.close()
        assert not path.exists()


def test_eval_completions_one_row_per_problem(tmp_path):
    records = completion_records(["1+1", "2+2"], ["2", {"a": 4}], ["2", "5"], np.array([1.0, 0.0]), [1, 1])
    write_completions(tmp_path / "out" / "completions.jsonl", records)
    lines = (tmp_path / "out" / "completions.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"prompt": "1+1", "reference": "2", "completion": "2", "reward/correct": 1.0, "length": 1},
        {"prompt": "2+2", "reference": {"a": 4}, "completion": "5", "reward/correct": 0.0, "length": 1}]
    with pytest.raises(ValueError, match="differ in length"):
        completion_records(["a"], ["b"], [], [1.0], [1])


def test_jaxrl_eval_writes_one_completion_per_held_out_problem(tmp_path, capsys):
    """`jaxrl eval ... --completions FILE`: one row per problem, whose rewards average to the printed accuracy."""
    from jaxrl import cli
    from jaxrl.data import arithmetic
    from test_pretrained_run import _checkpoint_with_tokenizer

    _checkpoint_with_tokenizer(tmp_path / "qwen")
    out = tmp_path / "eval" / "completions.jsonl"
    assert cli.main(["eval", "configs/default.yaml", f"checkpoint={tmp_path / 'qwen'}", "task.num_eval=8",
                     "progress=false", "eval.batch_size=8", "rl.sampling.max_new_tokens=4",
                     "--completions", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed[printed.index("{"):])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    held_out = arithmetic.make_splits(arithmetic.ArithmeticTaskConfig(num_eval=8), 0)[1]
    assert [r["prompt"] for r in rows] == [p.prompt for p in held_out]
    assert [r["reference"] for r in rows] == [p.reference for p in held_out]
    assert all(set(r) == {"prompt", "reference", "completion", "reward/correct", "length"} for r in rows)
    assert all(0 <= r["length"] <= 4 for r in rows)
    assert np.mean([r["reward/correct"] for r in rows]) == pytest.approx(result["eval/accuracy"])
    assert np.mean([r["length"] for r in rows]) == pytest.approx(result["eval/completion_length"])


def test_open_sample_log_follows_the_run_fresh_or_resumed(tmp_path):
    from jaxrl.config import Config
    from jaxrl.configlib import load_config
    from jaxrl.samples import open_sample_log

    config = load_config(Config, None, ["log.samples_every=1", "log.samples_per_step=2", "rl.group_size=2"])
    with open_sample_log(config, tmp_path, None, primary=True) as log:
        for step in (1, 2, 3):
            log.write(step, **_columns(4, step))
    steps = lambda: [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]  # noqa: E731
    assert steps() == [1, 1, 2, 2, 3, 3]
    open_sample_log(config, tmp_path, 2, primary=False).close()  # another process leaves the file alone
    assert steps() == [1, 1, 2, 2, 3, 3]
    open_sample_log(config, tmp_path, 2, primary=True).close()  # resumed after RL step 2
    assert steps() == [1, 1, 2, 2]
    open_sample_log(config, tmp_path, None, primary=True).close()  # a fresh run starts it empty
    assert (tmp_path / "samples.jsonl").read_text() == ""
