"""Run records and the run's plot."""

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
