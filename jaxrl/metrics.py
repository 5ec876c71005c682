"""Run outputs at the edge of the pipeline: JSONL metrics (flushed per line) and the summary plot."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np


def to_python(value: Any) -> Any:
    """JSON-safe scalars: numpy / jax scalars to float or int, non-finite floats to None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON object per call to `path`; each line is flushed so nothing is lost on a crash."""

    def __init__(self, path: str | os.PathLike):
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: to_python(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(records: list[dict[str, Any]], path: str | os.PathLike, title: str = "") -> None:
    """PNG of training reward (per step, and smoothed) and held-out greedy accuracy against RL step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rl = [r for r in records if r.get("phase") == "rl" and r.get("reward/mean") is not None]
    evals = [r for r in records if r.get("eval/accuracy") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
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
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
