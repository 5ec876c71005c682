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

from jaxrl import models
from jaxrl.models.hf import CheckpointError
from jaxrl import cli, configlib, loop
from jaxrl.loop import setup
from jaxrl.sharding import layout_from
from jaxrl.config import Config
from jaxrl.configlib import ConfigError, load_config
from jaxrl.policy_io import RUN_MODEL_FILE, load_policy
from jaxrl.data import arithmetic
from jaxrl.tokenizer import load_tokenizer
from test_hf_tokenizer import CHATML as CHATML_WITH_SYSTEM
from test_hf_tokenizer import GEMMA, GEMMA_SPECIALS, LLAMA3, LLAMA_SPECIALS, QWEN_SPECIALS

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


def _prompt_files(directory, num_train: int, num_eval: int) -> None:
    """`train.jsonl` and `eval.jsonl` of arithmetic problems with `#### answer` references in `directory`."""
    train, held_out = arithmetic.make_splits(arithmetic.ArithmeticTaskConfig(num_train=num_train, num_eval=num_eval),
                                             seed=0)
    for name, rows in (("train", train), ("eval", held_out)):
        (directory / f"{name}.jsonl").write_text("".join(
            json.dumps({"question": p.prompt, "answer": arithmetic.solution(p)}) + "\n" for p in rows))


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pretrained")
    _checkpoint_with_tokenizer(tmp / "qwen")
    _prompt_files(tmp, num_train=24, num_eval=8)
    overrides = [
        f"pretrained.path={tmp / 'qwen'}", "pretrained.dtype=float32", f"data.train_file={tmp / 'train.jsonl'}",
        f"data.eval_file={tmp / 'eval.jsonl'}", "data.reference_pattern='#### (.+)$'", "data.chat_template=true",
        "data.system_prompt='Think, then answer.'", "sft.steps=0", "rl.steps=2", "rl.prompts_per_step=4",
        "rl.group_size=4", "rl.sampling.max_new_tokens=12", "eval.every=0", "eval.batch_size=8",
        "checkpoint.every=0", "reward.function=math", "progress=false", f"output_dir={tmp / 'run'}",
        "tokenizer.stop_strings=['####']", "pretrained.attention_impl=xla",
    ]
    config = load_config(Config, None, overrides)
    return tmp, config, loop.run(config)


def test_run_from_a_hugging_face_checkpoint(pretrained_run):
    tmp, config, summary = pretrained_run
    assert summary["num_parameters"] == models.num_parameters(models.load_config(tmp / "qwen"))
    assert summary["num_eval_problems"] == 8 and 0.0 <= summary["accuracy_after_rl"] <= 1.0
    assert config.tokenizer.stop_strings == ("####",)
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
    generate = loop.Generator(tokenizer, (64,), None, chat_template=True, system_prompt="Think, then answer.")
    text = generate.render("1+2=")
    assert text == ("<|im_start|>system\nThink, then answer.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = generate.prompt_tokens("1+2=")
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") and tokenizer.token_to_id("<|im_end|>") in ids
    assert tokenizer.token_to_id("<|im_end|>") in tokenizer.stop_ids  # the template's end of turn stops


def test_recipe_errors():
    with pytest.raises(ConfigError, match="needs data.chat_template"):
        load_config(Config, None, ["data.system_prompt=hi"])


@pytest.fixture(scope="module")
def checkpoints_for_refusals(tmp_path_factory):
    """An HF checkpoint without tokenizer files, and one whose tokenizer has no chat template."""
    tmp = tmp_path_factory.mktemp("refusals")
    shutil.copytree(FIXTURE, tmp / "bare")
    _checkpoint_with_tokenizer(tmp / "no_template")
    config = json.loads((tmp / "no_template" / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp / "no_template" / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp


# (overrides, what the error must say); {tmp} is the fixture's directory.
REFUSED = [
    (["data.chat_template=true"], "tokenizer.path and data.chat_template need pretrained.path"),
    (["tokenizer.vocab_size=16", "task.num_train=300"],
     "tokenizer error: tokenizer.vocab_size=16: sentencepiece cannot train on the task's text"),
    (["tokenizer.stop_tokens=[NOT_A_TOKEN]"], "tokenizer error: stop token 'NOT_A_TOKEN' is not in the tokenizer's vocabulary"),
    (["rl.loss.preset=ppo", "rl.critic.model=separate", "rl.critic.checkpoint={tmp}/nowhere"],
     "checkpoint error: rl.critic.checkpoint: "),
    (["pretrained.path={tmp}/bare", "sft.steps=0"],
     "checkpoint error: pretrained.path: {tmp}/bare: no tokenizer.json or tokenizer.model in this directory; "
     "set tokenizer.path"),
    (["pretrained.path={tmp}/bare", "tokenizer.path={tmp}/nowhere.model", "sft.steps=0"],
     "checkpoint error: tokenizer.path: "),
    (["pretrained.path={tmp}/no_template", "sft.steps=0", "data.chat_template=true"],
     "data.chat_template: this tokenizer has no chat template"),
]


@pytest.mark.parametrize("overrides, message", REFUSED)
def test_refused_before_the_output_dir_changes(checkpoints_for_refusals, tmp_path, capsys, overrides, message):
    """Every check of a run happens before its directory changes: with overwrite=true, an old run stays whole."""
    tmp = checkpoints_for_refusals
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    old = {name: f"old {name}".encode() for name in ("metrics.jsonl", "summary.json", "tokenizer.model",
                                                      "config.yaml", "tensorboard/events")}
    for name, content in old.items():
        (out / name).write_bytes(content)
    code = cli.main(["train", "configs/default.yaml", f"output_dir={out}", "overwrite=true", "progress=false",
                     *(o.format(tmp=tmp) for o in overrides)])
    err = capsys.readouterr().err
    assert code == 2 and message.format(tmp=tmp) in err, err[-2000:]
    assert {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} == set(old)
    assert all((out / name).read_bytes() == content for name, content in old.items())


def test_stop_tokens_apply_to_a_trained_tokenizer(tmp_path):
    config = load_config(Config, "configs/default.yaml", [f"output_dir={tmp_path}", "tokenizer.stop_tokens=[',']"])
    _, tokenizer, _ = setup.policy_and_tokenizer(config, ["1,2=3", "4,5=9"], layout_from(config.mesh))
    assert tokenizer.stop_ids == (tokenizer.eos_id, tokenizer.token_to_id(","))


def test_eval_takes_tokenizer_path_without_pretrained_path(pretrained_run, capsys):
    """A policy checkpoint without tokenizer files is evaluated with `tokenizer.path` alone."""
    tmp, config, _ = pretrained_run
    bare = tmp / "bare-policy"
    assert cli.main(["convert", FIXTURE, str(bare)]) == 0
    shutil.rmtree(bare / "hf_files", ignore_errors=True)
    common = ["eval", "configs/default.yaml", f"checkpoint={bare}", "task.num_eval=8", "progress=false",
              "eval.batch_size=8", "rl.sampling.max_new_tokens=4"]
    assert cli.main(common) == 2
    assert f"eval error: checkpoint: {bare} holds no tokenizer files: set tokenizer.path" in capsys.readouterr().err
    assert cli.main([*common, f"tokenizer.path={tmp / 'qwen'}"]) == 0
    out = capsys.readouterr().out
    assert 0 <= json.loads(out[out.index("{"):])["eval/accuracy"] <= 1


def test_missing_checkpoint_is_a_clean_cli_error(tmp_path, capsys):
    code = cli.main(["train", "configs/default.yaml", f"pretrained.path={tmp_path / 'nowhere'}", "sft.steps=0",
                     f"output_dir={tmp_path / 'run'}"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxrl: checkpoint error: pretrained.path: ") and "nowhere: no such file" in err


@pytest.mark.parametrize("recipe", sorted(glob.glob("configs/*.yaml")))
def test_every_recipe_parses(recipe):
    config = load_config(Config, recipe)
    if recipe not in ("configs/default.yaml", "configs/tools.yaml", "configs/off_policy.yaml"):  # the real-model
        # recipes (the off-policy one is the default's task with rl.max_staleness 2): a checkpoint,
        # prompt files, RL from it (the built-in tool recipe trains from scratch, as the default does)
        assert config.pretrained.path and config.data.train_file and config.data.chat_template
        assert config.sft.steps == 0 and config.reward.function == "math"


def test_run_from_a_converted_policy_checkpoint(pretrained_run):
    """An orbax policy checkpoint (`jaxrl convert`) starts a run too: its kept HF files give the tokenizer."""
    tmp, config, _ = pretrained_run
    assert cli.main(["convert", str(tmp / "qwen"), str(tmp / "qwen-orbax")]) == 0
    run = tmp / "run-from-orbax"
    summary = loop.run(configlib.replace_path(configlib.replace_path(
        configlib.replace_path(config, "pretrained.path", str(tmp / "qwen-orbax")), "rl.steps", 1),
        "output_dir", str(run)))
    assert summary["num_parameters"] == models.num_parameters(models.load_config(tmp / "qwen"))
    assert (run / "hf" / "tokenizer.json").exists() and models.from_pretrained(run / "hf", progress=False)


def test_a_run_from_a_checkpoint_loads_as_the_model_it_trained(pretrained_run, tmp_path):
    """A run records the model it trained (model.yaml): for a run from pretrained.path that checkpoint's model,
    not config.yaml's unused `model` section, so `load_policy(run)`, `jaxrl convert run` and
    `pretrained.path=<run>` all work."""
    tmp, _, _ = pretrained_run
    policy = load_policy(tmp / "run")
    exported = models.from_pretrained(tmp / "run" / "hf", progress=False)
    assert policy.config.hidden_size == exported.config.hidden_size
    for got, want in zip(jax.tree.leaves(policy.params), jax.tree.leaves(exported.params)):
        np.testing.assert_array_equal(got, want)
    older = tmp_path / "older"  # a run written before model.yaml existed: an error that says so
    shutil.copytree(tmp / "run", older, ignore=shutil.ignore_patterns("hf", RUN_MODEL_FILE))
    with pytest.raises(CheckpointError, match=r"started from pretrained.path=.*'model' section is not the model "
                                              r"it trained, and it has no model.yaml"):
        load_policy(older)


# ----------------------------------------------------------------------------- the real-model recipes, in small

RECIPE_FIXTURES = {  # recipe -> (fixture checkpoint of its family, special tokens, chat template, tokenizer config)
    "configs/qwen2.5-math-1.5b-gsm8k.yaml": ("qwen2", QWEN_SPECIALS, CHATML_WITH_SYSTEM,
                                             {"eos_token": "<|endoftext|>", "bos_token": None}),
    "configs/qwen3-1.7b-math.yaml": ("qwen3", QWEN_SPECIALS, CHATML,
                                     {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}),
    "configs/llama3.2-1b-instruct-gsm8k.yaml": ("llama3_bf16", LLAMA_SPECIALS, LLAMA3,
                                                {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "configs/gemma3-1b-it-gsm8k.yaml": ("gemma3", GEMMA_SPECIALS, GEMMA,
                                        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}),
}


def _family_checkpoint(directory, fixture, specials, template, tokenizer_config):
    """A fixture checkpoint of the recipe's family with a < 128-token tokenizer of that family's kind."""
    shutil.copytree(f"tests/data/hf/transformers5/{fixture}", directory)
    tok = RawTokenizer(tok_models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = [p.prompt + " " + arithmetic.solution(p) for p in
              arithmetic.make_splits(arithmetic.ArithmeticTaskConfig(num_train=100, num_eval=8), 0)[0]]
    corpus += ["Please reason step by step, and put your final answer within boxed", "Think then give the answer",
               "user assistant model system"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=100, special_tokens=[*specials, "<unk>"] if "<unk>" not in specials else specials,
        show_progress=False))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": template}))


# Qwen2.5's recipe shares its data schema (GSM8K) with Llama's and Gemma's and its model family with the HF
# tests: it runs in the slow suite. So do Gemma 3's and Qwen3's (19 s and 15 s of `make test`, which had reached
# its 15 minutes; their model families stay covered by tests/test_hf.py and test_model_presets.py).
@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.slow) if "llama" not in r else r
                                    for r in sorted(RECIPE_FIXTURES)])
def test_recipe_runs_on_a_tiny_checkpoint_of_its_family(recipe, tmp_path):
    """Each real-model recipe, unchanged but for paths and sizes: float32 master weights, bfloat16 compute,
    its chat template and data schema, one RL step, the HF export."""
    fixture, specials, template, tokenizer_config = RECIPE_FIXTURES[recipe]
    _family_checkpoint(tmp_path / "model", fixture, specials, template, tokenizer_config)
    train, held_out = arithmetic.make_splits(arithmetic.ArithmeticTaskConfig(num_train=8, num_eval=4), seed=0)
    math_rows = "gsm8k" not in recipe  # MATH-style rows: problem + a solution with a boxed answer
    for name, rows in (("train", train), ("eval", held_out)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(
            {"problem": p.prompt, "solution": f"so \\boxed{{{p.answer}}}"} if math_rows else
            {"question": p.prompt, "answer": arithmetic.solution(p)}) + "\n" for p in rows))
    config = load_config(Config, recipe, [
        f"pretrained.path={tmp_path / 'model'}", f"data.train_file={tmp_path / 'train.jsonl'}",
        f"data.eval_file={tmp_path / 'eval.jsonl'}", "rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=2",
        "rl.micro_batches=2", "rl.sampling.max_new_tokens=8", "reward.overlong_buffer=4", "reward.num_workers=1",
        "eval.every=0", "eval.batch_size=4", "checkpoint.every=0", "progress=false",
        f"output_dir={tmp_path / 'run'}"])
    assert (config.pretrained.dtype, config.pretrained.compute_dtype) == ("float32", "bfloat16")
    summary = loop.run(config)
    assert summary["num_eval_problems"] == 4 and np.isfinite(summary["accuracy_after_rl"])
    exported = models.from_pretrained(tmp_path / "run" / "hf", progress=False)
    assert exported.config.family == models.load_config(tmp_path / "model").family
    assert {x.dtype for x in jax.tree.leaves(exported.params)} == {np.dtype("float32")}


def test_eval_of_a_run_started_from_a_hugging_face_checkpoint(pretrained_run, capsys):
    """`jaxrl eval` on such a run takes the tokenizer its saved config names (`pretrained.path`'s
    tokenizer.json): the run keeps no tokenizer.model of its own."""
    tmp, _, _ = pretrained_run
    assert not (tmp / "run" / "tokenizer.model").exists()
    code = cli.main(["eval", str(tmp / "run" / "config.yaml"), f"checkpoint={tmp / 'run'}", "eval.batch_size=8"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    result = json.loads(captured.out[captured.out.index("{"):])
    assert result["kind"] == "run" and result["step"] == 2 and 0 <= result["eval/accuracy"] <= 1


def test_convert_of_a_run_started_from_a_hugging_face_checkpoint_keeps_its_tokenizer(pretrained_run, tmp_path):
    """`jaxrl convert <run> out` without --base takes the HF files of the run's `pretrained.path`."""
    tmp, _, _ = pretrained_run
    assert cli.main(["convert", str(tmp / "run"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tmp / "qwen" / "tokenizer.json").read_bytes()
    assert load_tokenizer(tmp_path / "hf").vocab_size == load_tokenizer(tmp / "qwen").vocab_size
