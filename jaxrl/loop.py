"""The RL run, top to bottom: tokenizer -> warm start -> held-out eval -> RL -> held-out eval.

This module is the imperative edge: it owns I/O (files, progress bars, reward processes, checkpoints) and
calls the pure jitted pieces (`sampling.sample`, `losses.prepare_batch`, `train.make_*_step`). The objective
is `config.rl.loss` (any preset or composition of `jaxrl.losses`), or a loss term passed to `run(loss=...)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxrl import models
from jaxrl import configlib, dynamic_sampling, evaluation, losses, rewards
from jaxrl.checkpoint import Checkpointer, NonFiniteState
from jaxrl.config import Config, OptimConfig
from jaxrl.convert import RUN_MODEL_FILE, describe_source, load_policy
from jaxrl.data import arithmetic
from jaxrl.data.batching import shuffled_batches
from jaxrl.data.prompts import DataError, load_prompts
from jaxrl.metrics import MetricsWriter, build_mirrors, plot_run, read_metrics
from jaxrl.samples import completion_records, write_completions
from jaxrl.losses import Controls, Term
from jaxrl.sampling import FINISH_LENGTH, Rollout, SamplingConfig, compiled_programs, sample, stop_sequences_for
from jaxrl.sharding import (allgather, data_shard, from_process_local, gather, initialize_distributed, is_primary,
                            layout_from, process_local, process_max, process_rows, replicate, shard_batch,
                            wait_for_all_processes)
from jaxrl.tokenizer import (BaseTokenizer, ChatTemplateError, TokenizerError, encode_examples, encode_prompt,
                             left_pad, load_tokenizer, round_up, train_tokenizer)
from jaxrl.train import (TrainState, by_micro_batches, completion_logprobs, copy_arrays, critic_values, init_critic, init_train_state,
                         make_optimizer, make_rl_step, make_sft_step)
from jaxrl.models.hf import CheckpointError

log = logging.getLogger("jaxrl")

RewardFn = Callable[[str, str], float]  # (completion, reference) -> reward


def optimizer_from(config: OptimConfig):
    return make_optimizer(**dataclasses.asdict(config))


class TrainingDiverged(RuntimeError):
    """Too many consecutive RL steps had a non-finite loss or gradient (`rl.max_consecutive_skips`)."""


@dataclasses.dataclass(frozen=True)
class Generation:
    """One `Generator` call. In a multi-host run each process has the rows of its own prompts."""

    rollout: Rollout  # global arrays on the mesh, rows split over the data axes
    local: Rollout  # this process's rows of it, as numpy
    texts: list[str]  # decoded completions of `local`


@dataclasses.dataclass
class Generator:
    """Host-side wrapper around the jitted sampler: text prompts in, rollouts and texts out.

    With `chat_template`, each prompt becomes the user turn (after an optional system turn) of the
    tokenizer's chat template, ending with the assistant's generation prompt.
    """

    tokenizer: BaseTokenizer
    prompt_lengths: tuple[int, ...]  # padded prompt lengths, ascending: one compiled program per length
    mesh: jax.sharding.Mesh
    chat_template: bool = False
    system_prompt: str | None = None
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # token sequences that end a completion

    @classmethod
    def fitting(cls, prompts: Sequence[str], tokenizer: BaseTokenizer, mesh, chat_template: bool = False,
                system_prompt: str | None = None, buckets: int = 4,
                stop_strings: Sequence[str] = ()) -> "Generator":
        """A generator whose longest padded prompt length fits every one of `prompts`, with `buckets`
        lengths in all (`prompt_length_buckets`), stopping at `stop_strings` (`stop_sequences_for`)."""
        generate = cls(tokenizer, (), mesh, chat_template, system_prompt,
                       stop_sequences_for(tokenizer, stop_strings))
        longest = max(map(len, map(generate.prompt_tokens, prompts)))
        return dataclasses.replace(generate, prompt_lengths=prompt_length_buckets(longest, buckets))

    @property
    def prompt_length(self) -> int:
        """The longest padded prompt length."""
        return self.prompt_lengths[-1]

    def render(self, prompt: str) -> str:
        """The text the model sees for a task prompt."""
        if not self.chat_template:
            return prompt
        system = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        return self.tokenizer.apply_chat_template([*system, {"role": "user", "content": prompt}])

    def prompt_tokens(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, self.render(prompt), templated=self.chat_template)

    def __call__(self, policy, prompts: Sequence[str], rng, config: SamplingConfig,
                 temperature=None, group_size: int = 1) -> Generation:
        """Rollout rows `p * group_size + g`: sample g of `prompts[p]` (each prompt prefilled once).

        `prompts`: this process's prompts (all of them in a single-process run); every process passes as many.
        """
        rows = [self.prompt_tokens(p) for p in prompts]
        longest = process_max(max(map(len, rows)))  # every process pads to the same length
        length = next((n for n in self.prompt_lengths if n >= longest), self.prompt_length)
        tokens, valid = left_pad(rows, length, self.tokenizer.pad_id, prompts)
        parallel = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        if (len(prompts) * data_shard(self.mesh)[1]) % parallel:  # prompts do not split over the mesh: share
            tokens, valid, group_size = np.repeat(tokens, group_size, 0), np.repeat(valid, group_size, 0), 1
        tokens, valid = from_process_local((tokens, valid), self.mesh)
        rollout = sample(policy, tokens, valid, rng, config, self.tokenizer.stop_ids, self.tokenizer.pad_id,
                         temperature, group_size=group_size, stop_sequences=self.stop_sequences)
        local = process_local(rollout, self.mesh)
        return Generation(rollout, local, [self.tokenizer.decode(row) for row in local.completion_tokens])


def prompt_length_buckets(longest: int, count: int, multiple: int = 8) -> tuple[int, ...]:
    """Up to `count` padded prompt lengths, ascending: `longest` rounded up to `multiple`, then its successive
    halves (rounded up likewise, distinct, at least `multiple`). A batch is padded to the shortest that fits
    its longest prompt, so a run compiles at most `count` sampler programs per batch size while a batch of
    short prompts does not pay for the longest prompt of the data set (at most 2x padding beyond a bucket)."""
    lengths = {round_up(max(-(-longest // 2**i), 1), multiple) for i in range(count)}
    return tuple(sorted(lengths))


def _process_batches(problems, size: int, mesh):
    """Batches of `size` problems, the last padded by repeating its final problem (one compiled program for
    all), each as `(start, chunk, mine, real)`: the unpadded problems, this process's rows of the padded
    batch, and how many of those rows are real problems rather than padding."""
    rows = process_rows(size, mesh)
    for start in range(0, len(problems), size):
        chunk = list(problems[start:start + size])
        mine = (chunk + [chunk[-1]] * (size - len(chunk)))[rows]
        yield start, chunk, mine, max(0, min(len(chunk), rows.stop) - rows.start)


def evaluate(policy, generate: Generator, problems, pool: rewards.RewardPool, batch_size: int,
             max_new_tokens: int, completions: list | None = None) -> dict[str, float]:
    """Greedy accuracy on `problems`; every batch is padded to `batch_size` so one program serves all.
    Each process samples and scores its rows of every batch; the scores are gathered. `completions`, when
    given, is extended with one `samples.completion_records` row per problem this process sampled."""
    greedy = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    start, scores, lengths, sample_text = time.perf_counter(), [], [], None
    for _, chunk, padded, real in _process_batches(problems, batch_size, generate.mesh):
        generation = generate(policy, [p.prompt for p in padded], jax.random.key(0), greedy)
        local_scores = np.zeros(len(padded), np.float32)
        if real:
            local_scores[:real] = pool.score(generation.texts[:real], [p.reference for p in padded[:real]]).rewards
        row_lengths = generation.local.completion_mask.sum(1).astype(np.float32)
        all_scores, all_lengths = gather((local_scores, row_lengths), generate.mesh)
        scores += all_scores[:len(chunk)].tolist()
        lengths += all_lengths[:len(chunk)].tolist()
        if completions is not None:
            completions += completion_records([p.prompt for p in padded[:real]], [p.reference for p in padded[:real]],
                                              generation.texts[:real], local_scores[:real], row_lengths[:real])
        if sample_text is None and generation.texts:
            sample_text = generation.texts[0]
    return {"eval/accuracy": float(np.mean(scores)), "eval/completion_length": float(np.mean(lengths)),
            "eval/num_problems": len(problems), "eval/seconds": time.perf_counter() - start,
            "eval/sample": sample_text}


def evaluate_sampled(policy, generate: Generator, problems, pool: rewards.RewardPool, config: Config,
                     key: jax.Array) -> dict[str, float]:
    """pass@k and maj@k on `problems`: `config.eval.samples` completions of each at `config.eval.temperature`
    (one prefill per problem, its samples sharing its KV cache), scored by the run's reward; a completion is
    correct when its verifiable reward is 1. maj@k votes on the normalised extracted answers (math and
    arithmetic rewards; none for code)."""
    e = config.eval
    settings = dataclasses.replace(config.rl.sampling, temperature=e.temperature)
    per_call = max(1, e.batch_size // e.samples)  # problems per sampler call
    start, correct, votes = time.perf_counter(), [], []
    with_answers = bool(config.pieces()["reward.function"].info.get("answers"))
    for i, chunk, padded, real in _process_batches(problems, per_call, generate.mesh):
        generation = generate(policy, [p.prompt for p in padded], jax.random.fold_in(key, i), settings,
                              group_size=e.samples)
        texts = generation.texts[:real * e.samples]
        local = np.zeros((len(padded), e.samples), bool)
        if real:
            scores = pool.score(texts, [p.reference for p in padded[:real] for _ in range(e.samples)]).rewards
            local[:real] = scores.reshape(real, e.samples) >= 1.0
        local_votes = np.zeros((len(padded), len(e.pass_k)), bool)
        if with_answers:
            for p in range(real):
                answers = [_answer_key(t) for t in texts[p * e.samples:(p + 1) * e.samples]]
                local_votes[p] = [evaluation.majority_correct(answers[:k], local[p, :k]) for k in e.pass_k]
        all_correct, all_votes = gather((local, local_votes), generate.mesh)
        correct.append(all_correct[:len(chunk)])
        votes.append(all_votes[:len(chunk)])
    metrics = evaluation.sampled_metrics(np.concatenate(correct), e.pass_k)
    if with_answers:
        metrics.update({f"eval/maj@{k}": float(v) for k, v in zip(e.pass_k, np.concatenate(votes).mean(0))})
    metrics.update({"eval/samples": e.samples, "eval/temperature": e.temperature,
                    "eval/sampling/seconds": time.perf_counter() - start})
    return metrics


def _answer_key(text: str) -> str | None:
    answer = rewards.extract_answer(text)
    return None if answer is None else rewards.normalize_answer(answer)


def warm_start(policy, config: Config, generate: Generator, train_problems, writer: MetricsWriter) -> TrainState:
    """Supervised steps on sloppy-teacher demonstrations (see `jaxrl.data.arithmetic`).

    The steps donate their state, so `policy`'s arrays are consumed: use the returned state's policy.
    """
    optimizer = optimizer_from(config.sft.optim)
    state = init_train_state(policy, optimizer)
    step_fn = make_sft_step(optimizer, donate=True)
    examples = arithmetic.teacher_examples(train_problems, config.task, config.seed)
    # step n: the record of the n-th update, counted from 1 as RL's steps are
    bar = tqdm(range(1, config.sft.steps + 1), desc="warm start", disable=not config.progress, dynamic_ncols=True)
    for step in bar:
        prompts, solutions = zip(*(next(examples) for _ in range(config.sft.batch_size)))
        tokens, prompt_valid, mask = encode_examples(generate.tokenizer, [generate.render(p) for p in prompts],
                                                     solutions, generate.prompt_length,
                                                     templated=generate.chat_template)
        batch = shard_batch({"tokens": tokens, "prompt_valid": prompt_valid, "completion_mask": mask},
                            generate.mesh)
        state, metrics = step_fn(state, batch)
        if step % 25 == 0 or step in (1, config.sft.steps):
            metrics = jax.device_get(metrics)
            writer.write({"phase": "sft", "step": step, **metrics})
            bar.set_postfix(loss=f"{metrics['loss']:.3f}")
    return state


def rollout_batch(state: TrainState, logprob_fn, value_fn, rollout: Rollout, loss_config: losses.LossConfig,
                  controls: Controls, ref_policy=None) -> dict:
    """A rollout (global arrays on the mesh) with what the objective needs from the sampling-time models
    `[B, N]`: `old_logp` always, `entropy`, `ref_logp` (frozen warm-start policy) and `old_values` (critic)
    when used.

    The device computations are only dispatched here: the device runs them while the host scores the
    rewards of the same rollout.
    """
    batch = {"tokens": rollout.tokens, "prompt_valid": rollout.prompt_valid,
             "completion_mask": rollout.completion_mask, "sampler_logp": rollout.sampler_logp,
             "truncated": rollout.finish_reason == FINISH_LENGTH}
    tokens, prompt_valid = batch["tokens"], batch["prompt_valid"]
    batch["old_logp"], entropy = logprob_fn(state.policy, tokens, prompt_valid, controls.temperature)
    if loss_config.needs_entropy:
        batch["entropy"] = entropy
    if loss_config.needs_ref_logp:
        batch["ref_logp"] = logprob_fn(ref_policy, tokens, prompt_valid, controls.temperature)[0]
    if state.critic is not None:
        batch["old_values"] = value_fn(state.critic, tokens, prompt_valid)
    return batch


@dataclasses.dataclass(frozen=True)
class RolloutResult:
    """One step's prompts, completions and (when scored where they were sampled) rewards, with timings; with
    rl.overlap also the log-probs (and values) of the models that sampled it."""

    problems: list
    generation: Generation
    scored: rewards.RewardResult | None
    sample_s: float
    reward_s: float
    metrics: dict[str, float]  # dynamic sampling's
    batch: dict | None = None  # `rollout_batch` under the sampling-time models (rl.overlap), else None
    logprobs_s: float = 0.0  # the wait for that batch after scoring
    greedy_rewards: np.ndarray | None = None  # ReMax's baseline [P * G] (this process's rows), else None


def _dynamic_result(rounds, informative, generate: Generator, group_size: int, sample_s: float,
                    reward_s: float) -> RolloutResult:
    """The batch of `dynamic_sampling.select_groups` assembled from the rounds `(problems, generation,
    scored)`, with its metrics (this process's: rounds, first round's informative share, groups filled)."""
    quota = len(rounds[0][0])
    selection = dynamic_sampling.select_groups(informative, quota)
    local = dynamic_sampling.assemble([g.local for _, g, _ in rounds], selection, group_size,
                                      generate.tokenizer.pad_id)
    problems = [rounds[r][0][g] for r, g in selection.groups]
    texts = [rounds[r][1].texts[g * group_size + i] for r, g in selection.groups for i in range(group_size)]
    scores = [rounds[r][2] for r in range(len(rounds))]
    scored = rewards.RewardResult(
        np.concatenate([scores[r].rewards[g * group_size:(g + 1) * group_size] for r, g in selection.groups]),
        sum(s.timeouts for s in scores), sum(s.errors for s in scores), sum(s.seconds for s in scores))
    global_rollout = from_process_local(tuple(x for x in local if x is not None), generate.mesh)
    rollout = Rollout(*global_rollout, *(None,) * (len(Rollout._fields) - len(global_rollout)))
    metrics = {"dynamic/rounds": float(len(rounds)), "dynamic/informative_frac": float(informative[0].mean()),
               "dynamic/filled_groups": float(selection.filled), "dynamic/prompts_sampled": float(quota * len(rounds)),
               # the reward of the batch as sampled: reward/mean is over the selected (informative) groups
               "dynamic/sampled_reward_mean": float(np.mean(scores[0].rewards))}
    return RolloutResult(problems, Generation(rollout, local, texts), scored, sample_s, reward_s, metrics)


def prompt_statistics(correct: np.ndarray, group_size: int) -> dict[str, float]:
    """Per-prompt view of a batch's `[P * G]` verifiable rewards: the share of prompts all of whose samples
    were correct, none, and the mean over prompts of the per-prompt accuracy's spread (std)."""
    groups = np.asarray(correct, np.float64).reshape(-1, group_size)
    solved = groups > 0.5
    return {"prompts/all_correct_frac": float(solved.all(axis=1).mean()),
            "prompts/none_correct_frac": float((~solved).all(axis=1).mean()),
            "prompts/reward_std_mean": float(groups.std(axis=1).mean())}


def step_timing(sample_s: float, reward_s: float, logprobs_s: float, update_s: float,
                idle_s: float) -> dict[str, float]:
    """Seconds per phase of an RL step (`time/*`, wall clock, written to timings.jsonl).

    sample_s, reward_s, logprobs_s: sampling, scoring and the wait for the log-probs (and values) after
    scoring (with rl.overlap all three ran in the background during the previous step's update); update_s:
    the optimizer steps; idle_s: the time the update side waited for its rollout (rl.overlap only).
    """
    return {"time/sample_s": sample_s, "time/reward_s": reward_s, "time/logprobs_s": logprobs_s,
            "time/update_s": update_s, "time/idle_s": idle_s}


# Metrics of an optimizer update as a whole, averaged over the updates without weighting by their tokens.
_PER_UPDATE_METRICS = ("skipped", "nonfinite_update", "grad_norm", "critic_grad_norm")


def rl_update(state, step_fn, batch: dict, controls: Controls, config: Config, step: int, ref_policy=None):
    """`epochs x minibatches` optimizer steps on one prepared rollout batch; returns (state, metrics over
    the steps: `losses.mean_over_updates`, weighted by each minibatch's loss tokens but for the updates' own
    `_PER_UPDATE_METRICS`).

    Minibatches are drawn by a permutation seeded by (seed, step).
    """
    size = batch["tokens"].shape[0] // config.rl.minibatches
    order_rng = np.random.default_rng([config.seed, 3, step])
    collected = []
    for _ in range(config.rl.epochs):
        order = order_rng.permutation(batch["tokens"].shape[0]) if config.rl.minibatches > 1 else None
        for m in range(config.rl.minibatches):
            minibatch = batch if order is None else jax.tree.map(
                lambda x: x[order[m * size:(m + 1) * size]], batch)
            state, metrics = step_fn(state, minibatch, controls, ref_policy)
            collected.append(metrics)
    # Averaged on the host: an eager program on the batch here (a token count, say) would run beside the
    # in-flight update, and two programs with cross-process collectives in flight at once can deadlock
    # multi-process CPU (gloo) runs.
    collected = jax.device_get(collected)
    tokens = [m.pop("loss_tokens") for m in collected]
    per_update = [{k: v for k, v in m.items() if k in _PER_UPDATE_METRICS} for m in collected]
    per_token = [{k: v for k, v in m.items() if k not in _PER_UPDATE_METRICS} for m in collected]
    return state, jax.device_get({**losses.mean_over_updates(per_token, tokens),
                                  **losses.mean_over_updates(per_update)})


def shaped_rewards(correct: np.ndarray, texts: Sequence[str], lengths: np.ndarray, config: Config
                   ) -> rewards.ComposedRewards:
    """The verifiable reward `correct [B]` composed with the shaping components `config.reward` enables
    (format reward of `texts`, DAPO overlong and length penalties of the completion `lengths` in tokens)."""
    r = config.reward
    components = {"correct": np.asarray(correct, np.float32)}
    if r.format_weight:
        components["format"] = np.array([rewards.format_reward(t, pattern=r.format_pattern) for t in texts],
                                        np.float32)
    if r.overlong_buffer is not None:
        components["overlong"] = rewards.dapo_overlong_penalty(lengths, config.rl.sampling.max_new_tokens,
                                                               r.overlong_buffer)
    if r.length_target is not None:
        components["length"] = rewards.length_penalty(lengths, r.length_target, r.length_penalty_coef)
    return rewards.compose(components, r.component_weights())


def update_controls(controls: Controls, entropy: float, config: losses.LossConfig) -> Controls:
    """One step of the entropy-coefficient and temperature controllers, from the policy's mean entropy (a
    non-finite one, as from a skipped step, leaves them as they are)."""
    if not math.isfinite(entropy):
        return controls
    if config.entropy_target is not None:
        controls = controls.replace(entropy_coef=losses.adapt_entropy_coef(
            controls.entropy_coef, entropy, config.entropy_target, config.entropy_coef_step,
            config.entropy_coef_max), entropy_below_target=np.float32(entropy < config.entropy_target))
    if config.temperature_target_entropy is not None:
        controls = controls.replace(temperature=losses.adapt_temperature(
            controls.temperature, entropy, config.temperature_target_entropy, config.temperature_rate,
            config.temperature_min, config.temperature_max))
    return controls


def load_task(config: Config) -> tuple[list, list, list[str], dict[str, int]]:
    """`(train, held_out, tokenizer corpus, counts)`: the built-in arithmetic task, or the prompt files of
    `config.data`. Items have `.prompt` and `.reference`; a file that cannot be used raises `DataError`
    naming the config field, the file, the line and the row field."""
    data = config.data
    if data.train_file is None:
        train, held_out = arithmetic.make_splits(config.task, config.seed)
        return train, held_out, arithmetic.tokenizer_corpus(train[:4000]), {}
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
    corpus = [r.prompt for r in train] + [r.reference for r in train] + [r.reference for r in loaded["eval_file"]]
    return train, loaded["eval_file"], corpus, counts


def run(config: Config, config_source: str = "", loss: Term | None = None,
        reward_fn: RewardFn | None = None) -> dict[str, Any]:
    """Train the recipe end to end; writes everything under `config.output_dir`.

    `loss` replaces the objective built from `config.rl.loss` (its batch preparation still follows the
    config): any `(LossInputs, Normalizers, Controls) -> (loss, metrics)` term, see `jaxrl.losses`.
    `reward_fn` replaces `config.reward.function` for training and the held-out evaluation: a
    `(completion, reference) -> float` function that spawned reward workers can import by name (defined in
    an importable module, not in `__main__`). The shaping of `config.reward` is composed with it as usual.
    With `rl.steps=0` the run saves the warm-started policy as checkpoint 0, so that later runs can start
    from it with `pretrained.path=<output_dir> sft.steps=0` (the run's tokenizer comes with it).
    """
    if config.pretrained.path is None and (config.tokenizer.path is not None or config.data.chat_template):
        raise ValueError("tokenizer.path and data.chat_template need pretrained.path: a randomly initialised "
                         "model trains with the sentencepiece tokenizer trained for it")
    wall_start = time.perf_counter()
    times: dict[str, float] = {}
    initialize_distributed(config.distributed)  # a no-op unless this is one process of a multi-host job
    config = dataclasses.replace(config, output_dir=os.path.expanduser(config.output_dir))  # "~/runs/x"
    out = config.output_dir
    resume_step = resume_point(config) if config.resume else None
    if resume_step is None:
        _check_fresh_output_dir(config)

    # Everything that can refuse the config runs before the output dir changes: data, mesh and batch sizes,
    # policy, tokenizer, prompt rendering, the critic and, to resume, the checkpoint itself.
    t0 = time.perf_counter()
    train_problems, eval_problems, corpus, data_totals = load_task(config)
    layout = layout_from(config.mesh)
    mesh = layout.mesh
    check_batch_sizes(config, dict(mesh.shape), data_shard(mesh)[1])
    if config.rl.overlap and jax.process_count() > 1:
        raise ValueError("rl.overlap runs the next step's sampling in a background thread, which is single-process "
                         f"for now; this run has {jax.process_count()} processes: set rl.overlap=false")
    policy, tokenizer, tokenizer_file = _policy_and_tokenizer(config, corpus, layout)
    if tokenizer.vocab_size > policy.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                         f"{policy.config.vocab_size} embeddings")
    generate = _generator(train_problems + eval_problems, tokenizer, mesh, config)
    critic_trunk = _critic_trunk(config, policy)
    resumed = None
    if resume_step is not None:  # the warm-started policy, its evaluation and the RL state come from the run
        checkpointer = Checkpointer(os.path.join(out, "checkpoints"), keep=config.checkpoint.keep)
        state, controls = _rl_start(config, policy, critic_trunk)
        keep_ref = config.rl.loss.needs_ref_logp or config.rl.loss.needs_full_kl
        try:
            resume_step, resumed, damaged = _restore_newest_intact(
                checkpointer, state, controls, state.policy if keep_ref else None)
            before = _recorded_evaluation(os.path.join(out, "metrics.jsonl"))
        except BaseException:
            checkpointer.close()
            raise

    os.makedirs(out, exist_ok=True)
    if resume_step is not None and damaged:  # out of the manager's sight, or it would not save steps below them
        checkpointer.close()
        if is_primary():
            _set_aside(checkpointer.directory, damaged, os.path.join(out, "damaged_checkpoints"))
        wait_for_all_processes("jaxrl: damaged checkpoints set aside")
        checkpointer = Checkpointer(os.path.join(out, "checkpoints"), keep=config.checkpoint.keep,
                                    intact=[resume_step])
    metrics_path = _metrics_path(out)  # each process keeps its own records: process_<i>/ for i > 0
    if resume_step is None:
        _remove_records(metrics_path)
    else:
        _truncate_metrics(metrics_path, resume_step)
    if is_primary():
        if resume_step is None:
            _prepare_output_dir(out)
        _keep_tokenizer(config, tokenizer, tokenizer_file)
        with open(os.path.join(out, "config.yaml"), "w") as f:
            f.write(configlib.dump_yaml(config))
        with open(os.path.join(out, RUN_MODEL_FILE), "w") as f:  # the model this run trains: read by load_policy
            f.write(configlib.dump_yaml(policy.config))
    times["data_time_s"] = time.perf_counter() - t0
    reward_fn = reward_fn or config.pieces()["reward.function"].fn
    max_new = config.rl.sampling.max_new_tokens
    eval_args = dict(batch_size=config.eval.batch_size, max_new_tokens=max_new)
    if resume_step is None:
        checkpointer = Checkpointer(os.path.join(out, "checkpoints"), keep=config.checkpoint.keep)

    with contextlib.ExitStack() as finally_close:
        finally_close.callback(checkpointer.close)  # on an error too: an async save in flight is finished
        writer = finally_close.enter_context(MetricsWriter(
            metrics_path, os.path.join(os.path.dirname(metrics_path), "timings.jsonl"),
            build_mirrors(config, out) if is_primary() else ()))
        pool = finally_close.enter_context(rewards.RewardPool(
            reward_fn, num_workers=config.reward.num_workers, timeout_s=config.reward.timeout_s,
            batch_timeout_s=config.reward.batch_timeout_s))
        if resume_step is None:
            t0 = time.perf_counter()
            # only the policy is kept: the warm start's optimizer state would otherwise live through RL
            policy = warm_start(policy, config, generate, train_problems, writer).policy
            times["sft_time_s"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            before = evaluate(policy, generate, eval_problems, pool, **eval_args)
            times["eval_before_time_s"] = time.perf_counter() - t0
            writer.write({"phase": "rl", "step": 0, **before})
            log.info("held-out greedy accuracy after the warm start: %.3f", before["eval/accuracy"])
        else:
            log.info("resuming %s after RL step %d", out, resume_step)

        t0 = time.perf_counter()
        state, controls, totals = _rl(policy, config, train_problems, eval_problems, generate, pool, writer,
                                      checkpointer, loss, resume_step, resumed, critic_trunk)
        times["rl_time_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        after = evaluate(state.policy, generate, eval_problems, pool, **eval_args)
        if config.eval.samples:
            after.update(evaluate_sampled(state.policy, generate, eval_problems, pool, config,
                                          jax.random.fold_in(jax.random.key(config.seed), 4)))
        times["eval_after_time_s"] = time.perf_counter() - t0
        writer.write({"phase": "rl", "step": config.rl.steps, "final": True, **after})

    if config.pretrained.path is not None and config.pretrained.export_hf:
        exported = state.policy.replace(params=allgather(state.policy.params), layout=None)  # whole on each process
        if is_primary():
            models.save_pretrained(exported, os.path.join(out, "hf"), base=_hf_files(config.pretrained.path),
                                   progress=config.progress)
    times["total_wall_time_s"] = time.perf_counter() - wall_start

    summary = {
        "accuracy_before_rl": before["eval/accuracy"],
        "accuracy_after_rl": after["eval/accuracy"],
        "accuracy_gain": after["eval/accuracy"] - before["eval/accuracy"],
        "num_eval_problems": len(eval_problems),
        "completion_length_before_rl": before["eval/completion_length"],
        "completion_length_after_rl": after["eval/completion_length"],
        **{k.removeprefix("eval/") + "_after_rl": v for k, v in after.items()
           if k.startswith(("eval/pass@", "eval/maj@"))},
        **times,
        **totals,
        **data_totals,
        "num_parameters": models.num_parameters(state.policy.config),
        "devices": [str(d) for d in jax.devices()],
        "processes": jax.process_count(),
        "mesh": dict(mesh.shape),
        "seed": config.seed,
        "config_source": config_source,
        "config": configlib.to_dict(config),
    }
    if is_primary():
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        plot_run(read_metrics(os.path.join(out, "metrics.jsonl")), os.path.join(out, "reward_accuracy.png"),
                 title=f"RL ({config.rl.loss.preset or 'custom'} loss) on "
                       f"{os.path.basename(config.data.train_file or '') or 'arithmetic chains'} "
                       f"(seed {config.seed})")
    return summary


def evaluate_checkpoint(config: Config, checkpoint: str, completions_file: str | None = None) -> dict[str, Any]:
    """Held-out evaluation of a saved policy (`jaxrl eval CONFIG checkpoint=PATH`): greedy accuracy and, with
    `eval.samples`, pass@k / maj@k, on the evaluation problems of `config` (task, data, reward, sampling).

    `checkpoint`: a run directory (its newest checkpoint), one of its `checkpoints/<step>`, a policy checkpoint
    or a Hugging Face directory. A run's tokenizer is its `tokenizer.model`; otherwise `tokenizer.path` or the
    checkpoint's own tokenizer files. `completions_file`: a JSONL of the greedy completion of every held-out
    problem (prompt, reference, completion, reward/correct, length; in a multi-process run, the primary
    process's share)."""
    initialize_distributed(config.distributed)
    _, eval_problems, _, _ = load_task(config)
    layout = layout_from(config.mesh)
    source = describe_source(checkpoint)
    try:
        policy = load_policy(checkpoint, layout=layout, progress=config.progress)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint: {e}") from None
    tokenizer, _ = _load_checkpoint_tokenizer(checkpoint, config, "checkpoint")
    generate = _generator(eval_problems, tokenizer, layout.mesh, config)
    with rewards.RewardPool(config.pieces()["reward.function"].fn, num_workers=config.reward.num_workers,
                            timeout_s=config.reward.timeout_s, batch_timeout_s=config.reward.batch_timeout_s) as pool:
        completions = [] if completions_file else None
        result = evaluate(policy, generate, eval_problems, pool, config.eval.batch_size,
                          config.rl.sampling.max_new_tokens, completions)
        if completions_file and is_primary():
            write_completions(completions_file, completions)
        if config.eval.samples:
            result.update(evaluate_sampled(policy, generate, eval_problems, pool, config,
                                           jax.random.fold_in(jax.random.key(config.seed), 4)))
    return {"checkpoint": os.path.abspath(checkpoint), "kind": source.kind, "step": source.step, **result}


def _critic_trunk(config: Config, policy: models.Policy) -> models.Policy | None:
    """The separately loaded network of `rl.critic.model=separate` (None otherwise), checked against the policy."""
    if config.rl.critic.model != "separate":
        return None
    path = config.rl.critic.checkpoint
    try:
        trunk = load_policy(path, layout=policy.layout)
    except CheckpointError as e:
        raise CheckpointError(f"rl.critic.checkpoint: {e}") from None
    if trunk.config.vocab_size < policy.config.vocab_size:
        raise ValueError(f"rl.critic.checkpoint {path}: its vocabulary has {trunk.config.vocab_size} tokens, fewer "
                         f"than the policy's {policy.config.vocab_size}; the critic reads the policy's token ids")
    log.info("critic: %s (%d layers, hidden %d)", path, trunk.config.num_layers, trunk.config.hidden_size)
    return trunk


def _rl_start(config: Config, policy: models.Policy, critic_trunk: models.Policy | None
              ) -> tuple[TrainState, Controls]:
    """The RL state and controls before the first step: `policy` with RL's optimizer and, with `rl.critic`, a
    value model on a copy of its trunk or on `critic_trunk` (`_critic_trunk`)."""
    rl = config.rl
    critic = critic_optimizer = None
    if rl.critic.model != "none":
        critic, critic_optimizer = init_critic(critic_trunk or policy), optimizer_from(rl.critic.optim)
    state = init_train_state(policy, optimizer_from(rl.optim), critic, critic_optimizer)
    return state, Controls.initial(rl.loss, rl.sampling.temperature)


def check_batch_sizes(config: Config, mesh_shape: dict[str, int], data_shards: int = 1) -> None:
    """Every batch of the run must split evenly over the data-parallel axes (`data` x `fsdp`), and the RL
    prompts over the `data_shards` processes that load distinct rows: raise a `ValueError` naming the config
    fields and the numbers otherwise, before anything is compiled or written."""
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
            raise ValueError(f"{name} = {rows} rows do not split over {where}; use a multiple of {parallel}")
    if config.rl.prompts_per_step % data_shards:
        raise ValueError(f"rl.prompts_per_step ({config.rl.prompts_per_step}) does not split over the "
                         f"{data_shards} data shards of the processes (one per process holding distinct rows of "
                         "the batch)")


def _metrics_path(out: str) -> str:
    """`<out>/metrics.jsonl`; in a multi-host run, process i > 0 records what it saw under `process_<i>/`."""
    if is_primary():
        return os.path.join(out, "metrics.jsonl")
    directory = os.path.join(out, f"process_{jax.process_index()}")
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, "metrics.jsonl")


def _policy_and_tokenizer(config: Config, corpus: list[str], layout: models.Layout
                          ) -> tuple[models.Policy, BaseTokenizer, str | None]:
    """The pretrained checkpoint and its tokenizer, or a fresh `config.model` and a sentencepiece tokenizer
    trained on the task's text; the policy placed by `layout`. Writes nothing: the third item is the
    tokenizer file the run keeps (`_keep_tokenizer`), None for a trained tokenizer."""
    stop_tokens = config.tokenizer.stop_tokens
    if config.pretrained.path is None:
        saved = os.path.join(config.output_dir, "tokenizer.model")
        if config.resume and os.path.exists(saved):  # the resumed run's own tokenizer
            tokenizer = load_tokenizer(saved, stop_tokens=stop_tokens)
        else:
            try:
                tokenizer = train_tokenizer(corpus, config.tokenizer.vocab_size, stop_tokens=stop_tokens)
            except RuntimeError as e:  # sentencepiece's trainer: "Vocabulary size is smaller than required_chars"
                raise TokenizerError(f"tokenizer.vocab_size={config.tokenizer.vocab_size}: sentencepiece cannot "
                                     f"train on the task's text: {str(e).splitlines()[-1]}") from None
        return models.shard(models.init(config.model, config.seed), layout), tokenizer, None
    pretrained = config.pretrained
    try:
        policy = load_policy(pretrained.path, dtype=pretrained.dtype, compute_dtype=pretrained.compute_dtype,
                             layout=layout, progress=config.progress)
    except CheckpointError as e:
        raise CheckpointError(f"pretrained.path: {e}") from None
    policy = models.replace_config(policy, attention_impl=pretrained.attention_impl, remat=pretrained.remat)
    tokenizer, tokenizer_file = _load_checkpoint_tokenizer(pretrained.path, config, "pretrained.path")
    log.info("loaded %s (%s, %.1fM parameters) and its tokenizer (%d tokens, stop ids %s)", pretrained.path,
             policy.config.family, models.num_parameters(policy.config) / 1e6, tokenizer.vocab_size,
             tokenizer.stop_ids)
    return policy, tokenizer, tokenizer_file if tokenizer_file.endswith(".model") else None


def _load_checkpoint_tokenizer(checkpoint: str, config: Config, field: str) -> tuple[BaseTokenizer, str]:
    """The tokenizer of `checkpoint` (`_tokenizer_files`) with `tokenizer.stop_tokens`, and the path it came
    from; a `CheckpointError` naming `field` (or `tokenizer.path` when set) if there is none."""
    configured = config.tokenizer.path
    path = _tokenizer_files(checkpoint, configured)
    if path is None:
        raise CheckpointError(f"{field}: {checkpoint} holds no tokenizer files: set tokenizer.path")
    try:
        path = os.path.expanduser(path)
        return load_tokenizer(path, stop_tokens=config.tokenizer.stop_tokens), path
    except (FileNotFoundError, NotADirectoryError) as e:
        where = "tokenizer.path" if configured else field
        hint = "" if configured else "; set tokenizer.path"
        raise CheckpointError(f"{where}: {e}{hint}") from None


def _generator(problems, tokenizer: BaseTokenizer, mesh, config: Config) -> Generator:
    """The sampler front end for `problems`' prompts (rendered, encoded and bucketed now: a template that
    refuses them fails here, naming `data.chat_template`)."""
    try:
        return Generator.fitting([p.prompt for p in problems], tokenizer, mesh, config.data.chat_template,
                                 config.data.system_prompt, config.data.prompt_buckets, config.tokenizer.stop_strings)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"data.chat_template: {e}") from None


def _keep_tokenizer(config: Config, tokenizer: BaseTokenizer, tokenizer_file: str | None) -> None:
    """Write the run's `tokenizer.model` (as `jaxrl eval` and `pretrained.path=<run>` expect): the trained one,
    or a copy of the pretrained sentencepiece file; an HF tokenizer stays with the checkpoint it came from."""
    saved = os.path.join(config.output_dir, "tokenizer.model")
    if config.pretrained.path is None:
        if not (config.resume and os.path.exists(saved)):
            tokenizer.save(saved)
    elif tokenizer_file is not None and not (os.path.exists(saved) and os.path.samefile(tokenizer_file, saved)):
        shutil.copyfile(tokenizer_file, saved)


def _tokenizer_files(path: str, configured: str | None) -> str | None:
    """The tokenizer for a checkpoint: `configured` (`tokenizer.path`) when set, else a run's own
    `tokenizer.model` (the one it trained with), else the checkpoint's HF tokenizer files (None: none)."""
    if configured:
        return configured
    source = describe_source(path)
    if source.kind == "run":
        return os.path.join(os.path.dirname(os.path.dirname(source.directory)), "tokenizer.model")
    return _hf_files(path)


def _hf_files(path: str) -> str | None:
    """The directory with the tokenizer and HF config files of a checkpoint: an HF directory itself, the
    `hf_files/` a policy checkpoint kept from one; None for a run."""
    source = describe_source(path)
    files = {"hf": source.directory, "policy": os.path.join(source.directory, "hf_files")}.get(source.kind)
    return files if files is not None and os.path.isdir(files) else None


def _rl(warm_policy, config: Config, train_problems, eval_problems, generate, pool, writer, checkpointer,
        loss: Term | None = None, resume_step: int | None = None,
        resumed: tuple | None = None, critic_trunk: models.Policy | None = None):
    """RL from `warm_policy` (the warm-started policy), or from `resumed` (`_restore`'s result for
    `resume_step`; `warm_policy` is then unused).

    The optimizer steps donate the state (`make_rl_step`), so `warm_policy`'s arrays are consumed, but for
    `rl.overlap`, whose background rollout samples with the state that the update is given.
    """
    rl, loss_config = config.rl, config.rl.loss
    optimizer = optimizer_from(rl.optim)
    with_critic = rl.critic.model != "none"
    critic_optimizer = optimizer_from(rl.critic.optim) if with_critic else None
    full_kl = loss_config.needs_full_kl
    step_args = dict(micro_batches=rl.micro_batches, norm_length=loss_config.norm_length or rl.sampling.max_new_tokens,
                     critic_optimizer=critic_optimizer, full_kl=full_kl)
    objective = loss or losses.build_loss(loss_config, with_critic=with_critic)
    step_args["donate"] = not rl.overlap
    step_fn = make_rl_step(optimizer, objective, **step_args)
    warmup_fn = make_rl_step(optimizer, objective, update_policy=False, **step_args) if with_critic else None
    # the rollout's log-probs and values in rl.micro_batches groups of rows: the train step's activation bound
    logprob_fn = jax.jit(by_micro_batches(completion_logprobs, rl.micro_batches))
    value_fn = jax.jit(by_micro_batches(critic_values, rl.micro_batches))
    component_weights = config.reward.component_weights()  # name -> weight; the `[B, K]` columns' order
    prepare = jax.jit(functools.partial(losses.prepare_batch, loss_config, group_size=rl.group_size,
                                        component_weights=tuple(component_weights.values())))
    keep_ref = loss_config.needs_ref_logp or full_kl
    first_step = 1
    # The KL terms' frozen warm-start policy (None: no KL term), in its own arrays: the steps donate the state's.
    if resumed is None:
        state, controls = _rl_start(config, warm_policy, critic_trunk)
        ref_policy = copy_arrays(warm_policy) if keep_ref else None
    else:
        state, controls, ref_policy, metadata = resumed
        first_step = resume_step + 1
    shard, shards = data_shard(generate.mesh)  # rl.prompts_per_step splits over them: check_batch_sizes
    prompts_iter = shuffled_batches(train_problems, rl.prompts_per_step // shards, config.seed, (shard, shards))
    if resume_step is not None:
        prompts_iter.set_state(metadata["prompt_iterator"])

    preempted = _PreemptionFlag()
    rl_key = jax.random.fold_in(jax.random.key(config.seed), 2)  # sampling; 3: minibatch order, 4: sampled evaluation
    loss_key = jax.random.fold_in(jax.random.key(config.seed), 5)  # the loss's own draws (Clip-Cov)
    totals = {"reward_timeouts_total": 0, "reward_errors_total": 0, "skipped_updates_total": 0}
    consecutive_skips = 0
    if resume_step is not None:  # the run's counts so far (checkpoints before 2026-11-23 did not save them)
        totals.update(metadata.get("totals", {}))
        consecutive_skips = metadata.get("consecutive_skips", 0)
    eval_args = dict(batch_size=config.eval.batch_size, max_new_tokens=rl.sampling.max_new_tokens)
    greedy = dataclasses.replace(rl.sampling, temperature=0.0)
    background = ThreadPoolExecutor(1, thread_name_prefix="jaxrl-rollout") if rl.overlap else None
    pending: Future | None = None  # the next step's rollout, being sampled (and scored) in the background
    iterator_after_step = prompts_iter.get_state()  # the prompt iterator's state after the last finished step
    drawn_with = (None, None)  # the reference policy and temperature of the background rollout's ref_logp

    def references(problems) -> list[str]:
        return [p.reference for p in problems for _ in range(rl.group_size)]  # rows p * G + g

    def rollout(step: int, state: TrainState, problems, controls: Controls, ref_policy,
                background: bool) -> RolloutResult:
        """Sample step's completions with `state.policy`: on the main thread, or (`background`) on the
        rollout thread during the previous step's update, where the rewards are scored and the batch's
        log-probs (and values) computed too, under the same models that sampled it. With dynamic sampling,
        more rounds of prompts until the batch holds only informative groups."""
        dynamic = rl.dynamic_sampling.enabled
        key = jax.random.fold_in(rl_key, step)
        rounds, informative, sample_s, reward_s = [], [], 0.0, 0.0
        while True:
            t0 = time.perf_counter()
            round_key = key if not rounds else jax.random.fold_in(key, len(rounds))
            generation = generate(state.policy, [p.prompt for p in problems], round_key, rl.sampling,
                                  controls.temperature, group_size=rl.group_size)
            t1 = time.perf_counter()
            batch = None
            if background and not dynamic:  # dispatched first: the device computes it while the host scores
                batch = rollout_batch(state, logprob_fn, value_fn, generation.rollout, loss_config, controls,
                                      ref_policy)
            t2 = time.perf_counter()
            scored = pool.score(generation.texts, references(problems)) if background or dynamic else None
            sample_s, reward_s = sample_s + t1 - t0, reward_s + time.perf_counter() - t2
            rounds.append((problems, generation, scored))
            if not dynamic:
                result = RolloutResult(problems, generation, scored, sample_s, reward_s, {})
                return with_batch(with_baseline(result, state.policy, key), batch)
            informative.append(dynamic_sampling.informative_groups(shaped_rewards(
                scored.rewards, generation.texts, generation.local.completion_mask.sum(1), config).total,
                rl.group_size))
            short = sum(int(f.sum()) for f in informative) < len(problems)
            if not process_max(int(short and len(rounds) < rl.dynamic_sampling.max_rounds)):
                break  # every process has its informative groups (or the rounds ran out)
            problems = next(prompts_iter)
        result = with_baseline(_dynamic_result(rounds, informative, generate, rl.group_size, sample_s, reward_s),
                               state.policy, key)
        if not background:
            return result
        return with_batch(result, rollout_batch(state, logprob_fn, value_fn, result.generation.rollout,
                                                loss_config, controls, ref_policy))

    def with_baseline(result: RolloutResult, policy, key) -> RolloutResult:
        """`result` with ReMax's baseline when the estimator is `remax`: each prompt's greedy completion by the
        policy that sampled `result`, scored and shaped like the samples."""
        if loss_config.advantage.estimator != "remax":
            return result
        t0 = time.perf_counter()
        greedy_out = generate(policy, [p.prompt for p in result.problems], key, greedy)
        t1 = time.perf_counter()
        greedy_scored = pool.score(greedy_out.texts, [p.reference for p in result.problems])
        total = shaped_rewards(greedy_scored.rewards, greedy_out.texts, greedy_out.local.completion_mask.sum(1),
                               config).total
        return dataclasses.replace(result, greedy_rewards=np.repeat(total, rl.group_size),
                                   sample_s=result.sample_s + t1 - t0,
                                   reward_s=result.reward_s + time.perf_counter() - t1)

    def with_batch(result: RolloutResult, batch: dict | None) -> RolloutResult:
        """`result` holding `batch` once the device has computed it (the wait is its logprobs_s)."""
        if batch is None:
            return result
        t0 = time.perf_counter()
        jax.block_until_ready(batch)
        return dataclasses.replace(result, batch=batch, logprobs_s=time.perf_counter() - t0)

    def flush() -> None:
        """Wait for the background rollout (evaluation and checkpoints share the reward pool / need it done)."""
        if pending is not None:
            pending.result()

    def save(step: int, phase: str) -> None:
        flush()  # a rollout drawn for step + 1 is not in the checkpoint: a resumed run draws it again
        try:
            checkpointer.save(step, _checkpoint_state(state, controls, ref_policy if keep_ref else None),
                              {"phase": phase, "rl_step": step, "prompt_iterator": iterator_after_step,
                               "totals": dict(totals), "consecutive_skips": consecutive_skips})
        except NonFiniteState as e:  # never a checkpoint to resume from
            raise TrainingDiverged(f"RL step {step}: {e}; the last checkpoint in {checkpointer.directory} holds "
                                   "the last good parameters") from None

    bar = tqdm(range(first_step, rl.steps + 1), desc="RL", disable=not config.progress, dynamic_ncols=True,
               initial=first_step - 1, total=rl.steps)
    last_accuracy = None
    try:
        if rl.steps == 0:  # a warm-start-only run keeps its policy, for later runs to start from
            save(0, "done")
        for step in bar:
            record: dict[str, Any] = {"phase": "rl", "step": step}
            t0 = time.perf_counter()
            from_background = pending is not None
            if from_background:
                produced, pending = pending.result(), None
            else:  # on-policy: sample with the current parameters, score below
                produced = rollout(step, state, next(prompts_iter), controls, ref_policy, background=False)
            iterator_after_step = prompts_iter.get_state()
            # counted before the next step's rollout starts in the background (rl.overlap): its compilations
            # would otherwise show here or not depending on how long this step's update takes
            compiled = compiled_programs()
            t1 = time.perf_counter()
            problems, generation = produced.problems, produced.generation
            batch = produced.batch
            if batch is None:
                batch = rollout_batch(state, logprob_fn, value_fn, generation.rollout, loss_config, controls,
                                      ref_policy)
            elif "ref_logp" in batch and (drawn_with[0] is not ref_policy
                                          or drawn_with[1] != float(controls.temperature)):
                # drawn before a reference reset or a temperature change: recomputed for the KL terms
                batch = {**batch, "ref_logp": logprob_fn(ref_policy, batch["tokens"], batch["prompt_valid"],
                                                         controls.temperature)[0]}
            texts, local = generation.texts, generation.local
            t2 = time.perf_counter()
            # on the host, while the device computes the log-probs (or already done in the background)
            scored = produced.scored
            if scored is None:
                scored = pool.score(texts, references(problems))
            t3 = time.perf_counter()
            reward_s = produced.reward_s + (t3 - t2 if produced.scored is None else 0.0)  # (+ ReMax's baseline)
            composed = shaped_rewards(scored.rewards, texts, local.completion_mask.sum(1), config)
            seen = {"correct": scored.rewards, "length": local.completion_mask.sum(1),
                    "truncated": local.finish_reason == FINISH_LENGTH, "components": composed.components}
            if produced.greedy_rewards is not None:
                seen["greedy"] = produced.greedy_rewards
            seen = gather(seen, generate.mesh)  # every process's rows, on every process
            scored = _gathered_result(scored, seen["correct"], generate.mesh)
            composed = rewards.compose(seen["components"], component_weights)
            greedy_rewards = seen.get("greedy")
            if greedy_rewards is not None:
                record["reward/greedy_mean"] = float(greedy_rewards.mean())
            jax.block_until_ready(batch)
            t4 = time.perf_counter()
            logprobs_s = produced.logprobs_s + t4 - t3  # the background's wait (rl.overlap), then the main thread's
            reward_array = composed.total
            component_array = np.stack([composed.components[k] for k in component_weights], axis=1)  # [B, K]
            fields, prep_metrics = prepare(
                rewards=shard_batch(reward_array, generate.mesh), completion_mask=batch["completion_mask"],
                old_logp=batch["old_logp"], key=jax.random.fold_in(loss_key, step), truncated=batch["truncated"],
                entropy=batch.get("entropy"), ref_logp=batch.get("ref_logp"), sampler_logp=batch["sampler_logp"],
                values=batch.get("old_values"),
                greedy_rewards=None if greedy_rewards is None else shard_batch(greedy_rewards, generate.mesh),
                components=shard_batch(component_array, generate.mesh))
            train_batch = {k: batch[k] for k in ("tokens", "prompt_valid", "old_logp", "ref_logp", "old_values")
                           if k in batch}
            train_batch.update(fields)
            flush_after = step == rl.steps or bool(config.checkpoint.every and step % config.checkpoint.every == 0)
            if background is not None and not flush_after and not preempted:
                # step + 1 is sampled, scored and its old_logp computed by the models from before this update,
                # while it runs; its PPO ratio pi_theta / pi_old then spans the one-step lag
                pending = background.submit(rollout, step + 1, state, next(prompts_iter), controls, ref_policy,
                                            background=True)
                drawn_with = (ref_policy, float(controls.temperature))
            warming_up = with_critic and step <= rl.critic.warmup_steps
            state, metrics = rl_update(state, warmup_fn if warming_up else step_fn, train_batch, controls, config,
                                       step, ref_policy if full_kl else None)
            if warming_up:
                record["train/critic_warmup"] = 1.0
            if keep_ref and rl.ref_reset_every and step % rl.ref_reset_every == 0:
                ref_policy = copy_arrays(state.policy)  # the KL terms now pull towards the current policy
            t5 = time.perf_counter()
            consecutive_skips = consecutive_skips + 1 if metrics["skipped"] > 0 else 0
            if metrics["skipped"] > 0:
                totals["skipped_updates_total"] += int(round(metrics["skipped"] * rl.epochs * rl.minibatches))
                log.warning("RL step %d: %.0f%% of its optimizer updates skipped (%.0f%% for an update that would "
                            "make parameters non-finite, the rest for a non-finite loss or gradient; parameters "
                            "left as they were)", step, 100 * metrics["skipped"],
                            100 * metrics.get("nonfinite_update", 0.0))
                if consecutive_skips >= rl.max_consecutive_skips:
                    raise TrainingDiverged(
                        f"RL steps {step - consecutive_skips + 1}..{step}: {consecutive_skips} consecutive steps "
                        f"with non-finite loss, gradients or updated parameters (rl.max_consecutive_skips = "
                        f"{rl.max_consecutive_skips}); the last checkpoint in {config.output_dir}/checkpoints "
                        "holds the last good parameters (a checkpoint is never saved with non-finite arrays)")
            if loss_config.adaptive:
                if "entropy" not in metrics:
                    raise ValueError("entropy_target / temperature_target_entropy need the loss to report an "
                                     "'entropy' metric (losses.policy_term does)")
                controls = update_controls(controls, float(metrics["entropy"]), loss_config)
            totals["reward_timeouts_total"] += scored.timeouts
            totals["reward_errors_total"] += scored.errors
            record.update(scored.metrics())
            if len(composed.components) > 1:
                record.update(composed.metrics())
            record.update({f"train/{k}": v for k, v in metrics.items()})
            record.update({f"batch/{k}": v for k, v in jax.device_get(prep_metrics).items()})
            record["train/entropy_coef"] = float(controls.entropy_coef)
            if controls.entropy_below_target is not None:
                record["train/entropy_bonus"] = float(controls.entropy_bonus)
            record["train/temperature"] = float(controls.temperature)
            record["train/completion_length"] = float(seen["length"].mean())
            record["train/truncated_frac"] = float(seen["truncated"].mean())
            record.update(produced.metrics)
            record.update(prompt_statistics(np.asarray(seen["correct"]), rl.group_size))
            timing = step_timing(produced.sample_s, reward_s, logprobs_s=logprobs_s, update_s=t5 - t4,
                                 idle_s=t1 - t0 if from_background else 0.0)
            record.update(timing)
            record["sampler/compiled_programs"] = compiled
            record["sampler/prompt_length"] = int(local.prompt_valid.shape[1])
            if config.eval.every and step % config.eval.every == 0 and step != rl.steps:
                flush()
                record.update(evaluate(state.policy, generate, eval_problems, pool, **eval_args))
                last_accuracy = record["eval/accuracy"]
            record["time/step_s"] = time.perf_counter() - t0
            writer.write(record)
            # every process stops after the same step: the signal may reach them during different steps
            stopping = bool(process_max(int(bool(preempted))))
            if step == rl.steps:
                save(step, "done")
            elif flush_after or stopping:
                save(step, "rl")
            if stopping:
                checkpointer.wait()
                preempted.restore()
                raise Preempted(f"stopped by SIGTERM after RL step {step}; its checkpoint is in "
                                f"{checkpointer.directory}: run again with resume=true to go on")
            postfix = {"reward": f"{record['reward/mean']:.2f}"}
            if "entropy" in metrics:
                postfix["entropy"] = f"{metrics['entropy']:.3f}"
            if last_accuracy is not None:
                postfix["eval_acc"] = f"{last_accuracy:.2f}"
            postfix["s/r/u"] = f"{timing['time/sample_s']:.2f}/{timing['time/reward_s']:.2f}/{timing['time/update_s']:.2f}s"
            bar.set_postfix(postfix)
    finally:
        if background is not None:
            background.shutdown(wait=True, cancel_futures=True)
        preempted.restore()  # also after an exception: the process gets its SIGTERM handler back
    return state, controls, totals


class Preempted(RuntimeError):
    """The run received SIGTERM (e.g. a TPU preemption notice) and saved a checkpoint after its current step."""


class _PreemptionFlag:
    """True once SIGTERM arrived (installed only in the main thread; `restore` puts the old handler back)."""

    def __init__(self):
        self._set, self._previous = False, None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        del signum, frame
        self._set = True

    def __bool__(self) -> bool:
        return self._set

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def resume_point(config: Config) -> int:
    """The RL step of the newest checkpoint of the run in `config.output_dir`, after checking that the run
    exists and that its model, critic and data stream are the ones `config` describes. Raises
    `CheckpointError`."""
    out = config.output_dir
    directory = os.path.join(out, "checkpoints")
    step = Checkpointer.newest(directory)
    if step is None:
        raise CheckpointError(f"resume=true, but {directory} holds no checkpoint: no earlier run to resume in "
                              f"output_dir {out} (run without resume=true to start one)")
    if step > config.rl.steps:  # nothing to run, and the final record would describe later parameters
        raise CheckpointError(f"resume=true: the run in {out} is already past rl.steps={config.rl.steps} (its "
                              f"newest checkpoint is after RL step {step}): set rl.steps to {step} or more")
    saved_path = os.path.join(out, "config.yaml")
    try:
        saved = configlib.load_config(Config, saved_path)
    except (OSError, configlib.ConfigError) as e:
        raise CheckpointError(f"resume=true: cannot read the resumed run's config {saved_path}: {e}") from None
    now, then = configlib.to_dict(config), configlib.to_dict(saved)
    # The model, and what the saved data position means (the task, the prompt files, prompts per step).
    mismatches = [f"{section}.{key}: checkpoint {then[section].get(key)!r}, config {value!r}"
                  for section in ("model", "pretrained", "task", "data") for key, value in now[section].items()
                  if key not in ("attention_impl", "remat", "export_hf") and then[section].get(key) != value]
    for key in ("seed", "rl.critic.model", "rl.loss.preset", "rl.prompts_per_step"):
        a, b = now, then
        for part in key.split("."):
            a, b = a[part], b[part]
        if a != b:
            mismatches.append(f"{key}: checkpoint {b!r}, config {a!r}")
    # What else the checkpoint holds: a reference policy, the adaptive entropy coefficient's state.
    for what, held in (("a reference policy (rl.loss.kl_coef > 0, kl_target ref)", lambda c: c.rl.loss.needs_ref_logp),
                       ("an adaptive entropy state (rl.loss.entropy_target)",
                        lambda c: c.rl.loss.entropy_target is not None)):
        if held(config) != held(saved):
            mismatches.append(f"the checkpoint {'holds' if held(saved) else 'lacks'} {what}, which the config "
                              f"{'needs' if held(config) else 'does not use'}")
    if mismatches:
        raise CheckpointError(f"resume=true: the run in {out} does not match the config: " + "; ".join(mismatches))
    return step


def _restore(checkpointer: Checkpointer, step: int, state: TrainState, controls: Controls, ref_policy):
    """The RL state, controls, reference policy and metadata saved at `step`, laid out like `state`."""
    like = _checkpoint_state(state, controls, ref_policy)
    try:
        saved, metadata = checkpointer.restore(step, like)
    except Exception as e:  # orbax raises many types for missing or damaged files
        raise CheckpointError(f"resume=true: cannot restore checkpoint {step} in {checkpointer.directory}: "
                              f"{type(e).__name__}: {e}") from None
    state = state.replace(policy=state.policy.replace(params=saved["params"]), opt_state=saved["opt_state"],
                          step=saved["step"])
    if state.critic is not None:
        state = state.replace(critic=state.critic.replace(params=saved["critic_params"]),
                              critic_opt_state=saved["critic_opt_state"])
    controls = controls.replace(**saved["controls"])
    if ref_policy is not None:
        ref_policy = ref_policy.replace(params=saved["ref_params"])
    return state, controls, ref_policy, metadata


def _restore_newest_intact(checkpointer: Checkpointer, state: TrainState, controls: Controls, ref_policy
                           ) -> tuple[int, tuple, list[int]]:
    """`(step, _restore's result, damaged)`: the newest checkpoint that restores, after the newer ones that do
    not (`damaged`, each named in a warning). Raises `CheckpointError` with every checkpoint's error when none
    restores."""
    failures: list[tuple[int, CheckpointError]] = []
    for step in reversed(checkpointer.steps()):
        try:
            resumed = _restore(checkpointer, step, state, controls, ref_policy)
        except CheckpointError as e:
            failures.append((step, e))
            continue
        for damaged, error in failures:
            log.warning("%s; resuming from the older checkpoint %d instead (the RL steps after it run again)",
                        error, step)
        return step, resumed, [damaged for damaged, _ in failures]
    if not failures:
        raise CheckpointError(f"resume=true, but {checkpointer.directory} holds no checkpoint")
    raise CheckpointError("; ".join(str(e) for _, e in failures))


def _set_aside(directory: str, steps: list[int], destination: str) -> None:
    """Move the checkpoints of `steps` from `directory` to `destination/<step>` (`<step>.1`, ... when taken),
    where they stay for inspection."""
    os.makedirs(destination, exist_ok=True)
    for step in steps:
        target, n = os.path.join(destination, str(step)), 0
        while os.path.exists(target):
            n += 1
            target = os.path.join(destination, f"{step}.{n}")
        os.replace(os.path.join(directory, str(step)), target)
        log.warning("moved the damaged checkpoint %d to %s", step, target)


def _truncate_metrics(path: str, step: int) -> None:
    """Keep the records (and timings) up to RL step `step`: those written after the checkpoint are written
    again by the resumed run."""
    for file in (path, os.path.join(os.path.dirname(path), "timings.jsonl")):
        if not os.path.exists(file):
            continue
        kept = [r for r in read_metrics(file, torn_tail_ok=True)  # a crash may have cut the last write short
                if r.get("phase") != "rl" or (r["step"] <= step and not r.get("final"))]
        tmp = file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, file)


def _recorded_evaluation(path: str) -> dict[str, Any]:
    """The held-out evaluation after the warm start, as the resumed run recorded it (step 0)."""
    for record in read_metrics(path, torn_tail_ok=True):  # read before _truncate_metrics: a kill may cut the tail
        if record.get("phase") == "rl" and record.get("step") == 0 and "eval/accuracy" in record:
            return {k: v for k, v in record.items() if k.startswith("eval/")}
    raise CheckpointError(f"resume=true: {path} has no evaluation after the warm start (RL step 0)")


def _gathered_result(local: rewards.RewardResult, all_rewards: np.ndarray, mesh) -> rewards.RewardResult:
    """The reward outcome of the whole batch: every process's rewards, timeouts and errors (processes that
    scored the same rows, as when only `tensor` splits them, counted once)."""
    if jax.process_count() == 1:
        return local
    counts = allgather(np.asarray([local.timeouts, local.errors], np.int64), stack=True)
    duplicates = jax.process_count() // data_shard(mesh)[1]
    timeouts, errors = (int(c) // duplicates for c in np.asarray(counts).reshape(-1, 2).sum(0))
    return rewards.RewardResult(np.asarray(all_rewards, np.float32), timeouts, errors, local.seconds)


def _checkpoint_state(state: TrainState, controls: Controls, ref_policy=None) -> dict[str, Any]:
    controls = {"entropy_coef": controls.entropy_coef, "temperature": controls.temperature,
                **({} if controls.entropy_below_target is None
                   else {"entropy_below_target": controls.entropy_below_target})}
    if state.policy.layout is not None:  # host values: on the mesh, so that every process saves them alike
        controls = replicate(jax.device_get(controls), state.policy.layout.mesh)
    saved = {"params": state.policy.params, "opt_state": state.opt_state, "step": state.step,
             "controls": controls}
    if state.critic is not None:
        saved.update(critic_params=state.critic.params, critic_opt_state=state.critic_opt_state)
    if ref_policy is not None:  # the frozen reference of KL terms: the warm-started policy
        saved["ref_params"] = ref_policy.params
    return saved


def _check_fresh_output_dir(config: Config) -> None:
    """A fresh run may take over `output_dir` only if no run's checkpoints are there, or with overwrite=true."""
    out = config.output_dir
    step = Checkpointer.newest(os.path.join(out, "checkpoints"))
    if step is None:
        return
    if config.pretrained.path is not None and os.path.realpath(config.pretrained.path) == os.path.realpath(out):
        raise ValueError(f"pretrained.path is output_dir ({out}): a run cannot start from the run it would "
                         "replace; choose another output_dir")
    if config.overwrite:
        return
    raise ValueError(f"output_dir {out} holds a run with checkpoints (the newest after RL step {step}): "
                     "resume=true continues it, overwrite=true deletes it and starts again, or choose another "
                     "output_dir")


def _prepare_output_dir(out: str) -> None:
    """A fresh run owns its output directory (see `_check_fresh_output_dir`): the summary, plot, TensorBoard
    events and checkpoints (damaged ones too) of an earlier run are removed (each process removes its own
    records)."""
    for name in ("summary.json", "reward_accuracy.png"):
        path = os.path.join(out, name)
        if os.path.exists(path):
            os.remove(path)
    for name in ("checkpoints", "damaged_checkpoints", "tensorboard"):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)


def _remove_records(metrics_path: str) -> None:
    """A fresh run's process starts its `metrics.jsonl` and `timings.jsonl` empty."""
    for path in (metrics_path, os.path.join(os.path.dirname(metrics_path), "timings.jsonl")):
        if os.path.exists(path):
            os.remove(path)
