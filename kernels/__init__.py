"""Memory- and speed-critical ops: attention and token log-probabilities."""

from kernels.attention import attention, causal_padding_mask, sliding_window_mask
from kernels.logprobs import token_logprobs

__all__ = ["attention", "causal_padding_mask", "sliding_window_mask", "token_logprobs"]
