"""Memory- and speed-critical ops: attention and token log-probabilities."""

from jaxrl.kernels.attention import (KV, attention, causal_padding_mask, quantize_int8, shared_prefix_attention,
                               sliding_window_mask)
from jaxrl.kernels.logprobs import reference_token_logprobs, token_logprobs

__all__ = ["KV", "attention", "causal_padding_mask", "quantize_int8", "reference_token_logprobs",
           "shared_prefix_attention", "sliding_window_mask", "token_logprobs"]
