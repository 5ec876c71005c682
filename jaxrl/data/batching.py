"""Generic batching of in-memory prompt lists into checkpointable grain iterators."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import grain

T = TypeVar("T")


def shuffled_batches(items: Sequence[T], batch_size: int, seed: int) -> grain.DatasetIterator:
    """Endless shuffled batches (each a `list` of `batch_size` items) as a checkpointable grain iterator.

    Deterministic for `seed`; the order is reshuffled every epoch and batches may straddle epoch
    boundaries. Save/restore the position with the iterator's `get_state()` / `set_state()`.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if len(items) == 0:
        raise ValueError("cannot batch an empty list of items")
    dataset = grain.MapDataset.source(items).shuffle(seed=seed).repeat().batch(batch_size, batch_fn=list)
    return iter(dataset.to_iter_dataset())
