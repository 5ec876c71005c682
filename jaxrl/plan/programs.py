"""The programs one RL step of a recipe runs, as the real jitted functions with abstract, sharded inputs.

Nothing here allocates device memory or reads a checkpoint: parameters, optimizer state, caches and batches
are `jax.ShapeDtypeStruct`s carrying the `NamedSharding` the run would give them, so the same programs can be
compiled for an unattached TPU topology (`jaxrl.plan`) or filled with random arrays and run on the devices at
hand (`benchmarks/plan_check.py`).

One RL step (`jaxrl.loop`) runs, on the recipe's real shapes:
- the sampler (`jaxrl.sampling._sample`), planned as its two parts: `prefill` (the distinct prompts into
  their cache, through the self-attention kernel) and `decode_step` (one new token of every sequence against
  the longest cache, counted `max_new_tokens` times); with `whole_sampler` also `sample`, the sampler itself
  (its decode loop unrolled per segment: the slowest program to compile, and XLA's cost analysis counts a
  loop body once, so its time is not taken from it);
- `logprobs`: the sampling-time policy's log-probs of the rollout (and the reference's, with a KL term);
- `values`: the critic's values of the rollout, with a critic;
- `train_step`: one optimizer step on a mini-batch (`epochs x minibatches` per RL step), gradients
  accumulated over `micro_batches`;
- `eval_decode_step`: the held-out evaluation's decode step (every `eval.every` steps, not in the step itself),
  when its cache is larger than the rollout's.

With `rl.lora.enabled` every program runs the adapted policy (`models.lora.add_adapters` traced with
`jax.eval_shape`, so nothing is allocated): `policy` is then the adapters, `frozen_base` the base (its
projections in `rl.lora.quantize`'s type for QLoRA), `optimizer` the adapters' Adam state, and there is no
`reference` copy: the reference is the same base with the adapters off (`models.lora.adapters_off`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl import models
from jaxrl import losses
from jaxrl.config import Config
from jaxrl.sampling import (SamplingConfig, _sample, decode_segments, gathered_weights, sampling_dtype,
                            sampling_layout)
from jaxrl.sharding import BATCH_AXES, data_parallel_size, rules_from
from jaxrl.train import (Critic, TrainState, by_micro_batches, completion_logprobs, critic_values, make_optimizer,
                         make_rl_step, opt_state_shardings)
from jaxrl.models.configs import ModelConfig
from jaxrl.models.transformer import GroupKVCache, KVCache

PAD_ID = 0
EOS_ID = 1  # any id inside the vocabulary: programs do not depend on its value


@dataclasses.dataclass(frozen=True)
class Program:
    """One jitted program and the abstract arguments it is called with.

    `calls_per_step`: how often one RL step calls it (0: not part of the step, e.g. the evaluation);
    `resident_elsewhere`: names of the `StepPrograms.resident` trees that stay in device memory while it runs
    without being its arguments (their bytes add to its peak); `model_flops`: the model's own matmul FLOPs of
    one call, over all chips (`2 x params x tokens` forward, 3x that with the backward pass, plus attention),
    for the MFU; `timed`: whether its compiled cost is one phase of the step's time (the whole sampler is
    not: `prefill` and `decode_step x decode_steps` stand for it).
    """

    name: str
    fn: Callable
    args: tuple
    calls_per_step: float
    resident_elsewhere: tuple[str, ...] = ()
    model_flops: float = 0.0
    timed: bool = True
    repeats: int = 1  # times the compiled cost counts per call (decode_step: one per new token)
    note: str = ""

    def lower(self):
        return self.fn.lower(*self.args)


@dataclasses.dataclass(frozen=True)
class StepPrograms:
    """The programs of one RL step and the state that stays in device memory between them."""

    model: ModelConfig
    layout: models.Layout
    programs: tuple[Program, ...]
    resident: dict[str, Any]  # name -> pytree of sharded ShapeDtypeStructs
    shapes: dict[str, int]  # prompts, group, sequences, prompt_len, new_tokens, minibatch rows, ...


def abstract(tree: Any, shardings: Any) -> Any:
    """`tree`'s arrays (or ShapeDtypeStructs) as ShapeDtypeStructs placed by `shardings` (a matching tree)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def model_config(config: Config) -> ModelConfig:
    """The policy's `ModelConfig` as the run would build it: `config.model` without a checkpoint; with one,
    the checkpoint's own config.json when it is on this machine, else the `plan.model` preset standing in for
    it; with `pretrained.dtype`, `compute_dtype`, `attention_impl` and `remat` applied as the loader does."""
    pretrained = config.pretrained
    if pretrained.path is None:
        return config.model
    path = os.path.expanduser(pretrained.path)
    if os.path.isfile(os.path.join(path, "config.json")):
        loaded = models.load_config(path)
    elif config.plan.model is not None:
        if config.plan.model not in models.PRESETS:
            raise ValueError(f"plan.model {config.plan.model!r} is not a model preset; choose from "
                             f"{', '.join(sorted(models.PRESETS))}")
        loaded = models.PRESETS[config.plan.model]
    else:
        raise ValueError(f"pretrained.path {pretrained.path} is not on this machine: set plan.model to the "
                         f"preset of its shape ({', '.join(sorted(models.PRESETS))})")
    param_dtype = pretrained.dtype or loaded.param_dtype
    compute = pretrained.compute_dtype or pretrained.dtype or loaded.dtype
    return dataclasses.replace(loaded, param_dtype=param_dtype, dtype=compute,
                               attention_impl=pretrained.attention_impl, remat=pretrained.remat)


def _replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _rows(mesh, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    """A `[rows, ...]` batch array split over the data-parallel axes, as `jaxrl.sharding.shard_batch` places it."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(BATCH_AXES)))


def _scalar(mesh, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((), dtype, sharding=_replicated(mesh))


def _key(mesh) -> jax.ShapeDtypeStruct:
    key = jax.eval_shape(lambda: jax.random.key(0))
    return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=_replicated(mesh))


def abstract_policy(model: ModelConfig, layout: models.Layout, lora=None) -> models.Policy:
    """The policy with sharded ShapeDtypeStruct parameters, placed as `models.shard` would place them. With a
    `models.lora.LoraSpec`: the adapted policy (adapters in `params`, the base in `frozen`), its shapes found by
    tracing `add_adapters` on an abstract policy."""
    layout = layout.for_model(model)
    if lora is None:
        policy = models.abstract(model)
    else:
        from jaxrl.models.lora import add_adapters
        policy = jax.eval_shape(lambda: add_adapters(models.init(model, 0), lora, 0))
        policy = policy.replace(frozen=abstract(policy.frozen, layout.param_shardings(policy.frozen)))
    return policy.replace(params=abstract(policy.params, layout.param_shardings(policy.params)), layout=layout)


def lora_spec(config: Config):
    """`models.lora.LoraSpec` of `rl.lora`, or None when LoRA is off."""
    lora = config.rl.lora
    if not lora.enabled:
        return None
    from jaxrl.models.lora import LoraSpec
    return LoraSpec.of(lora)


def _critic(policy: models.Policy) -> Critic:
    """`jaxrl.train.init_critic`'s structure: a copy of the policy's trunk and a float32 value head."""
    head = {"kernel": jax.ShapeDtypeStruct((policy.config.hidden_size,), jnp.float32),
            "bias": jax.ShapeDtypeStruct((), jnp.float32)}
    head = abstract(head, jax.tree.map(lambda _: policy.layout.replicated(), head))
    return Critic(policy.graphdef, policy.config, {"trunk": policy.params, "head": head}, policy.layout)


def _opt_state(optimizer, params, layout: models.Layout):
    return abstract(jax.eval_shape(optimizer.init, params), opt_state_shardings(layout, optimizer, params))


def _forward_flops(model: ModelConfig, tokens: int, context: float, unembedded: int | None = None) -> float:
    """Matmul FLOPs of a forward pass over `tokens` tokens, each attending to `context` keys on average:
    `2 x non-embedding parameters x tokens`, the attention scores and values, and the output head for
    `unembedded` of the tokens (default all; the embedding lookup is no matmul)."""
    d, layers = model.hidden_size, model.num_layers
    dense = models.num_parameters(model) - model.vocab_size * d * (1 if model.tie_embeddings else 2)
    attention = 4 * layers * model.num_heads * model.head_dim * context
    head = 2 * model.vocab_size * d * (tokens if unembedded is None else unembedded)
    return tokens * (2 * dense + attention) + head


def step_programs(config: Config, layout: models.Layout, model: ModelConfig | None = None,
                  prompt_len: int | None = None, whole_sampler: bool = False) -> StepPrograms:
    """Every program of one RL step of `config` on `layout` (mesh + rules), with abstract inputs.

    `model` defaults to `model_config(config)`, `prompt_len` (the padded prompt length: the data's largest
    bucket) to `config.plan.prompt_len`. `whole_sampler`: also the sampler as one program (`sample`).
    """
    model = model or model_config(config)
    model.validate()
    prompt_len = prompt_len or config.plan.prompt_len
    rl, loss_config = config.rl, config.rl.loss
    mesh = layout.mesh
    layout = layout.for_model(model)
    lora = lora_spec(config)
    policy = abstract_policy(model, layout, lora)
    parallel = data_parallel_size(mesh)

    prompts, group, new = rl.prompts_per_step, rl.group_size, config.completion_tokens  # an episode: env.max_tokens
    sequences = prompts * group
    # Prompts that do not split over the data-parallel devices are repeated, one sample each (`Generator`).
    sampled_prompts, sampled_group = (prompts, group) if prompts % parallel == 0 else (sequences, 1)
    minibatch = sequences // rl.minibatches
    shapes = dict(prompts=prompts, group=group, sequences=sequences, prompt_len=prompt_len, new_tokens=new,
                  minibatch=minibatch, micro_batch=minibatch // rl.micro_batches, data_parallel=parallel,
                  sampled_prompts=sampled_prompts)
    for name, rows in (("rl.prompts_per_step x rl.group_size", sequences),
                       ("the micro-batch (rows / (rl.minibatches x rl.micro_batches))", minibatch // rl.micro_batches),
                       ("eval.batch_size", config.eval.batch_size)):
        if rows % parallel:
            raise ValueError(f"{name} = {rows} rows do not split over the data-parallel size {parallel} (mesh "
                             f"data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']})")

    optimizer = make_optimizer(**dataclasses.asdict(rl.optim))
    resident: dict[str, Any] = {"policy": policy.params, "optimizer": _opt_state(optimizer, policy.params, layout)}
    if lora is not None:
        resident["frozen_base"] = policy.frozen
    critic = critic_optimizer = None
    if rl.critic.model != "none":
        trunk = policy if rl.critic.model == "policy_copy" else abstract_policy(_critic_model(config), layout)
        critic = _critic(trunk)
        critic_optimizer = make_optimizer(**dataclasses.asdict(rl.critic.optim))
        resident["critic"] = critic.params
        resident["critic_optimizer"] = _opt_state(critic_optimizer, critic.params, layout)
    full_kl = loss_config.needs_full_kl
    keep_ref = loss_config.needs_ref_logp or full_kl
    ref_policy = None
    if keep_ref and lora is None:  # the frozen warm-start policy, in arrays of its own (`copy_arrays`)
        ref_policy = policy
        resident["reference"] = policy.params
    state = TrainState(policy=policy, opt_state=resident["optimizer"], step=_scalar(mesh, jnp.int32),
                       critic=critic, critic_opt_state=resident.get("critic_optimizer"))
    everything = tuple(resident)

    def others(*used: str) -> tuple[str, ...]:
        if "policy" in used:  # the adapted policy's programs take its base as an argument
            used = used + ("frozen_base",)
        return tuple(name for name in everything if name not in used)

    temperature = _scalar(mesh)
    programs = []
    total_len = prompt_len + new

    # -- the sampler, whole (what runs), and its prefill and one decode step (what its time is made of)
    sampler = _sampler(rl.sampling, sampled_group)
    prompt_tokens = _rows(mesh, (sampled_prompts, prompt_len), jnp.int32)
    prompt_valid = _rows(mesh, (sampled_prompts, prompt_len), jnp.bool_)
    if whole_sampler:
        programs.append(Program("sample", _Lowerable(sampler),
                                (policy, prompt_tokens, prompt_valid, _key(mesh), temperature),
                                calls_per_step=1, resident_elsewhere=others("policy"), timed=False,
                                note=f"{sampled_prompts} prompts x {sampled_group} samples, {new} new tokens"))
    programs.append(_prefill(policy, rl.sampling, prompt_tokens, prompt_valid, others("policy")))
    decoding, beside = _decoding_policy(policy, rl.sampling), others("policy")
    if decoding is not policy:  # the decode loop reads a gathered copy of the weights, the policy's stay beside
        beside = tuple(name for name in everything if name != "frozen_base")  # (a base is read as it is)
    programs.append(_decode_step(decoding, rl.sampling, sampled_prompts, sampled_group, prompt_len, new, mesh,
                                 beside))

    # -- log-probs (and values) of the rollout under the sampling-time models
    tokens = _rows(mesh, (sequences, total_len), jnp.int32)
    valid = _rows(mesh, (sequences, prompt_len), jnp.bool_)
    logprob_flops = _forward_flops(model, sequences * total_len, total_len / 2)
    programs.append(Program("logprobs", jax.jit(by_micro_batches(completion_logprobs, rl.micro_batches)),
                            (policy, tokens, valid, temperature),
                            calls_per_step=1 + keep_ref, resident_elsewhere=others("policy"),
                            model_flops=logprob_flops,
                            note=f"{_logprob_models(keep_ref, lora)}, {_micro(rl.micro_batches)}"))
    if critic is not None:
        programs.append(Program("values", jax.jit(by_micro_batches(critic_values, rl.micro_batches)),
                                (critic, tokens, valid), calls_per_step=1,
                                resident_elsewhere=others("critic"), model_flops=logprob_flops))

    # -- the optimizer step on one mini-batch
    objective = losses.build_loss(loss_config, with_critic=critic is not None)
    step = make_rl_step(optimizer, objective, micro_batches=rl.micro_batches,
                        norm_length=loss_config.norm_length or new, critic_optimizer=critic_optimizer,
                        full_kl=full_kl, donate=not rl.staleness)
    batch = _train_batch(config, mesh, minibatch, prompt_len, new, critic is not None)
    controls = jax.tree.map(lambda x: _scalar(mesh, x.dtype),
                            losses.Controls.initial(loss_config, rl.sampling.temperature))
    train_args = (state, batch, controls, ref_policy if full_kl else None)
    if full_kl and lora is not None:  # the reference is the state's own base with the adapters off, not a copy
        step = _with_base_reference(step, donate=not rl.staleness)
        train_args = train_args[:3]
    used = ("policy", "optimizer", "critic", "critic_optimizer") + (("reference",) if full_kl else ())
    train_flops = 3 * _forward_flops(model, minibatch * total_len, total_len / 2) * (1 + (critic is not None))
    if full_kl:
        train_flops += _forward_flops(model, minibatch * total_len, total_len / 2)
    if model.remat == "full":
        train_flops *= 4 / 3  # the forward pass again in the backward
    programs.append(Program("train_step", step, train_args, calls_per_step=rl.epochs * rl.minibatches,
                            resident_elsewhere=others(*used), model_flops=train_flops,
                            note=f"{minibatch} rows in {_micro(rl.micro_batches)}"))

    # -- the held-out evaluation (not part of the step): its decode step when its cache is the larger. ReMax's
    # greedy baseline samples the step's prompts once each: smaller than the rollout.
    eval_rows = config.eval.batch_size
    if eval_rows * total_len > sampled_prompts * prompt_len + sequences * new:
        greedy = dataclasses.replace(rl.sampling, temperature=0.0)
        programs.append(dataclasses.replace(
            _decode_step(decoding, greedy, eval_rows, 1, prompt_len, new, mesh, beside),
            name="eval_decode_step", calls_per_step=0, timed=False, note=f"{eval_rows} prompts, greedy"))
    return StepPrograms(model, layout, tuple(programs), resident, shapes)


def _logprob_models(keep_ref: bool, lora) -> str:
    if not keep_ref:
        return "policy"
    return "policy and reference (adapters off)" if lora is not None else "policy and reference"


def _with_base_reference(step: Callable, donate: bool) -> Callable:
    """`step(state, batch, controls)` of an adapted policy whose exact-KL reference is its own base with the
    adapters off (`models.lora.adapters_off`): one base in memory, not a second argument."""
    from jaxrl.models.lora import adapters_off

    def run(state, batch, controls):
        return step(state, batch, controls, adapters_off(state.policy))
    return jax.jit(run, donate_argnames=("state",) if donate else ())


def _micro(count: int) -> str:
    return f"{count} micro-batch{'es' if count > 1 else ''}"


def _sampler(sampling: SamplingConfig, group_size: int) -> Callable:
    """`lower(policy, prompt_tokens, prompt_valid, rng, temperature)` of the jitted sampler with its static
    settings bound."""
    def lower(policy, prompt_tokens, prompt_valid, rng, temperature):
        return _sample.lower(policy, prompt_tokens, prompt_valid, rng, sampling, EOS_ID, PAD_ID, temperature,
                             group_size=group_size)
    return lower


class _Lowerable:
    """A `lower(*args)` callable dressed as a jitted function (the sampler's static arguments bound)."""

    def __init__(self, lower: Callable):
        self._lower = lower

    def lower(self, *args):
        return self._lower(*args)


def _critic_model(config: Config) -> ModelConfig:
    path = os.path.expanduser(config.rl.critic.checkpoint)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"rl.critic.checkpoint {config.rl.critic.checkpoint} is not on this machine: the plan "
                         "needs its config.json for the critic's shape")
    return models.load_config(path)


def _decoding_policy(policy: models.Policy, sampling: SamplingConfig) -> models.Policy:
    """The policy the decode loop reads: with `gather_weights`, the weights gathered over `fsdp` as
    `jaxrl.sampling.gathered_weights` gives them (abstract), else the policy itself."""
    gathered = sampling_layout(policy.layout) if sampling.gather_weights else None
    if gathered is None:
        return policy
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(x.shape, sampling_dtype(path, x, policy.config.dtype),
                                             sharding=gathered.param_sharding(path, x.shape)), policy.params)
    return policy.replace(params=params)


def _prefill(policy: models.Policy, sampling: SamplingConfig, prompt_tokens, prompt_valid,
             resident_elsewhere: tuple[str, ...]) -> Program:
    """The sampler's prefill on its own: the weights gathered for the decode loop (`gather_weights`), then the
    distinct prompts into an empty cache of their length."""
    rows, length = prompt_tokens.shape
    int8 = sampling.kv_cache_dtype == "int8"

    def prefill(policy, tokens, valid):
        if sampling.gather_weights:
            policy = gathered_weights(policy)
        cache = KVCache.zeros(policy.config, rows, length, int8)
        hidden, cache = models.apply(policy, tokens, models.positions_from_mask(valid), valid, cache, 0)
        return models.logits_from_hidden(policy, hidden[:, -1:]), cache, policy.params

    return Program("prefill", jax.jit(prefill), (policy, prompt_tokens, prompt_valid), calls_per_step=1,
                   resident_elsewhere=resident_elsewhere,
                   model_flops=_forward_flops(policy.config, rows * length, length / 2, unembedded=rows),
                   note="gathers the weights once" if sampling_layout(policy.layout) and sampling.gather_weights
                   else "")


def _decode_step(policy: models.Policy, sampling: SamplingConfig, prompts: int, group: int, prompt_len: int,
                 new: int, mesh, resident_elsewhere: tuple[str, ...]) -> Program:
    """One decode step of the sampler's last segment (its longest cache): a token per sequence through the
    model, attending to the shared prompt cache and its own keys. Counted `new` times per sampler call: an upper
    bound (every sequence runs to `max_new_tokens`; earlier segments attend to shorter caches)."""
    rows = prompts * group
    start, end = decode_segments(new, sampling.decode_segments)[-1]
    int8 = sampling.kv_cache_dtype == "int8"
    config = policy.config

    def cache_like(batch, length):
        cache = jax.eval_shape(lambda: KVCache.zeros(config, batch, length, int8))
        spec = policy.layout.spec(("batch", "kv_heads", "cache_len", "head_dim"),
                                  (batch, config.num_kv_heads, length, config.head_dim))
        def place(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec[:x.ndim])))
        return jax.tree.map(place, cache)

    cache = GroupKVCache(cache_like(prompts, prompt_len), cache_like(rows, end))

    def decode(policy, token, position, key_valid, cache, index):
        hidden, cache = models.apply(policy, token, position, key_valid, cache, index)
        return models.logits_from_hidden(policy, hidden)[:, 0], cache

    args = (policy, _rows(mesh, (rows, 1), jnp.int32), _rows(mesh, (rows, 1), jnp.int32),
            _rows(mesh, (rows, prompt_len + end), jnp.bool_), cache, _scalar(mesh, jnp.int32))
    return Program("decode_step", jax.jit(decode, donate_argnums=(4,)), args, calls_per_step=1,
                   resident_elsewhere=resident_elsewhere, repeats=new,
                   model_flops=_forward_flops(config, rows, prompt_len + end),
                   note=f"x {new} tokens, cache {prompt_len} + {end}")


def _train_batch(config: Config, mesh, rows: int, prompt_len: int, new: int, with_critic: bool) -> dict:
    """A mini-batch as the loop gives the train step: the rollout's tokens and log-probs and what
    `losses.prepare_batch` adds (its fields found by tracing it on abstract inputs)."""
    loss_config = config.rl.loss
    tokens = _rows(mesh, (rows, prompt_len + new), jnp.int32)
    per_token = _rows(mesh, (rows, new), jnp.float32)
    per_row = _rows(mesh, (rows,), jnp.float32)
    weights = tuple(config.reward.component_weights().values())
    prepare = functools.partial(losses.prepare_batch, loss_config, group_size=config.rl.group_size,
                                component_weights=weights)
    inputs = dict(rewards=per_row, completion_mask=_rows(mesh, (rows, new), jnp.bool_), old_logp=per_token,
                  key=_key(mesh), truncated=_rows(mesh, (rows,), jnp.bool_), sampler_logp=per_token,
                  entropy=per_token if loss_config.needs_entropy else None,
                  ref_logp=per_token if loss_config.needs_ref_logp else None,
                  values=per_token if with_critic else None,
                  greedy_rewards=per_row if "greedy_rollouts" in loss_config.estimator_needs else None,
                  answer_ids=_rows(mesh, (rows,), jnp.int32) if loss_config.needs_answers else None,
                  components=_rows(mesh, (rows, len(weights)), jnp.float32))
    fields, _ = jax.eval_shape(lambda kw: prepare(**kw), inputs)
    batch = {"tokens": tokens, "prompt_valid": _rows(mesh, (rows, prompt_len), jnp.bool_), "old_logp": per_token}
    if loss_config.needs_ref_logp:
        batch["ref_logp"] = per_token
    if with_critic:
        batch["old_values"] = per_token
    for name, field in fields.items():
        batch[name] = _rows(mesh, field.shape, field.dtype)
    return batch


def state_bytes_per_chip(tree: Any) -> int:
    """Bytes of a tree of sharded ShapeDtypeStructs held by one device (the largest shard of each array)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * dtype_bits(leaf.dtype) // 8
    return total


def dtype_bits(dtype) -> int:
    """Bits per element as stored: 4 for a 4-bit type (a QLoRA base; numpy says one byte), else 8 x itemsize."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits
    return 8 * dtype.itemsize


def layout_for(config: Config, mesh) -> models.Layout:
    """The config's logical-axis rules on `mesh`."""
    return models.Layout(mesh, rules_from(config.mesh.rules))
