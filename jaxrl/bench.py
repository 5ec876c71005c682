"""Benchmarks: `jaxrl bench sample [options]`, the jitted sampler's throughput on a fixed workload, and
`jaxrl bench train [options]`, the RL train step's (`bench_train`; `--lengths ragged` draws long-tailed completion
lengths, `--packing on|off|compare` trains on packed or padded rows, `--lora RANK` times the same step with LoRA
adapters beside the full step, then both back to back: `compare_lora`).

    jaxrl bench sample [--model bench-small] [--prompts 8] [--prompt-len 64] [--group 8] [--new-tokens 128]
                       [--no-prefix-sharing | --compare | --compare-compaction] [--lengths fixed|ragged]
                       [--compaction on|off] [--decode-segments N] [--kv-cache compute|int8] [--repeats 3]

The workload: a policy with random weights (`--seed`), `prompts` prompts of `prompt_len` random token ids
(numpy, fixed seed), `group` samples of each (prompts * group sequences), exactly `new_tokens` new tokens per
sequence (EOS ignored), temperature 1, no top-k / top-p. With prefix sharing the sampler gets the P distinct
prompts and `group_size=G` (each prompt prefilled once); without it (the baseline) every prompt is repeated G
times and sampled with `group_size=1`. Prints one JSON line with every figure, then a markdown table.
`--compare` runs both modes, each in a fresh process (so peak memory and compile time are each run's own), and
reports the speedup. `--lengths ragged` stops row i at length `ragged_lengths(prompts * group, new_tokens, seed)[i]`
(a seeded log-normal: median 25% of `new_tokens`, 10% of the rows at it; the stop token is forced there) and
`--compare-compaction` runs the sampler with `SamplingConfig.compaction` off, then on, then both back to back
(`compare_compaction`) and reports the speedup in useful tokens/s (the tokens before each row's stop, over the time per call).
`benchmarks/sample_transformers.py` runs the same workload with Hugging Face transformers.

Module import is cheap (jax is imported inside the functions), so the CLI can build its parser from it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

PAD_ID = 0
NO_EOS = -1  # never sampled: every sequence runs to `new_tokens`
RAGGED_STOP_ID = 1  # the stop id a ragged workload forces at each row's drawn length


RAGGED_MEDIAN_FRACTION = 0.25  # median completion length / max_new_tokens
RAGGED_AT_BUDGET = 0.10  # fraction of completions that reach max_new_tokens


def ragged_lengths(count: int, max_new_tokens: int, seed: int = 0, median_fraction: float = RAGGED_MEDIAN_FRACTION,
                   at_budget: float = RAGGED_AT_BUDGET):
    """`[count]` int32 completion lengths in `[1, max_new_tokens]`, long-tailed as real RL completions are.

    `round(exp(z))` with `z ~ Normal(log(median_fraction * max_new_tokens), sigma)`, clipped to
    `[1, max_new_tokens]`, with `sigma = log(1 / median_fraction) / Phi^-1(1 - at_budget)` so that a fraction
    `at_budget` of the draws reach the budget (defaults: median 25% of the budget, 10% at it; sigma = 1.0817).
    Drawn with `numpy.random.default_rng(seed).standard_normal(count)`, so anyone can repeat them.
    """
    import math
    from statistics import NormalDist

    import numpy as np

    if not 0 < median_fraction < 1 or not 0 < at_budget < 0.5:
        raise ValueError(f"need 0 < median_fraction < 1 and 0 < at_budget < 0.5, got {median_fraction}, {at_budget}")
    sigma = math.log(1 / median_fraction) / NormalDist().inv_cdf(1 - at_budget)
    z = np.random.default_rng(seed).standard_normal(count)
    lengths = np.rint(np.exp(math.log(median_fraction * max_new_tokens) + sigma * z))
    return np.clip(lengths, 1, max_new_tokens).astype(np.int32)


def _model_config(model: Any, dtype: str | None = None):
    """`(name, models.ModelConfig)` of a preset name or a config; `dtype` (e.g. "bfloat16") stores and computes the
    weights in that dtype instead of the preset's."""
    import dataclasses

    from jaxrl import models
    if isinstance(model, models.ModelConfig):
        name, config = "custom", model
    elif model not in models.PRESETS:
        raise ValueError(f"unknown model preset {model!r}; choose from {sorted(models.PRESETS)}")
    else:
        name, config = model, models.PRESETS[model]
    if dtype is not None:
        config = dataclasses.replace(config, dtype=dtype, param_dtype=dtype)
    return name, config


def _peak_memory() -> tuple[int, str]:
    """Peak memory in bytes and where it comes from: the device allocator's peak if it reports one, else the
    process's peak resident set size (CPU)."""
    import jax

    device = jax.devices()[0]
    if device.platform != "cpu":
        try:
            stats = device.memory_stats() or {}
        except Exception:  # some backends do not implement memory_stats
            stats = {}
        if "peak_bytes_in_use" in stats:
            return int(stats["peak_bytes_in_use"]), "device peak_bytes_in_use"
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024), "host ru_maxrss"


def _timed(fn) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def bench_sample(model: Any = "bench-small", prompts: int = 8, prompt_len: int = 64, group: int = 8,
                 new_tokens: int = 128, temperature: float = 1.0, prefix_sharing: bool = True, repeats: int = 3,
                 seed: int = 0, decode_segments: int | None = None, kv_cache_dtype: str = "compute",
                 dtype: str | None = None, bandwidth: bool = False, lengths: str = "fixed",
                 compaction: bool | None = None, compaction_segments: int | None = None,
                 live_rows: int | None = None) -> dict:
    """Time `jaxrl.sampling.sample` on the workload of the module docstring; returns every figure.

    `model` is a preset name of `models.PRESETS` or a `models.ModelConfig`; `dtype` (e.g. "bfloat16") stores and
    computes the weights in that dtype instead of the preset's. Figures: `compile_s` (first call minus a steady
    call), `call_s` (median of `repeats` timed calls after the first), `tokens_per_s` (prompts * group *
    new_tokens / call_s), `ttft_s` (time to first token: median of `repeats` calls of the same workload with
    `new_tokens=1`, after their own warm-up call), `decode_step_s` ((call_s - ttft_s) / (new_tokens - 1)),
    `decode_bytes_per_step` (the fewest bytes one decode step must read: `decode_bytes_per_step`),
    `peak_memory_bytes`, the device and versions. `bandwidth` also measures the device's copy bandwidth
    (`copy_bandwidth`) and reports `memory_bound_fraction`: the time the step's bytes need at that bandwidth
    over the measured step time (1.0 = at the memory-bandwidth limit).

    `lengths="ragged"`: row i of the rollout stops at length `ragged_lengths(prompts * group, new_tokens,
    seed)[i]` (forced: `sample(forced_lengths=...)`, stop id `RAGGED_STOP_ID`) instead of running to
    `new_tokens`; the steps run are then the longest length, which `decode_step_s` divides by. Both workloads
    report `useful_tokens` (the tokens before and including each row's stop: the sum of the lengths) and
    `useful_tokens_per_s`. `compaction`, `compaction_segments` and `live_rows` set those `SamplingConfig` fields
    (None: the sampler's default).
    """
    import jax

    from jaxrl import models
    from jaxrl.sampling import SamplingConfig

    for name, value in (("prompts", prompts), ("prompt_len", prompt_len), ("group", group),
                        ("new_tokens", new_tokens), ("repeats", repeats)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    model_name, config = _model_config(model, dtype)
    shared = prefix_sharing
    overrides = {"kv_cache_dtype": kv_cache_dtype}
    if decode_segments is not None:
        overrides["decode_segments"] = decode_segments
    if compaction is not None:
        overrides["compaction"] = compaction
    if compaction_segments is not None:
        overrides["compaction_segments"] = compaction_segments
    if live_rows is not None:
        overrides["live_rows"] = live_rows
    if lengths not in ("fixed", "ragged"):
        raise ValueError(f"lengths must be 'fixed' or 'ragged', got {lengths!r}")
    sequences = prompts * group
    forced = ragged_lengths(sequences, new_tokens, seed) if lengths == "ragged" else None
    useful = int(forced.sum()) if forced is not None else sequences * new_tokens
    steps = int(forced.max()) if forced is not None else new_tokens
    policy, call = sample_workload(config, prompts, prompt_len, group, temperature, shared, seed,
                                   forced_lengths=forced, **overrides)

    jax.block_until_ready(policy.params)
    start = time.perf_counter()
    rollout = jax.block_until_ready(call(new_tokens))  # the first call: tracing + compilation + one run
    first = time.perf_counter() - start
    generated = int(rollout.completion_mask.sum())  # checked: the shapes and the token count the figures rest on
    if rollout.tokens.shape != (sequences, prompt_len + new_tokens) or generated != useful:
        raise RuntimeError(f"sampler returned tokens {rollout.tokens.shape} with {generated} generated tokens; "
                           f"expected ({sequences}, {prompt_len + new_tokens}) and {useful}")
    del rollout
    times = [_timed(lambda: call(new_tokens)) for _ in range(repeats)]
    call_s = statistics.median(times)
    _timed(lambda: call(1))  # warm-up (compile) of the one-token call
    ttft_times = [_timed(lambda: call(1)) for _ in range(repeats)]
    ttft_s = statistics.median(ttft_times)
    peak, peak_source = _peak_memory()
    device = jax.devices()[0]
    decode_step_s = (call_s - ttft_s) / (steps - 1) if steps > 1 else None
    step_bytes = decode_bytes_per_step(config, prompts, group, prompt_len, new_tokens, shared, kv_cache_dtype)
    copy_bytes_per_s = copy_bandwidth() if bandwidth else None
    bound_fraction = (step_bytes / copy_bytes_per_s / decode_step_s
                      if copy_bytes_per_s and decode_step_s and decode_step_s > 0 else None)
    return {
        "benchmark": "sample",
        "model": model_name,
        "parameters": models.num_parameters(config),
        "dtype": config.dtype,
        "prompts": prompts,
        "prompt_len": prompt_len,
        "group": group,
        "sequences": sequences,
        "new_tokens": new_tokens,
        "lengths": lengths,
        "length_distribution": (f"ragged_lengths(count={sequences}, max_new_tokens={new_tokens}, seed={seed}): "
                                f"log-normal, median {RAGGED_MEDIAN_FRACTION:.0%} of max_new_tokens, "
                                f"{RAGGED_AT_BUDGET:.0%} at it" if forced is not None else "fixed"),
        "steps": steps,
        "generated_tokens": generated,
        "useful_tokens": useful,
        "temperature": temperature,
        "prefix_sharing": shared,
        "decode_segments": SamplingConfig(**overrides).decode_segments,
        "compaction": SamplingConfig(**overrides).compaction,
        "compaction_segments": SamplingConfig(**overrides).compaction_segments,
        "live_rows": live_rows,
        "kv_cache_dtype": kv_cache_dtype,
        "repeats": repeats,
        "seed": seed,
        "compile_s": max(first - call_s, 0.0),
        "first_call_s": first,
        "call_s": call_s,
        "call_times_s": times,
        "tokens_per_s": generated / call_s,
        "useful_tokens_per_s": useful / call_s,
        "ttft_s": ttft_s,
        "ttft_times_s": ttft_times,
        "decode_step_s": decode_step_s,
        "decode_bytes_per_step": step_bytes,
        "copy_bytes_per_s": copy_bytes_per_s,
        "memory_bound_fraction": bound_fraction,
        "peak_memory_bytes": peak,
        "peak_memory_source": peak_source,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "jax_version": jax.__version__,
        "jaxlib_version": _jaxlib_version(),
    }


def sample_workload(config, prompts: int, prompt_len: int, group: int, temperature: float = 1.0,
                    prefix_sharing: bool = True, seed: int = 0, forced_lengths=None, **sampling_overrides):
    """The sampling workload of the module docstring for a `models.ModelConfig`: `(policy, call)` where
    `call(new_tokens)` samples `prompts * group` sequences of exactly `new_tokens` new tokens (a `Rollout`),
    or with `forced_lengths [prompts * group]` sequence i of `min(forced_lengths[i], new_tokens)` tokens.
    Extra keyword arguments are `SamplingConfig` fields (`kv_cache_dtype`, `decode_segments`, `compaction`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl import models
    from jaxrl.sampling import SamplingConfig, sample

    policy = models.init(config, seed)
    distinct = np.random.default_rng(seed).integers(0, config.vocab_size, (prompts, prompt_len), dtype=np.int32)
    rows = distinct if prefix_sharing else np.repeat(distinct, group, axis=0)  # row p * G + g: sample g of prompt p
    tokens = jnp.asarray(rows)
    valid = jnp.ones(rows.shape, bool)
    key = jax.random.key(seed)
    kwargs = {"group_size": group} if prefix_sharing else {}

    def call(new_tokens: int):
        sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=temperature, top_k=0, top_p=1.0,
                                  **sampling_overrides)
        if forced_lengths is None:
            return sample(policy, tokens, valid, key, sampling, eos_id=NO_EOS, pad_id=PAD_ID, **kwargs)
        return sample(policy, tokens, valid, key, sampling, eos_id=RAGGED_STOP_ID, pad_id=PAD_ID,
                      forced_lengths=np.minimum(forced_lengths, new_tokens), **kwargs)

    return policy, call


def decode_bytes_per_step(config, prompts: int, group: int, prompt_len: int, new_tokens: int, shared: bool,
                          kv_cache_dtype: str = "compute") -> int:
    """The fewest bytes one decode step of the workload must read from device memory, averaged over its steps.

    Every weight once (the input embedding table only through its `prompts * group` looked-up rows, unless
    tied to the unembedding, which reads it whole) plus every layer's cached keys and values: with prefix
    sharing each prompt's prefix once per group and each sequence's own completion; without it, each
    sequence's prompt and completion. A completion holds `new_tokens / 2` tokens on average over the steps.
    """
    import numpy as np

    from jaxrl import models
    sequences = prompts * group
    param_bytes = np.dtype(config.param_dtype).itemsize
    weights = models.num_parameters(config)
    if not config.tie_embeddings:
        weights -= config.vocab_size * config.hidden_size - sequences * config.hidden_size
    if kv_cache_dtype == "int8":  # int8 keys and values plus a float32 scale per slot and head
        slot = 2 * config.num_kv_heads * (config.head_dim + 4)
    else:
        slot = 2 * config.num_kv_heads * config.head_dim * np.dtype(config.dtype).itemsize
    prefix_tokens = (prompts if shared else sequences) * prompt_len
    cached_tokens = prefix_tokens + sequences * new_tokens / 2
    return int(weights * param_bytes + config.num_layers * slot * cached_tokens)


def copy_bandwidth(size_bytes: int = 2**30, repeats: int = 10) -> float:
    """The default device's memory bandwidth in bytes/s: a jitted elementwise copy of a `size_bytes` float32
    array (bytes read + bytes written over the median time of `repeats` calls after a warm-up)."""
    import jax
    import jax.numpy as jnp

    x = jnp.arange(size_bytes // 4, dtype=jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    jax.block_until_ready(copy(x))
    times = [_timed(lambda: copy(x)) for _ in range(repeats)]
    return 2 * x.nbytes / statistics.median(times)


def bench_train(model: Any = "bench-small", sequences: int = 64, prompt_len: int = 64, completion_len: int = 128,
                micro_batches: int = 1, repeats: int = 3, seed: int = 0, remat: str = "none",
                mesh: tuple[int, int, int] = (1, 1, 1), compute_dtype: str | None = None,
                peak_tflops: float | None = None, donate: bool = True, lengths: str = "fixed",
                packing: str = "off", row_tokens: int | None = None, buckets: int = 8,
                lora_rank: int | None = None, lora_alpha: float | None = None,
                lora_targets: tuple[str, ...] | None = None, quantize: str | None = None,
                more_steps: list | None = None, memory_only: bool = False) -> dict:
    """Time one RL optimizer step (`jaxrl.train.make_rl_step`) on a fixed workload; returns every figure.

    The workload (issue 7): `sequences` random sequences of `prompt_len` prompt + `completion_len` completion
    tokens; completion log-probs (`kernels.token_logprobs`); the token-level clipped policy loss (PPO clip
    0.2 on both sides, token-mean) with random per-sequence advantages and fixed old log-probs (the initial
    policy's); backward; global-norm clipping and AdamW. `tokens_per_s` is sequences * (prompt_len +
    completion_len) / the median of `repeats` steps after the first (compiling) one.

    `remat` (none / full / dots) sets `ModelConfig.remat`; `mesh` = (data, fsdp, tensor) places the policy and
    the batch by the default logical-axis rules (one size may be -1); `compute_dtype` runs the matmuls in
    that dtype over the preset's (float32) master weights. `model_tflops_per_s` counts 6 x (matmul parameters)
    per token plus the attention products; with `peak_tflops` (the devices' total peak in the compute dtype)
    the result includes `mfu`, the model FLOPs utilisation.

    `donate` (the training loop's setting) donates the state to the step. `step_memory_bytes` is the compiled
    step's own account of the memory it needs at once: its arguments, outputs and temporaries, less the outputs
    written over donated arguments (`memory_analysis()`; None where the backend gives none).

    `lengths="ragged"`: completion lengths drawn by `ragged_lengths(sequences, completion_len, seed)` (a
    log-normal with median 25% of `completion_len`, 10% at it); the tokens after each completion's end are
    padding (`PAD_ID`) and out of the loss mask, as the sampler leaves them. `packing="on"` trains on packed
    rows (`jaxrl.packing.plan_packing` with `row_tokens` (default: the padded row's `prompt_len +
    completion_len - 1`) and `buckets`, one plan per step, its host time counted in the step time);
    `micro_batches` then sets the token budget of a micro-batch, `sequences / micro_batches` padded rows' worth.
    `useful_tokens_per_s` counts the completion tokens trained (the sum of the lengths) per second.

    `lora_rank`: the policy gets LoRA adapters first (`models.lora.add_adapters`; `lora_alpha`, default 2 x rank;
    `lora_targets`, default every projection; `quantize`: the frozen base in int8 / int4 / nf4, QLoRA), so the
    step trains and keeps Adam's moments for the adapters alone; the frozen base is part of the state the step
    takes. Each call's output state is the next call's input, so a donated base passes through the step (its
    output written over its input) and is counted once; the base is checked unchanged after the timed steps.
    `more_steps`: a list that gets a callable running one more step of this benchmark and returning its seconds
    (`compare_lora` interleaves two benchmarks' steps with it).

    `memory_only`: compile the step and return its `memory_analysis()` figures without running it (the old
    log-probs are zeros, not the policy's: the compiled program depends on their shape alone); the figures
    that need the step to run are then None.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl import models
    from jaxrl import losses
    from jaxrl.train import completion_logprobs, init_train_state, make_optimizer, make_rl_step

    for name, value in (("sequences", sequences), ("prompt_len", prompt_len), ("completion_len", completion_len),
                        ("micro_batches", micro_batches), ("repeats", repeats)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if sequences % micro_batches:
        raise ValueError(f"sequences ({sequences}) must be divisible by micro_batches ({micro_batches})")
    if lengths not in ("fixed", "ragged"):
        raise ValueError(f"lengths must be 'fixed' or 'ragged', got {lengths!r}")
    if packing not in ("off", "on"):
        raise ValueError(f"packing must be 'off' or 'on', got {packing!r}")
    if peak_tflops is not None and not 0 < peak_tflops < float("inf"):  # else MFU divides by 0, or is NaN
        raise ValueError(f"peak_tflops must be a positive number, got {peak_tflops}")
    import dataclasses

    from jaxrl.packing import place_plan, plan_packing
    from jaxrl.sharding import data_parallel_size, make_mesh, shard_batch

    model_name, config = _model_config(model)
    config = dataclasses.replace(config, remat=remat, dtype=compute_dtype or config.dtype)
    layout = models.Layout(make_mesh(*mesh))
    policy = models.init(config, seed)
    lora = None
    if lora_rank is not None:
        policy, lora = _adapted(policy, lora_rank, lora_alpha, lora_targets, quantize, seed)
    elif quantize is not None or lora_alpha is not None or lora_targets is not None:
        raise ValueError("quantize, lora_alpha and lora_targets need lora_rank (the adapters' rank)")
    policy = models.shard(policy, layout)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, (sequences, prompt_len + completion_len))
    completion_lengths = np.full(sequences, completion_len, np.int32)
    if lengths == "ragged":
        completion_lengths = ragged_lengths(sequences, completion_len, seed)
    loss_mask = np.arange(completion_len)[None] < completion_lengths[:, None]
    tokens[:, prompt_len:][~loss_mask] = PAD_ID
    tokens = jnp.asarray(tokens, jnp.int32)
    prompt_valid = jnp.ones((sequences, prompt_len), bool)
    if memory_only:
        shape = jax.eval_shape(completion_logprobs, policy, tokens, prompt_valid)[0]
        old_logp = jnp.zeros(shape.shape, shape.dtype)
    else:
        old_logp, _ = jax.jit(completion_logprobs)(policy, tokens, prompt_valid)
    advantages = np.repeat(rng.standard_normal((sequences, 1)).astype(np.float32), completion_len, axis=1)
    batch = {"tokens": tokens, "prompt_valid": prompt_valid, "old_logp": old_logp,
             "advantages": jnp.asarray(advantages * loss_mask), "loss_mask": jnp.asarray(loss_mask)}
    batch = shard_batch(jax.device_get(batch), layout.mesh)
    host_prompt_valid, host_mask = np.asarray(prompt_valid), loss_mask
    shards = data_parallel_size(layout.mesh)

    def with_plan(batch):  # the host's planning, part of each packed step as in the training loop
        if packing == "off":
            return batch
        plan = plan_packing(host_prompt_valid, host_mask, row_tokens=row_tokens, shards=shards, buckets=buckets,
                            micro_rows=None if micro_batches == 1 else sequences // (micro_batches * shards),
                            row_field="--row-tokens")
        return {**batch, "plan": place_plan(plan, batch["tokens"])}
    optimizer = make_optimizer(learning_rate=1e-5)
    loss = losses.policy_term("ppo_clip", ratio="token", aggregation="token-mean", eps_low=0.2, eps_high=0.2)
    step = make_rl_step(optimizer, loss, micro_batches=micro_batches if packing == "off" else 1, donate=donate)
    controls = losses.Controls(entropy_coef=jnp.float32(0.0), temperature=jnp.float32(1.0))
    state = jax.block_until_ready(init_train_state(policy, optimizer))
    base_sum = None if lora is None else _tree_sum(state.policy.frozen)
    del policy  # with donation the step deletes the arrays the policy shares with the state

    start = time.perf_counter()
    planned = with_plan(batch)
    step = step.lower(state, planned, controls).compile()  # compiled once: timed, and its memory read below
    memory = step.memory_analysis()
    useful_tokens = int(completion_lengths.sum())
    described = {  # the workload and the compiled step: known before the step runs
        "benchmark": "train", "model": model_name, "parameters": models.num_parameters(config),
        "dtype": config.dtype, "param_dtype": config.param_dtype, "remat": remat,
        "mesh": list(layout.mesh.shape.values()), "sequences": sequences, "prompt_len": prompt_len,
        "completion_len": completion_len,
        "micro_batches": micro_batches, "repeats": repeats, "seed": seed, "lengths": lengths, "packing": packing,
        "useful_tokens": useful_tokens, "buckets": buckets, "donate": donate, "lora": lora,
        "packed_rows": None if packing == "off" else list(planned["plan"].gather.shape),
        "trainable_parameters": sum(int(x.size) for x in jax.tree.leaves(state.policy.params)),
        **_compiled_memory(memory), **_machine(),
    }
    if memory_only:  # every figure that needs the step to run is None
        return {**described, "memory_only": True, "compile_s": time.perf_counter() - start, "first_step_s": None,
                "step_s": None, "step_times_s": [], "tokens_per_s": None, "model_tflops_per_s": None,
                "useful_tokens_per_s": None, "mfu": None, "peak_memory_bytes": None, "peak_memory_source": None}
    state, metrics = jax.block_until_ready(step(state, planned, controls))
    first = time.perf_counter() - start
    if not np.isfinite(float(metrics["policy_loss"])):
        raise RuntimeError(f"the benchmark step's loss is not finite: {float(metrics['policy_loss'])}")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = jax.block_until_ready(step(state, with_plan(batch), controls))
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    if lora is not None and _tree_sum(state.policy.frozen) != base_sum:
        raise RuntimeError("the frozen base changed during the LoRA benchmark's steps")
    if more_steps is not None:
        carried = {"state": state}

        def one_more() -> float:
            begin = time.perf_counter()
            carried["state"], _ = jax.block_until_ready(step(carried["state"], with_plan(batch), controls))
            return time.perf_counter() - begin
        more_steps.append(one_more)
    peak, peak_source = _peak_memory()
    tokens_per_s = sequences * (prompt_len + completion_len) / step_s
    model_tflops = train_flops_per_token(config, prompt_len + completion_len) * tokens_per_s / 1e12
    return {
        **described, "compile_s": max(first - step_s, 0.0), "first_step_s": first, "step_s": step_s,
        "step_times_s": times, "tokens_per_s": tokens_per_s, "model_tflops_per_s": model_tflops,
        "useful_tokens_per_s": useful_tokens / step_s,
        "mfu": None if peak_tflops is None else model_tflops / peak_tflops,
        "peak_memory_bytes": peak, "peak_memory_source": peak_source,
    }


def _compiled_memory(memory) -> dict:
    """A compiled step's `memory_analysis()` figures in bytes (None without one): its arguments, outputs,
    temporaries, the outputs written over donated arguments (alias), and the step's total
    (arguments + outputs + temporaries - alias)."""
    figures = {f"{part}_bytes": None if memory is None else getattr(memory, f"{part}_size_in_bytes")
               for part in ("argument", "output", "alias", "temp")}
    figures["step_memory_bytes"] = None if memory is None else (
        figures["argument_bytes"] + figures["output_bytes"] + figures["temp_bytes"] - figures["alias_bytes"])
    return figures


def _machine() -> dict:
    """The device and versions a benchmark ran on."""
    import jax

    device = jax.devices()[0]
    return {"platform": device.platform, "device_kind": device.device_kind, "device_count": jax.device_count(),
            "cpu_count": os.cpu_count(), "machine": platform.machine(), "jax_version": jax.__version__,
            "jaxlib_version": _jaxlib_version()}


def _adapted(policy, rank: int, alpha: float | None, targets: tuple[str, ...] | None, quantize: str | None,
             seed: int):
    """`(adapted policy, description)`: `policy` with LoRA adapters (`models.lora.add_adapters`)."""
    import jax

    from jaxrl.models.lora import PROJECTIONS, LoraSpec, add_adapters
    spec = LoraSpec(rank=rank, alpha=float(2 * rank if alpha is None else alpha),
                    targets=tuple(targets) if targets else PROJECTIONS, quantize=quantize)
    adapted = add_adapters(policy, spec, seed)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(adapted.frozen))
    return adapted, {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets), "quantize": quantize,
                     "frozen_bytes": int(nbytes)}


def _tree_sum(tree) -> float:
    """A float64 checksum of every array of `tree` (a quantized base's integer values included)."""
    import jax
    import numpy as np

    return float(sum(np.asarray(x, np.float64).sum() for x in jax.tree.leaves(tree)))


def compare_lora(lora_rank: int, lora_alpha: float | None = None, lora_targets: tuple[str, ...] | None = None,
                 quantize: str | None = None, **kwargs) -> dict:
    """`bench_train(**kwargs)` of the full step, then of the same step with LoRA adapters (`lora_rank`, ...), in
    this process; `step_memory_ratio` is the LoRA step's `step_memory_bytes` over the full step's (each its own
    compiled program's `memory_analysis()`), `speedup_tokens_per_s` the LoRA step's tokens/s over the full's.
    Then `repeats` rounds of one full step and one LoRA step back to back, so that both see the same machine
    load: `interleaved_step_s` (full, LoRA) pairs and `speedup_interleaved`, the median of full / LoRA step
    time over the rounds. The host peak memory is the process's so far: the LoRA figure also covers the full
    step run before it. With `memory_only=True` both steps are compiled and not run: the speed figures are
    None and `interleaved_step_s` is empty."""
    from jaxrl.models.lora import PROJECTIONS, LoraSpec, target_paths
    spec = LoraSpec(rank=lora_rank, alpha=1.0, targets=tuple(lora_targets) if lora_targets else PROJECTIONS,
                    quantize=quantize)  # bad settings fail here, before the full step runs
    target_paths(_model_config(kwargs.get("model", "bench-small"))[1], spec.targets)
    steps: list = []
    full = bench_train(**kwargs, more_steps=steps)
    lora = bench_train(**kwargs, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=lora_targets,
                       quantize=quantize, more_steps=steps)
    ratio = (lora["step_memory_bytes"] / full["step_memory_bytes"]
             if lora["step_memory_bytes"] and full["step_memory_bytes"] else None)
    if kwargs.get("memory_only"):  # compiled, not run: nothing to time
        return {"benchmark": "train_lora", "full": full, "lora": lora, "step_memory_ratio": ratio,
                "speedup_tokens_per_s": None, "interleaved_step_s": [], "speedup_interleaved": None}
    full_step, lora_step = steps
    pairs = [(full_step(), lora_step()) for _ in range(kwargs.get("repeats", 3))]
    return {"benchmark": "train_lora", "full": full, "lora": lora, "step_memory_ratio": ratio,
            "speedup_tokens_per_s": lora["tokens_per_s"] / full["tokens_per_s"], "interleaved_step_s": pairs,
            "speedup_interleaved": statistics.median(a / b for a, b in pairs)}


def train_flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward): 6 x the parameters of every matmul
    (projections, MLP, output head; not the embedding lookup) + the attention products, 6 x 2 x layers x
    heads x head_dim x seq_len (causal: half of the full QK^T and PV products). Rematerialised work is not
    counted: MFU counts the model's FLOPs, not the hardware's."""
    c = config
    attention = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    matmul_params = c.num_layers * (attention + mlp) + c.vocab_size * c.hidden_size
    return 6 * matmul_params + 6 * 2 * c.num_layers * c.num_heads * c.head_dim * seq_len / 2


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "--preset", dest="model", default="bench-small",
                        help="model preset (default: bench-small)")
    parser.add_argument("--sequences", type=int, default=64, help="sequences per step (default: 64)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per sequence (default: 64)")
    parser.add_argument("--completion-len", type=int, default=128,
                        help="completion tokens per sequence (default: 128)")
    parser.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation (default: 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after the warm-up (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="weights and data seed (default: 0)")
    parser.add_argument("--remat", choices=("none", "full", "dots"), default="none",
                        help="rematerialisation of each block (default: none)")
    parser.add_argument("--mesh", default="1,1,1", help="data,fsdp,tensor mesh sizes; one may be -1 (default: 1,1,1)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="compute dtype over float32 master weights (default: the preset's)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the devices' total peak TFLOP/s in the compute dtype: report MFU")
    parser.add_argument("--no-donate", action="store_true",
                        help="keep the input state alive through the step (the training loop donates it)")
    parser.add_argument("--lengths", choices=("fixed", "ragged"), default="fixed",
                        help="completion lengths: all --completion-len, or long-tailed (ragged_lengths: log-normal, "
                             "median 25%% of --completion-len, 10%% at it; seeded by --seed) (default: fixed)")
    parser.add_argument("--packing", choices=("off", "on", "compare"), default="off",
                        help="padded rows, packed rows (jaxrl.packing), or both in this process and their ratio "
                             "(default: off)")
    parser.add_argument("--row-tokens", type=int, default=None,
                        help="packed row length (default: prompt-len + completion-len - 1)")
    parser.add_argument("--buckets", type=int, default=8, help="static packed row counts (default: 8)")
    parser.add_argument("--lora", type=int, default=None, metavar="RANK",
                        help="also time the step with LoRA adapters of this rank (models.lora; only the adapters "
                             "trained, Adam's state theirs alone, the base frozen), after the full step in the same "
                             "process, then --repeats rounds of one step of each back to back; reports both and the "
                             "LoRA step's compiled memory over the full step's")
    parser.add_argument("--lora-alpha", type=float, default=None,
                        help="the adapters' alpha: their output is scaled by alpha / rank (default: 2 x rank)")
    parser.add_argument("--lora-targets", nargs="+", default=None, metavar="PATTERN",
                        help="projections to adapt, by name (q_proj k_proj v_proj o_proj gate_proj up_proj "
                             "down_proj) or regular expression over their paths (default: all of them)")
    parser.add_argument("--quantize", choices=("int8", "int4", "nf4"), default=None,
                        help="with --lora: the frozen base's projections stored in this type (QLoRA; qwix)")
    parser.add_argument("--memory-only", action="store_true",
                        help="compile the step(s) and report their compiled memory (memory_analysis) without "
                             "running or timing them")


def run_train(args: argparse.Namespace) -> int:
    """Handler of `jaxrl bench train`: one JSON line, then a markdown table. Bad arguments -> exit 2."""
    try:
        try:
            mesh = tuple(int(size) for size in args.mesh.split(","))
        except ValueError:
            mesh = ()
        if len(mesh) != 3:
            raise ValueError(f"--mesh {args.mesh!r}: expected three sizes data,fsdp,tensor, e.g. 1,-1,1")
        kwargs = dict(model=args.model, sequences=args.sequences, prompt_len=args.prompt_len,
                      completion_len=args.completion_len, micro_batches=args.micro_batches,
                      repeats=args.repeats, seed=args.seed, remat=args.remat, mesh=mesh,
                      compute_dtype=args.dtype, peak_tflops=args.peak_tflops, donate=not args.no_donate,
                      lengths=args.lengths, row_tokens=args.row_tokens, buckets=args.buckets,
                      memory_only=args.memory_only)
        if args.lora is None and (args.quantize or args.lora_targets or args.lora_alpha is not None):
            raise ValueError("--quantize, --lora-targets and --lora-alpha need --lora RANK")
        if args.lora is not None:
            if args.packing == "compare":
                raise ValueError("--lora compares the full step with the LoRA step; use --packing on or off with it")
            comparison = compare_lora(args.lora, lora_alpha=args.lora_alpha, lora_targets=args.lora_targets,
                                      quantize=args.quantize, packing=args.packing, **kwargs)
            results = [comparison["full"], comparison["lora"]]
        else:
            modes = ("off", "on") if args.packing == "compare" else (args.packing,)
            results = [bench_train(**kwargs, packing=mode) for mode in modes]
    except (ValueError, RuntimeError) as e:
        print(f"jaxrl: bench error: {e}", file=sys.stderr)
        return 2
    if args.memory_only:
        print(json.dumps(comparison if args.lora is not None else
                         {"benchmark": "train_memory", "results": results} if len(results) == 2 else results[0]),
              flush=True)
        print()
        print(memory_table(results, comparison["step_memory_ratio"] if args.lora is not None else None))
        return 0
    if args.lora is not None:
        print(json.dumps(comparison), flush=True)
        print()
        print(lora_table(comparison))
        return 0
    if len(results) == 2:
        padded, packed = results
        speedup = packed["useful_tokens_per_s"] / padded["useful_tokens_per_s"]
        print(json.dumps({"benchmark": "train_compare", "padded": padded, "packed": packed,
                          "speedup_useful_tokens_per_s": speedup}), flush=True)
    else:
        print(json.dumps(results[0]), flush=True)
    r = results[0]
    print()
    print("| model | rows | sequences x tokens | useful tokens/s | training tokens/s | step time | compile "
          "| peak memory |\n|---|---|---|---|---|---|---|---|")
    for r in results:
        rows = "padded" if r["packing"] == "off" else "packed {} x {}".format(*r["packed_rows"])
        print(f"| {r['model']} ({r['parameters'] / 1e6:.1f}M, {r['dtype']}, remat {r['remat']}, mesh "
              f"{'x'.join(map(str, r['mesh']))}) | {rows} | {r['sequences']} x ({r['prompt_len']} + "
              f"{r['completion_len']} {r['lengths']}) | {r['useful_tokens_per_s']:.1f} | {r['tokens_per_s']:.1f} "
              f"| {r['step_s']:.3f} s | {r['compile_s']:.2f} s | {_gib(r['peak_memory_bytes'])} "
              f"({r['peak_memory_source']}) |")
    print()
    if len(results) == 2:
        print(f"packed / padded useful tokens/s: {speedup:.2f}x "
              f"({results[0]['useful_tokens']} completion tokens per step; both modes in this process, peak memory "
              "is the process's so far)")
    mfu = "" if r["mfu"] is None else f", MFU {100 * r['mfu']:.1f}%"
    print(f"model FLOPs (padded rows' count): {r['model_tflops_per_s']:.3f} TFLOP/s{mfu}")
    if r["step_memory_bytes"] is not None:
        print(f"the compiled step needs {_gib(r['step_memory_bytes'])} at once (state "
              f"{'donated' if r['donate'] else 'not donated'})")
    print(f"token-level clipped policy loss (clip 0.2, token-mean), AdamW; median of {r['repeats']} steps after a "
          f"warm-up; device {r['platform']} / {r['device_kind']} ({r['cpu_count']} CPUs), jax {r['jax_version']}")
    return 0


def _step_kind(r: dict) -> str:
    lora = r["lora"]
    if lora is None:
        return "full fine-tune"
    base = f"{lora['quantize']} base (QLoRA)" if lora["quantize"] else "base as loaded"
    from jaxrl.models.lora import PROJECTIONS
    targets = "all projections" if tuple(lora["targets"]) == PROJECTIONS else ", ".join(lora["targets"])
    return f"LoRA rank {lora['rank']} (alpha {lora['alpha']:g}) on {targets}, {base}"


def _workload(r: dict) -> str:
    """The model and workload of a `bench_train` result, in words (the tables' footnotes)."""
    return (f"model {r['model']} ({r['parameters'] / 1e6:.1f}M, {r['dtype']}, remat {r['remat']}), "
            f"{r['sequences']} x ({r['prompt_len']} + {r['completion_len']} {r['lengths']}) tokens, "
            f"{r['micro_batches']} micro-batch(es), state {'donated' if r['donate'] else 'not donated'}")


def memory_table(results: list[dict], ratio: float | None = None) -> str:
    """Markdown table of `bench_train(memory_only=True)` results: each compiled step's `memory_analysis()`;
    `ratio`: the second step's compiled memory over the first's (`compare_lora`), printed below."""
    lines = ["| step | trained parameters | compiled step memory | arguments | outputs | aliased | temporaries "
             "| compile |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        cells = [("-" if r[key] is None else _gib(r[key]))
                 for key in ("step_memory_bytes", "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")]
        kind = _step_kind(r) + ("" if r["packing"] == "off" else ", packed rows")
        lines.append(f"| {kind} | {r['trainable_parameters'] / 1e6:.2f}M | " + " | ".join(cells)
                     + f" | {r['compile_s']:.2f} s |")
    r = results[0]
    lines.append("")
    if ratio is not None:
        lines.append(f"LoRA / full compiled step memory: {100 * ratio:.1f}%")
    lines.append(f"{_workload(r)}; compiled, not run; compiled step memory = arguments + outputs + temporaries - "
                 f"outputs written over donated arguments; device {r['platform']} / {r['device_kind']}, "
                 f"jax {r['jax_version']}")
    return "\n".join(lines)


def lora_table(comparison: dict) -> str:
    """Markdown table of `compare_lora`'s result: each step's compiled memory (`memory_analysis()`) and speed."""
    lines = ["| step | trained parameters | frozen base | compiled step memory | arguments | temporaries "
             "| training tokens/s | step time | compile |", "|---|---|---|---|---|---|---|---|---|"]
    for r in (comparison["full"], comparison["lora"]):
        memory = "-" if r["step_memory_bytes"] is None else _gib(r["step_memory_bytes"])
        arguments = "-" if r["argument_bytes"] is None else _gib(r["argument_bytes"])
        temps = "-" if r["temp_bytes"] is None else _gib(r["temp_bytes"])
        frozen = "-" if r["lora"] is None else _gib(r["lora"]["frozen_bytes"])
        lines.append(f"| {_step_kind(r)} | {r['trainable_parameters'] / 1e6:.2f}M | {frozen} | {memory} | {arguments} "
                     f"| {temps} | {r['tokens_per_s']:.1f} | {r['step_s']:.3f} s | {r['compile_s']:.2f} s |")
    r = comparison["full"]
    ratio = comparison["step_memory_ratio"]
    lines.append("")
    pairs = ", ".join(f"{a:.2f} s / {b:.2f} s" for a, b in comparison["interleaved_step_s"])
    lines.append(("LoRA / full compiled step memory: " + ("-" if ratio is None else f"{100 * ratio:.1f}%")
                  + f"; LoRA / full training tokens/s: {comparison['speedup_interleaved']:.2f}x (median over "
                  f"{len(comparison['interleaved_step_s'])} back-to-back rounds, step time full / LoRA: {pairs}; "
                  f"separate runs above: {comparison['speedup_tokens_per_s']:.2f}x)"))
    lines.append(f"{_workload(r)}; "
                 f"compiled step memory = arguments + outputs + temporaries - outputs written over donated "
                 f"arguments; median of {r['repeats']} steps after a warm-up; device {r['platform']} / "
                 f"{r['device_kind']} ({r['cpu_count']} CPUs), jax {r['jax_version']}")
    return "\n".join(lines)


def _jaxlib_version() -> str | None:
    try:
        import jaxlib

        return jaxlib.__version__
    except Exception:
        return None


_CHILD = ("import json, sys\nfrom jaxrl.bench import bench_sample\n"
          "print(json.dumps(bench_sample(**json.loads(sys.argv[1]))), flush=True)")


def _bench_in_fresh_process(**kwargs) -> dict:
    """`bench_sample(**kwargs)` in a new Python process: its own compile cache and its own peak memory."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(kwargs)], stdout=subprocess.PIPE, text=True,
                            env=env, check=False)
    if result.returncode:
        raise RuntimeError(f"benchmark process failed (exit {result.returncode})")
    return json.loads(result.stdout.strip().splitlines()[-1])


def compare_sample(isolate: bool = True, **kwargs) -> dict:
    """Both modes (prefix sharing, then the repeated-prompt baseline) and the speedup of sharing.

    `isolate` runs each mode in a fresh process; otherwise both run here (the host peak memory is then the
    process's peak so far, i.e. the baseline's figure also covers the first run).
    """
    kwargs.pop("prefix_sharing", None)
    run = _bench_in_fresh_process if isolate else bench_sample
    shared = run(**kwargs, prefix_sharing=True)
    baseline = run(**kwargs, prefix_sharing=False)
    return {
        "benchmark": "sample_compare",
        "prefix_sharing": shared,
        "baseline": baseline,
        "speedup_tokens_per_s": shared["tokens_per_s"] / baseline["tokens_per_s"],
        "speedup_ttft": baseline["ttft_s"] / shared["ttft_s"],
        "peak_memory_ratio": shared["peak_memory_bytes"] / baseline["peak_memory_bytes"],
    }


def compare_compaction(rounds: int = 3, **kwargs) -> dict:
    """The same workload with `SamplingConfig.compaction` off (one jitted decode that stops only when every row
    has finished) and on (finished rows dropped between segments), in this process: each mode's figures
    (`bench_sample`, off first), then `rounds` rounds of one timed call of each mode back to back, so that both
    see the same machine load. `speedup_useful_tokens_per_s` is the median over the rounds of the off call's
    time over the on call's (the same tokens in both)."""
    import jax

    kwargs.pop("compaction", None)
    off = bench_sample(**kwargs, compaction=False)
    on = bench_sample(**kwargs, compaction=True)
    calls = {}
    for mode in (False, True):  # the programs bench_sample compiled: nothing compiles here
        model_name, config = _model_config(kwargs.get("model", "bench-small"), kwargs.get("dtype"))
        new_tokens, seed = kwargs.get("new_tokens", 128), kwargs.get("seed", 0)
        sequences = kwargs.get("prompts", 8) * kwargs.get("group", 8)
        forced = ragged_lengths(sequences, new_tokens, seed) if kwargs.get("lengths") == "ragged" else None
        overrides = {"kv_cache_dtype": kwargs.get("kv_cache_dtype", "compute"), "compaction": mode}
        for name in ("decode_segments", "compaction_segments"):
            if kwargs.get(name) is not None:
                overrides[name] = kwargs[name]
        policy, call = sample_workload(config, kwargs.get("prompts", 8), kwargs.get("prompt_len", 64),
                                       kwargs.get("group", 8), kwargs.get("temperature", 1.0),
                                       kwargs.get("prefix_sharing", True), seed, forced_lengths=forced, **overrides)
        jax.block_until_ready(policy.params)
        calls[mode] = (lambda call=call: call(new_tokens))
    pairs = [(_timed(calls[False]), _timed(calls[True])) for _ in range(rounds)]
    return {
        "benchmark": "sample_compaction",
        "compaction_off": off,
        "compaction_on": on,
        "interleaved_call_s": pairs,
        "speedup_useful_tokens_per_s": statistics.median(a / b for a, b in pairs),
        "speedup_separate_runs": on["useful_tokens_per_s"] / off["useful_tokens_per_s"],
    }


def compare_refill(live_rows: int, rounds: int = 2, model: Any = "bench-small", prompts: int = 32,
                   prompt_len: int = 64, group: int = 8, new_tokens: int = 512, temperature: float = 1.0,
                   seed: int = 0, lengths: str = "ragged", compaction_segments: int | None = None,
                   dtype: str | None = None, kv_cache_dtype: str = "compute") -> dict:
    """`prompts * group` rows (ragged lengths by default) sampled with at most `live_rows` rows decoding at once,
    three ways, in this process: today's single program (`compaction` off) and the compacted decode each run
    the rows as consecutive calls of `live_rows` rows (`live_rows / group` prompts per call, in order), and the
    refilled decode (`SamplingConfig.live_rows`) runs them as one call whose finished slots take the waiting
    rows. Every mode does the same useful work (each row stops at the same forced length). Each mode runs once
    to compile, then `rounds` rounds of one timed pass of each mode back to back, so that all three see the same
    machine load. Speedups: medians over the rounds of the ratio of pass times."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl import models
    from jaxrl.sampling import SamplingConfig, sample

    if live_rows < group or live_rows % group:
        raise ValueError(f"live_rows must be a positive multiple of group={group}, got {live_rows}")
    if prompts * group <= live_rows:
        raise ValueError(f"prompts * group = {prompts * group} rows must exceed live_rows={live_rows}: nothing waits")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    model_name, config = _model_config(model, dtype)
    sequences = prompts * group
    forced = (ragged_lengths(sequences, new_tokens, seed) if lengths == "ragged"
              else np.full(sequences, new_tokens, np.int32))
    policy = models.init(config, seed)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, config.vocab_size, (prompts, prompt_len),
                                                              dtype=np.int32))
    valid = jnp.ones(tokens.shape, bool)
    key = jax.random.key(seed)
    base = dict(max_new_tokens=new_tokens, temperature=temperature, top_k=0, top_p=1.0,
                kv_cache_dtype=kv_cache_dtype)
    if compaction_segments is not None:
        base["compaction_segments"] = compaction_segments
    per_call = live_rows // group

    def chunked(compaction: bool):
        settings = SamplingConfig(**base, compaction=compaction)

        def run():
            return [sample(policy, tokens[p:p + per_call], valid[p:p + per_call], key, settings, RAGGED_STOP_ID,
                           PAD_ID, group_size=group, forced_lengths=forced[p * group:(p + per_call) * group])
                    for p in range(0, prompts, per_call)]
        return run

    def refilled():
        return [sample(policy, tokens, valid, key, SamplingConfig(**base, live_rows=live_rows), RAGGED_STOP_ID,
                       PAD_ID, group_size=group, forced_lengths=forced)]

    modes = {"single_program": chunked(False), "compaction": chunked(True), "refill": refilled}
    first = {}
    for name, run in modes.items():
        start = time.perf_counter()
        rollouts = jax.block_until_ready(run())
        first[name] = time.perf_counter() - start
        generated = sum(int(r.completion_mask.sum()) for r in rollouts)
        if generated != int(forced.sum()):
            raise RuntimeError(f"{name}: {generated} generated tokens, expected {int(forced.sum())}")
    times = {name: [] for name in modes}
    for _ in range(rounds):
        for name, run in modes.items():
            times[name].append(_timed(run))
    useful = int(forced.sum())
    device = jax.devices()[0]
    return {
        "benchmark": "sample_refill",
        "model": model_name,
        "parameters": models.num_parameters(config),
        "dtype": config.dtype,
        "prompts": prompts,
        "prompt_len": prompt_len,
        "group": group,
        "sequences": sequences,
        "live_rows": live_rows,
        "new_tokens": new_tokens,
        "lengths": lengths,
        "length_distribution": (f"ragged_lengths(count={sequences}, max_new_tokens={new_tokens}, seed={seed})"
                                if lengths == "ragged" else "fixed"),
        "useful_tokens": useful,
        "first_pass_s": first,
        "pass_times_s": times,
        "useful_tokens_per_s": {name: useful / statistics.median(t) for name, t in times.items()},
        "speedup_vs_single_program": statistics.median(a / b for a, b in zip(times["single_program"],
                                                                              times["refill"])),
        "speedup_vs_compaction": statistics.median(a / b for a, b in zip(times["compaction"], times["refill"])),
        "platform": device.platform,
        "device_kind": device.device_kind,
        "cpu_count": os.cpu_count(),
        "jax_version": jax.__version__,
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def markdown_table(results: list[dict]) -> str:
    header = ("| mode | sequences | new tokens | useful tokens/s | tokens/s | time per call | time per step "
              "| time to first token | compile | peak memory |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [header]
    for r in results:
        if r["prefix_sharing"]:
            mode = f"prefix sharing ({r['prompts']} prompts x {r['group']})"
        else:
            mode = f"repeated prompts ({r['prompts']} x {r['group']})"
        mode += f", {r['lengths']} lengths, compaction {'on' if r['compaction'] else 'off'}"
        step = f"{1e3 * r['decode_step_s']:.2f} ms" if r["decode_step_s"] is not None else "-"
        lines.append(f"| {mode} | {r['sequences']} | {r['new_tokens']} | {r['useful_tokens_per_s']:.1f} "
                     f"| {r['tokens_per_s']:.1f} | {r['call_s']:.3f} s | {step} | {r['ttft_s']:.3f} s "
                     f"| {r['compile_s']:.2f} s "
                     f"| {_gib(r['peak_memory_bytes'])} ({r['peak_memory_source']}) |")
    return "\n".join(lines)


def refill_table(r: dict) -> str:
    """Markdown table of `compare_refill`'s result, with the workload in a line below."""
    lines = ["| mode | time per pass (median) | useful tokens/s | refill's speedup |", "|---|---|---|---|"]
    labels = {"single_program": f"single program, calls of {r['live_rows']} rows",
              "compaction": f"compaction, calls of {r['live_rows']} rows",
              "refill": f"refill, one call, {r['live_rows']} rows at once"}
    speedups = {"single_program": f"x{r['speedup_vs_single_program']:.2f}",
                "compaction": f"x{r['speedup_vs_compaction']:.2f}", "refill": "-"}
    for name, label in labels.items():
        lines.append(f"| {label} | {statistics.median(r['pass_times_s'][name]):.2f} s "
                     f"| {r['useful_tokens_per_s'][name]:.1f} | {speedups[name]} |")
    lines.append("")
    lines.append(f"{r['sequences']} rows ({r['prompts']} prompts x {r['group']}), prompt {r['prompt_len']}, "
                 f"{r['lengths']} lengths to {r['new_tokens']} ({r['length_distribution']}), model {r['model']} "
                 f"({r['parameters'] / 1e6:.1f}M, {r['dtype']}), {len(r['pass_times_s']['refill'])} rounds; "
                 f"device {r['platform']} / {r['device_kind']} ({r['cpu_count']} CPUs), jax {r['jax_version']}")
    return "\n".join(lines)


def _describe(r: dict) -> str:
    return (f"model {r['model']} ({r['parameters'] / 1e6:.1f}M parameters, {r['dtype']}), prompt length "
            f"{r['prompt_len']}, temperature {r['temperature']}, KV cache {r['kv_cache_dtype']}, "
            f"{r['decode_segments']} decode segments ({r['compaction_segments']} with compaction), "
            f"{r['repeats']} timed calls (median); "
            f"lengths {r['length_distribution']}; "
            f"device {r['platform']} / {r['device_kind']} ({r['cpu_count']} CPUs), jax {r['jax_version']}")


def add_sample_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bench-small",
                        help="model preset of models.PRESETS (random weights; default: bench-small)")
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts P (default: 8)")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default: 64)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt G (default: 8)")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens per sample (default: 128)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--no-prefix-sharing", action="store_true",
                       help="baseline: repeat every prompt G times, group_size=1")
    modes.add_argument("--compare", action="store_true",
                       help="run with and without prefix sharing (each in a fresh process), report the speedup")
    modes.add_argument("--compare-refill", action="store_true",
                       help="sample prompts x group rows with at most --live-rows decoding at once: the single "
                            "program and compaction in calls of --live-rows rows against one refilled call "
                            "(SamplingConfig.live_rows); --repeats rounds back to back (compare_refill)")
    modes.add_argument("--compare-compaction", action="store_true",
                       help="run with SamplingConfig.compaction off, then on, then 3 rounds of one call of each "
                            "back to back; report the speedup in useful tokens/s (median over the rounds)")
    parser.add_argument("--lengths", choices=("fixed", "ragged"), default="fixed",
                        help="fixed: every row runs to --new-tokens; ragged: row i stops at its length of "
                             "bench.ragged_lengths(prompts * group, new_tokens, seed), log-normal with median 25%% "
                             "of --new-tokens, 10%% at it (forced stop; default: fixed)")
    parser.add_argument("--compaction", choices=("on", "off"), default=None,
                        help="SamplingConfig.compaction: drop finished rows between decode segments "
                             "(default: the sampler's default)")
    parser.add_argument("--live-rows", type=int, default=None,
                        help="SamplingConfig.live_rows: decode at most this many rows at once, refilling finished "
                             "rows' slots with waiting rows (default: the whole batch at once)")
    parser.add_argument("--compaction-segments", type=int, default=None,
                        help="SamplingConfig.compaction_segments (default: the sampler's default)")
    parser.add_argument("--decode-segments", type=int, default=None,
                        help="SamplingConfig.decode_segments (default: the sampler's default)")
    parser.add_argument("--kv-cache", choices=("compute", "int8"), default="compute",
                        help="SamplingConfig.kv_cache_dtype (default: compute)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls after the warm-up (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling seed (default: 0)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="weights and compute dtype (default: the preset's)")
    parser.add_argument("--bandwidth", action="store_true",
                        help="measure the device's copy bandwidth and report the decode step's fraction of the "
                             "memory-bandwidth bound")


def run_sample(args: argparse.Namespace) -> int:
    """Handler of `jaxrl bench sample`: one JSON line, then a markdown table. Bad arguments -> exit 2."""
    from jaxrl import models
    if args.model not in models.PRESETS:
        print(f"jaxrl: bench error: unknown model {args.model!r}; choose from {sorted(models.PRESETS)}",
              file=sys.stderr)
        return 2
    kwargs = dict(model=args.model, prompts=args.prompts, prompt_len=args.prompt_len, group=args.group,
                  new_tokens=args.new_tokens, temperature=args.temperature, repeats=args.repeats, seed=args.seed,
                  decode_segments=args.decode_segments, kv_cache_dtype=args.kv_cache, dtype=args.dtype,
                  bandwidth=args.bandwidth, lengths=args.lengths,
                  compaction=None if args.compaction is None else args.compaction == "on",
                  compaction_segments=args.compaction_segments)
    if args.compare_refill:
        if args.live_rows is None:
            print("jaxrl: bench error: --compare-refill needs --live-rows", file=sys.stderr)
            return 2
        try:
            result = compare_refill(args.live_rows, rounds=args.repeats, model=args.model, prompts=args.prompts,
                                    prompt_len=args.prompt_len, group=args.group, new_tokens=args.new_tokens,
                                    temperature=args.temperature, seed=args.seed, lengths=args.lengths,
                                    compaction_segments=args.compaction_segments, dtype=args.dtype,
                                    kv_cache_dtype=args.kv_cache)
        except (ValueError, RuntimeError) as e:
            print(f"jaxrl: bench error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(result), flush=True)
        print()
        print(refill_table(result))
        return 0
    if args.live_rows is not None:
        kwargs["live_rows"] = args.live_rows
    try:
        if args.compare_compaction:
            result = compare_compaction(**kwargs)
            rows = [result["compaction_off"], result["compaction_on"]]
        elif args.compare:
            result = compare_sample(**kwargs)
            rows = [result["prefix_sharing"], result["baseline"]]
        else:
            result = bench_sample(**kwargs, prefix_sharing=not args.no_prefix_sharing)
            rows = [result]
    except (ValueError, RuntimeError) as e:
        print(f"jaxrl: bench error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    print()
    print(markdown_table(rows))
    print()
    print(_describe(rows[0]))
    for r in rows:
        if r["memory_bound_fraction"] is not None:
            print(f"decode step {1e3 * r['decode_step_s']:.2f} ms reads >= {r['decode_bytes_per_step'] / 1e9:.3f} GB; "
                  f"at the measured copy bandwidth {r['copy_bytes_per_s'] / 1e9:.0f} GB/s that is "
                  f"{100 * r['memory_bound_fraction']:.0f}% of the memory-bandwidth bound"
                  f" ({'prefix sharing' if r['prefix_sharing'] else 'repeated prompts'})")
    if args.compare_compaction:
        pairs = ", ".join(f"{a:.2f} s / {b:.2f} s" for a, b in result["interleaved_call_s"])
        print(f"compaction on vs off: useful tokens/s x{result['speedup_useful_tokens_per_s']:.2f} (median over "
              f"{len(result['interleaved_call_s'])} back-to-back rounds, time per call off / on: {pairs}; "
              f"separate runs above: x{result['speedup_separate_runs']:.2f})")
    if args.compare:
        print(f"prefix sharing vs repeated prompts: tokens/s x{result['speedup_tokens_per_s']:.2f}, "
              f"time to first token x{result['speedup_ttft']:.2f}, peak memory x{result['peak_memory_ratio']:.2f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrl bench", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="benchmark", required=True)
    sample = commands.add_parser("sample", help="sampler throughput, time to first token, memory")
    add_sample_arguments(sample)
    sample.set_defaults(handler=run_sample)
    train = commands.add_parser("train", help="RL train-step throughput, compile time, memory")
    add_train_arguments(train)
    train.set_defaults(handler=run_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`main(["sample", "--prompts", "2", ...])`: the same as `jaxrl bench sample --prompts 2 ...`."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
