"""The `jaxrl bench train` workload with Hugging Face transformers on torch (CPU): a reference point.

    pip install torch transformers numpy        # a separate environment: this script needs neither jax nor jaxrl
    python benchmarks/train_transformers.py [--sequences 64] [--prompt-len 64] [--completion-len 128]
                                            [--repeats 3] [--seed 0] [--threads N]

Self-contained and not part of the test suite (the project's environment has no torch). The workload is the
one of `jaxrl bench train` (`jaxrl/bench.py: bench_train`): the `bench-small` shape as a `Qwen2ForCausalLM`
(see `sample_transformers.py`), random weights, float32, train mode; 64 random sequences of 64 prompt + 128
completion tokens; per-token log-probs of the completion tokens (`log_softmax` of the logits at the
positions that predict them, as TRL's GRPO trainer computes them); the token-level clipped policy loss
(ratio = exp(logp - old_logp), PPO clip 0.2 both sides, token mean) with random per-sequence advantages and
fixed old log-probs (the initial model's); backward; global-norm clipping to 1.0 and `torch.optim.AdamW`.
Training tokens/s = sequences * (prompt + completion) / median step time of `--repeats` steps after a
warm-up step. Prints one JSON line, then a markdown table.
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

import numpy as np
import torch
import transformers
from sample_transformers import bench_small_config
from transformers import Qwen2ForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after the warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all CPUs)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = bench_small_config()
    model = Qwen2ForCausalLM(config).to(torch.float32).train()
    parameters = sum(p.numel() for p in model.parameters())
    rng = np.random.default_rng(args.seed)
    length = args.prompt_len + args.completion_len
    tokens = torch.from_numpy(rng.integers(0, config.vocab_size, (args.sequences, length)).astype(np.int64))
    advantages = torch.from_numpy(rng.standard_normal((args.sequences, 1)).astype(np.float32))

    def completion_logprobs() -> torch.Tensor:
        logits = model(input_ids=tokens[:, :-1]).logits[:, args.prompt_len - 1:]  # [S, N, V]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        return log_probs.gather(-1, tokens[:, args.prompt_len:, None])[..., 0]

    with torch.no_grad():
        old_logp = completion_logprobs()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> float:
        start = time.perf_counter()
        ratio = torch.exp(completion_logprobs() - old_logp)
        loss = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if not torch.isfinite(loss):
            sys.exit(f"loss is not finite: {loss.item()}")
        return time.perf_counter() - start

    first = step()
    times = [step() for _ in range(args.repeats)]
    step_s = statistics.median(times)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {
        "benchmark": "train_transformers", "model": "bench-small (Qwen2ForCausalLM)", "parameters": parameters,
        "dtype": "float32", "sequences": args.sequences, "prompt_len": args.prompt_len,
        "completion_len": args.completion_len, "repeats": args.repeats, "seed": args.seed, "first_step_s": first,
        "step_s": step_s, "step_times_s": times, "tokens_per_s": args.sequences * length / step_s,
        "peak_memory_bytes": maxrss if sys.platform == "darwin" else maxrss * 1024,
        "peak_memory_source": "host ru_maxrss", "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
    }
    print(json.dumps(result), flush=True)
    print()
    print("| implementation | sequences x tokens | training tokens/s | step time | peak memory |")
    print("|---|---|---|---|---|")
    print(f"| transformers {transformers.__version__} / torch {torch.__version__} ({result['attn_implementation']}) "
          f"| {args.sequences} x ({args.prompt_len} + {args.completion_len}) | {result['tokens_per_s']:.1f} "
          f"| {step_s:.3f} s | {result['peak_memory_bytes'] / 2**30:.2f} GiB (host ru_maxrss) |")


if __name__ == "__main__":
    main()
