"""Partial rollouts (`rl.partial_rollouts`): a step's sampling stops paying for its longest generations.

Kimi k1.5 (arXiv 2501.12599) carries long generations over to later iterations; APRIL (arXiv 2509.18521)
over-provisions the rollout and recycles the unfinished part. Here, per step:

1. The groups in flight are the carried ones and new ones, `prompts_per_step + extra_groups` in all.
2. Rounds of `segment_tokens` decode every unfinished row: a new group's first segment shares its prompt's
   prefill; a carried row continues from its prompt and completion so far, prefilled again under the newer
   policy (its old cache was computed by older parameters).
3. Once `prompts_per_step` groups are complete (every sample finished), and every group carried
   `max_carry` times is among them, the step trains the oldest complete ones; the rest are carried over.

Each token keeps the policy version that sampled it and its `sampler_logp`, so the trainer's rollout
correction weighs each token against the policy that actually drew it. A `Carry` is host data (numpy
rows): it is saved in checkpoints (`carry_record` / `carry_from_record`) so a resumed run continues it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from jaxrl.loop.generate import Generation
from jaxrl.sampling import FINISH_EOS, FINISH_LENGTH, Rollout
from jaxrl.sharding import from_process_local
from jaxrl.tokenizer import left_pad


@dataclasses.dataclass(frozen=True)
class Row:
    """One sample: `prompt [Lp]` (unpadded) and its completion so far, `tokens`, `logp` (the sampler's),
    `versions` (the policy version that sampled each token), all `[n]`; `finish` is FINISH_EOS or
    FINISH_LENGTH once the sample is finished, else None."""

    prompt: np.ndarray
    tokens: np.ndarray
    logp: np.ndarray
    versions: np.ndarray
    finish: int | None = None


@dataclasses.dataclass(frozen=True)
class Group:
    """A prompt's `group_size` samples; `started`: the step whose rollout began it; `carried`: the steps it
    has been carried over so far."""

    problem: Any
    rows: tuple[Row, ...]
    started: int
    carried: int = 0

    @property
    def complete(self) -> bool:
        return all(r.finish is not None for r in self.rows)


@dataclasses.dataclass(frozen=True)
class Carry:
    """What partial rollouts carry between steps: the groups in flight and the prompts drawn from the
    iterator that have not started yet (the iterator yields `prompts_per_step` at a time)."""

    groups: tuple[Group, ...] = ()
    queued: tuple = ()


def extended(row: Row, tokens: np.ndarray, logp: np.ndarray, mask: np.ndarray, finish: int, version: int,
             max_new_tokens: int) -> Row:
    """`row` after one segment: its generated `tokens [S]` where `mask [S]`, and finished when the segment
    ended on a stop (`finish` FINISH_EOS) or the completion reached `max_new_tokens` (FINISH_LENGTH)."""
    n = int(mask.sum())
    new_tokens = np.concatenate([row.tokens, tokens[:n]]).astype(np.int32)
    done = FINISH_EOS if finish == FINISH_EOS else (FINISH_LENGTH if len(new_tokens) >= max_new_tokens else None)
    return Row(row.prompt, new_tokens, np.concatenate([row.logp, logp[:n]]).astype(np.float32),
               np.concatenate([row.versions, np.full(n, version, np.int32)]), done)


def rollout(sampler, step: int, version: int, policy, temperature, prompts_iter, carry: Carry
            ) -> tuple[Generation, list, np.ndarray, Carry, dict[str, float], float]:
    """Step's batch by partial rollouts with `policy` (version `version`). Returns `(generation, problems,
    versions [B, N] int32 (-1 off the completion), carry after the step, metrics, sampling seconds)`, the
    generation's rows `p * G + g` as a one-step rollout's."""
    rl = sampler.config.rl
    partial, group_size, wanted = rl.partial_rollouts, rl.group_size, rl.prompts_per_step
    in_flight = wanted + (partial.extra_groups if partial.extra_groups is not None else wanted)
    segment = dataclasses.replace(rl.sampling, max_new_tokens=partial.segment_tokens)
    max_new, generate = rl.sampling.max_new_tokens, sampler.generate
    key = jax.random.fold_in(sampler.key, step)
    t0 = time.perf_counter()
    groups, queued = list(carry.groups), list(carry.queued)
    need = in_flight - len(groups)
    while len(queued) < need:
        queued.extend(next(prompts_iter))
    fresh, queued = queued[:need], queued[need:]
    carried_in = len(groups)
    if fresh:  # first segments, each prompt prefilled once for its group
        out = generate(policy, fresh, jax.random.fold_in(key, 0), segment, temperature, group_size=group_size)
        local = out.local
        prompts = _prompts(local)
        for i, problem in enumerate(fresh):
            rows = tuple(extended(Row(prompts[r], *_empty()), local.completion_tokens[r], local.sampler_logp[r],
                                  local.completion_mask[r], int(local.finish_reason[r]), version, max_new)
                         for r in range(i * group_size, (i + 1) * group_size))
            groups.append(Group(problem, rows, step))
    rounds, decoded = 1, len(fresh) * group_size
    continue_now = carried_in > 0  # the carried groups' next segment belongs to the first round
    while True:
        if continue_now:
            groups, rows_decoded = _continue(generate, policy, groups, segment, temperature,
                                             jax.random.fold_in(key, rounds), version, max_new,
                                             only=None if rounds > 1 else range(carried_in))
            decoded += rows_decoded
        complete = [g for g in groups if g.complete]
        forced_done = all(g.complete for g in groups if g.carried >= partial.max_carry)
        if len(complete) >= wanted and forced_done:
            break
        rounds += 1
        continue_now = True
    order = sorted(range(len(groups)), key=lambda i: (groups[i].started, i))
    taken = [i for i in order if groups[i].complete][:wanted]
    kept = tuple(dataclasses.replace(groups[i], carried=groups[i].carried + 1) for i in order if i not in taken)
    batch = [groups[i] for i in taken]
    generation, versions = _generation(generate, batch, max_new)
    metrics = {"partial/rounds": float(rounds), "partial/rows_decoded": float(decoded),
               "partial/carried_in": float(carried_in),
               "partial/carried_trained": float(sum(g.started < step for g in batch)),
               "partial/max_carried": float(max(g.carried for g in batch))}
    return (generation, [g.problem for g in batch], versions, Carry(kept, tuple(queued)), metrics,
            time.perf_counter() - t0)


def _empty():
    return np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32)


def _prompts(local: Rollout) -> list[np.ndarray]:
    """Each row's prompt token ids without its left padding."""
    width = local.prompt_valid.shape[1]
    tokens = np.asarray(local.tokens)[:, :width]
    return [tokens[r][np.asarray(local.prompt_valid[r])].astype(np.int32) for r in range(tokens.shape[0])]


def _continue(generate, policy, groups: list[Group], segment, temperature, key, version: int, max_new: int,
              only) -> tuple[list[Group], int]:
    """One segment of every unfinished row of `groups` (of the groups indexed by `only`, when given)."""
    indices = range(len(groups)) if only is None else only
    at = [(g, r) for g in indices for r, row in enumerate(groups[g].rows) if row.finish is None]
    if not at:
        return groups, 0
    rows = [np.concatenate([groups[g].rows[r].prompt, groups[g].rows[r].tokens]) for g, r in at]
    # few shapes, so few compiled programs: two lengths (a carried row holds at most max_new - segment tokens)
    # and three row counts (a quarter, half or all of the rows in flight)
    lengths = (generate.prompt_length + max_new // 2, generate.prompt_length + max_new - segment.max_new_tokens)
    in_flight = sum(len(g.rows) for g in groups)
    out = generate.continue_rows(policy, rows, key, segment, temperature, lengths,
                                 (-(-in_flight // 4), -(-in_flight // 2), in_flight))
    groups = list(groups)
    for i, (g, r) in enumerate(at):
        row = extended(groups[g].rows[r], out.completion_tokens[i], out.sampler_logp[i], out.completion_mask[i],
                       int(out.finish_reason[i]), version, max_new)
        groups[g] = dataclasses.replace(groups[g], rows=groups[g].rows[:r] + (row,) + groups[g].rows[r + 1:])
    return groups, len(at)


def _generation(generate, groups: list[Group], max_new: int) -> tuple[Generation, np.ndarray]:
    """The rollout of `groups`' finished rows (prompts left-padded to the generator's bucket that fits them,
    completions padded to `max_new`), and the versions `[B, N]` of their tokens (-1 elsewhere)."""
    rows = [row for g in groups for row in g.rows]
    longest = max(len(r.prompt) for r in rows)
    width = next((n for n in generate.prompt_lengths if n >= longest), longest)
    pad = generate.tokenizer.pad_id
    prompt_tokens, prompt_valid = left_pad([r.prompt for r in rows], width, pad)
    completion = np.full((len(rows), max_new), pad, np.int32)
    mask = np.zeros((len(rows), max_new), bool)
    logp = np.zeros((len(rows), max_new), np.float32)
    versions = np.full((len(rows), max_new), -1, np.int32)
    for i, r in enumerate(rows):
        n = len(r.tokens)
        completion[i, :n], mask[i, :n], logp[i, :n], versions[i, :n] = r.tokens, True, r.logp, r.versions
    finish = np.array([r.finish for r in rows], np.int32)
    local = Rollout(np.concatenate([prompt_tokens, completion], axis=1), prompt_valid, mask, logp, finish)
    rollout = Rollout(*from_process_local(tuple(local[:5]), generate.mesh))
    texts = [generate.tokenizer.decode(row) for row in local.completion_tokens]
    return Generation(rollout, local, texts), versions


def carry_record(carry: Carry, index_of: dict[int, int]) -> dict:
    """`carry` as JSON-able data for a checkpoint's metadata: problems by their index in the training set."""
    return {"groups": [{"problem": index_of[id(g.problem)], "started": g.started, "carried": g.carried,
                        "rows": [_row_record(r) for r in g.rows]} for g in carry.groups],
            "queued": [index_of[id(p)] for p in carry.queued]}


def carry_from_record(record: dict, problems: list) -> Carry:
    """The `Carry` that `carry_record` saved, its problems taken from the training set `problems`."""
    groups = tuple(Group(problems[g["problem"]], tuple(_row_from_record(r) for r in g["rows"]), g["started"],
                         g["carried"]) for g in record["groups"])
    return Carry(groups, tuple(problems[i] for i in record["queued"]))


def _row_record(row: Row) -> dict:
    return {"prompt": row.prompt.tolist(), "tokens": row.tokens.tolist(), "logp": row.logp.tolist(),
            "versions": row.versions.tolist(), "finish": row.finish}


def _row_from_record(record: dict) -> Row:
    return Row(np.asarray(record["prompt"], np.int32), np.asarray(record["tokens"], np.int32),
               np.asarray(record["logp"], np.float32), np.asarray(record["versions"], np.int32), record["finish"])
