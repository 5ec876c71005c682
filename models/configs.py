"""Model hyper-parameters as data, and named presets.

One `ModelConfig` describes every supported decoder: the small native models of the built-in task and the
Hugging Face families Llama 3.x, Qwen2 / Qwen2.5, Qwen3 and Gemma 3 (text). Each family is the same
transformer with a few switches (biases, q/k norms, Gemma's norm convention and sandwich norms, embedding
scaling, sliding-window layers, soft-capping, RoPE scaling). `models.hf_config` maps `config.json` to it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import numpy as np

Family = Literal["llama", "qwen2", "qwen3", "gemma3"]
LayerType = Literal["full", "sliding"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_scaling` / `rope_parameters`): `default` (none), `linear` or `llama3`."""

    type: Literal["default", "linear", "llama3"] = "default"
    factor: float = dataclasses.field(default=1.0, metadata={"gt": 0})
    low_freq_factor: float = dataclasses.field(default=1.0, metadata={"gt": 0})  # llama3 only
    high_freq_factor: float = dataclasses.field(default=4.0, metadata={"gt": 0})  # llama3 only
    original_max_position_embeddings: int = dataclasses.field(default=8192, metadata={"gt": 0})  # llama3 only


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer. Field names follow the HF Llama/Qwen `config.json` vocabulary."""

    family: Family = "llama"  # the HF architecture `save_pretrained` writes (its conventions must match)
    vocab_size: int = dataclasses.field(default=64, metadata={"gt": 0})
    hidden_size: int = dataclasses.field(default=128, metadata={"gt": 0})
    num_layers: int = dataclasses.field(default=4, metadata={"gt": 0})
    num_heads: int = dataclasses.field(default=4, metadata={"gt": 0})
    num_kv_heads: int = dataclasses.field(default=2, metadata={"gt": 0})
    head_dim: int = dataclasses.field(default=32, metadata={"gt": 0})
    intermediate_size: int = dataclasses.field(default=384, metadata={"gt": 0})
    max_position_embeddings: int = dataclasses.field(default=4096, metadata={"gt": 0})
    rope_theta: float = dataclasses.field(default=10_000.0, metadata={"gt": 0})
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)  # full-attention layers
    local_rope_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma 3); None: as full
    norm_eps: float = dataclasses.field(default=1e-6, metadata={"gt": 0})
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + weight): Gemma stores weight - 1
    post_norms: bool = False  # Gemma: also normalise the attention and MLP outputs ("sandwich" norms)
    scale_embeddings: bool = False  # Gemma: embeddings multiplied by sqrt(hidden_size)
    tie_embeddings: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    activation: Literal["silu", "gelu_tanh"] = "silu"
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its -1/2 power; None: head_dim
    attn_logit_softcap: float | None = None  # scores -> c * tanh(scores / c)
    final_logit_softcap: float | None = None  # logits -> c * tanh(logits / c)
    sliding_window: int | None = None  # keys visible to a sliding layer: the last `sliding_window` slots
    layer_types: tuple[LayerType, ...] = ()  # per layer; () means every layer is "full"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # activation / compute dtype
    # Self-attention kernel for training, log-probs and the sampler's prefill (kernels.attention.self_attention):
    # auto = cuDNN on NVIDIA GPUs, Pallas splash attention on TPUs (by the mesh's devices), XLA elsewhere.
    # Decoding with a KV cache always uses XLA.
    attention_impl: Literal["auto", "xla", "cudnn", "splash"] = "auto"
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # master weights
    # Rematerialisation of each block in training (models.transformer.REMAT_POLICIES): none keeps every
    # activation; full recomputes each block in the backward pass; dots keeps the weight matmuls' outputs.
    remat: Literal["none", "full", "dots"] = "none"

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding layers but sliding_window is not set")

    def layer_type(self, layer: int) -> LayerType:
        return self.layer_types[layer] if self.layer_types else "full"

    def inv_frequencies(self, layer: int) -> np.ndarray:
        """RoPE inverse frequencies `[head_dim // 2]` (float32) of `layer`, as HF computes them."""
        if self.layer_type(layer) == "sliding" and self.local_rope_theta is not None:
            return rope_inv_frequencies(self.head_dim, self.local_rope_theta, RopeScaling())
        return rope_inv_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)

    @property
    def query_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


def rope_inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """`1 / theta^(2i / head_dim)`, then scaled (transformers' `modeling_rope_utils` formulas)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    inv_freq = inv_freq.astype(np.float32)
    if scaling.type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if scaling.type == "llama3":
        old_context = scaling.original_max_position_embeddings
        low_freq_wavelen = old_context / scaling.low_freq_factor
        high_freq_wavelen = old_context / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_context / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


PRESETS: dict[str, ModelConfig] = {
    # ~0.8M parameters: the default CPU recipe.
    "tiny": ModelConfig(),
    # The `bench-small` shape of the sampler / train-step benchmarks (Qwen2-style).
    "bench-small": ModelConfig(
        vocab_size=32_000, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64,
        intermediate_size=1408, rope_theta=1e6, qkv_bias=True, tie_embeddings=False, family="qwen2",
    ),
    # Qwen2.5-0.5B's shape (494M parameters), for accelerator benchmarks with random weights.
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151_936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
        intermediate_size=4864, rope_theta=1e6, qkv_bias=True, tie_embeddings=True, family="qwen2",
        max_position_embeddings=32_768,
    ),
    # The shapes below are what `models.hf_config.from_hf` makes of each checkpoint's config.json (float32 here;
    # a checkpoint loads in its own dtype). tests/test_model_presets.py holds those config.json files and checks
    # the parameter counts against the model cards.
    # Qwen/Qwen2.5-Math-1.5B (1.54B).
    "qwen2.5-math-1.5b": ModelConfig(
        family="qwen2", vocab_size=151_936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
        head_dim=128, intermediate_size=8960, max_position_embeddings=4096, rope_theta=10_000.0, qkv_bias=True,
        tie_embeddings=True,
    ),
    # meta-llama/Llama-3.2-1B-Instruct (1.23B): llama3 RoPE scaling, factor 32.
    "llama3.2-1b": ModelConfig(
        family="llama", vocab_size=128_256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, intermediate_size=8192, max_position_embeddings=131_072, rope_theta=500_000.0,
        rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192), norm_eps=1e-5, tie_embeddings=True,
    ),
    # google/gemma-3-1b-it (302M embedding + 698M other parameters): 5 sliding layers (window 512, RoPE base 1e4)
    # to each full one (RoPE base 1e6), query scale 256^-1/2, no soft-capping (final_logit_softcapping is null).
    "gemma3-1b": ModelConfig(
        family="gemma3", vocab_size=262_144, hidden_size=1152, num_layers=26, num_heads=4, num_kv_heads=1,
        head_dim=256, intermediate_size=6912, max_position_embeddings=32_768, rope_theta=1_000_000.0,
        local_rope_theta=10_000.0, norm_eps=1e-6, norm_offset=1.0, post_norms=True, scale_embeddings=True,
        tie_embeddings=True, qk_norm=True, activation="gelu_tanh", query_pre_attn_scalar=256.0,
        sliding_window=512, layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(26)),
    ),
    # Qwen/Qwen3-1.7B (1.7B): q/k norms, head_dim 128 (not hidden / heads).
    "qwen3-1.7b": ModelConfig(
        family="qwen3", vocab_size=151_936, hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8,
        head_dim=128, intermediate_size=6144, max_position_embeddings=40_960, rope_theta=1_000_000.0,
        qk_norm=True, tie_embeddings=True,
    ),
    # Qwen/Qwen2.5-7B-Instruct (7.61B).
    "qwen2.5-7b": ModelConfig(
        family="qwen2", vocab_size=152_064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
        head_dim=128, intermediate_size=18_944, max_position_embeddings=32_768, rope_theta=1_000_000.0,
        qkv_bias=True, tie_embeddings=False,
    ),
    # meta-llama/Llama-3.1-8B-Instruct (8.03B): llama3 RoPE scaling, factor 8.
    "llama3.1-8b": ModelConfig(
        family="llama", vocab_size=128_256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, intermediate_size=14_336, max_position_embeddings=131_072, rope_theta=500_000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), norm_eps=1e-5, tie_embeddings=False,
    ),
    # Qwen/Qwen2.5-14B-Instruct (14.7B).
    "qwen2.5-14b": ModelConfig(
        family="qwen2", vocab_size=152_064, hidden_size=5120, num_layers=48, num_heads=40, num_kv_heads=8,
        head_dim=128, intermediate_size=13_824, max_position_embeddings=32_768, rope_theta=1_000_000.0,
        qkv_bias=True, tie_embeddings=False,
    ),
    # Qwen/Qwen2.5-32B-Instruct (32.5B).
    "qwen2.5-32b": ModelConfig(
        family="qwen2", vocab_size=152_064, hidden_size=5120, num_layers=64, num_heads=40, num_kv_heads=8,
        head_dim=128, intermediate_size=27_648, max_position_embeddings=32_768, rope_theta=1_000_000.0,
        qkv_bias=True, tie_embeddings=False,
    ),
}


def num_parameters(config: ModelConfig) -> int:
    """Parameter count implied by `config` (embeddings counted once when tied)."""
    d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    attention = d * h * hd + 2 * d * kv * hd + h * hd * d
    if config.qkv_bias:
        attention += h * hd + 2 * kv * hd
    if config.o_bias:
        attention += d
    if config.qk_norm:
        attention += 2 * hd
    norms = (4 if config.post_norms else 2) * d
    layer = attention + 3 * d * config.intermediate_size + norms
    embeddings = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    return config.num_layers * layer + embeddings + d
