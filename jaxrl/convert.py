"""Checkpoint conversion (`jaxrl convert`): Hugging Face directories, jaxrl policy checkpoints and
training-run checkpoints.

    convert("~/models/Qwen2.5-Math-1.5B", "ckpt/qwen")         # HF -> policy checkpoint (orbax)
    convert("runs/gsm8k", "out/qwen-rl", base="~/models/Qwen2.5-Math-1.5B")   # run -> HF
    save_policy(policy, "ckpt/mine")                           # a policy checkpoint

What a checkpoint directory is (`describe_source`) and how a policy is loaded from one (`load_policy`, which
training and evaluation use too) are `jaxrl.policy_io`'s; this module only converts and saves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from typing import Literal

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl import configlib, models
from jaxrl.models.hf import CheckpointError, copy_non_weight_files
from jaxrl.models.transformer import Policy
from jaxrl.policy_io import (DTYPES, HF_FILES_DIR, MODEL_FILE, PARAMS_DIR, POLICY_FORMAT, Source,
                             describe_source, load_policy)

__all__ = ["ConvertResult", "convert", "parse_size", "save_policy"]


# ----------------------------------------------------------------------------- saving


def save_policy(policy: Policy, directory: str | os.PathLike, *, hf_files: str | os.PathLike | None = None,
                overwrite: bool = False) -> None:
    """Write `policy` as a policy checkpoint (see the module docstring).

    Args:
      hf_files: an HF directory whose non-weight files (config.json, tokenizer, generation config, ...) are
        kept in `hf_files/`, so that converting back to HF needs no `base`.
      overwrite: replace an existing policy checkpoint; otherwise a non-empty `directory` is refused
        (`FileExistsError`).

    `model.json` is removed first and written last: a directory it is missing from is incomplete.
    """
    directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    if os.path.isdir(directory) and os.listdir(directory) and not overwrite:
        raise FileExistsError(f"{directory}: not empty (pass overwrite=True to replace it)")
    os.makedirs(directory, exist_ok=True)
    model_file = os.path.join(directory, MODEL_FILE)
    if os.path.exists(model_file):
        os.remove(model_file)
    checkpointer = ocp.StandardCheckpointer()
    try:
        checkpointer.save(os.path.join(directory, PARAMS_DIR), policy.params, force=True)
        checkpointer.wait_until_finished()
    finally:
        checkpointer.close()
    files_dir = os.path.join(directory, HF_FILES_DIR)
    if os.path.isdir(files_dir):
        shutil.rmtree(files_dir)
    if hf_files is not None:
        hf_files = os.path.expanduser(os.fspath(hf_files))
        os.makedirs(files_dir)
        copy_non_weight_files(hf_files, files_dir)
    tmp = model_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"format": POLICY_FORMAT, "model": configlib.to_dict(policy.config)}, f, indent=2)
        f.write("\n")
    os.replace(tmp, model_file)


# ----------------------------------------------------------------------------- conversion


@dataclasses.dataclass(frozen=True)
class ConvertResult:
    """What `convert` wrote: `to` ("hf" or "orbax"), the destination, the source's kind (and step for a run),
    the parameter count and dtype, and the bytes written."""

    to: Literal["hf", "orbax"]
    path: str
    source: Source
    num_parameters: int
    dtype: str
    num_bytes: int

    def summary(self) -> str:
        what = "Hugging Face checkpoint" if self.to == "hf" else "policy checkpoint (orbax)"
        src = self.source.directory + (f" (step {self.source.step})" if self.source.step is not None else "")
        return (f"wrote {what} {self.path}: {self.num_parameters:,} parameters ({self.dtype}), "
                f"{self.num_bytes:,} bytes, from {src}")


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: Literal["hf", "orbax"] | None = None,
    dtype: str | None = None,
    base: str | os.PathLike | None = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    progress: bool = False,
    no_tokenizer: bool = False,
) -> ConvertResult:
    """Convert a checkpoint: HF -> policy checkpoint (orbax), or any source -> HF.

    Args:
      src: any source `load_policy` understands.
      dst: the directory to write; must not exist or be empty unless `overwrite` (it is then replaced).
      to: "hf" or "orbax"; default: "orbax" for an HF source, "hf" otherwise.
      dtype: parameter dtype of the output; default: the source's.
      base: for `to="hf"`, the HF directory the policy came from: its tokenizer, generation config and the
        non-architecture keys of its config.json (token ids, ...) are carried over. Default: the source itself
        when it is an HF directory, the `hf_files/` a policy checkpoint kept from its HF origin, and for a run
        the HF files of the `pretrained.path` its config.yaml names (`run_hf_files`). For `to="orbax"` from
        an HF source, the source's (or `base`'s) non-weight files are kept in the checkpoint's `hf_files/`.
      max_shard_bytes: for `to="hf"`, the largest safetensors file before sharding.
      overwrite: replace a non-empty `dst`.
      no_tokenizer: for `to="hf"`, write an HF directory without a tokenizer when none is found (otherwise a
        `CheckpointError` naming `base` refuses: `transformers` could not tokenize with the output).

    The output is written beside `dst` under a temporary name and renamed when complete, so an interrupted
    conversion leaves no `dst` that looks complete (and an existing one is replaced only at the end).
    Raises `CheckpointError`, `configlib.ConfigError`, `FileExistsError` or `ValueError` with the path.
    """
    if to not in (None, "hf", "orbax"):
        raise ValueError(f"to must be 'hf' or 'orbax', got {to!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    source = describe_source(src)
    dst = os.path.abspath(os.path.expanduser(os.fspath(dst)))
    to = to or ("orbax" if source.kind == "hf" else "hf")
    _check_destination(source, dst, overwrite)
    if base is not None:
        base = os.path.abspath(os.path.expanduser(os.fspath(base)))
        if not os.path.isfile(os.path.join(base, "config.json")):
            raise CheckpointError(f"{base}: not a Hugging Face directory (no config.json) for --base")
    elif source.kind == "hf":
        base = source.directory
    elif source.kind == "policy" and os.path.isfile(os.path.join(source.directory, HF_FILES_DIR, "config.json")):
        base = os.path.join(source.directory, HF_FILES_DIR)

    policy = load_policy(source.directory, dtype=dtype, progress=progress)  # first: it names a damaged run's files
    if base is None and to == "hf":
        why = f"the {source.kind} names no HF origin"
        if source.kind == "run":
            base, why = run_hf_files(os.path.dirname(os.path.dirname(source.directory)))
        if base is None and not no_tokenizer:
            raise CheckpointError(f"{src}: no tokenizer for the Hugging Face output: {why}; pass --base HF_DIR "
                                  "(the HF directory it started from), or --no-tokenizer to write the weights "
                                  "without one")
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=parent)
    try:
        if to == "hf":
            models.save_pretrained(policy, tmp, base=base, max_shard_bytes=max_shard_bytes, progress=progress)
        else:
            save_policy(policy, tmp, hf_files=base)
        _replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    leaves = jax.tree.leaves(policy.params)
    return ConvertResult(to, dst, source, int(sum(np.prod(x.shape, dtype=np.int64) for x in leaves)),
                         policy.config.param_dtype, _tree_bytes(dst))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def run_hf_files(run: str) -> tuple[str | None, str]:
    """`(directory, why)`: the HF files (tokenizer, generation config, token ids) of the `pretrained.path` a
    run's `config.yaml` names: that HF directory, or the `hf_files/` of a policy checkpoint there; `(None,
    why not)` when the run started from random weights (its sentencepiece `tokenizer.model` is no HF
    tokenizer), its `pretrained.path` is gone, or holds no tokenizer files."""
    config_file = os.path.join(run, "config.yaml")
    # only this key is read (as `_run_model_config` reads only the model): the whole config would import the
    # run's custom pieces (`imports:`, `module:function`), which converting its weights does not need
    data = configlib.load_yaml(config_file) or {}
    pretrained = data.get("pretrained") if isinstance(data, dict) else None
    path = pretrained.get("path") if isinstance(pretrained, dict) else None
    if path is not None and not isinstance(path, str):
        raise configlib.ConfigError(f"{config_file}: pretrained.path: expected a str, got {path!r}")
    if path is None:
        return None, (f"the run ({config_file}) trained from random weights with its own sentencepiece "
                      "tokenizer, which a Hugging Face directory does not carry")
    path = os.path.abspath(os.path.expanduser(path))
    candidates = (path, os.path.join(path, HF_FILES_DIR))
    directory = next((c for c in candidates if os.path.isfile(os.path.join(c, "config.json"))), None)
    if directory is None:
        return None, f"its pretrained.path {path} ({config_file}) is not a Hugging Face directory here"
    if not any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES):
        return None, f"its pretrained.path {directory} ({config_file}) holds no tokenizer files"
    return directory, ""


def _check_destination(source: Source, dst: str, overwrite: bool) -> None:
    src = source.directory
    if source.kind == "run":
        src = os.path.dirname(os.path.dirname(src))  # the whole run
    if os.path.commonpath([os.path.realpath(src), os.path.realpath(dst)]) == os.path.realpath(dst):
        raise ValueError(f"{dst}: the destination contains (or is) the source {source.directory}")
    if not os.path.lexists(dst):
        return
    if os.path.isdir(dst) and not os.path.islink(dst) and not os.listdir(dst):
        return
    if not overwrite:
        raise FileExistsError(f"{dst}: already exists and is not empty (use --overwrite / overwrite=True to "
                              "replace it)")


def _replace(tmp: str, dst: str) -> None:
    """Move the finished `tmp` to `dst`, replacing what is there only once `tmp` is complete."""
    if not os.path.lexists(dst):
        os.rename(tmp, dst)
        return
    if os.path.isdir(dst) and not os.path.islink(dst):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=os.path.dirname(dst))
        os.rename(dst, os.path.join(old, "x"))
        os.rename(tmp, dst)
        shutil.rmtree(old)
    else:
        os.remove(dst)
        os.rename(tmp, dst)


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size like '500MB', '5GB', '2GiB', '1.5 GB' or '1000000'. As in `transformers`' max_shard_size,
    KB/MB/GB are powers of 10 and KiB/MiB/GiB powers of 2. `ValueError` for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}: expected e.g. 500MB, 5GB, 2GiB or a number of bytes")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"invalid size {text!r}: must be positive")
    return size
