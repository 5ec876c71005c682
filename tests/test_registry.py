"""jaxrl.registry: names, signatures, needs and source records of the pieces a config names."""

import pytest

from jaxrl import registry
from jaxrl.registry import RegistryError


def test_built_in_pieces_are_registered_with_their_needs():
    assert {"ppo_clip", "reinforce", "cispo", "gmpo"} <= set(registry.names("objective"))
    assert {"token", "sequence", "sequence_token"} <= set(registry.names("ratio"))
    assert {"arithmetic", "math", "code"} <= set(registry.names("reward"))
    assert registry.resolve("advantage", "gae", "f").needs == {"critic"}
    assert registry.resolve("advantage", "remax", "f").needs == {"greedy_rollouts"}
    assert registry.resolve("reward", "math", "f").info["binary"] is True
    assert "binary" not in registry.resolve("reward", "code", "f").info
    assert registry.resolve("objective", "gmpo", "f").info["own_ratio"] is True
    assert all(registry.resolve("objective", n, "f").builtin for n in ("ppo_clip", "reinforce", "cispo", "gmpo"))


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(RegistryError, match=r"rl.loss.ratio: unknown ratio 'seq'; registered: 'sequence', "
                                            r"'sequence_token', 'token'") as error:
        registry.resolve("ratio", "seq", "rl.loss.ratio")
    assert error.value.field == "rl.loss.ratio"


def test_module_function_names_resolve_and_are_checked():
    entry = registry.resolve("reward", "reward_fns:exact_match", "reward.function")
    assert entry.name == "reward_fns:exact_match" and entry.source == "reward_fns:exact_match"
    assert not entry.builtin and entry.needs == frozenset()
    with pytest.raises(RegistryError, match="reward.function: module 'reward_fns' .* has no 'nope'"):
        registry.resolve("reward", "reward_fns:nope", "reward.function")
    with pytest.raises(RegistryError, match="cannot import module 'no_such_module_x'.*PYTHONPATH"):
        registry.resolve("reward", "no_such_module_x:f", "reward.function")


def test_registering_a_name_twice_with_another_function_is_refused():
    def ratio_a(logp, old_logp, mask):
        return logp

    def ratio_b(logp, old_logp, mask):
        return logp

    registry.register("ratio", "test_twice")(ratio_a)
    registry.register("ratio", "test_twice")(ratio_a)  # the same function again: a no-op
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("ratio", "test_twice")(ratio_b)
    with pytest.raises(ValueError, match="unknown needs"):
        registry.register("ratio", "x", needs=("gpu",))


def _item(prompt, completion, reference, row):
    return 0.0


def _subset(completion, reference, *, timeout=1.0):
    return 0.0


def _batched(completions, rows):
    return [0.0] * len(completions)


def _kwargs(**kwargs):
    return 0.0


def _mixed(completion, rows):
    return 0.0


def _no_completion(prompt, reference):
    return 0.0


def _unknown(completion, answer):
    return 0.0


class _Judge:
    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, completions):
        return [0.0] * len(completions)


class _NeedsArguments:
    def __init__(self, model_path):
        pass

    def __call__(self, completions):
        return [0.0] * len(completions)


def test_reward_signatures_say_which_arguments_and_whether_batched():
    assert registry.reward_arguments(_item, "f") == (("prompt", "completion", "reference", "row"), False)
    assert registry.reward_arguments(_subset, "f") == (("completion", "reference"), False)
    assert registry.reward_arguments(_batched, "f") == (("completions", "rows"), True)
    assert registry.reward_arguments(_kwargs, "f") == (("prompt", "completion", "reference", "row"), False)
    assert registry.reward_arguments(_Judge, "f") == (("prompts", "completions"), True)
    for fn, why in ((_mixed, "mixes per-completion and batched"), (_no_completion, "does not take the completion"),
                    (_unknown, "takes answer"), (_NeedsArguments, "constructible without arguments")):
        with pytest.raises(RegistryError, match=f"reward.function: .*{why}"):
            registry.reward_arguments(fn, "reward.function")


def test_records_name_own_pieces_and_find_changes(tmp_path, monkeypatch):
    module = tmp_path / "own_piece_module.py"
    module.write_text("def reward(completion):\n    return 1.0\n")
    monkeypatch.syspath_prepend(tmp_path)
    pieces = {"reward.function": registry.resolve("reward", "own_piece_module:reward", "reward.function"),
              "rl.loss.ratio": registry.resolve("ratio", "token", "rl.loss.ratio")}
    recorded = registry.record(pieces)
    assert [(f, s) for f, s, _ in recorded] == [("reward.function", "own_piece_module:reward")]  # no built-ins
    assert registry.changed(recorded, recorded) == []
    module.write_text("def reward(completion):\n    return 2.0\n")
    now = registry.record(pieces)
    assert now[0][2] != recorded[0][2]
    assert registry.changed(recorded, now) == [
        f"reward.function: the source of own_piece_module:reward changed (sha256 {recorded[0][2]} -> {now[0][2]})"]
    assert registry.changed(recorded, ()) == [
        "reward.function: the run used own_piece_module:reward, the config names a built-in piece or none"]
