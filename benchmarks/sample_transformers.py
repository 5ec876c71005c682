"""The `jaxrl bench sample` workload with Hugging Face transformers on torch (CPU): a reference point.

    pip install torch transformers numpy        # a separate environment: this script needs neither jax nor jaxrl
    python benchmarks/sample_transformers.py [--prompts 8] [--prompt-len 64] [--group 8] [--new-tokens 128]
                                             [--repeats 3] [--seed 0] [--threads N]

Self-contained and not part of the test suite (the project's environment has no torch). The workload is the
one of `jaxrl bench sample` (`jaxrl/bench.py`): the `bench-small` shape as a `Qwen2ForCausalLM` (vocab 32000,
hidden 512, 8 layers, 8 query / 2 KV heads of 64, MLP 1408, RoPE theta 1e6, q/k/v biases, untied embeddings)
with random weights (`torch.manual_seed`), float32, eval mode, `torch.set_num_threads(os.cpu_count())`;
8 prompts of 64 random token ids (numpy `default_rng(seed)`, the same ids as jaxrl's benchmark), each repeated
8 times (`repeat_interleave`), `generate(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
max_new_tokens=128, min_new_tokens=128, eos_token_id=None)`: exactly 8 * 8 * 128 generated tokens per call.
One warm-up call, then `--repeats` timed calls (median). Time to first token: the same call with
`max_new_tokens=1` (after its own warm-up). Peak memory: the process's `ru_maxrss`. Prints one JSON line,
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

import numpy as np
import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

PAD_ID = 0


def bench_small_config() -> Qwen2Config:
    """`models.PRESETS["bench-small"]` as a transformers config."""
    return Qwen2Config(
        vocab_size=32_000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, intermediate_size=1408, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
        hidden_act="silu", tie_word_embeddings=False, use_sliding_window=False, torch_dtype="float32",
        bos_token_id=None, eos_token_id=None, pad_token_id=PAD_ID,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls after the warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all CPUs)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = bench_small_config()
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    parameters = sum(p.numel() for p in model.parameters())

    prompts = np.random.default_rng(args.seed).integers(0, config.vocab_size, (args.prompts, args.prompt_len),
                                                        dtype=np.int32)
    input_ids = torch.from_numpy(prompts.astype(np.int64)).repeat_interleave(args.group, 0)
    attention_mask = torch.ones_like(input_ids)
    sequences = args.prompts * args.group

    def generate(new_tokens: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=PAD_ID)

    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        out = generate(new_tokens)
        elapsed = time.perf_counter() - start
        if tuple(out.shape) != (sequences, args.prompt_len + new_tokens):
            sys.exit(f"generate returned {tuple(out.shape)}, expected ({sequences}, {args.prompt_len + new_tokens})")
        return elapsed

    first = timed(args.new_tokens)  # warm-up
    times = [timed(args.new_tokens) for _ in range(args.repeats)]
    call_s = statistics.median(times)
    timed(1)  # warm-up of the one-token call
    ttft_times = [timed(1) for _ in range(args.repeats)]
    ttft_s = statistics.median(ttft_times)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    generated = sequences * args.new_tokens
    result = {
        "benchmark": "sample_transformers",
        "model": "bench-small (Qwen2ForCausalLM)",
        "parameters": parameters,
        "dtype": "float32",
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "group": args.group,
        "sequences": sequences,
        "new_tokens": args.new_tokens,
        "generated_tokens": generated,
        "temperature": 1.0,
        "repeats": args.repeats,
        "seed": args.seed,
        "warmup_call_s": first,
        "call_s": call_s,
        "call_times_s": times,
        "tokens_per_s": generated / call_s,
        "ttft_s": ttft_s,
        "ttft_times_s": ttft_times,
        "peak_memory_bytes": maxrss if sys.platform == "darwin" else maxrss * 1024,
        "peak_memory_source": "host ru_maxrss",
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    print(json.dumps(result), flush=True)
    print()
    print("| implementation | sequences | new tokens | tokens/s | time per call | time to first token | peak memory |")
    print("|---|---|---|---|---|---|---|")
    print(f"| transformers {transformers.__version__} / torch {torch.__version__} ({result['attn_implementation']}) "
          f"| {sequences} | {args.new_tokens} | {result['tokens_per_s']:.1f} | {call_s:.3f} s | {ttft_s:.3f} s "
          f"| {result['peak_memory_bytes'] / 2**20:.0f} MiB (host ru_maxrss) |")
    print()
    print(f"{parameters / 1e6:.1f}M parameters, float32, {args.prompts} prompts x {args.group} samples, prompt "
          f"length {args.prompt_len}, {args.repeats} timed calls (median), {torch.get_num_threads()} threads "
          f"({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
