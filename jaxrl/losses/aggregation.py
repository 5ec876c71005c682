"""Aggregation of per-token losses into a scalar, normalised by counts of the *whole* optimised batch.

A mini-batch is split into micro-batches for gradient accumulation and across data-parallel devices;
each part computes `sum(its per-token losses) / count(whole batch)`, so the parts add up to exactly the
loss of the whole batch whatever the split. The counts travel in `Normalizers`, computed once from the
loss mask of the whole batch before it is split.

Modes (B sequences, N completion tokens, l = per-token loss, m = loss mask):

| mode | value | used by |
|---|---|---|
| `token-mean` | `sum(l m) / sum(m)` | DAPO (Yu et al. 2025), the default |
| `seq-mean-token-mean` | `mean over sequences of (sum_t l m / sum_t m)` | GRPO (Shao et al. 2024), GSPO |
| `seq-mean-token-sum` | `sum(l m) / number of sequences` | REINFORCE-style sequence sums |
| `seq-mean-token-sum-norm` | `sum(l m) / (rows x norm_length)`, a constant | Dr. GRPO (Liu et al. 2025) |

Sequences whose mask is all zero (filtered) are not counted by the sequence means; the last mode divides
by the number of rows and a constant length, so it does not depend on response lengths at all.

The mask may have holes (a multi-turn episode's observation tokens sit between its model turns with mask
0): every mode counts the masked-in tokens only, so a row with holes gives what its compacted row (model
tokens only) gives (`tests/test_holes.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from flax import struct

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


@struct.dataclass
class Normalizers:
    """Counts over the whole optimised batch (every micro-batch and data shard together).

    num_tokens: scalar, valid (loss-mask) tokens.
    num_seqs: scalar, rows with at least one valid token.
    num_rows: scalar, all rows.
    norm_length: constant length of `seq-mean-token-sum-norm` (static).
    num_counted_tokens: scalar, valid tokens whose token weight is not 0 (those the policy loss counts:
      its clip and ratio metrics describe them), or None when the counts were taken without the weights.
    """

    num_tokens: jax.Array
    num_seqs: jax.Array
    num_rows: jax.Array
    norm_length: float = struct.field(pytree_node=False, default=1.0)
    num_counted_tokens: jax.Array | None = None


def normalizers(mask: jax.Array, norm_length: float = 1.0, token_weights: jax.Array | None = None
                ) -> Normalizers:
    """Counts of the batch whose loss mask is `mask [B, N]` (the whole batch, before any split), and with
    its `token_weights [B, N]` (`LossInputs.token_weights`) the count of valid tokens of non-zero weight."""
    m = mask.astype(jnp.float32)
    counted = None if token_weights is None else jnp.sum(m * (token_weights != 0))
    return Normalizers(num_tokens=m.sum(), num_seqs=(m.sum(axis=1) > 0).sum().astype(jnp.float32),
                       num_rows=jnp.float32(m.shape[0]), norm_length=float(norm_length),
                       num_counted_tokens=counted)


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str, norm: Normalizers) -> jax.Array:
    """Scalar from `per_token [B, N]` under loss mask `mask [B, N]` (see the module table for modes)."""
    m = mask.astype(jnp.float32)
    total = jnp.sum(per_token * m)
    if mode == "token-mean":
        return total / jnp.maximum(norm.num_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = jnp.sum(per_token * m, axis=1) / jnp.maximum(m.sum(axis=1), 1.0)
        return jnp.sum(per_seq) / jnp.maximum(norm.num_seqs, 1.0)
    if mode == "seq-mean-token-sum":
        return total / jnp.maximum(norm.num_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        return total / (jnp.maximum(norm.num_rows, 1.0) * norm.norm_length)
    raise ValueError(f"unknown aggregation {mode!r}; valid choices: {', '.join(AGGREGATIONS)}")


def token_mean(per_token: jax.Array, mask: jax.Array, norm: Normalizers, count: jax.Array | None = None
               ) -> jax.Array:
    """`sum(per_token * mask) / count`: how every per-token *metric* is reported. `count` is the whole-batch
    number of the tokens `mask` selects: `num_tokens` by default, `num_counted_tokens` for a narrower mask."""
    count = norm.num_tokens if count is None else count
    return jnp.sum(per_token * mask.astype(jnp.float32)) / jnp.maximum(count, 1.0)


def masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.max(jnp.where(mask.astype(bool), x, -jnp.inf))


def masked_min(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.min(jnp.where(mask.astype(bool), x, jnp.inf))


def _extreme(name: str):
    """The reduction a metric's name asks for: `_max` -> maximum, `_min` -> minimum, else None."""
    return jnp.maximum if name.endswith("_max") else jnp.minimum if name.endswith("_min") else None


def mean_over_updates(per_update: Sequence[dict[str, jax.Array]],
                      weights: Sequence[jax.Array] | None = None) -> dict[str, jax.Array]:
    """The metrics of several optimizer updates as one: `_max`/`_min` names take the max/min over the
    updates (an update without loss tokens reports -inf/+inf and so drops out), everything else the mean,
    weighted by `weights` when given (each update's loss tokens: the token means of the updates then make
    the token mean of their union, and an update without tokens drops out; all zero: the plain mean)."""
    n = len(per_update)
    w = jnp.ones(n, jnp.float32) if weights is None else jnp.stack([jnp.asarray(x, jnp.float32) for x in weights])
    total = w.sum()
    w = jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), 1.0 / n)

    def combine(name):
        values = jnp.stack([metrics[name] for metrics in per_update])
        extreme = _extreme(name)
        return (w * values).sum() if extreme is None else extreme.reduce(values)
    return {name: combine(name) for name in per_update[0]}


def reduce_metrics(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Combine the metrics of two parts of one batch: names ending in `_max`/`_min` take the max/min,
    everything else is already normalised by whole-batch counts and adds up."""
    def combine(name):
        extreme = _extreme(name)
        return a[name] + b[name] if extreme is None else extreme(a[name], b[name])
    return {name: combine(name) for name in a}
