"""A tiny Hugging Face checkpoint with a tokenizer and a chat template, for trying recipes without downloads.

    jaxrl tiny-checkpoint /tmp/tiny --family qwen2 --layers 2 --hidden 64
    jaxrl train configs/default.yaml pretrained.path=/tmp/tiny

`write_tiny_checkpoint(path, family=..., layers=..., hidden=...)` writes:
- `config.json` + `model.safetensors`: a randomly initialised `jaxrl.models` transformer of `family` (float32);
- `tokenizer.json`: a byte-level BPE (any text encodes) trained on a little built-in text, with the ChatML
  special tokens `<|endoftext|>` (padding), `<|im_start|>` and `<|im_end|>` (end of turn and EOS);
- `tokenizer_config.json`: those tokens and a ChatML chat template (`CHATML`), so `data.chat_template: true`
  and chat `messages` data work.

The weights are random: a run learns from scratch (the default recipe's warm start teaches it arithmetic).
"""

from __future__ import annotations

import json
import os
from typing import get_args

from jaxrl.models.configs import Family

__all__ = ["CHATML", "FAMILIES", "SPECIAL_TOKENS", "tiny_model_config", "tiny_tokenizer_json",
           "write_tiny_checkpoint"]

FAMILIES: tuple[str, ...] = get_args(Family)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad, turn start, turn end (= EOS)

# ChatML, as Qwen's instruct models write it (without their default system message).
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Text the BPE merges are learned from: arithmetic, chat roles, and a little English and Python.
_CORPUS = [
    "What is 12+7? 12+7=19. The answer is 19.", "37-15=22 #### 22", "Compute 9*8. 9*8=72, so \\boxed{72}.",
    "system user assistant", "You are a helpful assistant. Think step by step, then answer.",
    "<think> First add the tens, then the ones. </think> <answer> 42 </answer>",
    "Question: Which is larger, 0.5 or 0.45? Choices: A, B, C, D. Answer: A",
    "def solve(a, b):\n    return a + b\n\nprint(solve(1, 2))",
    "The quick brown fox jumps over the lazy dog.", "0123456789 +-*/=()[]{}<>.,:;!?'\"#$%&@^_`|~\\",
]


def tiny_tokenizer_json(vocab_size: int = 384) -> str:
    """`tokenizer.json` text: a byte-level BPE of at most `vocab_size` tokens, `SPECIAL_TOKENS` first (ids 0-2),
    then the 256 byte symbols, then merges learned from the built-in text (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(_CORPUS * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tokenizer.to_str()


def tiny_model_config(family: str = "qwen2", layers: int = 2, hidden: int = 64, vocab_size: int = 384):
    """The `jaxrl.models.ModelConfig` of a tiny `family` model: heads of 16 dimensions (2 key/value heads
    when there are several), an MLP 3x `hidden` wide."""
    from jaxrl import models
    from jaxrl.models.hf_config import TRAITS

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
    if layers < 1 or hidden < 16 or hidden % 16:
        raise ValueError(f"layers must be >= 1 and hidden a multiple of 16 (>= 16), got {layers} and {hidden}")
    heads = hidden // 16
    kv_heads = 2 if heads % 2 == 0 else 1
    return models.ModelConfig(family=family, vocab_size=vocab_size, hidden_size=hidden, num_layers=layers,
                              num_heads=heads, num_kv_heads=kv_heads, head_dim=16, intermediate_size=3 * hidden,
                              max_position_embeddings=2048, **TRAITS[family])


def write_tiny_checkpoint(path: str | os.PathLike, *, family: str = "qwen2", layers: int = 2, hidden: int = 64,
                          seed: int = 0, overwrite: bool = False) -> str:
    """Write a tiny random-weight HF checkpoint with tokenizer and chat template to `path`; returns `path`.

    Refuses (FileExistsError) a `path` that exists and is not empty, unless `overwrite`.
    """
    from jaxrl import models

    directory = os.path.expanduser(os.fspath(path))
    if os.path.isdir(directory) and os.listdir(directory) and not overwrite:
        raise FileExistsError(f"{directory} exists and is not empty (pass overwrite=True / --overwrite)")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise FileExistsError(f"{directory} exists and is not a directory")
    tokenizer_json = tiny_tokenizer_json()
    vocab = len(json.loads(tokenizer_json)["model"]["vocab"])
    config = tiny_model_config(family, layers, hidden, vocab_size=-(-vocab // 64) * 64)  # room to spare
    models.save_pretrained(models.init(config, seed), directory, progress=False)
    pad, _, eos = (json.loads(tokenizer_json)["model"]["vocab"][t] for t in SPECIAL_TOKENS)
    config_file = os.path.join(directory, "config.json")
    with open(config_file) as f:
        raw = json.load(f)
    raw.update(bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    files = {
        "config.json": raw,
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                  "unk_token": None, "add_bos_token": False, "chat_template": CHATML,
                                  "model_max_length": config.max_position_embeddings},
        "generation_config.json": {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": pad},
    }
    for name, content in files.items():
        with open(os.path.join(directory, name), "w") as f:
            f.write(content if isinstance(content, str) else json.dumps(content, indent=2) + "\n")
    return directory
