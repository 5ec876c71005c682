"""A recipe that starts from a Hugging Face checkpoint: its tokenizer.json and chat template, RL on prompt
files, the trained policy exported back as a Hugging Face directory."""

import glob
import json
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models as tok_models, pre_tokenizers, trainers

import models
from jaxrl import cli, loop
from jaxrl.config import Config
from jaxrl.configlib import ConfigError, load_config
from jaxrl.data import arithmetic
from jaxrl.tokenizer import load_tokenizer

FIXTURE = "tests/data/hf/transformers5/qwen2"  # vocab 128, tied, q/k/v biases
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _checkpoint_with_tokenizer(directory):
    """The qwen2 fixture plus a small tokenizer.json (< 128 tokens) with Qwen's special tokens."""
    shutil.copytree(FIXTURE, directory)
    tok = RawTokenizer(tok_models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = [p.prompt + " " + arithmetic.solution(p) for p in
              arithmetic.make_splits(arithmetic.ArithmeticTaskConfig(num_train=200, num_eval=8), 0)[0]]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"],
        show_progress=False))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHATML}))
    assert load_tokenizer(directory).vocab_size <= 128


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pretrained")
    _checkpoint_with_tokenizer(tmp / "qwen")
    train, held_out = arithmetic.make_splits(arithmetic.ArithmeticTaskConfig(num_train=24, num_eval=8), seed=0)
    for name, rows in (("train", train), ("eval", held_out)):
        (tmp / f"{name}.jsonl").write_text("".join(
            json.dumps({"question": p.prompt, "answer": arithmetic.solution(p)}) + "\n" for p in rows))
    overrides = [
        f"pretrained.path={tmp / 'qwen'}", "pretrained.dtype=float32", f"data.train_file={tmp / 'train.jsonl'}",
        f"data.eval_file={tmp / 'eval.jsonl'}", "data.reference_pattern='#### (.+)$'", "data.chat_template=true",
        "data.system_prompt='Think, then answer.'", "sft.steps=0", "rl.steps=2", "rl.prompts_per_step=4",
        "rl.group_size=4", "rl.sampling.max_new_tokens=12", "eval.every=0", "eval.batch_size=8",
        "checkpoint.every=0", "reward.function=math", "progress=false", f"output_dir={tmp / 'run'}",
    ]
    config = load_config(Config, None, overrides)
    return tmp, config, loop.run(config)


def test_run_from_a_hugging_face_checkpoint(pretrained_run):
    tmp, config, summary = pretrained_run
    assert summary["num_parameters"] == models.num_parameters(models.load_config(tmp / "qwen"))
    assert summary["num_eval_problems"] == 8 and 0.0 <= summary["accuracy_after_rl"] <= 1.0
    # The exported directory is the trained policy: equal to the final orbax checkpoint, loadable again.
    exported = models.from_pretrained(tmp / "run" / "hf", progress=False)
    manager = ocp.CheckpointManager(tmp / "run" / "checkpoints")
    saved = manager.restore(manager.latest_step(), args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    manager.close()
    saved_params = jax.tree.leaves(saved["state"]["params"])
    initial = models.from_pretrained(tmp / "qwen", progress=False)
    changed = False
    assert len(saved_params) == len(jax.tree.leaves(exported.params))
    for got, want, before in zip(jax.tree.leaves(exported.params), saved_params,
                                 jax.tree.leaves(initial.params)):
        np.testing.assert_array_equal(got, want)
        changed |= not np.array_equal(got, before)
    assert changed, "RL did not update the policy"
    # Tokenizer files and non-architecture config keys come along from the source directory.
    assert (tmp / "run" / "hf" / "tokenizer.json").exists()
    assert json.loads((tmp / "run" / "hf" / "config.json").read_text())["bos_token_id"] == 1


def test_prompts_go_through_the_chat_template(pretrained_run):
    tmp, config, _ = pretrained_run
    tokenizer = load_tokenizer(tmp / "qwen")
    generate = loop.Generator(tokenizer, 64, None, chat_template=True, system_prompt="Think, then answer.")
    text = generate.render("1+2=")
    assert text == ("<|im_start|>system\nThink, then answer.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = generate.prompt_tokens("1+2=")
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") and tokenizer.token_to_id("<|im_end|>") in ids
    assert tokenizer.token_to_id("<|im_end|>") in tokenizer.stop_ids  # the template's end of turn stops


@pytest.mark.parametrize("overrides, match", [
    (["data.chat_template=true"], "need pretrained.path"),
    (["data.system_prompt=hi"], "needs data.chat_template"),
])
def test_recipe_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(Config, None, overrides)


def test_missing_checkpoint_is_a_clean_cli_error(tmp_path, capsys):
    code = cli.main(["train", "configs/default.yaml", f"pretrained.path={tmp_path / 'nowhere'}", "sft.steps=0",
                     f"output_dir={tmp_path / 'run'}"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxrl: checkpoint error: pretrained.path: ") and "nowhere: no such file" in err


@pytest.mark.parametrize("recipe", sorted(glob.glob("configs/*.yaml")))
def test_every_recipe_parses(recipe):
    config = load_config(Config, recipe)
    if recipe != "configs/default.yaml":  # the real-model recipes: a checkpoint, prompt files, RL from it
        assert config.pretrained.path and config.data.train_file and config.data.chat_template
        assert config.sft.steps == 0 and config.reward.function == "math"
