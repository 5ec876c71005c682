"""Held-out evaluation: greedy accuracy (`evaluate`), pass@k and maj@k (`evaluate_sampled`), and the
evaluation of a saved policy behind `jaxrl eval` (`evaluate_checkpoint`).

The evaluation scores with the verifiable reward the config names for it (`eval.reward`, else
`reward.function`) and names the metric after what that reward measures: `eval/accuracy` for a reward
registered as binary (right or wrong: arithmetic, math), `eval/reward` (its mean) for any other."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

import jax
import numpy as np

from jaxrl import evaluation, rewards
from jaxrl.config import Config
from jaxrl.envs.pool import EnvPool
from jaxrl.loop import progress, setup
from jaxrl.loop.episodes import EpisodeGenerator, episode_metrics
from jaxrl.loop.generate import Generator
from jaxrl.loop.rollout import score
from jaxrl.models.hf import CheckpointError
from jaxrl.policy_io import describe_source, load_policy
from jaxrl.sampling import SamplingConfig
from jaxrl.rewards.scoring import RewardScorer, eval_reward, pool_for
from jaxrl.samples import completion_records, write_completions
from jaxrl.sharding import gather, initialize_distributed, is_primary, layout_from, process_rows


@dataclasses.dataclass(frozen=True)
class Evaluator:
    """The held-out evaluation's reward: its pool, its config name, and what its mean is."""

    pool: rewards.RewardPool
    reward: str  # the config's name of it (`eval.reward` or `reward.function`)
    binary: bool  # right or wrong (registered `binary=True`): its mean is an accuracy
    answers: bool = False  # its completions hold answers that `extract_answer` finds: maj@k votes on them

    @property
    def metric(self) -> str:
        return "accuracy" if self.binary else "reward"

    @property
    def key(self) -> str:
        """The record's key of the evaluation's mean: `eval/accuracy` or `eval/reward`."""
        return f"eval/{self.metric}"

    @classmethod
    def of(cls, config: Config, pool: rewards.RewardPool) -> "Evaluator":
        name, entry = eval_reward(config)
        return cls(pool, name, bool(entry.info.get("binary")), bool(entry.info.get("answers")))


def evaluation_pool(config: Config, scorer: RewardScorer | None = None) -> rewards.RewardPool:
    """The pool of the evaluation's reward: the training scorer's verifiable-reward pool when it is the same
    reward (no second set of workers), else a new one (the caller closes it)."""
    if scorer is not None and config.eval.reward in (None, config.reward.function):
        return scorer.pools["correct"]
    return pool_for(eval_reward(config)[1].fn, config.reward)


def process_batches(problems, size: int, mesh):
    """Batches of `size` problems, the last padded by repeating its final problem (one compiled program for
    all), each as `(start, chunk, mine, real)`: the unpadded problems, this process's rows of the padded
    batch, and how many of those rows are real problems rather than padding."""
    rows = process_rows(size, mesh)
    for start in range(0, len(problems), size):
        chunk = list(problems[start:start + size])
        mine = (chunk + [chunk[-1]] * (size - len(chunk)))[rows]
        yield start, chunk, mine, max(0, min(len(chunk), rows.stop) - rows.start)


def evaluate(policy, generate: Generator, problems, evaluator: Evaluator, batch_size: int,
             max_new_tokens: int, completions: list | None = None) -> dict[str, float]:
    """Greedy accuracy (or mean reward, see `Evaluator`) on `problems`; every batch is padded to `batch_size`
    so one program serves all.
    Each process samples and scores its rows of every batch; the scores are gathered. `completions`, when
    given, is extended with one `samples.completion_records` row per problem this process sampled."""
    greedy = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    start, scores, lengths, sample_text, episodes = time.perf_counter(), [], [], None, []
    for _, chunk, padded, real in process_batches(problems, batch_size, generate.mesh):
        generation = generate(policy, padded, jax.random.key(0), greedy)
        local_scores = np.zeros(len(padded), np.float32)
        if real:
            local_scores[:real] = score(evaluator.pool, padded[:real], generation.texts[:real], 1).rewards
        row_lengths = generation.local.completion_mask.sum(1).astype(np.float32)
        all_scores, all_lengths = gather((local_scores, row_lengths), generate.mesh)
        scores += all_scores[:len(chunk)].tolist()
        lengths += all_lengths[:len(chunk)].tolist()
        if generation.episodes is not None:
            episodes += generation.episodes[:real]
        if completions is not None:  # this process's problems
            completions += completion_records([p.prompt for p in padded[:real]], [p.reference for p in padded[:real]],
                                              generation.texts[:real], local_scores[:real], row_lengths[:real],
                                              None if generation.episodes is None else
                                              [e.record() for e in generation.episodes[:real]])
        if sample_text is None and generation.texts:
            sample_text = generation.texts[0]
    metrics = {evaluator.key: float(np.mean(scores)), "eval/completion_length": float(np.mean(lengths))}
    if episodes:  # multi-turn: tool use and turns of this process's episodes
        metrics.update(episode_metrics(episodes, np.asarray(lengths[:len(episodes)]), prefix="eval/"))
    return {**metrics, "eval/num_problems": len(problems), "eval/seconds": time.perf_counter() - start,
            "eval/sample": sample_text}


def evaluate_sampled(policy, generate: Generator, problems, evaluator: Evaluator, config: Config,
                     key: jax.Array) -> dict[str, float]:
    """pass@k and maj@k on `problems`: `config.eval.samples` completions of each at `config.eval.temperature`
    (one prefill per problem, its samples sharing its KV cache), scored by the evaluation's reward; a
    completion is correct when that reward is at least 1. maj@k votes on the normalised extracted answers
    (rewards registered with `answers=True`: math and arithmetic; none for code)."""
    e = config.eval
    settings = dataclasses.replace(config.rl.sampling, temperature=e.temperature)
    per_call = max(1, e.batch_size // e.samples)  # problems per sampler call
    start, correct, votes = time.perf_counter(), [], []
    with_answers = evaluator.answers
    for i, chunk, padded, real in process_batches(problems, per_call, generate.mesh):
        generation = generate(policy, padded, jax.random.fold_in(key, i), settings,
                              group_size=e.samples)
        texts = generation.texts[:real * e.samples]
        local = np.zeros((len(padded), e.samples), bool)
        if real:
            scores = score(evaluator.pool, padded[:real], texts, e.samples).rewards
            local[:real] = scores.reshape(real, e.samples) >= 1.0
        local_votes = np.zeros((len(padded), len(e.pass_k)), bool)
        if with_answers:
            for p in range(real):
                answers = [rewards.answer_key(t) for t in texts[p * e.samples:(p + 1) * e.samples]]
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


def final_evaluation(policy, generate: Generator, problems, evaluator: Evaluator, config: Config,
                     completions: list | None = None) -> dict[str, Any]:
    """Greedy accuracy and, with `eval.samples`, pass@k / maj@k (drawn with key fold_in(seed, 4))."""
    result = evaluate(policy, generate, problems, evaluator, config.eval.batch_size,
                      config.rl.sampling.max_new_tokens, completions)
    if config.eval.samples:
        result.update(evaluate_sampled(policy, generate, problems, evaluator, config,
                                       jax.random.fold_in(jax.random.key(config.seed), 4)))
    return result


def evaluate_checkpoint(config: Config, checkpoint: str, completions_file: str | None = None) -> dict[str, Any]:
    """Held-out evaluation of a saved policy (`jaxrl eval CONFIG checkpoint=PATH`): greedy accuracy and, with
    `eval.samples`, pass@k / maj@k, on the evaluation problems of `config` (task, data, reward, sampling).

    `checkpoint`: a run directory (its newest checkpoint), one of its `checkpoints/<step>`, a policy checkpoint
    or a Hugging Face directory. A run's tokenizer is its `tokenizer.model`, or for a run started from an HF
    checkpoint the one its saved config names; otherwise `tokenizer.path` or the checkpoint's own tokenizer
    files (`setup.tokenizer_files`). `completions_file`: a JSONL of the greedy completion of every held-out
    problem (prompt, reference, completion, reward/correct, length; in a multi-process run, the primary
    process's share)."""
    initialize_distributed(config.distributed)
    _, eval_problems, _, _ = setup.load_task(config)
    layout = layout_from(config.mesh)
    source = describe_source(checkpoint)
    try:
        policy = load_policy(checkpoint, layout=layout, progress=progress.bars(config.progress))
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint: {e}") from None
    tokenizer, _ = setup.load_checkpoint_tokenizer(checkpoint, config, "checkpoint")
    generate = setup.make_generator(eval_problems, tokenizer, layout.mesh, config)
    completions = [] if completions_file else None
    with evaluation_pool(config) as pool, contextlib.ExitStack() as env:
        if config.env.multi_turn:  # episodes with the environment's workers, as in training
            generate = EpisodeGenerator(generate, env.enter_context(
                EnvPool(config.env, startup_timeout_s=config.reward.startup_timeout_s)), config.env)
        evaluator = Evaluator.of(config, pool)
        result = final_evaluation(policy, generate, eval_problems, evaluator, config, completions)
    if completions_file and is_primary():
        write_completions(completions_file, completions)
    return {"checkpoint": os.path.abspath(checkpoint), "kind": source.kind, "step": source.step,
            "eval_reward": evaluator.reward, **result}
