"""Policy networks and checkpoint conversion."""

from models.configs import PRESETS, ModelConfig, num_parameters
from models.transformer import (
    KVCache, Policy, Transformer, apply, forward, init, logits_from_hidden, positions_from_mask, unembedding,
)

__all__ = [
    "PRESETS", "KVCache", "ModelConfig", "Policy", "Transformer", "apply", "forward", "init",
    "logits_from_hidden", "num_parameters", "positions_from_mask", "unembedding",
]
