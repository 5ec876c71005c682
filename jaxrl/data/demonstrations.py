"""Demonstrations for a supervised warm start from a data file: `(record, solution)` pairs of the train records
that carry one (`data.solution_field`, or a chat row's last assistant message), endless, shuffled, reproducible.

    pairs = demonstrations(train_records, seed=config.seed)
    record, solution = next(pairs)   # the model learns `solution` after render_prompt(record, ...)

`demonstration_batches(records, batch_size, seed)` gives them as lists of `batch_size` pairs. Both are grain
iterators: the same seed gives the same order, and `get_state()` / `set_state()` save and restore the position.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain

from jaxrl.data.batching import shuffle_seed, shuffled_batches
from jaxrl.data.prompts import DataError, PromptRecord

__all__ = ["NoDemonstrations", "demonstration_batches", "demonstration_pairs", "demonstrations"]


class NoDemonstrations(DataError):
    """The warm start needs demonstrations, and no train record has one."""


def demonstration_pairs(records: Sequence[PromptRecord], source: str = "data.train_file"
                        ) -> list[tuple[PromptRecord, str]]:
    """`(record, record.solution)` for every record with a solution, in file order; `NoDemonstrations` (naming
    `source`) when none has one."""
    pairs = [(r, r.solution) for r in records if r.solution is not None]
    if not pairs:
        raise NoDemonstrations(
            f"{source}: the supervised warm start (sft.steps > 0) needs demonstrations, but none of its "
            f"{len(records)} records has one: set data.solution_field to a row field holding worked solutions, use "
            "data.format: messages with assistant answers, or set sft.steps=0")
    return pairs


def demonstrations(records: Sequence[PromptRecord], seed: int, source: str = "data.train_file"
                   ) -> grain.DatasetIterator:
    """Endless shuffled `(record, solution)` pairs over the records with a solution, each epoch a new order
    (deterministic for `seed`, shuffled like the RL prompts: `jaxrl.data.batching`)."""
    pairs = demonstration_pairs(records, source)
    return iter(grain.MapDataset.source(pairs).shuffle(seed=shuffle_seed(seed)).repeat().to_iter_dataset())


def demonstration_batches(records: Sequence[PromptRecord], batch_size: int, seed: int,
                          shard: tuple[int, int] = (0, 1), source: str = "data.train_file") -> grain.DatasetIterator:
    """Endless shuffled batches (lists of `batch_size` `(record, solution)` pairs); `shard = (index, count)` is
    this host's share of a multi-host run's global batch (`jaxrl.data.batching.shuffled_batches`)."""
    return shuffled_batches(demonstration_pairs(records, source), batch_size, seed, shard)
