"""What the notebooks do with `loop.run`: a warm-start-only run (`rl.steps=0`) that later runs start from, and a
reward of their own named as `module:function`."""

import os
import sys

import pytest

from jaxrl import loop
from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.metrics import read_metrics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_rl_step import TINY  # noqa: E402


def test_runs_start_from_a_warm_start_only_run_and_take_a_reward_function(tmp_path):
    warm_dir, branch_dir = tmp_path / "warm", tmp_path / "branch"
    warm = loop.run(load_config(Config, "configs/default.yaml", [*TINY, "rl.steps=0", f"output_dir={warm_dir}"]))
    assert os.path.isdir(warm_dir / "checkpoints" / "0")
    warm_eval = [r for r in read_metrics(warm_dir / "metrics.jsonl") if r.get("final")][0]

    config = load_config(Config, "configs/default.yaml", [
        *TINY, f"pretrained.path={warm_dir}", "sft.steps=0", "rl.steps=1", f"output_dir={branch_dir}",
        "reward.function=reward_fns:quarter"])
    branch = loop.run(config)
    records = read_metrics(branch_dir / "metrics.jsonl")
    start = next(r for r in records if r["step"] == 0 and "eval/sample" in r)
    # The branch starts from the warm-started policy and its tokenizer: the same greedy completions.
    assert start["eval/sample"] == warm_eval["eval/sample"]
    assert start["eval/completion_length"] == warm_eval["eval/completion_length"]
    assert branch["num_parameters"] == warm["num_parameters"]
    assert (branch_dir / "tokenizer.model").read_bytes() == (warm_dir / "tokenizer.model").read_bytes()
    # Training and evaluation scored every completion with the configured reward; its mean is no accuracy.
    assert [r["reward/mean"] for r in records if "reward/mean" in r] == [0.25]
    assert branch["reward_before_rl"] == branch["reward_after_rl"] == 0.25 and "accuracy_after_rl" not in branch
    assert branch["eval_reward"] == "reward_fns:quarter"
    assert [r["eval/reward"] for r in records if "eval/reward" in r] == [0.25, 0.25]


def test_a_fresh_run_never_takes_over_another_runs_checkpoints(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("HOME", str(tmp_path))
    overrides = [*TINY, "rl.steps=0", f"output_dir={out}"]
    loop.run(load_config(Config, "configs/default.yaml", [*TINY, "rl.steps=0", "output_dir=~/run"]))  # ~ expands
    assert not os.path.exists("~")
    metrics = (out / "metrics.jsonl").read_bytes()
    # Restarted without resume=true (a preempted job's command): refused before anything in the dir changes,
    # and so is a config that fails later checks.
    for extra in ([], ["mesh.data=2"]):
        with pytest.raises(ValueError, match="holds a run with checkpoints .* resume=true .* overwrite=true"):
            loop.run(load_config(Config, "configs/default.yaml", [*overrides, *extra]))
    with pytest.raises(ValueError, match="pretrained.path is output_dir"):
        loop.run(load_config(Config, "configs/default.yaml", [
            *overrides, f"pretrained.path={out}", "sft.steps=0", "overwrite=true"]))
    assert (out / "metrics.jsonl").read_bytes() == metrics and os.path.isdir(out / "checkpoints" / "0")
    # a check that fails after the output-dir check (here: the mesh) also leaves the run as it was
    with pytest.raises(ValueError, match="mesh"):
        loop.run(load_config(Config, "configs/default.yaml", [*overrides, "overwrite=true", "mesh.data=2"]))
    assert (out / "metrics.jsonl").read_bytes() == metrics and os.path.isdir(out / "checkpoints" / "0")
    loop.run(load_config(Config, "configs/default.yaml", [*overrides, "overwrite=true", "seed=1"]))
    assert (out / "metrics.jsonl").read_bytes() != metrics and os.path.isdir(out / "checkpoints" / "0")


def test_resumed_run_keeps_counting_reward_errors(tmp_path):
    """summary.json's totals cover the whole run, not just the part after the resume."""
    import shutil

    overrides = [*TINY, "rl.steps=4", "checkpoint.every=2", f"output_dir={tmp_path}",
                 "reward.function=reward_fns:fails_on_odd_length"]
    whole = loop.run(load_config(Config, "configs/default.yaml", overrides))
    assert whole["reward_errors_total"] > 0
    shutil.rmtree(tmp_path / "checkpoints" / "4")  # as if the run had died after step 2's checkpoint
    resumed = loop.run(load_config(Config, "configs/default.yaml", [*overrides, "resume=true"]))
    assert resumed["reward_errors_total"] == whole["reward_errors_total"]
    assert resumed["reward_after_rl"] == whole["reward_after_rl"]
