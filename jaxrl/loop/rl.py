"""The RL phase: `train` drives the steps; `rl_step` is one step as a function of an explicit `LoopState`.

A step: take the rollout from the producer (sampled now, or up to rl.max_staleness versions ahead on its
thread: `jaxrl.loop.producer`) -> its log-probs under the parameters to update -> score and gather its
rewards -> `losses.prepare_batch` (advantages, rollout correction) -> `rl_update` (the jitted
`train.make_rl_step`, epochs x minibatches) -> controllers -> the step's record. `finish_step` then evaluates,
writes the record and saves, and the new version goes to the producer. Everything a step changes is in the
`LoopState` it returns; `RLContext` holds what stays fixed for the run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxrl import losses, models, rewards
from jaxrl.advantage_shaping import answer_clusters
from jaxrl.checkpoint import Checkpointer, NonFiniteState
from jaxrl.config import Config
from jaxrl.data.batching import shuffled_batches
from jaxrl.errors import Preempted, RunConfigError, TrainingDiverged
from jaxrl.losses import Controls
from jaxrl.loop import held_out, partial, progress, resume, self_rewards, setup
from jaxrl.loop.episodes import episode_metrics, turn_credit_arrays
from jaxrl.loop.generate import Generator
from jaxrl.loop.producer import Produced, Producer, staleness_metrics
from jaxrl.loop.rollout import RolloutResult, Sampler, rollout_batch, score_rollout, shaped_rewards
from jaxrl.metrics import MetricsWriter
from jaxrl.models import lora
from jaxrl.packing import host_rows
from jaxrl.rewards.scoring import RewardScorer
from jaxrl.samples import SampleLog, sequence_advantages
from jaxrl.sampling import FINISH_LENGTH
from jaxrl.sharding import (allgather, data_shard, from_process_local, gather, process_local, process_max,
                            process_rows, shard_batch)
from jaxrl.train import TrainState, copy_policy

log = logging.getLogger("jaxrl")

# Metrics of an optimizer update as a whole, averaged over the updates without weighting by their tokens.
_PER_UPDATE_METRICS = ("skipped", "nonfinite_update", "grad_norm", "critic_grad_norm")


@dataclasses.dataclass(frozen=True)
class LoopState:
    """Everything an RL step changes (PureJaxRL's `runner_state`): `rl_step` returns the next one."""

    train: TrainState
    controls: Controls
    ref_policy: models.Policy | None  # the KL terms' frozen reference (None: no KL term), in its own arrays
    prompts: Any  # the prompt iterator (`shuffled_batches`); `next` advances it in place
    iterator_after_step: dict  # the prompt iterator's state after the last finished step (checkpointed)
    totals: dict[str, int]  # reward timeouts and errors, skipped updates: the run's counts so far
    consecutive_skips: int = 0  # steps in a row whose updates were skipped (rl.max_consecutive_skips)
    carry_after_step: partial.Carry | None = None  # partial rollouts' groups in flight after the last step
    last_accuracy: float | None = None  # the latest periodic evaluation's, for the progress line


@dataclasses.dataclass(frozen=True)
class RunResources:
    """What a run opened before it starts (`experiment.open_resources`): where its records go and the reward
    workers it scores with."""

    writer: MetricsWriter  # metrics.jsonl, timings.jsonl and their mirrors (TensorBoard, wandb)
    scorer: RewardScorer  # every configured reward
    evaluator: held_out.Evaluator  # the held-out evaluation's reward
    samples: SampleLog  # samples.jsonl
    checkpointer: Checkpointer
    env_pool: Any = None  # a multi-turn run's environment workers (`jaxrl.envs.EnvPool`), else None


@dataclasses.dataclass(frozen=True)
class RLContext:
    """What stays fixed over the RL phase: the config, the programs, the sampler, the sinks and the keys."""

    config: Config
    programs: setup.StepPrograms
    sampler: Sampler
    eval_problems: list
    evaluator: held_out.Evaluator  # the held-out evaluation's reward and metric name
    writer: MetricsWriter
    samples: SampleLog  # samples.jsonl
    checkpointer: Checkpointer
    loss_key: jax.Array  # the loss's own draws (Clip-Cov), folded with the step
    producer: Producer  # the steps' rollouts, sampled up to rl.max_staleness versions ahead
    problem_index: dict[int, int]  # id(problem) -> its index in the training set (partial rollouts' carry)
    preempted: "PreemptionFlag"

    @property
    def keep_ref(self) -> bool:
        return self.config.rl.loss.needs_ref_logp or self.config.rl.loss.needs_full_kl


def train(warm_policy, config: Config, problems: tuple[list, list], generate: Generator, sinks: RunResources,
          resume_step: int | None = None, resumed: tuple | None = None,
          critic_trunk: models.Policy | None = None) -> tuple[TrainState, Controls, dict[str, int]]:
    """RL from `warm_policy` (the warm-started policy), or from `resumed` (`resume.restore`'s result for
    `resume_step`; `warm_policy` is then unused), on `problems` (train, held-out). Returns the final state,
    controls and totals.

    The optimizer steps donate the state (`make_rl_step`), so `warm_policy`'s arrays are consumed, but with
    `rl.max_staleness`, whose producer samples with the versions the updates were given.
    """
    rl = config.rl
    train_problems, eval_problems = problems
    if rl.staleness and rl.loss.is_level == "none":
        log.warning("rl.max_staleness = %d without a rollout correction (rl.loss.is_level: none): tokens up to %d "
                    "policy versions old are trained as if the policy being updated had sampled them; see "
                    "configs/off_policy.yaml for a corrected recipe", rl.staleness, rl.staleness)
    programs = setup.step_programs(config)
    loop_state = initial_loop_state(config, warm_policy, train_problems, generate.mesh, resume_step, resumed,
                                    critic_trunk)
    preempted = PreemptionFlag()
    seed_key = jax.random.key(config.seed)  # fold_in 2: sampling; 3: minibatch order; 4: sampled evaluation
    sampler = Sampler(config, generate, sinks.scorer, programs, jax.random.fold_in(seed_key, 2))
    first_step = 1 if resume_step is None else resume_step + 1
    producer = Producer(sampler, loop_state.prompts, first_step - 1, rl.steps, loop_state.carry_after_step)
    ctx = RLContext(config, programs, sampler, eval_problems, sinks.evaluator, sinks.writer, sinks.samples,
                    sinks.checkpointer, jax.random.fold_in(seed_key, 5), producer,
                    {id(p): i for i, p in enumerate(train_problems)}, preempted)
    bar = progress.steps(first_step, rl.steps, "RL", config.progress)
    try:
        if rl.steps == 0:  # a warm-start-only run keeps its policy, for later runs to start from
            save(ctx, loop_state, 0, "done")
        producer.publish(first_step - 1, loop_state.train, loop_state.controls)
        for step in bar:
            t0 = time.perf_counter()
            loop_state, produced = take_rollout(ctx, loop_state, step)
            idle_s = time.perf_counter() - t0 if rl.staleness else 0.0
            loop_state, record = rl_step(ctx, loop_state, step, produced.result, produced.compiled, idle_s)
            loop_state = finish_step(ctx, loop_state, step, record, t0)
            producer.publish(step, loop_state.train, loop_state.controls)
            bar.set_postfix(progress_postfix(record, loop_state.last_accuracy))
    finally:
        producer.close()
        preempted.restore()  # also after an exception: the process gets its SIGTERM handler back
    return loop_state.train, loop_state.controls, loop_state.totals


def initial_loop_state(config: Config, warm_policy, train_problems, mesh, resume_step: int | None,
                       resumed: tuple | None, critic_trunk: models.Policy | None) -> LoopState:
    """The loop state before the first step to run: fresh from `warm_policy`, or `resumed` with its saved
    prompt position, totals and skip count (checkpoints before 2026-11-23 did not save the last two)."""
    rl = config.rl
    keep_ref = rl.loss.needs_ref_logp or rl.loss.needs_full_kl
    if resumed is None:
        state, controls = setup.rl_start(config, warm_policy, critic_trunk)
        ref_policy = None
        if keep_ref:  # the warm start; with LoRA, its base with the adapters off (no second copy of the model)
            ref_policy = lora.adapters_off(warm_policy) if lora.is_adapted(warm_policy) else copy_policy(warm_policy)
        metadata = {}
    else:
        state, controls, ref_policy, metadata = resumed
    shard, shards = data_shard(mesh)  # rl.prompts_per_step splits over them: check_batch_sizes
    prompts = shuffled_batches(train_problems, rl.prompts_per_step // shards, config.seed, (shard, shards))
    if resume_step is not None:
        prompts.set_state(metadata["prompt_iterator"])
    totals = {"reward_timeouts_total": 0, "reward_errors_total": 0, "skipped_updates_total": 0,
              **metadata.get("totals", {})}
    carry = metadata.get("partial_carry")
    carry = None if carry is None else partial.carry_from_record(carry, train_problems)
    return LoopState(state, controls, ref_policy, prompts, prompts.get_state(), totals,
                     metadata.get("consecutive_skips", 0), carry)


def take_rollout(ctx: RLContext, s: LoopState, step: int) -> tuple[LoopState, Produced]:
    """Step's rollout from the producer (waiting for it), and the state after it: the prompt iterator's
    position and partial rollouts' carry as they were after this step's rollout (what a checkpoint saves)."""
    produced = ctx.producer.take(step)
    s = dataclasses.replace(s, iterator_after_step=produced.iterator_state, carry_after_step=produced.carry)
    return s, produced


def rl_step(ctx: RLContext, s: LoopState, step: int, produced: RolloutResult, compiled: int,
            idle_s: float) -> tuple[LoopState, dict[str, Any]]:
    """One RL step on `produced`: log-probs -> rewards -> advantages -> update ->
    controllers. Returns the next loop state and the step's record (without evaluation and step time)."""
    config, programs, mesh = ctx.config, ctx.programs, ctx.sampler.generate.mesh
    rl = config.rl
    record: dict[str, Any] = {"phase": "rl", "step": step}
    record.update(staleness_metrics(produced.versions, step, rl.staleness))
    # dispatched: the device computes the log-probs (with the parameters to update) while the host scores
    batch = rollout_batch(s.train, programs.logprobs, programs.values, produced.generation.rollout, rl.loss,
                          s.controls, s.ref_policy, programs.pack, programs.token_stats)
    texts, local = produced.generation.texts, produced.generation.local
    t2 = time.perf_counter()
    # on the host, while the device computes the log-probs (or already done on the producer's thread)
    scored = produced.scored
    if scored is None:
        scored = score_rollout(ctx.sampler, produced.problems, texts)
    t3 = time.perf_counter()
    reward_s = produced.reward_s + (t3 - t2 if produced.scored is None else 0.0)  # (+ ReMax's baseline)
    # RENT / self-certainty (issue 35): from the batch's per-token statistics (waits for the log-prob pass)
    scored = self_rewards.with_token_rewards(scored, batch, texts, config, mesh)
    seen, scored, composed = gathered_rewards(produced, scored, config, programs.component_weights, mesh)
    greedy_rewards = seen.get("greedy")
    if greedy_rewards is not None:
        record["reward/greedy_mean"] = float(greedy_rewards.mean())
    jax.block_until_ready(batch)
    t4 = time.perf_counter()
    logprobs_s = t4 - t3  # the wait for the log-prob pass after scoring
    train_batch, prep_metrics = train_batch_of(ctx, batch, composed, greedy_rewards, step,
                                               produced.generation.episodes, seen.get("answer_ids"))
    log_samples(ctx, step, produced, composed, train_batch["advantages"])
    warming_up = programs.critic_warmup is not None and step <= rl.critic.warmup_steps
    state, metrics = rl_update(s.train, programs.critic_warmup if warming_up else programs.update, train_batch,
                               s.controls, config, step, s.ref_policy if rl.loss.needs_full_kl else None,
                               programs.pack)
    if warming_up:
        record["train/critic_warmup"] = 1.0
    s = dataclasses.replace(s, train=state)
    if ctx.keep_ref and rl.ref_reset_every and step % rl.ref_reset_every == 0:
        s = dataclasses.replace(s, ref_policy=copy_policy(state.policy))  # KL now pulls towards the current policy
    t5 = time.perf_counter()
    s = after_update(s, metrics, scored, config, step)
    record.update(step_record(s.controls, scored, composed, metrics, prep_metrics, seen, produced, rl.group_size))
    record.update(self_rewards.step_metrics(seen["components"], seen["correct"], config))  # TTRL's label accuracy
    record.update(step_timing(produced.sample_s, reward_s, logprobs_s=logprobs_s, update_s=t5 - t4, idle_s=idle_s))
    record["sampler/compiled_programs"] = compiled
    record["sampler/prompt_length"] = int(local.prompt_valid.shape[1])
    return s, record


def gathered_rewards(produced: RolloutResult, scored: rewards.RewardResult, config: Config,
                     component_weights: dict[str, float], mesh):
    """`(seen, scored, composed)` of the whole batch, on every process: `seen` holds the verifiable rewards
    `correct [B]`, completion `length [B]`, `truncated [B]`, the shaping `components`, ReMax's `greedy`
    baseline (when drawn) and SEED-GRPO's `answer_ids` (each sample's answer cluster in its group); `scored` the gathered reward outcome; `composed` the shaped rewards."""
    local = produced.generation.local
    composed = shaped_rewards(scored, produced.generation, config)
    seen = {"correct": scored.rewards, "length": local.completion_mask.sum(1),
            "truncated": local.finish_reason == FINISH_LENGTH, "components": composed.components}
    if produced.greedy_rewards is not None:
        seen["greedy"] = produced.greedy_rewards
    if config.rl.loss.needs_answers:  # seed_grpo: each sample's answer cluster within its group
        seen["answer_ids"] = answer_clusters([rewards.answer_key(t) for t in produced.generation.texts],
                                             config.rl.group_size)
    seen = gather(seen, mesh)  # every process's rows, on every process
    scored = _gathered_result(scored, seen["correct"], mesh)
    return seen, scored, rewards.compose(seen["components"], component_weights)


def _gathered_result(local: rewards.RewardResult, all_rewards: np.ndarray, mesh) -> rewards.RewardResult:
    """The reward outcome of the whole batch: every process's rewards, timeouts and errors (processes that
    scored the same rows, as when only `tensor` splits them, counted once)."""
    if jax.process_count() == 1:
        return local
    counts = allgather(np.asarray([local.timeouts, local.errors], np.int64), stack=True)
    duplicates = jax.process_count() // data_shard(mesh)[1]
    timeouts, errors = (int(c) // duplicates for c in np.asarray(counts).reshape(-1, 2).sum(0))
    return rewards.RewardResult(np.asarray(all_rewards, np.float32), timeouts, errors, local.seconds)


def train_batch_of(ctx: RLContext, batch: dict, composed: rewards.ComposedRewards, greedy_rewards, step: int,
                   episodes=None, answer_ids=None) -> tuple[dict, dict]:
    """The update's batch: the rollout's arrays with `losses.prepare_batch`'s fields (advantages, ...) from
    the shaped rewards `[B]` and their components `[B, K]` (multi-turn: and the per-turn rewards of this
    process's `episodes`); and prepare_batch's metrics."""
    mesh, weights = ctx.sampler.generate.mesh, ctx.programs.component_weights
    component_array = np.stack([composed.components[k] for k in weights], axis=1)  # [B, K]
    turns = {}
    if episodes is not None:  # multi-turn: each turn's rewards where it ends (gae, turn_credit: discounted)
        mine = process_rows(len(composed.total), mesh)
        turns = dict(zip(("token_rewards", "turn_ids"), from_process_local(turn_credit_arrays(
            episodes, composed.total[mine], batch["completion_mask"].shape[1]), mesh)))
    fields, prep_metrics = ctx.programs.prepare(
        rewards=shard_batch(composed.total, mesh), completion_mask=batch["completion_mask"],
        old_logp=batch["old_logp"], key=jax.random.fold_in(ctx.loss_key, step), truncated=batch["truncated"],
        entropy=batch.get("entropy"), ref_logp=batch.get("ref_logp"), sampler_logp=batch["sampler_logp"],
        values=batch.get("old_values"),
        greedy_rewards=None if greedy_rewards is None else shard_batch(greedy_rewards, mesh),
        components=shard_batch(component_array, mesh),
        answer_ids=None if answer_ids is None else shard_batch(answer_ids, mesh), **turns)
    train_batch = {k: batch[k] for k in ("tokens", "prompt_valid", "old_logp", "ref_logp", "old_values")
                   if k in batch}
    train_batch.update(fields)
    return train_batch, prep_metrics


def log_samples(ctx: RLContext, step: int, produced: RolloutResult, composed: rewards.ComposedRewards,
                advantages: jax.Array) -> None:
    """Every `log.samples_every` steps, `log.samples_per_step` rows of the batch to samples.jsonl: prompt,
    completion, reference, reward components, total reward, the sequence's advantage (its mean over the
    completion tokens of `advantages [B, N]`), length and finish reason; this process's rows (the primary
    process writes them)."""
    every, group_size = ctx.config.log.samples_every, ctx.config.rl.group_size
    if not every or step % every:
        return
    mesh, local = ctx.sampler.generate.mesh, produced.generation.local
    mine = process_rows(len(composed.total), mesh)
    local_advantages = process_local(advantages, mesh)  # on every process: it may move rows between them
    ctx.samples.write(step, prompts=[p.prompt for p in produced.problems for _ in range(group_size)],
                      completions=produced.generation.texts,
                      references=[p.reference for p in produced.problems for _ in range(group_size)],
                      components={name: values[mine] for name, values in composed.components.items()},
                      rewards=composed.total[mine],
                      advantages=sequence_advantages(local_advantages, local.completion_mask),
                      lengths=local.completion_mask.sum(1), finish_reasons=local.finish_reason,
                      episodes=None if produced.generation.episodes is None else
                      [e.record() for e in produced.generation.episodes])


def flushes_after(config: Config, step: int) -> bool:
    """Whether the run waits for every rollout after `step`: its last step, or a checkpoint step."""
    return step == config.rl.steps or bool(config.checkpoint.every and step % config.checkpoint.every == 0)


def rl_update(state, step_fn, batch: dict, controls: Controls, config: Config, step: int, ref_policy=None,
              pack=None):
    """`epochs x minibatches` optimizer steps on one prepared rollout batch; returns (state, metrics over
    the steps: `losses.mean_over_updates`, weighted by each minibatch's loss tokens but for the updates' own
    `_PER_UPDATE_METRICS`).

    Minibatches are drawn by a permutation seeded by (seed, step). With `pack` (packed training) each
    minibatch is planned after the permutation, from its prompts and loss mask, and carries its `plan`.
    """
    size = batch["tokens"].shape[0] // config.rl.minibatches
    order_rng = np.random.default_rng([config.seed, 3, step])
    host = None if pack is None else (host_rows(batch["prompt_valid"]), host_rows(batch["loss_mask"]))
    collected = []
    for _ in range(config.rl.epochs):
        order = order_rng.permutation(batch["tokens"].shape[0]) if config.rl.minibatches > 1 else None
        for m in range(config.rl.minibatches):
            rows = slice(None) if order is None else order[m * size:(m + 1) * size]
            minibatch = batch if order is None else jax.tree.map(lambda x: x[rows], batch)
            if pack is not None:
                minibatch = {**minibatch, "plan": pack(host[0][rows], host[1][rows], minibatch["tokens"])}
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


def after_update(s: LoopState, metrics: dict, scored: rewards.RewardResult, config: Config, step: int
                 ) -> LoopState:
    """The loop state after step's update: skip counts (raising `TrainingDiverged` after
    `rl.max_consecutive_skips` skipped steps in a row), the controllers, the reward failure totals."""
    rl, totals = config.rl, dict(s.totals)
    consecutive_skips = s.consecutive_skips + 1 if metrics["skipped"] > 0 else 0
    if metrics["skipped"] > 0:
        totals["skipped_updates_total"] += int(round(metrics["skipped"] * rl.epochs * rl.minibatches))
        log.warning("RL step %d: %.0f%% of its optimizer updates skipped (%.0f%% for an update that would "
                    "make parameters non-finite, the rest for a non-finite loss or gradient; parameters "
                    "left as they were)", step, 100 * metrics["skipped"], 100 * metrics.get("nonfinite_update", 0.0))
        if consecutive_skips >= rl.max_consecutive_skips:
            raise TrainingDiverged(
                f"RL steps {step - consecutive_skips + 1}..{step}: {consecutive_skips} consecutive steps "
                f"with non-finite loss, gradients or updated parameters (rl.max_consecutive_skips = "
                f"{rl.max_consecutive_skips}); the last checkpoint in {config.output_dir}/checkpoints "
                "holds the last good parameters (a checkpoint is never saved with non-finite arrays)")
    controls = s.controls
    if rl.loss.adaptive:
        if "entropy" not in metrics:
            raise RunConfigError("entropy_target / temperature_target_entropy need the loss to report an "
                                 "'entropy' metric (losses.policy_term does)")
        controls = update_controls(controls, float(metrics["entropy"]), rl.loss)
    totals["reward_timeouts_total"] += scored.timeouts
    totals["reward_errors_total"] += scored.errors
    return dataclasses.replace(s, controls=controls, totals=totals, consecutive_skips=consecutive_skips)


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


def step_record(controls: Controls, scored: rewards.RewardResult, composed: rewards.ComposedRewards,
                metrics: dict, prep_metrics: dict, seen: dict, produced: RolloutResult, group_size: int
                ) -> dict[str, Any]:
    """The step's rewards, update and batch metrics, controls, completion statistics, dynamic sampling's
    metrics and the per-prompt view, in the order metrics.jsonl has always had them."""
    record = dict(scored.metrics())
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
    record.update(prompt_statistics(np.asarray(seen["correct"]), group_size))
    episodes = produced.generation.episodes
    if episodes is not None:  # multi-turn: this process's episodes
        record.update(episode_metrics(episodes, produced.generation.local.completion_mask.sum(1)))
    return record


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
    scoring (with rl.max_staleness sampling and scoring ran on the producer's thread during earlier updates);
    update_s: the optimizer steps; idle_s: the time the update side waited for its rollout (rl.max_staleness).
    """
    return {"time/sample_s": sample_s, "time/reward_s": reward_s, "time/logprobs_s": logprobs_s,
            "time/update_s": update_s, "time/idle_s": idle_s}


def finish_step(ctx: RLContext, s: LoopState, step: int, record: dict[str, Any], t0: float) -> LoopState:
    """After step's update: the periodic evaluation, the record (with the step's wall time from `t0`), the
    checkpoint (every `checkpoint.every` steps, the last, or on SIGTERM: then `Preempted` is raised)."""
    config = ctx.config
    if config.eval.every and step % config.eval.every == 0 and step != config.rl.steps:
        ctx.producer.wait()  # the evaluation shares the device and the reward pool
        record.update(held_out.evaluate(s.train.policy, ctx.sampler.generate, ctx.eval_problems, ctx.evaluator,
                                        batch_size=config.eval.batch_size,
                                        max_new_tokens=config.rl.sampling.max_new_tokens))
        s = dataclasses.replace(s, last_accuracy=record[ctx.evaluator.key])
    record["time/step_s"] = time.perf_counter() - t0
    ctx.writer.write(record)
    # every process stops after the same step: the signal may reach them during different steps
    stopping = bool(process_max(int(bool(ctx.preempted))))
    if step == config.rl.steps:
        save(ctx, s, step, "done")
    elif flushes_after(config, step) or stopping:
        save(ctx, s, step, "rl")
    if stopping:
        ctx.checkpointer.wait()
        ctx.preempted.restore()
        raise Preempted(f"stopped by SIGTERM after RL step {step}; its checkpoint is in "
                        f"{ctx.checkpointer.directory}: run again with resume=true to go on")
    return s


def save(ctx: RLContext, s: LoopState, step: int, phase: str) -> None:
    """Checkpoint `s` after RL `step`; a non-finite state is never saved (`TrainingDiverged`)."""
    ctx.producer.wait()  # rollouts drawn for later steps are not in the checkpoint: a resumed run draws them again
    arrays = resume.checkpoint_state(s.train, s.controls, s.ref_policy if ctx.keep_ref else None)
    metadata = {"phase": phase, "rl_step": step, "prompt_iterator": s.iterator_after_step,
                "totals": dict(s.totals), "consecutive_skips": s.consecutive_skips}
    if s.carry_after_step is not None:
        metadata["partial_carry"] = partial.carry_record(s.carry_after_step, ctx.problem_index)
    try:
        ctx.checkpointer.save(step, arrays, metadata)
    except NonFiniteState as e:  # never a checkpoint to resume from
        raise TrainingDiverged(f"RL step {step}: {e}; the last checkpoint in {ctx.checkpointer.directory} holds "
                               "the last good parameters") from None


def progress_postfix(record: dict[str, Any], last_accuracy: float | None) -> dict[str, str]:
    """The progress line's values: reward, entropy, the latest evaluation and the sample/reward/update times."""
    postfix = {"reward": f"{record['reward/mean']:.2f}"}
    if "train/entropy" in record:
        postfix["entropy"] = f"{record['train/entropy']:.3f}"
    if last_accuracy is not None:
        postfix["eval_acc"] = f"{last_accuracy:.2f}"
    postfix["s/r/u"] = f"{record['time/sample_s']:.2f}/{record['time/reward_s']:.2f}/{record['time/update_s']:.2f}s"
    return postfix


class PreemptionFlag:
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
