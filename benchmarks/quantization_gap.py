"""How far a quantized base moves the log-probs of sampled tokens, per weight format and per number of tokens.

    python benchmarks/quantization_gap.py [CHECKPOINT ...] [--prompts 8,128] [--group 2] [--prompt-len 6]
                                          [--new-tokens 16] [--schemes int8,gptq-int8,int4,gptq-int4,rtn9,rtn10,rtn12]

Default checkpoints: the tests' tiny Llama 3, Qwen2, Qwen3 and Gemma 3 (random weights). For each and each
`--prompts` count: random prompts of `--prompt-len` tokens, `--group` completions each of `--new-tokens` tokens
sampled at temperature 1 from the float32 base, each scored in its own context (`jaxrl.train.completion_logprobs`)
by the base and by the quantized base; reported: mean, 99th percentile and max of `|log p_q - log p|` in nats.

Schemes: `int8`, `int4`, `nf4` are QLoRA's bases (`models.lora.add_adapters`, qwix round-to-nearest: one scale per
output channel for int8, groups of inputs for 4 bits). `gptq-<type>` rounds the same format with GPTQ
(`qwix.contrib.gptq`: each projection's error compensated through the Hessian of its inputs, from `--calibration`
completions sampled from the base with other prompts). `rtn<b>` (fake quantization, not a storage format) rounds
each weight to a b-bit grid, one absmax scale per output channel, and computes in float32: how the gap falls per
bit. Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from qwix.contrib import gptq, gptq_core

from jaxrl import models
from jaxrl.models import lora
from jaxrl.models.transformer import positions_from_mask
from jaxrl.sampling import SamplingConfig, sample
from jaxrl.train import completion_logprobs

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "hf", "transformers5")
FAMILIES = ("llama3", "qwen2", "qwen3", "gemma3")
SCHEMES = ("int8", "gptq-int8", "int4", "gptq-int4", "rtn9", "rtn10", "rtn12")


def sampled(policy: models.Policy, prompts: int, group: int, prompt_len: int, new_tokens: int, seed: int):
    """Completions of random prompts sampled at temperature 1 from `policy` (no EOS: every token is sampled)."""
    tokens = jax.random.randint(jax.random.key(seed), (prompts, prompt_len), 0, policy.config.vocab_size)
    return sample(policy, tokens, jnp.ones(tokens.shape, bool), jax.random.key(seed + 1),
                  SamplingConfig(max_new_tokens=new_tokens, temperature=1.0), eos_id=-1, pad_id=0, group_size=group)


def input_hessians(policy: models.Policy, tokens: jax.Array) -> dict[str, jax.Array]:
    """`{projection path: X^T X / count [in, in]}` of each projection's inputs X over `tokens` `[B, T]` (qwix's
    GPTQ calibration)."""
    model = nnx.merge(policy.graphdef, policy.params)
    rules = [gptq.GptqRule(module_path=".*", weight_qtype="int8")]
    valid = jnp.ones(tokens.shape, bool)
    calibrating = qwix.quantize_model(model, gptq.GptqCalibrationProvider(rules), tokens, positions_from_mask(valid),
                                      valid)
    calibrating(tokens, positions_from_mask(valid), valid)
    stats = {tuple(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(nnx.state(calibrating))}
    return {"/".join(path[:-1]): value["sum_of_hessian"] / value["count"]
            for path, value in stats.items() if path[-1] == "weight_gptq"}


def gptq_rounded(quantized: models.Policy, base: models.Policy, hessians: dict[str, jax.Array]) -> models.Policy:
    """`quantized` (a QLoRA policy) with each projection's integers and scales rounded by GPTQ instead."""
    model = nnx.merge(quantized.graphdef, quantized.params, quantized.frozen)
    floats = nnx.merge(base.graphdef, base.params)
    for path in lora.projection_paths(base.config):
        weight = lora._module(model, path).weight
        how = dataclasses.replace(weight.how, channelwise_axes=[0])
        w = lora._module(floats, path).weight[...].astype(jnp.float32)
        rounded = _gptq(w, hessians[path].astype(jnp.float32), how)
        old = weight.array
        scale = rounded.scale.astype(old.scale.dtype).reshape(old.scale.shape)
        lora._module(model, path).weight = weight.replace(array=dataclasses.replace(old, qvalue=rounded.qvalue,
                                                                                    scale=scale))
    return quantized.replace(frozen=nnx.split(model, nnx.LoRAParam, ...)[2])


_GPTQ_PROGRAMS: dict[str, Any] = {}


def _gptq(w: jax.Array, hessian: jax.Array, how) -> Any:
    """qwix's GPTQ rounding of `w` `[out, in]` as one compiled program per format (op by op, its column loop takes
    a minute on the tiny checkpoints; `how` holds lists, so it cannot be a static argument)."""
    if repr(how) not in _GPTQ_PROGRAMS:
        _GPTQ_PROGRAMS[repr(how)] = jax.jit(lambda w, hessian: gptq_core.quantize_weight(w, hessian, how)[0])
    return _GPTQ_PROGRAMS[repr(how)](w, hessian)


def fake_quantized(base: models.Policy, bits: int) -> models.Policy:
    """`base` with every projection weight rounded to a `bits`-bit grid (absmax, one scale per output channel)."""
    model = nnx.merge(base.graphdef, base.params)
    top = 2 ** (bits - 1) - 1
    for path in lora.projection_paths(base.config):
        module = lora._module(model, path)
        w = np.asarray(module.weight[...], np.float64)
        scale = np.maximum(np.abs(w).max(axis=1, keepdims=True), 1e-30) / top
        module.weight = nnx.Param(jnp.asarray(np.round(w / scale) * scale, module.weight[...].dtype))
    return base.replace(params=nnx.split(model, nnx.Param)[1])


def scheme_policy(scheme: str, base: models.Policy, calibration: jax.Array | None) -> models.Policy:
    if scheme.startswith("rtn"):
        return fake_quantized(base, int(scheme[3:]))
    qtype = scheme.removeprefix("gptq-")
    quantized = lora.add_adapters(base, lora.LoraSpec(rank=4, alpha=8.0, quantize=qtype), seed=0)
    if scheme.startswith("gptq-"):
        quantized = gptq_rounded(quantized, base, input_hessians(base, calibration))
    return quantized


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="*", help="HF checkpoint directories (default: the four test fixtures)")
    parser.add_argument("--prompts", default="8", help="comma-separated prompt counts, one measurement each")
    parser.add_argument("--group", type=int, default=2, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--calibration", type=int, default=16, help="GPTQ: prompts (x 4 completions of 32 tokens)")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args(argv)
    checkpoints = args.checkpoints or [os.path.join(FIXTURES, name) for name in FAMILIES]
    schemes = args.schemes.split(",")
    unknown = [s for s in schemes if s.removeprefix("gptq-") not in lora.QUANTIZATIONS
               and not (s.startswith("rtn") and s[3:].isdigit())]
    if unknown:
        parser.error(f"--schemes: unknown {', '.join(unknown)} (known: {', '.join(SCHEMES)}, nf4, rtn<bits>)")
    logprobs = jax.jit(completion_logprobs)
    rows = []
    for checkpoint in checkpoints:
        base = models.from_pretrained(checkpoint, dtype="float32", progress=False)
        calibration = (sampled(base, args.calibration, 4, args.prompt_len, 32, args.seed + 1000).tokens
                       if any(s.startswith("gptq-") for s in schemes) else None)
        policies = {scheme: scheme_policy(scheme, base, calibration) for scheme in schemes}
        for prompts in map(int, args.prompts.split(",")):
            rollout = sampled(base, prompts, args.group, args.prompt_len, args.new_tokens, args.seed)
            exact, _ = logprobs(base, rollout.tokens, rollout.prompt_valid)
            for scheme, policy in policies.items():
                gap = np.abs(np.asarray(logprobs(policy, rollout.tokens, rollout.prompt_valid)[0] - exact)).ravel()
                rows.append({"checkpoint": os.path.basename(os.path.normpath(checkpoint)), "scheme": scheme,
                             "tokens": int(gap.size), "mean": float(gap.mean()),
                             "p99": float(np.quantile(gap, 0.99)), "max": float(gap.max())})
    result = {"benchmark": "quantization_gap", "new_tokens": args.new_tokens, "group": args.group,
              "prompt_len": args.prompt_len, "rows": rows, "jax_version": jax.__version__,
              "qwix_version": getattr(qwix, "__version__", None), "platform": jax.devices()[0].platform}
    print(json.dumps(result))
    print("\n| checkpoint | scheme | tokens | mean | p99 | max |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['checkpoint']} | {r['scheme']} | {r['tokens']} | {r['mean']:.4f} | {r['p99']:.3f} | "
              f"{r['max']:.3f} |")
    return result


if __name__ == "__main__":
    main()
