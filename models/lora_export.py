"""LoRA exports: a PEFT adapter directory, and a merged Hugging Face checkpoint.

    lora_export.save_peft(policy, spec, "out/adapter", base_model_name_or_path="Qwen/Qwen2.5-Math-1.5B")
    lora_export.save_merged(policy, spec, "out/hf", base="~/models/Qwen2.5-Math-1.5B")

`policy` is an adapted policy (`models.lora.add_adapters`), `spec` the `LoraSpec` it was built with. The PEFT
directory holds `adapter_config.json` and `adapter_model.safetensors`, which `peft.PeftModel.from_pretrained`
loads onto the base checkpoint. PEFT computes `y = x W^T + (lora_alpha / r) (x A_peft^T) B_peft^T` with
`lora_A.weight` `[r, in]` and `lora_B.weight` `[out, r]`, so qwix's `A [in, r]` and `B [r, out]` are stored
transposed. The merged checkpoint is `models.lora.merged` (a quantized base dequantized) written by
`models.save_pretrained`, so it works for every family the project saves.

Both are written into a temporary directory beside `directory` and renamed into place when complete: an
interrupted export leaves no directory that looks complete, and an existing one is replaced only at the end.
Arrays are fetched with `jax.device_get`: on several processes, all-gather the policy first.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable

import jax
import numpy as np

from jaxrl.models import hf, lora
from jaxrl.models.safetensors_io import TensorSpec, write_file
from jaxrl.models.transformer import Policy

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the causal LM, whose modules start `model.layers`


def _module_name(path: str) -> str:
    """HF module name of a projection path: `layers/0/self_attn/q_proj` -> `model.layers.0.self_attn.q_proj`."""
    return hf.hf_name(tuple(path.split("/")))


def _adapters(policy: Policy, spec: lora.LoraSpec) -> dict[str, tuple[jax.Array, jax.Array]]:
    """`models.lora.adapter_weights`, after checking that `policy` is adapted, with `spec.rank`."""
    if not lora.is_adapted(policy):
        raise ValueError("the policy has no LoRA adapters (models.lora.add_adapters): export a plain policy with "
                         "models.save_pretrained")
    adapters = lora.adapter_weights(policy)
    if not adapters:
        raise ValueError("the policy's params hold no LoRA adapters (weight_lora_a / weight_lora_b)")
    for path, (a, b) in adapters.items():
        if a.shape[1] != spec.rank or b.shape[0] != spec.rank:
            raise ValueError(f"{path}: adapters of rank {a.shape[1]} (A {list(a.shape)}, B {list(b.shape)}), but "
                             f"spec.rank is {spec.rank}: pass the LoraSpec the policy was adapted with")
    return adapters


def peft_tensors(policy: Policy, spec: lora.LoraSpec, dtype: str | None = None) -> dict[str, np.ndarray]:
    """`{PEFT tensor name: host array}`: per adapted projection, `...<proj>.lora_A.weight` = A^T `[rank, in]` and
    `...<proj>.lora_B.weight` = B^T `[out, rank]`, in `dtype` (default: the adapters' own)."""
    out = {}
    for path, (a, b) in _adapters(policy, spec).items():
        name = PEFT_PREFIX + _module_name(path)
        for suffix, value in (("lora_A", a.T), ("lora_B", b.T)):
            host = np.asarray(jax.device_get(value))
            out[f"{name}.{suffix}.weight"] = np.ascontiguousarray(host.astype(dtype or host.dtype, copy=False))
    return out


def target_modules(policy: Policy, spec: lora.LoraSpec) -> list[str]:
    """PEFT's `target_modules`: the projection names (`q_proj`, ...) where every layer adapts the same ones,
    else the exact module names (`model.layers.0.self_attn.q_proj`), which PEFT matches whole."""
    adapted = list(_adapters(policy, spec))
    names = [p for p in lora.PROJECTIONS if any(path.rsplit("/", 1)[-1] == p for path in adapted)]
    every_layer = [path for path in lora.projection_paths(policy.config) if path.rsplit("/", 1)[-1] in names]
    if sorted(every_layer) == sorted(adapted):
        return names
    return [_module_name(path) for path in adapted]


def peft_config(policy: Policy, spec: lora.LoraSpec, base_model_name_or_path: str | None) -> dict:
    """The `adapter_config.json` of a PEFT LoRA adapter (scale `lora_alpha / r`, no dropout, no bias)."""
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else float(spec.alpha)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": spec.rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": target_modules(policy, spec),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
    }


def save_peft(policy: Policy, spec: lora.LoraSpec, directory: str | os.PathLike,
              base_model_name_or_path: str | None = None, *, dtype: str | None = None) -> None:
    """Write `policy`'s adapters as a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`)
    at `directory`, replacing what is there. `base_model_name_or_path`: recorded in the config (the base that
    `PeftModel.from_pretrained` is given, e.g. the HF directory or hub name the policy was loaded from)."""
    tensors = peft_tensors(policy, spec, dtype)  # errors before anything is written
    config = peft_config(policy, spec, None if base_model_name_or_path is None else os.fspath(base_model_name_or_path))

    def write(tmp: str) -> None:
        specs = [TensorSpec(name, value.dtype, value.shape) for name, value in tensors.items()]
        write_file(os.path.join(tmp, PEFT_WEIGHTS), specs, tensors.values(), metadata={"format": "pt"})
        with open(os.path.join(tmp, PEFT_CONFIG), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")

    _write_atomically(directory, write)


def save_merged(policy: Policy, spec: lora.LoraSpec, directory: str | os.PathLike, *,
                base: str | os.PathLike | None = None, dtype: str | None = None,
                max_shard_bytes: int = 5 * 2**30, progress: bool = False) -> None:
    """Write `policy` with its adapters folded in (`models.lora.merged`: `W + (alpha / rank) (A B)^T`, a quantized
    base dequantized) as an HF checkpoint directory at `directory`, replacing what is there. `base`, `dtype`,
    `max_shard_bytes`, `progress`: as `models.save_pretrained` (`base` is the HF directory the base came from:
    its tokenizer and other files are copied)."""
    _adapters(policy, spec)
    plain = lora.merged(policy, spec)
    _write_atomically(directory, lambda tmp: hf.save_pretrained(plain, tmp, dtype=dtype, base=base,
                                                                max_shard_bytes=max_shard_bytes, progress=progress))


def _write_atomically(directory: str | os.PathLike, write: Callable[[str], None]) -> None:
    """`write(tmp)` into a fresh temporary directory beside `directory`, then rename it to `directory` (an
    existing one is moved aside first and removed after). The temporary directory is removed on failure."""
    dst = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise FileExistsError(f"{dst}: exists and is not a directory")
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=parent)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0o700
        if os.path.lexists(dst):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=parent)
            os.rename(dst, os.path.join(old, "x"))
            os.rename(tmp, dst)
            shutil.rmtree(old)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
