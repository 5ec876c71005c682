"""What the policy writes: `samples.jsonl` during RL and per-problem completions of an evaluation.

`samples.jsonl` (`log.samples_every`, `log.samples_per_step`): every `every` RL steps, `rows` completions of
that step's batch, one JSON object each:

    {"step": 10, "prompt": "What is 3 + 4?", "completion": "<answer>7</answer>", "reference": "7",
     "rewards": {"correct": 1.0, "format": 0.5}, "reward": 1.5, "advantage": 0.8, "length": 12,
     "finish_reason": "eos"}

`prompt` is the task's prompt text (the row's prompt after `data.template`), not the chat-templated token
string the model sees (`jaxrl train --dry-run` prints that once). `advantage` is the sequence's: its mean over
completion tokens for a per-token estimator. The rows are the first member of each of the first groups (then
the second members, ...): deterministic, and as many different prompts as possible.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.metrics import read_metrics, to_python

__all__ = ["FINISH_REASONS", "pick_rows", "sequence_advantages", "sample_records", "SampleLog",
           "truncate_samples", "open_sample_log", "completion_records", "write_completions"]

FINISH_REASONS = ("eos", "length")  # jaxrl.sampling.FINISH_EOS, FINISH_LENGTH


def pick_rows(batch_size: int, group_size: int, count: int) -> list[int]:
    """Indices of `count` rows of a batch of `batch_size // group_size` groups of `group_size` (group g holds
    rows `g * group_size ...`): member 0 of groups 0, 1, ..., then member 1 of each, ... (at most the batch)."""
    groups = batch_size // group_size
    order = [g * group_size + m for m in range(group_size) for g in range(groups)]
    return order[:count]


def sequence_advantages(advantages, completion_mask=None) -> np.ndarray:
    """`[B]` float32: each sequence's advantage; for per-token advantages `[B, N]` their mean over the
    completion tokens (`completion_mask [B, N]`; 0 for a sequence without any)."""
    advantages = np.asarray(advantages, np.float32)
    if advantages.ndim == 1:
        return advantages
    mask = np.ones_like(advantages) if completion_mask is None else np.asarray(completion_mask, np.float32)
    return (advantages * mask).sum(1) / np.maximum(mask.sum(1), 1.0)


def sample_records(step: int, rows: Sequence[int], *, prompts: Sequence[str], completions: Sequence[str],
                   references: Sequence[Any], components: Mapping[str, Sequence[float]], rewards: Sequence[float],
                   advantages: Sequence[float], lengths: Sequence[int], finish_reasons: Sequence[int],
                   episodes: Sequence[Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The samples.jsonl records of `rows` of one RL step's batch; every column is per sequence `[B]`
    (`components`: name -> `[B]` reward component, e.g. correct, format; `finish_reasons`: FINISH_EOS or
    FINISH_LENGTH codes). Multi-turn: `episodes` are the whole episodes (`Episode.record()`: turns, tool counts,
    how it ended) and `completion` is the model's turns joined."""
    records = [{"step": int(step), "prompt": prompts[i], "completion": completions[i],
                "reference": to_python(references[i]),
                "rewards": {name: float(values[i]) for name, values in components.items()},
                "reward": float(rewards[i]), "advantage": float(advantages[i]), "length": int(lengths[i]),
                "finish_reason": FINISH_REASONS[int(finish_reasons[i])]} for i in rows]
    if episodes is not None:
        for record, i in zip(records, rows):
            record["episode"] = to_python(episodes[i])
    return records


class SampleLog:
    """Appends `samples.jsonl` records: `rows` rows every `every` RL steps (0: never); a no-op unless `primary`
    (in a multi-process run only the primary process writes). Each write is flushed.

    Usage in the RL loop, per step: `if log.due(step): log.write(step, **columns)` (columns as
    `sample_records` takes them, for the whole batch)."""

    def __init__(self, path: str | os.PathLike, every: int, rows: int, group_size: int, primary: bool = True):
        self.path, self.every, self.rows, self.group_size = path, every, rows, group_size
        self._file = open(path, "a", encoding="utf-8") if primary and every else None

    def due(self, step: int) -> bool:
        return self._file is not None and step % self.every == 0

    def write(self, step: int, **columns) -> None:
        if not self.due(step):
            return
        picked = pick_rows(len(columns["completions"]), self.group_size, self.rows)
        for record in sample_records(step, picked, **columns):
            self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> "SampleLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def truncate_samples(path: str | os.PathLike, step: int) -> None:
    """Keep the samples of RL steps up to `step` (a resumed run's checkpoint step): the resumed run writes the
    later steps again. A torn last line (a kill mid-write) is dropped."""
    if not os.path.exists(path):
        return
    kept = [r for r in read_metrics(path, torn_tail_ok=True) if r["step"] <= step]
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)


def open_sample_log(config, output_dir: str | os.PathLike, resume_step: int | None, primary: bool) -> SampleLog:
    """The run's `<output_dir>/samples.jsonl` log (`config.log`, `config.rl.group_size`): a fresh run
    (`resume_step` None) starts it empty, a resumed one keeps the samples up to its checkpoint's step. Only the
    `primary` process touches the file. Call it where the run opens metrics.jsonl (the directory is its own)."""
    path = os.path.join(output_dir, "samples.jsonl")
    if primary:
        if resume_step is None:
            if os.path.exists(path):
                os.remove(path)
        else:
            truncate_samples(path, resume_step)
    return SampleLog(path, config.log.samples_every, config.log.samples_per_step, config.rl.group_size, primary)


def completion_records(prompts: Sequence[str], references: Sequence[Any], completions: Sequence[str],
                       correct: Sequence[float], lengths: Sequence[int],
                       episodes: Sequence[Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One record per held-out problem: prompt, reference, completion, reward/correct (the verifiable reward),
    length (completion tokens), and multi-turn the whole `episode`."""
    columns = (prompts, references, completions, correct, lengths) + (() if episodes is None else (episodes,))
    if len({len(c) for c in columns}) != 1:
        raise ValueError(f"completion columns differ in length: {[len(c) for c in columns]}")
    records = [{"prompt": p, "reference": to_python(r), "completion": c, "reward/correct": float(s),
                "length": int(n)} for p, r, c, s, n in zip(*columns[:5])]
    for record, episode in zip(records, episodes or ()):
        record["episode"] = to_python(episode)
    return records


def write_completions(path: str | os.PathLike, records: Sequence[Mapping[str, Any]]) -> None:
    """`jaxrl eval --completions FILE`: the records of `completion_records` as JSONL (replacing `path`)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(dict(r)) + "\n" for r in records)
    os.replace(tmp, path)
