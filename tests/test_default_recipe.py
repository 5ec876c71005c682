"""The acceptance run: the default recipe teaches the policy, for two seeds (slow: ~4 min per seed)."""

import pytest

from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.loop import run


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_default_recipe_learns(tmp_path, seed):
    config = load_config(Config, "configs/default.yaml", [f"seed={seed}", f"output_dir={tmp_path}",
                                                           "progress=false"])
    summary = run(config)
    assert summary["num_eval_problems"] >= 200
    assert summary["accuracy_after_rl"] >= 0.50
    assert summary["accuracy_after_rl"] - summary["accuracy_before_rl"] >= 0.20
    assert summary["total_wall_time_s"] <= 600
