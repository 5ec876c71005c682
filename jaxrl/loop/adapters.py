"""LoRA in a run (`rl.lora`): the policy RL starts from becomes the frozen base of adapters (`models.lora`).

A fresh run adapts the warm-started policy and records which base it is (`lora_base.json`: its name and a
fingerprint of its weights). When that base exists only in this run (a warm start, or a random init), it is
saved once as an HF directory `<output_dir>/lora_base`, since the checkpoints hold only the adapters. A resumed
run loads the base again (from there, or from `pretrained.path`), refuses one whose fingerprint differs, and
adds the adapters that the checkpoint then restores. A run that quantizes its base (`rl.lora.quantize`) first
measures what that did to the policy RL starts from (`quantized_start`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl import models
from jaxrl.config import Config
from jaxrl.metrics import read_metrics
from jaxrl.models import lora, lora_export
from jaxrl.models.hf import CheckpointError
from jaxrl.policy_io import load_policy
from jaxrl.loop import held_out
from jaxrl.loop.generate import Generator
from jaxrl.loop.setup import hf_files
from jaxrl.train import completion_logprobs
from jaxrl.sharding import allgather, is_primary, wait_for_all_processes

log = logging.getLogger("jaxrl")

BASE_DIR = "lora_base"  # <output_dir>/lora_base: the base of a run whose base is not a file of its own
BASE_RECORD = lora.BASE_RECORD  # <output_dir>/lora_base.json: {"name", "fingerprint", "saved"}
QUANTIZED_PHASE = "lora"  # metrics.jsonl's record of what quantizing the base did (`quantized_start`)


def spec_of(config: Config) -> lora.LoraSpec:
    """The adapters `config.rl.lora` asks for."""
    return lora.LoraSpec.of(config.rl.lora)


def adapt(config: Config, base: models.Policy) -> models.Policy:
    """`base` with the adapters of `config.rl.lora` (initialised from `config.seed`), placed by its layout. A
    target pattern that matches nothing raises a `ValueError` naming `rl.lora.targets`."""
    try:
        adapted = lora.add_adapters(base, spec_of(config), config.seed)
    except ValueError as e:
        raise ValueError(f"rl.lora.targets: {e}") from None
    if base.layout is not None:
        adapted = models.shard(adapted, base.layout)
    trainable, frozen = lora.count(adapted.params), lora.count(base.params)
    log.info("LoRA rank %d (alpha %g) on %d projections: %d trainable parameters over a frozen base of %d%s",
             config.rl.lora.rank, config.rl.lora.alpha, len(lora.adapter_weights(adapted)), trainable, frozen,
             f" (stored as {config.rl.lora.quantize})" if config.rl.lora.quantize else "")
    return adapted


def base_name(config: Config) -> str:
    """How the run names its base: the pretrained checkpoint as loaded, or this run's saved copy."""
    if config.pretrained.path is not None and config.sft.steps == 0:
        return config.pretrained.path
    return os.path.join(config.output_dir, BASE_DIR)


def start(config: Config, base: models.Policy, base_files: str | None = None) -> models.Policy:
    """The adapted policy a fresh run trains. Records the base (`lora_base.json`) and, when it is not a file
    already, saves it to `<output_dir>/lora_base` (`base_files`: the HF directory whose tokenizer and config
    files go with it)."""
    name = base_name(config)
    saved = name == os.path.join(config.output_dir, BASE_DIR)
    record = {"name": name, "fingerprint": lora.fingerprint(base), "saved": saved}
    if saved:
        whole = base.replace(params=allgather(base.params), layout=None)
        if is_primary():
            models.save_pretrained(whole, name, base=base_files, progress=False)
    if is_primary():
        with open(os.path.join(config.output_dir, BASE_RECORD), "w") as f:
            json.dump(record, f, indent=2)
    wait_for_all_processes("jaxrl: LoRA base saved")
    return adapt(config, base)


def quantized_start(config: Config, base: models.Policy, adapted: models.Policy, generate: Generator, problems,
                    evaluator: held_out.Evaluator) -> dict[str, Any]:
    """What quantizing the base (`rl.lora.quantize`) did to the policy RL starts from (`adapted`, its adapters
    still zero), against the unquantized `base`: a metrics record with
      - the held-out greedy evaluation of `adapted` (`eval/...`, as RL step 0 records `base`'s);
      - `logprob_gap/{mean,p99,max}`: `|log p_adapted - log p_base|` in nats over the completion tokens that
        `base` samples with the run's sampling settings for the first `eval.batch_size` held-out problems (one
        completion each), scored at the sampling temperature; `logprob_gap/tokens` counts them.
    The largest gap grows with the number of tokens looked at; the mean does not (benchmarks/RESULTS.md)."""
    evaluation = held_out.evaluate(adapted, generate, problems, evaluator, batch_size=config.eval.batch_size,
                                   max_new_tokens=config.rl.sampling.max_new_tokens)
    _, _, mine, _ = next(held_out.process_batches(problems, config.eval.batch_size, generate.mesh))
    rollout = generate(base, mine, jax.random.key(config.seed), config.rl.sampling).rollout
    gap = _logprob_gap(base, adapted, rollout.tokens, rollout.prompt_valid, rollout.completion_mask,
                       config.rl.sampling.temperature)
    record = {**{k: v for k, v in evaluation.items() if k != "eval/sample"},
              **{k: v.item() for k, v in jax.device_get(gap).items()}}  # (floats, and the token count an int)
    log.info("the %s base: held-out greedy %s %.3f; sampled-token log-prob gap to the unquantized base: mean "
             "%.4f, p99 %.4f, max %.4f nats over %d tokens", config.rl.lora.quantize, evaluator.metric,
             record[evaluator.key], record["logprob_gap/mean"], record["logprob_gap/p99"],
             record["logprob_gap/max"], record["logprob_gap/tokens"])
    return record


@jax.jit
def _logprob_gap(base: models.Policy, adapted: models.Policy, tokens: jax.Array, prompt_valid: jax.Array,
                 mask: jax.Array, temperature: jax.Array) -> dict[str, jax.Array]:
    """Statistics of `|log p_adapted - log p_base|` `[B, N]` over the completion tokens `mask` `[B, N]` marks."""
    exact, _ = completion_logprobs(base, tokens, prompt_valid, temperature)
    moved, _ = completion_logprobs(adapted, tokens, prompt_valid, temperature)
    gap = jnp.where(mask, jnp.abs(moved - exact), jnp.nan)
    return {"logprob_gap/mean": jnp.nanmean(gap), "logprob_gap/p99": jnp.nanquantile(gap, 0.99),
            "logprob_gap/max": jnp.nanmax(gap), "logprob_gap/tokens": jnp.sum(mask)}


def recorded_quantized_start(metrics_path: str) -> dict[str, Any]:
    """The run's `quantized_start` record as `metrics.jsonl` holds it (for a resumed run's summary); `{}` when the
    run did not quantize its base."""
    for record in read_metrics(metrics_path, torn_tail_ok=True):
        if record.get("phase") == QUANTIZED_PHASE:
            return {k: v for k, v in record.items() if k not in ("phase", "step")}
    return {}


def summary_fields(record: dict[str, Any], evaluator: held_out.Evaluator) -> dict[str, Any]:
    """`summary.json`'s view of a `quantized_start` record: the quantized start's held-out metric and the
    log-prob gap (`{}` for a run without a quantized base)."""
    if not record:
        return {}
    gaps = {f"quantization_logprob_gap_{k.removeprefix('logprob_gap/')}": v for k, v in record.items()
            if k.startswith("logprob_gap/")}
    return {f"{evaluator.metric}_quantized_start": record[evaluator.key], **gaps}


def resume_base(config: Config, loaded: models.Policy) -> models.Policy:
    """The base a resumed LoRA run's adapters were trained on: `loaded` (the policy the config loads) or the copy
    the run saved, checked against the run's record. Raises `CheckpointError` when the record is missing or the
    base is another one."""
    path = os.path.join(config.output_dir, BASE_RECORD)
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"resume=true with rl.lora.enabled: cannot read {path}, the record of the base the "
                              f"adapters were trained on: {e}") from None
    name = base_name(config)
    if record["name"] != name:
        raise CheckpointError(f"resume=true: the run's adapters were trained on the base {record['name']!r} "
                              f"({path}), but the config's base is {name!r}; resume with the same base")
    base = loaded
    if record.get("saved"):
        base = _load_saved(name, loaded)
    found = lora.fingerprint(base)
    if found != record["fingerprint"]:
        raise CheckpointError(f"resume=true: the base {name!r} is not the one the run's adapters were trained on: "
                              f"its weights' fingerprint is {found}, the run recorded {record['fingerprint']} "
                              f"({path}); resume with the same base")
    return base


def _load_saved(directory: str, like: models.Policy) -> models.Policy:
    """The run's saved base, with `like`'s compute settings and placement."""
    try:
        base = load_policy(directory, layout=like.layout)
    except CheckpointError as e:
        raise CheckpointError(f"resume=true with rl.lora.enabled: cannot load the run's base {directory}: {e}") from None
    config = like.config
    base = models.replace_config(base, dtype=config.dtype, attention_impl=config.attention_impl, remat=config.remat)
    if base.config != config:
        raise CheckpointError(f"resume=true: the run's base {directory} has another model config than the config's "
                              f"policy: {base.config} vs {config}")
    return base


def export(config: Config, policy: models.Policy, progress: bool) -> None:
    """The trained adapters as a PEFT directory `<output_dir>/adapter` (for `pretrained.path`, the base they go
    on when the run did not warm-start), and merged into the base as an HF directory `<output_dir>/hf`."""
    whole = policy.replace(params=allgather(policy.params), frozen=allgather(policy.frozen), layout=None)
    if not is_primary():
        return
    spec, out = spec_of(config), config.output_dir
    base_files = hf_files(config.pretrained.path)
    lora_export.save_merged(whole, spec, os.path.join(out, "hf"), base=base_files, progress=progress)
    lora_export.save_peft(whole, spec, os.path.join(out, "adapter"),
                          base_model_name_or_path=os.path.abspath(base_name(config)))
