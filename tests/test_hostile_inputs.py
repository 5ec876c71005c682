"""The corpus of hostile inputs: files an attacker (or a broken download) puts where jaxrl reads configs, prompt
rows and Hugging Face directories. Each case once hung, crashed with a traceback or was silently accepted; each
must now stop at once with one line naming the file (and the line or key). Add a case whenever a new hole is
found.

Hangs are bounded by `_deadline` (SIGALRM interrupts a blocked `open` of a FIFO and a runaway Python loop), so
the old code fails these tests instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import struct
import time

import pytest

from jaxrl import cli
from jaxrl.config import Config
from jaxrl.configlib import ConfigError, load_config
from jaxrl.data.prompts import DataError, load_prompts
from jaxrl.tokenizer import TokenizerError, load_tokenizer
from jaxrl.models import hf_config
from jaxrl.models.hf import CheckpointError, from_pretrained
from jaxrl.models.safetensors_io import SafetensorsError, read_header

FIXTURES = os.path.join(os.path.dirname(__file__), "data", "hf", "transformers4")


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise TimeoutError in the body after `seconds` (instead of hanging the test run)."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _refused_fast(error: type[Exception], *fragments: str, seconds: float = 1.0):
    """The body raises `error` within `seconds` (generous: the fixed code takes milliseconds), with a one-line
    message containing every fragment."""
    start = time.perf_counter()
    with _deadline(10.0), pytest.raises(error) as info:
        yield
    elapsed = time.perf_counter() - start
    message = str(info.value)
    assert elapsed < seconds, f"took {elapsed:.2f} s: {message}"
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def _one_line_exit_2(capsys, argv: list[str], *fragments: str) -> None:
    """`jaxrl <argv>` exits 2 within a second, printing one line that contains every fragment."""
    start = time.perf_counter()
    with _deadline(20.0):
        assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert time.perf_counter() - start < 5.0  # the CLI imports jax on the way: a loose bound
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"


def _hf_copy(tmp_path, name: str = "qwen2"):
    directory = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), directory)
    return directory


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# ----------------------------------------------------------------------------------------------- YAML configs


def _mapping_bomb(levels: int = 9) -> str:
    """The "billion laughs": each level a mapping of 9 aliases of the level before (9^9 ~ 4e8 leaves)."""
    lines = ["x0: &x0 {a: 1, b: 1, c: 1, d: 1, e: 1, f: 1, g: 1, h: 1, i: 1}"]
    lines += [f"x{i}: &x{i} {{" + ", ".join(f"{k}: *x{i - 1}" for k in "abcdefghi") + "}"
              for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def _list_bomb(levels: int = 6) -> str:
    """The same with lists, inside a real field (the rows of mesh.rules); 9^6 leaves, since the old code built
    the error message's repr of the whole tree in C (not interruptible, gigabytes at 9 levels)."""
    lines = ["mesh:", "  rules:", "  - &l0 [a, a, a, a, a, a, a, a, a]"]
    lines += [f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text, line", [(_mapping_bomb(), 5), (_list_bomb(), 7)], ids=["mappings", "lists"])
def test_alias_bomb_is_refused_in_under_a_second(tmp_path, capsys, text, line):
    """A ~700-byte YAML of nested anchors and aliases: the loader walked ~10^9 nodes (minutes, or forever)."""
    assert len(text) < 800 and "*" in text
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    with _refused_fast(ConfigError, f"{path}:{line}: this value has more than 20,000 nodes with its YAML aliases "
                                    "expanded (an alias bomb?)"):
        load_config(Config, path)
    _one_line_exit_2(capsys, ["train", str(path)], "configuration error", "alias bomb")


def test_alias_bomb_in_an_override_is_refused(capsys):
    inner = "[" + ", ".join(["x"] * 9) + "]"
    value = f"[&a0 {inner}" + "".join(f", &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 7)) + "]"
    with _refused_fast(ConfigError, "override 'mesh.rules=", "more than 20,000 nodes"):
        load_config(Config, "configs/default.yaml", [f"mesh.rules={value}"])


@pytest.mark.parametrize("text, fragment", [
    ("seed: " + "[" * 50_000 + "]" * 50_000 + "\n", ":1: invalid YAML: nested deeper than 32 levels"),
    ("data:\n  train_file: " + "{a: " * 50_000 + "1" + "}" * 50_000 + "\n", ":2: invalid YAML: nested deeper"),
    ("mesh:\n  rules: &r [*r]\n", ":2: invalid YAML: an alias refers to a value that contains it"),
    # shallow anchors, deep through their aliases: 40 levels of one alias each
    ("a0: &a0 [x]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 40)),
     "nested deeper than 32 levels with aliases expanded"),
], ids=["lists", "mappings", "recursive-alias", "deep-through-aliases"])
def test_deep_yaml_is_a_one_line_error(tmp_path, text, fragment):
    """Nesting exhausted Python's stack (RecursionError traceback); an alias of its own parent recursed forever."""
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    with _refused_fast(ConfigError, f"{path}", fragment):
        load_config(Config, path)


@pytest.mark.parametrize("override, fragment", [
    ("rl.optim.learning_rate=" + "9" * 400, "rl.optim.learning_rate: must be finite, got inf"),
    ("rl.optim.learning_rate=1e400", "rl.optim.learning_rate: must be finite, got inf"),
    ("model.hidden_size=" + "9" * 30, "model.hidden_size: must fit in 64 bits, got 999"),
], ids=["float-400-digits", "float-1e400", "int-30-digits"])
def test_numbers_beyond_float_or_64_bits_are_refused(override, fragment):
    """A 400-digit number for a float field crashed with OverflowError; an int beyond 64 bits was accepted."""
    with _refused_fast(ConfigError, fragment):
        load_config(Config, "configs/default.yaml", [override])


def test_infinite_learning_rate_is_refused(tmp_path):
    """`rl.optim.learning_rate=.inf` was accepted: the first update made every parameter non-finite."""
    with _refused_fast(ConfigError, "rl.optim.learning_rate: must be finite, got inf"):
        load_config(Config, "configs/default.yaml", ["rl.optim.learning_rate=.inf"])
    path = tmp_path / "lr.yaml"
    path.write_text("sft:\n  optim:\n    learning_rate: .inf\n")
    with _refused_fast(ConfigError, f"{path}:3: sft.optim.learning_rate: must be finite, got inf"):
        load_config(Config, path)


# ----------------------------------------------------------------------------------------------- prompt rows


GOOD_ROW = json.dumps({"question": "1+1?", "answer": "2"})


def test_deep_jsonl_row_names_file_and_line(tmp_path):
    """A row of 100,000 nested lists raised RecursionError, naming neither file nor line."""
    path = tmp_path / "deep.jsonl"
    path.write_text(GOOD_ROW + "\n" + '{"question": "q", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with _refused_fast(DataError, f"{path}:2: JSON nested 100001 levels deep, more than the limit of 64"):
        load_prompts(path)
    records, skipped = load_prompts(path, skip_bad_rows=True)
    assert (len(records), skipped) == (1, 1)


def test_5000_digit_integer_row_names_file_and_line(tmp_path):
    """Python's int-string limit raised a ValueError that named no file or line."""
    path = tmp_path / "big.jsonl"
    path.write_text(GOOD_ROW + "\n" + '{"question": "q", "answer": ' + "9" * 5000 + "}\n")
    with _refused_fast(DataError, f"{path}:2: invalid JSON (Exceeds the limit (4300 digits)"):
        load_prompts(path)


def test_400_digit_integer_reference_is_a_reference(tmp_path):
    """Below Python's digit limit, a huge integer reference crashed the finiteness check (OverflowError)."""
    path = tmp_path / "big.jsonl"
    path.write_text('{"question": "q", "answer": ' + "9" * 400 + "}\n")
    with _deadline(10.0):
        records, _ = load_prompts(path)
    assert records[0].reference == "9" * 400


def test_fifo_prompt_file_is_refused(tmp_path):
    path = tmp_path / "train.jsonl"
    os.mkfifo(path)
    with _refused_fast(DataError, f"{path}: not a regular file but a FIFO"):
        load_prompts(path)


# ----------------------------------------------------------------------------------------------- HF directories


def _plant(path, kind: str) -> socket.socket | None:
    """Replace the file at `path` by a `kind` of non-regular file (returns the socket to close, for one)."""
    os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "socket":  # bound by a relative name: a Unix socket path has at most 107 bytes
        sock = socket.socket(socket.AF_UNIX)
        cwd = os.getcwd()
        os.chdir(path.parent)
        try:
            sock.bind(path.name)
        finally:
            os.chdir(cwd)
        return sock
    else:  # a character device, through a symlink (as HF's cache links its files)
        os.symlink("/dev/zero", path)
    return None


KINDS = {"fifo": "a FIFO", "directory": "a directory", "device": "a character device", "socket": "a socket"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name, source", [
    ("config.json", "qwen2"), ("model.safetensors", "qwen2"), ("model.safetensors.index.json", "llama3"),
    ("model-00002-of-00004.safetensors", "llama3"),
])
def test_non_regular_hf_file_is_refused_in_under_a_second(tmp_path, kind, name, source):
    """A FIFO named model.safetensors (or config.json, the index, a shard) hung from_pretrained forever."""
    directory = _hf_copy(tmp_path, source)
    sock = _plant(directory / name, kind)
    with _refused_fast(CheckpointError, f"{directory / name}: not a regular file but {KINDS[kind]}"):
        from_pretrained(directory, progress=False)
    if sock is not None:
        sock.close()


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_fifo_stops_jaxrl_convert_with_one_line(tmp_path, capsys, name):
    directory = _hf_copy(tmp_path)
    _plant(directory / name, "fifo")
    _one_line_exit_2(capsys, ["convert", str(directory), str(tmp_path / "out")], "convert error",
                     f"{name}: not a regular file but a FIFO")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_fifo_tokenizer_file_is_refused(tmp_path, name):
    """A FIFO tokenizer.json read as 'no tokenizer here'; a FIFO tokenizer_config.json was skipped silently
    (other special tokens); now each is refused by name."""
    from tokenizers import Tokenizer, models as tokenizer_models

    directory = tmp_path / "tok"
    directory.mkdir()
    backend = Tokenizer(tokenizer_models.WordLevel({"a": 0, "</s>": 1}, unk_token="a"))
    (directory / "tokenizer.json").write_text(backend.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert load_tokenizer(directory).eos_id == 1
    _plant(directory / name, "fifo")
    with _refused_fast(TokenizerError, f"{directory / name}: not a regular file but a FIFO"):
        load_tokenizer(directory)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_deep_tokenizer_json_is_a_one_line_error(tmp_path, name):
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_text("{}")
    (directory / name).write_text("[" * 100_000 + "]" * 100_000)
    with _refused_fast(TokenizerError, f"{directory / name}: JSON nested 100000 levels deep"):
        load_tokenizer(directory)


def test_deep_config_json_is_a_one_line_error(tmp_path, capsys):
    directory = _hf_copy(tmp_path)
    (directory / "config.json").write_text('{"model_type": "qwen2", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with _refused_fast(CheckpointError, f"{directory / 'config.json'}: JSON nested 100001 levels deep"):
        from_pretrained(directory, progress=False)
    _one_line_exit_2(capsys, ["convert", str(directory), str(tmp_path / "out")], "JSON nested 100001 levels")


def _write_safetensors(path, header: bytes, data_bytes: int = 0) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + data_bytes)


def test_deep_safetensors_header_is_a_one_line_error(tmp_path):
    directory = _hf_copy(tmp_path)
    _write_safetensors(directory / "model.safetensors", b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    with _refused_fast(CheckpointError, "model.safetensors: the safetensors header: JSON nested 100001 levels"):
        from_pretrained(directory, progress=False)


def test_oversized_safetensors_header_is_refused_before_reading(tmp_path):
    """A header of more than safetensors' 100,000,000-byte limit is not read (a sparse file: no disk used)."""
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 104_000_000))
        f.truncate(8 + 104_000_000 + 64)
    with _refused_fast(SafetensorsError, f"{path}: not a safetensors file (header length 104000000",
                       "at most 100,000,000 bytes", seconds=0.5):
        read_header(path)


@pytest.mark.parametrize("metadata", [[1, 2], {"format": {"nested": "x"}}], ids=["list", "nested"])
def test_malformed_safetensors_metadata_is_refused(tmp_path, metadata):
    path = tmp_path / "meta.safetensors"
    _write_safetensors(path, json.dumps({"__metadata__": metadata}).encode())
    with _refused_fast(SafetensorsError, f"{path}: the safetensors header's __metadata__ must map strings"):
        read_header(path)


@pytest.mark.parametrize("changes, fragment", [
    ({"num_hidden_layers": "32"}, "num_hidden_layers must be an integer of at most 64 bits, got '32' (str)"),
    ({"num_hidden_layers": [2]}, "num_hidden_layers must be an integer of at most 64 bits, got [2] (list)"),
    ({"vocab_size": 96.5}, "vocab_size must be an integer of at most 64 bits, got 96.5 (float)"),
    ({"intermediate_size": 0}, "intermediate_size must be > 0, got 0"),
    ({"hidden_size": True}, "hidden_size must be an integer of at most 64 bits, got True (bool)"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a finite number, got '1e-6' (str)"),
    ({"rope_theta": math.inf}, "rope_theta must be a finite number, got inf (float)"),
    ({"rope_scaling": [1]}, "rope_scaling must be an object, got [1] (list)"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "rope_scaling.factor must be a finite number"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false' (str)"),
    ({"hidden_act": ["silu"]}, "hidden_act must be a string, got ['silu'] (list)"),
    ({"use_sliding_window": True, "sliding_window": "4"},
     "sliding_window must be an integer of at most 64 bits, got '4' (str)"),
    ({"use_sliding_window": True, "sliding_window": 4, "layer_types": [["sliding_attention"], "full_attention"]},
     "layer_types must list 2 of"),
    ({"model_type": ["qwen2"]}, "model_type must be a string, got ['qwen2'] (list)"),
    ({"rope_theta": 10**400}, "rope_theta must be a finite number, got 1000000000"),
    ({"num_hidden_layers": 10**6}, "num_hidden_layers must be at most 1024, got 1000000"),
    ({"vocab_size": 2**64}, "vocab_size must be an integer of at most 64 bits, got 18446744073709551616 (int)"),
], ids=lambda v: None if isinstance(v, str) else "-".join(map(str, v)))
def test_mistyped_config_json_names_the_key(tmp_path, changes, fragment):
    """Wrong types raised TypeError/AttributeError tracebacks deep in the model code, or were silently taken
    (`"tie_word_embeddings": "false"` read as true)."""
    directory = _hf_copy(tmp_path)
    _edit_json(directory / "config.json", **changes)
    with _refused_fast(CheckpointError, f"{directory / 'config.json'}: {fragment}"):
        from_pretrained(directory, progress=False)


def test_mistyped_config_json_stops_jaxrl_convert_with_one_line(tmp_path, capsys):
    directory = _hf_copy(tmp_path)
    _edit_json(directory / "config.json", num_hidden_layers="32")
    _one_line_exit_2(capsys, ["convert", str(directory), str(tmp_path / "out")], "convert error",
                     "config.json: num_hidden_layers must be an integer of at most 64 bits, got '32' (str)")


def test_config_json_that_is_not_an_object_is_named(tmp_path):
    directory = _hf_copy(tmp_path)
    (directory / "config.json").write_text("[1, 2]")
    with _refused_fast(CheckpointError, "config.json: expected a JSON object of settings, got list"):
        from_pretrained(directory, progress=False)
    with pytest.raises(hf_config.ConfigError, match="x.json: expected a JSON object, got 'qwen2' "):
        hf_config.from_hf("qwen2", "x.json")


@pytest.mark.parametrize("weight_map, fragment", [
    ([], "'weight_map' must be an object of tensor name -> file name, got list"),
    (None, "'weight_map' must be an object of tensor name -> file name, got NoneType"),
    ({"model.norm.weight": 1}, "weight_map['model.norm.weight'] must be a file name in the checkpoint directory"),
    ({"model.norm.weight": None}, "weight_map['model.norm.weight'] must be a file name"),
    ({"model.norm.weight": ["a"]}, "weight_map['model.norm.weight'] must be a file name"),
    ({"model.norm.weight": "../qwen2/model.safetensors"}, "weight_map['model.norm.weight'] must be a file name in "
                                                          "the checkpoint directory, got '../qwen2/model.safetensors'"),
], ids=["list", "null", "number", "null-file", "list-file", "outside"])
def test_mistyped_weight_index_names_the_key(tmp_path, weight_map, fragment):
    """`"weight_map": []` raised AttributeError, a number TypeError; a path read outside the checkpoint."""
    _hf_copy(tmp_path, "qwen2")
    directory = _hf_copy(tmp_path, "llama3")
    _edit_json(directory / "model.safetensors.index.json", weight_map=weight_map)
    with _refused_fast(CheckpointError, f"{directory / 'model.safetensors.index.json'}: {fragment}"):
        from_pretrained(directory, progress=False)
