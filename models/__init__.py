"""Policy networks and checkpoint conversion.

    policy = models.from_pretrained("path/to/Qwen2.5-Math-1.5B")   # HF config.json + safetensors
    logits = models.forward(policy, tokens)                        # [batch, seq, vocab] float32
    models.save_pretrained(policy, "out/", base="path/to/Qwen2.5-Math-1.5B")
"""

from jaxrl.models.configs import PRESETS, ModelConfig, RopeScaling, num_parameters
from jaxrl.models.hf import CheckpointError, from_pretrained, load_config, save_pretrained
from jaxrl.models.partitioning import DEFAULT_RULES, Layout
from jaxrl.models.transformer import (
    GroupKVCache, KVCache, Policy, Transformer, abstract, apply, forward, init, logits_from_hidden,
    positions_from_mask, replace_config, shard, softcap, unembedding,
)

__all__ = [
    "DEFAULT_RULES", "PRESETS", "CheckpointError", "GroupKVCache", "KVCache", "Layout", "ModelConfig", "Policy", "RopeScaling", "Transformer",
    "abstract", "apply", "forward", "from_pretrained", "init", "load_config", "logits_from_hidden", "num_parameters",
    "positions_from_mask", "replace_config", "save_pretrained", "shard", "softcap", "unembedding",
]
