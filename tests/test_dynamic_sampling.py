"""DAPO dynamic sampling: which groups are kept, how rounds are assembled, and the loop that draws them."""

import numpy as np
import pytest

from jaxrl.dynamic_sampling import assemble, informative_groups, select_groups
from jaxrl.sampling import Rollout


def test_informative_groups_are_those_whose_rewards_differ():
    rewards = np.array([1, 1, 0, 0, 1, 0, 0.5, 0.5, 0.2, 0.3])
    np.testing.assert_array_equal(informative_groups(rewards, 2), [False, False, True, False, True])
    # equal in float32, the advantages' precision: such a group gets zero advantages, so it is not informative
    np.testing.assert_array_equal(informative_groups(np.array([0.7, 0.7 + 1e-12, 0.7, 0.7 + 1e-6]), 2),
                                  [False, True])


def test_select_takes_informative_groups_in_draw_order_then_fills():
    rounds = [np.array([True, False, False]), np.array([False, True, True])]
    assert select_groups(rounds, 2) == ([(0, 0), (1, 1)], 0)
    assert select_groups(rounds, 3) == ([(0, 0), (1, 1), (1, 2)], 0)
    # only 1 informative in all: the first-drawn uninformative groups fill, kept in draw order
    sparse = [np.array([False, True, False]), np.array([False, False, False])]
    assert select_groups(sparse, 3) == ([(0, 0), (0, 1), (0, 2)], 2)
    with pytest.raises(ValueError, match="fewer than the batch's 7"):
        select_groups(sparse, 7)


def _rollout(prompt_len, rows, offset, new=3):
    tokens = np.arange(rows * (prompt_len + new)).reshape(rows, -1) + offset
    valid = np.ones((rows, prompt_len), bool)
    valid[:, 0] = False
    return Rollout(tokens, valid, np.ones((rows, new), bool), np.full((rows, new), offset, np.float32),
                   np.arange(rows) + offset, None)


def test_assemble_left_pads_rounds_to_the_longest_prompt():
    g = 2
    short, long = _rollout(4, 4, 1000), _rollout(6, 4, 2000)  # 2 groups each
    out = assemble([short, long], select_groups([np.array([False, True]), np.array([True, False])], 2), g, 7)
    assert out.tokens.shape == (4, 9) and out.prompt_valid.shape == (4, 6) and out.policy_logp is None
    # group 1 of the short round, left-padded by 2 pad tokens (invalid), then group 0 of the long round
    np.testing.assert_array_equal(out.tokens[:2, :2], 7)
    np.testing.assert_array_equal(out.tokens[:2, 2:], short.tokens[2:4])
    np.testing.assert_array_equal(out.prompt_valid[:2], np.c_[np.zeros((2, 2), bool), short.prompt_valid[2:4]])
    np.testing.assert_array_equal(out.tokens[2:], long.tokens[:2])
    np.testing.assert_array_equal(out.finish_reason, [1002, 1003, 2000, 2001])
    np.testing.assert_array_equal(out.sampler_logp[:, 0], [1000, 1000, 2000, 2000])


def test_dynamic_sampling_in_the_loop(tmp_path):
    """A barely trained policy solves few problems: rounds are drawn up to the bound, the batch is filled
    with uninformative groups when they run out, and the metrics say so; the run is reproducible."""
    from jaxrl import loop
    from jaxrl.config import Config
    from jaxrl.configlib import load_config
    from jaxrl.metrics import read_metrics

    def run(out):
        config = load_config(Config, "configs/default.yaml", [
            "model.hidden_size=32", "model.num_layers=1", "model.head_dim=8", "model.intermediate_size=64",
            "task.num_train=200", "task.num_eval=8", "sft.steps=30", "sft.batch_size=8", "rl.steps=3",
            "rl.prompts_per_step=4", "rl.group_size=4", "rl.sampling.max_new_tokens=16",
            "rl.dynamic_sampling.enabled=true", "rl.dynamic_sampling.max_rounds=3", "eval.every=0",
            "eval.batch_size=8", "checkpoint.every=0", "reward.num_workers=1", "progress=false",
            f"output_dir={out}"])
        loop.run(config)
        return [r for r in read_metrics(out / "metrics.jsonl") if "dynamic/rounds" in r]

    records = run(tmp_path / "a")
    assert len(records) == 3
    for r in records:
        assert 1 <= r["dynamic/rounds"] <= 3
        assert r["dynamic/prompts_sampled"] == 4 * r["dynamic/rounds"]
        assert 0 <= r["dynamic/filled_groups"] <= 4
        if r["dynamic/rounds"] < 3:  # stopped early: the batch is full of informative groups
            assert r["dynamic/filled_groups"] == 0
        # a filled batch still holds some groups all correct or all wrong
        informative = 1 - r["prompts/all_correct_frac"] - r["prompts/none_correct_frac"]
        assert informative >= (4 - r["dynamic/filled_groups"]) / 4 - 1e-9
        assert 0 <= r["dynamic/sampled_reward_mean"] <= 1
        if r["dynamic/rounds"] == 1:  # the first round's groups are the batch
            assert r["dynamic/sampled_reward_mean"] == pytest.approx(r["reward/mean"])
    assert any(r["dynamic/rounds"] > 1 for r in records), records
    timings = [r for r in read_metrics(tmp_path / "a" / "timings.jsonl") if "time/update_s" in r]
    assert len(timings) == 3 and all(t["time/idle_s"] == 0.0 for t in timings)  # no background rollout here
    assert run(tmp_path / "b") == records
