"""The `jaxrl bench train` workload with Tunix (Google's JAX post-training library) on CPU: the JAX peer.

    python -m venv tunixenv && tunixenv/bin/pip install google-tunix   # its own environment (tested: 0.1.7)
    tunixenv/bin/python benchmarks/train_tunix.py [--sequences 64] [--prompt-len 64] [--completion-len 128]
                                                  [--repeats 3] [--seed 0]

Not part of the test suite and independent of jaxrl. It builds the `bench-small` shape as Tunix's Qwen2
(`tunix.models.qwen2.model.Qwen2`: vocab 32000, embed 512, MLP 1408, 8 layers, 8 query / 2 KV heads of 64,
RoPE theta 1e6, untied head, float32, random weights). Its train step is the one Tunix's trainer
(`PeftTrainer._train_step`) builds:
- `nnx.value_and_grad` of Tunix's own GRPO loss, `tunix.rl.algo_core.grpo_loss_fn`: per-token log-probs
  from the full logits (`common.compute_per_token_logps`), token-level clipped ratio with epsilon 0.2,
  `loss_agg_mode="token-mean"`, beta 0 (no KL term);
- `optax.global_norm` and `nnx.Optimizer.update` with global-norm clipping to 1.0 and AdamW;
- the whole step in `nnx.jit`.

The batch: 64 random sequences of 64 prompt + 128 completion tokens (no padding: pad id -1), random
per-sequence advantages and fixed old log-probs (the initial model's). Training tokens/s = sequences *
(prompt + completion) / median step time of `--repeats` steps after a warm-up step. Prints one JSON line,
then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tunix
from flax import nnx
from tunix.models.qwen2 import model as qwen2
from tunix.rl import algo_core, common

PAD_ID, EOS_ID = -1, -2  # never in the random tokens: nothing is padding, nothing ends early


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after the warm-up")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    config = qwen2.ModelConfig(num_layers=8, vocab_size=32_000, embed_dim=512, hidden_dim=1408, num_heads=8,
                               head_dim=64, num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6,
                               use_tied_embedding=False)
    model = qwen2.Qwen2(config, rngs=nnx.Rngs(args.seed))
    parameters = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    rng = np.random.default_rng(args.seed)
    prompts = jnp.asarray(rng.integers(0, config.vocab_size, (args.sequences, args.prompt_len)), jnp.int32)
    completions = jnp.asarray(rng.integers(0, config.vocab_size, (args.sequences, args.completion_len)), jnp.int32)
    graphdef, state = nnx.split(model)
    old_logp = common.compute_per_token_logps(graphdef, state, prompt_tokens=prompts, completion_tokens=completions,
                                              pad_id=PAD_ID, eos_id=EOS_ID)
    example = SimpleNamespace(prompt_ids=prompts, completion_ids=completions,
                              completion_mask=jnp.ones(completions.shape, jnp.int32),
                              advantages=jnp.asarray(rng.standard_normal(args.sequences), jnp.float32),
                              old_per_token_logps=old_logp, ref_per_token_logps=None)
    algo = SimpleNamespace(beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_algo="grpo", loss_agg_mode="token-mean",
                           temperature=1.0)
    optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5)), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer):
        def loss_fn(model):
            return algo_core.grpo_loss_fn(model, example, algo, PAD_ID, EOS_ID)
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        grad_norm = optax.global_norm(grads)
        optimizer.update(model, grads)
        return loss, grad_norm

    def timed() -> float:
        start = time.perf_counter()
        loss, _ = jax.block_until_ready(train_step(model, optimizer))
        if not np.isfinite(float(loss)):
            sys.exit(f"loss is not finite: {float(loss)}")
        return time.perf_counter() - start

    first = timed()
    times = [timed() for _ in range(args.repeats)]
    step_s = statistics.median(times)
    length = args.prompt_len + args.completion_len
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {
        "benchmark": "train_tunix", "model": "bench-small (tunix Qwen2)", "parameters": int(parameters),
        "dtype": "float32", "sequences": args.sequences, "prompt_len": args.prompt_len,
        "completion_len": args.completion_len, "repeats": args.repeats, "seed": args.seed, "first_step_s": first,
        "compile_s": max(first - step_s, 0.0), "step_s": step_s, "step_times_s": times,
        "tokens_per_s": args.sequences * length / step_s,
        "peak_memory_bytes": maxrss * 1024, "peak_memory_source": "host ru_maxrss", "cpu_count": os.cpu_count(),
        "machine": platform.machine(), "jax_version": jax.__version__,
        "tunix_version": getattr(tunix, "__version__", None),
    }
    print(json.dumps(result), flush=True)
    print()
    print("| implementation | sequences x tokens | training tokens/s | step time | compile | peak memory |")
    print("|---|---|---|---|---|---|")
    print(f"| tunix {result['tunix_version']} (jax {jax.__version__}) | {args.sequences} x ({args.prompt_len} + "
          f"{args.completion_len}) | {result['tokens_per_s']:.1f} | {step_s:.3f} s | {result['compile_s']:.2f} s "
          f"| {result['peak_memory_bytes'] / 2**30:.2f} GiB (host ru_maxrss) |")


if __name__ == "__main__":
    main()
