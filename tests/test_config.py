"""The run configuration: the shipped recipe loads, and malformed configs stop with the field named."""

import pytest

from jaxrl import cli
from jaxrl.config import Config
from jaxrl.configlib import ConfigError, load_config


def test_default_recipe_loads_and_overrides_apply():
    config = load_config(Config, "configs/default.yaml", ["rl.steps=7", "rl.loss.clip_eps_high=0.3", "seed=3"])
    assert (config.rl.steps, config.rl.loss.clip_eps_high, config.seed) == (7, 0.3, 3)
    assert config.model.num_layers == 2 and config.task.num_eval >= 200


@pytest.mark.parametrize(
    "yaml_text, overrides, expected",
    [
        ("rl:\n  stepz: 3\n", [], ["bad.yaml:2", "stepz", "did you mean 'steps'"]),
        ("rl:\n  steps: three\n", [], ["bad.yaml:2", "rl.steps", "expected an int"]),
        ("rl:\n  optim:\n    learning_rate: -1.0\n", [], ["bad.yaml:3", "rl.optim.learning_rate", "> 0"]),
        ("reward:\n  function: vibes\n", [], ["bad.yaml:2", "reward.function", "'arithmetic'"]),
        ("", ["rl.group_size=1"], ["rl.group_size", ">= 2"]),
        ("", ["model.num_kv_heads=3"], ["model", "num_heads (4) must be a multiple of num_kv_heads (3)"]),
        ("", ["rl.minibatches=3"], ["rl", "not divisible by minibatches = 3"]),
        ("", ["tokenizer.vocab_size=100"], ["tokenizer.vocab_size (100) exceeds model.vocab_size (64)"]),
        ("", ["rl.sampling.top_p=1.5"], ["rl.sampling.top_p", "<= 1"]),
    ],
)
def test_malformed_config_names_the_field(tmp_path, capsys, yaml_text, overrides, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as error:
        load_config(Config, path, overrides)
    for fragment in expected:
        assert fragment in str(error.value)
    # The CLI turns the same error into a one-line message and exit status 2, before any work starts.
    assert cli.main(["train", str(path), *overrides]) == 2
    assert "configuration error" in capsys.readouterr().err
