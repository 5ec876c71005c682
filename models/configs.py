"""Model hyper-parameters as data, and named presets.

Field names follow the Hugging Face Llama/Qwen `config.json` vocabulary where one exists, so that loading
real checkpoints later maps one-to-one.
"""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer (Llama / Qwen family layout)."""

    vocab_size: int = dataclasses.field(default=64, metadata={"gt": 0})
    hidden_size: int = dataclasses.field(default=128, metadata={"gt": 0})
    num_layers: int = dataclasses.field(default=4, metadata={"gt": 0})
    num_heads: int = dataclasses.field(default=4, metadata={"gt": 0})
    num_kv_heads: int = dataclasses.field(default=2, metadata={"gt": 0})
    head_dim: int = dataclasses.field(default=32, metadata={"gt": 0})
    intermediate_size: int = dataclasses.field(default=384, metadata={"gt": 0})
    rope_theta: float = dataclasses.field(default=10_000.0, metadata={"gt": 0})
    norm_eps: float = dataclasses.field(default=1e-6, metadata={"gt": 0})
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    dtype: Literal["float32", "bfloat16"] = "float32"  # activation / compute dtype
    param_dtype: Literal["float32", "bfloat16"] = "float32"  # master weights

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


PRESETS: dict[str, ModelConfig] = {
    # ~0.8M parameters: the default CPU recipe.
    "tiny": ModelConfig(),
    # The `bench-small` shape of the sampler / train-step benchmarks (Qwen2-style).
    "bench-small": ModelConfig(
        vocab_size=32_000, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64,
        intermediate_size=1408, rope_theta=1e6, qkv_bias=True, tie_embeddings=False,
    ),
}


def num_parameters(config: ModelConfig) -> int:
    """Parameter count implied by `config` (embeddings counted once when tied)."""
    d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    attention = d * h * hd + 2 * d * kv * hd + h * hd * d
    if config.qkv_bias:
        attention += h * hd + 2 * kv * hd
    if config.qk_norm:
        attention += 2 * hd
    layer = attention + 3 * d * config.intermediate_size + 2 * d
    embeddings = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    return config.num_layers * layer + embeddings + d
