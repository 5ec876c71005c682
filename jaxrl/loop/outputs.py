"""Who owns `output_dir`: a fresh run takes it over (only when no run's checkpoints are there, or with
overwrite=true), writes its config, model and tokenizer there, and keeps one `metrics.jsonl` per process."""

from __future__ import annotations

import os
import shutil

import jax

from jaxrl import configlib, models
from jaxrl.checkpoint import Checkpointer
from jaxrl.config import Config
from jaxrl.errors import RunConfigError
from jaxrl.policy_io import RUN_MODEL_FILE
from jaxrl.sharding import is_primary
from jaxrl.tokenizer import BaseTokenizer


def check_fresh_output_dir(config: Config) -> None:
    """A fresh run may take over `output_dir` only if no run's checkpoints are there, or with overwrite=true."""
    out = config.output_dir
    step = Checkpointer.newest(os.path.join(out, "checkpoints"))
    if step is None:
        return
    if config.pretrained.path is not None and os.path.realpath(config.pretrained.path) == os.path.realpath(out):
        raise RunConfigError(f"pretrained.path is output_dir ({out}): a run cannot start from the run it would "
                             "replace; choose another output_dir")
    if config.overwrite:
        return
    raise RunConfigError(f"output_dir {out} holds a run with checkpoints (the newest after RL step {step}): "
                         "resume=true continues it, overwrite=true deletes it and starts again, or choose another "
                         "output_dir")


def prepare_output_dir(out: str) -> None:
    """A fresh run owns its output directory (see `check_fresh_output_dir`): the summary, plot, TensorBoard
    events and checkpoints (damaged ones too) of an earlier run are removed (each process removes its own
    records)."""
    for name in ("summary.json", "reward_accuracy.png"):
        path = os.path.join(out, name)
        if os.path.exists(path):
            os.remove(path)
    for name in ("checkpoints", "damaged_checkpoints", "tensorboard"):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)


def remove_records(metrics_path: str) -> None:
    """A fresh run's process starts its `metrics.jsonl` and `timings.jsonl` empty."""
    for path in (metrics_path, os.path.join(os.path.dirname(metrics_path), "timings.jsonl")):
        if os.path.exists(path):
            os.remove(path)


def metrics_path(out: str) -> str:
    """`<out>/metrics.jsonl`; in a multi-host run, process i > 0 records what it saw under `process_<i>/`."""
    if is_primary():
        return os.path.join(out, "metrics.jsonl")
    directory = os.path.join(out, f"process_{jax.process_index()}")
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, "metrics.jsonl")


def keep_tokenizer(config: Config, tokenizer: BaseTokenizer, tokenizer_file: str | None) -> None:
    """Write the run's `tokenizer.model` (as `jaxrl eval` and `pretrained.path=<run>` expect): the trained one,
    or a copy of the pretrained sentencepiece file; an HF tokenizer stays with the checkpoint it came from."""
    saved = os.path.join(config.output_dir, "tokenizer.model")
    if config.pretrained.path is None:
        if not (config.resume and os.path.exists(saved)):
            tokenizer.save(saved)
    elif tokenizer_file is not None and not (os.path.exists(saved) and os.path.samefile(tokenizer_file, saved)):
        shutil.copyfile(tokenizer_file, saved)


def write_run_files(config: Config, policy: models.Policy, tokenizer: BaseTokenizer, tokenizer_file: str | None,
                    fresh: bool) -> None:
    """The primary process's files of a starting run: (fresh) an emptied output dir, the tokenizer, the
    resolved `config.yaml` and the model config `load_policy` reads back."""
    out = config.output_dir
    if fresh:
        prepare_output_dir(out)
    keep_tokenizer(config, tokenizer, tokenizer_file)
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write(configlib.dump_yaml(config))
    with open(os.path.join(out, RUN_MODEL_FILE), "w") as f:  # the model this run trains: read by load_policy
        f.write(configlib.dump_yaml(policy.config))
