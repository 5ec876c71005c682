"""LoRA exports (`models.lora_export`) of the tiny HF fixtures, with random nonzero adapters: the PEFT directory's
names, shapes, dtypes and config; its tensors recompose the merged export's weights (numpy); the merged export
reloads to the adapted policy's logits; a QLoRA int8 policy exports dequantized; clear errors. No torch here:
`tests/data/hf/check_peft_load.py` loads the same exports in transformers + PEFT."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import FIXTURES, tensors_of
from jaxrl import models
from jaxrl.models import lora, lora_export, safetensors_io
from jaxrl.models.safetensors_io import read_header

RANK, ALPHA = 4, 8.0
SPEC = lora.LoraSpec(RANK, ALPHA)
NAMES = ["llama3", "qwen2"]
PROJ = {"self_attn": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]}


forward = jax.jit(models.forward)


def fixture(name):
    return os.path.join(FIXTURES, "transformers5", name)


def randomized(policy, seed=1):
    """Every adapter drawn anew (B is zero after `add_adapters`, which would make every comparison vacuous)."""
    leaves, treedef = jax.tree.flatten(policy.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return policy.replace(params=jax.tree.unflatten(treedef, [
        0.05 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]))


@pytest.fixture(scope="module")
def bases():
    return {name: models.from_pretrained(fixture(name), dtype="float32", progress=False) for name in NAMES}


@pytest.fixture(scope="module")
def exported(bases, tmp_path_factory):
    """`{name: (adapted policy, PEFT dir, merged dir)}`, rank 4 on every projection."""
    out = {}
    for name in NAMES:
        policy = randomized(lora.add_adapters(bases[name], SPEC, seed=0))
        root = tmp_path_factory.mktemp(name)
        lora_export.save_peft(policy, SPEC, root / "adapter", base_model_name_or_path=fixture(name))
        lora_export.save_merged(policy, SPEC, root / "hf", base=fixture(name))
        out[name] = (policy, str(root / "adapter"), str(root / "hf"))
    return out


def _sizes(config, kind, proj):
    """(in, out) of a projection, from the HF config."""
    hidden, heads, kv, head_dim, mlp = (config["hidden_size"], config["num_attention_heads"],
                                        config["num_key_value_heads"], config.get("head_dim"),
                                        config["intermediate_size"])
    head_dim = head_dim or hidden // heads
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim), "v_proj": (hidden, kv * head_dim),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, mlp), "up_proj": (hidden, mlp),
            "down_proj": (mlp, hidden)}[proj]


@pytest.mark.parametrize("name", NAMES)
def test_peft_directory_names_shapes_dtypes_and_config(exported, name):
    _, adapter, _ = exported[name]
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    with open(os.path.join(fixture(name), "config.json")) as f:
        hf = json.load(f)
    want = {}
    for i in range(hf["num_hidden_layers"]):
        for kind, projs in PROJ.items():
            for proj in projs:
                fan_in, fan_out = _sizes(hf, kind, proj)
                prefix = f"base_model.model.model.layers.{i}.{kind}.{proj}"
                want[f"{prefix}.lora_A.weight"] = (RANK, fan_in)
                want[f"{prefix}.lora_B.weight"] = (fan_out, RANK)
    header = read_header(os.path.join(adapter, "adapter_model.safetensors"))[0]
    assert {k: v.shape for k, v in header.items()} == want
    assert {str(v.dtype) for v in header.values()} == {"float32"}
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias", "use_rslora",
                                   "fan_in_fan_out", "inference_mode", "base_model_name_or_path")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none",
        "use_rslora": False, "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": fixture(name)}
    assert config["target_modules"] == list(lora.PROJECTIONS)


@pytest.mark.parametrize("name", NAMES)
def test_peft_tensors_recompose_the_merged_weights(exported, name):
    """W + (alpha / r) B_peft A_peft, in numpy from the two files, is the merged export; the rest is the base."""
    _, adapter, merged = exported[name]
    peft = tensors_of(adapter)
    merged_tensors, base = tensors_of(merged), tensors_of(fixture(name))
    assert set(merged_tensors) == set(base)
    adapted = 0
    for key, weight in base.items():
        a = peft.get(f"base_model.model.{key.removesuffix('.weight')}.lora_A.weight")
        if a is None:
            np.testing.assert_array_equal(merged_tensors[key], weight)
            continue
        b = peft[f"base_model.model.{key.removesuffix('.weight')}.lora_B.weight"]
        want = weight.astype(np.float64) + ALPHA / RANK * b.astype(np.float64) @ a.astype(np.float64)
        np.testing.assert_allclose(merged_tensors[key], want, rtol=0, atol=1e-5)
        assert np.abs(want - weight).max() > 1e-2  # the adapters matter
        adapted += 1
    assert adapted == 7 * models.load_config(fixture(name)).num_layers


def test_merged_export_reloads_to_the_adapted_logits(exported):
    """On Qwen2 (tied head, q/k/v biases); Llama's merged weights are checked above, its logits in PEFT's check."""
    name = "qwen2"
    policy, _, merged = exported[name]
    expected = np.load(os.path.join(fixture(name), "expected.npz"))
    tokens, valid = jnp.asarray(expected["tokens"], jnp.int32), jnp.asarray(expected["attention_mask"], bool)
    want = np.asarray(forward(policy, tokens, valid))[np.asarray(valid)]
    got = np.asarray(forward(models.from_pretrained(merged, progress=False), tokens, valid))[np.asarray(valid)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    base = np.asarray(forward(lora.adapters_off(policy), tokens, valid))[np.asarray(valid)]
    assert np.abs(base - want).max() > 1.0  # the adapters matter
    for file in ("generation_config.json",):  # the base's other files come along
        assert os.path.isfile(os.path.join(merged, file))


def test_adapters_on_some_layers_list_the_exact_modules(bases, tmp_path):
    spec = lora.LoraSpec(RANK, ALPHA, ("layers/0/self_attn/(q|v)_proj", "layers/1/mlp/down_proj"))
    policy = randomized(lora.add_adapters(bases["qwen2"], spec, seed=0))
    lora_export.save_peft(policy, spec, tmp_path / "adapter")
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        config = json.load(f)
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]
    assert config["target_modules"] == modules and config["base_model_name_or_path"] is None
    header = read_header(str(tmp_path / "adapter" / "adapter_model.safetensors"))[0]
    assert sorted(header) == sorted(f"base_model.model.{m}.lora_{x}.weight" for m in modules for x in "AB")
    # the same projections on every layer: their names
    spec = lora.LoraSpec(RANK, ALPHA, ("v_proj", "q_proj"))
    assert lora_export.target_modules(lora.add_adapters(bases["qwen2"], spec, seed=0), spec) == ["q_proj", "v_proj"]


def test_qlora_int8_exports_merged_and_dequantized(bases, tmp_path):
    spec = lora.LoraSpec(RANK, ALPHA, quantize="int8")
    policy = randomized(lora.add_adapters(bases["qwen2"], spec, seed=0))
    lora_export.save_merged(policy, spec, tmp_path / "hf", base=fixture("qwen2"))
    merged = tensors_of(tmp_path / "hf")
    adapters = lora.adapter_weights(policy)
    frozen = {tuple(map(str, k)): v[...] for k, v in nnx.to_flat_state(policy.frozen)}
    checked = 0
    for path, (a, b) in adapters.items():
        parts = tuple(path.split("/"))
        qvalue = np.asarray(frozen[parts + ("weight", "array", "qvalue")])
        scale = np.asarray(frozen[parts + ("weight", "array", "scale")])
        assert qvalue.dtype == np.int8
        want = qvalue.astype(np.float64) * scale + ALPHA / RANK * (np.asarray(a, np.float64) @ np.asarray(b)).T
        got = merged["model." + path.replace("/", ".") + ".weight"]
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        checked += 1
    assert checked == 14
    reloaded = models.from_pretrained(tmp_path / "hf", progress=False)
    assert reloaded.config == bases["qwen2"].config


def test_bad_input_gets_a_clear_error(bases, exported, tmp_path):
    with pytest.raises(ValueError, match="no LoRA adapters.*add_adapters"):
        lora_export.save_peft(bases["qwen2"], SPEC, tmp_path / "a")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        lora_export.save_merged(bases["qwen2"], SPEC, tmp_path / "b")
    policy = exported["qwen2"][0]
    with pytest.raises(ValueError, match="rank 4 .*spec.rank is 8"):
        lora_export.save_peft(policy, lora.LoraSpec(8, ALPHA), tmp_path / "c")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        lora_export.save_peft(policy, SPEC, tmp_path / "file")
    assert sorted(os.listdir(tmp_path)) == ["file"]  # nothing half-written


def test_an_export_replaces_a_directory_only_when_complete(exported, tmp_path, monkeypatch):
    policy = exported["qwen2"][0]
    target = tmp_path / "adapter"
    target.mkdir()
    (target / "stale.txt").write_text("old")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors_io, "write_file", broken)
    monkeypatch.setattr(lora_export, "write_file", broken)
    with pytest.raises(OSError, match="disk full"):
        lora_export.save_peft(policy, SPEC, target)
    assert sorted(os.listdir(tmp_path)) == ["adapter"] and os.listdir(target) == ["stale.txt"]
    monkeypatch.undo()
    lora_export.save_peft(policy, SPEC, target)
    assert sorted(os.listdir(tmp_path)) == ["adapter"]
    assert sorted(os.listdir(target)) == ["adapter_config.json", "adapter_model.safetensors"]
