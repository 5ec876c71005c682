"""models.configs.PRESETS of released checkpoints: each preset is exactly what `models.hf_config.from_hf` makes of
that checkpoint's config.json (so a plan with random weights has the shapes a real load gets), and its parameter
count is the published one.

The config.json dicts are the released files' architecture keys (token ids, `use_cache`, `transformers_version`
and the like left out: `from_hf` ignores them), from the Hugging Face repositories named on each."""

import dataclasses

import pytest

from jaxrl.models.configs import PRESETS, num_parameters
from jaxrl.models.hf_config import from_hf

_QWEN = {"attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02, "model_type": "qwen2",
         "architectures": ["Qwen2ForCausalLM"], "rms_norm_eps": 1e-06, "use_sliding_window": False,
         "torch_dtype": "bfloat16"}
_LLAMA = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
          "hidden_act": "silu", "initializer_range": 0.02, "mlp_bias": False, "model_type": "llama",
          "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
          "vocab_size": 128256, "max_position_embeddings": 131072}

CONFIG_JSON = {
    # Qwen/Qwen2.5-Math-1.5B
    "qwen2.5-math-1.5b": {**_QWEN, "hidden_size": 1536, "intermediate_size": 8960, "max_position_embeddings": 4096,
                          "max_window_layers": 21, "num_attention_heads": 12, "num_hidden_layers": 28,
                          "num_key_value_heads": 2, "rope_theta": 10000, "sliding_window": 4096,
                          "tie_word_embeddings": True, "use_mrope": False, "vocab_size": 151936},
    # meta-llama/Llama-3.2-1B-Instruct
    "llama3.2-1b": {**_LLAMA, "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192,
                    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
                    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                    "tie_word_embeddings": True},
    # google/gemma-3-1b-it
    "gemma3-1b": {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                  "attn_logit_softcapping": None, "cache_implementation": "hybrid", "final_logit_softcapping": None,
                  "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
                  "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
                  "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26,
                  "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
                  "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
                  "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
                  "vocab_size": 262144},
    # Qwen/Qwen3-1.7B
    "qwen3-1.7b": {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                   "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
                   "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 28,
                   "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
                   "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
                   "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
                   "use_sliding_window": False, "vocab_size": 151936},
    # Qwen/Qwen2.5-7B-Instruct
    "qwen2.5-7b": {**_QWEN, "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 32768,
                   "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28,
                   "num_key_value_heads": 4, "rope_theta": 1000000.0, "sliding_window": 131072,
                   "tie_word_embeddings": False, "vocab_size": 152064},
    # meta-llama/Llama-3.1-8B-Instruct
    "llama3.1-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                    "num_hidden_layers": 32, "num_key_value_heads": 8,
                    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                    "tie_word_embeddings": False},
    # Qwen/Qwen2.5-14B-Instruct
    "qwen2.5-14b": {**_QWEN, "hidden_size": 5120, "intermediate_size": 13824, "max_position_embeddings": 32768,
                    "max_window_layers": 70, "num_attention_heads": 40, "num_hidden_layers": 48,
                    "num_key_value_heads": 8, "rope_theta": 1000000.0, "sliding_window": 131072,
                    "tie_word_embeddings": False, "vocab_size": 152064},
    # Qwen/Qwen2.5-32B-Instruct
    "qwen2.5-32b": {**_QWEN, "hidden_size": 5120, "intermediate_size": 27648, "max_position_embeddings": 32768,
                    "max_window_layers": 70, "num_attention_heads": 40, "num_hidden_layers": 64,
                    "num_key_value_heads": 8, "rope_theta": 1000000.0, "sliding_window": 131072,
                    "tie_word_embeddings": False, "vocab_size": 152064},
}

# (published parameter count as written, where it is written). A count is checked to within 0.5% or to the
# precision it is published with, whichever is looser ("1.7B" says 1.65B to 1.75B).
PUBLISHED = {
    "qwen2.5-math-1.5b": ("1.54B", "huggingface.co/Qwen/Qwen2.5-1.5B model card (the same shape)"),
    "llama3.2-1b": ("1.23B", "huggingface.co/meta-llama/Llama-3.2-1B-Instruct model card"),
    "gemma3-1b": ("1.0B", "Gemma 3 technical report, table 1: 302M embedding + 698M other parameters"),
    "qwen3-1.7b": ("1.7B", "huggingface.co/Qwen/Qwen3-1.7B model card"),
    "qwen2.5-7b": ("7.61B", "huggingface.co/Qwen/Qwen2.5-7B-Instruct model card"),
    "llama3.1-8b": ("8.03B", "huggingface.co/meta-llama/Llama-3.1-8B-Instruct model card"),
    "qwen2.5-14b": ("14.7B", "huggingface.co/Qwen/Qwen2.5-14B-Instruct model card"),
    # The card's "32.5B" is 0.8% under the shape's count; the repository page's safetensors count says 32.8B.
    "qwen2.5-32b": ("32.8B", "huggingface.co/Qwen/Qwen2.5-32B-Instruct, safetensors model size"),
}
# Finer figures where one is published: non-embedding counts (the model cards) and Gemma's split.
NON_EMBEDDING = {"qwen2.5-7b": 6.53e9, "qwen2.5-14b": 13.1e9, "qwen3-1.7b": 1.4e9, "gemma3-1b": 698e6}


@pytest.mark.parametrize("name", sorted(CONFIG_JSON))
def test_preset_is_what_loading_the_checkpoint_config_gives(name):
    loaded = from_hf(CONFIG_JSON[name], f"{name}/config.json", dtype="float32", param_dtype="float32")
    preset = PRESETS[name]
    differing = [f.name for f in dataclasses.fields(preset) if getattr(preset, f.name) != getattr(loaded, f.name)]
    assert differing == [], {k: (getattr(preset, k), getattr(loaded, k)) for k in differing}


def _tolerance(written: str) -> tuple[float, float]:
    """`"7.61B"` -> (7.61e9, relative tolerance)."""
    value = float(written[:-1]) * {"B": 1e9, "M": 1e6}[written[-1]]
    decimals = len(written[:-1].split(".")[1]) if "." in written else 0
    half_unit = 0.5 * 10.0 ** -decimals * {"B": 1e9, "M": 1e6}[written[-1]]
    return value, max(0.005, half_unit / value)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_is_the_published_one(name):
    config = PRESETS[name]
    count = num_parameters(config)
    published, tolerance = _tolerance(PUBLISHED[name][0])
    assert abs(count - published) <= tolerance * published, (count, PUBLISHED[name])
    if name in NON_EMBEDDING:
        embedding = config.vocab_size * config.hidden_size * (1 if config.tie_embeddings else 2)
        expected = NON_EMBEDDING[name]
        assert abs(count - embedding - expected) <= 0.01 * expected, (count - embedding, expected)


def test_gemma3_1b_layers_and_llama3_rope_scaling():
    gemma = PRESETS["gemma3-1b"]
    full = [i for i, t in enumerate(gemma.layer_types) if t == "full"]
    assert full == [5, 11, 17, 23] and gemma.sliding_window == 512 and gemma.query_scale == 256 ** -0.5
    assert gemma.inv_frequencies(0)[1] == pytest.approx(10_000 ** (-2 / 256))  # sliding: local base
    assert gemma.inv_frequencies(5)[1] == pytest.approx(1e6 ** (-2 / 256))  # full: global base
    llama = PRESETS["llama3.1-8b"]
    assert (llama.rope_scaling.type, llama.rope_scaling.factor) == ("llama3", 8.0)
    low = llama.inv_frequencies(0)[-1]  # the longest wavelength is divided by the factor
    assert low == pytest.approx(500_000.0 ** (-126 / 128) / 8.0, rel=1e-5)
