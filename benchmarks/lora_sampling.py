"""Sampling with LoRA adapters: the adapted policy as it is (the adapters' matmuls at every decode step) against
merging the adapters into the weights once per RL step and sampling the plain policy.

    python benchmarks/lora_sampling.py [--model bench-small] [--rank 16] [--prompts 8] [--group 8]
                                       [--new-tokens 128] [--rounds 3] [--quantize int8]

Times, in rounds interleaved so that a drifting machine load falls on every mode alike (median over rounds):
`base` (the plain policy, for scale), `adapted` (the sampler on the adapted policy), `merge` (the jitted
merge alone) and `merged` (merge + sampling the merged policy: what one RL step would pay). The adapters get
random nonzero values, so nothing is skipped. Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from jaxrl import models
from jaxrl.bench import _model_config
from jaxrl.models import lora
from jaxrl.sampling import SamplingConfig, sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-small")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantize", choices=lora.QUANTIZATIONS, default=None)
    args = parser.parse_args()

    name, config = _model_config(args.model)
    base = models.init(config, 0)
    spec = lora.LoraSpec(rank=args.rank, alpha=2.0 * args.rank, quantize=args.quantize)
    adapted = lora.add_adapters(base, spec, seed=0)
    leaves, tree = jax.tree.flatten(adapted.params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    adapted = adapted.replace(params=jax.tree.unflatten(
        tree, [x + 0.01 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]))
    merge = jax.jit(lambda policy: lora.merged(policy, spec))

    prompts = jax.random.randint(jax.random.key(2), (args.prompts, args.prompt_len), 0, config.vocab_size)
    valid = jnp.ones(prompts.shape, bool)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0)

    def sampled(policy):
        return sample(policy, prompts, valid, jax.random.key(3), sampling, eos_id=-1, pad_id=0,
                      group_size=args.group).tokens

    modes = {
        "base": lambda: sampled(base),
        "adapted": lambda: sampled(adapted),
        "merge": lambda: merge(adapted).params,
        "merged": lambda: sampled(merge(adapted)),
    }
    for run in modes.values():  # compile every program first
        jax.block_until_ready(run())
    times = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode, run in modes.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            times[mode].append(time.perf_counter() - start)
    median = {mode: statistics.median(t) for mode, t in times.items()}
    tokens = args.prompts * args.group * args.new_tokens
    result = {"model": name, "rank": args.rank, "quantize": args.quantize, "prompts": args.prompts,
              "group": args.group, "new_tokens": args.new_tokens, "rounds": args.rounds,
              "device": str(jax.devices()[0]), "jax": jax.__version__,
              **{f"{mode}_s": round(s, 4) for mode, s in median.items()},
              "adapted_over_merged": round(median["adapted"] / median["merged"], 3)}
    print(json.dumps(result), flush=True)
    print()
    print("| mode | seconds per rollout (median) | tokens/s |")
    print("|---|---|---|")
    for mode, s in median.items():
        print(f"| {mode} | {s:.3f} | {'' if mode == 'merge' else f'{tokens / s:.0f}'} |")


if __name__ == "__main__":
    main()
