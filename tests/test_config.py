"""The run configuration: the shipped recipe loads, and malformed configs stop with the field named."""

import pytest

from jaxrl import cli
from jaxrl.config import Config
from jaxrl.configlib import ConfigError, dump_yaml, load_config


def test_presets_apply_under_explicit_fields(tmp_path):
    """A preset sets its fields; fields set in the file or as overrides win over it, whatever the order."""
    config = load_config(Config, "configs/default.yaml", ["rl.loss.preset=gspo"])
    assert (config.rl.loss.ratio, config.rl.loss.clip_eps_high, config.rl.loss.aggregation) == (
        "sequence", 4e-4, "seq-mean-token-mean")
    path = tmp_path / "recipe.yaml"
    path.write_text("rl:\n  loss:\n    clip_eps_high: 0.001\n    advantage:\n      std_scope: batch\n")
    config = load_config(Config, path, ["rl.loss.preset=dr_grpo"])
    assert config.rl.loss.preset == "dr_grpo" and config.rl.loss.aggregation == "seq-mean-token-sum-norm"
    assert config.rl.loss.clip_eps_high == 0.001 and config.rl.loss.advantage.std_scope == "batch"
    ppo = load_config(Config, "configs/default.yaml", ["rl.loss.preset=ppo", "rl.critic.model=policy_copy"])
    assert ppo.rl.loss.advantage.estimator == "gae" and ppo.rl.loss.value_coef == 0.5
    # The resolved config, dumped and loaded again, is the same config (presets and all).
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(dump_yaml(config))
    assert load_config(Config, dumped) == config


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
        ("", ["rl.minibatches=3"], ["rl", "not divisible by minibatches x micro_batches = 3 x 1"]),
        ("", ["rl.micro_batches=3"], ["rl", "not divisible by minibatches x micro_batches = 1 x 3"]),
        ("", ["reward.overlong_buffer=64"], ["reward.overlong_buffer (64) exceeds rl.sampling.max_new_tokens (48)"]),
        ("", ["reward.format_pattern=xml"], ["reward.format_pattern", "'think_answer'", "'answer'"]),
        # The loss library: unknown presets and pieces list the valid choices; incompatible pieces are named.
        ("rl:\n  loss:\n    preset: grpoo\n", [], ["bad.yaml:3", "rl.loss.preset", "'grpo'", "'dr_grpo'", "'kl_cov'"]),
        ("", ["rl.loss.objective=ppo"], ["rl.loss.objective", "'ppo_clip'", "'cispo'", "'gmpo'"]),
        ("", ["rl.loss.aggregation=mean"], ["rl.loss.aggregation", "'token-mean'", "'seq-mean-token-sum-norm'"]),
        ("", ["rl.loss.ratio=seq"], ["rl.loss.ratio", "'sequence'", "'sequence_token'"]),
        ("", ["rl.loss.kl_estimator=k4"], ["rl.loss.kl_estimator", "'k3'", "'full'"]),
        ("", ["rl.loss.advantage.estimator=ppo"], ["rl.loss.advantage.estimator", "'gae'", "'rloo'", "'grpo_s'"]),
        ("", ["rl.loss.advantage.estimator=gae"],
         ["estimator 'gae' needs a critic", "critic.model to 'policy_copy'",
          "bnpo, empg, grpo, grpo_s, gtpo, nsr, opo, passk, psr, reinforce_pp, remax, rloo, seed_grpo"]),
        ("", ["rl.loss.preset=ppo"], ["estimator 'gae' needs a critic"]),
        ("", ["rl.critic.model=policy_copy"], ["advantage estimator 'grpo' does not use values", "gae"]),
        ("", ["rl.critic.model=value_head"], ["rl.critic.model", "'policy_copy'"]),
        ("", ["rl.loss.objective=gmpo", "rl.loss.ratio=sequence"], ["ratio must be 'token'"]),
        ("", ["rl.loss.dual_clip_c=3", "rl.loss.objective=cispo"], ["dual_clip_c applies to objective 'ppo_clip'"]),
        ("", ["rl.loss.dual_clip_c=0.5"], ["rl.loss.dual_clip_c", "> 1"]),
        ("", ["rl.loss.kl_estimator=full", "rl.loss.kl_in_reward=true"], ["'full' is a loss term", "k1, k2, k3"]),
        ("", ["rl.loss.advantage.per_component=true", "rl.loss.advantage.estimator=rloo"],
         ["per_component", "'grpo'"]),
        ("", ["rl.loss.advantage.estimator=gtpo", "reward.format_weight=0.1"],
         ["estimator 'gtpo' splits each group by binary outcome rewards", "reward.format_weight"]),
        ("", ["rl.loss.advantage.estimator=grpo_s", "reward.function=code"], ["'grpo_s'", "pass fraction"]),
        ("", ["tokenizer.vocab_size=100"], ["tokenizer.vocab_size (100) exceeds model.vocab_size (64)"]),
        ("", ["rl.sampling.top_p=1.5"], ["rl.sampling.top_p", "<= 1"]),
        ("", ["seed=-1"], ["seed", ">= 0"]),
        ("", ["reward.length_target=100", "reward.length_penalty_coef=inf"],  # infinite rewards at step 1
         ["reward.length_penalty_coef", "must be finite, got inf"]),
        ("", ["rl.optim.learning_rate=.inf"], ["rl.optim.learning_rate: must be finite, got inf"]),
        ("", ["sft.optim.learning_rate=inf"], ["sft.optim.learning_rate: must be finite, got inf"]),
        ("", ["rl.sampling.temperature=inf"], ["rl.sampling.temperature: must be finite, got inf"]),
        ("", ["rl.loss.clip_eps_low=inf"], ["rl.loss.clip_eps_low: must be finite, got inf"]),
        ("", ["model.rope_theta=inf"], ["model.rope_theta: must be finite, got inf"]),
        ("", ["rl.loss.clip_cov_high=nan"], ["rl.loss.clip_cov_high", "must be a number, got nan"]),
        ("", ["eval.samples=4", "eval.pass_k=[]"], ["eval.pass_k is empty"]),
        ("", ["data.template={prompt}"], ["data.template: expected a str, got a mapping",
                                          "quote the value, e.g. \"data.template='...'\" in the shell"]),
        ("", ["data.template={prompt} A:"], ["cannot parse value",
                                             "quote the value, e.g. \"data.template='{prompt} A:'\" in the shell"]),
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


from pathlib import Path  # noqa: E402

RECIPES = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
@pytest.mark.parametrize("changes", [[], ["rl.loss.clip_eps_high=0.5"], ["rl.loss.preset=null", "rl.loss.kl_coef=0.1"]])
def test_dumped_recipe_loads_back_and_takes_another_preset_like_the_recipe(tmp_path, recipe, changes):
    """A run's config.yaml acts as its recipe: equal when loaded, and rl.loss.preset=X on it gives what
    rl.loss.preset=X on the recipe gives (the dump writes the preset and only the fields that differ)."""
    assert len(RECIPES) >= 5
    config = load_config(Config, recipe, changes)
    dumped = tmp_path / "config.yaml"
    dumped.write_text(dump_yaml(config))
    assert load_config(Config, dumped) == config
    for name in type(config.rl.loss).PRESETS:
        overrides = [f"rl.loss.preset={name}"] + (["rl.critic.model=policy_copy"] if name == "ppo" else [])
        try:
            expected = load_config(Config, recipe, changes + overrides)
        except ConfigError:  # a preset the recipe cannot take (e.g. binary-reward estimators, shaped rewards)
            with pytest.raises(ConfigError):
                load_config(Config, dumped, overrides)
            continue
        assert load_config(Config, dumped, overrides) == expected, name
    gspo = load_config(Config, dumped, ["rl.loss.preset=gspo"]).rl.loss
    assert (gspo.ratio, gspo.clip_eps_low, gspo.aggregation) == ("sequence", 3e-4, "seq-mean-token-mean")
    assert gspo.clip_eps_high == (0.5 if "rl.loss.clip_eps_high=0.5" in changes else 4e-4)


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_file_system_error_of_the_run_is_a_message_and_exit_2_not_a_traceback(tmp_path, capsys, monkeypatch,
                                                                                  command):
    """E.g. `output_dir=/etc/passwd/run`: os.makedirs raises NotADirectoryError (an OSError, no ValueError)."""
    from jaxrl import loop

    def refuse(*args, **kwargs):
        raise NotADirectoryError(20, "Not a directory", "/etc/passwd/run")

    monkeypatch.setattr(loop, "run", refuse)
    monkeypatch.setattr(loop, "evaluate_checkpoint", refuse)
    extra = ["checkpoint=runs/default"] if command == "eval" else []
    assert cli.main([command, str(RECIPES[0].parent / "default.yaml"), *extra]) == 2
    assert "Not a directory: '/etc/passwd/run'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_missing_config_asks_for_the_config_only(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("the following arguments are required: config")


def _float_fields(cls, prefix=""):
    """Dotted paths of every float field (plain, optional or tuple entries) of a config dataclass tree."""
    import collections.abc
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, path = hints[f.name], f"{prefix}{f.name}"
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            yield from _float_fields(tp, path + ".")
        elif typing.get_origin(tp) in (dict, collections.abc.Mapping):  # a mapping's values, under a free key
            if args[1] is float:
                yield f"{path}.any_key"
        elif tp is float or float in args or any(float in typing.get_args(a) for a in args):
            yield path


FLOAT_FIELDS = sorted(_float_fields(Config))
INFINITY_MEANS_SOMETHING = {"rl.optim.max_grad_norm", "sft.optim.max_grad_norm", "rl.critic.optim.max_grad_norm",
                            "rl.loss.clip_eps_high",  # no upper ratio clip (gpg's preset, issue 35)
                            "rl.loss.is_cap"}  # no upper bound on the rollout correction's weights (issue 33)


@pytest.mark.parametrize("path", FLOAT_FIELDS)
def test_every_float_field_refuses_infinity_unless_it_means_no_limit(path):
    """`rl.optim.learning_rate=.inf` was accepted (and the first update made every parameter non-finite). Every
    float field of the run config now refuses +-inf, through the bounds metadata (not field by field); only the
    gradient-norm limits admit +inf, which optax reads as no clipping, and rl.loss.clip_eps_high (no upper clip)."""
    assert len(FLOAT_FIELDS) > 40  # the sweep reaches every section (rl.loss, model, reward, ...)
    if path in INFINITY_MEANS_SOMETHING:
        assert load_config(Config, "configs/default.yaml", [f"{path}=inf"])
    else:
        with pytest.raises(ConfigError, match=f"{path}: must be finite, got inf"):
            load_config(Config, "configs/default.yaml", [f"{path}=inf"])
    with pytest.raises(ConfigError, match=f"{path}: must be finite, got -inf"):
        load_config(Config, "configs/default.yaml", [f"{path}=-inf"])


def test_an_infinite_gradient_norm_limit_means_no_clipping():
    """What `max_grad_norm: .inf` means to optax: the gradients pass unchanged (and the config takes it)."""
    import math

    import jax.numpy as jnp
    import optax

    config = load_config(Config, "configs/default.yaml", ["rl.optim.max_grad_norm=.inf"])
    assert config.rl.optim.max_grad_norm == math.inf
    grads = {"w": jnp.array([3e4, -4e4]), "b": jnp.array([1e-3])}
    clip = optax.clip_by_global_norm(config.rl.optim.max_grad_norm)
    clipped, _ = clip.update(grads, clip.init(grads))
    assert all(bool(jnp.array_equal(clipped[k], grads[k])) for k in grads)
