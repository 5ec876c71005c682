"""Run records and the run's plot."""

import matplotlib

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
