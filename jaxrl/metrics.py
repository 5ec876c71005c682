"""Run outputs at the edge of the pipeline: JSONL metrics (flushed per line) and the summary plot."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl import registry


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
    of the same seed write identical metrics files. Each of `mirrors` (objects with `write(record)` and
    `close()`, such as the registered writers `tensorboard` and `wandb`: see `build_mirrors`) gets every whole
    record, durations included. A mirror mirrors the two JSONL files: opening a writer first replays the records
    already there (those a resumed run kept) to each mirror, so the steps a resumed run writes again do not
    show twice.
    """

    def __init__(self, path: str | os.PathLike, timings_path: str | os.PathLike | None = None,
                 mirrors: Sequence[Any] = ()):
        self._mirrors = list(mirrors)
        if self._mirrors and os.path.exists(path):
            for record in kept_records(path, timings_path):
                for mirror in self._mirrors:
                    mirror.write(record)
        self._file = open(path, "a", encoding="utf-8")
        self._timings = None if timings_path is None else open(timings_path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        record = {k: to_python(v) for k, v in record.items()}
        for mirror in self._mirrors:
            mirror.write(record)
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
        for mirror in self._mirrors:
            mirror.close()
        self._file.close()
        if self._timings is not None:
            self._timings.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def kept_records(path: str | os.PathLike, timings_path: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """The records of `path` as they were written, each with its wall-clock durations from `timings_path` put
    back (matched by phase, step and final)."""
    records = read_metrics(path, torn_tail_ok=True)
    if timings_path is None or not os.path.exists(timings_path):
        return records
    key = lambda r: (r.get("phase"), r.get("step"), bool(r.get("final")))  # noqa: E731
    timings = {key(t): {k: v for k, v in t.items() if is_wall_clock(k)}
               for t in read_metrics(timings_path, torn_tail_ok=True)}
    return [{**r, **timings.get(key(r), {})} for r in records]


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers (no bools, no None) as `<phase>/<key>`, e.g. `rl/reward/mean`, `sft/loss`; `{}` for
    a record without a step. Both mirrors log these names, each at `<phase>/step`."""
    if "step" not in record:
        return {}
    phase = record.get("phase", "run")
    return {f"{phase}/{key}": value for key, value in record.items()
            if key not in ("phase", "step", "final") and isinstance(value, (int, float))
            and not isinstance(value, bool)}


def build_mirrors(config, output_dir: str | os.PathLike) -> list[Any]:
    """The metrics mirrors a run's config turns on: the built-in writers by their top-level bools
    (`tensorboard: true`, `wandb: true`) and the user's own in `log.writers`, each built on
    `<output_dir>/<name>` (a `module:function` name's directory is its function's name). Only the primary
    process should build them."""
    from jaxrl import registry

    mirrors = []
    for field, name in enabled_writers(config):
        entry = registry.resolve("writer", name, field)
        directory = os.path.join(os.fspath(output_dir), name.rpartition(":")[2])
        mirrors.append(entry.fn(directory=directory, config=config))
    return mirrors


def enabled_writers(config) -> list[tuple[str, str]]:
    """`(config field, writer name)` of every writer the config turns on: a registered writer whose name is a
    top-level bool set to true (`wandb`), then `log.writers`."""
    from jaxrl import registry

    builtin = [(name, name) for name in registry.names("writer") if getattr(config, name, False) is True]
    return builtin + [(f"log.writers[{i}]", name) for i, name in enumerate(config.log.writers)]


class TensorBoardMirror:
    """Every scalar of a record as a TensorBoard scalar `<phase>/<key>` at its `step` (tensorboardX event files
    in `directory`, which it empties first: `MetricsWriter` replays the kept records)."""

    def __init__(self, directory: str | os.PathLike):
        shutil.rmtree(directory, ignore_errors=True)
        self._writer = tensorboard_writer(directory)

    def write(self, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            self._writer.add_scalar(key, value, global_step=record["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


@registry.register("writer", "tensorboard", extra="tensorboard", package="tensorboardX")
def tensorboard_mirror(directory: str, config) -> TensorBoardMirror:
    """`tensorboard: true`: TensorBoard event files under `<output_dir>/tensorboard`."""
    return TensorBoardMirror(directory)


class WandbMirror:
    """Every scalar of a record logged to a Weights & Biases run as `<phase>/<key>` (`rl/reward/mean`,
    `sft/loss`, the same names as in TensorBoard) against the step metric `<phase>/step`, so that the warm start's
    steps and the RL steps never collide (and a resumed run may log a step again: wandb's own `_step` is not
    used). Records without a step are not logged.

    `run`: a started `wandb` run (`wandb.init(...)`); see `wandb_mirror` for how the config starts one."""

    def __init__(self, run):
        self._run, self._phases = run, set()

    def write(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if not values:
            return
        phase = record.get("phase", "run")
        if phase not in self._phases:
            self._run.define_metric(f"{phase}/step")
            self._run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
            self._phases.add(phase)
        self._run.log({f"{phase}/step": record["step"], **values})

    def close(self) -> None:
        self._run.finish()


@registry.register("writer", "wandb", extra="wandb", package="wandb")
def wandb_mirror(directory: str, config) -> WandbMirror:
    """`wandb: true`: a wandb run named `log.wandb_name` (default: output_dir's basename) in project
    `log.wandb_project`, in mode `log.wandb_mode` (None: wandb's default or `WANDB_MODE`), its files under
    `directory` (`<output_dir>/wandb`), with the resolved config as the run's config. Each start of a run,
    a resumed one too, is a new wandb run that first gets the records already in metrics.jsonl."""
    try:
        import wandb
    except ImportError as e:
        from jaxrl.extras import MissingExtra, install_command
        raise MissingExtra(f"wandb: true needs the wandb package: {install_command('wandb')}") from e
    from jaxrl.configlib import to_dict

    os.makedirs(directory, exist_ok=True)
    log = config.log
    name = log.wandb_name or os.path.basename(os.path.normpath(os.path.abspath(config.output_dir)))
    settings = {} if log.wandb_mode is None else {"mode": log.wandb_mode}
    # wandb writes into a `wandb/` folder of the directory it is given: `directory` itself when it is named so
    parent = os.path.dirname(os.path.abspath(directory)) if os.path.basename(directory) == "wandb" else directory
    # reinit="create_new" (wandb >= 0.19.10): a notebook calling loop.run twice gets two runs, not a reused one
    run = wandb.init(project=log.wandb_project, name=name, dir=parent, config=to_dict(config),
                     reinit="create_new", **settings)
    return WandbMirror(run)


def tensorboard_writer(directory: str | os.PathLike):
    """A tensorboardX `SummaryWriter` writing event files into `directory`."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError as e:
        from jaxrl.extras import MissingExtra, install_command
        raise MissingExtra(f"tensorboard: true needs the tensorboardX package: {install_command('tensorboard')}") \
            from e
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
    """PNG of training reward (per step, and smoothed) and the held-out greedy accuracy (or mean reward, for an
    evaluation reward that is not right-or-wrong) against RL step.

    Drawn on a standalone `Figure` (no pyplot): the process's matplotlib backend is left as it was, so a
    notebook that calls `loop.run` keeps showing its own plots inline.
    """
    from matplotlib.figure import Figure

    rl = [r for r in records if r.get("phase") == "rl" and r.get("reward/mean") is not None]
    key = "eval/accuracy" if any(r.get("eval/accuracy") is not None for r in records) else "eval/reward"
    evals = [r for r in records if r.get(key) is not None]
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
        ax.plot([r["step"] for r in evals], [r[key] for r in evals], "o-", color="tab:red", lw=2,
                label=f"held-out greedy {key.removeprefix('eval/')}")
    ax.set_xlabel("RL step")
    # [0, 1] (accuracy's range), widened to show shaped rewards outside it (e.g. an overlong penalty of -1)
    values = [r["reward/mean"] for r in rl] + [r[key] for r in evals]
    ax.set_ylim(min([0, *values]), max([1, *values]))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
