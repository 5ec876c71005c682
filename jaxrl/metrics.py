"""Run outputs at the edge of the pipeline: JSONL metrics (flushed per line) and the summary plot."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from typing import Any

import numpy as np


def to_python(value: Any) -> Any:
    """JSON-safe values: numpy / jax scalars to float or int, arrays to lists, non-finite floats to None (also
    inside lists and dicts: json.dumps would write NaN / Infinity, which strict JSON readers reject)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    return value


def is_wall_clock(key: str) -> bool:
    """Whether a metric is a wall-clock duration (`time/*`, `*/seconds`): the one thing two runs of the same
    seed do not share."""
    return key.startswith("time/") or key.endswith("/seconds")


class MetricsWriter:
    """Appends one JSON object per call to `path`; each line is flushed so nothing is lost on a crash.

    Wall-clock durations go to `timings_path` (with the record's `phase` and `step`) instead, so that two runs
    of the same seed write identical metrics files. With `tensorboard_dir`, every numeric value is also written
    as a TensorBoard scalar `<phase>/<key>` at its `step` (tensorboardX event files). The event files mirror the
    two JSONL files: opening a writer rebuilds them from the records already there (those a resumed run kept),
    so the steps a resumed run writes again do not show twice in TensorBoard.
    """

    def __init__(self, path: str | os.PathLike, timings_path: str | os.PathLike | None = None,
                 tensorboard_dir: str | os.PathLike | None = None):
        self._tensorboard = None
        if tensorboard_dir is not None:
            shutil.rmtree(tensorboard_dir, ignore_errors=True)
            self._tensorboard = tensorboard_writer(tensorboard_dir)
            for kept in (path, timings_path):
                if kept is not None and os.path.exists(kept):
                    for record in read_metrics(kept, torn_tail_ok=True):
                        self._mirror(record)
            self._tensorboard.flush()
        self._file = open(path, "a", encoding="utf-8")
        self._timings = None if timings_path is None else open(timings_path, "a", encoding="utf-8")

    def _mirror(self, record: dict[str, Any]) -> None:
        """Its numeric values as TensorBoard scalars (none for a record without a step)."""
        if "step" not in record:
            return
        phase = record.get("phase", "run")
        for key, value in record.items():
            if key not in ("phase", "step", "final") and isinstance(value, (int, float)) \
                    and not isinstance(value, bool):
                self._tensorboard.add_scalar(f"{phase}/{key}", value, global_step=record["step"])

    def write(self, record: dict[str, Any]) -> None:
        record = {k: to_python(v) for k, v in record.items()}
        if self._tensorboard is not None:
            self._mirror(record)
            self._tensorboard.flush()
        if self._timings is not None:
            timings = {k: v for k, v in record.items() if is_wall_clock(k)}
            record = {k: v for k, v in record.items() if not is_wall_clock(k)}
            if timings:
                keys = {k: record[k] for k in ("phase", "step", "final") if k in record}
                self._timings.write(json.dumps({**keys, **timings}) + "\n")
                self._timings.flush()
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        self._file.close()
        if self._timings is not None:
            self._timings.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tensorboard_writer(directory: str | os.PathLike):
    """A tensorboardX `SummaryWriter` writing event files into `directory`."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError as e:
        raise ImportError("tensorboard=true needs the tensorboardX package: pip install 'jaxrl[tensorboard]' "
                          "(or tensorboardX)") from e
    return SummaryWriter(logdir=os.fspath(directory), flush_secs=10)


def read_metrics(path: str | os.PathLike, *, torn_tail_ok: bool = False) -> list[dict[str, Any]]:
    """The records of a JSONL metrics file. A line that is not JSON raises a `ValueError` naming the file
    and line, except, with `torn_tail_ok`, an unterminated last line (a write cut short by a crash), which is
    dropped with a warning: the resumed run writes that record again."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if torn_tail_ok and number == len(lines):  # no newline after it
                logging.getLogger("jaxrl").warning("%s:%d: dropped a partly written last record", path, number)
                break
            raise ValueError(f"{path}:{number}: not a JSON record ({e.msg})") from None
    return records


def plot_run(records: list[dict[str, Any]], path: str | os.PathLike, title: str = "") -> None:
    """PNG of training reward (per step, and smoothed) and held-out greedy accuracy against RL step.

    Drawn on a standalone `Figure` (no pyplot): the process's matplotlib backend is left as it was, so a
    notebook that calls `loop.run` keeps showing its own plots inline.
    """
    from matplotlib.figure import Figure

    rl = [r for r in records if r.get("phase") == "rl" and r.get("reward/mean") is not None]
    evals = [r for r in records if r.get("eval/accuracy") is not None]
    fig = Figure(figsize=(7, 4), dpi=120)
    ax = fig.subplots()
    if rl:
        steps = np.array([r["step"] for r in rl])
        reward = np.array([r["reward/mean"] for r in rl])
        ax.plot(steps, reward, color="tab:blue", alpha=0.3, lw=1)
        window = max(1, len(reward) // 20)
        smooth = np.convolve(reward, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1:], smooth, color="tab:blue", lw=2, label="train reward (sampled, T=1)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-", color="tab:red", lw=2,
                label="held-out greedy accuracy")
    ax.set_xlabel("RL step")
    # [0, 1] (accuracy's range), widened to show shaped rewards outside it (e.g. an overlong penalty of -1)
    values = [r["reward/mean"] for r in rl] + [r["eval/accuracy"] for r in evals]
    ax.set_ylim(min([0, *values]), max([1, *values]))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
