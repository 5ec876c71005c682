"""Tests for jaxrl.configlib: YAML + overrides -> frozen dataclasses, with located errors."""

from __future__ import annotations

import dataclasses
import math
import textwrap
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import pytest
import yaml

from jaxrl.configlib import ConfigError, dump_yaml, from_dict, load_config, replace_path, to_dict


@dataclass(frozen=True)
class Optim:
    learning_rate: float = field(default=3e-4, metadata={"gt": 0})
    warmup_steps: int = field(default=0, metadata={"ge": 0})
    schedule: Literal["constant", "cosine"] = "cosine"
    betas: tuple[float, ...] = (0.9, 0.95)


@dataclass(frozen=True)
class Model:
    dims: tuple[int, ...] = (64, 64)
    name: str = "tiny"
    dropout: float | None = None
    heads: Literal[1, 2, 4] = 2


@dataclass(frozen=True)
class Root:
    seed: int = 0
    total_steps: int = field(default=100, metadata={"gt": 0})
    debug: bool = False
    optim: Optim = field(default_factory=Optim)
    model: Model = field(default_factory=lambda: Model(name="base"))

    def validate(self):
        if self.optim.warmup_steps > self.total_steps:
            raise ValueError(f"optim.warmup_steps ({self.optim.warmup_steps}) must not exceed "
                             f"total_steps ({self.total_steps})")


@dataclass(frozen=True)
class Checked:
    low: int = 0
    high: int = 1

    def validate(self):
        if self.low >= self.high:
            raise ValueError("low must be < high")


@dataclass(frozen=True)
class WithChecked:
    window: Checked = field(default_factory=Checked)


@dataclass(frozen=True)
class BadSchema:
    items: list = field(default_factory=list)


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def raises(fn, *parts):
    """Call fn, expect ConfigError, and check that every part appears in the message."""
    with pytest.raises(ConfigError) as info:
        fn()
    msg = str(info.value)
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


# --------------------------------------------------------------------------- happy paths


def test_defaults_only():
    cfg = load_config(Root)
    assert cfg == Root()
    assert cfg.model.name == "base"  # default_factory values are kept, not Model()


def test_file_values_and_defaults(tmp_path):
    path = write(tmp_path, """
        seed: 7
        optim:
          learning_rate: 1e-3   # plain YAML 1.1 "string", read as a float
          warmup_steps: 10
          betas: [0.8, 1]
        model:
          dims: [1, 2, 3]
          dropout: 0.1
    """)
    cfg = load_config(Root, path)
    assert cfg.seed == 7
    assert cfg.optim == Optim(learning_rate=1e-3, warmup_steps=10, betas=(0.8, 1.0))
    assert isinstance(cfg.optim.betas[1], float)
    assert cfg.model == Model(dims=(1, 2, 3), name="base", dropout=0.1)
    assert cfg.debug is False


def test_int_accepted_for_float(tmp_path):
    cfg = load_config(Root, write(tmp_path, "optim:\n  learning_rate: 1\n"))
    assert cfg.optim.learning_rate == 1.0 and isinstance(cfg.optim.learning_rate, float)


def test_empty_file_means_defaults(tmp_path):
    assert load_config(Root, write(tmp_path, "# nothing\n")) == Root()


def test_overrides(tmp_path):
    path = write(tmp_path, "seed: 1\nmodel:\n  dropout: 0.5\n")
    cfg = load_config(Root, path, [
        "seed=2",
        "optim.learning_rate=1e-3",
        "optim.schedule=constant",
        "model.dims=[8, 16]",
        "model.dropout=null",
        "model.name=big",
        "model.heads=4",
        "debug=true",
    ])
    assert cfg.seed == 2
    assert cfg.optim.learning_rate == 1e-3
    assert cfg.optim.schedule == "constant"
    assert cfg.model == Model(dims=(8, 16), name="big", dropout=None, heads=4)
    assert cfg.debug is True


def test_overrides_apply_in_order_and_without_file():
    cfg = load_config(Root, None, ["seed=1", "seed=5", "optim.learning_rate=2"])
    assert cfg.seed == 5 and cfg.optim.learning_rate == 2.0


def test_override_mapping_merges_into_section():
    cfg = load_config(Root, None, ["optim={warmup_steps: 3, schedule: constant}"])
    assert cfg.optim == Optim(warmup_steps=3, schedule="constant")


def test_from_dict_and_to_dict():
    cfg = from_dict(Root, {"seed": 3, "model": {"dims": [4]}})
    assert cfg.model.dims == (4,) and cfg.model.name == "base"
    assert to_dict(cfg)["model"] == {"dims": [4], "name": "base", "dropout": None, "heads": 2}
    raises(lambda: from_dict(Root, {"seed": "3"}, source="api"), "api: seed: expected an int")


def test_dump_yaml_round_trip(tmp_path):
    original = Root(seed=3, debug=True, total_steps=50,
                    optim=Optim(learning_rate=1e-10, warmup_steps=5, schedule="constant"),
                    model=Model(dims=(3, 5), name="1e-3", dropout=0.25, heads=4))
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_yaml(original))
    assert load_config(Root, path) == original
    assert load_config(Root, write(tmp_path, dump_yaml(Root()), "d.yaml")) == Root()


def test_replace_path():
    cfg = Root()
    new = replace_path(cfg, "optim.learning_rate", 0.5)
    assert new.optim.learning_rate == 0.5 and cfg.optim.learning_rate == 3e-4
    assert new.model == cfg.model
    assert replace_path(cfg, "optim.learning_rate", "1e-3").optim.learning_rate == 1e-3
    assert replace_path(cfg, "model.dims", [1, 2]).model.dims == (1, 2)
    assert replace_path(cfg, "model", {"name": "x"}).model == Model(name="x")
    raises(lambda: replace_path(cfg, "optim.learnig_rate", 1.0), "unknown field 'learnig_rate' in optim",
           "did you mean 'learning_rate'?")
    raises(lambda: replace_path(cfg, "optim.learning_rate", -1), "optim.learning_rate: must be > 0")
    raises(lambda: replace_path(cfg, "seed", True), "seed: expected an int, got True (bool)")
    raises(lambda: replace_path(cfg, "optim.warmup_steps", 1000), "must not exceed")


# --------------------------------------------------------------------------- file errors


def test_unknown_key_in_file(tmp_path):
    path = write(tmp_path, """
        seed: 1
        optim:
          learning_rat: 0.1
    """)
    msg = raises(lambda: load_config(Root, path), f"{path}:3:", "unknown field 'learning_rat' in optim",
                 "did you mean 'learning_rate'?",
                 "valid fields: betas, learning_rate, schedule, warmup_steps")
    assert msg.startswith(f"{path}:3: ")


def test_unknown_top_level_key_without_suggestion(tmp_path):
    path = write(tmp_path, "seed: 1\nzzz: 2\n")
    msg = raises(lambda: load_config(Root, path), f"{path}:2:", "unknown field 'zzz' at top level",
                 "valid fields: debug, model, optim, seed, total_steps")
    assert "did you mean" not in msg


def test_wrong_type_in_file(tmp_path):
    path = write(tmp_path, "seed: 1\noptim:\n  warmup_steps: 2\n  learning_rate: abc\n")
    raises(lambda: load_config(Root, path),
           f"{path}:4: optim.learning_rate: expected a float, got 'abc' (str)")


def test_quoted_number_is_not_coerced(tmp_path):
    raises(lambda: load_config(Root, write(tmp_path, 'seed: "3"\n')),
           ":1: seed: expected an int, got '3' (str)")
    raises(lambda: load_config(Root, write(tmp_path, 'optim:\n  learning_rate: "1e-3"\n')),
           ":2: optim.learning_rate: expected a float, got '1e-3' (str)")


def test_bool_is_not_a_number(tmp_path):
    raises(lambda: load_config(Root, write(tmp_path, "debug: false\nseed: true\n")), ":2: seed: expected an int")
    raises(lambda: load_config(Root, write(tmp_path, "optim:\n  learning_rate: false\n")),
           ":2: optim.learning_rate: expected a float, got False (bool)")


def test_float_for_int_and_bad_tuple_item(tmp_path):
    raises(lambda: load_config(Root, write(tmp_path, "seed: 1.5\n")), "seed: expected an int, got 1.5")
    path = write(tmp_path, "model:\n  dims:\n    - 1\n    - x\n")
    raises(lambda: load_config(Root, path), f"{path}:2: model.dims[1]: expected an int, got 'x'")
    raises(lambda: load_config(Root, write(tmp_path, "model:\n  dims: 3\n")),
           ":2: model.dims: expected a list, got 3 (int)")


def test_mapping_for_scalar_and_scalar_for_section(tmp_path):
    raises(lambda: load_config(Root, write(tmp_path, "seed:\n  a: 1\n")),
           ":1: seed: expected an int, got a mapping")
    raises(lambda: load_config(Root, write(tmp_path, "seed: 1\noptim: 3\n")),
           ":2: optim: expected a mapping of Optim fields, got 3 (int)")


def test_braces_for_a_string_hint_at_quoting_where_the_value_was_written(tmp_path):
    msg = raises(lambda: load_config(Root, write(tmp_path, "model:\n  name: {big}\n")),
                 ":2: model.name: expected a str, got a mapping", "quote the value, e.g. name: '...' in the file")
    assert "shell" not in msg
    raises(lambda: load_config(Root, None, ["model.name={big}"]), "e.g. \"model.name='...'\" in the shell")


def test_literal_outside_choices(tmp_path):
    path = write(tmp_path, "optim:\n  schedule: linear\n")
    raises(lambda: load_config(Root, path),
           f"{path}:2: optim.schedule: expected one of 'constant', 'cosine', got 'linear'")
    raises(lambda: load_config(Root, write(tmp_path, "model:\n  heads: 3\n")),
           ":2: model.heads: expected one of 1, 2, 4, got 3 (int)")


def test_duplicate_keys(tmp_path):
    path = write(tmp_path, """
        optim:
          learning_rate: 0.1
          warmup_steps: 1
          learning_rate: 0.2
    """)
    raises(lambda: load_config(Root, path),
           f"{path}:4: optim.learning_rate: duplicate key (first defined at line 2)")
    raises(lambda: load_config(Root, write(tmp_path, "seed: 1\nseed: 2\n")), ":2: seed: duplicate key")


def test_top_level_not_a_mapping(tmp_path):
    path = write(tmp_path, "- 1\n- 2\n")
    raises(lambda: load_config(Root, path), f"{path}:1:", "top level must be a mapping")


def test_yaml_syntax_error(tmp_path):
    path = write(tmp_path, "seed: 1\noptim:\n  learning_rate: [1, 2\n  warmup_steps: 3\n")
    msg = raises(lambda: load_config(Root, path), f"{path}:", "invalid YAML")
    line = int(msg.split(f"{path}:")[1].split(":")[0])
    assert line in (3, 4)
    raises(lambda: load_config(Root, write(tmp_path, "seed: 1\n  bad: indent\n")), ":2: invalid YAML")


def test_yaml_1_2_scalars(tmp_path):
    """on/off/yes/no are strings, ints are decimal, no base-60: PyYAML's YAML 1.1 reads them otherwise."""
    path = write(tmp_path, "seed: 010\nmodel:\n  name: on\n")
    config = load_config(Root, path, ["optim.warmup_steps=0x10"])
    assert (config.seed, config.model.name, config.optim.warmup_steps) == (10, "on", 16)
    assert load_config(Root, None, ["model.name=off", "debug=true"]).model == Model(name="off")
    raises(lambda: load_config(Root, None, ["debug=yes"]), "debug: expected a bool (true or false), got 'yes'")
    raises(lambda: load_config(Root, None, ["total_steps=1:30"]), "total_steps: expected an int, got '1:30'")


def test_unclosed_bracket_is_reported_where_it_opens(tmp_path):
    path = write(tmp_path, "seed: 1\noptim:\n  betas: [0.9, 0.95\n  warmup_steps: 3\n")
    raises(lambda: load_config(Root, path), f"{path}:4: invalid YAML", "(it began at line 3)")
    path = write(tmp_path, "seed: 1\noptim:\n  betas: [0.9, 0.95\n")
    raises(lambda: load_config(Root, path), f"{path}:3: invalid YAML")  # not line 4, the end of the file
    path = write(tmp_path, "seed: 1\nmodel:\n  name: 'tiny\n")
    raises(lambda: load_config(Root, path), f"{path}:3: invalid YAML")


def test_missing_file(tmp_path):
    raises(lambda: load_config(Root, tmp_path / "nope.yaml"), "nope.yaml", "not found")


def test_a_non_utf8_file_names_the_line(tmp_path):
    """E.g. a Latin-1 'é' in a comment: the line, not only the byte offset."""
    path = tmp_path / "cfg.yaml"
    path.write_bytes(b"seed: 1\r\n# caf\xe9\r\noptim:\r\n  learning_rate: 0.1\r\n")
    raises(lambda: load_config(Root, path), f"{path}:2: not UTF-8 text: byte 0xe9")
    path.write_bytes(b"seed: 1\r\n# cafe\r\noptim:\r\n  learning_rate: 0.1\r\n")
    assert load_config(Root, path).optim.learning_rate == 0.1


def test_bounds(tmp_path):
    path = write(tmp_path, "seed: 1\noptim:\n  learning_rate: -1\n")
    raises(lambda: load_config(Root, path), f"{path}:3: optim.learning_rate: must be > 0, got -1.0")
    raises(lambda: load_config(Root, None, ["optim.warmup_steps=-1"]),
           "override 'optim.warmup_steps=-1': optim.warmup_steps: must be >= 0, got -1")


def test_nan_is_no_value_of_any_float_field(tmp_path):
    """Unbounded fields and tuple entries took NaN (and gave NaN parameters, say); bounded ones refused it only by
    accident of the comparison."""
    path = write(tmp_path, "model:\n  dropout: .nan\n")
    raises(lambda: load_config(Root, path), f"{path}:2: model.dropout: must be a number, got nan")
    raises(lambda: load_config(Root, None, ["optim.betas=[0.9, nan]"]), "optim.betas: must be a number, got nan")


@dataclass(frozen=True)
class Clipping:
    max_norm: float = field(default=1.0, metadata={"gt": 0, "le": math.inf})  # inf: no clipping
    floor: float = field(default=-1.0, metadata={"ge": -math.inf, "lt": 0})  # -inf: no floor
    scale: float = field(default=1.0, metadata={"gt": 0})


def test_infinity_only_where_the_bounds_admit_it(tmp_path):
    """`learning_rate=.inf` was accepted (a `gt=0` bound holds for inf), and the first update made every
    parameter non-finite. Infinity is now a value only of a field whose bounds name it (`le=math.inf`, or
    `ge=-math.inf` for -inf), whatever the source (file, override, tuple entry, replace_path)."""
    path = write(tmp_path, "optim:\n  learning_rate: .inf\n")
    raises(lambda: load_config(Root, path), f"{path}:2: optim.learning_rate: must be finite, got inf")
    raises(lambda: load_config(Root, None, ["model.dropout=-.inf"]), "model.dropout: must be finite, got -inf")
    raises(lambda: load_config(Root, None, ["optim.betas=[0.9, inf]"]), "optim.betas: must be finite, got inf")
    raises(lambda: replace_path(Root(), "optim.learning_rate", math.inf), "optim.learning_rate: must be finite")
    raises(lambda: from_dict(Root, {"model": {"dropout": math.inf}}), "model.dropout: must be finite, got inf")
    assert load_config(Clipping, None, ["max_norm=inf", "floor=-inf"]) == Clipping(math.inf, -math.inf)
    raises(lambda: load_config(Clipping, None, ["max_norm=-inf"]), "max_norm: must be finite, got -inf")
    raises(lambda: load_config(Clipping, None, ["floor=inf"]), "floor: must be finite, got inf")
    raises(lambda: load_config(Clipping, None, ["scale=inf"]), "scale: must be finite, got inf")


def test_validate_cross_check(tmp_path):
    path = write(tmp_path, "total_steps: 5\noptim:\n  warmup_steps: 10\n")
    raises(lambda: load_config(Root, path), f"{path}: optim.warmup_steps (10) must not exceed")
    nested = write(tmp_path, "window:\n  low: 3\n  high: 2\n", "w.yaml")
    raises(lambda: load_config(WithChecked, nested), f"{nested}:1: window: low must be < high")
    raises(lambda: load_config(WithChecked, None, ["window.low=5"]),
           "override 'window.low=5': window: low must be < high")
    fine = write(tmp_path, "window:\n  low: 1\n  high: 2\n", "fine.yaml")  # the override broke it
    raises(lambda: load_config(WithChecked, fine, ["window.low=5"]),
           f"{fine}:1 with override 'window.low=5': window: low must be < high")


def test_unsupported_schema_type():
    with pytest.raises(TypeError, match="unsupported config field type"):
        load_config(BadSchema)


# --------------------------------------------------------------------------- override errors


def test_override_unknown_field():
    raises(lambda: load_config(Root, None, ["optim.lr=3"]),
           "override 'optim.lr=3': unknown field 'lr' in optim",
           "valid fields: betas, learning_rate, schedule, warmup_steps")
    raises(lambda: load_config(Root, None, ["optimm.learning_rate=3"]),
           "override 'optimm.learning_rate=3': unknown field 'optimm' at top level",
           "did you mean 'optim'?")


def test_override_malformed():
    raises(lambda: load_config(Root, None, ["seed"]), "override 'seed'", "key=value")
    raises(lambda: load_config(Root, None, ["optim..lr=1"]), "key=value")
    raises(lambda: load_config(Root, None, ["seed=[1"]), "override 'seed=[1'", "cannot parse")


def test_override_with_a_yaml_comment_is_an_error_not_a_silent_cut():
    """`#` at the start of a value or after a space begins a YAML comment: `key=#### (.+)$` would give None
    and `key=after #### x` would give 'after'. Quoted, or with `#` inside a word, the value is kept."""
    raises(lambda: load_config(Root, None, ["model.name=#### (.+)$"]),
           "override 'model.name=#### (.+)$': YAML reads '#### (.+)$' as a comment", "quote the value")
    raises(lambda: load_config(Root, None, ["model.name=big # the large one"]),
           "YAML reads '# the large one' as a comment")
    assert load_config(Root, None, ["model.name='#### (.+)$'"]).model.name == "#### (.+)$"
    assert load_config(Root, None, ["model.name=C#"]).model.name == "C#"
    assert load_config(Root, None, ["model.dropout="]).model.dropout is None


def test_a_file_value_that_yaml_reads_as_a_comment_is_an_error_not_a_silent_null(tmp_path):
    """In a file too, `name: #### (.+)$` is an empty value (null) followed by a comment to YAML."""
    path = write(tmp_path, "model:\n  name: #### (.+)$\n  dropout:\n")
    raises(lambda: load_config(Root, path), f"{path}:2: model.name: YAML reads '#### (.+)$' as a comment",
           "quote the value")
    path = write(tmp_path, "model:\n  dropout:   # none\n")
    raises(lambda: load_config(Root, path), f"{path}:2: model.dropout", "write dropout: null")
    path = write(tmp_path, "model:   # a comment after a section is fine\n  name: '#### (.+)$'  # so is this\n"
                           "  dropout:\n")
    assert load_config(Root, path).model == Model(name="#### (.+)$", dropout=None)


def test_override_wrong_types():
    raises(lambda: load_config(Root, None, ["optim=3"]),
           "override 'optim=3': optim: expected a mapping of Optim fields, got 3 (int)")
    raises(lambda: load_config(Root, None, ["seed=abc"]),
           "override 'seed=abc': seed: expected an int, got 'abc' (str)")
    raises(lambda: load_config(Root, None, ["optim.learning_rate=abc"]),
           "optim.learning_rate: expected a float, got 'abc' (str)")
    raises(lambda: load_config(Root, None, ["model.dims=[1, 2.5]"]), "model.dims[1]: expected an int")
    raises(lambda: load_config(Root, None, ["seed.x=1"]), "override 'seed.x=1': seed: expected an int")


def test_override_wins_over_bad_file_value_only_when_valid(tmp_path):
    path = write(tmp_path, "optim:\n  learning_rate: abc\n")
    assert load_config(Root, path, ["optim.learning_rate=0.1"]).optim.learning_rate == 0.1
    raises(lambda: load_config(Root, path), f"{path}:2: optim.learning_rate")


def test_configs_are_frozen():
    cfg = load_config(Root)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]


@dataclass(frozen=True)
class Clip:
    low: float = 0.2
    high: float = 0.2


@dataclass(frozen=True)
class Objective:
    PRESETS: ClassVar[dict] = {"wide": {"clip": {"high": 0.5}, "mode": "sum"}, "tight": {"clip": {"low": 0.01}}}
    preset: Literal["wide", "tight"] | None = None
    mode: Literal["mean", "sum"] = "mean"
    clip: Clip = field(default_factory=Clip)


@dataclass(frozen=True)
class WithObjective:
    loss: Objective = field(default_factory=Objective)


def test_presets_start_from_the_named_values_and_explicit_fields_win(tmp_path):
    assert load_config(WithObjective, overrides=["loss.preset=wide"]).loss == Objective("wide", "sum", Clip(0.2, 0.5))
    path = tmp_path / "c.yaml"
    path.write_text("loss:\n  clip:\n    high: 0.3\n  preset: wide\n")  # the explicit field wins, in any order
    assert load_config(WithObjective, path).loss == Objective("wide", "sum", Clip(0.2, 0.3))
    assert load_config(WithObjective, path, ["loss.preset=tight"]).loss == Objective("tight", "mean", Clip(0.01, 0.3))
    config = load_config(WithObjective, path)
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(dump_yaml(config))
    assert load_config(WithObjective, dumped) == config
    with pytest.raises(ConfigError, match=r"c.yaml:4: loss.preset: expected one of 'wide', 'tight' or null"):
        path.write_text("loss:\n  clip:\n    high: 0.3\n  preset: narrow\n")
        load_config(WithObjective, path)


@dataclass(frozen=True)
class Stack:
    PRESETS: ClassVar[dict] = {"deep": {"depth": 3, "loss": {"preset": "wide"}}}
    preset: Literal["deep"] | None = None
    depth: int = 1
    loss: Objective = field(default_factory=Objective)


@dataclass(frozen=True)
class WithStack:
    seed: int = 0
    stack: Stack = field(default_factory=Stack)


def test_dump_yaml_writes_a_preset_section_as_the_preset_and_its_differences(tmp_path):
    path = write(tmp_path, "loss:\n  clip:\n    high: 0.3\n  preset: wide\n", "recipe.yaml")
    config = load_config(WithObjective, path)
    dumped = write(tmp_path, dump_yaml(config), "dumped.yaml")
    assert yaml.safe_load(dumped.read_text()) == {"loss": {"preset": "wide", "clip": {"high": 0.3}}}
    assert to_dict(config)["loss"] == {"preset": "wide", "mode": "sum", "clip": {"low": 0.2, "high": 0.3}}
    assert load_config(WithObjective, dumped) == config
    # Another preset on the dumped config gives what it gives on the recipe: the old preset's values go.
    for overrides in (["loss.preset=tight"], ["loss.preset=null"], ["loss.preset=tight", "loss.mode=sum"]):
        assert load_config(WithObjective, dumped, overrides) == load_config(WithObjective, path, overrides)
    assert load_config(WithObjective, dumped, ["loss.preset=tight"]).loss == Objective("tight", "mean", Clip(0.01, 0.3))
    # A field set back to its default still differs from the preset, so it is written.
    config = WithObjective(Objective("wide", "mean", Clip(0.2, 0.5)))
    assert yaml.safe_load(dump_yaml(config)) == {"loss": {"preset": "wide", "mode": "mean"}}
    assert load_config(WithObjective, write(tmp_path, dump_yaml(config), "d2.yaml")) == config


@pytest.mark.parametrize("recipe", [
    "",
    "seed: 4\nstack:\n  preset: deep\n",
    "stack:\n  preset: deep\n  loss:\n    clip:\n      high: 0.7\n",
    "stack:\n  preset: deep\n  depth: 5\n  loss:\n    preset: tight\n    mode: sum\n",
    "stack:\n  preset: deep\n  loss:\n    preset: null\n",
    "stack:\n  loss:\n    preset: tight\n    clip:\n      high: 0.9\n",
])
def test_dump_yaml_round_trips_nested_presets(tmp_path, recipe):
    path = write(tmp_path, recipe, "recipe.yaml")
    config = load_config(WithStack, path)
    dumped = write(tmp_path, dump_yaml(config), "dumped.yaml")
    assert load_config(WithStack, dumped) == config
    for overrides in (["stack.preset=deep"], ["stack.preset=null"], ["stack.loss.preset=tight"]):
        assert load_config(WithStack, dumped, overrides) == load_config(WithStack, path, overrides)
    # A config.yaml written before (every field explicit) still loads as the same config.
    assert load_config(WithStack, write(tmp_path, yaml.safe_dump(to_dict(config)), "old.yaml")) == config


def test_anchors_aliases_and_merge_keys(tmp_path):
    """Ordinary anchors work (as before) and merge keys now do too (`<<` was an unknown field): keys written
    in the mapping win over merged ones, the earlier of several merged mappings wins, and the merge is
    shallow. Errors in a merged value name the line where it is written."""
    path = write(tmp_path, """
        optim: &base
          learning_rate: 0.01
          warmup_steps: 5
          betas: &betas [0.8, 0.9]
        model:
          dims: *betas
        """)
    raises(lambda: load_config(Root, path), f"{path}:6: model.dims[0]: expected an int, got 0.8")
    path = write(tmp_path, """
        total_steps: 50
        model: &m
          name: shared
          dims: [1, 2]
        optim:
          <<: [&lr {learning_rate: 0.5, warmup_steps: 1}, {learning_rate: 0.7, schedule: constant}]
          warmup_steps: 3
        """)
    cfg = load_config(Root, path)
    assert cfg.optim == Optim(learning_rate=0.5, warmup_steps=3, schedule="constant")
    assert cfg.model == Model(dims=(1, 2), name="shared")
    path = write(tmp_path, "optim: &o\n  learning_rate: 0.1\nmodel:\n  <<: *o\n")
    raises(lambda: load_config(Root, path), f"{path}:2: unknown field 'learning_rate' in model")
    path = write(tmp_path, "optim:\n  <<: 3\n")
    raises(lambda: load_config(Root, path), f"{path}:2: optim: a merge key '<<' takes a mapping")


def test_config_files_have_limits(tmp_path):
    """Only a regular file of at most 256 KiB is read as a config (a FIFO blocked the read forever; /dev/zero
    never ended)."""
    import os

    big = write(tmp_path, "seed: 1\n" + "# padding\n" * 30_000, "big.yaml")
    raises(lambda: load_config(Root, big), f"{big}: larger than 262,144 bytes")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    raises(lambda: load_config(Root, fifo), f"{fifo}: not a regular file but a FIFO")
    raises(lambda: load_config(Root, tmp_path), f"{tmp_path}: not a regular file but a directory")
    # PyYAML is pure Python: a document is refused once it holds 20,000 values, not after parsing all of it.
    flat = write(tmp_path, "model:\n  dims: [" + "1, " * 80_000 + "1]\n", "flat.yaml")
    raises(lambda: load_config(Root, flat), f"{flat}:2: invalid YAML: more than 20,000 values")


# --------------------------------------------------------------------------- mapping fields


@dataclass(frozen=True)
class Weights:
    extra: dict[str, float] = field(default_factory=dict, metadata={"ge": -1, "le": 10})
    name: str = "w"


@dataclass(frozen=True)
class WithWeights:
    weights: Weights = field(default_factory=Weights)
    steps: dict[str, int] = field(default_factory=dict)


def test_mapping_field_from_yaml_and_overrides(tmp_path):
    from jaxrl.configlib import FrozenMapping

    path = write(tmp_path, """
        weights:
          extra:
            my_rewards:brevity: 0.1
            pkg.mod:Judge: 2
        """)
    cfg = load_config(WithWeights, path)
    assert cfg.weights.extra == {"my_rewards:brevity": 0.1, "pkg.mod:Judge": 2.0}
    assert list(cfg.weights.extra) == ["my_rewards:brevity", "pkg.mod:Judge"]  # the file's order
    assert type(cfg.weights.extra["pkg.mod:Judge"]) is float
    assert isinstance(cfg.weights.extra, FrozenMapping)
    with pytest.raises(TypeError):
        cfg.weights.extra["x"] = 1.0  # read-only
    assert hash(cfg) == hash(load_config(WithWeights, path))  # a frozen config stays hashable
    # overrides merge into the mapping key by key, as into a section
    cfg = load_config(WithWeights, path, ["weights.extra={my_rewards:brevity: 0.5, other:fn: -1}",
                                          "weights.extra.plain=3e-1", "steps={a: 3}"])
    assert cfg.weights.extra == {"my_rewards:brevity": 0.5, "pkg.mod:Judge": 2.0, "other:fn": -1.0, "plain": 0.3}
    assert cfg.steps == {"a": 3}
    inline = write(tmp_path, "weights: {extra: {my_rewards:brevity: 0.1}}\n", "inline.yaml")
    assert load_config(WithWeights, inline).weights.extra == {"my_rewards:brevity": 0.1}
    assert load_config(WithWeights).weights.extra == {}


def test_mapping_field_round_trips_through_dump_yaml(tmp_path):
    cfg = load_config(WithWeights, None, ["weights.extra={b:fn: 0.25, a.b:c: -1}", "steps={x: 1}"])
    assert to_dict(cfg) == {"weights": {"extra": {"b:fn": 0.25, "a.b:c": -1.0}, "name": "w"}, "steps": {"x": 1}}
    dumped = write(tmp_path, dump_yaml(cfg), "dumped.yaml")
    again = load_config(WithWeights, dumped)
    assert again == cfg and list(again.weights.extra) == ["b:fn", "a.b:c"]
    assert from_dict(WithWeights, to_dict(cfg)) == cfg
    assert replace_path(cfg, "weights.extra", {"c:d": 1}).weights.extra == {"b:fn": 0.25, "a.b:c": -1.0, "c:d": 1.0}
    import pickle

    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_mapping_field_errors_name_the_key_and_line(tmp_path):
    path = write(tmp_path, """
        weights:
          extra:
            fine:fn: 0.5
            bad:fn: lots
        """)
    raises(lambda: load_config(WithWeights, path), f"{path}:4: weights.extra.bad:fn: expected a float, got 'lots'")
    path = write(tmp_path, """
        weights:
          extra:
            fine:fn: 0.5
            big:fn: 11
        """, "bounds.yaml")
    raises(lambda: load_config(WithWeights, path), f"{path}:4: weights.extra.big:fn: must be <= 10, got 11.0")
    raises(lambda: load_config(WithWeights, None, ["weights.extra={a: .nan}"]),
           "override 'weights.extra={a: .nan}': weights.extra.a: must be a number, got nan")
    raises(lambda: load_config(WithWeights, None, ["weights.extra=0.1"]),
           "weights.extra: expected a mapping of names to values (a float each), got 0.1")
    raises(lambda: load_config(WithWeights, None, ["weights.extra.pkg.mod:fn=0.1"]),
           "weights.extra.pkg: expected a float, got a mapping (a key with dots is written whole: "
           "weights.extra={pkg.<rest>: <value>})")
    raises(lambda: load_config(WithWeights, None, ["steps={a: 1.5}"]), "steps.a: expected an int, got 1.5")
