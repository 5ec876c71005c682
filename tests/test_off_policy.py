"""Bounded staleness and partial rollouts: the version schedule, the producer, the carry, and bad configs.

The loop's end-to-end behaviour (exact resume at rl.max_staleness=2 with partial rollouts) is in
test_resume.py; here the pieces run on stand-ins for the sampler, without compiling a model.
"""

import dataclasses
import json
import types

import jax
import numpy as np
import pytest

from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.loop import partial, producer
from jaxrl.loop.generate import Generation
from jaxrl.loop.rollout import RolloutResult
from jaxrl.sampling import FINISH_EOS, FINISH_LENGTH, Rollout

EOS, PAD = 1, 0


def test_each_step_is_sampled_by_the_newest_version_the_depth_allows_and_restarts_after_a_checkpoint():
    """depth 2, checkpoints every 4: steps 1-3 by the warm start; then 2 behind; after each checkpoint step the
    producer restarts from its version (what a run resumed there does)."""
    versions = [producer.sampling_version(s, depth=2, start=0, checkpoint_every=4) for s in range(1, 13)]
    assert versions == [0, 0, 0, 1, 4, 4, 4, 5, 8, 8, 8, 9]
    assert [producer.sampling_version(s, 0, 0, 4) for s in range(1, 6)] == [0, 1, 2, 3, 4]  # on-policy
    assert [producer.sampling_version(s, 1, 6, 0) for s in range(7, 11)] == [6, 6, 7, 8]  # resumed at 6
    for s in range(1, 40):  # never more than `depth` behind, never before the last restart
        v = producer.sampling_version(s, 3, 0, 5)
        assert s - 1 - 3 <= v <= s - 1 and v >= (s - 1) // 5 * 5


def test_staleness_metrics_count_each_token_and_refuse_one_beyond_the_bound():
    versions = np.array([[3, 3, 2, -1], [4, -1, -1, -1]])  # step 5 updates version 4
    metrics = producer.staleness_metrics(versions, step=5, bound=2)
    assert metrics["offpolicy/staleness_max"] == 2.0
    assert metrics["offpolicy/staleness_mean"] == pytest.approx((1 + 1 + 2 + 0) / 4)
    assert [metrics[f"offpolicy/staleness_{k}_frac"] for k in range(3)] == [0.25, 0.5, 0.25]
    with pytest.raises(RuntimeError, match="3 policy versions old, beyond rl.max_staleness = 2"):
        producer.staleness_metrics(np.array([[1, 4]]), step=5, bound=2)


class _FakeRun:
    """A sampler stand-in: sample g of problem p has a fixed total length `lengths[p][g]` (ending in EOS, or
    FINISH_LENGTH at the budget); token i of a completion is `10 + i`, its log-prob `-(i + 1) / 100`. Records
    each call's rows."""

    def __init__(self, lengths, max_new, segment, group_size):
        self.lengths, self.max_new, self.segment, self.group_size = lengths, max_new, segment, group_size
        self.prompt_lengths, self.prompt_length = (4,), 4
        self.tokenizer = types.SimpleNamespace(pad_id=PAD, decode=lambda row: " ".join(map(str, row)))
        self.mesh = None
        self.calls = []

    def _segment(self, done: int, total: int):
        n = min(self.segment, total - done)
        tokens = np.full(self.segment, PAD, np.int32)
        tokens[:n] = 10 + np.arange(done, done + n)
        if done + n == total and total < self.max_new:
            tokens[n - 1] = EOS
        logp = np.zeros(self.segment, np.float32)
        logp[:n] = -(np.arange(done, done + n) + 1) / 100
        finish = FINISH_EOS if done + n == total and total < self.max_new else FINISH_LENGTH
        return tokens, logp, np.arange(self.segment) < n, finish

    def _rollout(self, prompts, parts):
        tokens = np.stack([np.concatenate([p, t]) for p, (t, _, _, _) in zip(prompts, parts)])
        return Rollout(tokens, np.ones((len(prompts), 4), bool), np.stack([m for _, _, m, _ in parts]),
                       np.stack([lp for _, lp, _, _ in parts]), np.array([f for _, _, _, f in parts]))

    def __call__(self, policy, problems, key, config, temperature, group_size):
        assert config.max_new_tokens == self.segment and group_size == self.group_size
        self.calls.append(("new", len(problems)))
        prompts = [np.full(4, 2 + p.index, np.int32) for p in problems for _ in range(group_size)]
        parts = [self._segment(0, self.lengths[p.index][g]) for p in problems for g in range(group_size)]
        return Generation(None, self._rollout(prompts, parts), [])

    def continue_rows(self, policy, rows, key, config, temperature, lengths, row_counts):
        self.calls.append(("continue", len(rows)))
        parts = []
        for row in rows:  # the prompt identifies the problem; the completion so far, how far it got
            problem, done = int(row[0]) - 2, len(row) - 4
            sample = [g for g in range(self.group_size) if done < self.lengths[problem][g]
                      and np.array_equal(row[4:], 10 + np.arange(done))]
            parts.append(self._segment(done, self.lengths[problem][sample[0]]))
        return self._rollout([r[:4] for r in rows], parts)


def _rollout_through(monkeypatch, lengths, steps):
    """`steps` steps of partial rollouts (2 prompts per step, group 2, segments of 4, budget 12, 2 extra
    groups, max_carry 1) over problems 0.. whose samples have `lengths`; returns each step's `(step, trained
    groups, metrics)`, the last carry and the stand-in sampler."""
    config = load_config(Config, "configs/default.yaml", [
        "rl.prompts_per_step=2", "rl.group_size=2", "rl.sampling.max_new_tokens=12",
        "rl.partial_rollouts.segment_tokens=4", "rl.max_staleness=1"])
    problems = [types.SimpleNamespace(index=i) for i in range(len(lengths))]
    batches = iter([problems[i:i + 2] for i in range(0, len(problems), 2)])
    fake = _FakeRun(lengths, 12, 4, 2)
    sampler = types.SimpleNamespace(config=config, generate=fake, key=jax.random.key(0))
    monkeypatch.setattr(partial, "_generation", lambda generate, groups, max_new: (groups, None))
    carry, taken = partial.Carry(), []
    for step in range(1, steps + 1):
        groups, _, _, carry, metrics, _ = partial.rollout(sampler, step, step - 1, None, 1.0, batches, carry)
        taken.append((step, groups, metrics))
    return taken, carry, fake


def test_partial_rollouts_train_the_oldest_complete_groups_and_carry_the_rest_at_most_max_carry_steps(monkeypatch):
    """Problems 0-7 (2 per batch, group 2, segments of 4, budget 12). Long samples (12 tokens: 3 segments) and
    short ones (3 tokens): a step stops once 2 groups are complete; carried groups finish in the next step."""
    L, S = 12, 3
    lengths = [[S, S], [L, S], [S, S], [S, L], [S, S], [S, S], [L, L], [S, S]]
    taken, carry, fake = _rollout_through(monkeypatch, lengths, steps=3)
    step1 = taken[0]
    # step 1: groups 0-3 in flight; after one segment 0 and 2 are complete: trained; 1 and 3 carried
    assert [g.problem.index for g in step1[1]] == [0, 2] and step1[2]["partial/rounds"] == 1
    step2 = taken[1]
    # step 2: new groups 4 and 5 are complete after their first segment, but carried 1 and 3 must finish
    # (max_carry 1): the step goes on until they do, and trains them, the oldest
    assert [g.problem.index for g in step2[1]] == [1, 3]
    assert all(g.complete for _, groups, _ in taken for g in groups)
    for step, groups, _ in taken:
        for g in groups:
            for row, total in zip(g.rows, lengths[g.problem.index]):
                assert len(row.tokens) == total  # every token, once, in order
                np.testing.assert_array_equal(row.tokens[:-1], 10 + np.arange(total - 1))
                np.testing.assert_allclose(row.logp, -(np.arange(total) + 1) / 100)
                assert row.finish == (FINISH_LENGTH if total == L else FINISH_EOS)
                assert step - 1 - row.versions.min() <= 1  # the staleness bound (depth 0 + 1 carry)
    long_row = step2[1][0].rows[0]  # problem 1's long sample: 1 segment in step 1, 2 in step 2
    np.testing.assert_array_equal(long_row.versions, [0] * 4 + [1] * 8)
    assert all(g.carried <= 1 for g in carry.groups)
    assert ("continue", 2) in fake.calls  # only the unfinished rows of carried groups are continued


def test_a_carry_survives_its_checkpoint_record(monkeypatch):
    _, carry, _ = _rollout_through(monkeypatch, [[12, 3], [3, 12], [12, 12], [3, 3], [3, 3], [3, 3]], steps=2)
    problems = [types.SimpleNamespace(index=i) for i in range(6)]
    index_of = {id(g.problem): g.problem.index for g in carry.groups}
    index_of.update({id(p): p.index for p in carry.queued})
    record = partial.carry_record(carry, index_of)
    back = partial.carry_from_record(json.loads(json.dumps(record)), problems)
    assert len(back.groups) == len(carry.groups) > 0
    for a, b in zip(carry.groups, back.groups):
        assert (a.problem.index, a.started, a.carried) == (b.problem.index, b.started, b.carried)
        for x, y in zip(a.rows, b.rows):
            for field in ("prompt", "tokens", "logp", "versions"):
                np.testing.assert_array_equal(getattr(x, field), getattr(y, field))
                assert getattr(x, field).dtype == getattr(y, field).dtype
            assert x.finish == y.finish


class _Prompts:
    def __init__(self):
        self.drawn = 0

    def __next__(self):
        self.drawn += 1
        return [f"prompt {self.drawn}"]

    def get_state(self):
        return {"drawn": self.drawn}


@pytest.mark.parametrize("staleness", [0, 2])
def test_the_producer_starts_each_step_once_its_version_exists_and_in_step_order(monkeypatch, staleness):
    """Each step's rollout is sampled by the state published as its version, whether on the producer's thread
    (staleness 2) or inline; the prompt iterator's position after each step is the one it had then."""
    seen = []

    def fake_sample(sampler, step, state, problems, controls, prompts, background):
        seen.append((step, state, problems[0], background))
        local = Rollout(None, None, np.ones((1, 3), bool), None, None)
        return RolloutResult(problems, Generation(None, local, []), None, 0.0, 0.0, {})

    monkeypatch.setattr(producer, "sample_rollout", fake_sample)
    config = load_config(Config, "configs/default.yaml", [f"rl.max_staleness={staleness}", "checkpoint.every=0"])
    prompts = _Prompts()
    run = producer.Producer(types.SimpleNamespace(config=config), prompts, start=0, last=6, carry=None)
    try:
        run.publish(0, "v0", None)
        assert run.submitted == 1 + staleness  # steps 1..1+depth are the warm start's
        for step in range(1, 7):
            produced = run.take(step)
            assert produced.version == max(0, step - 1 - staleness)
            assert produced.iterator_state == {"drawn": step}
            assert produced.result.versions.tolist() == [[produced.version] * 3]
            run.publish(step, f"v{step}", None)
    finally:
        run.close()
    assert [(s, v) for s, v, _, _ in seen] == [(s, f"v{max(0, s - 1 - staleness)}") for s in range(1, 7)]
    assert [p for _, _, p, _ in seen] == [f"prompt {s}" for s in range(1, 7)]
    assert all(background == bool(staleness) for *_, background in seen)
    with pytest.raises(RuntimeError, match="step 9's rollout was never started"):
        run.take(9)


@pytest.mark.parametrize("overrides, error", [
    (["rl.max_staleness=-1"], "rl.max_staleness"),
    (["rl.max_staleness=2", "rl.overlap=true"], "rl.overlap is the older name"),
    (["rl.max_staleness=1", "rl.partial_rollouts.segment_tokens=20"], r"segment_tokens \(20\) must divide"),
    (["rl.max_staleness=1", "rl.partial_rollouts.segment_tokens=48"], r"segment_tokens \(48\) must divide"),
    (["rl.partial_rollouts.segment_tokens=16"], r"rl.max_staleness \(0\) is below rl.partial_rollouts.max_carry"),
    (["rl.max_staleness=1", "rl.partial_rollouts.segment_tokens=16", "rl.partial_rollouts.max_carry=2"],
     r"rl.max_staleness \(1\) is below"),
    (["rl.max_staleness=1", "rl.partial_rollouts.segment_tokens=16", "rl.partial_rollouts.extra_groups=17"],
     r"extra_groups \(17\) exceeds rl.prompts_per_step"),
    (["rl.max_staleness=1", "rl.partial_rollouts.segment_tokens=16", "rl.dynamic_sampling.enabled=true"],
     "rl.partial_rollouts with rl.dynamic_sampling.enabled"),
    (["rl.max_staleness=1", "rl.partial_rollouts.segment_tokens=16", "tokenizer.stop_strings=[</a>]"],
     "rl.partial_rollouts with tokenizer.stop_strings"),
    (["rl.max_staleness=1", "rl.partial_rollouts.segment_tokens=16", "rl.loss.advantage.estimator=remax"],
     "rl.partial_rollouts with rl.loss.advantage.estimator 'remax'"),
    (["rl.max_staleness=1", "rl.partial_rollouts.segment_tokens=16", "rl.partial_rollouts.segment_tokens=-4"],
     "rl.partial_rollouts.segment_tokens"),
])
def test_bad_staleness_and_partial_rollout_settings_name_the_field(overrides, error):
    with pytest.raises(ValueError, match=error):
        load_config(Config, "configs/default.yaml", overrides)


def test_the_extended_row_finishes_on_a_stop_or_at_the_budget():
    row = partial.Row(np.array([5], np.int32), *partial._empty())
    mid = partial.extended(row, np.array([10, 11, 0, 0]), np.array([-.1, -.2, 0, 0]),
                           np.array([1, 1, 0, 0], bool), FINISH_LENGTH, version=3, max_new_tokens=8)
    assert mid.finish is None and mid.tokens.tolist() == [10, 11] and mid.versions.tolist() == [3, 3]
    stop = partial.extended(mid, np.array([EOS, 0]), np.array([-.3, 0]), np.array([1, 0], bool), FINISH_EOS, 4, 8)
    assert stop.finish == FINISH_EOS and stop.versions.tolist() == [3, 3, 4]
    full = partial.extended(dataclasses.replace(mid, tokens=np.arange(6)), np.array([7, 8]), np.zeros(2),
                            np.ones(2, bool), FINISH_LENGTH, 4, 8)
    assert full.finish == FINISH_LENGTH
