"""Sequence packing: the train step and the old/reference log-prob passes on packed rows instead of padded ones.

A sampler-layout batch holds `tokens [B, Lp + N]` (left-padded prompt, then the completion, padding after it
ends) and per-token fields `[B, N]`. Most completions end long before `N`, so most of a padded row is padding.
`plan_packing` (host, numpy) places every sequence whole into fixed-length rows `[R, S]` first-fit-decreasing;
on device, packing is one gather (`pack_rows`) and the log-probs come back to the sampler layout with another
(`unpack`), so every loss piece, aggregation and estimator runs unchanged on `[B, N]`.

A sequence with prompt length p (its valid prompt tokens) and completion length c (up to its last real token:
a multi-turn episode's observation tokens inside the completion are packed too) needs `p + c - 1` input
positions: the model reads every token but the last, and the positions `p - 1 .. p + c - 2` of the sequence
predict its c completion tokens. A sequence with c = 0 (nothing to score) takes no space.

Rows are grouped into micro-batches of a fixed token budget (`micro_rows` rows of every data shard), and the
number of rows is rounded up to one of `buckets` static sizes, so a run compiles a bounded number of shapes.
With data parallelism the rows of shard d hold only sequences of shard d, so packing moves no token between
devices: every index in a plan is local to its shard's block of rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


class PackingError(ValueError):
    """A batch that cannot be packed as configured; the message names the config field."""


@struct.dataclass
class PackPlan:
    """Where each sequence of a `[B, Lp + N]` batch sits in `R` packed rows of `S` positions (int32 arrays).

    gather: `[R, S]` index into the flattened rows of the token batch held by the row's data shard
      (`tokens.reshape(shards, -1)[d]`): the token read at each packed position (0 on padding).
    segments: `[R, S]` 1, 2, ... per sequence of a row, 0 on padding (`models.apply`'s segment ids).
    positions: `[R, S]` rotary position of each token in its own sequence (restarting at 0).
    unpack: `[M, B, N]` for micro-batch m, the index into the flattened `[R / M / shards, S]` block of its
      rows held by the sequence's data shard of the position that predicts completion token j of sequence b;
      -1 where sequence b has no token j or sits in another micro-batch.
    shards: static number of data-parallel shards the rows are split over (R and B are multiples of it).
    max_segments: static bound on the sequences of one row, a power of two (`models.apply`'s `max_segments`, for
      the cuDNN kernel; a power of two so that a run compiles few values of it), or None: the row length (always
      enough; `Packer` leaves it None off GPUs, where no kernel reads it, so that it adds no compiles).

    Micro-batch m holds rows m, m + M, m + 2M, ... (as `train._split_micro_batches` groups rows), so each spans
    every data shard.
    """

    gather: jax.Array
    segments: jax.Array
    positions: jax.Array
    unpack: jax.Array
    shards: int = struct.field(pytree_node=False, default=1)
    max_segments: int | None = struct.field(pytree_node=False, default=None)

    @property
    def micro_batches(self) -> int:
        return self.unpack.shape[0]

    @property
    def row_tokens(self) -> int:
        return self.gather.shape[1]


def sequence_lengths(prompt_valid: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(prompt_len [B], completion_len [B])`: valid prompt tokens, and completion tokens up to the last one
    `mask [B, N]` marks (0 when it marks none). Holes in `mask` count: they are real tokens."""
    prompt_valid, mask = np.asarray(prompt_valid, bool), np.asarray(mask) != 0
    last = mask.shape[1] - np.argmax(mask[:, ::-1], axis=1)
    return prompt_valid.sum(1).astype(np.int64), np.where(mask.any(1), last, 0).astype(np.int64)


def bucket(n: int, cap: int, count: int) -> int:
    """The smallest of `count` sizes `ceil(cap * i / count)`, i = 1..count, that is >= n (n <= cap)."""
    levels = sorted({max(1, math.ceil(cap * i / count)) for i in range(1, count + 1)})
    return next(level for level in levels if level >= n)


def first_fit_decreasing(need: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of the indices of `need` (positive sizes), each summing to <= `capacity`: longest first, each into
    the first bin with room. Bins are returned in the order they were opened."""
    order = np.argsort(-need, kind="stable")
    free = np.zeros(len(need), np.int64)
    bins: list[list[int]] = []
    for i in order:
        fits = np.flatnonzero(free[:len(bins)] >= need[i])
        if fits.size:
            b = int(fits[0])
        else:
            b = len(bins)
            bins.append([])
            free[b] = capacity
        bins[b].append(int(i))
        free[b] -= need[i]
    return bins


def plan_packing(prompt_valid: np.ndarray, mask: np.ndarray, *, row_tokens: int | None = None,
                 micro_rows: int | None = None, shards: int = 1, buckets: int = 8,
                 row_field: str = "rl.packing.row_tokens") -> PackPlan:
    """The packing of a sampler-layout batch (numpy in, a `PackPlan` of numpy int32 arrays out).

    Args:
      prompt_valid: `[B, Lp]` bool, the left-padded prompts' valid tokens.
      mask: `[B, N]` the tokens to score (completion mask, or loss mask): each sequence is packed up to the
        last token it marks.
      row_tokens: S, positions per packed row; None: `Lp + N - 1`, the padded row's, so every sequence fits.
      micro_rows: rows of each data shard per micro-batch (the token budget: `micro_rows * shards * S` tokens);
        None: one micro-batch of all rows.
      shards: data-parallel shards; B must be a multiple, and rows of shard d take only sequences of rows
        `[d * B / shards, (d + 1) * B / shards)`.
      buckets: how many static sizes the row count (or, with `micro_rows`, the micro-batch count) is rounded up
        to, evenly spaced up to its largest possible value.
      row_field: the config field named when a sequence does not fit in a row.

    Raises:
      PackingError naming `row_field` when a sequence needs more than S positions.
    """
    prompt_valid = np.asarray(prompt_valid, bool)
    batch, prompt_width = prompt_valid.shape
    width = prompt_width + np.shape(mask)[1]  # L: the token batch's row length
    row = width - 1 if row_tokens is None else int(row_tokens)
    if batch % shards:
        raise PackingError(f"a batch of {batch} rows does not split over {shards} data shards")
    if micro_rows is not None and micro_rows < 1:
        raise PackingError(f"micro_rows must be >= 1, got {micro_rows}")
    prompt_len, completion_len = sequence_lengths(prompt_valid, mask)
    need = np.where(completion_len > 0, prompt_len + completion_len - 1, 0)
    if (bad := np.flatnonzero((completion_len > 0) & (prompt_len == 0))).size:
        raise PackingError(f"sequence {bad[0]} has completion tokens but an empty prompt: nothing predicts its "
                           "first token")
    if need.size and need.max() > row:
        i = int(np.argmax(need))
        raise PackingError(f"{row_field} = {row} is shorter than sequence {i}: its {prompt_len[i]} prompt + "
                           f"{completion_len[i]} completion tokens need {need[i]} positions (all but the last "
                           f"token); use {row_field} >= {need.max()}")
    per_shard = batch // shards
    rows_of = []  # per shard: bins of global sequence indices
    for d in range(shards):
        ids = d * per_shard + np.flatnonzero(need[d * per_shard:(d + 1) * per_shard] > 0)
        rows_of.append([[int(ids[k]) for k in b] for b in first_fit_decreasing(need[ids], row)])
    used = max((len(r) for r in rows_of), default=0)
    if micro_rows is None:
        micro, rows_each = 1, bucket(used, max(per_shard, 1), buckets)
    else:
        rows_each = micro_rows
        micro = bucket(math.ceil(used / micro_rows), max(1, math.ceil(per_shard / micro_rows)), buckets)
    rows_per_shard = micro * rows_each
    total = shards * rows_per_shard
    gather = np.zeros((total, row), np.int32)
    segments = np.zeros((total, row), np.int32)
    positions = np.zeros((total, row), np.int32)
    unpack = np.full((micro, batch, width - prompt_width), -1, np.int32)
    for d, bins in enumerate(rows_of):
        for j, members in enumerate(bins):
            g, m, q = d * rows_per_shard + j, j % micro, j // micro  # global row, micro-batch, row within it
            offset = 0
            for segment, i in enumerate(members, start=1):
                n, p, c = int(need[i]), int(prompt_len[i]), int(completion_len[i])
                local = i - d * per_shard
                span = slice(offset, offset + n)
                gather[g, span] = local * width + prompt_width - p + np.arange(n)
                segments[g, span] = segment
                positions[g, span] = np.arange(n)
                unpack[m, i, :c] = q * row + offset + p - 1 + np.arange(c)
                offset += n
    most = max((len(members) for bins in rows_of for members in bins), default=1)
    return PackPlan(gather, segments, positions, unpack, shards, 1 << (most - 1).bit_length())


def place_plan(plan: PackPlan, like: jax.Array) -> PackPlan:
    """`plan` on the devices of `like` (a `[B, ...]` batch array): rows split over its data-parallel axes as the
    batch is (so each shard's indices sit beside its tokens); unchanged layout on a single device."""
    sharding = getattr(like, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not isinstance(sharding, jax.sharding.NamedSharding) or mesh.size == 1:
        return jax.tree.map(jnp.asarray, plan)
    from jaxrl.sharding import BATCH_AXES
    spec = jax.sharding.PartitionSpec

    def put(x, partition):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, jax.sharding.NamedSharding(mesh, partition),
                                            lambda index: x[index])
    rows = spec(BATCH_AXES)
    return plan.replace(gather=put(plan.gather, rows), segments=put(plan.segments, rows),
                        positions=put(plan.positions, rows), unpack=put(plan.unpack, spec(None, BATCH_AXES)))


def data_shards(like: jax.Array) -> int:
    """The data-parallel size of the mesh `like` is placed on (1 off a mesh)."""
    sharding = getattr(like, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return 1
    from jaxrl.sharding import data_parallel_size
    return data_parallel_size(sharding.mesh)


def host_rows(x: jax.Array) -> np.ndarray:
    """The whole of a (possibly multi-process) global array, as numpy on this process."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _by_shard(fn, shards: int, *arrays):
    """`fn` mapped over the data shards' blocks of `arrays` (each `[shards * k, ...]` seen as `[shards, k * ...]`):
    index arithmetic stays local to a shard. Returns `fn`'s outputs `[shards, ...]`."""
    blocks = [a.reshape(shards, -1) for a in arrays]
    return jax.vmap(fn)(*blocks)


def split_rows(x: jax.Array, micro_batches: int) -> jax.Array:
    """`[R, ...]` -> `[M, R / M, ...]`, micro-batch m holding rows m, m + M, ... (`PackPlan`'s grouping)."""
    return x.reshape(x.shape[0] // micro_batches, micro_batches, *x.shape[1:]).swapaxes(0, 1)


def pack_rows(tokens: jax.Array, gather: jax.Array, shards: int) -> tuple[jax.Array, jax.Array]:
    """`(inputs [r, S], targets [r, S])` of packed rows: the token at each packed position, and the token after
    it in its own sequence (the one that position predicts), from `tokens [B, L]` and a plan's `gather [r, S]`
    (rows of one micro-batch, or all)."""
    def take(flat, index):
        return flat[index], flat[jnp.minimum(index + 1, flat.shape[0] - 1)]
    inputs, targets = _by_shard(take, shards, tokens, gather)
    return inputs.reshape(gather.shape), targets.reshape(gather.shape)


def unpack(values: jax.Array, index: jax.Array, shards: int, fill: jax.Array | float = 0.0) -> jax.Array:
    """`[B, N]` from per-position `values [r, S]` of packed rows and an unpack index `[B, N]` into them
    (`PackPlan.unpack[m]`); `fill` (a scalar or `[B, N]`) where the index is -1."""
    gathered = _by_shard(lambda flat, i: flat[jnp.maximum(i, 0)], shards, values, index).reshape(index.shape)
    return jnp.where(index >= 0, gathered, fill)


class Packer:
    """The run's planner (`rl.packing` of the config, `rl.micro_batches`): `packer(prompt_valid, mask, like)`
    -> the `PackPlan` of a batch, placed beside `like` (its tokens). `mask` `[B, N]` marks the tokens to score
    (the completion mask for the log-prob passes, the loss mask for an update); arrays may be global jax arrays
    of a multi-process run (every process plans the whole batch, and keeps its shards).

    Micro-batch budget: `micro_batch_tokens` over all data shards, rounded down to whole rows of each shard; or
    (0) the padded micro-batch's, `B / (micro_batches x shards)` rows of each shard; or one micro-batch when
    `micro_batches` is 1.
    """

    def __init__(self, config, micro_batches: int = 1):
        self.config, self.micro_batches = config, micro_batches

    def micro_rows(self, batch: int, row: int, shards: int) -> int | None:
        budget = self.config.micro_batch_tokens
        if budget:
            rows = budget // (row * shards)
            if rows < 1:
                raise PackingError(f"rl.packing.micro_batch_tokens = {budget} holds no row of {row} positions on "
                                   f"each of the {shards} data shards; use at least {row * shards}")
            return rows
        if self.micro_batches > 1:
            return max(1, batch // (self.micro_batches * shards))
        return None

    def __call__(self, prompt_valid, mask, like: jax.Array) -> PackPlan:
        prompt_valid, mask = host_rows(prompt_valid), host_rows(mask)
        shards = data_shards(like)
        row = self.config.row_tokens or prompt_valid.shape[1] + mask.shape[1] - 1
        plan = plan_packing(prompt_valid, mask, row_tokens=row, shards=shards, buckets=self.config.buckets,
                            micro_rows=self.micro_rows(prompt_valid.shape[0], row, shards))
        if jax.default_backend() != "gpu":  # only the cuDNN kernel reads the bound: elsewhere one compile less
            plan = plan.replace(max_segments=None)
        return place_plan(plan, like)
