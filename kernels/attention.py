"""Grouped-query attention: one reference in XLA, fast kernels where a backend has them.

- `self_attention` serves training, log-probs and prefill (keys are the queries' own tokens; the prefill writes
  them into the cache too). It dispatches by `implementation` (`resolve_implementation`: `auto` picks by the
  platform of the devices the program runs on, `target_platform`):
  - the XLA reference;
  - `jax.nn.dot_product_attention`'s cuDNN kernel on NVIDIA GPUs; packed rows (int segment ids) take cuDNN's
    variable-length kernel, each segment attended as a sequence of its own, on Hopper or newer;
  - JAX's Pallas splash attention on TPUs (interpret mode elsewhere, for tests). On a mesh of several devices
    it runs inside `jax.shard_map`, each chip on its own rows and heads (a Mosaic kernel cannot be
    partitioned by XLA).
- `attention` (a dense mask over a KV cache) serves decoding, and prefill with the `xla` implementation.
- `shared_prefix_attention` serves group sampling, where the samples of a prompt share its keys.

A Pallas decode kernel would only earn its place by beating the XLA decode on a measured GPU.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec


def causal_padding_mask(query_index: jax.Array, key_valid: jax.Array) -> jax.Array:
    """Boolean mask `[batch, q_len, k_len]`: key j is visible to query i iff j <= index(i) and j is valid.

    Args:
      query_index: `[batch, q_len]` int, absolute slot of each query in the key axis.
      key_valid: `[batch, k_len]` bool, False for padding slots.
    """
    key_index = jnp.arange(key_valid.shape[1])
    causal = key_index[None, None, :] <= query_index[:, :, None]
    return causal & key_valid[:, None, :]


def sliding_window_mask(query_index: jax.Array, key_len: int, window: int) -> jax.Array:
    """`[batch, q_len, k_len]` bool: key slot j is within the last `window` slots of query slot i
    (`j > i - window`, transformers' `sliding_window_overlay`). Combine with `causal_padding_mask`.

    Slots, not rotary positions: the batch is left-padded, so the two differ by a per-row constant.
    """
    key_index = jnp.arange(key_len)
    return key_index[None, None, :] > query_index[:, :, None] - window


class KV(NamedTuple):
    """One layer's keys and values, `[batch, num_kv_heads, length, head_dim]` (heads-major, the KV cache's
    layout: XLA's batched matrix products want the batch and head axes leading).

    Either in a float dtype (scales None) or int8 with float32 scales `k_scale, v_scale [batch, num_kv_heads,
    length]`, one per key slot and head (`quantize_int8`): value = int8 * scale. Attention applies the scales
    to the scores and to the softmax weights, so an int8 cache is never dequantized as a whole.
    """

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 quantization over the last axis: `x [..., d]` -> `(int8 [..., d], float32 scale [...])`
    with `x ~= int8 * scale` (error at most scale / 2 = max|x| / 254 per entry)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    quantized = jnp.round(x / jnp.where(scale == 0, 1.0, scale)[..., None])
    return quantized.astype(jnp.int8), scale


def attention(q: jax.Array, kv: KV, mask: jax.Array, *, scale: float | None = None,
              softcap: float | None = None) -> jax.Array:
    """Softmax attention with grouped KV heads.

    Args:
      q: `[batch, q_len, num_heads, head_dim]`.
      kv: keys and values `[batch, num_kv_heads, k_len, head_dim]`; `num_heads % num_kv_heads == 0`.
      mask: `[batch, q_len, k_len]` bool; rows with no visible key yield finite (ignored) outputs.
      scale: multiplies the scores (default `head_dim ** -0.5`).
      softcap: scores -> `softcap * tanh(scores / softcap)` before masking (Gemma); None: off.

    Returns:
      `[batch, q_len, num_heads, head_dim]` in q's dtype; softmax computed in float32.
    """
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = kv.k.shape[1]
    q = q.reshape(batch, q_len, num_kv_heads, num_heads // num_kv_heads, head_dim)
    per_row = (slice(None), slice(None), None, None)  # [batch, kv, len] scales -> [b, k, q, g, len]
    scores = _scores("bqkgd,bksd->bkqgs", q, kv.k, kv.k_scale, per_row)
    weights = _masked_softmax(scores, mask[:, None, :, None], head_dim, scale, softcap)
    out = _weighted_values("bkqgs,bksd->bkqgd", weights, kv.v, kv.v_scale, per_row)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)


def shared_prefix_attention(q: jax.Array, prefix: KV, own: KV, mask: jax.Array, *, scale: float | None = None,
                            softcap: float | None = None) -> jax.Array:
    """Attention of `group` sequences per prompt over their prompt's keys (held once) followed by their own.

    Equal to `attention` over keys `concat(repeat(prefix.k, group), own.k)`, without the repeat: the prefix
    scores of a prompt's whole group are one matrix product with `group * q_len * heads / kv_heads` query rows,
    so the prompt's cache is read once per group instead of once per sequence (Hydragen, Juravsky et al. 2024).

    Args:
      q: `[batch, q_len, num_heads, head_dim]`, batch = prompts * group, row `p * group + j` = sample j of p.
      prefix: the prompts' keys and values, `[prompts, num_kv_heads, prefix_len, head_dim]`.
      own: each sequence's own keys and values after the prefix, `[batch, num_kv_heads, k_len, head_dim]`.
      mask: `[batch, q_len, prefix_len + k_len]` bool over the concatenated key axis.
      scale, softcap: as in `attention`.

    Returns:
      `[batch, q_len, num_heads, head_dim]` in q's dtype; one softmax over both parts, in float32.
    """
    batch, q_len, num_heads, head_dim = q.shape
    prompts, num_kv_heads, prefix_len, _ = prefix.k.shape
    group, groups = batch // prompts, num_heads // num_kv_heads
    # Every product below has its batch axes (prompt or sequence, kv head) leading in its output, the order
    # XLA's batched matrix multiply produces; asking for another order made XLA:CPU's products up to 9x slower.
    # Only the small score and output tensors are transposed.
    per_prompt = (slice(None), slice(None), None, None, None)  # [prompts, kv, len] scales -> [p, k, j, q, g, len]
    per_row = (slice(None), slice(None), None, None)  # [batch, kv, len] -> [b, k, q, g, len]
    q_by_prompt = q.reshape(prompts, group, q_len, num_kv_heads, groups, head_dim)
    prefix_scores = _scores("pjqkgd,pksd->pkjqgs", q_by_prompt, prefix.k, prefix.k_scale, per_prompt)
    prefix_scores = prefix_scores.transpose(0, 2, 1, 3, 4, 5).reshape(batch, num_kv_heads, q_len, groups, prefix_len)
    q = q.reshape(batch, q_len, num_kv_heads, groups, head_dim)
    own_scores = _scores("bqkgd,bksd->bkqgs", q, own.k, own.k_scale, per_row)
    scores = jnp.concatenate([prefix_scores, own_scores], axis=-1)
    weights = _masked_softmax(scores, mask[:, None, :, None], head_dim, scale, softcap)  # [b, k, q, g, s]
    prefix_weights = weights[..., :prefix_len].reshape(prompts, group, num_kv_heads, q_len, groups, prefix_len)
    from_prefix = _weighted_values("pjkqgs,pksd->pkjqgd", prefix_weights, prefix.v, prefix.v_scale,
                                   (slice(None), None, slice(None), None, None))
    from_own = _weighted_values("bkqgs,bksd->bkqgd", weights[..., prefix_len:], own.v, own.v_scale, per_row)
    out = from_prefix.transpose(0, 2, 3, 1, 4, 5).reshape(batch, q_len, num_kv_heads, groups, head_dim)
    return (out + from_own.transpose(0, 2, 1, 3, 4)).reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)


def _scores(spec: str, q: jax.Array, k: jax.Array, k_scale: jax.Array | None, expand: tuple) -> jax.Array:
    """float32 `q . k` scores (an int8 `k` is converted to q's dtype, its scale applied per key)."""
    scores = jnp.einsum(spec, q, k.astype(q.dtype), preferred_element_type=jnp.float32)
    return scores if k_scale is None else scores * k_scale[(*expand, slice(None))]


def _weighted_values(spec: str, weights: jax.Array, v: jax.Array, v_scale: jax.Array | None,
                     expand: tuple) -> jax.Array:
    """float32 `weights . v` (an int8 `v`'s per-key scale folded into the float32 weights first). Callers
    round to the compute dtype once, at the end."""
    if v_scale is not None:
        weights = weights * v_scale[(*expand, slice(None))]
    return jnp.einsum(spec, weights, v.astype(jnp.float32), preferred_element_type=jnp.float32)


def _masked_softmax(scores: jax.Array, mask: jax.Array, head_dim: int, scale: float | None,
                    softcap: float | None) -> jax.Array:
    """Softmax over the last axis of float32 `scores` after scaling, soft-capping and masking."""
    scores = scores * (head_dim**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash")


def target_platform(mesh=None) -> str:
    """The platform (`tpu`, `gpu`, `cpu`) of the devices a program runs on: those of `mesh` (a
    `jax.sharding.Mesh`, possibly over an unattached TPU topology compiled for on a CPU host), else the
    default backend's. Kernels are picked by it, not by `jax.default_backend()`, which stays `cpu` when
    compiling ahead of time for a TPU."""
    if mesh is None:
        return jax.default_backend()
    return mesh.devices.flat[0].platform


def resolve_implementation(implementation: str = "auto", backend: str | None = None) -> str:
    """The self-attention kernel to use: `auto` -> cuDNN on NVIDIA GPUs, Pallas splash attention on TPUs, XLA
    elsewhere (CPU, ROCm); any other name is kept. `backend`: the target platform (`target_platform`);
    None: the default backend's."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; choose from "
                         f"{', '.join(IMPLEMENTATIONS)}")
    if implementation != "auto":
        return implementation
    backend = backend or jax.default_backend()
    if backend == "tpu":
        return "splash"
    if backend in ("gpu", "cuda") and "rocm" not in jax.devices()[0].client.platform_version.lower():
        return "cudnn"
    return "xla"


def self_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array, *, scale: float | None = None,
                   softcap: float | None = None, window: int | None = None, implementation: str = "xla",
                   interpret: bool = False, layout=None, max_segments: int | None = None) -> jax.Array:
    """Causal self-attention of a left-padded batch without a cache (training, log-probs, prefill).

    Args:
      q: `[batch, seq, num_heads, head_dim]`.
      k, v: `[batch, seq, num_kv_heads, head_dim]` (token-major, as projected).
      valid: `[batch, seq]` bool, False on padding: no query sees a padding key. Or int segment ids of packed
        rows (`jaxrl.packing`): 0 on padding, and a query sees only earlier keys of its own segment. A segment
        is a run of equal ids (every implementation agrees where each segment's slots are contiguous, as a
        packer writes them). The sliding window counts slots, so within a segment it counts positions, and a
        window reaching back past a segment's start is cut there.
      scale, softcap: as in `attention`.
      window: sliding window (key j visible to query i iff `i - window < j <= i`); None: full causal.
      implementation: `xla` (the reference, `attention` with a dense mask), `cudnn`
        (`jax.nn.dot_product_attention`'s cuDNN kernel, NVIDIA GPUs) or `splash` (JAX's Pallas splash attention,
        TPUs). cuDNN has no soft-capping and takes only bf16/fp16 inputs with head_dim a multiple of 8 up to
        128 (`cudnn_supports`): otherwise it falls back to `xla`. Packed rows (int `valid`) go to cuDNN's
        variable-length ("THD", ragged offsets) kernel (`_cudnn_packed_self_attention`), which needs a Hopper
        or newer GPU and JAX's private cuDNN entry point (`cudnn_packed_available`); otherwise to `xla`.
      interpret: run the Pallas kernel in interpret mode (always so when the target platform is not a TPU:
        tests on CPU).
      layout: the `models.partitioning.Layout` the program is sharded by, or None. Its mesh's devices decide the
        target platform; on a mesh of several devices splash runs per chip inside `jax.shard_map`
        (`_splash_sharded`), the batch split over the batch axes and the heads over their axes by the layout's
        rules. The other implementations leave the partitioning to XLA.
      max_segments: packed rows only, cuDNN only: a static bound on the segments of one row. cuDNN sizes its
        work by it (it runs `batch * max_segments` sequences of up to `seq` slots, mostly empty, and keeps
        float32 softmax statistics `[batch * max_segments, heads, seq]` for the backward pass), so give the
        packer's bound. None: `seq`, always enough. A row with more segments than the bound gets NaN outputs
        at every real token (never silently wrong attention).

    Returns:
      `[batch, seq, num_heads, head_dim]` in q's dtype. Rows of padding queries are unspecified.
    """
    packed = valid.dtype != jnp.bool_
    if implementation == "cudnn" and softcap is None and cudnn_supports(q.dtype, q.shape[-1]):
        if not packed:
            return _cudnn_self_attention(q, k, v, valid, scale, window, "cudnn")
        if cudnn_packed_available(None if layout is None else layout.mesh):
            return _cudnn_packed_self_attention(q, k, v, valid, scale, window, max_segments)
    if implementation == "splash":
        interpret = interpret or target_platform(None if layout is None else layout.mesh) != "tpu"
        if layout is not None and layout.mesh.size > 1:
            return _splash_sharded(q, k, v, valid, scale, softcap, window, interpret, layout)
        return _splash_self_attention(q, k, v, valid, scale, softcap, window, interpret)
    if implementation not in ("xla", "cudnn"):
        raise ValueError(f"unknown attention implementation {implementation!r}; choose from xla, cudnn, splash")
    seq = q.shape[1]
    query_index = jnp.broadcast_to(jnp.arange(seq), valid.shape)
    mask = causal_padding_mask(query_index, valid != 0)
    if packed:
        mask = mask & (valid[:, :, None] == valid[:, None, :])
    if window is not None:
        mask = mask & sliding_window_mask(query_index, seq, window)
    return attention(q, KV(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)), mask, scale=scale, softcap=softcap)


CUDNN_SEQ_MULTIPLE = 64  # cuDNN's flash kernels reject some odd lengths ("Unsupported sequence length Q 511")


def cudnn_supports(dtype, head_dim: int) -> bool:
    """Whether cuDNN's fused attention takes inputs of this dtype and head size (float32 it does not)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim % 8 == 0 \
        and head_dim <= 128


def _cudnn_self_attention(q, k, v, valid, scale, window, implementation):
    """`jax.nn.dot_product_attention` (GQA native) on a left-padded batch.

    cuDNN takes padding only as per-row lengths of right-padded sequences (a broadcast `[batch, 1, 1, seq]`
    mask is refused: "Bias must have same seq length as QKV"). Each row is rotated so its real tokens come
    first, attended with `query/key_value_seq_lengths`, and rotated back. The real tokens keep their order, so
    causality and the sliding window are unchanged (RoPE has already been applied at the original positions).
    """
    seq = q.shape[1]
    padded = -(-seq // CUDNN_SEQ_MULTIPLE) * CUDNN_SEQ_MULTIPLE
    lengths = valid.sum(axis=1, dtype=jnp.int32)  # left padding: the real tokens are the last `lengths`
    to_right = (jnp.arange(seq)[None, :] + (seq - lengths)[:, None]) % seq  # [batch, seq] source index

    def rotate(x, index):  # then pad the sequence at the end: past `lengths`, so masked
        x = jnp.take_along_axis(x, index[:, :, None, None], axis=1)
        return jnp.pad(x, ((0, 0), (0, padded - x.shape[1]), (0, 0), (0, 0)))

    out = jax.nn.dot_product_attention(
        rotate(q, to_right), rotate(k, to_right), rotate(v, to_right),
        scale=scale if scale is not None else q.shape[-1] ** -0.5, is_causal=True, query_seq_lengths=lengths,
        key_value_seq_lengths=lengths, local_window_size=None if window is None else (window - 1, 0),
        implementation=implementation)
    back = (jnp.arange(seq)[None, :] + lengths[:, None]) % seq
    return jnp.take_along_axis(out, back[:, :, None, None], axis=1)


def segment_ranges(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each segment of packed rows lies: cuDNN's variable-length ("THD") description of them.

    A segment is a maximal run of equal non-zero ids; 0 is padding. Segment m of row b is the slots
    `[starts[b, m], starts[b, m] + lengths[b, m])`, in row order.

    Args:
      segment_ids: `[batch, seq]` int.
      max_segments: static number of segment entries per row, M.

    Returns:
      `(lengths [batch, M] int32, starts [batch, M + 1] int32, count [batch] int32)`: the first M segments of
      each row, -1 past the row's last one (the `[batch, M + 1]` start offsets, -1 filled, are the layout JAX's
      cuDNN entry point takes); `count` is the row's number of segments, which may exceed M (then segments
      after the M-th are not described).
    """
    segment_ids = segment_ids.astype(jnp.int32)
    batch, seq = segment_ids.shape
    previous = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)))  # padding (0) before slot 0
    real = segment_ids != 0
    first = real & (segment_ids != previous)  # [batch, seq] a segment starts here
    ordinal = jnp.cumsum(first, axis=1, dtype=jnp.int32) - 1  # [batch, seq] the slot's segment, where real
    count = ordinal[:, -1] + 1
    rows = jnp.arange(batch)[:, None]
    # Scatter into M + 1 columns; the last one collects everything past the M-th segment and is dropped.
    column = jnp.where(first & (ordinal < max_segments), ordinal, max_segments)
    starts = jnp.full((batch, max_segments + 1), -1, jnp.int32).at[rows, column].set(
        jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)))
    column = jnp.where(real & (ordinal < max_segments), ordinal, max_segments)
    lengths = jnp.zeros((batch, max_segments + 1), jnp.int32).at[rows, column].add(1)[:, :max_segments]
    described = jnp.arange(max_segments)[None, :] < count[:, None]
    lengths = jnp.where(described, lengths, -1)
    starts = jnp.where(jnp.arange(max_segments + 1)[None, :] < jnp.minimum(count, max_segments)[:, None],
                       starts, -1)
    return lengths, starts, count


def cudnn_packed_available(mesh=None) -> bool:
    """Whether packed rows can take cuDNN's variable-length kernel: the target devices (`mesh`'s, else the
    default backend's) are NVIDIA GPUs of compute capability 9.0 (Hopper) or newer, which JAX requires of it,
    and JAX's private cuDNN entry point takes segment offsets (`_cudnn_ragged_entry_point`: a JAX release that
    changes it falls back to XLA instead of failing). `attention_impl: xla` keeps packed rows off it."""
    device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
    if device.platform != "gpu" or "cuda" not in device.client.platform_version.lower():
        return False
    try:
        capability = tuple(int(x) for x in str(device.compute_capability).split("."))
    except (AttributeError, ValueError):
        return False
    return capability >= (9, 0) and _cudnn_ragged_entry_point() is not None


@functools.lru_cache(maxsize=None)
def _cudnn_ragged_entry_point():
    """`(jax._src.cudnn.fused_attention_stablehlo.dot_product_attention, MaskType)` if this JAX has them with
    the arguments used here (checked on jax 0.10.2; the device machine's 0.11.2 is checked by
    benchmarks/gpu_packed.py), else None."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn
        parameters = inspect.signature(cudnn.dot_product_attention).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    needed = {"q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type", "sliding_window_length",
              "qkv_layout"}
    if not needed <= set(parameters) or not hasattr(cudnn, "MaskType"):
        return None
    return cudnn.dot_product_attention, cudnn.MaskType


def _cudnn_ragged_attention(q, k, v, lengths, starts, scale, window, mask: str = "PADDING_CAUSAL"):
    """cuDNN flash attention over the segments `segment_ranges` describes, each attended causally on its own
    (a sequence of its own to cuDNN: causality and the window count from the segment's first slot), through
    JAX's private entry point. q `[batch, seq, heads, head_dim]`, k and v `[batch, seq, heads, head_dim]`
    (as many heads as q: see `_cudnn_packed_self_attention`). Slots outside every segment: unspecified.
    `mask`: the entry point's `MaskType` name (benchmarks/gpu_packed.py also measures `CAUSAL`)."""
    attend, mask_type = _cudnn_ragged_entry_point()
    return attend(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=starts, kv_offsets=starts, scale=scale,
                  mask_type=mask_type[mask], sliding_window_length=window, qkv_layout="BTNH")


def _cudnn_packed_self_attention(q, k, v, segment_ids, scale, window, max_segments, attend=None,
                                 repeat_kv: bool = True):
    """Causal self-attention of packed rows through cuDNN's variable-length kernel (`self_attention` with int
    segment ids and `implementation="cudnn"`).

    Each row's segments are described by their start slots and lengths (`segment_ranges`, computed in the
    program from the ids, with the static bound `max_segments`, default `seq`); cuDNN attends each segment as a
    sequence of its own, so no mask is materialised and no work is spent across segments. The sequence axis is
    padded at the end to a multiple of `CUDNN_SEQ_MULTIPLE` (slots in no segment). Outputs of padding slots are
    set to 0 (cuDNN leaves them unwritten: a NaN there would reach the weight gradients through a 0 * NaN).
    Rows with more segments than the bound: NaN at every real slot.

    `repeat_kv`: repeat the KV heads up to the query heads first. JAX's entry point scales the key offsets by
    the query heads' stride (`_fix_seqlen_offsets` in jax 0.10 and 0.11), which is right for keys only when they
    have as many heads as the queries; benchmarks/gpu_packed.py measures the unrepeated form too. `attend`: the
    kernel, `(q, k, v, lengths, starts, scale, window) -> out` (default `_cudnn_ragged_attention`; tests pass a
    CPU rendering of the same semantics).
    """
    batch, seq, num_heads, head_dim = q.shape
    bound = max(2, min(seq if max_segments is None else max_segments, seq))  # one segment: JAX's unpacked path
    lengths, starts, count = segment_ranges(segment_ids, bound)
    if repeat_kv and k.shape[2] != num_heads:
        k, v = (jnp.repeat(x, num_heads // x.shape[2], axis=2) for x in (k, v))
    padded = -(-seq // CUDNN_SEQ_MULTIPLE) * CUDNN_SEQ_MULTIPLE
    extra = ((0, 0), (0, padded - seq), (0, 0), (0, 0))
    attend = attend or _cudnn_ragged_attention
    out = attend(*(jnp.pad(x, extra) for x in (q, k, v)), lengths, starts,
                 head_dim ** -0.5 if scale is None else scale, window)[:, :seq]
    real = (segment_ids != 0)[:, :, None, None]
    out = jnp.where(real, out, jnp.zeros((), out.dtype))
    return jnp.where(real & (count > bound)[:, None, None, None], jnp.full((), jnp.nan, out.dtype), out).astype(
        q.dtype)


SPLASH_BLOCK = 128  # TPU lanes: sequence blocks of the splash kernel


def _splash_self_attention(q, k, v, valid, scale, softcap, window, interpret):
    """JAX's Pallas splash attention, one MQA kernel per KV head (GQA); padding as segment 0, the sequence
    padded at the end to a multiple of `SPLASH_BLOCK` (those slots are segment 0 too and come after every
    real token, so causality hides them)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    groups = num_heads // num_kv_heads
    padded = -(-seq // SPLASH_BLOCK) * SPLASH_BLOCK
    extra = ((0, 0), (0, padded - seq), (0, 0), (0, 0))
    q, k, v = (jnp.pad(x, extra) for x in (q, k, v))
    segments = jnp.pad(valid, ((0, 0), (0, padded - seq))).astype(jnp.int32)
    shape = (padded, padded)
    head_mask = masks.CausalMask(shape) if window is None else masks.LocalMask(shape, (window - 1, 0), 0)
    block = splash.BlockSizes(*(SPLASH_BLOCK,) * 8)
    kernel = splash.make_splash_mqa_single_device(masks.MultiHeadMask([head_mask] * groups), block_sizes=block,
                                                  attn_logits_soft_cap=softcap, interpret=interpret)
    scale = head_dim ** -0.5 if scale is None else scale
    # [batch, kv, groups, seq, head_dim] queries against [batch, kv, seq, head_dim] keys, one kernel per (b, kv)
    q = (q * scale).astype(q.dtype).reshape(batch, padded, num_kv_heads, groups, head_dim).transpose(0, 2, 3, 1, 4)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def one(q_kv, k_kv, v_kv, segment):
        return kernel(q_kv, k_kv, v_kv, splash.SegmentIds(q=segment, kv=segment))

    per_kv = jax.vmap(one, in_axes=(0, 0, 0, None))
    out = jax.vmap(per_kv)(q, k, v, segments)  # [batch, kv, groups, padded, head_dim]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, padded, num_heads, head_dim)[:, :seq]


def _splash_sharded(q, k, v, valid, scale, softcap, window, interpret, layout):
    """`_splash_self_attention` inside `jax.shard_map` over `layout.mesh`: XLA cannot partition a Mosaic kernel,
    so each chip runs it on its own shard. The batch is split as `layout` splits `batch`, the query heads as it
    splits `heads`; the sequence and head_dim are whole on every chip (a sequence split by the rules is gathered
    here: causal attention needs every earlier key).

    GQA: a chip holding `heads_per_shard` consecutive query heads needs the KV heads those read. With
    `local_groups = gcd(heads_per_shard, groups)` query heads per KV head on the chip, K and V are repeated
    `groups // local_groups` times along their heads before the shard_map and split like the queries. Where
    the KV heads split evenly (`heads_per_shard % groups == 0`, e.g. 32 query and 8 KV heads on tensor=4) the
    repeat is 1 and this is the plain split. Otherwise (e.g. 8 query and 2 KV heads on tensor=4: each chip's 2
    query heads read one KV head, repeated twice) each chip holds `heads_per_shard // local_groups` KV heads
    instead of all of them replicated: never more K/V memory per chip (`lcm(heads_per_shard, groups)` divides
    `num_heads`), paid for by the repeat itself (K/V of the chip's heads written once more,
    `[batch/shards, seq, heads_per_shard // local_groups, head_dim]` each) and, in the backward pass, the
    gradients of the copies summed back into their KV head (a reduction over the head axes).
    """
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    groups = num_heads // num_kv_heads
    q_spec = layout.spec(("batch", None, "heads", None), q.shape)
    q_spec = tuple(q_spec) + (None,) * (4 - len(q_spec))
    batch_axes, head_axes = q_spec[0], q_spec[2]
    head_shards = math.prod(layout.mesh.shape[a] for a in _axes_tuple(head_axes))
    heads_per_shard = num_heads // head_shards
    local_groups = math.gcd(heads_per_shard, groups)
    repeat = groups // local_groups
    if repeat > 1:  # kv head j -> copies j * repeat + r, each read by `local_groups` consecutive query heads
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    qkv_spec = PartitionSpec(batch_axes, None, head_axes, None)
    valid_spec = PartitionSpec(batch_axes, None)

    def local(q, k, v, valid):
        return _splash_self_attention(q, k, v, valid, scale, softcap, window, interpret)

    sharded = jax.shard_map(local, mesh=layout.mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, valid_spec),
                            out_specs=qkv_spec, check_vma=False)
    return sharded(q, k, v, valid)


def _axes_tuple(axes) -> tuple[str, ...]:
    """A `PartitionSpec` entry (None, a mesh axis name or a tuple of them) as a tuple of names."""
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
