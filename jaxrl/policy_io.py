"""Reading policies for training and evaluation: what a checkpoint path holds (`describe_source`) and
`load_policy` for any of the four kinds below. The conversion tool (`jaxrl convert`, `save_policy`) is in
`jaxrl.convert`.

Four kinds of source are understood:

* a Hugging Face directory: `config.json` + `model.safetensors` (or shards with an index);
* a *policy checkpoint* (`POLICY_FORMAT`, written by `jaxrl.convert.save_policy`)::

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
import os
import re
from typing import Literal

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl import configlib, models
from jaxrl.checkpoint import CheckpointDamaged, verify_saved_arrays
from jaxrl.models import lora
from jaxrl.models.configs import ModelConfig
from jaxrl.models.hf import CheckpointError, load_config
from jaxrl.models.safe_read import read_json_file
from jaxrl.models.transformer import Policy

__all__ = ["DTYPES", "HF_FILES_DIR", "MODEL_FILE", "PARAMS_DIR", "POLICY_FORMAT", "RUN_MODEL_FILE", "Source",
           "describe_source", "load_policy"]

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
        run = os.path.dirname(source.config_file)
        if os.path.lexists(os.path.join(run, lora.BASE_RECORD)):
            return _load_lora_run(source, run, dtype=dtype, compute_dtype=compute_dtype, mesh=mesh, layout=layout,
                                  progress=progress)
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


def _load_lora_run(source: Source, run: str, **load) -> Policy:
    """A LoRA run's checkpoint (it holds the adapters alone): the base it records (`lora_base.json`), checked by
    its fingerprint, with the checkpoint's adapters merged in (`models.lora.merged`; a quantized base comes back
    dequantized), as a plain policy."""
    from jaxrl.config import LoraConfig  # (jaxrl.config imports much of jaxrl; only LoRA runs need it)
    record_file = os.path.join(run, lora.BASE_RECORD)
    record = read_json_file(record_file, error=CheckpointError)
    if not isinstance(record, dict) or not isinstance(record.get("name"), str):
        raise CheckpointError(f"{record_file}: expected {{'name': <base path>, 'fingerprint': ...}}")
    try:
        base = load_policy(record["name"], **load)
    except CheckpointError as e:
        raise CheckpointError(f"{source.directory}: a LoRA run's checkpoint; its base ({record_file}) does not load: "
                              f"{e}") from None
    if lora.fingerprint(base) != record.get("fingerprint"):
        raise CheckpointError(f"{source.directory}: a LoRA run's checkpoint, but its base {record['name']} is not the "
                              f"one its adapters were trained on (weights' fingerprint {lora.fingerprint(base)}, "
                              f"recorded {record.get('fingerprint')} in {record_file})")
    data = configlib.load_yaml(source.config_file) or {}
    section = ((data.get("rl") or {}).get("lora") or {}) if isinstance(data, dict) else {}
    settings = configlib.from_dict(LoraConfig, section, source=f"{source.config_file}: rl.lora")
    spec = lora.LoraSpec.of(settings)
    adapted = lora.add_adapters(base, spec, seed=0)  # the checkpoint's adapters replace these
    shardings = None if base.layout is None else base.layout.param_sharding
    trained = _restore(base.config, os.path.join(source.directory, "state"), "params", None, load.get("mesh"),
                       shardings, template=adapted)
    return lora.merged(trained, spec)


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
             mesh: Mesh | None, shardings=None, template: Policy | None = None) -> Policy:
    """Restore the parameters stored at `item_dir` (under the key `subtree` of the stored tree, if given)
    against the shapes of `config`, read in their stored dtype and cast to `dtype` afterwards. `template`: the
    policy whose `params` are stored (an adapted policy: its adapters), with its graph and frozen base kept."""
    adapted = template
    template = template or models.abstract(config)
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
    if adapted is not None:
        return adapted.replace(params=params)
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
