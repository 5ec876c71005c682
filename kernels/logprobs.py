"""Per-token log-probabilities and entropy of a categorical policy head.

Reference implementation over the full `[batch, seq, vocab]` logits, computed in float32. The chunked,
memory-lean version (no full-vocabulary logits held for the backward pass) replaces the body of
`token_logprobs` without changing its signature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(
    hidden: jax.Array,
    unembedding: jax.Array,
    targets: jax.Array,
    temperature: float | jax.Array = 1.0,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of `targets` and entropy of the full distribution at every position.

    Args:
      hidden: `[batch, seq, hidden]` final (normed) hidden states.
      unembedding: `[vocab, hidden]` output projection (the embedding table when tied).
      targets: `[batch, seq]` int token ids whose log-probs are wanted.
      temperature: logits are divided by it (log-probs under the sampling temperature).
      softcap: logits -> `softcap * tanh(logits / softcap)` before the temperature (Gemma); None: off.

    Returns:
      `(logprobs [batch, seq], entropy [batch, seq])`, float32, in nats.
    """
    logits = jnp.einsum("btd,vd->btv", hidden, unembedding, preferred_element_type=jnp.float32)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    logits = logits / temperature
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    target_logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return target_logp, entropy
