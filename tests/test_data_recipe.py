"""Prompt sets from files, chosen by a recipe: RL on a JSONL prompt set, bad rows stopping the run with
file, line and field named, or skipped and counted with `data.skip_bad_rows`."""

import json

import pytest

from jaxrl import cli, loop
from jaxrl.config import Config
from jaxrl.configlib import ConfigError, load_config
from jaxrl.data import arithmetic
from jaxrl.data.prompts import DataError
from jaxrl.metrics import read_metrics

TINY = [
    "model.hidden_size=32", "model.num_layers=2", "model.head_dim=8", "model.intermediate_size=64",
    "sft.steps=0", "rl.steps=2", "rl.prompts_per_step=4", "rl.group_size=4", "rl.sampling.max_new_tokens=16",
    "eval.every=0", "eval.batch_size=8", "checkpoint.every=0", "reward.function=math", "progress=false",
]


def _write_jsonl(path, rows):
    """GSM8K-style rows (worked solution ending in '#### N'); `rows` items are dicts or raw lines."""
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")


def _prompt_files(tmp_path, bad_train=(), bad_eval=()):
    train, held_out = arithmetic.make_splits(arithmetic.ArithmeticTaskConfig(num_train=40, num_eval=8), seed=0)
    row = lambda p: {"question": p.prompt, "answer": arithmetic.solution(p)}  # noqa: E731
    train_rows, eval_rows = [row(p) for p in train], [row(p) for p in held_out]
    for line, bad in bad_train:
        train_rows.insert(line - 1, bad)
    for line, bad in bad_eval:
        eval_rows.insert(line - 1, bad)
    _write_jsonl(tmp_path / "train.jsonl", train_rows)
    _write_jsonl(tmp_path / "eval.jsonl", eval_rows)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"data:\n  train_file: {tmp_path / 'train.jsonl'}\n  eval_file: {tmp_path / 'eval.jsonl'}\n"
                      f"  reference_pattern: '#### (.+)$'\n")
    return recipe


MISSING = {"question": "1+1="}  # no 'answer'
WRONG_TYPE = {"question": 7, "answer": "#### 7"}


def test_a_recipe_trains_on_prompt_files_and_counts_skipped_rows(tmp_path):
    recipe = _prompt_files(tmp_path, bad_train=[(5, MISSING), (9, WRONG_TYPE)], bad_eval=[(2, "{not json")])
    recipe.write_text(recipe.read_text() + "  skip_bad_rows: true\n")
    config = load_config(Config, recipe, [*TINY, f"output_dir={tmp_path / 'run'}"])
    summary = loop.run(config)
    assert summary["data_train_rows"] == 40 and summary["data_train_bad_rows_skipped"] == 2
    assert summary["data_eval_rows"] == 8 and summary["data_eval_bad_rows_skipped"] == 1
    assert summary["num_eval_problems"] == 8 and 0.0 <= summary["accuracy_after_rl"] <= 1.0
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in records] == [1, 2]


@pytest.mark.parametrize("bad, line, fragments", [
    (MISSING, 5, ["field 'answer' missing"]),
    (WRONG_TYPE, 9, ["field 'question' must be a string, got int"]),
    ({"question": "2+2=", "answer": "no hashes"}, 3, ["does not match reference_pattern"]),
])
def test_a_bad_row_stops_the_run_naming_file_line_and_field(tmp_path, capsys, bad, line, fragments):
    recipe = _prompt_files(tmp_path, bad_train=[(line, bad)])
    args = [*TINY, f"output_dir={tmp_path / 'run'}"]
    with pytest.raises(DataError) as error:
        loop.run(load_config(Config, recipe, args))
    for fragment in ["data.train_file", f"train.jsonl:{line}", *fragments]:
        assert fragment in str(error.value)
    assert cli.main(["train", str(recipe), *args]) == 2
    err = capsys.readouterr().err
    assert "jaxrl: data error: data.train_file" in err and f"train.jsonl:{line}" in err


def test_missing_prompt_file_and_inconsistent_data_config(tmp_path, capsys):
    recipe = _prompt_files(tmp_path)
    (tmp_path / "eval.jsonl").unlink()
    assert cli.main(["train", str(recipe), *TINY, f"output_dir={tmp_path / 'run'}"]) == 2
    assert "data.eval_file: prompt file not found" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="train_file and eval_file go together"):
        load_config(Config, None, ["data.train_file=x.jsonl"])
    with pytest.raises(ConfigError, match="set sft.steps=0"):
        load_config(Config, recipe)
    with pytest.raises(ConfigError, match="invalid prompt template"):
        load_config(Config, recipe, ["sft.steps=0", "data.template='Q: {question!r}'"])
