"""Generic batching of in-memory prompt lists into checkpointable grain iterators."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import grain

T = TypeVar("T")


def shuffled_batches(items: Sequence[T], batch_size: int, seed: int,
                     shard: tuple[int, int] = (0, 1)) -> grain.DatasetIterator:
    """Endless shuffled batches (each a `list` of `batch_size` items) as a checkpointable grain iterator.

    Deterministic for `seed`; the order is reshuffled every epoch and batches may straddle epoch
    boundaries. Save/restore the position with the iterator's `get_state()` / `set_state()`.

    `shard = (index, count)`: this host's share of a global batch of `batch_size * count` items (every
    `count`-th item of the shuffled stream from `index`), so the hosts of a multi-host run together draw the
    items a single host would, each reading only its own.
    """
    index, count = shard
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if len(items) == 0:
        raise ValueError("cannot batch an empty list of items")
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} is not in [0, {count})")
    dataset = grain.MapDataset.source(items).shuffle(seed=shuffle_seed(seed)).repeat()
    if count > 1:
        dataset = dataset[index::count]
    return iter(dataset.batch(batch_size, batch_fn=list).to_iter_dataset())


def shuffle_seed(seed: int) -> int:
    """grain's shuffle seed for run seed `seed`: Knuth's multiplicative hash, a bijection of the 32-bit seeds
    that keeps 0. grain shuffles epoch e with seed + e, so consecutive run seeds used as they are would draw the
    same orders one epoch apart (seed 1's first epoch was seed 0's second): a seed sweep would not be
    independent."""
    return (seed * 0x9E3779B1) % 2**32
