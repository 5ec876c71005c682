"""`jaxrl train CONFIG --print-config` and `--dry-run` (jaxrl.dry_run): look at a run before starting it."""

import json
import os

import pytest

from jaxrl.cli import main


def _files(tmp_path, rows):
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out.write_text(json.dumps({"question": "What is 2+2?", "answer": "4"}) + "\n")
    return [f"data.train_file={train}", f"data.eval_file={held_out}", "sft.steps=0",
            "data.template='Q: {prompt} A:'", "reward.function=math", "rl.prompts_per_step=2", "rl.group_size=2",
            "eval.batch_size=2", f"output_dir={tmp_path / 'out'}"]


def test_print_config_lists_every_key_with_type_default_and_choices(capsys):
    assert main(["train", "configs/default.yaml", "seed=3", "--print-config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "seed: 3  # int >= 0, <= 4294967295; default 0 (changed)" in lines
    assert "wandb: false  # bool; default false" in lines
    assert "  samples_every: 10  # int >= 0; default 10" in lines  # under log:
    assert any(line.startswith("  function: \"arithmetic\"  # str; default \"arithmetic\"; one of ")
               and "arithmetic, code, math, " in line and line.endswith("or module:function")  # (+ tests' own)
               for line in lines)
    assert any(line.startswith("    objective: \"ppo_clip\"") and "ppo_clip" in line.split("one of ")[1]
               for line in lines)
    assert "  chat_template: false  # bool; default false" in lines
    assert "  system_prompt: null  # str or null; default null" in lines
    assert "  extra: {}  # mapping of str to float; default {}" in lines  # under reward:
    # every leaf of the config is a line
    from jaxrl.config import Config
    from jaxrl.configlib import to_dict

    def leaves(tree):  # a mapping field (reward.extra, {} by default) is one line
        return sum(leaves(v) if isinstance(v, dict) and v else 1 for v in tree.values())

    assert sum("  # " in line for line in lines) == leaves(to_dict(Config()))


def test_dry_run_passes_prints_the_rendered_prompt_and_writes_nothing(tmp_path, capsys):
    overrides = _files(tmp_path, [{"question": "What is 1+2?", "answer": "3"},
                                  {"question": "What is 3+4?", "answer": "7"}])
    before = sorted(os.listdir(tmp_path))
    assert main(["train", "configs/default.yaml", *overrides, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == before  # no output_dir, no other file
    assert "    | Q: What is 1+2? A:" in out.splitlines()
    assert "train.jsonl: 2 rows (0 bad skipped)" in out
    assert "scored as a completion: math = 1" in out  # the math reward accepts the bare reference "3"
    assert out.rstrip().endswith("7/7 checks passed")


def test_dry_run_reports_bad_data_and_a_taken_output_dir_and_exits_2(tmp_path, capsys):
    overrides = _files(tmp_path, [{"question": "What is 1+2?", "answer": "3"}, {"question": "no answer"}])
    (tmp_path / "out" / "checkpoints" / "5").mkdir(parents=True)  # another run's checkpoint
    assert main(["train", "configs/default.yaml", *overrides, "--dry-run"]) == 2
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 2
    assert failed[0].startswith("FAILED output_dir") and "holds a run with checkpoints" in failed[0]
    assert failed[1].startswith("FAILED data") and "data.train_file" in failed[1] and "train.jsonl:2" in failed[1]
    assert "ok     loss" in out  # the checks that do not need the data still run
    assert os.listdir(tmp_path / "out") == ["checkpoints"]


def test_dry_run_names_a_missing_extra(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)
    overrides = _files(tmp_path, [{"question": "What is 1+2?", "answer": "3"}])
    assert main(["train", "configs/default.yaml", *overrides, "wandb=true", "--dry-run"]) == 2
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAILED")]
    assert "extras" in line and "wandb: true needs the wandb package" in line and "pip install" in line


def test_train_help_mentions_print_config_and_dry_run(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "--print-config" in text and "--dry-run" in text


def test_configlib_describe_walks_any_schema():
    """The generic part: types, bounds, Literal choices, optional and list fields, nested sections, defaults,
    changed values and a per-field choices note."""
    import dataclasses
    import math
    from typing import Literal

    from jaxrl.configlib import describe, load_config

    @dataclasses.dataclass(frozen=True)
    class Optim:
        learning_rate: float = dataclasses.field(default=3e-4, metadata={"gt": 0})
        schedule: Literal["constant", "cosine"] = "cosine"
        max_norm: float = dataclasses.field(default=math.inf, metadata={"gt": 0, "le": math.inf})

    @dataclasses.dataclass(frozen=True)
    class Root:
        name: str | None = None
        sizes: tuple[int, ...] = (1, 2)
        optim: Optim = dataclasses.field(default_factory=Optim)

    config = load_config(Root, None, ["optim.schedule=constant", "name=x"])
    assert describe(config, {"optim.schedule": "see the docs"}).splitlines() == [
        'name: "x"  # str or null; default null (changed)',
        "sizes: [1, 2]  # list of int; default [1, 2]",
        "optim:",
        "  learning_rate: 0.0003  # float > 0; default 0.0003",
        "  schedule: \"constant\"  # one of 'constant', 'cosine'; default \"cosine\" (changed); see the docs",
        "  max_norm: .inf  # float > 0, <= .inf; default .inf",
    ]


def test_dry_run_prints_the_chat_templated_prompt_of_a_pretrained_checkpoint(tmp_path, capsys):
    """With pretrained.path, the checkpoint's tokenizer renders the prompt, chat template and system turn
    included; no weights are loaded (the safetensors file may be anything)."""
    from test_pretrained_run import _checkpoint_with_tokenizer

    _checkpoint_with_tokenizer(tmp_path / "qwen")
    (tmp_path / "qwen" / "model.safetensors").write_bytes(b"not weights")  # never read by a dry run
    overrides = _files(tmp_path, [{"question": "What is 1+2?", "answer": "3"}])
    assert main(["train", "configs/default.yaml", *overrides, f"pretrained.path={tmp_path / 'qwen'}",
                 "data.chat_template=true", "data.system_prompt='Be brief.'", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("ok     template")))
    assert lines[start + 1:start + 7] == ["    | <|im_start|>system", "    | Be brief.<|im_end|>",
                                          "    | <|im_start|>user", "    | Q: What is 1+2? A:<|im_end|>",
                                          "    | <|im_start|>assistant", "    | "]


def test_dry_run_checks_the_lora_targets(tmp_path, capsys):
    overrides = _files(tmp_path, [{"question": "What is 1+2?", "answer": "3"}])
    assert main(["train", "configs/default.yaml", *overrides, "rl.lora.enabled=true", "rl.lora.targets=[attn]",
                 "--dry-run"]) == 2
    failed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAILED")]
    assert failed == [line for line in failed if "rl.lora.targets: target 'attn' matches no projection" in line]
    assert len(failed) == 1
