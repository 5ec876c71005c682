"""Own pieces from YAML only (tests/custom_pieces): a reward named `module:function`, an objective and an
advantage estimator registered by a module under `imports:`. A `jaxrl train` run records them (and their source
hashes) in config.yaml; resuming from that file continues with them bit for bit; a changed source is refused by
name; a wrong signature is refused when the config loads, before any model or data."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml

from jaxrl.config import Config
from jaxrl.configlib import ConfigError, load_config

HERE = os.path.dirname(os.path.abspath(__file__))
PIECES = os.path.join(HERE, "custom_pieces")
TIMINGS = ("time/", "sampler/compiled_programs", "eval/seconds", "eval/sampling/seconds")


def _project(tmp_path):
    """A user's project directory: the recipe and the modules beside it (the working directory of the run)."""
    project = tmp_path / "project"
    shutil.copytree(PIECES, project)
    return project


def _train(project, *args, wait=True):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("PYTHONPATH", None)  # the project's modules import from the working directory, as a user's would
    command = [sys.executable, "-m", "jaxrl.cli", "train", *args]
    process = subprocess.Popen(command, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    if not wait:
        return process
    stdout, stderr = process.communicate(timeout=400)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _finish(process):
    stdout, stderr = process.communicate(timeout=400)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _rl_records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if not k.startswith(TIMINGS)} for r in records if r["phase"] == "rl"]


def _params(out, step):
    return ocp.StandardCheckpointer().restore(os.path.join(out, "checkpoints", str(step), "state"))["params"]


def test_own_pieces_from_yaml_record_and_resume_bit_for_bit(tmp_path):
    project = _project(tmp_path)
    whole, part = project / "runs" / "whole", project / "runs" / "part"
    # the uninterrupted run and the first half of the other, side by side
    runs = [_train(project, "recipe.yaml", f"output_dir={whole}", wait=False),
            _train(project, "recipe.yaml", f"output_dir={part}", "rl.steps=2", wait=False)]
    for result in map(_finish, runs):
        assert result.returncode == 0, result.stderr[-3000:]

    saved = yaml.safe_load((part / "config.yaml").read_text())
    assert saved["imports"] == ["my_losses"]
    assert saved["reward"]["function"] == "my_rewards:step_credit"
    assert saved["rl"]["loss"]["objective"] == "tanh_surrogate"
    assert saved["rl"]["loss"]["advantage"]["estimator"] == "median_baseline"
    recorded = {field: (source, digest) for field, source, digest in saved["piece_sources"]}
    assert recorded["reward.function"][0] == "my_rewards:step_credit"
    assert recorded["rl.loss.objective"][0] == "my_losses:tanh_surrogate"
    assert recorded["rl.loss.advantage.estimator"][0] == "my_losses:median_baseline"
    assert recorded["log.writers[0]"][0] == "my_writer:JsonlCopy"
    with open(whole / "JsonlCopy" / "records.jsonl") as f:  # the writer got every record metrics.jsonl got
        copied = [json.loads(line) for line in f]
    with open(whole / "metrics.jsonl") as f:
        assert [r["step"] for r in copied] == [json.loads(line)["step"] for line in f]
    summary = json.loads((part / "summary.json").read_text())
    assert summary["piece_sources"] == saved["piece_sources"]
    assert _rl_records(part)[1]["step"] == 1 and "reward/mean" in _rl_records(part)[1]

    # a changed source is refused by name, before anything is written
    rewards = project / "my_rewards.py"
    original = rewards.read_text()
    rewards.write_text(original.replace("at most 3", "at most three"))
    refused = _train(project, str(part / "config.yaml"), "resume=true", "rl.steps=4")
    assert refused.returncode == 2
    assert "reward.function" in refused.stderr and "my_rewards:step_credit" in refused.stderr
    assert "changed" in refused.stderr and "resume_changed_pieces" in refused.stderr
    rewards.write_text(original)

    # resumed from the run's own config.yaml: the same pieces, bit for bit
    resumed = _train(project, str(part / "config.yaml"), "resume=true", "rl.steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _rl_records(part) == _rl_records(whole)
    for a, b in zip(*(jax_leaves(_params(out, 4)) for out in (part, whole))):
        np.testing.assert_array_equal(a, b)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


@pytest.mark.parametrize("override, field, expected", [
    ("reward.function=bad_pieces:reward_of_two", "reward.function",
     "a reward takes per completion any of (prompt, completion, reference, row)"),
    ("rl.loss.objective=bad_pieces:objective_of_three", "rl.loss.objective",
     "log_ratio, advantages, logp, mask, eps_low, eps_high, dual_clip_c"),
    ("rl.loss.advantage.estimator=bad_pieces:advantage_of_rewards", "rl.loss.advantage.estimator",
     "(inputs, config)"),
    ("rl.loss.objective=no_such_module:f", "rl.loss.objective", "cannot import module 'no_such_module'"),
    ("rl.loss.advantage.estimator=median", "rl.loss.advantage.estimator", "'median_baseline'"),
])
def test_a_wrong_piece_is_refused_when_the_config_loads(monkeypatch, override, field, expected):
    monkeypatch.syspath_prepend(PIECES)
    with pytest.raises(ConfigError) as error:
        load_config(Config, os.path.join(PIECES, "recipe.yaml"), [override])
    message = str(error.value)
    assert f"override {override!r}" in message and f"{field}:" in message
    assert expected in message


def test_a_wrong_signature_stops_jaxrl_train_before_anything_loads(tmp_path):
    project = _project(tmp_path)
    result = _train(project, "recipe.yaml", "reward.function=bad_pieces:reward_of_two", "output_dir=runs/bad")
    assert result.returncode == 2
    assert result.stderr.startswith("jaxrl: configuration error:")
    assert "reward.function" in result.stderr and "reward_of_two(text, answer)" in result.stderr
    assert not (project / "runs").exists()


def test_imports_that_fail_name_the_list_entry(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(PIECES)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("imports: [my_losses, not_a_module]\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml:1: imports\[1\]: cannot import module 'not_a_module'"):
        load_config(Config, recipe)
