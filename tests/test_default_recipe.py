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


def test_metrics_writer_mirrors_scalars_to_tensorboard(tmp_path):
    """`tensorboard=true`: every numeric metric of a record becomes a scalar `<phase>/<key>` at its step in a
    TensorBoard event file (read back record by record: TFRecord framing around `Event` protos)."""
    import struct

    from tensorboardX.proto import event_pb2

    from jaxrl.metrics import MetricsWriter

    with MetricsWriter(tmp_path / "m.jsonl", tmp_path / "t.jsonl", tmp_path / "tb") as writer:
        writer.write({"phase": "rl", "step": 3, "reward/mean": 0.25, "train/entropy": 1.5, "time/sample_s": 0.1,
                      "note": "text is skipped"})
        writer.write({"phase": "sft", "step": 7, "train/loss": 2.0})
    (events,) = list((tmp_path / "tb").iterdir())
    data, scalars = events.read_bytes(), {}
    while data:
        (length,) = struct.unpack("<Q", data[:8])
        event = event_pb2.Event.FromString(data[12:12 + length])
        data = data[12 + length + 4:]
        for value in event.summary.value:
            scalars[(value.tag, event.step)] = value.simple_value
    assert scalars == {("rl/reward/mean", 3): 0.25, ("rl/train/entropy", 3): 1.5, ("rl/time/sample_s", 3):
                       pytest.approx(0.1), ("sft/train/loss", 7): 2.0}
