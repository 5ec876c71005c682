"""The acceptance run: the default recipe teaches the policy, for two seeds (slow: ~2.5 min per seed on 2 CPU cores)."""

import pytest

from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.loop import run


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_default_recipe_learns(tmp_path, seed):
    config = load_config(Config, "configs/default.yaml", [f"seed={seed}", f"output_dir={tmp_path}",
                                                           "progress=false"])
    summary = run(config)
    assert summary["num_eval_problems"] >= 200
    assert summary["accuracy_after_rl"] >= 0.50
    assert summary["accuracy_after_rl"] - summary["accuracy_before_rl"] >= 0.20
    assert summary["total_wall_time_s"] <= 600


@pytest.mark.slow
def test_two_runs_of_the_default_recipe_write_identical_metrics(tmp_path):
    """Determinism of the whole recipe (warm start, GRPO, evaluations, checkpoints): same seed and config, the
    same metrics file byte for byte (wall-clock durations live in timings.jsonl)."""
    files = []
    for name in ("a", "b"):
        config = load_config(Config, "configs/default.yaml", [f"output_dir={tmp_path / name}", "progress=false"])
        run(config)
        files.append((tmp_path / name / "metrics.jsonl").read_bytes())
    assert files[0] == files[1] and files[0].count(b"\n") > 100


def _tensorboard_scalars(directory) -> list[tuple[str, int, float]]:
    """Every scalar of every event file in `directory`, read record by record (TFRecord framing around `Event`
    protos)."""
    import struct

    from tensorboardX.proto import event_pb2

    scalars = []
    for events in sorted(directory.iterdir()):
        data = events.read_bytes()
        while data:
            (length,) = struct.unpack("<Q", data[:8])
            event = event_pb2.Event.FromString(data[12:12 + length])
            data = data[12 + length + 4:]
            scalars += [(value.tag, event.step, value.simple_value) for value in event.summary.value]
    return scalars


def test_metrics_writer_mirrors_scalars_to_tensorboard(tmp_path):
    """`tensorboard=true`: every numeric metric of a record becomes a scalar `<phase>/<key>` at its step."""
    from jaxrl.metrics import MetricsWriter, TensorBoardMirror

    with MetricsWriter(tmp_path / "m.jsonl", tmp_path / "t.jsonl", [TensorBoardMirror(tmp_path / "tb")]) as writer:
        writer.write({"phase": "rl", "step": 3, "reward/mean": 0.25, "train/entropy": 1.5, "time/sample_s": 0.1,
                      "note": "text is skipped"})
        writer.write({"phase": "sft", "step": 7, "train/loss": 2.0})
    scalars = {(tag, step): value for tag, step, value in _tensorboard_scalars(tmp_path / "tb")}
    assert scalars == {("rl/reward/mean", 3): 0.25, ("rl/train/entropy", 3): 1.5, ("rl/time/sample_s", 3):
                       pytest.approx(0.1), ("sft/train/loss", 7): 2.0}


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path):
    """A resumed run truncates its records to the checkpoint and writes the later steps again: the event files
    are rebuilt from the kept records, so every (tag, step) appears once, with the resumed run's value, and the
    warm-start (SFT) steps survive."""
    from jaxrl.metrics import MetricsWriter, TensorBoardMirror

    paths = tmp_path / "m.jsonl", tmp_path / "t.jsonl"
    with MetricsWriter(*paths, [TensorBoardMirror(tmp_path / "tb")]) as writer:
        writer.write({"phase": "sft", "step": 5, "train/loss": 2.0})
        for step in (1, 2, 3):
            writer.write({"phase": "rl", "step": step, "reward/mean": float(step), "time/step_s": 0.5})
    for path in paths:  # what the loop keeps when it resumes after RL step 1
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(line for line in lines if '"step": 2' not in line and '"step": 3' not in line))
    with MetricsWriter(*paths, [TensorBoardMirror(tmp_path / "tb")]) as writer:
        for step in (2, 3):
            writer.write({"phase": "rl", "step": step, "reward/mean": 10.0 * step, "time/step_s": 0.25})
    scalars = _tensorboard_scalars(tmp_path / "tb")
    assert sorted((tag, step) for tag, step, _ in scalars) == sorted(set((tag, step) for tag, step, _ in scalars))
    assert {(tag, step): value for tag, step, value in scalars} == {
        ("sft/train/loss", 5): 2.0, ("rl/reward/mean", 1): 1.0, ("rl/reward/mean", 2): 20.0,
        ("rl/reward/mean", 3): 30.0, ("rl/time/step_s", 1): 0.5, ("rl/time/step_s", 2): 0.25,
        ("rl/time/step_s", 3): 0.25}
