"""jaxrl.tiny / `jaxrl tiny-checkpoint`: a tiny HF checkpoint with a tokenizer and a ChatML chat template that
`jaxrl.models.from_pretrained`, `jaxrl.tokenizer.load_tokenizer` and a recipe's `pretrained.path` accept."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import cli, models
from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.data.prompts import PromptRecord
from jaxrl.data.render import render_prompt
from jaxrl.tiny import CHATML, FAMILIES, write_tiny_checkpoint
from jaxrl.tokenizer import encode_prompt, load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen")


def test_loads_as_a_model_and_a_tokenizer(tiny):
    policy = models.from_pretrained(tiny, progress=False)
    tokenizer = load_tokenizer(tiny)
    assert policy.config.family == "qwen2" and policy.config.qkv_bias and policy.config.num_layers == 2
    assert tokenizer.vocab_size <= policy.config.vocab_size
    # Byte-level: any text round-trips, CJK and emoji included.
    text = "Rechne 12+7 = ? 中文 🙂"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.eos_id == im_end and tokenizer.pad_id == tokenizer.token_to_id("<|endoftext|>")
    assert im_end in tokenizer.stop_ids
    logits = models.forward(policy, jnp.asarray([tokenizer.encode(text)]))
    assert logits.shape[-1] == policy.config.vocab_size and bool(jnp.isfinite(logits).all())


def test_renders_a_chat_prompt(tiny):
    tokenizer = load_tokenizer(tiny)
    assert tokenizer.chat_template == CHATML
    text = render_prompt(PromptRecord("2+2?", "4", "f:1"), tokenizer, chat_template=True, system_prompt="Be brief.")
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = encode_prompt(tokenizer, text, templated=True)
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") and ids.count(tokenizer.token_to_id("<|im_end|>")) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_round_trips(tmp_path, family):
    path = write_tiny_checkpoint(tmp_path / family, family=family, layers=1, hidden=32, seed=1)
    policy = models.from_pretrained(path, progress=False)
    assert (policy.config.family, policy.config.num_layers, policy.config.hidden_size) == (family, 1, 32)
    again = models.from_pretrained(write_tiny_checkpoint(tmp_path / "again", family=family, layers=1, hidden=32,
                                                         seed=1), progress=False)
    tokens = jnp.arange(8)[None]
    np.testing.assert_array_equal(models.forward(policy, tokens), models.forward(again, tokens))  # seeded


def test_a_recipe_accepts_it(tiny):
    config = load_config(Config, "configs/default.yaml", [f"pretrained.path={tiny}", "data.chat_template=true"])
    assert config.pretrained.path == str(tiny)


def test_cli(tmp_path, capsys):
    out = tmp_path / "t"
    assert cli.main(["tiny-checkpoint", str(out), "--family", "llama", "--layers", "1", "--hidden", "32"]) == 0
    assert f"pretrained.path={out}" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    # A non-empty directory is refused; the CLI's family choices are the models' families.
    assert cli.main(["tiny-checkpoint", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert cli.main(["tiny-checkpoint", str(out), "--overwrite", "--hidden", "24"]) == 2
    assert "multiple of 16" in capsys.readouterr().err
    tiny_parser = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices.values()
                       if a.prog.endswith("tiny-checkpoint"))
    family = next(a for a in tiny_parser._actions if a.dest == "family")
    assert tuple(family.choices) == FAMILIES
