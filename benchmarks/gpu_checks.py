"""Correctness of the accelerator kernels on the device they run on: prints one JSON line and a table.

    python benchmarks/gpu_checks.py [--seed 0]

- `self_attention(implementation="cudnn")` (the cuDNN flash-attention kernel that `auto` picks on NVIDIA
  GPUs; CPU tests can only check the arguments it is given) against the XLA reference computed in float32 on
  the same bf16 inputs: outputs and gradients, causal and sliding-window, GQA, left padding.
- `kernels.token_logprobs` (chunked, custom VJP) against the full-logits reference at Qwen's vocabulary size:
  log-probs, entropy and the gradient of a loss of both.

Errors are relative: ||got - want|| / ||want|| over the rows of real (non-padding) tokens. Fresh random inputs
per seed. On a machine without an NVIDIA GPU the cuDNN rows are reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.kernels.attention import resolve_implementation, self_attention
from jaxrl.kernels.logprobs import reference_token_logprobs, token_logprobs

BF16_TOLERANCE = 2e-2  # bf16 operands: errors land between 1e-3 and 1e-2


def _relative_error(got, want, real=None) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if real is not None:
        got, want = got[real], want[real]
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def attention_case(key, batch=4, seq=512, heads=8, kv_heads=2, head_dim=64):
    """bf16 `q [b, s, h, d]`, `k, v [b, s, kv, d]`, left-padded `valid [b, s]` (row i has i * s / 8 pads)."""
    kq, kk, kv, kw = jax.random.split(key, 4)
    q = jax.random.normal(kq, (batch, seq, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), jnp.bfloat16)
    pads = np.arange(batch) * seq // 8
    valid = jnp.asarray(np.arange(seq)[None, :] >= pads[:, None])
    weights = jax.random.normal(kw, q.shape, jnp.float32)
    return q, k, v, valid, weights


def check_attention(key, window: int | None, seq: int) -> dict:
    q, k, v, valid, weights = attention_case(key, seq=seq)
    real = np.asarray(valid)

    def loss(impl, dtype):
        def f(q, k, v):
            out = self_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), valid, window=window,
                                 implementation=impl)
            return jnp.sum(jnp.where(valid[..., None, None], out.astype(jnp.float32), 0) * weights)
        return f

    want = jax.jit(lambda q, k, v: self_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                                  v.astype(jnp.float32), valid, window=window))(q, k, v)
    got = jax.jit(lambda q, k, v: self_attention(q, k, v, valid, window=window, implementation="cudnn"))(q, k, v)
    want_grads = jax.jit(jax.grad(loss("xla", jnp.float32), argnums=(0, 1, 2)))(q, k, v)
    got_grads = jax.jit(jax.grad(loss("cudnn", jnp.bfloat16), argnums=(0, 1, 2)))(q, k, v)
    errors = {"output": _relative_error(got, want, real)}
    for name, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads):
        errors[name] = _relative_error(g, w, real)
    return errors


def check_logprobs(key, batch=4, seq=512, hidden=896, vocab=151_936) -> dict:
    kh, ku, kt = jax.random.split(key, 3)
    h = jax.random.normal(kh, (batch, seq, hidden), jnp.float32)
    unembedding = jax.random.normal(ku, (vocab, hidden), jnp.float32) * hidden**-0.5
    targets = jax.random.randint(kt, (batch, seq), 0, vocab)

    def loss(fn):
        def f(h, u):
            logp, entropy = fn(h, u, targets, 0.9)
            return jnp.sum(logp) + 0.1 * jnp.sum(entropy)
        return f

    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda h, u: token_logprobs(h, u, targets, 0.9))(h, unembedding)
        want = jax.jit(lambda h, u: reference_token_logprobs(h, u, targets, 0.9))(h, unembedding)
        got_grads = jax.jit(jax.grad(loss(token_logprobs), argnums=(0, 1)))(h, unembedding)
        want_grads = jax.jit(jax.grad(loss(reference_token_logprobs), argnums=(0, 1)))(h, unembedding)
    return {"logp": _relative_error(got[0], want[0]), "entropy": _relative_error(got[1], want[1]),
            "d_hidden": _relative_error(got_grads[0], want_grads[0]),
            "d_unembedding": _relative_error(got_grads[1], want_grads[1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    key = jax.random.key(args.seed)
    device = jax.devices()[0]
    rows = []
    if resolve_implementation("auto") == "cudnn":
        for i, (window, seq) in enumerate(((None, 512), (128, 512), (None, 511))):
            errors = check_attention(jax.random.fold_in(key, 10 + i), window, seq)
            rows.append({"check": f"cudnn self-attention, bf16, seq {seq}, window {window}", "errors": errors,
                         "tolerance": BF16_TOLERANCE, "ok": max(errors.values()) < BF16_TOLERANCE})
    else:
        rows.append({"check": "cudnn self-attention", "skipped": f"no NVIDIA GPU ({device.platform})"})
    errors = check_logprobs(jax.random.fold_in(key, 1))
    rows.append({"check": "chunked token log-probs, float32 (highest precision)", "errors": errors,
                 "tolerance": 1e-4, "ok": max(errors.values()) < 1e-4})
    result = {"device": device.device_kind, "platform": device.platform, "jax_version": jax.__version__,
              "seed": args.seed, "checks": rows}
    print(json.dumps(result), flush=True)
    print("\n| check | relative errors | tolerance | ok |\n|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['check']} | skipped: {r['skipped']} | | |")
        else:
            errors = ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items())
            print(f"| {r['check']} | {errors} | {r['tolerance']:.0e} | {'yes' if r['ok'] else 'NO'} |")
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
