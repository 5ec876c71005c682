"""Run records and the run's plot."""

import json

import matplotlib
import pytest

from jaxrl.metrics import plot_run


def test_plot_run_writes_a_png_and_leaves_the_matplotlib_backend_alone(tmp_path):
    """A notebook that calls `loop.run` keeps its inline backend: the run's plot must not switch it."""
    records = [{"phase": "rl", "step": 0, "eval/accuracy": 0.25}] + [
        {"phase": "rl", "step": s, "reward/mean": 0.1 * s} for s in range(1, 6)] + [
        {"phase": "rl", "step": 5, "final": True, "eval/accuracy": 0.5}]
    previous = matplotlib.get_backend()
    matplotlib.use("pdf")
    try:
        plot_run(records, tmp_path / "plot.png", title="test")
        assert matplotlib.get_backend() == "pdf"
    finally:
        matplotlib.use(previous)
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_read_metrics_names_a_bad_line_and_may_drop_a_torn_last_one(tmp_path, caplog):
    from jaxrl.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"phase": "rl", "step": 3, "reward/me')  # killed mid-write
    with pytest.raises(ValueError, match=r"metrics.jsonl:3: not a JSON record"):
        read_metrics(path)
    assert read_metrics(path, torn_tail_ok=True) == [{"step": 1}, {"step": 2}]
    assert "metrics.jsonl:3: dropped a partly written last record" in caplog.text
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')  # damage inside the file is never dropped
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        read_metrics(path, torn_tail_ok=True)


def test_records_are_strict_json_with_non_finite_values_and_arrays_inside(tmp_path):
    """NaN / inf anywhere (a list, a dict, an array) are written as null: json.dumps wrote NaN / Infinity, which
    strict JSON readers reject; an array of more than one value failed the write."""
    import json

    import numpy as np

    from jaxrl.metrics import MetricsWriter

    def strict(constant):
        raise ValueError(f"not JSON: {constant}")

    with MetricsWriter(tmp_path / "metrics.jsonl") as writer:
        writer.write({"step": np.int64(1), "loss": np.float32("nan"), "per_group": [1.0, float("inf")],
                      "by_kind": {"a": float("-inf")}, "hist": np.array([0.5, np.nan])})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=strict) == {
        "step": 1, "loss": None, "per_group": [1.0, None], "by_kind": {"a": None}, "hist": [0.5, None]}


def test_plot_run_shows_rewards_outside_zero_one(tmp_path, monkeypatch):
    """Shaped rewards may be negative (an overlong penalty is -1): the y axis widens to show them (it was
    fixed at [0, 1], which cut such a curve off); rewards in [0, 1] keep [0, 1]."""
    from matplotlib.figure import Figure

    limits = []
    monkeypatch.setattr(Figure, "savefig", lambda self, path: limits.append(self.axes[0].get_ylim()))
    plot_run([{"phase": "rl", "step": s, "reward/mean": -0.5 * s} for s in range(1, 4)], tmp_path / "a.png")
    plot_run([{"phase": "rl", "step": 1, "reward/mean": 0.5}, {"phase": "rl", "step": 1, "eval/accuracy": 0.2}],
             tmp_path / "b.png")
    plot_run([], tmp_path / "c.png")
    assert limits == [(-1.5, 1), (0, 1), (0, 1)]


def _wandb_history(run_directory, config: dict | None = None) -> list[dict]:
    """The history rows of the one offline run under `run_directory` (`<output_dir>/wandb`), and its config
    (into `config`), once its `.wandb` file holds the run's exit record."""
    import time

    (path,) = list(run_directory.glob("offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + 30
    while True:  # wandb-core may write the file a moment after run.finish() returns
        records = _wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    rows = []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config") and config is not None:  # the config comes with the run or after it
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def _wandb_records(path) -> list:
    """The records of a `.wandb` file so far: a LevelDB-style log (7-byte file header, 32 KiB blocks, records
    split into chunks with a 7-byte header: crc32, length, type) of wandb's own `Record` protobufs."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, block, pending, records = 7, 32768, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's zero-padded tail
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if position + 7 + length > len(data):  # a chunk still being written
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def test_wandb_offline_run_holds_the_scalars_of_metrics_jsonl(tmp_path, monkeypatch):
    """`wandb: true` with WANDB_MODE=offline: the run's history holds every scalar of every metrics.jsonl record
    (timings too), as `<phase>/<key>` at `<phase>/step`; the warm start's steps and the RL steps do not collide;
    a resumed run replays the kept records, so each step shows once with the resumed run's values."""
    pytest.importorskip("wandb")
    from jaxrl.config import Config
    from jaxrl.metrics import MetricsWriter, build_mirrors, scalars

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    out.mkdir()
    config = Config(output_dir=str(out), wandb=True)
    paths = out / "metrics.jsonl", out / "timings.jsonl"
    with MetricsWriter(*paths, build_mirrors(config, out)) as writer:
        writer.write({"phase": "sft", "step": 1, "train/loss": 2.5, "time/step_s": 0.5})
        writer.write({"phase": "sft", "step": 2, "train/loss": 2.0})
        writer.write({"phase": "rl", "step": 0, "eval/accuracy": 0.25, "eval/sample": "text is not a scalar"})
        writer.write({"phase": "rl", "step": 1, "reward/mean": 0.5, "train/skipped": False, "time/step_s": 1.5})
        writer.write({"phase": "rl", "step": 2, "reward/mean": 0.75, "kl": None})
    (run,) = list((out / "wandb").glob("offline-run-*"))
    import shutil

    shutil.rmtree(run)  # the resumed run below is a new wandb run
    lines = paths[0].read_text().splitlines(keepends=True)  # what the loop keeps resuming after RL step 1
    paths[0].write_text("".join(line for line in lines if '"step": 2' not in line or '"sft"' in line))
    with MetricsWriter(*paths, build_mirrors(config, out)) as writer:
        writer.write({"phase": "rl", "step": 2, "reward/mean": 0.875, "time/step_s": 1.0})
    logged_config = {}
    history = _wandb_history(out / "wandb", logged_config)
    from jaxrl.configlib import to_dict

    assert {k: v for k, v in logged_config.items() if k != "_wandb"} == to_dict(config)  # the resolved config
    logged = {(phase, row[f"{phase}/step"]): {k: v for k, v in row.items() if k.startswith(phase + "/")}
              for row in history for phase in ("sft", "rl") if f"{phase}/step" in row}
    assert len(logged) == len(history)  # each row belongs to one phase
    expected = {}
    from jaxrl.metrics import kept_records

    for record in kept_records(*paths):
        expected[(record["phase"], record["step"])] = {f"{record['phase']}/step": record["step"], **scalars(record)}
    assert logged == expected
    assert expected[("rl", 2)] == {"rl/step": 2, "rl/reward/mean": 0.875, "rl/time/step_s": 1.0}
    assert expected[("sft", 1)] == {"sft/step": 1, "sft/train/loss": 2.5, "sft/time/step_s": 0.5}
    assert len(history) == 5


def test_wandb_mode_and_name_come_from_the_log_section(tmp_path, monkeypatch):
    """`log.wandb_mode: offline` is honoured without WANDB_MODE (an online default would need the network);
    the run is named after output_dir unless `log.wandb_name` says otherwise."""
    pytest.importorskip("wandb")
    from jaxrl.config import Config, LogConfig
    from jaxrl.metrics import build_mirrors

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name, expected in ((None, "my-run"), ("custom", "custom")):
        out = tmp_path / str(name) / "my-run"
        config = Config(output_dir=str(out), wandb=True, log=LogConfig(wandb_mode="offline", wandb_name=name))
        (mirror,) = build_mirrors(config, out)
        assert mirror._run.name == expected and mirror._run.settings.mode == "offline"
        mirror.write({"phase": "rl", "step": 1, "reward/mean": 0.5})
        mirror.close()
        assert [row["rl/reward/mean"] for row in _wandb_history(out / "wandb")] == [0.5]
