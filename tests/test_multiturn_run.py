"""Multi-turn runs end to end (`loop.run` with an `env:` section): a hostile environment cannot stop the batch or
the run, and what it did is counted and logged."""

import json
import sys
from pathlib import Path

import pytest

from jaxrl import loop
from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.metrics import read_metrics

HERE = Path(__file__).resolve().parent


def _config(output_dir, *more):
    return load_config(Config, None, [
        "imports=[my_envs]", "env.name=hostile", "env.max_turns=3", "env.max_tokens=40", "env.turn_tokens=16",
        "env.observation_tokens=8", "env.step_timeout_s=1.0", "env.num_workers=2",
        "model.vocab_size=32", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=16", "model.intermediate_size=64", "task.num_eval=8",
        "sft.steps=0", "rl.steps=2", "rl.prompts_per_step=4", "rl.group_size=2", "eval.every=0",
        "eval.batch_size=8", "checkpoint.every=0", "reward.num_workers=1", "progress=false",
        "log.samples_every=1", "log.samples_per_step=8", f"output_dir={output_dir}", *more])


@pytest.fixture(autouse=True)
def _custom_pieces(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE / "custom_pieces"))
    monkeypatch.delitem(sys.modules, "my_envs", raising=False)


def test_a_hostile_environment_ends_episodes_not_the_run(tmp_path):
    summary = loop.run(_config(tmp_path / "run"))
    assert "accuracy_after_rl" in summary
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("phase") == "rl"]
    steps = [r for r in records if r["step"] in (1, 2) and "episode/turns_mean" in r]
    assert len(steps) == 2
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    episodes = [s["episode"] for s in samples]
    errors = [e for episode in episodes for e in episode["errors"]]
    # every kind of failure the environment produced was recorded against its episode, not raised
    assert any("step_timeout_s" in e for e in errors) or any("killed its worker" in e for e in errors)
    for s in samples:
        for turn in s["episode"]["turns"]:
            turn["text"].encode("utf-8")  # no lone surrogate reached the log
            if turn["role"] == "observation":
                assert len(turn["text"]) <= 64  # 1 MB cut to env.observation_tokens tokens
    total_errors = sum(r["episode/env_errors_mean"] for r in steps)
    assert total_errors > 0


class _TemplateOnly:
    """The part of a tokenizer that rendering uses: a ChatML template that drops tool messages."""

    chat_template = ("{%- for message in messages if message.role != 'tool' %}{{- '<|im_start|>' + message.role + "
                     "'\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
                     "{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    special_tokens: dict = {}

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        from jaxrl.tokenizer import BaseTokenizer
        return BaseTokenizer.apply_chat_template(self, messages, add_generation_prompt, **kwargs)


def test_a_chat_template_without_a_tool_role_is_refused_for_a_tool_recipe(tmp_path):
    from jaxrl.loop import setup
    from jaxrl.tokenizer import ChatTemplateError

    config = load_config(Config, None, ["env.name=tools", "env.tools=[calculator]", "data.chat_template=true",
                                        "pretrained.path=unused"])
    with pytest.raises(ChatTemplateError, match="data.chat_template: .*tool"):
        setup.make_generator([], _TemplateOnly(), None, config)
