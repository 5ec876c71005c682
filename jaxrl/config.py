"""The run configuration: typed, frozen dataclasses (data only; loading and validation in `configlib`).

A YAML recipe lists only what it changes from these defaults; `key.sub=value` overrides follow it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Literal

from jaxrl import registry
from jaxrl.configlib import FrozenMapping
from jaxrl.data.arithmetic import ArithmeticTaskConfig
from jaxrl.data.prompts import PromptFields
from jaxrl.envs.config import EnvConfig
from jaxrl.losses import LossConfig
from jaxrl.sampling import SamplingConfig
from jaxrl.models.configs import ModelConfig
from jaxrl.models.lora import PROJECTIONS


def _field(default, **constraints):
    """A field with bounds (`gt`, `ge`, `lt`, `le`), checked by `configlib`. Every float field must be finite
    unless its bounds admit infinity (`le=math.inf`): only `OptimConfig.max_grad_norm` does."""
    return dataclasses.field(default=default, metadata=constraints)


def _section(cls, **kwargs):
    return dataclasses.field(default_factory=lambda: cls(**kwargs))


@dataclasses.dataclass(frozen=True)
class PretrainedConfig:
    """Start from a checkpoint instead of a randomly initialised `model` (whose fields are then ignored)."""

    path: str | None = None  # a Hugging Face directory (config.json + *.safetensors) or a jaxrl policy checkpoint
    dtype: Literal["float32", "bfloat16", "float16"] | None = None  # parameters; None: the checkpoint's own
    compute_dtype: Literal["float32", "bfloat16", "float16"] | None = None  # activations; None: as dtype
    export_hf: bool = True  # write the trained policy as a Hugging Face directory to <output_dir>/hf
    # self-attention kernel for the loaded policy (see model.attention_impl): auto, xla, cudnn or splash
    attention_impl: Literal["auto", "xla", "cudnn", "splash"] = "auto"
    remat: Literal["none", "full", "dots"] = "none"  # rematerialisation while training (see model.remat)


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """Without `path`, a sentencepiece model of `vocab_size` pieces is trained on the task's text."""

    path: str | None = None  # tokenizer.json / tokenizer.model (or their directory); default: pretrained.path
    vocab_size: int = _field(32, gt=4)  # sentencepiece vocabulary trained for the built-in task
    stop_tokens: tuple[str, ...] = ()  # extra vocabulary tokens that end a completion (besides EOS / end-of-turn)
    # Strings that end a completion, matched as token sequences: each string encoded on its own, after a space
    # and without a leading "▁" token (e.g. "</answer>" for a base model whose vocabulary has no such token);
    # see jaxrl.sampling.stop_sequences_for.
    stop_strings: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup to a constant learning rate, after global-norm gradient clipping."""

    learning_rate: float = _field(1e-3, gt=0)
    warmup_steps: int = _field(0, ge=0)
    weight_decay: float = _field(0.0, ge=0)
    b1: float = _field(0.9, ge=0, lt=1)
    b2: float = _field(0.99, ge=0, lt=1)
    max_grad_norm: float = _field(1.0, gt=0, le=math.inf)  # inf: no clipping (the one float field that may be inf)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised warm start on teacher demonstrations."""

    steps: int = _field(600, ge=0)
    batch_size: int = _field(64, gt=0)
    optim: OptimConfig = _section(OptimConfig, learning_rate=3e-3, warmup_steps=50)


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """The value model of PPO-style estimators (GAE)."""

    # policy_copy: a copy of the policy's trunk + a zero-initialised value head; separate: its own network, the
    # trunk loaded from `checkpoint` (an HF directory or a jaxrl checkpoint, of any size, same token ids) + a
    # zero-initialised head.
    model: Literal["none", "policy_copy", "separate"] = "none"
    checkpoint: str = ""  # the separate critic's trunk
    warmup_steps: int = _field(0, ge=0)  # first RL steps that train only the critic (the policy waits)
    optim: OptimConfig = _section(OptimConfig, learning_rate=1e-3, warmup_steps=5)


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (jaxrl.dynamic_sampling): groups whose rewards are all equal are dropped and more
    prompts sampled until the batch is full of informative groups, for at most `max_rounds` sampling rounds per
    step (the first included); then uninformative groups fill the rest (reported as dynamic/filled_groups)."""

    enabled: bool = False
    max_rounds: int = _field(4, gt=0)


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """Packed training (jaxrl.packing): the update and the old/reference log-prob and value passes run on rows
    of `row_tokens` positions holding whole sequences (segment ids keep them apart) instead of one padded row
    per sequence, and micro-batches hold a token budget instead of a count of sequences. Same losses and
    gradients as the padded rows (to float32 rounding: sums run in another order)."""

    enabled: bool = False
    # Positions per packed row; 0: the padded row's (prompt width + completion tokens - 1), which every
    # sequence fits. A sequence longer than a row is an error at plan time naming this field.
    row_tokens: int = _field(0, ge=0)
    # Tokens of one micro-batch over all data-parallel devices (rows x row_tokens; rounded down to whole rows
    # of every data shard); 0: the padded micro-batch's, 1 / rl.micro_batches of the mini-batch's rows.
    micro_batch_tokens: int = _field(0, ge=0)
    # Static sizes the number of rows (or of micro-batches) is rounded up to: a run compiles each packed
    # program at most this many times per batch shape.
    buckets: int = _field(8, gt=0)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on the frozen policy RL starts from (`jaxrl.models.lora`, through qwix): only the adapters
    are trained, get optimizer state and are checkpointed; the base, with the adapters off, is the KL reference.
    `quantize` stores the frozen base's projections in int8 or 4 bits (QLoRA); adapters and activations keep
    the compute dtype."""

    enabled: bool = False
    rank: int = _field(8, gt=0)
    alpha: float = _field(16.0, gt=0)  # the adapters' output is scaled by alpha / rank
    # Only 0: dropout in the update would make the PPO ratio noisy even where the parameters have not moved
    # (the rollout's log-probs are computed without it).
    dropout: float = _field(0.0, ge=0, lt=1)
    # Regular expressions, each matching a projection's name (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    # down_proj) or its path (layers/0/self_attn/q_proj); a pattern that matches nothing is an error.
    targets: tuple[str, ...] = PROJECTIONS
    quantize: Literal["int8", "int4", "nf4"] | None = None  # the frozen base's weights (QLoRA); None: as loaded


@dataclasses.dataclass(frozen=True)
class PartialRolloutConfig:
    """Partial rollouts (Kimi k1.5's partial rollouts; APRIL, arXiv 2509.18521): each step decodes in segments
    of `segment_tokens` over `rl.prompts_per_step + extra_groups` groups, stops once `rl.prompts_per_step`
    groups are complete, trains on those (oldest first) and carries the others over to the next step, where
    they continue (their prompt and completion so far prefilled again) under the newer policy. Each token
    keeps the version that sampled it and its log-prob (`sampler_logp`), which the rollout correction uses."""

    segment_tokens: int = _field(0, ge=0)  # 0: off; must divide rl.sampling.max_new_tokens
    extra_groups: int | None = _field(None, ge=1)  # groups in flight beyond prompts_per_step (None: as many)
    # Steps a group may be carried over; it is completed in the step after that. Its first tokens are then up
    # to depth + max_carry versions old, so rl.max_staleness must be at least max_carry.
    max_carry: int = _field(1, ge=1)

    @property
    def enabled(self) -> bool:
        return self.segment_tokens > 0


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Rollout batches of `prompts_per_step * group_size` completions, `epochs * minibatches` optimizer
    steps per batch, each accumulated over `micro_batches`; the objective is `loss` (see jaxrl.losses)."""

    steps: int = _field(100, ge=0)
    prompts_per_step: int = _field(16, gt=0)
    group_size: int = _field(8, ge=2)
    epochs: int = _field(1, gt=0)
    minibatches: int = _field(1, gt=0)
    micro_batches: int = _field(1, gt=0)  # gradient accumulation inside each optimizer step
    # An optimizer step whose loss or gradients are not finite is skipped (parameters untouched, logged as
    # train/skipped); this many consecutive RL steps with skipped updates stop the run.
    max_consecutive_skips: int = _field(3, gt=0)
    # The KL terms' reference policy is the warm-started one; every this many RL steps it becomes the current
    # policy instead (0: never), as in periodic reference resets.
    ref_reset_every: int = _field(0, ge=0)
    # Bounded staleness: rollouts come from a producer (a background thread) that samples up to this many
    # policy versions ahead of the update. The rollout of step s is sampled by the parameters after update
    # max(s - 1 - depth, c), c the last checkpoint step before s (a resumed run then draws what the uninterrupted
    # one drew), depth = max_staleness - partial_rollouts.max_carry when partial rollouts are on. The trainer
    # recomputes old_logp with the parameters it is about to update, so the PPO ratio is a trust region around
    # them; the rollout correction (rl.loss.is_level: exp(old_logp - sampler_logp)) corrects the staleness.
    # 0: on-policy. Every token trained on is at most max_staleness versions old (checked every step).
    max_staleness: int = _field(0, ge=0)
    overlap: bool = False  # the same as max_staleness: 1 (older configs)
    partial_rollouts: PartialRolloutConfig = _section(PartialRolloutConfig)
    dynamic_sampling: DynamicSamplingConfig = _section(DynamicSamplingConfig)
    sampling: SamplingConfig = _section(SamplingConfig)
    loss: LossConfig = _section(LossConfig)
    critic: CriticConfig = _section(CriticConfig)
    optim: OptimConfig = _section(OptimConfig, learning_rate=3e-4, warmup_steps=5)
    packing: PackingConfig = _section(PackingConfig)
    lora: LoraConfig = _section(LoraConfig)

    @property
    def staleness(self) -> int:
        """The bound on the policy versions between a sampled token and the update it trains (`max_staleness`,
        at least 1 with the older `overlap`)."""
        return max(self.max_staleness, int(self.overlap))

    @property
    def sampling_depth(self) -> int:
        """How many versions behind the update a step's rollout is sampled (partial rollouts keep
        `partial_rollouts.max_carry` of `staleness` for the steps a group is carried)."""
        return self.staleness - (self.partial_rollouts.max_carry if self.partial_rollouts.enabled else 0)

    def validate(self) -> None:
        if self.sampling.temperature <= 0:
            raise ValueError("sampling.temperature must be > 0 for RL (greedy groups carry no signal)")
        batch = self.prompts_per_step * self.group_size
        if batch % (self.minibatches * self.micro_batches):
            raise ValueError(f"prompts_per_step * group_size = {batch} is not divisible by minibatches x "
                             f"micro_batches = {self.minibatches} x {self.micro_batches}")
        packing = self.packing
        if packing.enabled and packing.micro_batch_tokens and self.micro_batches > 1:
            raise ValueError(f"packing.micro_batch_tokens ({packing.micro_batch_tokens}) and micro_batches "
                             f"({self.micro_batches}) both set the micro-batch size: set one of them")
        if packing.row_tokens and packing.micro_batch_tokens and packing.micro_batch_tokens < packing.row_tokens:
            raise ValueError(f"packing.micro_batch_tokens ({packing.micro_batch_tokens}) is smaller than one row "
                             f"(packing.row_tokens = {packing.row_tokens})")
        if self.overlap and self.max_staleness not in (0, 1):
            raise ValueError(f"rl.overlap is the older name of rl.max_staleness: 1; it contradicts "
                             f"rl.max_staleness = {self.max_staleness}: set only rl.max_staleness")
        partial = self.partial_rollouts
        if partial.enabled:
            max_new = self.sampling.max_new_tokens
            if partial.segment_tokens >= max_new or max_new % partial.segment_tokens:
                raise ValueError(f"rl.partial_rollouts.segment_tokens ({partial.segment_tokens}) must divide "
                                 f"rl.sampling.max_new_tokens ({max_new}) and be smaller, so every segment of a "
                                 "carried completion fits its remaining budget")
            if self.staleness < partial.max_carry:
                raise ValueError(f"rl.max_staleness ({self.staleness}) is below rl.partial_rollouts.max_carry "
                                 f"({partial.max_carry}): a group carried over that many steps has tokens that "
                                 "many versions old; raise rl.max_staleness or lower max_carry")
            extra = partial.extra_groups if partial.extra_groups is not None else self.prompts_per_step
            if extra > self.prompts_per_step:
                raise ValueError(f"rl.partial_rollouts.extra_groups ({extra}) exceeds rl.prompts_per_step "
                                 f"({self.prompts_per_step}): a step trains prompts_per_step groups, so more "
                                 "carried groups than that could not all be trained within max_carry steps")
            if self.dynamic_sampling.enabled:
                raise ValueError("rl.partial_rollouts with rl.dynamic_sampling.enabled: dynamic sampling selects "
                                 "whole rounds of groups as they finish sampling, which carried groups never do "
                                 "at once; turn one of them off")
        if self.lora.enabled and self.lora.dropout:
            raise ValueError(f"lora.dropout is {self.lora.dropout}; only 0 is supported: the PPO ratio compares the "
                             "update's log-probs with the rollout's, which dropout would make differ even where the "
                             "parameters have not moved")
        if self.lora.enabled and self.critic.model == "policy_copy":
            raise ValueError("lora.enabled with critic.model 'policy_copy': a critic on the policy's trunk would need "
                             "adapters of its own on the same frozen base, which is not supported; use critic.model "
                             "'separate' (a full value network of its own, from critic.checkpoint) or an estimator "
                             "without a critic (critic.model 'none')")
        if (self.critic.model == "separate") != bool(self.critic.checkpoint):
            raise ValueError("critic.model 'separate' loads its network from critic.checkpoint (and only it does): "
                             f"got critic.model={self.critic.model!r}, critic.checkpoint={self.critic.checkpoint!r}")


# Names a `reward.extra` entry cannot take: the shaping components' and the reward metrics' (reward/<name>).
RESERVED_REWARD_NAMES = ("correct", "format", "overlong", "length", "total", "mean", "std", "timeouts", "errors",
                         "seconds", "greedy_mean")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """The rewards of RL (see jaxrl.rewards.scoring): the verifiable `function`, more rewards in `extra`, and
    shaping, composed with weights into one reward per completion. Each reward runs in its own worker pool
    (jaxrl.rewards.RewardPool) with the timeouts below."""

    # The verifiable reward: a registered name (jaxrl.registry kind `reward`: arithmetic, math, code, and those of
    # modules under `imports:`) or `module:function`. It takes any of prompt, completion, reference, row by name
    # (per completion), or any of prompts, completions, references, rows (batched: lists; a class is instantiated
    # once per worker, e.g. a reward model). Weight 1, logged as reward/correct, and what the held-out evaluation
    # measures unless eval.reward names another.
    function: str = "arithmetic"
    # More rewards, `{name or module:function: weight}` (e.g. {my_rewards:brevity: 0.1}), added to the total with
    # their weights and logged as reward/<name>; weight 0 scores and logs one without training on it.
    extra: Mapping[str, float] = FrozenMapping()
    num_workers: int = _field(2, ge=1)  # worker processes of each reward (function and every extra)
    # Per completion; a stuck worker is killed and replaced. For `code`, all of a problem's test runs share it
    # (each ~20-50 ms to start, at most 5 s): runs that no longer fit score as failed, with a logged warning.
    # A batched reward's chunk gets timeout_s x its number of completions.
    timeout_s: float = _field(2.0, gt=0)
    # Hard budget for scoring one whole batch (None: per-item timeouts only). Items unfinished when it runs
    # out score 0 as timeouts; set it above timeout_s + batch_size / num_workers x typical item time.
    batch_timeout_s: float | None = _field(None, gt=0)
    # The largest chunk of completions a batched reward is called with (the batch is split evenly over the
    # workers in chunks of at most this many).
    batch_size: int = _field(64, gt=0)
    # Seconds a reward worker may take to start: imports, warm_up, and a reward class's instance (a reward
    # model loads here); not charged to any item's timeout.
    startup_timeout_s: float = _field(60.0, gt=0)
    # Shaping, composed with the verifiable reward ("correct", weight 1) by jaxrl.rewards.compose; each
    # component is logged (reward/<name>) and feeds rl.loss.advantage.per_component.
    format_weight: float = _field(0.0, ge=0)  # weight of format_reward (0: off)
    format_pattern: Literal["think_answer", "answer"] = "think_answer"
    # DAPO soft overlong punishment: the last `overlong_buffer` tokens before rl.sampling.max_new_tokens
    # (env.max_tokens in a multi-turn run).
    overlong_buffer: int | None = _field(None, gt=0)  # None: off
    overlong_weight: float = _field(1.0, ge=0)
    length_target: int | None = _field(None, gt=0)  # length penalty beyond this many tokens (None: off)
    length_penalty_coef: float = _field(0.0, ge=0)
    # Issue 35, self-rewarding signals (jaxrl.rewards.self_rewarding: ttrl, rent, self_certainty under `extra`):
    # the weight of the verifiable reward `correct` in the total. 0 trains on the other components alone (e.g.
    # TTRL without the reference answers); `correct` is still scored and logged as reward/correct.
    function_weight: float = _field(1.0, ge=0)

    def __post_init__(self):  # a RewardConfig built in Python with a dict: read-only and hashable, as loaded
        if not isinstance(self.extra, FrozenMapping):
            object.__setattr__(self, "extra", FrozenMapping(self.extra))

    def component_weights(self) -> dict[str, float]:
        """Name -> weight of every active reward component: `correct` (`function_weight`, 1 by default), the
        shaping components, the extras."""
        weights = {"correct": self.function_weight}
        if self.format_weight:
            weights["format"] = self.format_weight
        if self.overlong_buffer is not None:
            weights["overlong"] = self.overlong_weight
        if self.length_target is not None:
            weights["length"] = 1.0  # the coefficient is inside the penalty
        weights.update(self.extra)
        return weights

    def validate(self) -> None:
        for name in self.extra:
            if name in RESERVED_REWARD_NAMES:
                raise registry.RegistryError(
                    f"reward.extra.{name}: {name!r} is taken (by a shaping component or a reward metric: "
                    f"{', '.join(RESERVED_REWARD_NAMES)}); name the reward by its module:function",
                    field=f"reward.extra.{name}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Prompt sets from local JSONL / Parquet files (see jaxrl.data.prompts). Without `train_file` the
    built-in arithmetic task (`task`) runs. With it, RL draws prompts from `train_file`, the greedy
    accuracy is measured on `eval_file`, and the tokenizer is trained on both files' prompts and
    references. Demonstrations for the warm start (sft.steps) come from `solution_field`, or from a chat
    row's last assistant message (`format: messages`)."""

    train_file: str | None = None
    eval_file: str | None = None
    # prompt: a prompt field + template; messages: OpenAI-style chat rows [{"role", "content"}, ...]: a final
    # assistant message is the answer (demonstration, reference) and the turns before it the prompt; a
    # conversation ending with a user turn is all prompt (needs chat_template: true)
    format: Literal["prompt", "messages"] = "prompt"
    prompt_field: str = "question"  # row field with the prompt text
    reference_field: str = "answer"  # row field with the reference (string, number, list or dict)
    messages_field: str = "messages"  # row field with a chat row's messages (format: messages)
    solution_field: str | None = None  # row field with a worked solution: the warm start's demonstration
    template: str = "{prompt}"  # str.format template over the row's fields; {prompt}: the prompt_field's text
    reference_pattern: str | None = None  # regex whose group 1 is the reference, e.g. '#### (.+)$' (GSM8K)
    reference_from: Literal["field", "boxed"] = "field"  # boxed: the answer extracted from the field (MATH)
    skip_bad_rows: bool = False  # skip malformed rows (counted in summary.json) instead of stopping
    chat_template: bool = False  # wrap each templated prompt as a user turn with the tokenizer's chat template
    system_prompt: str | None = None  # a system turn before it (chat_template only; a chat row's own one wins)
    # Each batch of prompts is left-padded to the shortest of this many lengths that fits it: the longest
    # prompt's length and its halves (multiples of 8). More buckets: less padding, more compiled programs.
    prompt_buckets: int = _field(4, gt=0)

    def prompt_fields(self) -> PromptFields:
        return PromptFields(self.prompt_field, self.reference_field, self.template, self.reference_pattern,
                            self.reference_from, self.format, self.messages_field, self.solution_field)

    @property
    def has_demonstrations(self) -> bool:
        """Whether the train file's rows can carry demonstrations for a supervised warm start."""
        return self.solution_field is not None or self.format == "messages"

    def validate(self) -> None:
        if (self.train_file is None) != (self.eval_file is None):
            raise ValueError("train_file and eval_file go together: RL prompts from one, held-out prompts for "
                             "the greedy accuracy from the other")
        if self.format == "messages" and not self.chat_template:
            raise ValueError("data.format 'messages' needs data.chat_template: true (the tokenizer's chat "
                             "template renders each conversation)")
        self.prompt_fields()  # checks the template (its syntax), the format and the reference pattern


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Greedy accuracy on the held-out problems; after RL, optionally also `samples` completions per problem
    at `temperature`, scored as pass@k (unbiased estimator) and maj@k for each k in `pass_k`."""

    every: int = _field(20, ge=0)  # RL steps between evaluations (0: only before and after RL)
    batch_size: int = _field(256, gt=0)  # sequences per sampler call
    samples: int = _field(0, ge=0)  # completions per problem for pass@k / maj@k (0: greedy accuracy only)
    pass_k: tuple[int, ...] = _field((1,), gt=0)
    temperature: float = _field(1.0, gt=0)
    # The verifiable reward the held-out problems are scored with (a registered name or module:function, like
    # reward.function); None: reward.function. Reported as accuracy only for a reward registered binary=True.
    reward: str | None = None

    def validate(self) -> None:
        if not self.samples and (self.pass_k != (1,) or self.temperature != 1.0):
            raise ValueError("eval.pass_k and eval.temperature set how eval.samples completions per problem are "
                             "sampled and scored: set eval.samples (0 evaluates greedily only)")
        if self.samples and not self.pass_k:
            raise ValueError("eval.pass_k is empty: list the k of pass@k and maj@k, e.g. [1, 4]")
        if self.samples and max(self.pass_k) > self.samples:
            raise ValueError(f"eval.pass_k {list(self.pass_k)} has k > eval.samples ({self.samples})")
        if self.samples > self.batch_size:
            raise ValueError(f"eval.samples ({self.samples}) exceeds eval.batch_size ({self.batch_size}): one "
                             "sampler call must hold a problem's samples")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axes (their product is the number of devices; one may be -1: the devices left over) and
    the rules that place logical axes on them (MaxText-style; see models.partitioning).

    The default rules: `batch` over data and fsdp (data parallelism); `embed` over fsdp (FSDP: parameters,
    gradients and optimizer state split); `heads`, `kv_heads`, `mlp` and `vocab` over tensor (tensor
    parallelism). Each row of `rules` replaces one: `[logical_name, mesh_axis, ...]`, e.g. `[embed]` to
    replicate the parameters' hidden dimension or `[vocab, tensor, fsdp]`.
    """

    data: int = _field(1, ge=-1)
    fsdp: int = _field(1, ge=-1)
    tensor: int = _field(1, ge=-1)
    rules: tuple[tuple[str, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-host runs: every host runs the same command; `jax.distributed.initialize()` joins them.

    `initialize`: auto (when `coordinator_address` is set or the environment is a multi-process SLURM / Open
    MPI job or a multi-host TPU slice), on, or off. Fields left unset are detected by JAX from the cluster.
    """

    initialize: Literal["auto", "on", "off"] = "auto"
    coordinator_address: str | None = None  # host:port of process 0
    num_processes: int | None = _field(None, gt=0)
    process_id: int | None = _field(None, ge=0)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = _field(50, ge=0)  # RL steps between checkpoints (0: only at the end)
    keep: int = _field(2, gt=0)


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """What `jaxrl plan` needs beyond the recipe to compile its programs for a topology (see jaxrl.plan)."""

    # A models.PRESETS name whose shape stands in for `pretrained.path` when that checkpoint is not on this
    # machine (planning uses random weights). None: the checkpoint's config.json, or `model` without one.
    model: str | None = None
    prompt_len: int = _field(512, gt=0)  # the longest padded prompt of the data, in tokens (its largest bucket)
    topology: str | None = None  # default for `--topology`, e.g. v5e:8x8
    # Two layer counts [d1, d2] below the model's: its programs are compiled at those depths and every figure
    # extrapolated linearly to the full depth (the layers are unrolled, so a 32B model's train step would take
    # longer and more host memory to compile than this machine has). Empty: compile at the full depth.
    depths: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """What a run logs beside metrics.jsonl: the wandb mirror's run (with `wandb: true`) and samples.jsonl."""

    wandb_project: str = "jaxrl"
    wandb_name: str | None = None  # None: the basename of output_dir
    # None: wandb's own default (or the WANDB_MODE environment variable); offline writes <output_dir>/wandb only
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    # Every this many RL steps, `samples_per_step` completions of that step's batch go to <output_dir>/samples.jsonl
    # (prompt, completion, reference, reward components, advantage, length, finish reason); 0: off.
    samples_every: int = _field(10, ge=0)
    samples_per_step: int = _field(4, gt=0)
    # More metrics writers of the user's own (jaxrl.registry kind `writer`, or module:function), each called as
    # `writer(directory=<output_dir>/<name>, config=...)` and given every record metrics.jsonl gets.
    writers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = _field(0, ge=0, le=2**32 - 1)  # the data shuffle (grain) takes 32 bits
    # Modules imported when the config loads (before its names are checked): their `@jaxrl.registry.register`
    # decorators add rewards, objectives, ratios, advantage estimators or writers that the config names.
    imports: tuple[str, ...] = _field((), import_modules=True)
    output_dir: str = "runs/default"
    progress: bool = True  # progress bars on stderr
    tensorboard: bool = False  # also write metrics as TensorBoard event files to <output_dir>/tensorboard
    # also log metrics to Weights & Biases (the `wandb` extra; see `log`), files under <output_dir>/wandb
    wandb: bool = False
    # Go on from the newest checkpoint in output_dir (parameters, optimizer state, critic, controls, data
    # position, RL step): the result equals an uninterrupted run's. The model must be the checkpoint's.
    resume: bool = False
    # A fresh run refuses an output_dir that holds another run's checkpoints unless this is set: then that
    # run's checkpoints and metrics are deleted (a restarted job that forgot resume=true loses nothing).
    overwrite: bool = False
    # The run's own pieces (rewards, objectives, estimators named as module:function or registered by `imports:`)
    # as `[field, module:qualname, sha256 of the source file]`: written by the run to its config.yaml and
    # summary.json (a value set here is replaced). resume=true refuses a piece whose source changed since,
    # unless `resume_changed_pieces` is set.
    piece_sources: tuple[tuple[str, str, str], ...] = ()
    resume_changed_pieces: bool = False
    model: ModelConfig = _section(ModelConfig)
    pretrained: PretrainedConfig = _section(PretrainedConfig)
    tokenizer: TokenizerConfig = _section(TokenizerConfig)
    task: ArithmeticTaskConfig = _section(ArithmeticTaskConfig)
    sft: SFTConfig = _section(SFTConfig)
    rl: RLConfig = _section(RLConfig)
    reward: RewardConfig = _section(RewardConfig)
    data: DataConfig = _section(DataConfig)
    eval: EvalConfig = _section(EvalConfig)
    mesh: MeshConfig = _section(MeshConfig)
    distributed: DistributedConfig = _section(DistributedConfig)
    checkpoint: CheckpointConfig = _section(CheckpointConfig)
    plan: PlanConfig = _section(PlanConfig)
    log: LogConfig = _section(LogConfig)
    env: EnvConfig = _section(EnvConfig)  # multi-turn episodes with tools (jaxrl.envs); env.name null: single-turn

    @property
    def completion_tokens(self) -> int:
        """Tokens a sequence may have after its prompt: an episode's `env.max_tokens` (model and observation
        tokens) in a multi-turn run, else `rl.sampling.max_new_tokens`."""
        return self.env.max_tokens if self.env.multi_turn else self.rl.sampling.max_new_tokens

    def component_weights(self) -> dict[str, float]:
        """The reward components' weights (`RewardConfig.component_weights`), and in a multi-turn run the
        environment's rewards (`env`, weight 1) last."""
        weights = self.reward.component_weights()
        if self.env.multi_turn:
            weights["env"] = 1.0
        return weights

    def pieces(self) -> dict[str, registry.Entry]:
        """Config field -> the registry entry it names: every named reward (`reward.function`, one
        `reward.extra.<name>` per extra reward, `eval.reward` when set), writer (`log.writers`), objective, ratio,
        estimator, loss term, environment (`env.name`) and tool (`env.tools`)."""
        pieces = {"reward.function": registry.resolve("reward", self.reward.function, "reward.function")}
        for name in self.reward.extra:
            field = f"reward.extra.{name}"
            try:
                pieces[field] = registry.resolve("reward", name, field)
            except registry.RegistryError as e:  # the field holds a colon: name it for the file:line lookup
                raise registry.RegistryError(str(e), field=field) from None
        if self.eval.reward is not None:
            pieces["eval.reward"] = registry.resolve("reward", self.eval.reward, "eval.reward")
        pieces.update({f"log.writers[{i}]": registry.resolve("writer", name, f"log.writers[{i}]")
                       for i, name in enumerate(self.log.writers)})
        if self.env.name is not None:
            pieces["env.name"] = registry.resolve("environment", self.env.name, "env.name")
        pieces.update({f"env.tools[{i}]": registry.resolve("tool", name, f"env.tools[{i}]")
                       for i, name in enumerate(self.env.tools)})
        return {**pieces, **self.rl.loss.pieces("rl.loss")}

    def check_pieces(self) -> None:
        """Check what every named piece needs against the rest of the config (`configlib` imported `imports:`
        before building any section, so the names they register resolve)."""
        pieces = self.pieces()
        estimator, needs = self.rl.loss.advantage.estimator, pieces["rl.loss.advantage.estimator"].needs
        if "critic" in needs and self.rl.critic.model == "none":
            without = [n for n in registry.names("advantage")
                           if "critic" not in registry.resolve("advantage", n, "").needs]
            raise registry.RegistryError(
                f"rl.critic.model: advantage estimator {estimator!r} needs a critic, but critic.model is 'none'; "
                f"set critic.model to 'policy_copy', or choose an estimator without one: {', '.join(without)}")
        if self.rl.critic.model != "none" and "critic" not in needs:
            using = [n for n in registry.names("advantage") if "critic" in registry.resolve("advantage", n, "").needs]
            raise registry.RegistryError(f"rl.critic.model is {self.rl.critic.model!r} but advantage estimator "
                                         f"{estimator!r} does not use values; estimators that do: {', '.join(using)}",
                                         field="rl.critic.model")
        if "binary_rewards" in needs and (set(self.reward.component_weights()) != {"correct"}
                                          or not pieces["reward.function"].info.get("binary")):
            raise registry.RegistryError(
                f"rl.loss.advantage.estimator: estimator {estimator!r} splits each group by binary outcome rewards "
                f"(right or wrong): it cannot take shaped rewards (reward.format_weight, overlong_buffer, "
                f"length_target) or a reward that is not registered as binary, such as the code reward's pass "
                f"fraction (reward.function {self.reward.function!r})")
        if self.rl.loss.needs_answers and not pieces["reward.function"].info.get("answers"):  # issue 35: seed_grpo
            raise registry.RegistryError(
                f"rl.loss.advantage.estimator: estimator {estimator!r} clusters each group by its extracted final "
                f"answers; reward.function {self.reward.function!r} is not registered with answers=True (math "
                "and arithmetic are)", field="rl.loss.advantage.estimator")
        self.check_self_rewards(pieces)

    def check_self_rewards(self, pieces: Mapping[str, registry.Entry]) -> None:
        """Issue 35, self-rewarding signals: where a self-reward (`jaxrl.rewards.self_rewarding`, registered with
        `self_reward=`) may be named, its weight, and the run settings it cannot work with; a
        `registry.RegistryError` naming the field otherwise."""
        for field in ("reward.function", "eval.reward"):
            entry = pieces.get(field)
            if entry is not None and entry.info.get("self_reward"):
                raise registry.RegistryError(
                    f"{field}: {entry.name!r} is a self-reward, computed by the RL loop from the policy's own samples "
                    f"or distribution, not a verifiable reward: name it under reward.extra (e.g. "
                    f"reward.extra.{entry.name}=1.0, with reward.function_weight=0 to train on it alone)", field=field)
        weights = self.component_weights()
        if not any(w != 0 for w in weights.values()):
            raise registry.RegistryError(
                "reward.function_weight: every reward component has weight 0 (reward.function_weight = 0 and no "
                "other weighted component): the total reward is constant, there is nothing to train on",
                field="reward.function_weight")
        selfish = {name: pieces[f"reward.extra.{name}"] for name in self.reward.extra
                   if pieces[f"reward.extra.{name}"].info.get("self_reward")}
        for name, entry in selfish.items():
            weight = self.reward.extra[name]
            if not (math.isfinite(weight) and weight >= 0):
                raise registry.RegistryError(
                    f"reward.extra.{name}: the weight of the self-reward {name!r} must be a finite number >= 0 (a "
                    f"negative one trains away from the policy's own consensus or confidence), got {weight}",
                    field=f"reward.extra.{name}")
            kind = entry.info["self_reward"]
            if kind == "group" and self.rl.group_size < 2:
                raise registry.RegistryError(
                    f"rl.group_size: the self-reward {name!r} votes over each prompt's group of samples; a group "
                    f"of {self.rl.group_size} has no vote", field="rl.group_size")
            if "greedy_rollouts" in pieces["rl.loss.advantage.estimator"].needs:
                raise registry.RegistryError(
                    f"rl.loss.advantage.estimator: {self.rl.loss.advantage.estimator!r} scores one greedy completion "
                    f"per prompt as its baseline; the self-reward {name!r} has no group (or per-token statistics) "
                    "for it", field="rl.loss.advantage.estimator")
            if kind == "token" and self.rl.dynamic_sampling.enabled:
                raise registry.RegistryError(
                    f"rl.dynamic_sampling.enabled: the self-reward {name!r} needs the rollout's per-token statistics, "
                    "which dynamic sampling's rounds select groups before computing", field="rl.dynamic_sampling.enabled")
            if kind == "token" and self.rl.packing.enabled:
                raise registry.RegistryError(
                    f"rl.packing.enabled: the self-reward {name!r} reads per-token statistics that only the padded "
                    "log-prob pass computes; turn packing off", field="rl.packing.enabled")

    def check_partial_rollouts(self) -> None:
        """The sampler settings a carried completion cannot continue under: a `ValueError` naming the field."""
        if self.env.multi_turn:
            raise ValueError(f"rl.partial_rollouts with env.name {self.env.name!r}: a multi-turn episode's state "
                             "(its environment and turns) is not carried between steps; turn partial rollouts off")
        if self.tokenizer.stop_strings:
            raise ValueError("rl.partial_rollouts with tokenizer.stop_strings: a stop string split by a segment "
                             "boundary would not end its completion; use stop tokens (tokenizer.stop_tokens) or "
                             "turn partial rollouts off")
        if self.rl.sampling.policy_logp:
            raise ValueError("rl.partial_rollouts with rl.sampling.policy_logp: the carried completions keep only "
                             "sampler_logp; turn one of them off")
        if "greedy_rollouts" in self.pieces()["rl.loss.advantage.estimator"].needs:
            raise ValueError(f"rl.partial_rollouts with rl.loss.advantage.estimator "
                             f"{self.rl.loss.advantage.estimator!r}: its greedy baseline is one completion by the "
                             "policy that sampled the group, which a carried group does not have")

    def validate(self) -> None:
        if not self.output_dir.strip():
            raise ValueError("output_dir is empty: name the run's directory")
        self.check_pieces()
        buffer, max_new = self.reward.overlong_buffer, self.completion_tokens
        if buffer is not None and buffer > max_new:
            limit = "env.max_tokens" if self.env.multi_turn else "rl.sampling.max_new_tokens"
            raise ValueError(f"reward.overlong_buffer ({buffer}) exceeds {limit} ({max_new})")
        if self.data.train_file is not None and self.sft.steps and not self.data.has_demonstrations:
            raise ValueError(f"sft.steps is {self.sft.steps}, but a prompt file (data.train_file) gives the warm "
                             "start no demonstrations: set data.solution_field (a row field with worked "
                             "solutions), use data.format: messages (the last assistant message), or set "
                             "sft.steps=0")
        if self.rl.partial_rollouts.enabled:
            self.check_partial_rollouts()
        if self.data.system_prompt is not None and not self.data.chat_template:
            raise ValueError("data.system_prompt needs data.chat_template: true")
        if self.pretrained.path is None and self.tokenizer.vocab_size > self.model.vocab_size:
            raise ValueError(f"tokenizer.vocab_size ({self.tokenizer.vocab_size}) exceeds "
                             f"model.vocab_size ({self.model.vocab_size})")
