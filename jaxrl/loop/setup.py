"""What a run needs before its first step, built without writing anything: the task's problems, the mesh
check of the batch sizes, the policy and its tokenizer, the sampler front end, the critic, and the jitted
programs of an RL step. Everything that can refuse a config runs here, before the output directory changes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable

import jax

from jaxrl import configlib, losses, models, registry
from jaxrl.config import Config, OptimConfig
from jaxrl.data import arithmetic
from jaxrl.data.demonstrations import demonstration_pairs
from jaxrl.data.prompts import DataError, load_prompts
from jaxrl.envs.render import check_tool_role
from jaxrl.errors import RunConfigError
from jaxrl.losses import Controls
from jaxrl.loop import progress, self_rewards
from jaxrl.loop.generate import Generator
from jaxrl.models.hf import CheckpointError
from jaxrl.policy_io import describe_source, load_policy
from jaxrl.tokenizer import BaseTokenizer, ChatTemplateError, TokenizerError, load_tokenizer, train_tokenizer
from jaxrl.packing import Packer
from jaxrl.train import (TrainState, by_micro_batches, completion_logprobs, critic_values, init_critic,
                         init_train_state, make_optimizer, make_rl_step, packed_completion_logprobs,
                         packed_critic_values)

log = logging.getLogger("jaxrl")

def optimizer_from(config: OptimConfig):
    return make_optimizer(**dataclasses.asdict(config))


def check_tokenizer_settings(config: Config) -> None:
    """A run from random weights trains its own sentencepiece tokenizer: `tokenizer.path` and
    `data.chat_template` need `pretrained.path` (evaluating a checkpoint may set `tokenizer.path` alone)."""
    if config.pretrained.path is None and (config.tokenizer.path is not None or config.data.chat_template):
        raise RunConfigError("tokenizer.path and data.chat_template need pretrained.path: a randomly initialised "
                             "model trains with the sentencepiece tokenizer trained for it")


def load_task(config: Config) -> tuple[list, list, list[str], dict[str, int]]:
    """`(train, held_out, tokenizer corpus, counts)`: the built-in arithmetic task, or the prompt files of
    `config.data`. Items have `.prompt` and `.reference`; a file that cannot be used raises `DataError`
    naming the config field, the file, the line and the row field (`NoDemonstrations` when the warm start,
    `sft.steps > 0`, would find no solution in `data.train_file`)."""
    data = config.data
    if data.train_file is None:
        train, held_out = arithmetic.make_splits(config.task, config.seed)
        return train, held_out, arithmetic.tokenizer_corpus(train[:4000], config.task), {}
    loaded, counts = {}, {}
    for name in ("train_file", "eval_file"):
        path = os.path.expanduser(getattr(data, name))
        try:
            loaded[name], skipped = load_prompts(path, data.prompt_fields(), skip_bad_rows=data.skip_bad_rows)
        except (DataError, FileNotFoundError) as e:
            raise DataError(f"data.{name}: {e}") from e
        counts[f"data_{name.removesuffix('_file')}_rows"] = len(loaded[name])
        counts[f"data_{name.removesuffix('_file')}_bad_rows_skipped"] = skipped
    train = loaded["train_file"]
    if config.sft.steps:
        demonstration_pairs(train)  # a warm start from the file needs solutions in it (NoDemonstrations)
    corpus = [r.prompt for r in train] + [r.reference for r in train] + [r.reference for r in loaded["eval_file"]]
    return train, loaded["eval_file"], corpus, counts


def tokenizer_symbols(config: Config) -> tuple[str, ...]:
    """Strings the trained tokenizer keeps whole (`train_tokenizer(user_symbols=...)`): the tool tags and call
    JSON of the built-in task with `task.tool_rate > 0` (`arithmetic.tokenizer_symbols`), else none."""
    return arithmetic.tokenizer_symbols(config.task) if config.data.train_file is None else ()


def check_batch_sizes(config: Config, mesh_shape: dict[str, int], data_shards: int = 1) -> None:
    """Every batch of the run must split evenly over the data-parallel axes (`data` x `fsdp`), and the RL
    prompts over the `data_shards` processes that load distinct rows: raise a `RunConfigError` naming the
    config fields and the numbers otherwise, before anything is compiled or written."""
    parallel = mesh_shape["data"] * mesh_shape["fsdp"]
    where = f"the data-parallel size {parallel} (mesh data={mesh_shape['data']} x fsdp={mesh_shape['fsdp']})"
    rl = config.rl
    batches = {"rl.prompts_per_step x rl.group_size": rl.prompts_per_step * rl.group_size,
               "eval.batch_size": config.eval.batch_size}
    if rl.minibatches * rl.micro_batches > 1:  # each micro-batch of an update splits over the devices too
        batches["rl.prompts_per_step x rl.group_size // (rl.minibatches x rl.micro_batches)"] = (
            rl.prompts_per_step * rl.group_size // (rl.minibatches * rl.micro_batches))
    if config.sft.steps:
        batches["sft.batch_size"] = config.sft.batch_size
    if config.eval.samples:  # the sampled evaluation prefills eval.batch_size // eval.samples problems per call
        batches["eval.batch_size // eval.samples"] = max(1, config.eval.batch_size // config.eval.samples)
    for name, rows in batches.items():
        if rows % parallel:
            raise RunConfigError(f"{name} = {rows} rows do not split over {where}; use a multiple of {parallel}")
    if config.rl.prompts_per_step % data_shards:
        raise RunConfigError(f"rl.prompts_per_step ({config.rl.prompts_per_step}) does not split over the "
                             f"{data_shards} data shards of the processes (one per process holding distinct rows "
                             "of the batch)")


def policy_and_tokenizer(config: Config, corpus: list[str], layout: models.Layout
                         ) -> tuple[models.Policy, BaseTokenizer, str | None]:
    """The pretrained checkpoint and its tokenizer, or a fresh `config.model` and a sentencepiece tokenizer
    trained on the task's text; the policy placed by `layout`. Writes nothing: the third item is the
    tokenizer file the run keeps (`outputs.keep_tokenizer`), None for a trained tokenizer."""
    stop_tokens = config.tokenizer.stop_tokens
    if config.pretrained.path is None:
        saved = os.path.join(config.output_dir, "tokenizer.model")
        if config.resume and os.path.exists(saved):  # the resumed run's own tokenizer
            tokenizer = load_tokenizer(saved, stop_tokens=stop_tokens)
        else:
            try:
                tokenizer = train_tokenizer(corpus, config.tokenizer.vocab_size, stop_tokens=stop_tokens,
                                            user_symbols=tokenizer_symbols(config))
            except RuntimeError as e:  # sentencepiece's trainer: "Vocabulary size is smaller than required_chars"
                raise TokenizerError(f"tokenizer.vocab_size={config.tokenizer.vocab_size}: sentencepiece cannot "
                                     f"train on the task's text: {str(e).splitlines()[-1]}") from None
        return models.shard(models.init(config.model, config.seed), layout), tokenizer, None
    pretrained = config.pretrained
    try:
        policy = load_policy(pretrained.path, dtype=pretrained.dtype, compute_dtype=pretrained.compute_dtype,
                             layout=layout, progress=progress.bars(config.progress))
    except CheckpointError as e:
        raise CheckpointError(f"pretrained.path: {e}") from None
    policy = models.replace_config(policy, attention_impl=pretrained.attention_impl, remat=pretrained.remat)
    tokenizer, tokenizer_file = load_checkpoint_tokenizer(pretrained.path, config, "pretrained.path")
    log.info("loaded %s (%s, %.1fM parameters) and its tokenizer (%d tokens, stop ids %s)", pretrained.path,
             policy.config.family, models.num_parameters(policy.config) / 1e6, tokenizer.vocab_size,
             tokenizer.stop_ids)
    return policy, tokenizer, tokenizer_file if tokenizer_file.endswith(".model") else None


def load_checkpoint_tokenizer(checkpoint: str, config: Config, field: str) -> tuple[BaseTokenizer, str]:
    """The tokenizer of `checkpoint` (`tokenizer_files`) with `tokenizer.stop_tokens`, and the path it came
    from; a `CheckpointError` naming `field` (or `tokenizer.path` when set) if there is none."""
    configured = config.tokenizer.path
    path = tokenizer_files(checkpoint, configured)
    if path is None:
        raise CheckpointError(f"{field}: {checkpoint} holds no tokenizer files: set tokenizer.path")
    try:
        path = os.path.expanduser(path)
        return load_tokenizer(path, stop_tokens=config.tokenizer.stop_tokens), path
    except (FileNotFoundError, NotADirectoryError) as e:
        where = "tokenizer.path" if configured else field
        hint = "" if configured else "; set tokenizer.path"
        raise CheckpointError(f"{where}: {e}{hint}") from None


def tokenizer_files(path: str, configured: str | None) -> str | None:
    """The tokenizer for a checkpoint: `configured` (`tokenizer.path`) when set, else for a run its own
    `tokenizer.model` (the one it trained with or copied) or, for a run started from an HF checkpoint, the
    tokenizer its saved config names (`tokenizer.path`, else `pretrained.path`'s files); else the checkpoint's
    HF tokenizer files (None: none)."""
    if configured:
        return configured
    source = describe_source(path)
    if source.kind != "run":
        return hf_files(path)
    run_dir = os.path.dirname(os.path.dirname(source.directory))
    own = os.path.join(run_dir, "tokenizer.model")
    if os.path.exists(own):
        return own
    try:
        saved = configlib.load_config(Config, source.config_file)
    except (OSError, configlib.ConfigError):
        return own  # an older or damaged run: the error names the file it lacks
    if saved.tokenizer.path:
        return saved.tokenizer.path
    if saved.pretrained.path is None:
        return own
    return hf_files(saved.pretrained.path) if os.path.exists(saved.pretrained.path) else None


def hf_files(path: str) -> str | None:
    """The directory with the tokenizer and HF config files of a checkpoint: an HF directory itself, the
    `hf_files/` a policy checkpoint kept from one; None for a run."""
    source = describe_source(path)
    files = {"hf": source.directory, "policy": os.path.join(source.directory, "hf_files")}.get(source.kind)
    return files if files is not None and os.path.isdir(files) else None


def make_generator(problems, tokenizer: BaseTokenizer, mesh, config: Config) -> Generator:
    """The sampler front end for `problems`' prompts (rendered, encoded and bucketed now: a template that
    refuses them fails here, naming `data.chat_template`). In a multi-turn run with a chat template, the
    template must have a tool role and gets the environment's tool schemas (`tools=`)."""
    tool_schemas = ()
    try:
        if config.env.multi_turn and config.data.chat_template:
            check_tool_role(tokenizer)
            environment = registry.resolve("environment", config.env.name, "env.name").fn(config.env)
            tool_schemas = tuple(getattr(environment, "tool_schemas", ()))
        return Generator.fitting(problems, tokenizer, mesh, config.data.chat_template,
                                 config.data.system_prompt, config.data.prompt_buckets, config.tokenizer.stop_strings,
                                 tool_schemas=tool_schemas)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"data.chat_template: {e}") from None


def critic_trunk(config: Config, policy: models.Policy) -> models.Policy | None:
    """The separately loaded network of `rl.critic.model=separate` (None otherwise), checked against the policy."""
    if config.rl.critic.model != "separate":
        return None
    path = config.rl.critic.checkpoint
    try:
        trunk = load_policy(path, layout=policy.layout)
    except CheckpointError as e:
        raise CheckpointError(f"rl.critic.checkpoint: {e}") from None
    if trunk.config.vocab_size < policy.config.vocab_size:
        raise RunConfigError(f"rl.critic.checkpoint {path}: its vocabulary has {trunk.config.vocab_size} tokens, "
                             f"fewer than the policy's {policy.config.vocab_size}; the critic reads the policy's "
                             "token ids")
    log.info("critic: %s (%d layers, hidden %d)", path, trunk.config.num_layers, trunk.config.hidden_size)
    return trunk


def rl_start(config: Config, policy: models.Policy, trunk: models.Policy | None) -> tuple[TrainState, Controls]:
    """The RL state and controls before the first step: `policy` with RL's optimizer and, with `rl.critic`, a
    value model on a copy of its trunk or on `trunk` (`critic_trunk`)."""
    rl = config.rl
    critic = critic_optimizer = None
    if rl.critic.model != "none":
        critic, critic_optimizer = init_critic(trunk or policy), optimizer_from(rl.critic.optim)
    state = init_train_state(policy, optimizer_from(rl.optim), critic, critic_optimizer)
    return state, Controls.initial(rl.loss, rl.sampling.temperature)


@dataclasses.dataclass(frozen=True)
class StepPrograms:
    """The jitted programs of an RL step, built once per run (none of them holds run state)."""

    update: Callable  # (state, batch, controls, ref_policy) -> (state, metrics): `train.make_rl_step`
    critic_warmup: Callable | None  # the same, training only the critic (rl.critic.warmup_steps)
    logprobs: Callable  # (policy, tokens, prompt_valid, temperature[, plan=]) -> (logp [B, N], entropy [B, N])
    values: Callable  # (critic, tokens, prompt_valid[, plan=]) -> values [B, N]
    prepare: Callable  # `losses.prepare_batch` for this config: rewards -> advantages and the batch's fields
    component_weights: dict[str, float]  # reward component -> weight; the `[B, K]` columns' order
    # rl.packing.enabled: (prompt_valid, mask, like) -> PackPlan (`jaxrl.packing.Packer`); logprobs and values
    # then take the plan (`plan=`) and the update a batch with one (`"plan"`). None: padded rows.
    pack: Packer | None = None
    # The per-token statistics the token self-rewards read (`self_rewards.token_statistics`: entropy,
    # self_certainty), kept by `rollout_batch` as the batch's `token_stats`; () when none (issue 35).
    token_stats: tuple[str, ...] = ()


def step_programs(config: Config) -> StepPrograms:
    """The programs of `config.rl`'s step: the objective and the advantage estimator it names."""
    rl, loss_config = config.rl, config.rl.loss
    optimizer = optimizer_from(rl.optim)
    with_critic = rl.critic.model != "none"
    critic_optimizer = optimizer_from(rl.critic.optim) if with_critic else None
    step_args = dict(micro_batches=rl.micro_batches, norm_length=loss_config.norm_length or config.completion_tokens,
                     critic_optimizer=critic_optimizer, full_kl=loss_config.needs_full_kl)
    objective = losses.build_loss(loss_config, with_critic=with_critic)
    step_args["donate"] = not rl.staleness  # the producer samples with versions the update was given
    update = make_rl_step(optimizer, objective, **step_args)
    warmup = make_rl_step(optimizer, objective, update_policy=False, **step_args) if with_critic else None
    # the rollout's log-probs and values in rl.micro_batches groups of rows: the train step's activation bound
    # (packed: in micro-batches of the plan's token budget)
    pack = Packer(rl.packing, rl.micro_batches) if rl.packing.enabled else None
    token_stats = self_rewards.token_statistics(config)
    if pack is None:  # with the self-certainty reward: a third output from the same forward pass
        logprob_fn = (self_rewards.completion_logprobs_with_certainty if "self_certainty" in token_stats
                      else completion_logprobs)
        logprobs = jax.jit(by_micro_batches(logprob_fn, rl.micro_batches))
        values = jax.jit(by_micro_batches(critic_values, rl.micro_batches))
    else:
        logprobs, values = jax.jit(packed_completion_logprobs), jax.jit(packed_critic_values)
    component_weights = config.component_weights()
    prepare = jax.jit(functools.partial(losses.prepare_batch, loss_config, group_size=rl.group_size,
                                        component_weights=tuple(component_weights.values())))
    return StepPrograms(update, warmup, logprobs, values, prepare, component_weights, pack, token_stats)
