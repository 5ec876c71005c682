"""Held-out evaluation: greedy accuracy (`evaluate`), pass@k and maj@k (`evaluate_sampled`), and the
evaluation of a saved policy behind `jaxrl eval` (`evaluate_checkpoint`)."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import numpy as np

from jaxrl import evaluation, rewards
from jaxrl.config import Config
from jaxrl.loop import setup
from jaxrl.loop.generate import Generator
from jaxrl.models.hf import CheckpointError
from jaxrl.policy_io import describe_source, load_policy
from jaxrl.sampling import SamplingConfig
from jaxrl.sharding import gather, initialize_distributed, layout_from, process_rows


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
             max_new_tokens: int) -> dict[str, float]:
    """Greedy accuracy on `problems`; every batch is padded to `batch_size` so one program serves all.
    Each process samples and scores its rows of every batch; the scores are gathered."""
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
    with_answers = config.reward.function in ("arithmetic", "math")
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


def final_evaluation(policy, generate: Generator, problems, pool: rewards.RewardPool, config: Config
                     ) -> dict[str, Any]:
    """Greedy accuracy and, with `eval.samples`, pass@k / maj@k (drawn with key fold_in(seed, 4))."""
    result = evaluate(policy, generate, problems, pool, config.eval.batch_size, config.rl.sampling.max_new_tokens)
    if config.eval.samples:
        result.update(evaluate_sampled(policy, generate, problems, pool, config,
                                       jax.random.fold_in(jax.random.key(config.seed), 4)))
    return result


def evaluate_checkpoint(config: Config, checkpoint: str) -> dict[str, Any]:
    """Held-out evaluation of a saved policy (`jaxrl eval CONFIG checkpoint=PATH`): greedy accuracy and, with
    `eval.samples`, pass@k / maj@k, on the evaluation problems of `config` (task, data, reward, sampling).

    `checkpoint`: a run directory (its newest checkpoint), one of its `checkpoints/<step>`, a policy checkpoint
    or a Hugging Face directory. A run's tokenizer is its `tokenizer.model`, or for a run started from an HF
    checkpoint the one its saved config names; otherwise `tokenizer.path` or the checkpoint's own tokenizer
    files (`setup.tokenizer_files`)."""
    initialize_distributed(config.distributed)
    _, eval_problems, _, _ = setup.load_task(config)
    layout = layout_from(config.mesh)
    source = describe_source(checkpoint)
    try:
        policy = load_policy(checkpoint, layout=layout, progress=config.progress)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint: {e}") from None
    tokenizer, _ = setup.load_checkpoint_tokenizer(checkpoint, config, "checkpoint")
    generate = setup.make_generator(eval_problems, tokenizer, layout.mesh, config)
    r = config.reward
    with rewards.RewardPool(setup.REWARD_FUNCTIONS[r.function], num_workers=r.num_workers, timeout_s=r.timeout_s,
                            batch_timeout_s=r.batch_timeout_s) as pool:
        result = final_evaluation(policy, generate, eval_problems, pool, config)
    return {"checkpoint": os.path.abspath(checkpoint), "kind": source.kind, "step": source.step, **result}
