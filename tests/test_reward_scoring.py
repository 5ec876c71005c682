"""Tests for jaxrl.rewards.scoring and the reward fields of the config: several rewards with weights
(`reward.extra`), the evaluation's reward (`eval.reward`), and their checks when the config loads."""

import os
import sys
import textwrap

import numpy as np
import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # spawned workers and `reward_fns:...` names import the test rewards
    sys.path.insert(0, _HERE)

import reward_fns  # noqa: E402

from jaxrl.config import Config, RewardConfig  # noqa: E402
from jaxrl.configlib import ConfigError, dump_yaml, load_config  # noqa: E402
from jaxrl.rewards import RewardScorer, format_reward  # noqa: E402
from jaxrl.rewards.scoring import eval_reward, reward_functions, shape  # noqa: E402


def test_scorer_scores_every_reward_and_shape_composes_them_with_their_weights():
    texts = ["<think>a</think><answer>4</answer>", "4", "hang", "four"]
    references = ["<think>a</think><answer>4</answer>", "4", "4", "4"]
    functions = {"correct": reward_fns.chaos, "reward_fns:brevity": reward_fns.brevity,
                 "batch": reward_fns.batch_lengths}
    config = RewardConfig(extra={"reward_fns:brevity": 0.5, "batch": 0.0}, format_weight=0.25,
                          num_workers=1, timeout_s=0.25)
    with RewardScorer(functions, config) as scorer:
        scored = scorer.score(texts, references, prompts=["p"] * 4)
    brevity = [-len(t) / 100 for t in texts]
    assert list(scored.components) == ["correct", "reward_fns:brevity", "batch"]
    np.testing.assert_array_equal(scored.rewards, [1.0, 1.0, 0.0, 0.0])  # "hang" timed out in `correct`
    np.testing.assert_allclose(scored.components["reward_fns:brevity"], brevity, rtol=1e-6)
    np.testing.assert_array_equal(scored.components["batch"], [0.0, 0.0, 0.0, 0.0])  # its one chunk hung
    assert (scored.results["correct"].timeouts, scored.results["batch"].timeouts) == (1, 4)
    assert (scored.timeouts, scored.errors) == (5, 0)
    assert scored.seconds == pytest.approx(sum(r.seconds for r in scored.results.values()))
    metrics = scored.metrics()
    assert metrics["reward/mean"] == 0.5 and metrics["reward/timeouts"] == 5.0
    assert (metrics["reward/batch/timeouts"], metrics["reward/reward_fns:brevity/errors"]) == (4.0, 0.0)

    composed = shape(scored.components, texts, np.array([9, 1, 1, 1]), config, max_new_tokens=16)
    formats = [format_reward(t) for t in texts]
    assert formats == [1.0, 0.0, 0.0, 0.0]
    expected = [c + 0.5 * b + 0.25 * f for c, b, f in zip([1.0, 1.0, 0.0, 0.0], brevity, formats)]
    np.testing.assert_allclose(composed.total, expected, rtol=1e-6)
    assert list(composed.components) == ["correct", "format", "reward_fns:brevity", "batch"]
    logged = composed.metrics()
    assert logged["reward/reward_fns:brevity"] == pytest.approx(np.mean(brevity))
    assert logged["reward/correct"] == 0.5


def test_shape_without_extras_is_the_shaped_verifiable_reward():
    config = RewardConfig(overlong_buffer=4, length_target=8, length_penalty_coef=0.5)
    composed = shape({"correct": np.array([1.0, 0.0, 1.0])}, ["a", "b", "c"], np.array([2, 14, 16]), config,
                     max_new_tokens=16)
    overlong = [0.0, -0.5, -1.0]  # the last 4 tokens before 16: a ramp to -1
    length = [0.0, -0.5 * 6 / 8, -0.5 * 8 / 8]
    np.testing.assert_allclose(composed.total, np.array([1.0, 0.0, 1.0]) + overlong + length, rtol=1e-6)
    assert list(composed.components) == ["correct", "overlong", "length"]


def test_config_names_every_reward_and_resolves_them_when_it_loads(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent("""
        reward:
          function: math
          extra:
            reward_fns:brevity: 0.1
            arithmetic: 0.0
        eval:
          reward: reward_fns:exact_match
        """).lstrip())
    config = load_config(Config, path)
    assert config.reward.component_weights() == {"correct": 1.0, "reward_fns:brevity": 0.1, "arithmetic": 0.0}
    pieces = config.pieces()
    assert pieces["reward.extra.reward_fns:brevity"].fn is reward_fns.brevity
    assert pieces["reward.extra.arithmetic"].name == "arithmetic"
    assert pieces["eval.reward"].fn is reward_fns.exact_match
    assert list(reward_functions(config)) == ["correct", "reward_fns:brevity", "arithmetic"]
    assert reward_functions(config, reward_fns.quarter)["correct"] is reward_fns.quarter
    assert eval_reward(config) == ("reward_fns:exact_match", pieces["eval.reward"])
    tuned = load_config(Config, path, ["reward.batch_size=8", "reward.num_workers=3", "reward.timeout_s=0.5",
                                       "reward.batch_timeout_s=9", "reward.startup_timeout_s=120"])
    with RewardScorer.from_config(tuned) as scorer:  # workers start on the first score(): none here
        assert list(scorer.pools) == ["correct", "reward_fns:brevity", "arithmetic"]
        assert scorer.pools["correct"].reward_fn.__name__ == "math_verify"
        assert {(p.batch_size, p.num_workers, p.timeout_s, p.batch_timeout_s, p.startup_timeout_s)
                for p in scorer.pools.values()} == {(8, 3, 0.5, 9.0, 120.0)}
    assert eval_reward(Config()) == ("arithmetic", Config().pieces()["reward.function"])
    assert "eval.reward" not in Config().pieces()
    # the run's config.yaml names them, and loads back equal
    dumped = tmp_path / "config.yaml"
    dumped.write_text(dump_yaml(config))
    again = load_config(Config, dumped)
    assert again == config and hash(again) == hash(config)
    assert list(again.reward.extra) == ["reward_fns:brevity", "arithmetic"]


def test_config_refuses_unknown_and_reserved_extra_rewards_where_they_are_written(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("reward:\n  extra:\n    reward_fns:brevity: 0.1\n    reward_fns:no_such_fn: 0.2\n")
    with pytest.raises(ConfigError, match=rf"^{path}:4: reward.extra.reward_fns:no_such_fn: module 'reward_fns' "
                                          r"\(.*\) has no 'no_such_fn'"):
        load_config(Config, path)
    path.write_text("reward:\n  extra:\n    no_such_reward: 0.1\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: reward.extra.no_such_reward: unknown reward "
                                          "'no_such_reward'; registered: 'arithmetic', 'code', 'math'"):
        load_config(Config, path)
    with pytest.raises(ConfigError, match="reward.extra.missing_module:fn: cannot import module 'missing_module'"):
        load_config(Config, None, ["reward.extra={missing_module:fn: 1}"])
    with pytest.raises(ConfigError, match="reward.extra.reward_fns:spin: reward .*spin.* takes seconds"):
        load_config(Config, None, ["reward.extra={reward_fns:spin: 1}"])  # a wrong signature, before any model
    path.write_text("reward:\n  extra:\n    format: 0.1\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: reward: reward.extra.format: 'format' is taken"):
        load_config(Config, path)
    with pytest.raises(ConfigError, match=r"reward.extra.reward_fns:brevity: must be finite, got inf"):
        load_config(Config, None, ["reward.extra={reward_fns:brevity: .inf}"])
    with pytest.raises(ConfigError, match="eval.reward: unknown reward 'nope'"):
        load_config(Config, None, ["eval.reward=nope"])


def test_a_reward_config_built_in_python_is_read_only_and_hashable():
    config = RewardConfig(extra={"reward_fns:brevity": 0.1})
    assert hash(config) == hash(RewardConfig(extra={"reward_fns:brevity": 0.1}))
    assert config == RewardConfig(extra={"reward_fns:brevity": 0.1}) != RewardConfig()
    with pytest.raises(TypeError):
        config.extra["other"] = 1.0
