"""One RL step's rollout: sample completions (more rounds with dynamic sampling, ReMax's greedy baseline),
score them, and dispatch the log-probs (and values) of the models that sampled them (`rollout_batch`).

With `rl.max_staleness` the whole of `sample_rollout` runs on the producer's thread (`jaxrl.loop.producer`)
during earlier steps' updates, and scores there too; the trainer computes the log-probs (`rollout_batch`)
with the parameters it updates.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxrl import dynamic_sampling, losses, rewards
from jaxrl.config import Config
from jaxrl.losses import Controls
from jaxrl.loop import self_rewards
from jaxrl.loop.generate import Generation, Generator
from jaxrl.loop.setup import StepPrograms
from jaxrl.sampling import FINISH_LENGTH, Rollout
from jaxrl.rewards.pool import RewardPool, RewardResult
from jaxrl.rewards.scoring import RewardScorer, ScoredBatch, shape
from jaxrl.sharding import from_process_local, process_max
from jaxrl.train import TrainState


@dataclasses.dataclass(frozen=True)
class RolloutResult:
    """One step's prompts, completions and (when scored where they were sampled) rewards, with timings."""

    problems: list
    generation: Generation
    scored: ScoredBatch | None
    sample_s: float
    reward_s: float
    metrics: dict[str, float]  # dynamic sampling's, partial rollouts'
    greedy_rewards: np.ndarray | None = None  # ReMax's baseline [P * G] (this process's rows), else None
    versions: np.ndarray | None = None  # `[B, N]` int32 policy version of each sampled token, -1 elsewhere


@dataclasses.dataclass(frozen=True)
class Sampler:
    """What a rollout is drawn with, fixed for the run: the sampler front end, the rewards' scorer, the step's
    programs (for the log-probs and values) and the sampling key (fold_in(seed, 2), folded with the step)."""

    config: Config
    generate: Generator
    scorer: RewardScorer
    programs: StepPrograms
    key: jax.Array


def row_of(problem) -> dict:
    """The data row a reward receives as `row`: a prompt file's row as read, or the built-in task's problem as
    `{"prompt", "reference"}`."""
    row = getattr(problem, "row", None)
    return row if row is not None else {"prompt": problem.prompt, "reference": problem.reference}


def repeat_each(values, times: int) -> list:
    """`[v0, v0, ..., v1, v1, ...]`: each of `values` `times` times (row `p * G + g` is sample g of prompt p)."""
    return [v for v in values for _ in range(times)]


def score(scorer: RewardScorer | RewardPool, problems, texts, group_size: int) -> ScoredBatch | RewardResult:
    """The rewards of `texts` (rows `p * G + g`: sample g of `problems[p]`) from every reward of a `scorer`, or
    from one `RewardPool`, each reward given the prompt, completion, reference and data row it takes."""
    return scorer.score(texts, repeat_each((p.reference for p in problems), group_size),
                        prompts=repeat_each((p.prompt for p in problems), group_size),
                        rows=repeat_each(map(row_of, problems), group_size))


def score_rollout(sampler: Sampler, problems, texts) -> ScoredBatch:
    """`score` of a training rollout with every configured reward, the group self-rewards (TTRL, computed here
    from the texts of each prompt's group) included."""
    scored = score(sampler.scorer, problems, texts, sampler.config.rl.group_size)
    return self_rewards.with_group_rewards(scored, texts, sampler.config)


def shaped_rewards(scored: ScoredBatch, generation: Generation, config: Config) -> rewards.ComposedRewards:
    """The scored rewards of `generation` (the verifiable `correct` and `reward.extra`'s) composed with the
    shaping components `config.reward` enables (format reward of its texts, DAPO overlong and length penalties
    of its completion lengths in tokens) and, multi-turn, the environment's rewards (`env`)."""
    local = generation.local
    env_rewards = None
    if generation.episodes is not None:
        env_rewards = np.array([sum(e.reward_totals().values()) for e in generation.episodes], np.float32)
    return shape(scored.components, generation.texts, local.completion_mask.sum(1), config.reward,
                 config.completion_tokens, env_rewards, config.component_weights())


def rollout_batch(state: TrainState, logprob_fn, value_fn, rollout: Rollout, loss_config: losses.LossConfig,
                  controls: Controls, ref_policy=None, pack=None, token_stats: tuple[str, ...] = ()) -> dict:
    """A rollout (global arrays on the mesh) with what the objective needs from the sampling-time models
    `[B, N]`: `old_logp` always, `entropy`, `ref_logp` (frozen warm-start policy) and `old_values` (critic)
    when used.

    With `pack` (`StepPrograms.pack`, packed training) the passes run on the packed rows of the completions
    (up to each one's last generated token), `logprob_fn` and `value_fn` taking the plan, kept as `pack_plan`.

    `token_stats` names the per-token statistics the token self-rewards read (`StepPrograms.token_stats`), kept
    as `token_stats` `{name: [B, N]}` from the same log-prob pass.

    The device computations are only dispatched here: the device runs them while the host scores the
    rewards of the same rollout.
    """
    batch = {"tokens": rollout.tokens, "prompt_valid": rollout.prompt_valid,
             "completion_mask": rollout.completion_mask, "sampler_logp": rollout.sampler_logp,
             "truncated": rollout.finish_reason == FINISH_LENGTH}
    tokens, prompt_valid = batch["tokens"], batch["prompt_valid"]
    extra = {}
    if pack is not None:
        batch["pack_plan"] = extra["plan"] = pack(prompt_valid, batch["completion_mask"], tokens)
    outputs = logprob_fn(state.policy, tokens, prompt_valid, controls.temperature, **extra)
    batch["old_logp"], entropy = outputs[0], outputs[1]
    if loss_config.needs_entropy:
        batch["entropy"] = entropy
    if token_stats:
        batch["token_stats"] = self_rewards.token_stats_of(token_stats, outputs)
    if loss_config.needs_ref_logp:
        batch["ref_logp"] = logprob_fn(ref_policy, tokens, prompt_valid, controls.temperature, **extra)[0]
    if state.critic is not None:
        batch["old_values"] = value_fn(state.critic, tokens, prompt_valid, **extra)
    return batch


def sample_rollout(sampler: Sampler, step: int, state: TrainState, problems, controls: Controls, prompts_iter,
                   background: bool) -> RolloutResult:
    """Sample step's completions with `state.policy`: on the main thread, or (`background`) on the producer's
    thread, where the rewards are scored too. With dynamic sampling, more rounds of prompts (drawn from
    `prompts_iter`) until the batch holds only informative groups."""
    config, rl = sampler.config, sampler.config.rl
    dynamic = rl.dynamic_sampling.enabled
    key = jax.random.fold_in(sampler.key, step)
    rounds, informative, sample_s, reward_s = [], [], 0.0, 0.0
    while True:
        t0 = time.perf_counter()
        round_key = key if not rounds else jax.random.fold_in(key, len(rounds))
        generation = sampler.generate(state.policy, problems, round_key, rl.sampling,
                                      controls.temperature, group_size=rl.group_size)
        t1 = time.perf_counter()
        scored = score_rollout(sampler, problems, generation.texts) if background or dynamic else None
        sample_s, reward_s = sample_s + t1 - t0, reward_s + time.perf_counter() - t1
        rounds.append((problems, generation, scored))
        if not dynamic:
            return with_baseline(sampler, RolloutResult(problems, generation, scored, sample_s, reward_s, {}),
                                 state.policy, key)
        informative.append(dynamic_sampling.informative_groups(shaped_rewards(scored, generation, config).total,
                                                               rl.group_size))
        short = sum(int(f.sum()) for f in informative) < len(problems)
        if not process_max(int(short and len(rounds) < rl.dynamic_sampling.max_rounds)):
            break  # every process has its informative groups (or the rounds ran out)
        problems = next(prompts_iter)
    return with_baseline(sampler, dynamic_result(rounds, informative, sampler.generate, rl.group_size, sample_s,
                                                 reward_s), state.policy, key)


def with_baseline(sampler: Sampler, result: RolloutResult, policy, key) -> RolloutResult:
    """`result` with ReMax's baseline when the estimator needs greedy rollouts (`remax`): each prompt's greedy
    completion by the policy that sampled `result`, scored and shaped like the samples."""
    config = sampler.config
    if "greedy_rollouts" not in config.rl.loss.estimator_needs:
        return result
    greedy = dataclasses.replace(config.rl.sampling, temperature=0.0)
    t0 = time.perf_counter()
    greedy_out = sampler.generate(policy, result.problems, key, greedy)
    t1 = time.perf_counter()
    greedy_scored = score(sampler.scorer, result.problems, greedy_out.texts, 1)
    total = shaped_rewards(greedy_scored, greedy_out, config).total
    return dataclasses.replace(result, greedy_rewards=np.repeat(total, config.rl.group_size),
                               sample_s=result.sample_s + t1 - t0,
                               reward_s=result.reward_s + time.perf_counter() - t1)


def selected_scores(scores: list[ScoredBatch], groups, group_size: int) -> ScoredBatch:
    """The scores of the selected `groups` (`(round, group)` pairs) of the rounds' `scores`, in that order,
    with every round's failures and time."""
    results = {}
    for name in scores[0].results:
        rounds = [s.results[name] for s in scores]
        selected = np.concatenate([rounds[r].rewards[g * group_size:(g + 1) * group_size] for r, g in groups])
        results[name] = RewardResult(selected, sum(r.timeouts for r in rounds), sum(r.errors for r in rounds),
                                     sum(r.seconds for r in rounds))
    return ScoredBatch({name: r.rewards for name, r in results.items()}, results, sum(s.timeouts for s in scores),
                       sum(s.errors for s in scores), sum(s.seconds for s in scores))


def dynamic_result(rounds, informative, generate: Generator, group_size: int, sample_s: float,
                   reward_s: float) -> RolloutResult:
    """The batch of `dynamic_sampling.select_groups` assembled from the rounds `(problems, generation,
    scored)`, with its metrics (this process's: rounds, first round's informative share, groups filled)."""
    quota = len(rounds[0][0])
    selection = dynamic_sampling.select_groups(informative, quota)
    local = dynamic_sampling.assemble([g.local for _, g, _ in rounds], selection, group_size,
                                      generate.tokenizer.pad_id)
    problems = [rounds[r][0][g] for r, g in selection.groups]
    texts = [rounds[r][1].texts[g * group_size + i] for r, g in selection.groups for i in range(group_size)]
    episodes = None if rounds[0][1].episodes is None else [
        rounds[r][1].episodes[g * group_size + i] for r, g in selection.groups for i in range(group_size)]
    scores = [rounds[r][2] for r in range(len(rounds))]
    scored = selected_scores(scores, selection.groups, group_size)
    global_rollout = from_process_local(tuple(x for x in local if x is not None), generate.mesh)
    rollout = Rollout(*global_rollout, *(None,) * (len(Rollout._fields) - len(global_rollout)))
    metrics = {"dynamic/rounds": float(len(rounds)), "dynamic/informative_frac": float(informative[0].mean()),
               "dynamic/filled_groups": float(selection.filled), "dynamic/prompts_sampled": float(quota * len(rounds)),
               # the reward of the batch as sampled: reward/mean is over the selected (informative) groups
               "dynamic/sampled_reward_mean": float(np.mean(scores[0].rewards))}
    return RolloutResult(problems, Generation(rollout, local, texts, episodes), scored, sample_s, reward_s, metrics)
