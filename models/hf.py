"""Hugging Face checkpoints in and out: `config.json` + `*.safetensors`, streamed one tensor at a time.

    policy = models.from_pretrained("~/models/Qwen2.5-Math-1.5B", dtype="float32", mesh=mesh)
    logits = models.forward(policy, tokens)
    models.save_pretrained(policy, "out/qwen-rl", base="~/models/Qwen2.5-Math-1.5B")

The parameter tree mirrors HF names and layouts (`models.transformer`), so loading is: check every header
against the expected shapes (before reading any data), then read each tensor into a fresh host array (cast
there if asked), place it on the device(s) with its sharding and drop the host copy. At most one stored
tensor exists beside the parameters at any time. Saving writes each tensor as it is fetched.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding
from tqdm.auto import tqdm

from jaxrl.models import hf_config
from jaxrl.models.configs import ModelConfig
from jaxrl.models.safe_read import open_regular, read_json_file
from jaxrl.models.safetensors_io import (SafetensorsError, TensorInfo, TensorSpec, aligned_empty, read_header, read_tensor,
                                   write_file)
from jaxrl.models.transformer import Policy, abstract
from jaxrl.errors import JaxrlError

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tensors some checkpoints carry that the model recomputes or shares: skipped, with a log line.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|msgpack|h5)$|.*\.safetensors\.index\.json$")

ParamPath = tuple[str | int, ...]
ShardingFn = Callable[[ParamPath, tuple[int, ...]], Sharding]


class CheckpointError(JaxrlError, ValueError):
    """A checkpoint that cannot be loaded exactly; the message names the file and the tensor."""

    kind = "checkpoint error"


def hf_name(path: ParamPath) -> str:
    """HF tensor name of a parameter path, e.g. `("layers", 0, "mlp", "up_proj", "weight")` ->
    `model.layers.0.mlp.up_proj.weight`."""
    name = ".".join(str(k) for k in path)
    return name if path[0] == "lm_head" else f"model.{name}"


def _param_paths(params: nnx.State) -> list[tuple[ParamPath, Any]]:
    return [(tuple(path), variable.get_value()) for path, variable in nnx.to_flat_state(params)]


def read_config(directory: str) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint directory: a JSON object read with `models.safe_read`'s limits
    (a regular file of at most 64 MiB, nested at most 64 levels)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: not a directory (expected a Hugging Face checkpoint directory)")
    try:
        raw = read_json_file(path, error=CheckpointError)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (a Hugging Face checkpoint directory has config.json)") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object of settings, got {type(raw).__name__}")
    return raw


def load_config(directory: str | os.PathLike, *, dtype: str | None = None,
                compute_dtype: str | None = None) -> ModelConfig:
    """The `ModelConfig` of an HF checkpoint directory (see `models.hf_config.from_hf`)."""
    directory = os.path.expanduser(os.fspath(directory))
    try:
        return hf_config.from_hf(read_config(directory), os.path.join(directory, "config.json"),
                                 dtype=compute_dtype, param_dtype=dtype)
    except hf_config.ConfigError as e:
        raise CheckpointError(str(e)) from None


def _tensor_index(directory: str) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint by name, from `model.safetensors` or else the index of its shards (the
    order of transformers' `from_pretrained`: with both, the single file)."""
    index_path = os.path.join(directory, INDEX_FILE)
    try:
        if os.path.lexists(os.path.join(directory, SINGLE_FILE)):
            return read_header(os.path.join(directory, SINGLE_FILE))[0]
        if os.path.lexists(index_path):
            weight_map = _weight_map(index_path)
            tensors = {}
            for file in sorted(set(weight_map.values())):
                path = os.path.join(directory, file)
                if not os.path.lexists(path):
                    raise CheckpointError(f"{path}: missing (listed in {INDEX_FILE})")
                tensors.update(read_header(path)[0])
            for name, file in weight_map.items():
                if name not in tensors or os.path.basename(tensors[name].file) != file:
                    raise CheckpointError(f"{os.path.join(directory, file)}: tensor {name!r} listed in "
                                          f"{INDEX_FILE} is not in that file")
            return tensors
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            other = [f for f in os.listdir(directory) if _WEIGHT_FILE.match(f)]
            raise CheckpointError(f"{directory}: no *.safetensors weights" +
                                  (f" (found {', '.join(other)}: convert them to safetensors)" if other else ""))
        if len(files) > 1:
            raise CheckpointError(f"{directory}: {len(files)} safetensors files but no {INDEX_FILE}")
        return read_header(os.path.join(directory, files[0]))[0]
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None


def _weight_map(index_path: str) -> dict[str, str]:
    """The index's `weight_map`: tensor name -> a file name in the same directory (no path: `../x` or `/dev/x`
    would read outside the checkpoint)."""
    try:
        index = read_json_file(index_path, error=CheckpointError)
    except FileNotFoundError:
        raise CheckpointError(f"{index_path}: missing") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: 'weight_map' must be an object of tensor name -> file name, got "
                              f"{type(weight_map).__name__}")
    for name, file in weight_map.items():
        if not isinstance(file, str) or file in ("", ".", "..") or os.path.basename(file) != file or "/" in file:
            raise CheckpointError(f"{index_path}: weight_map[{name!r}] must be a file name in the checkpoint "
                                  f"directory, got {repr(file)[:80]}")
    return weight_map


def from_pretrained(
    path: str | os.PathLike,
    dtype: str | None = None,
    *,
    compute_dtype: str | None = None,
    mesh: Mesh | None = None,
    shardings: ShardingFn | None = None,
    progress: bool = True,
) -> Policy:
    """Load an HF checkpoint directory (`config.json` + `model.safetensors` or sharded with an index).

    Args:
      path: local directory (nothing is downloaded).
      dtype: parameter dtype ("float32", "bfloat16", "float16"); default: the checkpoint's own.
      compute_dtype: activation dtype; default: `dtype`.
      mesh: place every parameter on this mesh as it is read (replicated unless `shardings` says otherwise).
      shardings: `(param path, shape) -> Sharding`, e.g. from logical-axis rules; needs no mesh.
      progress: a progress bar over bytes read.

    Raises `CheckpointError` naming the file and tensor for a missing file, an unsupported architecture, a
    missing tensor or one of the wrong shape, before any data is read, and for a tied checkpoint that also
    stores an `lm_head.weight` other than the embedding; nothing half-loaded is returned.
    """
    directory = os.path.expanduser(os.fspath(path))
    config = load_config(directory, dtype=dtype, compute_dtype=compute_dtype)
    template = abstract(config)
    tensors = _tensor_index(directory)
    plan = _match(template.params, tensors, config, directory)
    stored_head = tensors.get("lm_head.weight") if config.tie_embeddings else None
    if shardings is None:
        default = NamedSharding(mesh, PartitionSpec()) if mesh is not None else jax.sharding.SingleDeviceSharding(
            jax.devices()[0])
        shardings = lambda _path, _shape: default  # noqa: E731

    total = sum(info.nbytes for _, info, _ in plan)
    loaded: dict[ParamPath, jax.Array] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {os.path.basename(directory)}",
              disable=not progress, leave=False) as bar:
        for param_path, info, target in plan:
            try:
                host = read_tensor(info)
            except (SafetensorsError, OSError) as e:
                raise CheckpointError(f"{info.file}: tensor {info.name!r}: {e}") from None
            if stored_head is not None and param_path == ("embed_tokens", "weight"):
                _check_tied_head(host, stored_head, directory)
            if host.dtype != target.dtype:  # cast on the host: the stored copy is freed at once
                cast = aligned_empty(host.shape, np.dtype(target.dtype))
                np.copyto(cast, host, casting="unsafe")
                host = cast
            # On CPU, XLA adopts the aligned host array without a copy; elsewhere it is copied and dropped.
            loaded[param_path] = jax.device_put(host, shardings(param_path, target.shape))
            del host
            bar.update(info.nbytes)
    params = template.params
    for param_path, variable in nnx.to_flat_state(params):
        variable.set_value(loaded[tuple(param_path)])
    return Policy(template.graphdef, config, params)


def _check_tied_head(embedding: np.ndarray, head: TensorInfo, directory: str) -> None:
    """A tied checkpoint may store `lm_head.weight` too, but only as a copy of the embedding `[vocab, hidden]`:
    transformers 5 leaves a model whose stored head differs untied, so ignoring that head would change the
    logits. Compared through a memory map, a slice of rows at a time (no second copy of the table)."""
    same = head.shape == embedding.shape
    if same:
        with open_regular(head.file, CheckpointError) as f:
            stored = np.memmap(f, head.dtype, "r", head.offset, head.shape)
            rows = max(1, 2**22 // max(1, embedding[0].size))
            same = all(np.array_equal(embedding[i:i + rows], stored[i:i + rows])
                       for i in range(0, len(embedding), rows))
            del stored
    if not same:
        raise CheckpointError(f"{head.file}: tensor 'lm_head.weight' differs from 'model.embed_tokens.weight', but "
                              f"{os.path.join(directory, 'config.json')} has tie_word_embeddings=true (transformers "
                              "5 then uses the stored head, untied): set tie_word_embeddings to false to use it, or "
                              "remove it to tie the head to the embedding")


def _match(params: nnx.State, tensors: dict[str, TensorInfo], config: ModelConfig,
           directory: str) -> list[tuple[ParamPath, TensorInfo, jax.ShapeDtypeStruct]]:
    """Pair every parameter with its tensor; every problem is reported before any data is read."""
    plan, problems = [], []
    for param_path, target in _param_paths(params):
        name = hf_name(param_path)
        info = tensors.get(name)
        if info is None:
            problems.append(f"missing tensor {name!r} {list(target.shape)}")
        elif info.shape != target.shape:
            problems.append(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, the config.json implies "
                            f"{list(target.shape)}")
        elif info.dtype.kind not in "fV" or info.dtype.itemsize < 2:
            problems.append(f"{info.file}: tensor {name!r} has dtype {info.dtype} (quantized checkpoints are "
                            "not supported)")
        else:
            plan.append((param_path, info, target))
    if problems:
        files = sorted({os.path.basename(i.file) for i in tensors.values()})
        raise CheckpointError(f"{directory} ({', '.join(files)}): " + "; ".join(problems[:10]) +
                              (f"; and {len(problems) - 10} more" if len(problems) > 10 else ""))
    expected = {hf_name(p) for p, _, _ in plan}
    extra = sorted(set(tensors) - expected)
    if config.tie_embeddings and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")
        log.info("%s: tied embeddings: the stored lm_head.weight is not used", directory)
    skipped = [n for n in extra if _IGNORED.match(n)]
    if skipped:
        log.info("%s: skipping %d recomputed tensors (%s)", directory, len(skipped), skipped[0])
    unknown = [n for n in extra if not _IGNORED.match(n)]
    if unknown:
        where = os.path.basename(tensors[unknown[0]].file)
        raise CheckpointError(f"{directory}: {len(unknown)} tensors the {config.family} architecture does not "
                              f"have, e.g. {unknown[0]!r} in {where} (a different architecture or a wrong "
                              "config.json?)")
    return plan


def save_pretrained(
    policy: Policy,
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    base: str | os.PathLike | None = None,
    max_shard_bytes: int = 5 * 2**30,
    progress: bool = True,
) -> None:
    """Write `policy` as an HF checkpoint directory that `transformers` (and vLLM) load.

    Args:
      dtype: storage dtype; default: the parameters' dtype (so `save_pretrained(from_pretrained(d))`
        reproduces `d`'s tensors bit for bit).
      base: the HF directory the policy came from: its `config.json` keys that do not describe the
        architecture (token ids, ...) are kept, and its other files (tokenizer, generation config, chat
        template, license, ...) are copied.
      max_shard_bytes: above this total, weights are split into `model-0000i-of-0000n.safetensors` files
        with a `model.safetensors.index.json`.
    """
    directory = os.path.expanduser(os.fspath(path))
    os.makedirs(directory, exist_ok=True)
    config = policy.config
    store_dtype = np.dtype(dtype or config.param_dtype)
    arch = hf_config.to_hf(config, store_dtype.name)
    raw = {}
    if base is not None:
        base = os.path.expanduser(os.fspath(base))
        raw = read_config(base)
        for key in _ARCH_KEYS | set(arch):
            raw.pop(key, None)
        copy_non_weight_files(base, directory, skip=("config.json",))

    entries = [(hf_name(p), value) for p, value in _param_paths(policy.params)]
    specs = [TensorSpec(name, store_dtype, tuple(value.shape)) for name, value in entries]
    shards = _shard(specs, max_shard_bytes)
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    values = dict(entries)
    total = sum(np.prod(s.shape, dtype=np.int64) * store_dtype.itemsize for s in specs)
    with tqdm(total=int(total), unit="B", unit_scale=True, desc=f"saving {os.path.basename(directory)}",
              disable=not progress, leave=False) as bar:
        def arrays(shard):
            for spec in shard:
                host = np.asarray(jax.device_get(values[spec.name]))
                yield host.astype(store_dtype, copy=False)
                bar.update(host.size * store_dtype.itemsize)
        for name, shard in zip(names, shards):
            write_file(os.path.join(directory, name), shard, arrays(shard), metadata={"format": "pt"})
    index_path = os.path.join(directory, INDEX_FILE)
    if len(shards) > 1:
        index = {"metadata": {"total_size": int(total)},
                 "weight_map": {spec.name: name for name, shard in zip(names, shards) for spec in shard}}
        _write_json(index_path, index)
    # Weight files of an earlier save into the same directory would shadow or contradict these.
    for stale in os.listdir(directory):
        if (stale.endswith(".safetensors") and stale not in names) or (stale == INDEX_FILE and len(shards) == 1):
            os.remove(os.path.join(directory, stale))
    _write_json(os.path.join(directory, "config.json"), {**raw, **arch})


# config.json keys that describe the architecture in either transformers spelling: never copied from `base`.
_ARCH_KEYS = {"rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq", "dtype", "torch_dtype",
              "layer_types", "sliding_window", "sliding_window_pattern", "_sliding_window_pattern",
              "use_sliding_window", "max_window_layers", "attention_bias", "transformers_version"}


def copy_non_weight_files(source: str, destination: str, skip: tuple[str, ...] = ()) -> None:
    """Copy the top-level files of an HF directory other than weights (tokenizer, generation config, chat
    template, license, ...) from `source` to `destination`, except the names in `skip`."""
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if os.path.isfile(path) and name not in skip and not _WEIGHT_FILE.match(name):
            shutil.copyfile(path, os.path.join(destination, name))


def _shard(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of at most `max_bytes` (a larger tensor gets a file of its own)."""
    shards, current, size = [], [], 0
    for spec in specs:
        nbytes = int(np.prod(spec.shape, dtype=np.int64)) * spec.dtype.itemsize
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    return shards + [current] if current else shards


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)

