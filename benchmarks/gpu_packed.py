"""Packed rows on an NVIDIA GPU: cuDNN's variable-length attention against XLA, and a Qwen2.5-0.5B-shaped model
on packed rows against the same sequences padded. Prints one JSON line, then tables.

    python benchmarks/gpu_packed.py [--seed 0] [--small]

1. Attention (gating): bf16 `q [rows, seq, 14, 64]`, `k, v [rows, seq, 2, 64]` (Qwen2.5-0.5B's heads), rows packed
   first-fit with sequences of 64 + `jaxrl.bench.ragged_lengths` tokens (several per row, trailing padding), causal
   and sliding window 128, seq 768 and 700 (not a multiple of 64). `self_attention(..., implementation="cudnn",
   max_segments=M)` (M the packing's most segments per row, and None = seq) against the XLA path in float32 on
   the same inputs: outputs and q/k/v gradients, relative error over real tokens; every output finite.
2. Diagnostics (not gating): whether the program really calls cuDNN (`__cudnn$fmha` in the compiled HLO), JAX's
   private entry point's signature, the unrepeated-KV form (`repeat_kv=False`: native GQA, whose key offsets JAX
   may scale by the query heads; see `kernels.attention._cudnn_packed_self_attention`) and the CAUSAL mask type
   in place of PADDING_CAUSAL.
3. Timing of one attention layer's forward + backward (median of 20 after 3 warm-ups, `block_until_ready`): packed
   cuDNN with the tight bound, with M = seq and with native GQA, the same sequences padded (one per row, cuDNN's
   padded path), and packed XLA.
4. Model (gating): `models.PRESETS["qwen2.5-0.5b"]` in bf16 with random weights, `attention_impl="cudnn"`: the
   logits at every real token of packed rows against the same sequences left-padded (cuDNN's padded path), and
   both against the padded float32 XLA forward.

`--small` shrinks every shape and uses a tiny model: a CPU smoke test of the script itself (cuDNN rows then take
the XLA fallback and say so). Errors are ||got - want|| / ||want||.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from gpu_checks import _relative_error  # benchmarks/ is the script's own folder

from jaxrl import models
from jaxrl.bench import ragged_lengths
from jaxrl.kernels.attention import (_cudnn_packed_self_attention, _cudnn_ragged_attention, _cudnn_ragged_entry_point,
                                    cudnn_packed_available, self_attention)

BF16_TOLERANCE = 2e-2  # bf16 operands: errors land between 1e-3 and 1e-2
MODEL_TOLERANCE = 5e-2  # 24 bf16 layers


def pack(lengths, row: int):
    """First-fit decreasing: segment ids and positions `[rows, row]` int32, and each sequence's (row, first slot)
    in the order of `lengths`."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    free, places = [], [None] * len(lengths)
    for i in order:
        r = next((r for r, f in enumerate(free) if f >= lengths[i]), None)
        if r is None:
            free.append(row)
            r = len(free) - 1
        places[i] = (r, row - free[r])
        free[r] -= lengths[i]
    segments = np.zeros((len(free), row), np.int32)
    positions = np.zeros((len(free), row), np.int32)
    for i, (r, start) in enumerate(places):
        segments[r, start:start + lengths[i]] = 1 + max(segments[r].max(), 0)
        positions[r, start:start + lengths[i]] = np.arange(lengths[i])
    return segments, positions, places


def _lengths(count, seq, seed):
    prompt = min(64, seq // 4)
    return [int(prompt + n) for n in ragged_lengths(count, seq - prompt, seed)]


def _attention_inputs(key, seq, count, heads, kv_heads, head_dim, seed):
    lengths = _lengths(count, seq, seed)
    segments, _, _ = pack(lengths, seq)
    rows = segments.shape[0]
    kq, kk, kv, kw = jax.random.split(key, 4)
    q = jax.random.normal(kq, (rows, seq, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(kk, (rows, seq, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(kv, (rows, seq, kv_heads, head_dim), jnp.bfloat16)
    weights = jax.random.normal(kw, q.shape, jnp.float32)
    return lengths, jnp.asarray(segments), q, k, v, weights


def _cudnn_fn(window, max_segments, variant="default"):
    """Packed cuDNN attention `(q, k, v, segment_ids) -> out`: `self_attention`'s, or a diagnostic variant of it
    (`native GQA`: KV heads not repeated; `mask CAUSAL`: the entry point's CAUSAL mask type)."""
    if variant == "default":
        return lambda q, k, v, s: self_attention(q, k, v, s, window=window, implementation="cudnn",
                                                 max_segments=max_segments)
    if variant == "native GQA":
        return lambda q, k, v, s: _cudnn_packed_self_attention(q, k, v, s, None, window, max_segments,
                                                               repeat_kv=False)
    attend = functools.partial(_cudnn_ragged_attention, mask="CAUSAL")
    return lambda q, k, v, s: _cudnn_packed_self_attention(q, k, v, s, None, window, max_segments, attend)


def check_attention(key, seq, window, bound, variant, shapes, seed) -> dict:
    """Packed cuDNN (bf16) against packed XLA (float32 on the same inputs): outputs and gradients."""
    lengths, segments, q, k, v, weights = _attention_inputs(key, seq, *shapes, seed)
    real = np.asarray(segments != 0)
    most = int(max(np.unique(row[row > 0]).size for row in np.asarray(segments)))
    max_segments = most if bound == "tight" else None
    fn = _cudnn_fn(window, max_segments, variant)
    reference = lambda q, k, v, s: self_attention(q, k, v, s, window=window)  # noqa: E731

    def loss(f, dtype):
        def run(q, k, v):
            out = f(q.astype(dtype), k.astype(dtype), v.astype(dtype), segments).astype(jnp.float32)
            return jnp.sum(jnp.where(segments[..., None, None] != 0, out, 0) * weights), out
        return jax.jit(jax.value_and_grad(run, argnums=(0, 1, 2), has_aux=True))

    compiled = loss(fn, jnp.bfloat16).lower(q, k, v).compile()
    (_, got), got_grads = compiled(q, k, v)
    (_, want), want_grads = loss(reference, jnp.float32)(q, k, v)
    errors = {"output": _relative_error(got, want, real)}
    for name, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads):
        errors[name] = _relative_error(g, w, real)
    return {"errors": errors, "finite": bool(np.isfinite(np.asarray(got)).all()), "rows": int(segments.shape[0]),
            "sequences": len(lengths), "max_segments": max_segments, "most_segments_per_row": most,
            "cudnn_in_hlo": "cudnn$fmha" in compiled.as_text()}


def _median_ms(fn, *args, warmup=3, repeats=20) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_attention(key, seq, shapes, seed) -> list[dict]:
    """Forward + backward of one attention layer on the same sequences, five ways."""
    lengths, segments, q, k, v, _ = _attention_inputs(key, seq, *shapes, seed)
    most = int(max(np.unique(row[row > 0]).size for row in np.asarray(segments)))
    longest = max(lengths)
    padded_valid = jnp.asarray(np.arange(longest)[None, :] >= (longest - np.asarray(lengths))[:, None])
    heads, kv_heads, head_dim = q.shape[2], k.shape[2], q.shape[3]
    kp = jax.random.split(jax.random.fold_in(key, 1), 3)
    pq = jax.random.normal(kp[0], (len(lengths), longest, heads, head_dim), jnp.bfloat16)
    pk = jax.random.normal(kp[1], (len(lengths), longest, kv_heads, head_dim), jnp.bfloat16)
    pv = jax.random.normal(kp[2], (len(lengths), longest, kv_heads, head_dim), jnp.bfloat16)

    def grad_of(f, mask):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, mask).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))

    variants = [
        ("packed cudnn, max_segments = most per row", grad_of(_cudnn_fn(None, most), segments), (q, k, v)),
        ("packed cudnn, max_segments = seq", grad_of(_cudnn_fn(None, None), segments), (q, k, v)),
        ("packed cudnn, native GQA (diagnostic: right only if its check passed)",
         grad_of(_cudnn_fn(None, most, "native GQA"), segments), (q, k, v)),
        ("padded cudnn (one sequence per row)",
         grad_of(lambda q, k, v, m: self_attention(q, k, v, m, implementation="cudnn"), padded_valid),
         (pq, pk, pv)),
        ("packed xla", grad_of(lambda q, k, v, m: self_attention(q, k, v, m), segments), (q, k, v)),
    ]
    rows = []
    for name, fn, args in variants:
        try:
            ms = _median_ms(fn, *args)
            rows.append({"variant": name, "shape": list(args[0].shape), "ms": ms,
                         "useful_tokens_per_ms": sum(lengths) / ms})
        except Exception as error:  # noqa: BLE001 - a variant that does not run is reported, not fatal
            rows.append({"variant": name, "error": f"{type(error).__name__}: {str(error)[:300]}"})
    return rows


def check_model(key, small: bool, seed: int) -> dict:
    """Packed cuDNN bf16 logits at real tokens against the same sequences padded (cuDNN bf16), and both against
    the padded float32 XLA forward."""
    if small:
        config = models.ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                    head_dim=16, intermediate_size=128, family="qwen2", qkv_bias=True)
        count, row = 6, 128
    else:
        config, count, row = models.PRESETS["qwen2.5-0.5b"], 12, 512
    lengths = _lengths(count, row, seed + 1)
    segments, positions, places = pack(lengths, row)
    rng = np.random.default_rng(seed)
    sequences = [rng.integers(0, config.vocab_size, n).astype(np.int32) for n in lengths]
    packed = np.zeros(segments.shape, np.int32)
    for s, (r, start) in zip(sequences, places):
        packed[r, start:start + len(s)] = s
    longest = max(lengths)
    padded = np.zeros((count, longest), np.int32)
    valid = np.zeros((count, longest), bool)
    for i, s in enumerate(sequences):
        padded[i, longest - len(s):], valid[i, longest - len(s):] = s, True
    packed_index = np.concatenate([r * row + start + np.arange(len(s)) for s, (r, start) in zip(sequences, places)])
    padded_index = np.concatenate([i * longest + longest - len(s) + np.arange(len(s))
                                   for i, s in enumerate(sequences)])
    most = int(max(np.unique(r[r > 0]).size for r in segments))

    impl = "cudnn" if jax.default_backend() == "gpu" else "xla"  # CPU smoke test: no cuDNN at all
    policy = models.init(dataclasses.replace(config, dtype="bfloat16", attention_impl=impl), jax.random.fold_in(key, 2))

    def logits_at_real_tokens(policy, tokens, positions, mask, index, max_segments=None):
        hidden, _ = models.apply(policy, tokens, positions, mask, max_segments=max_segments)
        hidden = hidden.reshape(-1, hidden.shape[-1])[index][None]
        return models.logits_from_hidden(policy, hidden)[0]

    run = jax.jit(logits_at_real_tokens, static_argnums=(5,))
    packed_logits = run(policy, jnp.asarray(packed), jnp.asarray(positions), jnp.asarray(segments),
                        jnp.asarray(packed_index), most)
    padded_positions = models.positions_from_mask(jnp.asarray(valid))
    padded_logits = run(policy, jnp.asarray(padded), padded_positions, jnp.asarray(valid), jnp.asarray(padded_index))
    f32 = models.replace_config(policy, dtype="float32", attention_impl="xla")
    exact = run(f32, jnp.asarray(padded), padded_positions, jnp.asarray(valid), jnp.asarray(padded_index))

    def error(a, b):  # on the device: [tokens, vocab] float32 is large
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

    return {"model": "tiny" if small else "qwen2.5-0.5b", "sequences": count, "rows": int(segments.shape[0]),
            "row": row, "max_segments": most, "tokens": int(sum(lengths)),
            "finite": bool(jnp.isfinite(packed_logits).all()),
            "errors": {"packed vs padded (both cudnn bf16)": error(packed_logits, padded_logits),
                       "packed cudnn bf16 vs padded xla f32": error(packed_logits, exact),
                       "padded cudnn bf16 vs padded xla f32": error(padded_logits, exact)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    args = parser.parse_args(argv)
    key = jax.random.key(args.seed)
    device = jax.devices()[0]
    available = cudnn_packed_available()
    entry = _cudnn_ragged_entry_point()
    shapes = (12, 4, 2, 16) if args.small else (24, 14, 2, 64)  # sequences, heads, kv heads, head_dim
    seqs = (128, 100) if args.small else (768, 700)
    window = 16 if args.small else 128
    note = "" if available else " (cuDNN packed unavailable here: XLA fallback)"
    checks = [{"check": "cuDNN packed kernel available (NVIDIA GPU, compute capability >= 9.0, JAX entry point)",
               "gating": device.platform == "gpu", "ok": available, "errors": {}}]
    cases = [(seqs[0], None, "tight", "default"), (seqs[0], window, "tight", "default"),
             (seqs[1], None, "tight", "default"), (seqs[0], None, "seq", "default"),
             (seqs[0], window, "tight", "native GQA"), (seqs[0], window, "tight", "mask CAUSAL")]
    for i, (seq, w, bound, variant) in enumerate(cases):
        gating = variant == "default"
        name = (f"packed cudnn attention, bf16, seq {seq}, window {w}, max_segments {bound}"
                + ("" if gating else f", {variant} (diagnostic)") + note)
        try:
            result = check_attention(jax.random.fold_in(key, 10 + i), seq, w, bound, variant, shapes, args.seed)
            ok = (max(result["errors"].values()) < BF16_TOLERANCE and result["finite"]
                  and (result["cudnn_in_hlo"] or not available))
        except Exception as error:  # noqa: BLE001 - reported; fails the run only if gating
            result, ok = {"error": f"{type(error).__name__}: {str(error)[:500]}"}, False
        checks.append({"check": name, "gating": gating, "ok": ok, **result})
    try:
        model = check_model(jax.random.fold_in(key, 2), args.small, args.seed)
        model_ok = model["finite"] and max(model["errors"].values()) < MODEL_TOLERANCE
    except Exception as error:  # noqa: BLE001
        model, model_ok = {"error": f"{type(error).__name__}: {str(error)[:500]}"}, False
    checks.append({"check": "packed model forward" + note, "gating": True, "ok": model_ok, **model})
    timing = time_attention(jax.random.fold_in(key, 3), seqs[0], shapes, args.seed)
    result = {"device": device.device_kind, "platform": device.platform, "jax_version": jax.__version__,
              "cudnn_packed_available": available, "seed": args.seed,
              "entry_point": None if entry is None else str(inspect.signature(entry[0])),
              "checks": checks, "timing": timing}
    print(json.dumps(result), flush=True)
    print("\n| check | errors | cuDNN in HLO | ok |\n|---|---|---|---|")
    for c in checks:
        errors = c.get("error") or ", ".join(f"{k} {v:.1e}" for k, v in c["errors"].items()) or str(c["ok"])
        print(f"| {c['check']} | {errors} | {c.get('cudnn_in_hlo', '')} | "
              f"{'yes' if c['ok'] else 'NO' if c['gating'] else 'no (diagnostic)'} |")
    print("\n| attention fwd+bwd, same sequences | q shape | ms | useful tokens/ms |\n|---|---|---|---|")
    for t in timing:
        if "error" in t:
            print(f"| {t['variant']} | | {t['error']} | |")
        else:
            print(f"| {t['variant']} | {t['shape']} | {t['ms']:.3f} | {t['useful_tokens_per_ms']:.0f} |")
    return 0 if all(c["ok"] for c in checks if c["gating"]) else 1


if __name__ == "__main__":
    sys.exit(main())
