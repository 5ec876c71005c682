"""Hugging Face checkpoints: configs of transformers 4.x and 5.x, logits and greedy tokens equal to
transformers' own (fixtures made by `tests/data/hf/make_fixtures.py`; no torch here), bit-exact round
trips, sharded files, placement on a mesh and clear errors for bad checkpoints."""

import dataclasses
import json
import os
import struct
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import models
from hf_fixtures import FIXTURES, tensors_of
from jaxrl.sampling import SamplingConfig, sample
from jaxrl.models import CheckpointError, hf_config
from jaxrl.models.configs import RopeScaling
from jaxrl.models.safetensors_io import SafetensorsError, TensorSpec, read_header, read_tensor, write_file

NAMES = ["llama3", "qwen2", "qwen3", "gemma3", "llama3_bf16"]
VERSIONS = ["transformers4", "transformers5"]


def fixture(version: str, name: str) -> str:
    return os.path.join(FIXTURES, version, name)


@pytest.fixture(scope="module")
def loaded():
    """Every fixture loaded once in float32: `{(version, name): policy}`."""
    return {(v, n): models.from_pretrained(fixture(v, n), dtype="float32", progress=False)
            for v in VERSIONS for n in NAMES}


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize("name", NAMES)
def test_transformers_4_and_5_configs_mean_the_same_model(name):
    configs = [models.load_config(fixture(v, name)) for v in VERSIONS]
    assert configs[0] == configs[1]


def test_family_features_read_from_config():
    llama = models.load_config(fixture("transformers5", "llama3"))
    assert llama.family == "llama" and not llama.tie_embeddings and llama.rope_scaling == models.RopeScaling(
        "llama3", 8.0, 1.0, 4.0, 32)
    qwen2 = models.load_config(fixture("transformers5", "qwen2"))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.tie_embeddings and not qwen2.sliding_window
    qwen3 = models.load_config(fixture("transformers5", "qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 16 and qwen3.hidden_size == 48 and not qwen3.tie_embeddings
    gemma = models.load_config(fixture("transformers4", "gemma3"))
    assert (gemma.sliding_window, gemma.layer_types) == (8, ("sliding", "sliding", "sliding", "full"))
    assert (gemma.local_rope_theta, gemma.rope_theta, gemma.rope_scaling.type) == (1e4, 1e6, "linear")
    assert gemma.norm_offset == 1.0 and gemma.post_norms and gemma.scale_embeddings
    assert gemma.query_scale == 24 ** -0.5 and gemma.final_logit_softcap == 30.0
    assert models.load_config(fixture("transformers5", "llama3_bf16")).param_dtype == "bfloat16"


def _raw(name="llama3", version="transformers5"):
    with open(os.path.join(fixture(version, name), "config.json")) as f:
        return json.load(f)


def test_config_variants_and_unknown_keys():
    raw = {**_raw(), "some_future_key": {"x": 1}, "use_cache": False}
    assert hf_config.from_hf(raw) == models.load_config(fixture("transformers5", "llama3"))
    # An older Gemma 3 file: sliding_window_pattern instead of layer_types.
    old = {k: v for k, v in _raw("gemma3", "transformers4").items() if k not in ("layer_types",)}
    old["sliding_window_pattern"] = 2
    assert hf_config.from_hf(old).layer_types == ("sliding", "full", "sliding", "full")
    # Qwen2 files carry sliding_window even when use_sliding_window is false.
    qwen = {**_raw("qwen2"), "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 1}
    assert hf_config.from_hf(qwen).sliding_window is None
    qwen["use_sliding_window"] = True
    qwen.pop("layer_types", None)
    swa = hf_config.from_hf(qwen)
    assert swa.sliding_window == 4096 and swa.layer_types[0] == "full" and set(swa.layer_types[1:]) == {"sliding"}
    assert hf_config.from_hf({**_raw(), "torch_dtype": "bfloat16", "dtype": None}).param_dtype == "bfloat16"


def test_missing_keys_take_transformers_defaults():
    # A hand-written Gemma 3 config.json without the attention keys: transformers' Gemma3TextConfig defaults
    # (query_pre_attn_scalar 256, sliding window 4096 on 5 of every 6 layers, 4 KV heads, head_dim 256).
    keep = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size")
    bare = {k: v for k, v in _raw("gemma3", "transformers4").items() if k in keep}
    gemma = hf_config.from_hf({**bare, "num_hidden_layers": 6, "num_attention_heads": 8})
    assert (gemma.query_scale, gemma.num_kv_heads, gemma.head_dim) == (256 ** -0.5, 4, 256)
    assert (gemma.sliding_window, gemma.layer_types) == (4096, ("sliding",) * 5 + ("full",))
    assert (gemma.rope_theta, gemma.local_rope_theta) == (1e6, 1e4)
    qwen3 = {k: v for k, v in _raw("qwen3").items() if k != "head_dim"}
    assert hf_config.from_hf(qwen3).head_dim == 128
    # rope_parameters without its own rope_theta: the top-level one, as transformers 5 reads it
    raw = {**_raw("qwen2"), "rope_theta": 1e6, "rope_parameters": {"rope_type": "default"}}
    assert hf_config.from_hf(raw).rope_theta == 1e6
    # Qwen2 / Qwen3 with use_sliding_window: a 4096-token window from layer 28 on (Qwen2Config's defaults)
    for name in ("qwen2", "qwen3"):
        raw = {k: v for k, v in _raw(name).items() if k not in ("sliding_window", "max_window_layers",
                                                                "layer_types")}
        swa = hf_config.from_hf({**raw, "use_sliding_window": True, "num_hidden_layers": 32})
        assert (swa.sliding_window, swa.layer_types) == (4096, ("full",) * 28 + ("sliding",) * 4)


def test_rope_scaling_overrides_rope_parameters():
    """transformers 4.x reads only `rope_scaling` and 5.x lets it override `rope_parameters`: so does jaxrl."""
    raw = {**_raw("qwen2"), "rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
           "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    config = hf_config.from_hf(raw)
    assert (config.rope_theta, config.rope_scaling) == (1e6, RopeScaling("linear", 4.0))
    with pytest.raises(hf_config.ConfigError, match="rope_scaling type 'yarn' is not supported"):
        hf_config.from_hf({**raw, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    gemma = _raw("gemma3")
    assert hf_config.from_hf({**gemma, "rope_scaling": {"rope_type": "linear", "factor": 3.0}}).rope_scaling == \
        RopeScaling("linear", 3.0)
    local = {**gemma["rope_parameters"]["sliding_attention"], "rope_type": "linear", "factor": 8.0}
    with pytest.raises(hf_config.ConfigError, match="sliding_attention type 'linear' is not supported"):
        hf_config.from_hf({**gemma, "rope_parameters": {**gemma["rope_parameters"], "sliding_attention": local}})


@pytest.mark.parametrize("change, match", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"model_type": "gemma3"}, "multimodal Gemma 3"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_parameters type 'yarn'"),
    ({"rope_scaling": {"rope_type": "linear"}}, "missing key 'rope_scaling.factor'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ({"hidden_size": None}, "missing key 'hidden_size'"),
    ({"hidden_size": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": None},
     "the model's head_dim must be > 0, got 0"),  # derived: hidden_size // num_attention_heads
])
def test_unsupported_configs_are_named(change, match):
    with pytest.raises(hf_config.ConfigError, match=match) as info:
        hf_config.from_hf({**_raw(), **change}, "some/dir/config.json")
    assert "some/dir/config.json" in str(info.value)


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(loaded, version, name):
    expected = np.load(os.path.join(fixture(version, name), "expected.npz"))
    valid = expected["attention_mask"].astype(bool)
    policy = loaded[version, name]
    logits = models.forward(policy, jnp.asarray(expected["tokens"], jnp.int32), jnp.asarray(valid))
    np.testing.assert_array_equal(models.positions_from_mask(jnp.asarray(valid))[valid],
                                  expected["position_ids"][valid])
    assert logits.dtype == jnp.float32 and logits.shape == expected["logits"].shape
    assert np.abs(np.asarray(logits) - expected["logits"])[valid].max() <= 1e-4
    if name == "gemma3":  # the fixture is longer than the sliding window, so the window is exercised
        assert expected["tokens"].shape[1] > 4 * policy.config.sliding_window


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_gemma3_scales_embeddings_in_the_compute_dtype(param_dtype):
    """sqrt(hidden_size) is rounded to the compute dtype and multiplies the embeddings in it, as in transformers'
    bfloat16 model: float32 master weights computing in bfloat16 embed as a bfloat16 checkpoint does."""
    # transformers 5.24.0 computed these: AutoModelForCausalLM.from_pretrained(transformers5/gemma3,
    # dtype=torch.bfloat16).model.embed_tokens(tokens), stored as float32.
    expected = np.load(os.path.join(FIXTURES, "gemma3_bf16_embeddings.npz"))
    policy = models.from_pretrained(fixture("transformers5", "gemma3"), param_dtype, compute_dtype="bfloat16",
                                    progress=False)
    model = nnx.merge(policy.graphdef, policy.params)
    embedded = model.embed_tokens(jnp.asarray(expected["tokens"])[None])[0]
    assert embedded.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(embedded, np.float32), expected["embeddings"])


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_matches_transformers(loaded, name):
    expected = np.load(os.path.join(fixture("transformers5", name), "expected.npz"))
    prompt = jnp.asarray(expected["prompt"], jnp.int32)
    new = expected["generated"].shape[1] - prompt.shape[1]
    assert new >= 32
    rollout = sample(loaded["transformers5", name], prompt, jnp.ones(prompt.shape, bool), jax.random.key(0),
                     SamplingConfig(max_new_tokens=new, temperature=0.0), eos_id=-1, pad_id=0)
    np.testing.assert_array_equal(np.asarray(rollout.tokens), expected["generated"])


# ----------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_round_trips_bit_exactly(tmp_path, name):
    source = fixture("transformers5", name)
    policy = models.from_pretrained(source, progress=False)  # the checkpoint's own dtype
    models.save_pretrained(policy, tmp_path, progress=False)
    original, saved = tensors_of(source), tensors_of(str(tmp_path))
    assert sorted(original) == sorted(saved)
    for key in original:
        assert original[key].dtype == saved[key].dtype
        np.testing.assert_array_equal(original[key].view(np.uint8), saved[key].view(np.uint8), err_msg=key)
    assert models.load_config(tmp_path) == models.load_config(source)


def test_sharded_save_with_base_files(tmp_path):
    source = fixture("transformers5", "qwen3")
    policy = models.from_pretrained(source, dtype="float32", progress=False)
    models.save_pretrained(policy, tmp_path, base=source, max_shard_bytes=40_000, progress=False)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and all((tmp_path / f).exists() for f in files)
    assert (tmp_path / "generation_config.json").read_text() == open(
        os.path.join(source, "generation_config.json")).read()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["bos_token_id"] == 1 and config["architectures"] == ["Qwen3ForCausalLM"]
    reloaded = models.from_pretrained(tmp_path, progress=False)
    for a, b in zip(jax.tree.leaves(reloaded.params), jax.tree.leaves(policy.params)):
        np.testing.assert_array_equal(a, b)
    # Saving again unsharded replaces the shards instead of leaving them beside the new file.
    models.save_pretrained(policy, tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_a_single_file_beside_an_index_is_what_loads_as_in_transformers(tmp_path):
    source = fixture("transformers5", "qwen3")
    policy = models.from_pretrained(source, dtype="float32", progress=False)
    models.save_pretrained(policy, tmp_path, max_shard_bytes=40_000, progress=False)  # shards + index
    other = tensors_of(source)  # and a single file of other weights beside them
    other["model.norm.weight"] = other["model.norm.weight"] + 1
    write_file(tmp_path / "model.safetensors", [TensorSpec(k, v.dtype, v.shape) for k, v in other.items()],
               other.values())
    loaded = models.from_pretrained(tmp_path, dtype="float32", progress=False)
    np.testing.assert_array_equal(loaded.params["norm"]["weight"][...], other["model.norm.weight"])


def test_bfloat16_storage_of_float32_params(tmp_path):
    policy = models.from_pretrained(fixture("transformers5", "llama3_bf16"), dtype="float32", progress=False)
    assert {x.dtype for x in jax.tree.leaves(policy.params)} == {jnp.dtype("float32")}
    models.save_pretrained(policy, tmp_path, dtype="bfloat16", progress=False)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    original = tensors_of(fixture("transformers5", "llama3_bf16"))
    for key, value in tensors_of(str(tmp_path)).items():
        np.testing.assert_array_equal(value.view(np.uint16), original[key].view(np.uint16))


_NATIVE = models.ModelConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=8, intermediate_size=64)


def test_native_model_saves_as_its_family(tmp_path):
    config = models.ModelConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                head_dim=8, intermediate_size=64, qk_norm=True, family="qwen3")
    policy = models.init(config, 0)
    models.save_pretrained(policy, tmp_path, progress=False)
    reloaded = models.from_pretrained(tmp_path, progress=False)
    tokens = jnp.arange(10)[None] % 40
    np.testing.assert_array_equal(models.forward(reloaded, tokens), models.forward(policy, tokens))
    with pytest.raises(hf_config.ConfigError, match=r"as a transformers llama config.json: .*qk_norm \(True, not"):
        models.save_pretrained(models.init(dataclasses.replace(config, family="llama"), 0), tmp_path / "bad",
                               progress=False)


@pytest.mark.parametrize("family, change, named", [
    ("llama", dict(sliding_window=4, layer_types=("sliding", "full")), "layer types"),
    ("llama", dict(query_pre_attn_scalar=2.0), "query scale"),
    ("qwen3", dict(qk_norm=True, final_logit_softcap=1.0), "final_logit_softcap"),
    ("gemma3", {**hf_config.TRAITS["gemma3"], "attn_logit_softcap": 1.0}, "attn_logit_softcap"),
    ("gemma3", {**hf_config.TRAITS["gemma3"], "rope_scaling": RopeScaling("linear", 2.0),
                "sliding_window": 4, "layer_types": ("sliding", "full")}, "RoPE frequencies"),
])
def test_what_config_json_cannot_express_is_refused(tmp_path, family, change, named):
    """A native model whose config.json would load as a different model stops before anything is written."""
    config = dataclasses.replace(_NATIVE, family=family, **change)
    with pytest.raises(hf_config.ConfigError, match=f"cannot be written as a transformers .*{named}"):
        models.save_pretrained(models.init(config, 0), tmp_path, progress=False)
    assert not any(tmp_path.iterdir())


def test_native_gemma3_writes_its_defaults_as_numbers(tmp_path):
    """`None` (the full layers' RoPE base, head_dim as the query scalar) is written as the number it means:
    transformers 4.57 raises on a null there."""
    config = dataclasses.replace(_NATIVE, family="gemma3", **hf_config.TRAITS["gemma3"], rope_theta=5e4,
                                 sliding_window=4, layer_types=("sliding", "full"))
    policy = models.init(config, 0)
    models.save_pretrained(policy, tmp_path, progress=False)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert (raw["rope_local_base_freq"], raw["query_pre_attn_scalar"]) == (5e4, 8)
    tokens = jnp.arange(10)[None] % 40
    np.testing.assert_array_equal(models.forward(models.from_pretrained(tmp_path, progress=False), tokens),
                                  models.forward(policy, tokens))


def test_loads_onto_a_mesh_with_shardings():
    """8 host devices: replicated by default, or split by a sharding function, with the same values."""
    script = textwrap.dedent(f"""
        import jax, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from jaxrl import models
        mesh = Mesh(np.asarray(jax.devices()).reshape(8), ("fsdp",))
        source = {fixture("transformers5", "qwen2")!r}
        plain = models.from_pretrained(source, progress=False)
        replicated = models.from_pretrained(source, mesh=mesh, progress=False)
        split = lambda path, shape: NamedSharding(mesh, P("fsdp") if shape[0] % 8 == 0 else P())
        sharded = models.from_pretrained(source, shardings=split, progress=False)
        embed = sharded.params["embed_tokens"]["weight"][...]
        assert embed.sharding.spec == P("fsdp"), embed.sharding
        assert replicated.params["norm"]["weight"][...].sharding.spec == P()
        for a, b, c in zip(*(jax.tree.leaves(p.params) for p in (plain, replicated, sharded))):
            np.testing.assert_array_equal(a, b); np.testing.assert_array_equal(a, c)
        tokens = np.arange(16).reshape(8, 2) % 100
        np.testing.assert_allclose(models.forward(sharded, tokens), models.forward(plain, tokens), atol=1e-5)
        print("ok")
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# ----------------------------------------------------------------------------- bad checkpoints


@pytest.fixture
def qwen_copy(tmp_path):
    directory = tmp_path / "qwen2"
    shutil.copytree(fixture("transformers5", "qwen2"), directory)
    return directory


def _rewrite(path, drop=(), reshape=None):
    """Rewrite a safetensors file without the `drop` tensors and with `reshape = (name, new_array)`."""
    infos = read_header(path)[0]
    arrays = {n: read_tensor(i) for n, i in infos.items() if n not in drop}
    if reshape:
        arrays[reshape[0]] = reshape[1]
    specs = [TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items()]
    write_file(path, specs, arrays.values(), {"format": "pt"})


def test_missing_directory_and_files(tmp_path, qwen_copy):
    with pytest.raises(CheckpointError, match="not a directory"):
        models.from_pretrained(tmp_path / "nope", progress=False)
    (qwen_copy / "config.json").rename(qwen_copy / "config.bak")
    with pytest.raises(CheckpointError, match=r"qwen2/config.json: missing"):
        models.from_pretrained(qwen_copy, progress=False)
    (qwen_copy / "config.bak").rename(qwen_copy / "config.json")
    (qwen_copy / "model.safetensors").rename(qwen_copy / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no \*.safetensors weights \(found pytorch_model.bin"):
        models.from_pretrained(qwen_copy, progress=False)


def test_missing_shard_and_bad_index(tmp_path):
    directory = tmp_path / "llama3"
    shutil.copytree(fixture("transformers5", "llama3"), directory)
    (directory / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00004.safetensors: missing \(listed in"):
        models.from_pretrained(directory, progress=False)


def test_invalid_config_json_names_line(qwen_copy):
    (qwen_copy / "config.json").write_text('{\n  "model_type": "qwen2",\n  "hidden_size": ,\n}')
    with pytest.raises(CheckpointError, match=r"config.json:3: invalid JSON"):
        models.from_pretrained(qwen_copy, progress=False)


def test_unsupported_architecture_names_file(qwen_copy):
    raw = json.loads((qwen_copy / "config.json").read_text())
    (qwen_copy / "config.json").write_text(json.dumps({**raw, "model_type": "phi3"}))
    with pytest.raises(CheckpointError, match=r"qwen2/config.json: model_type 'phi3' is not supported"):
        models.from_pretrained(qwen_copy, progress=False)


def test_missing_tensor_is_named(qwen_copy):
    _rewrite(qwen_copy / "model.safetensors", drop=["model.layers.1.self_attn.k_proj.bias"])
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.self_attn.k_proj.bias'") as info:
        models.from_pretrained(qwen_copy, progress=False)
    assert "model.safetensors" in str(info.value)


def test_wrong_shape_is_named(qwen_copy):
    _rewrite(qwen_copy / "model.safetensors", reshape=("model.layers.0.mlp.up_proj.weight",
                                                       np.zeros((3, 5), np.float32)))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' "
                                              r"has shape \[3, 5\]"):
        models.from_pretrained(qwen_copy, progress=False)


def test_unexpected_tensor_and_truncated_file(qwen_copy):
    _rewrite(qwen_copy / "model.safetensors", reshape=("model.layers.0.extra.weight", np.zeros(4, np.float32)))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.extra.weight' in model.safetensors"):
        models.from_pretrained(qwen_copy, progress=False)
    shutil.copy(fixture("transformers5", "qwen2") + "/model.safetensors", qwen_copy / "model.safetensors")
    size = os.path.getsize(qwen_copy / "model.safetensors")
    with open(qwen_copy / "model.safetensors", "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor '.*': data offsets .* \(truncated file\?\)"):
        models.from_pretrained(qwen_copy, progress=False)


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]},
    {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]},
])
def test_malformed_header_entries_are_named(tmp_path, entry):
    header = json.dumps({"w": entry}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(SafetensorsError, match=r"bad.safetensors: tensor 'w': shape and data offsets must be "):
        read_header(path)


def test_tied_checkpoint_with_stored_head_loads(qwen_copy):
    """Some exports of tied models also store lm_head.weight: it is not used (and not an error)."""
    embed = read_tensor(read_header(qwen_copy / "model.safetensors")[0]["model.embed_tokens.weight"])
    _rewrite(qwen_copy / "model.safetensors", reshape=("lm_head.weight", embed))
    policy = models.from_pretrained(qwen_copy, progress=False)
    assert "lm_head" not in policy.params


def test_tied_checkpoint_with_a_different_stored_head_is_refused(qwen_copy):
    """tie_word_embeddings=true beside a stored lm_head.weight that is not the embedding: transformers 5.24.0
    then leaves the model untied and uses the stored head (checked: its logits differ from the tied model's by
    more than 10), so ignoring the head would silently give other logits. Refused, naming the file and key."""
    embed = read_tensor(read_header(qwen_copy / "model.safetensors")[0]["model.embed_tokens.weight"])
    head = embed.copy()
    head[5, 3] += 1.0
    _rewrite(qwen_copy / "model.safetensors", reshape=("lm_head.weight", head))
    with pytest.raises(CheckpointError, match=r"qwen2/model.safetensors: tensor 'lm_head.weight' differs from "
                                              r"'model.embed_tokens.weight'.*tie_word_embeddings"):
        models.from_pretrained(qwen_copy, progress=False)
    _rewrite(qwen_copy / "model.safetensors", reshape=("lm_head.weight", head[:-1]))  # another shape
    with pytest.raises(CheckpointError, match=r"tensor 'lm_head.weight' differs"):
        models.from_pretrained(qwen_copy, progress=False)


def test_json_depth_matches_the_parsed_structure():
    """`models.safe_read.json_depth` counts brackets outside strings (no parse, no recursion); the reference is
    the depth of what `json.loads` builds, on random documents whose strings are full of brackets, quotes and
    escapes."""
    import json
    import random

    from jaxrl.models.safe_read import json_depth

    def depth(value):
        if isinstance(value, (list, dict)):
            children = value.values() if isinstance(value, dict) else value
            return 1 + max((depth(v) for v in children), default=0)
        return 0

    rng = random.Random(0)
    pieces = ['[', ']', '{', '}', '"', '\\', '\\"', 'a', ' ', '\n', 'é', '\\u005b']

    def build(level):
        kind = rng.random()
        if level > 12 or kind < 0.3:
            return rng.choice([1, -2.5, None, True, "".join(rng.choices(pieces, k=rng.randint(0, 8)))])
        if kind < 0.65:
            return [build(level + 1) for _ in range(rng.randint(0, 3))]
        return {"".join(rng.choices(pieces, k=rng.randint(0, 5))): build(level + 1) for _ in range(rng.randint(0, 3))}

    for _ in range(300):
        doc = build(0)
        for text in (json.dumps(doc), json.dumps(doc, indent=1, ensure_ascii=False)):
            assert json_depth(text) == depth(json.loads(text)), text


def test_symlinked_files_still_load(tmp_path):
    """HF's cache keeps each file as a symlink into blobs/: the regular-file check follows symlinks (only what
    they point to must be a regular file)."""
    source = fixture("transformers4", "llama3")
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for n, name in enumerate(sorted(os.listdir(source))):
        shutil.copyfile(os.path.join(source, name), blobs / f"blob{n}")
        os.symlink(os.path.join("..", "..", "blobs", f"blob{n}"), snapshot / name)
    loaded = models.from_pretrained(snapshot, progress=False)
    reference = models.from_pretrained(source, progress=False)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(reference.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_json_depth_is_linear_on_unterminated_strings():
    """A string pattern that can fail after its opening quote is retried from every later quote: 80 kB of
    '\\"' took 34 s. Unterminated strings now run to the end of the text."""
    import time

    from jaxrl.models.safe_read import json_depth

    for text in ('"' + '\\"' * 500_000, '["\\' * 300_000, '"a' * 500_000 + "\\"):
        start = time.perf_counter()
        json_depth(text)
        assert time.perf_counter() - start < 1.0
    assert json_depth('[[1, "]]]\\"[[["], ["') == 2
