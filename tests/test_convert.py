"""Checkpoint conversion (`jaxrl.convert`, `jaxrl convert`): HF <-> policy checkpoints bit for bit, dtype
changes, loading from every kind of source (HF, policy checkpoint, run step, run) and clear errors."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import models
from hf_fixtures import FIXTURES, tensors_of
from jaxrl import cli, configlib
from jaxrl.checkpoint import Checkpointer
from jaxrl.config import Config
from jaxrl.convert import convert, parse_size, save_policy
from jaxrl.policy_io import HF_FILES_DIR, MODEL_FILE, POLICY_FORMAT, RUN_MODEL_FILE, describe_source, load_policy
from jaxrl.models import CheckpointError

HF5 = os.path.join(FIXTURES, "transformers5")
NAMES = ["llama3", "qwen2", "qwen3", "gemma3", "llama3_bf16"]


def fixture(name: str) -> str:
    return os.path.join(HF5, name)


def assert_same_tensors(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        np.testing.assert_array_equal(a[key].view(np.uint8), b[key].view(np.uint8), err_msg=key)


def assert_same_params(a: models.Policy, b: models.Policy) -> None:
    assert jax.tree.structure(a.params) == jax.tree.structure(b.params)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def make_run(run_dir, name: str = "qwen2", steps=(3,)) -> models.Policy:
    """A fake training run: config.yaml + checkpoints/<step> with params (doubled at each later step),
    optimizer-like state and a step counter; returns the policy of the last step."""
    policy = models.from_pretrained(fixture(name), progress=False)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(configlib.dump_yaml(Config(model=policy.config, output_dir=str(run_dir))))
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=5)
    params = policy.params
    for i, step in enumerate(steps):
        params = jax.tree.map(lambda x: x * 2, policy.params) if i else policy.params
        state = {"params": params, "opt_state": {"mu": jax.tree.map(jnp.zeros_like, params)},
                 "step": jnp.int32(step)}
        checkpointer.save(step, state, {"phase": "rl", "rl_step": step})
    checkpointer.close()
    return models.Policy(policy.graphdef, policy.config, params)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", NAMES)
def test_hf_to_orbax_to_hf_is_bit_exact(tmp_path, name):
    source = fixture(name)
    result = convert(source, tmp_path / "policy")  # HF source: orbax by default
    assert result.to == "orbax" and result.source.kind == "hf"
    assert result.num_parameters == models.num_parameters(models.load_config(source))
    meta = json.loads((tmp_path / "policy" / MODEL_FILE).read_text())
    assert meta["format"] == POLICY_FORMAT and meta["model"]["family"] == models.load_config(source).family
    assert (tmp_path / "policy" / HF_FILES_DIR / "config.json").exists()

    back = convert(tmp_path / "policy", tmp_path / "hf")  # policy source: HF by default
    assert back.to == "hf" and back.source.kind == "policy"
    assert_same_tensors(tensors_of(source), tensors_of(tmp_path / "hf"))
    assert models.load_config(tmp_path / "hf") == models.load_config(source)
    # The HF files the policy checkpoint kept make the way back complete: token ids, generation config.
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    original = json.loads(open(os.path.join(source, "config.json")).read())
    assert config["bos_token_id"] == original["bos_token_id"]
    assert (tmp_path / "hf" / "generation_config.json").read_text() == open(
        os.path.join(source, "generation_config.json")).read()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directories left


def test_bfloat16_is_preserved(tmp_path):
    convert(fixture("llama3_bf16"), tmp_path / "policy")
    policy = load_policy(tmp_path / "policy")
    assert policy.config.param_dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(policy.params)} == {jnp.dtype("bfloat16")}
    assert_same_params(policy, models.from_pretrained(fixture("llama3_bf16"), progress=False))


def test_dtype_conversion(tmp_path):
    source = fixture("qwen2")
    result = convert(source, tmp_path / "bf16", dtype="bfloat16")
    assert result.dtype == "bfloat16"
    policy = load_policy(tmp_path / "bf16")
    assert policy.config.param_dtype == policy.config.dtype == "bfloat16"
    assert_same_params(policy, models.from_pretrained(source, "bfloat16", progress=False))
    # Orbax -> HF back in float32: the bf16 values, widened exactly.
    convert(tmp_path / "bf16", tmp_path / "hf32", dtype="float32")
    saved = tensors_of(tmp_path / "hf32")
    for key, value in tensors_of(source).items():
        assert saved[key].dtype == np.float32
        np.testing.assert_array_equal(saved[key], value.astype(jnp.bfloat16).astype(np.float32), err_msg=key)
    # load_policy casts on the way in too.
    cast = load_policy(tmp_path / "bf16", dtype="float32")
    assert {x.dtype for x in jax.tree.leaves(cast.params)} == {jnp.dtype("float32")}


def test_save_policy_refuses_a_non_empty_directory(tmp_path):
    policy = models.from_pretrained(fixture("qwen3"), progress=False)
    (tmp_path / "other.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        save_policy(policy, tmp_path)
    save_policy(policy, tmp_path / "p")
    save_policy(jax.tree.map(lambda x: x, policy), tmp_path / "p", overwrite=True)
    assert_same_params(load_policy(tmp_path / "p"), policy)
    assert not (tmp_path / "p" / HF_FILES_DIR).exists()


# ----------------------------------------------------------------------------- sources


def test_load_policy_from_every_kind_of_source(tmp_path):
    run = tmp_path / "run"
    expected = make_run(run, "qwen2", steps=(2, 5))
    convert(fixture("qwen2"), tmp_path / "policy")
    original = models.from_pretrained(fixture("qwen2"), progress=False)

    assert describe_source(fixture("qwen2")).kind == "hf"
    assert describe_source(tmp_path / "policy").kind == "policy"
    for path in (run, run / "checkpoints", run / "checkpoints" / "5"):
        source = describe_source(path)
        assert (source.kind, source.step, source.directory) == ("run", 5, str(run / "checkpoints" / "5"))
        assert_same_params(load_policy(path), expected)
    assert describe_source(run / "checkpoints" / "2").step == 2
    assert_same_params(load_policy(run / "checkpoints" / "2"), original)  # an earlier step, by its directory
    assert_same_params(load_policy(fixture("qwen2")), original)
    assert_same_params(load_policy(tmp_path / "policy"), original)

    loaded = load_policy(run, dtype="bfloat16", mesh=jax.make_mesh((1,), ("data",)))
    leaf = jax.tree.leaves(loaded.params)[0]
    assert leaf.dtype == jnp.bfloat16 and isinstance(leaf.sharding, jax.sharding.NamedSharding)
    assert loaded.config.param_dtype == "bfloat16"
    tokens = jnp.arange(8)[None] % loaded.config.vocab_size
    assert models.forward(loaded, tokens).shape == (1, 8, loaded.config.vocab_size)


def test_a_flipped_byte_in_a_run_checkpoint_is_refused_by_load_policy(tmp_path):
    # `jaxrl eval` and `pretrained.path=<run>` read a run's parameters without `Checkpointer.restore`: a byte
    # flipped in the array data loaded as other values. Each flip now either fails to load, naming the
    # digests, or (a byte of the optimizer state, or one orbax never reads) loads the saved values exactly.
    run = tmp_path / "run"
    expected = make_run(run, "qwen2", steps=(3,))
    state_dir = run / "checkpoints" / "3" / "state"
    path = max((os.path.join(root, f) for root, _, files in os.walk(state_dir) for f in files
                if os.path.basename(root) == "d"), key=os.path.getsize)
    size, refused = os.path.getsize(path), 0
    for position in range(size // 16, size, size // 8):
        with open(path, "r+b") as f:
            f.seek(position)
            byte = f.read(1)[0]
            f.seek(position)
            f.write(bytes([byte ^ 0x10]))
        try:
            assert_same_params(load_policy(run), expected)
        except CheckpointError as e:
            refused += "do not match the digests" in str(e) or "cannot restore" in str(e)
        with open(path, "r+b") as f:  # undo, so each flip is alone
            f.seek(position)
            f.write(bytes([byte]))
    assert refused, "no flip in the largest data file was refused"


def test_run_to_hf_with_and_without_base(tmp_path):
    run = tmp_path / "run"
    expected = make_run(run, "gemma3")
    # a run from random weights has no HF tokenizer: refused loudly, naming --base, unless asked for
    with pytest.raises(CheckpointError, match=r"no tokenizer for the Hugging Face output: .*random weights.*--base"):
        convert(run, tmp_path / "plain")
    assert not (tmp_path / "plain").exists()
    result = convert(run, tmp_path / "plain", no_tokenizer=True)
    assert result.to == "hf" and result.source.step == 3
    assert not (tmp_path / "plain" / "generation_config.json").exists()  # a run names no HF origin
    assert_same_params(models.from_pretrained(tmp_path / "plain", progress=False), expected)

    convert(run / "checkpoints", tmp_path / "based", base=fixture("gemma3"))
    assert (tmp_path / "based" / "generation_config.json").read_text() == open(
        os.path.join(fixture("gemma3"), "generation_config.json")).read()
    config = json.loads((tmp_path / "based" / "config.json").read_text())
    assert config["eos_token_id"] == json.loads(open(os.path.join(fixture("gemma3"), "config.json")).read())[
        "eos_token_id"]
    # The run's own directory may hold the output (it does not contain the source's files).
    convert(run, run / "hf", no_tokenizer=True)
    assert describe_source(run).kind == "run"


def test_run_to_hf_takes_the_tokenizer_from_the_runs_pretrained_path(tmp_path, capsys):
    """Without --base, a run started from an HF directory (`pretrained.path` in its config.yaml) converts with
    that directory's tokenizer and HF files; a pretrained.path without tokenizer files is refused, naming it."""
    origin = tmp_path / "origin"
    shutil.copytree(fixture("qwen2"), origin)
    run = tmp_path / "run"
    make_run(run, "qwen2")
    saved = configlib.load_config(Config, run / "config.yaml")
    (run / "config.yaml").write_text(configlib.dump_yaml(
        configlib.replace_path(saved, "pretrained.path", str(origin))))
    (run / RUN_MODEL_FILE).write_text(configlib.dump_yaml(saved.model))  # as a run from pretrained.path writes
    err = cli_error(capsys, run, tmp_path / "bare")
    assert f"its pretrained.path {origin}" in err and "holds no tokenizer files" in err and "--base" in err
    (origin / "tokenizer.json").write_text('{"model": "a tokenizer"}')
    (origin / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    assert cli.main(["convert", str(run), str(tmp_path / "hf")]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_text() == (origin / name).read_text(), name
    assert cli.main(["convert", str(run), str(tmp_path / "hf2"), "--no-tokenizer"]) == 0


# ----------------------------------------------------------------------------- CLI


def test_cli_convert_prints_a_summary(tmp_path, capsys):
    assert cli.main(["convert", fixture("llama3"), str(tmp_path / "policy")]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"wrote policy checkpoint (orbax) {tmp_path / 'policy'}: 44,784 parameters (float32)")
    assert "bytes" in out and len(out.splitlines()) == 1
    assert cli.main(["convert", str(tmp_path / "policy"), str(tmp_path / "hf"), "--dtype", "bfloat16",
                     "--max-shard-size", "40KB"]) == 0
    out = capsys.readouterr().out
    assert f"wrote Hugging Face checkpoint {tmp_path / 'hf'}: 44,784 parameters (bfloat16)" in out
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    # --overwrite replaces the destination (here: back to one float32 file).
    assert cli.main(["convert", str(tmp_path / "policy"), str(tmp_path / "hf"), "--overwrite"]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors")) == ["model.safetensors"]
    assert_same_tensors(tensors_of(fixture("llama3")), tensors_of(tmp_path / "hf"))
    # HF -> HF: a dtype change with the tokenizer files carried over.
    assert cli.main(["convert", fixture("qwen2"), str(tmp_path / "q16"), "--to", "hf", "--dtype", "float16"]) == 0
    assert (tmp_path / "q16" / "generation_config.json").exists()
    assert {t.dtype for t in tensors_of(tmp_path / "q16").values()} == {np.dtype("float16")}


def cli_error(capsys, *argv) -> str:
    assert cli.main(["convert", *map(str, argv)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("jaxrl: convert error: ") and len(err.splitlines()) == 1
    return err


def test_cli_errors_name_the_path(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert str(missing) in cli_error(capsys, missing, tmp_path / "out")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    err = cli_error(capsys, tmp_path / "junk", tmp_path / "out")
    assert str(tmp_path / "junk") in err and "expected a Hugging Face directory" in err

    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("x")
    err = cli_error(capsys, fixture("qwen2"), tmp_path / "dst")
    assert str(tmp_path / "dst") in err and "--overwrite" in err
    assert (tmp_path / "dst" / "keep.txt").read_text() == "x"

    err = cli_error(capsys, fixture("qwen2"), tmp_path / "out", "--max-shard-size", "5 parsecs")
    assert "'5 parsecs'" in err
    assert not (tmp_path / "out").exists()
    assert "not a Hugging Face directory" in cli_error(capsys, fixture("qwen2"), tmp_path / "o", "--to", "hf",
                                                       "--base", tmp_path / "junk")
    assert "contains (or is) the source" in cli_error(capsys, fixture("qwen2"), fixture("qwen2"), "--overwrite")


def test_incomplete_and_mismatched_checkpoints(tmp_path):
    convert(fixture("qwen3"), tmp_path / "policy")
    (tmp_path / "policy" / MODEL_FILE).unlink()  # as if the conversion had been interrupted
    with pytest.raises(CheckpointError, match="incomplete"):
        load_policy(tmp_path / "policy")

    run = tmp_path / "run"
    make_run(run, "qwen2")
    shutil.copytree(run / "checkpoints", tmp_path / "orphan")  # a step without its run's config.yaml
    with pytest.raises(CheckpointError, match=r"config\.yaml.*missing"):
        load_policy(tmp_path / "orphan" / "3")
    # A config.yaml that does not describe the stored parameters: every mismatch named.
    config = models.load_config(fixture("qwen2"))
    wrong = Config(model=models.ModelConfig(**{**config.__dict__, "intermediate_size": 48}))
    (run / "config.yaml").write_text(configlib.dump_yaml(wrong))
    with pytest.raises(CheckpointError, match=r"'layers\.0\.mlp\.up_proj\.weight\.value' has shape \[64, 32\]"):
        load_policy(run)
    (run / "config.yaml").write_text("model:\n  hidden_size: many\n")
    with pytest.raises(configlib.ConfigError, match="hidden_size"):
        load_policy(run)
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").mkdir()
    with pytest.raises(CheckpointError, match="no finished checkpoint"):
        load_policy(run)


def test_parse_size():
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5 kb") == 1500
    assert parse_size("123") == 123
    for bad in ("", "GB", "-5GB", "0", "5 GBs", "1e9"):
        with pytest.raises(ValueError, match="invalid size"):
            parse_size(bad)


def test_hostile_run_and_policy_files_stop_convert_with_one_line(tmp_path, capsys):
    """A run's config.yaml / model.yaml and a policy's model.json are read with the same limits as configs and
    HF files: an alias bomb, deep nesting, a FIFO (which was passed over, or hung) each stop `jaxrl convert`
    with one line naming the file."""
    run = tmp_path / "run"
    make_run(run, "qwen2")
    bomb = "model:\n  layer_types:\n  - &l0 [a, a, a, a, a, a, a, a, a]\n" + "".join(
        f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 7))
    for text, fragment in ((bomb, "config.yaml:7: this value has more than 20,000 nodes with its YAML aliases"),
                           ("model:\n  layer_types: " + "[" * 10_000 + "]" * 10_000 + "\n",
                            "config.yaml:2: invalid YAML: nested deeper than 32 levels")):
        (run / "config.yaml").write_text(text)
        assert fragment in cli_error(capsys, run, tmp_path / "out")
    os.mkfifo(run / RUN_MODEL_FILE)
    assert f"{run / RUN_MODEL_FILE}: not a regular file but a FIFO" in cli_error(capsys, run, tmp_path / "out")

    policy = tmp_path / "policy"
    convert(fixture("qwen2"), policy)
    (policy / MODEL_FILE).write_text('{"format": "jaxrl-policy/1", "model": ' + "[" * 1000 + "]" * 1000 + "}")
    assert "model.json: JSON nested 1001 levels deep" in cli_error(capsys, policy, tmp_path / "out")
    (policy / MODEL_FILE).unlink()
    os.mkfifo(policy / MODEL_FILE)
    assert f"{policy / MODEL_FILE}: not a regular file but a FIFO" in cli_error(capsys, policy, tmp_path / "out")
