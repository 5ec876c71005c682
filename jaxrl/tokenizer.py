"""Sentencepiece tokenizer: training a small model for built-in tasks, encoding and decoding."""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer:
    """A thin, explicit wrapper around `sentencepiece.SentencePieceProcessor`."""

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.pad_id, self.bos_id, self.eos_id = self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id()
        if min(self.pad_id, self.bos_id, self.eos_id) < 0:
            raise ValueError("the sentencepiece model must define <pad>, <s> (BOS) and </s> (EOS) pieces")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        with open(path, "rb") as f:
            return cls(f.read())

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "wb") as f:
            f.write(self.model_proto)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, ignoring pad, BOS and everything from the first EOS on.

        Ids the tokenizer does not have (a model vocabulary padded beyond it) decode as the unknown piece:
        sampled tokens are model output and are never trusted to be in range.
        """
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i not in (self.pad_id, self.bos_id):
                out.append(i if 0 <= i < self.vocab_size else self._sp.unk_id())
        return self._sp.decode(out)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a BPE sentencepiece model on `texts` (deterministic; digits always split one per token)."""
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=proto, vocab_size=vocab_size, model_type="bpe",
        split_digits=True, hard_vocab_limit=False, character_coverage=1.0, num_threads=1,
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, minloglevel=2,
    )
    return Tokenizer(proto.getvalue())


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[str], length: int) -> tuple[np.ndarray, np.ndarray]:
    """BOS + prompt tokens, left-padded to `length`.

    Returns `(tokens [P, length] int32, valid [P, length] bool)`. A prompt longer than `length` is an error,
    never silently truncated.
    """
    tokens = np.full((len(prompts), length), tokenizer.pad_id, np.int32)
    valid = np.zeros((len(prompts), length), bool)
    for row, prompt in enumerate(prompts):
        ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
        if len(ids) > length:
            raise ValueError(f"prompt {row} has {len(ids)} tokens, more than the prompt length {length}: "
                             f"{prompt[:80]!r}")
        tokens[row, length - len(ids):] = ids
        valid[row, length - len(ids):] = True
    return tokens, valid


def encode_examples(
    tokenizer: Tokenizer, prompts: Sequence[str], completions: Sequence[str], prompt_length: int,
    completion_length: int | None = None, round_to: int = 8,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt (left-padded) + completion + EOS (right-padded), the layout the sampler produces.

    `completion_length=None` pads to the longest completion (with EOS) rounded up to `round_to`, so that a
    stream of batches compiles a few shapes and wastes little compute on padding.

    Returns `(tokens [B, prompt_length + completion_length], prompt_valid [B, prompt_length],
    completion_mask [B, completion_length])`.
    """
    prompt_tokens, prompt_valid = encode_prompts(tokenizer, prompts, prompt_length)
    encoded = [[*tokenizer.encode(text), tokenizer.eos_id] for text in completions]
    if completion_length is None:
        completion_length = round_up(max(map(len, encoded)), round_to)
    completion = np.full((len(prompts), completion_length), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(prompts), completion_length), bool)
    for row, (text, ids) in enumerate(zip(completions, encoded)):
        if len(ids) > completion_length:
            raise ValueError(f"completion {row} has {len(ids)} tokens (with EOS), more than "
                             f"{completion_length}: {text[:80]!r}")
        completion[row, :len(ids)] = ids
        mask[row, :len(ids)] = True
    return np.concatenate([prompt_tokens, completion], axis=1), prompt_valid, mask
