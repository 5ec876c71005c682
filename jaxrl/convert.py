"""Checkpoint conversion: Hugging Face directories, jaxrl policy checkpoints and training-run checkpoints.

    policy = load_policy("runs/gsm8k")                        # latest checkpoint of a run
    convert("~/models/Qwen2.5-Math-1.5B", "ckpt/qwen")         # HF -> policy checkpoint (orbax)
    convert("runs/gsm8k", "out/qwen-rl", base="~/models/Qwen2.5-Math-1.5B")   # run -> HF

Four kinds of source are understood (`load_policy`, `convert`):

* a Hugging Face directory: `config.json` + `model.safetensors` (or shards with an index);
* a *policy checkpoint* (this module's format, `POLICY_FORMAT`)::

      <dir>/params/       the parameters (an `nnx.State`), orbax `StandardCheckpointer`
      <dir>/hf_files/     optional: the HF directory's non-weight files (config.json, tokenizer, ...)
      <dir>/model.json    {"format": "jaxrl-policy/1", "model": <ModelConfig as a dict>}

  `model.json` is written last, so an interrupted save never looks complete;
* a training-run checkpoint `<run>/checkpoints/<step>` (orbax `CheckpointManager` step with a `state`
  item whose `"params"` entry is the policy; the model config comes from `<run>/model.yaml`, the model the
  run trained, which for a run from `pretrained.path` is that checkpoint's; runs written before model.yaml
  existed fall back to the `model` section of `<run>/config.yaml`);
* a run directory `<run>` or `<run>/checkpoints`: its latest step.
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
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl import models
from jaxrl import configlib
from jaxrl.checkpoint import CheckpointDamaged, verify_saved_arrays
from jaxrl.models.configs import ModelConfig
from jaxrl.models.hf import CheckpointError, copy_non_weight_files, load_config
from jaxrl.models.safe_read import read_json_file
from jaxrl.models.transformer import Policy

__all__ = ["POLICY_FORMAT", "RUN_MODEL_FILE", "ConvertResult", "Source", "convert", "describe_source", "load_policy",
           "parse_size", "save_policy"]

POLICY_FORMAT = "jaxrl-policy/1"
MODEL_FILE = "model.json"
RUN_MODEL_FILE = "model.yaml"  # in a run directory: the ModelConfig the run trained
PARAMS_DIR = "params"
HF_FILES_DIR = "hf_files"
DTYPES = ("float32", "bfloat16", "float16")

_STEP = re.compile(r"^\d+$")
_EXPECTED = ("expected a Hugging Face directory (config.json + *.safetensors), a jaxrl policy checkpoint "
             f"({MODEL_FILE} + {PARAMS_DIR}/), a run directory (config.yaml + checkpoints/), its checkpoints/ "
             "directory or one of its checkpoints/<step> directories")


# ----------------------------------------------------------------------------- sources


@dataclasses.dataclass(frozen=True)
class Source:
    """What a path holds. `kind`: "hf", "policy" or "run"; for a run, `directory` is the step directory
    (`<run>/checkpoints/<step>`), `config_file` the run's config.yaml and `step` the step."""

    kind: Literal["hf", "policy", "run"]
    directory: str
    config_file: str | None = None
    step: int | None = None


def describe_source(path: str | os.PathLike) -> Source:
    """Classify `path` (see the module docstring); `CheckpointError` naming the path for anything else."""
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory ({_EXPECTED})")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory ({_EXPECTED})")
    # lexists, not isfile: a FIFO or device under an expected name is refused by its reader (models.safe_read)
    # with the name, instead of the directory being misread as another kind.
    if os.path.lexists(os.path.join(path, MODEL_FILE)):
        return Source("policy", path)
    if os.path.isdir(os.path.join(path, PARAMS_DIR)):
        raise CheckpointError(f"{path}: has {PARAMS_DIR}/ but no {MODEL_FILE}: an incomplete (interrupted?) "
                              "policy checkpoint")
    if os.path.lexists(os.path.join(path, "config.json")):
        return Source("hf", path)
    if os.path.isdir(os.path.join(path, "state")):  # <run>/checkpoints/<step>
        name = os.path.basename(path)
        if not _STEP.match(name):
            raise CheckpointError(f"{path}: not a finished checkpoint step (a step directory is named by its "
                                  "step number; this one may be an interrupted save)")
        return Source("run", path, _run_config_file(os.path.dirname(os.path.dirname(path)), path), int(name))
    if os.path.isfile(os.path.join(path, "config.yaml")) and os.path.isdir(os.path.join(path, "checkpoints")):
        return _latest_step(os.path.join(path, "checkpoints"), os.path.join(path, "config.yaml"))
    if _steps(path):  # <run>/checkpoints
        return _latest_step(path, _run_config_file(os.path.dirname(path), path))
    if os.path.isfile(os.path.join(path, "config.yaml")):
        raise CheckpointError(f"{path}: a run directory without checkpoints/ (no checkpoint was saved)")
    raise CheckpointError(f"{path}: not a checkpoint ({_EXPECTED})")


def _steps(checkpoints: str) -> list[int]:
    """Finished steps of a CheckpointManager directory (interrupted saves keep a temporary name)."""
    try:
        names = os.listdir(checkpoints)
    except OSError:
        return []
    return sorted(int(n) for n in names if _STEP.match(n) and os.path.isdir(os.path.join(checkpoints, n, "state")))


def _latest_step(checkpoints: str, config_file: str) -> Source:
    steps = _steps(checkpoints)
    if not steps:
        raise CheckpointError(f"{checkpoints}: no finished checkpoint (expected <step>/state/ directories)")
    step_dir = os.path.join(checkpoints, str(steps[-1]))
    return Source("run", step_dir, config_file, steps[-1])


def _run_config_file(run: str, where: str) -> str:
    config_file = os.path.join(run, "config.yaml")
    if not os.path.isfile(config_file):
        raise CheckpointError(f"{where}: a run checkpoint, but {config_file} (the run's model config) is missing")
    return config_file


def _run_model_config(config_file: str) -> ModelConfig:
    """The model a run trained: `<run>/model.yaml`, or for older runs the `model` section of its config.yaml
    (only that section is read, so a run whose other sections have since changed still converts)."""
    model_file = os.path.join(os.path.dirname(config_file), RUN_MODEL_FILE)
    if os.path.lexists(model_file):  # a FIFO or device there is refused by the reader, not passed over
        return configlib.load_config(ModelConfig, model_file)
    data = configlib.load_yaml(config_file) or {}  # limits: regular file, size, alias expansion, depth
    if not isinstance(data, dict) or not isinstance(data.get("model", {}), dict):
        raise configlib.ConfigError(f"{config_file}: expected a run config with a 'model' mapping")
    pretrained = data.get("pretrained") if isinstance(data.get("pretrained"), dict) else {}
    if pretrained.get("path"):  # the model section is the unused default, not the model the run trained
        raise CheckpointError(f"{config_file}: the run started from pretrained.path={pretrained['path']}, so its "
                              f"'model' section is not the model it trained, and it has no {RUN_MODEL_FILE} (runs "
                              f"write one since 2026-11-23): write that model's ModelConfig fields there as YAML")
    return configlib.from_dict(ModelConfig, data.get("model", {}), source=f"{config_file}: model")


# ----------------------------------------------------------------------------- loading


def load_policy(path: str | os.PathLike, *, dtype: str | None = None, compute_dtype: str | None = None,
                mesh: Mesh | None = None, layout: models.Layout | None = None, progress: bool = False) -> Policy:
    """Load a policy from any source `describe_source` understands.

    Args:
      path: an HF directory, a policy checkpoint, a run checkpoint step, a run or its checkpoints/ directory.
      dtype: parameter dtype ("float32", "bfloat16", "float16"), also the compute dtype (as in
        `models.from_pretrained`); default: the stored parameters' dtype and the stored config's compute dtype.
      compute_dtype: activation dtype; default: `dtype` when given.
      mesh: place every parameter replicated on this mesh; default: the first device.
      layout: place every parameter by its logical axes on `layout.mesh` as it is read (no process or device
        ever holds the whole policy), and keep the layout in the returned policy (`models.shard`).
      progress: a progress bar while reading an HF checkpoint.

    Raises `CheckpointError` (naming the path) for something that is not a checkpoint, an incomplete one or
    parameters that do not fit the model config; `configlib.ConfigError` for a bad model config.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    source = describe_source(path)
    if source.kind == "hf":
        config = load_config(source.directory)  # for its head_dim; from_pretrained applies the dtypes
    elif source.kind == "policy":
        config = _policy_model_config(source.directory)
        params_dir, subtree = os.path.join(source.directory, PARAMS_DIR), None
    else:
        config = _run_model_config(source.config_file)
        params_dir, subtree = os.path.join(source.directory, "state"), "params"
    shardings = None
    if layout is not None:
        layout = layout.for_model(config)  # weights split whole heads, as their activations and KV cache
        shardings = layout.param_sharding
    if source.kind == "hf":
        policy = models.from_pretrained(source.directory, dtype, compute_dtype=compute_dtype, mesh=mesh,
                                        shardings=shardings, progress=progress)
        return policy if layout is None else policy.replace(layout=layout)
    policy = _restore(config, params_dir, subtree, dtype, mesh, shardings)
    if compute_dtype is not None and compute_dtype != policy.config.dtype:
        config = dataclasses.replace(policy.config, dtype=compute_dtype)
        policy = Policy(models.abstract(config).graphdef, config, policy.params)  # the graph holds the dtype
    return policy if layout is None else policy.replace(layout=layout)


def _policy_model_config(directory: str) -> ModelConfig:
    model_file = os.path.join(directory, MODEL_FILE)
    try:
        data = read_json_file(model_file, error=CheckpointError)  # limits: regular file, size, depth
    except FileNotFoundError:
        raise CheckpointError(f"{model_file}: missing") from None
    if not isinstance(data, dict) or data.get("format") != POLICY_FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise CheckpointError(f"{model_file}: not a {POLICY_FORMAT} policy checkpoint (format: {found!r})")
    if not isinstance(data.get("model"), dict):
        raise CheckpointError(f"{model_file}: no 'model' mapping")
    return configlib.from_dict(ModelConfig, data["model"], source=f"{model_file}: model")


def _restore(config: ModelConfig, item_dir: str, subtree: str | None, dtype: str | None,
             mesh: Mesh | None, shardings=None) -> Policy:
    """Restore the parameters stored at `item_dir` (under the key `subtree` of the stored tree, if given)
    against the shapes of `config`, read in their stored dtype and cast to `dtype` afterwards."""
    template = models.abstract(config)
    where = item_dir if subtree is None else f"{item_dir} [{subtree!r}]"
    if not os.path.isdir(item_dir):
        raise CheckpointError(f"{item_dir}: missing")
    try:
        stored = ocp.PyTreeCheckpointHandler().metadata(epath.Path(item_dir)).tree
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{item_dir}: cannot read the checkpoint metadata: {e}") from None
    if subtree is not None:
        if not isinstance(stored, dict) or subtree not in stored:
            keys = sorted(stored) if isinstance(stored, dict) else []
            raise CheckpointError(f"{item_dir}: no {subtree!r} entry (found: {', '.join(map(str, keys))})")
        stored = stored[subtree]
    stored_leaves = {_key(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(stored)[0]}
    sharding = (NamedSharding(mesh, PartitionSpec()) if mesh is not None
                else jax.sharding.SingleDeviceSharding(jax.devices()[0]))

    problems = []

    def target(key_path, leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        name = _key(key_path)
        meta = stored_leaves.pop(name, None)
        if meta is None:
            problems.append(f"missing {name!r} {list(leaf.shape)}")
        elif tuple(meta.shape) != tuple(leaf.shape):
            problems.append(f"{name!r} has shape {list(meta.shape)}, the model config implies {list(leaf.shape)}")
        else:
            where = sharding if shardings is None else shardings(key_path, leaf.shape)
            return jax.ShapeDtypeStruct(leaf.shape, meta.dtype, sharding=where)
        return leaf

    item = jax.tree_util.tree_map_with_path(target, template.params)
    if stored_leaves:
        problems.append(f"{len(stored_leaves)} stored arrays the model config does not have, e.g. "
                        f"{next(iter(stored_leaves))!r}")
    if problems:
        raise CheckpointError(f"{where}: parameters do not match the {config.family} model config: " +
                              "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10
                                                          else ""))
    if subtree is not None:
        item = {subtree: item}
    try:
        restored = ocp.PyTreeCheckpointer().restore(item_dir, args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=subtree is not None))
    except Exception as e:  # noqa: BLE001  orbax and tensorstore raise many types (a bare Exception too) for
        # missing or damaged files: one line naming the checkpoint, never a traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{where}: cannot restore the parameters: {first}") from None
    if subtree is not None:  # a run's checkpoint: its arrays carry digests (checked before any cast)
        try:
            verify_saved_arrays(os.path.dirname(item_dir), {subtree: restored[subtree]})
        except CheckpointDamaged as e:
            raise CheckpointError(str(e)) from None
    params = restored[subtree] if subtree is not None else restored
    if dtype is not None and (dtype, dtype) != (config.param_dtype, config.dtype):
        config = dataclasses.replace(config, param_dtype=dtype, dtype=dtype)
        template = models.abstract(config)  # the graph holds the compute dtype
    params = jax.tree.map(lambda x: x.astype(config.param_dtype), params)
    return Policy(template.graphdef, config, params)


def _key(key_path) -> str:
    """'layers.0.mlp.up_proj.weight.value' for a key path of a State (int keys, attributes) or of the
    stored metadata (string keys): the two spell the same path alike."""
    parts = []
    for k in key_path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


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
