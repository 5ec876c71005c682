"""Hugging Face `config.json` <-> `ModelConfig`, for both transformers 4.x and 5.x spellings.

transformers 4.x writes `torch_dtype`, `rope_theta` + `rope_scaling` (and Gemma 3's `rope_local_base_freq`,
older Gemma 3 files `sliding_window_pattern` instead of `layer_types`); 5.x writes `dtype` and
`rope_parameters` (per layer type for Gemma 3). Both are read; keys that do not change the numerics
(`use_cache`, `id2label`, token ids, ...) are ignored. `to_hf` writes both spellings: 4.57 ignores
`rope_parameters` (it would silently fall back to an unscaled theta of 1e4) and 5.x prefers it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxrl.models.configs import Family, ModelConfig, RopeScaling
from jaxrl.errors import JaxrlError

ARCHITECTURES: dict[str, tuple[Family, str]] = {  # HF model_type -> (family, architecture class)
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3_text": ("gemma3", "Gemma3ForCausalLM"),
}
_MODEL_TYPE = {family: model_type for model_type, (family, _) in ARCHITECTURES.items()}
_TIED_BY_DEFAULT = {"llama": False, "qwen2": False, "qwen3": False, "gemma3": True}
_PLAIN = dict(norm_offset=0.0, post_norms=False, scale_embeddings=False, qk_norm=False, activation="silu")
TRAITS: dict[str, dict[str, Any]] = {  # what each family fixes, whatever its config.json says
    "llama": _PLAIN,
    "qwen2": {**_PLAIN, "qkv_bias": True, "o_bias": False},
    "qwen3": {**_PLAIN, "qk_norm": True},
    "gemma3": dict(norm_offset=1.0, post_norms=True, scale_embeddings=True, qk_norm=True, activation="gelu_tanh"),
}
# transformers' config-class defaults for keys that change the outputs, where they differ from the fallbacks
# below (a hand-written config.json may leave them out; released checkpoints spell them all out).
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "rope_local_base_freq": 10_000.0, "rope_theta": 1e6},
    "qwen2": {"sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"head_dim": 128, "sliding_window": 4096, "max_window_layers": 28},
}
_MAX_LAYERS = 1024  # the largest released decoders have under 200
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


class ConfigError(JaxrlError, ValueError):
    """An unsupported or inconsistent `config.json`; the message names the file and the key."""

    kind = "checkpoint error"


_REQUIRED = object()
_TYPE_NAMES = {int: "an integer of at most 64 bits", float: "a finite number", bool: "true or false", str: "a string",
               dict: "an object", list: "a list"}


class _Keys:
    """Typed access to one JSON object of `config.json` (the top level or a nested one such as `rope_scaling`):
    a value of the wrong type (`"32"` for an int, `"false"` for a bool, a list for an object), a non-finite
    number, or a count below 1 is a `ConfigError` naming the file and the dotted key, never a TypeError later.
    JSON null counts as absent (transformers writes nulls for unset keys)."""

    def __init__(self, raw: Any, source: str, prefix: str = ""):
        if not isinstance(raw, dict):
            what = f"{prefix.rstrip('.')} must be an object" if prefix else "expected a JSON object"
            raise ConfigError(f"{source}: {what}, got {_show(raw)}")
        self.raw, self.source, self.prefix = raw, source, prefix

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def get(self, key: str, kind: type, default: Any = None, *, positive: bool = False,
            most: int | None = None) -> Any:
        """`raw[key]` checked to be of `kind` (int, float, bool, str, dict or list; float accepts integers and
        returns a float), `default` when absent or null; `positive`: a number must be > 0; `most`: at most."""
        value = self.raw.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ConfigError(f"{self.source}: missing key {self.prefix + key!r}")
            return default
        ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
        if kind is int and ok:
            ok = -2**63 <= value < 2**63
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                ok, value = math.isfinite(float(value)), float(value)
            except OverflowError:  # an integer beyond float's range
                ok = False
        if ok and positive and not value > 0:
            raise ConfigError(f"{self.source}: {self.prefix + key} must be > 0, got {value!r}")
        if ok and most is not None and value > most:
            raise ConfigError(f"{self.source}: {self.prefix + key} must be at most {most}, got {value!r}")
        if not ok:
            raise ConfigError(f"{self.source}: {self.prefix + key} must be {_TYPE_NAMES[kind]}, got {_show(value)}")
        return value

    def sub(self, key: str) -> "_Keys":
        """The nested object at `key` ({} when absent or null)."""
        return _Keys(self.get(key, dict, {}), self.source, f"{self.prefix}{key}.")


def _show(value: Any) -> str:
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:60] + '...'} ({type(value).__name__})"


def from_hf(raw: dict[str, Any], source: str = "config.json", *, dtype: str | None = None,
            param_dtype: str | None = None) -> ModelConfig:
    """The `ModelConfig` of an HF `config.json` dict.

    `param_dtype` defaults to the checkpoint's own dtype (`dtype` / `torch_dtype`, else float32) and `dtype`
    (the compute dtype) to `param_dtype`.
    """
    keys = _Keys(raw, source)
    model_type = keys.get("model_type", str, _REQUIRED)
    if model_type not in ARCHITECTURES:
        hint = (" (a multimodal Gemma 3 checkpoint: convert its language model to Gemma3ForCausalLM first)"
                if model_type == "gemma3" else "")
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported{hint}; supported: "
                          f"{', '.join(sorted(ARCHITECTURES))}")
    family = ARCHITECTURES[model_type][0]
    keys = _Keys({**_CLASS_DEFAULTS.get(model_type, {}), **raw}, source)
    for key, value, why in (("mlp_bias", False, "biased MLP projections"),
                            ("use_bidirectional_attention", False, "bidirectional attention"),
                            ("pretraining_tp", 1, "tensor-parallel pretraining slices")):
        if keys.get(key, type(value), value) != value:
            raise ConfigError(f"{source}: {key}={keys.raw[key]!r} ({why}) is not supported")
    gemma = family == "gemma3"
    activation_key = "hidden_activation" if gemma else "hidden_act"
    activation = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}.get(keys.get(activation_key, str, "?"))
    if keys.has(activation_key) and activation != TRAITS[family]["activation"]:
        raise ConfigError(f"{source}: {activation_key}={keys.raw[activation_key]!r} is not supported for "
                          f"{model_type} (transformers' {model_type} uses {TRAITS[family]['activation']})")

    def count(key, default=_REQUIRED):
        return keys.get(key, int, default, positive=True)

    hidden, heads = count("hidden_size"), count("num_attention_heads")
    # Layers are built one by one (and listed in layer_types): a billion would hang before any header check.
    num_layers = keys.get("num_hidden_layers", int, _REQUIRED, positive=True, most=_MAX_LAYERS)
    theta, scaling, local_theta = _rope(keys, family)
    window, layer_types = _sliding_layers(keys, family, num_layers)
    stored = _DTYPES.get(keys.get("dtype", str, None) or keys.get("torch_dtype", str, "float32"), "float32")
    param_dtype = param_dtype or stored
    attention_bias = keys.get("attention_bias", bool, False)
    traits = {"qkv_bias": attention_bias, "o_bias": attention_bias, **TRAITS[family]}
    config = ModelConfig(
        family=family,
        vocab_size=count("vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=count("num_key_value_heads", heads),
        head_dim=count("head_dim", hidden // heads),
        intermediate_size=count("intermediate_size"),
        max_position_embeddings=count("max_position_embeddings", 4096),
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        norm_eps=keys.get("rms_norm_eps", float, 1e-6, positive=True),
        tie_embeddings=keys.get("tie_word_embeddings", bool, _TIED_BY_DEFAULT[family]),
        **traits,
        query_pre_attn_scalar=keys.get("query_pre_attn_scalar", float, positive=True) if gemma else None,
        # transformers' Gemma 3 stores attn_logit_softcapping but never applies it (4.57 and 5.x alike;
        # Gemma 3 replaced it by q/k norms): ignored here too, so logits match.
        attn_logit_softcap=None,
        final_logit_softcap=keys.get("final_logit_softcapping", float, positive=True) if gemma else None,
        sliding_window=window,
        layer_types=layer_types,
        dtype=dtype or param_dtype,
        param_dtype=param_dtype,
    )
    for f in dataclasses.fields(config):  # values derived from others (head_dim = hidden // heads) too
        value = getattr(config, f.name)
        if "gt" in f.metadata and isinstance(value, (int, float)) and not value > f.metadata["gt"]:
            raise ConfigError(f"{source}: the model's {f.name} must be > {f.metadata['gt']}, got {value!r}")
    try:
        config.validate()
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    return config


def _rope_scaling(params: _Keys) -> RopeScaling:
    if not params.raw:
        return RopeScaling()
    kind = params.get("rope_type", str, None) or params.get("type", str, "default")
    key = params.prefix.rstrip(".")
    if kind == "default":
        return RopeScaling()
    if kind not in ("linear", "llama3"):
        raise ConfigError(f"{params.source}: {key} type {kind!r} is not supported (default, linear, llama3)")
    factor = params.get("factor", float, _REQUIRED, positive=True)
    if kind == "linear":
        return RopeScaling("linear", factor)
    return RopeScaling("llama3", factor, params.get("low_freq_factor", float, _REQUIRED, positive=True),
                       params.get("high_freq_factor", float, _REQUIRED, positive=True),
                       params.get("original_max_position_embeddings", int, _REQUIRED, positive=True))


def _rope(keys: _Keys, family: str) -> tuple[float, RopeScaling, float | None]:
    """`(rope_theta, scaling, local_rope_theta)`; global-layer values for Gemma 3.

    A non-empty `rope_scaling` decides the scaling (of Gemma 3's full-attention layers) whatever
    `rope_parameters` says: transformers 4.x reads only `rope_scaling`, and 5.x lets it override
    `rope_parameters`. A rope_theta missing from `rope_parameters` is the top-level one, as 5.x reads it.
    """
    params, rope_scaling = keys.sub("rope_parameters"), keys.sub("rope_scaling")
    top = keys.get("rope_theta", float, None, positive=True)
    top_local = keys.get("rope_local_base_freq", float, None, positive=True)
    full, local = params, _Keys({}, keys.source, "rope_parameters.sliding_attention.")
    if family == "gemma3" and params.has("full_attention"):
        full, local = params.sub("full_attention"), params.sub("sliding_attention")
        local_scaling = _rope_scaling(local)
        if local_scaling.type != "default":
            raise ConfigError(f"{keys.source}: rope_parameters.sliding_attention type {local_scaling.type!r} is not "
                              "supported (sliding layers use unscaled RoPE)")
    full_theta = full.get("rope_theta", float, None, positive=True)
    theta = full_theta or top or 10_000.0  # Gemma 3's 1e6: _CLASS_DEFAULTS
    if rope_scaling.raw:
        scaling = _rope_scaling(rope_scaling)
        theta = rope_scaling.get("rope_theta", float, None, positive=True) or top or full_theta or 10_000.0
    else:
        scaling = _rope_scaling(full)
    local_theta = (local.get("rope_theta", float, None, positive=True) or top_local or 10_000.0
                   if family == "gemma3" else None)
    return theta, scaling, local_theta


def _sliding_layers(keys: _Keys, family: str, num_layers: int) -> tuple[int | None, tuple]:
    """`(sliding_window, layer_types)`, with layer types "full" / "sliding" (() when every layer is full)."""
    if family == "llama" or (family in ("qwen2", "qwen3") and not keys.get("use_sliding_window", bool, False)):
        return None, ()  # whatever sliding_window says
    window = keys.get("sliding_window", int, None)
    if not window:
        return None, ()
    if window < 0:
        raise ConfigError(f"{keys.source}: sliding_window must be >= 0, got {window}")
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    if keys.get("layer_types", list, None):
        types = keys.raw["layer_types"]
        if len(types) != num_layers or any(not isinstance(t, str) or t not in names for t in types):
            raise ConfigError(f"{keys.source}: layer_types must list {num_layers} of {sorted(names)}, got "
                              f"{_show(types)}")
        types = tuple(names[t] for t in types)
    elif family == "gemma3":
        pattern = (keys.get("sliding_window_pattern", int, None, positive=True)
                   or keys.get("_sliding_window_pattern", int, 6, positive=True))
        types = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))
    else:
        first = keys.get("max_window_layers", int, num_layers)
        types = tuple("sliding" if i >= first else "full" for i in range(num_layers))
    return (window, types) if "sliding" in types else (None, ())


def to_hf(config: ModelConfig, dtype: str) -> dict[str, Any]:
    """The architecture keys of `config.json` (transformers 4.x spelling) for weights stored in `dtype`.

    Raises `ConfigError` when the file would describe a different model (a feature its family's config
    cannot express, such as a sliding window on Llama): what it writes is read back and compared."""
    model_type = _MODEL_TYPE[config.family]
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type][1]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling.type == "default" else _scaling_to_hf(config.rope_scaling),
        "rope_parameters": _rope_parameters(config),
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if config.family != "qwen2":
        out["attention_bias"] = config.qkv_bias
    if config.family == "gemma3":
        out.update(hidden_activation="gelu_pytorch_tanh",
                   query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
                   final_logit_softcapping=config.final_logit_softcap,
                   rope_local_base_freq=config.local_rope_theta or config.rope_theta)
    else:
        out["hidden_act"] = "silu"
    if config.sliding_window:
        out["sliding_window"] = config.sliding_window
        out["layer_types"] = [f"{t}_attention" for t in config.layer_types]
        if config.family in ("qwen2", "qwen3"):
            out["use_sliding_window"] = True
            out["max_window_layers"] = config.layer_types.index("sliding")
    elif config.family == "gemma3":  # transformers' Gemma 3 always has a window; here no layer uses it
        out["sliding_window"] = config.max_position_embeddings
        out["layer_types"] = ["full_attention"] * config.num_layers
    differs = _differences(config, from_hf(out, f"the {model_type} config.json being written"))
    if differs:
        raise ConfigError(f"this {config.family} model cannot be written as a transformers {model_type} "
                          f"config.json: it would load with a different {'; '.join(differs)}")
    return out


# Fields that do not change the outputs (or that `_behaviour` compares as their effect).
_NOT_BEHAVIOUR = {"dtype", "param_dtype", "attention_impl", "remat", "rope_theta", "rope_scaling",
                  "local_rope_theta", "query_pre_attn_scalar", "sliding_window", "layer_types"}


def _behaviour(config: ModelConfig) -> dict[str, Any]:
    """What `config` means for the outputs, each default spelled out (None as head_dim, () as all full)."""
    layers = range(config.num_layers)
    types = tuple(config.layer_type(i) for i in layers)
    return {**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in _NOT_BEHAVIOUR},
            "layer types": types, "sliding_window": config.sliding_window if "sliding" in types else None,
            "query scale": config.query_scale,
            "RoPE frequencies": tuple(tuple(config.inv_frequencies(i).tolist()) for i in layers)}


def _differences(ours: ModelConfig, loaded: ModelConfig) -> list[str]:
    """`"name: ours vs loaded"` for each difference in behaviour."""
    a, b = _behaviour(ours), _behaviour(loaded)
    return [k if k == "RoPE frequencies" else f"{k} ({a[k]!r}, not {b[k]!r})" for k in a if a[k] != b[k]]


def _rope_parameters(config: ModelConfig) -> dict[str, Any]:
    """transformers 5.x `rope_parameters` (per layer type for Gemma 3)."""
    full = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling.type != "default":
        full.update(_scaling_to_hf(config.rope_scaling))
    if config.family != "gemma3":
        return full
    local = {"rope_type": "default", "rope_theta": config.local_rope_theta or config.rope_theta}
    return {"full_attention": full, "sliding_attention": local}


def _scaling_to_hf(scaling: RopeScaling) -> dict[str, Any]:
    if scaling.type == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    return {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}
