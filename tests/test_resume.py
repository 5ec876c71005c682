"""Exact resume: a run killed with SIGKILL (or stopped by SIGTERM) and resumed with `resume=true` ends with
the parameters, optimizer state and metrics of a run that was never interrupted; bad resumes say why."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# A tiny, quick version of the default recipe. The entropy bonus gives every step a gradient even when the
# barely warm-started policy earns no reward.
RECIPE = [
    "model.hidden_size=32", "model.num_layers=2", "model.head_dim=8", "model.intermediate_size=64",
    "task.num_train=200", "task.num_eval=16", "sft.steps=5", "sft.batch_size=8", "rl.steps=12",
    "rl.prompts_per_step=4", "rl.group_size=4", "rl.minibatches=2", "rl.sampling.max_new_tokens=24",
    "rl.loss.entropy_coef=0.01", "rl.loss.kl_coef=0.01", "eval.every=0", "eval.batch_size=16",
    "checkpoint.every=4", "reward.num_workers=1", "progress=false",
]
LOCAL = ("sampler/compiled_programs",)


def _command(out, *extra):
    return [sys.executable, "-m", "jaxrl.cli", "train", "configs/default.yaml", *RECIPE, f"output_dir={out}", *extra]


def _env():
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _train(out, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(_command(out, *extra), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


def _train_side_by_side(*runs) -> list[subprocess.CompletedProcess]:
    """`_train(out, *extra)` for each `(out, *extra)` of `runs`, all at once (the suite's wall time; and
    results that must not depend on what else the machine runs)."""
    processes = [(run, subprocess.Popen(_command(*run), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)) for run in runs]
    results = []
    try:
        for run, process in processes:
            stdout, stderr = process.communicate(timeout=300)
            results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    finally:
        for _, process in processes:
            process.kill()
    return results


def _state(out, step):
    return ocp.StandardCheckpointer().restore(os.path.join(out, "checkpoints", str(step), "state"))


def _rl_records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if not k.startswith(LOCAL)} for r in records if r["phase"] == "rl"]


def _assert_same_state(a, b):
    leaves_a, leaves_b = jax_leaves(a), jax_leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0
    for (path, x), (_, y) in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(x, y, err_msg=path)  # bitwise


def jax_leaves(tree):
    import jax
    return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _damage(state_dir):
    """Overwrite the saved arrays of a checkpoint's `state` directory with garbage."""
    for name in os.listdir(state_dir):
        if (state_dir / name).is_dir():
            for root, _, files in os.walk(state_dir / name):
                for f in files:
                    with open(os.path.join(root, f), "wb") as handle:
                        handle.write(b"garbage")


def _flip_a_byte(state_dir):
    """Flip one bit of the middle byte of the largest data file of a checkpoint's `state` directory: inside the
    compressed chunks of its largest arrays, a change that orbax restores as other values without an error."""
    files = [os.path.join(root, f) for root, _, names in os.walk(state_dir) for f in names
             if os.path.basename(root) == "d"]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


def _interrupted(out, sig, after_step: int, *extra):
    """Start the run; send `sig` once the checkpoint of `after_step` is complete; return the process."""
    process = subprocess.Popen(_command(out, *extra), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    target = os.path.join(out, "checkpoints", str(after_step))
    deadline = time.time() + 240
    while not os.path.isdir(target) and process.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    process.send_signal(sig)
    process.communicate(timeout=120)
    return process


OFF_POLICY = ["rl.max_staleness=2", "rl.partial_rollouts.segment_tokens=8", "rl.loss.is_level=token"]


@pytest.mark.parametrize("off_policy", [False, True], ids=["synchronous", "staleness_2_partial_rollouts"])
def test_a_run_killed_with_sigkill_and_resumed_equals_an_uninterrupted_run(tmp_path, off_policy):
    """Killed after the checkpoint of step k = 4: resumed, its state at 2k = 8 and at 12 equals the
    uninterrupted run's bit for bit, and so do its metrics (but for the number of compiled programs, which a
    fresh process counts from zero). Also with rollouts up to 2 versions stale and partial rollouts: the groups
    carried over at the checkpoint are in it, and after a checkpoint the producer restarts from its version in
    both runs."""
    extra = OFF_POLICY if off_policy else []
    whole = _train(tmp_path / "whole", *extra)
    assert whole.returncode == 0, whole.stderr[-3000:]

    out = tmp_path / "killed"
    process = _interrupted(out, signal.SIGKILL, 4, *extra)
    assert process.returncode == -signal.SIGKILL
    assert not (out / "checkpoints" / "12").exists(), "the run finished before it could be killed"
    with open(out / "metrics.jsonl", "a") as f:  # as if the kill had cut a record short
        f.write('{"phase": "rl", "step": 7, "reward/me')
    resumed = _train(out, "resume=true", *extra)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr

    for step in (8, 12):  # 2k and the end
        _assert_same_state(_state(out, step), _state(tmp_path / "whole", step))
    before, after = _state(tmp_path / "whole", 8)["params"], _state(tmp_path / "whole", 12)["params"]
    assert any((x != y).any() for (_, x), (_, y) in zip(jax_leaves(before), jax_leaves(after))), "nothing trained"
    assert _rl_records(out) == _rl_records(tmp_path / "whole")
    if off_policy:
        records = [r for r in _rl_records(out) if "reward/mean" in r]  # the RL steps' records
        assert len(records) == 12
        stale = {r["step"]: r["offpolicy/staleness_max"] for r in records}
        assert max(stale.values()) == 2 and stale[1] == 0, stale  # the bound is reached, never passed
        assert sum(r["partial/carried_trained"] for r in records) > 0  # carried groups were trained
        assert all(abs(r["batch/is_weight_mean"] - 1) < 0.5 for r in records)  # the correction saw the lag
def test_sigterm_saves_a_checkpoint_and_the_run_resumes_from_it(tmp_path):
    """A preemption notice: the step in progress finishes, its checkpoint is written, the process exits 143."""
    out = tmp_path / "preempted"
    process = _interrupted(out, signal.SIGTERM, 4)
    assert process.returncode == 143, process.stderr
    steps = sorted(int(d) for d in os.listdir(out / "checkpoints") if d.isdigit())
    assert steps[-1] > 4 or steps == [4]  # the step after the signal was saved (or 4 itself)
    resumed = _train(out, "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (out / "checkpoints" / "12").is_dir()


def test_bad_resumes_name_the_problem(tmp_path):
    out = tmp_path / "run"
    missing, first = _train_side_by_side((tmp_path / "nothing", "resume=true"), (out, "rl.steps=4"))
    assert missing.returncode == 2
    assert "resume=true, but" in missing.stderr and "holds no checkpoint" in missing.stderr
    assert first.returncode == 0, first.stderr[-3000:]

    # Refused before they change anything, so they can all look at the run at once.
    records, saved_config = (out / "metrics.jsonl").read_bytes(), (out / "config.yaml").read_bytes()
    other_shape, other_data, other_loss, fewer_steps = _train_side_by_side(
        (out, "rl.steps=8", "model.hidden_size=64", "resume=true"),
        (out, "rl.steps=8", "rl.prompts_per_step=8", "task.num_train=300", "resume=true"),
        (out, "rl.steps=8", "rl.loss.kl_coef=0", "rl.loss.entropy_target=0.5", "resume=true"),
        (out, "rl.steps=3", "resume=true"))
    assert other_shape.returncode == 2
    assert "model.hidden_size: checkpoint 32, config 64" in other_shape.stderr, other_shape.stderr[-2000:]
    assert other_data.returncode == 2  # the saved data position would index another stream
    assert "task.num_train: checkpoint 200, config 300" in other_data.stderr, other_data.stderr[-2000:]
    assert "rl.prompts_per_step: checkpoint 4, config 8" in other_data.stderr
    assert other_loss.returncode == 2
    assert "the checkpoint holds a reference policy" in other_loss.stderr, other_loss.stderr[-2000:]
    assert "the checkpoint lacks an adaptive entropy state" in other_loss.stderr
    assert fewer_steps.returncode == 2  # nothing to run: the final record would describe step 4's parameters
    assert "already past rl.steps=3 (its newest checkpoint is after RL step 4)" in fewer_steps.stderr, \
        fewer_steps.stderr[-2000:]
    assert (out / "metrics.jsonl").read_bytes() == records and (out / "config.yaml").read_bytes() == saved_config

    _damage(out / "checkpoints" / "4" / "state")
    corrupt = _train(out, "rl.steps=8", "resume=true")
    assert corrupt.returncode == 2
    assert "cannot restore checkpoint 4" in corrupt.stderr, corrupt.stderr[-2000:]
    # the checkpoint is restored before the run's files change: the final evaluation record stays
    assert (out / "metrics.jsonl").read_bytes() == records and (out / "config.yaml").read_bytes() == saved_config


def test_two_runs_with_the_same_seed_write_identical_metrics(tmp_path):
    """Everything but wall-clock durations (kept in timings.jsonl) is a function of the seed and config."""
    runs = [tmp_path / "a", tmp_path / "b"]
    for result in _train_side_by_side(*[(out, "rl.steps=3", "checkpoint.every=0") for out in runs]):
        assert result.returncode == 0, result.stderr[-3000:]
    first, second = ((out / "metrics.jsonl").read_bytes() for out in runs)
    assert first == second and len(first.splitlines()) > 4
    timings = [json.loads(line) for line in (runs[0] / "timings.jsonl").read_text().splitlines()]
    assert {"phase", "step", "time/sample_s", "time/update_s"} <= set(timings[-2])
    assert not any(k.startswith("time/") for line in first.splitlines() for k in json.loads(line))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_older_one_resumed(tmp_path):
    """Checkpoints 4 and 8 (checkpoint.keep=2), one byte flipped in 8's array data, which orbax alone restores
    as other values: its digests name the array, the run resumes from 4, moves 8 to damaged_checkpoints/ (where
    orbax would keep it from saving steps up to 8), steps 5-8 come out as they did the first time, and 4 is
    still there after the resumed run's saves."""
    out = tmp_path / "run"
    first = _train(out, "rl.steps=8", "checkpoint.keep=2")
    assert first.returncode == 0, first.stderr[-3000:]
    saved, records = _state(out, 8), _rl_records(out)
    _flip_a_byte(out / "checkpoints" / "8" / "state")
    assert any((x != y).any() for (_, x), (_, y) in zip(jax_leaves(_state(out, 8)), jax_leaves(saved))), \
        "the flipped byte should restore as other values without the digests"

    resumed = _train(out, "rl.steps=8", "checkpoint.keep=2", "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    warnings = [line for line in resumed.stderr.splitlines() if "cannot restore checkpoint 8" in line]
    assert len(warnings) == 1 and "from the older checkpoint 4" in warnings[0], resumed.stderr[-3000:]
    assert re.search(r"CheckpointDamaged: checkpoint 8: array \S+ \(saved [0-9a-f]{16}, read [0-9a-f]{16}\) does not "
                     r"match its digest; resuming", warnings[0]), warnings[0]
    assert "resuming" in resumed.stderr and "after RL step 4" in resumed.stderr
    assert sorted(os.listdir(out / "damaged_checkpoints")) == ["8"]
    assert sorted(int(d) for d in os.listdir(out / "checkpoints") if d.isdigit()) == [4, 8]
    _assert_same_state(_state(out, 8), saved)
    assert _rl_records(out) == records
