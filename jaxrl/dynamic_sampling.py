"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476), as pure functions over host arrays.

A group whose G completions all earn the same reward has zero group-normalised advantage: it adds nothing to
the gradient but still counts in token-mean normalisers. Dynamic sampling drops such groups and samples more
prompts until the batch holds `quota` informative groups, for at most `max_rounds` rounds; if they run out,
the batch is filled with uninformative groups (in the order they were drawn) so that its shape, and the
compiled programs, stay the same. The loop (`jaxrl.loop`) draws the rounds; this module decides and assembles.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jaxrl.sampling import Rollout


def informative_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """`[B]` rewards, rows `p * G + g` -> `[B / G]` bool: True where the group's rewards are not all equal in
    float32, the precision of the advantages (rewards equal in float32 give a group zero advantages)."""
    groups = np.asarray(rewards, np.float32).reshape(-1, group_size)
    return groups.max(axis=1) > groups.min(axis=1)


class Selection(NamedTuple):
    """Which groups make the batch: `(round, group)` pairs in batch order, and how many were uninformative."""

    groups: list[tuple[int, int]]
    filled: int  # uninformative groups used to fill the batch after the rounds ran out


def select_groups(informative: Sequence[np.ndarray], quota: int) -> Selection:
    """The first `quota` informative groups over the rounds, in draw order; if fewer, then uninformative ones
    (first drawn first). `informative`: one `[groups]` bool array per round."""
    keep = [(r, g) for r, flags in enumerate(informative) for g in np.flatnonzero(flags)]
    if len(keep) >= quota:
        return Selection(keep[:quota], 0)
    spare = [(r, g) for r, flags in enumerate(informative) for g in np.flatnonzero(~flags)]
    fill = spare[:quota - len(keep)]
    if len(keep) + len(fill) < quota:
        raise ValueError(f"{len(keep) + len(fill)} groups sampled in all, fewer than the batch's {quota}")
    chosen = set(keep + fill)  # batch order: the order drawn, informative or not
    ordered = [(r, g) for r, flags in enumerate(informative) for g in range(len(flags)) if (r, g) in chosen]
    return Selection(ordered, len(fill))


def assemble(rollouts: Sequence[Rollout], selection: Selection, group_size: int, pad_id: int) -> Rollout:
    """One host rollout of the selected groups (`Rollout`s of numpy arrays, rows `p * G + g`). Rounds whose
    prompts were padded to different lengths are left-padded to the longest (pad tokens, invalid)."""
    prompt_len = max(r.prompt_valid.shape[1] for r in rollouts)

    def rows(g: int) -> slice:
        return slice(g * group_size, (g + 1) * group_size)

    def widen(r: Rollout, tokens: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        extra = prompt_len - r.prompt_valid.shape[1]
        return (np.pad(tokens, ((0, 0), (extra, 0)), constant_values=pad_id),
                np.pad(valid, ((0, 0), (extra, 0)), constant_values=False))

    parts = []
    for r, g in selection.groups:
        source = rollouts[r]
        tokens, valid = widen(source, np.asarray(source.tokens)[rows(g)], np.asarray(source.prompt_valid)[rows(g)])
        parts.append(Rollout(tokens, valid, *(None if x is None else np.asarray(x)[rows(g)]
                                              for x in source[2:])))
    return Rollout(*(None if parts[0][i] is None else np.concatenate([p[i] for p in parts])
                     for i in range(len(Rollout._fields))))
