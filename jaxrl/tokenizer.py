"""Tokenizers: one interface over sentencepiece `.model` files and Hugging Face `tokenizer.json`.

- `BaseTokenizer` is the interface the rest of jaxrl uses: `vocab_size`, `pad_id`, `bos_id` (None when the
  model has no BOS, e.g. Qwen), `eos_id` (the primary stop id), `stop_ids` (every id that ends a completion),
  `encode`, `decode`, `chat_template` and `apply_chat_template`.
- `SentencePieceTokenizer` (alias `Tokenizer`, the historical name) wraps a sentencepiece model: the one
  `train_tokenizer` trains for the built-in arithmetic task, or a model directory's `tokenizer.model`.
- `HFTokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (`tokenizer.json`).
- `load_tokenizer(path)` reads a model directory the way transformers lays it out: `tokenizer.json` (preferred)
  or `tokenizer.model`, special tokens from `tokenizer_config.json` / `special_tokens_map.json`, extra stop
  ids from `generation_config.json`, the chat template from `chat_template.jinja` or `tokenizer_config.json`.
- Chat templates render as in transformers (sandboxed jinja2, `trim_blocks`, `lstrip_blocks`, `tojson`,
  `raise_exception`, `strftime_now`, the special token strings as variables).
- `encode_prompt` / `encode_prompts` / `encode_examples` build the token layouts the sampler and the losses
  use: prompts left-padded (BOS first when the tokenizer has one and the text is not already templated),
  completions right-padded and ending in EOS.

Encoding and decoding a `tokenizer.json` directory match transformers 5's `AutoTokenizer` (checked on Llama 3,
Qwen 2.5 / 3 and Gemma 3 layouts): a raw prompt (`encode_prompt(text, templated=False)`) is `tokenizer(text)`,
a chat prompt (`templated=True`) is `apply_chat_template(messages, tokenize=True)` (the template writes BOS;
nothing is added), `decode` is `decode(ids, skip_special_tokens=True)` up to the first stop id. Deliberate
differences: a raw prompt whose text already begins with the BOS string gets one BOS, not two; a raw prompt
gets BOS only, never the other tokens a post-processor may add (an EOS after a prompt would end it before the
model answers), and no BOS without a configured `bos_token`; `decode` stops at the first stop id and also
drops pad and BOS when they are not special.

Sampled tokens are model output and never trusted: `decode` tolerates ids outside the tokenizer's vocabulary
(model embedding tables are often padded beyond it) and negative ids.

Every unusable input raises an error naming the file (and the key): `FileNotFoundError` for missing files,
`TokenizerError` (a `ValueError`) for bad contents, `ChatTemplateError` (a `ValueError`) for templates that
fail to compile or render (including a template's own `raise_exception`).
"""

from __future__ import annotations

import abc
import datetime
import functools
import io
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import sentencepiece as spm
import tokenizers

from jaxrl.models.safe_read import MAX_JSON_BYTES, loads_json, read_regular
from jaxrl.errors import JaxrlError

__all__ = [
    "BaseTokenizer", "ChatTemplateError", "HFTokenizer", "SentencePieceTokenizer", "Tokenizer", "TokenizerError",
    "compile_chat_template", "encode_examples", "encode_prompt", "encode_prompts", "load_tokenizer", "round_up",
    "train_tokenizer",
]

logger = logging.getLogger(__name__)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3  # the pieces `train_tokenizer` reserves

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")

# End-of-turn markers of common chat formats. One is added to `stop_ids` by `load_tokenizer` when it is in the
# vocabulary and the chat template uses it: a model trained on that template ends its turn with it, even when
# the configured EOS is another token (e.g. a base Qwen model: EOS <|endoftext|>, turns end with <|im_end|>).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>",
                      "<|end_of_text|>", "</s>")


class TokenizerError(JaxrlError, ValueError):
    """A tokenizer file or setting that cannot be used; the message names the file (and key)."""

    kind = "tokenizer error"


class ChatTemplateError(JaxrlError, ValueError):
    """A chat template that does not compile, fails to render, or rejects the messages (`raise_exception`)."""

    kind = "tokenizer error"


class _UnknownToken(TokenizerError):
    def __init__(self, key: str, token: str):
        super().__init__(f"{key} {token!r} is not in the tokenizer's vocabulary")
        self.key, self.token = key, token


class _BadStopId(TokenizerError):
    def __init__(self, i: int, vocab_size: int):
        super().__init__(f"stop id {i} is outside the vocabulary [0, {vocab_size})")
        self.id, self.vocab_size = i, vocab_size


# ---------------------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------------------


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise ChatTemplateError(f"the chat template rejected the messages: {message}")


def _strftime_now(format):
    return datetime.datetime.now().strftime(format)


def compile_chat_template(source: str, origin: str = "chat template") -> jinja2.Template:
    """Compile a chat template with the environment transformers uses; `origin` names it in errors."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{origin}: invalid jinja template at line {e.lineno}: {e.message}") from None


# ---------------------------------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------------------------------


class BaseTokenizer(abc.ABC):
    """What jaxrl needs from a tokenizer. Subclasses set the attributes below and implement the abstract methods.

    Attributes:
      pad_id: the id prompts and completions are padded with (EOS when the tokenizer defines no pad token).
      bos_id: the beginning-of-sequence id, or None (Qwen has none).
      eos_id: the primary end-of-sequence id: appended to training completions, passed to the sampler.
      stop_ids: every id that ends a completion, EOS first, no duplicates: e.g. <|im_end|>, <|eot_id|>, the
        ids of generation_config.json's `eos_token_id`, the `END_OF_TURN_TOKENS` the chat template uses.
      add_bos_token: whether a prompt that is not chat-templated gets BOS prepended (`encode_prompt`).
      special_tokens: the special token strings by name (`bos_token`, `eos_token`, `pad_token`, `unk_token`),
        only those the tokenizer defines; chat templates see them as variables.
      chat_template: the jinja chat template source, or None.
    """

    pad_id: int
    bos_id: int | None
    eos_id: int
    stop_ids: tuple[int, ...]
    add_bos_token: bool
    special_tokens: dict[str, str]
    chat_template: str | None

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """One more than the largest id the tokenizer knows; ids in `[0, vocab_size)` decode to text."""

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids `[T]` of `text`. Special token strings in `text` (e.g. "<|im_end|>") become their ids, as
        in transformers. `add_special_tokens=True` also adds BOS (when `add_bos_token`)."""

    @abc.abstractmethod
    def _decode_ids(self, ids: list[int]) -> str:
        """Text of the ids before the first stop, pad and BOS removed (they may be out of range or negative),
        skipping special tokens."""

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (a piece of the vocabulary), or None."""

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (`[T]`, any int-like): everything before the first id in `stop_ids`, skipping pad, BOS
        and other special tokens. Ids outside `[0, vocab_size)` are dropped (sentencepiece: decoded as the
        unknown piece), never an error: sampled tokens may come from a model vocabulary padded beyond the
        tokenizer's. An id that both pads and stops (Qwen's <|endoftext|>) stops.
        """
        stops, skip, kept = set(self.stop_ids), {self.pad_id, self.bos_id}, []
        for i in ids:
            i = int(i)
            if i in stops:
                break
            if i not in skip:
                kept.append(i)
        return self._decode_ids(kept)

    def encode_prompt(self, text: str, *, templated: bool) -> list[int]:
        """See the module function `encode_prompt`."""
        return encode_prompt(self, text, templated=templated)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` (`[{"role": ..., "content": ...}, ...]`) with `chat_template`.

        The template sees `messages`, `add_generation_prompt`, `tools=None` and `documents=None` (defined as in
        transformers, so that a template's `tools is not none` test is false), the special token strings
        (`bos_token`, ...) and `kwargs` (e.g. `tools`, `enable_thinking`; they override all of these). The
        result already holds the template's BOS text: encode it with `encode_prompt(..., templated=True)`.
        """
        if self.chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template (looked for chat_template.jinja and "
                                    "tokenizer_config.json 'chat_template')")
        origin = getattr(self, "chat_template_origin", "chat template")
        if getattr(self, "_compiled_source", None) is not self.chat_template:
            self._compiled_template = compile_chat_template(self.chat_template, origin)
            self._compiled_source = self.chat_template
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  **variables)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{origin}: {e}") from None
        except Exception as e:  # jinja2.TemplateError, or a TypeError etc. from the template's own expressions
            raise ChatTemplateError(f"{origin}: rendering failed: {type(e).__name__}: {e}") from e

    def _finish_init(self, chat_template: str | None, extra_stop_ids: Iterable[int],
                     stop_tokens: Iterable[str]) -> None:
        """Set `chat_template` and `stop_ids`: EOS, `extra_stop_ids`, `stop_tokens`, then the
        `END_OF_TURN_TOKENS` in the vocabulary that `chat_template` uses."""
        self.chat_template, self.chat_template_origin = chat_template, "chat template"
        turn_ends = [t for t in END_OF_TURN_TOKENS if chat_template is not None and t in chat_template]
        self._set_stops([*extra_stop_ids, *(self._resolve("stop token", t) for t in stop_tokens),
                         *(i for i in map(self.token_to_id, turn_ends) if i is not None)])

    def _set_stops(self, extra_stop_ids: Iterable[int]) -> None:
        stops = [self.eos_id]
        for i in extra_stop_ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise _BadStopId(i, self.vocab_size)
            if i not in stops:
                stops.append(i)
        self.stop_ids = tuple(stops)

    def _resolve(self, key: str, token: str) -> int:
        i = self.token_to_id(token)
        if i is None:
            raise _UnknownToken(key, token)
        return i


# ---------------------------------------------------------------------------------------------------------
# Sentencepiece
# ---------------------------------------------------------------------------------------------------------

_FROM_MODEL = object()  # special token not configured: use the sentencepiece model's own piece
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class SentencePieceTokenizer(BaseTokenizer):
    """A sentencepiece model (`model_proto`: the serialized `.model` file).

    Special tokens default to the model's own pieces (`<pad>`, `<s>`, `</s>`, `<unk>` ids as trained); a
    string overrides one (it must be a piece of the model), None removes it (e.g. `bos_token=None`). Without a
    pad piece, padding uses EOS. A model without an EOS piece needs `eos_token`. Untemplated prompts get BOS
    when the model has one, unless `add_bos_token=False`. `stop_ids`: EOS, `extra_stop_ids`, the ids of
    `stop_tokens`, and the `END_OF_TURN_TOKENS` of the vocabulary that `chat_template` uses.

    `encode` recognizes the control pieces (`<s>`, `</s>`, `<pad>`, ...) and `<unk>` written in the text, so
    that chat-templated text encodes its BOS/EOS strings as their ids; text without them encodes exactly as
    `SentencePieceProcessor.encode`.
    """

    def __init__(self, model_proto: bytes, *, bos_token: Any = _FROM_MODEL, eos_token: Any = _FROM_MODEL,
                 pad_token: Any = _FROM_MODEL, unk_token: Any = _FROM_MODEL, stop_tokens: Iterable[str] = (),
                 extra_stop_ids: Iterable[int] = (), chat_template: str | None = None,
                 add_bos_token: bool | None = None):
        self.model_proto = model_proto
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        except RuntimeError as e:  # sentencepiece's own message is a C++ source location
            raise TokenizerError(f"not a sentencepiece model: {e}") from None
        sp = self._sp
        builtin = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "pad_token": sp.pad_id(),
                   "unk_token": sp.unk_id()}
        given = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token, "unk_token": unk_token}
        ids: dict[str, int | None] = {}
        self.special_tokens = {}
        for key in SPECIAL_TOKEN_KEYS:
            value = given[key]
            if value is _FROM_MODEL:
                ids[key] = builtin[key] if builtin[key] >= 0 else None
            elif value is None:
                ids[key] = None
            else:
                ids[key] = self._resolve(key, value)
            if ids[key] is not None:
                self.special_tokens[key] = sp.id_to_piece(ids[key])
        if ids["eos_token"] is None:
            raise TokenizerError("the sentencepiece model has no </s> (EOS) piece and no eos_token was given")
        self.eos_id, self.bos_id = ids["eos_token"], ids["bos_token"]
        if ids["pad_token"] is None:
            logger.info("the tokenizer has no pad token: padding with EOS (id %d)", self.eos_id)
            self.pad_id = self.eos_id
        else:
            self.pad_id = ids["pad_token"]
        self._unk_id = ids["unk_token"] if ids["unk_token"] is not None else sp.unk_id()
        self.add_bos_token = self.bos_id is not None and add_bos_token is not False
        specials = {sp.id_to_piece(i): i for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i)}
        specials.update({v: ids[k] for k, v in self.special_tokens.items()})
        self._specials = specials
        self._special_re = (re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
                            if specials else None)
        self._finish_init(chat_template, extra_stop_ids, stop_tokens)

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs: Any) -> "SentencePieceTokenizer":
        """The model in the `.model` file at `path` (no config files: see `load_tokenizer` for those)."""
        with open(path, "rb") as f:
            proto = f.read()
        try:
            return cls(proto, **kwargs)
        except TokenizerError as e:
            raise TokenizerError(f"{path}: {e}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write the serialized model (`.model` file)."""
        with open(path, "wb") as f:
            f.write(self.model_proto)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        return i if 0 <= i < self.vocab_size and self._sp.id_to_piece(i) == token else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        surrogate = _LONE_SURROGATE.search(text)
        if surrogate:  # sentencepiece's error is "Unable to cast Python instance of type <class 'str'>"
            raise ValueError(f"text holds a lone surrogate {surrogate.group()!r} at {surrogate.start()} (not valid "
                             f"Unicode; e.g. a JSON '\\ud83d' escape without its pair): {text[:80]!r}")
        if self._special_re is None or not self._special_re.search(text):
            ids = self._sp.encode(text)
        else:
            ids, start = [], 0
            for match in self._special_re.finditer(text):
                if match.start() > start:
                    ids += self._sp.encode(text[start:match.start()])
                ids.append(self._specials[match.group()])
                start = match.end()
            if start < len(text):
                ids += self._sp.encode(text[start:])
        if add_special_tokens and self.add_bos_token and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def _decode_ids(self, ids: list[int]) -> str:
        return self._sp.decode([i if 0 <= i < self.vocab_size else self._unk_id for i in ids])


Tokenizer = SentencePieceTokenizer  # the historical name


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, stop_tokens: Iterable[str] = (),
                    user_symbols: Sequence[str] = ()) -> SentencePieceTokenizer:
    """Train a BPE sentencepiece model on `texts` (deterministic; digits always split one per token).

    Pieces 0-3 are `<pad>`, `<unk>`, `<s>` (BOS), `</s>` (EOS). Text is not normalised, so every text made of
    the corpus's characters decodes back exactly (`decode(encode(t)) == t`): newlines, tabs, repeated and
    leading spaces and characters such as `½` are kept, not rewritten (sentencepiece's default `nmt_nfkc`
    normaliser with `remove_extra_whitespaces` turns `\n`/`\t` into spaces, merges spaces and maps `½` to
    `1⁄2`, which alters prompts and leaves a policy no way to write a newline). Every character of `texts`
    is a piece (`character_coverage=1.0`); a character absent from them encodes as `<unk>`. `stop_tokens`
    (pieces of the trained vocabulary) end a completion besides EOS.

    `user_symbols` (a tool task's tags such as `<tool_call>`): strings that are always one piece each, wherever
    they occur. With them the text gets no dummy "▁" prefix, so that the pieces of an episode encoded apart
    (prompt, model turns, observations, each starting or ending at such a symbol) give the same tokens as the
    whole text: what a multi-turn sampler appends is what a demonstration trains on.
    """
    symbols = list(dict.fromkeys(user_symbols))
    for symbol in symbols:
        if not symbol or any(c.isspace() for c in symbol):
            raise ValueError(f"user symbol {symbol!r}: a piece must be non-empty and hold no whitespace")
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=proto, vocab_size=vocab_size, model_type="bpe",
        split_digits=True, hard_vocab_limit=False, character_coverage=1.0, num_threads=1,
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, minloglevel=2,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        max_sentence_length=1 << 30,  # the most it takes; by default, texts over 4192 bytes were skipped silently
        **({"user_defined_symbols": symbols, "add_dummy_prefix": False} if symbols else {}),
    )
    return SentencePieceTokenizer(proto.getvalue(), stop_tokens=stop_tokens)


# ---------------------------------------------------------------------------------------------------------
# Hugging Face tokenizers
# ---------------------------------------------------------------------------------------------------------


class HFTokenizer(BaseTokenizer):
    """A Hugging Face `tokenizers.Tokenizer` (what `tokenizer.json` holds) with its special tokens.

    Special tokens are given as strings of the vocabulary (None: the tokenizer has none). `eos_token` (or a
    first `extra_stop_ids` entry) is required; without `pad_token`, padding uses EOS. `add_bos_token=None`
    follows tokenizer.json's post-processor (BOS is added when it adds BOS to a text, as transformers does);
    True/False overrides it (`load_tokenizer` never does: transformers 5 ignores tokenizer_config.json's
    `add_bos_token` next to a tokenizer.json). `stop_ids`: EOS, `extra_stop_ids`, the ids of `stop_tokens`, and
    the `END_OF_TURN_TOKENS` of the vocabulary that `chat_template` uses. `clean_up_tokenization_spaces`:
    `decode` removes the space before `.,!?` and contractions (`" n't"`, `" 's"`, ...), as transformers does,
    except for a BPE model, where transformers 5 ignores the setting.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None, unk_token: str | None = None,
                 stop_tokens: Iterable[str] = (), extra_stop_ids: Iterable[int] = (),
                 chat_template: str | None = None, add_bos_token: bool | None = None,
                 clean_up_tokenization_spaces: bool = False):
        self._tok = tokenizer
        self._clean_up = clean_up_tokenization_spaces and not isinstance(tokenizer.model, tokenizers.models.BPE)
        added = tokenizer.get_added_tokens_decoder()
        self._vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        given = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token, "unk_token": unk_token}
        self.special_tokens = {k: v for k, v in given.items() if v is not None}
        ids = {k: self._resolve(k, v) for k, v in self.special_tokens.items()}
        extra_stop_ids = [int(i) for i in extra_stop_ids]
        if "eos_token" in ids:
            self.eos_id = ids["eos_token"]
        elif extra_stop_ids:
            self.eos_id = extra_stop_ids[0]
        else:
            raise TokenizerError("no EOS: give eos_token (tokenizer_config.json) or eos_token_id "
                                 "(generation_config.json)")
        self.bos_id = ids.get("bos_token")
        if "pad_token" in ids:
            self.pad_id = ids["pad_token"]
        else:
            logger.info("the tokenizer has no pad token: padding with EOS (id %d)", self.eos_id)
            self.pad_id = self.eos_id
        # Whether tokenizer.json's post-processor puts BOS first (probed on the empty text).
        self._post_adds_bos = (self.bos_id is not None
                               and tokenizer.encode("", add_special_tokens=True).ids[:1] == [self.bos_id])
        self.add_bos_token = self.bos_id is not None and (
            self._post_adds_bos if add_bos_token is None else bool(add_bos_token))
        self._special_ids = {i for i, t in added.items() if t.special} | set(ids.values())
        self._finish_init(chat_template, extra_stop_ids, stop_tokens)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens=True` applies tokenizer.json's post-processor, with BOS present exactly when
        `add_bos_token` (never twice)."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.bos_id is not None:
            if self._post_adds_bos and not self.add_bos_token:
                ids = ids[1:]
            elif self.add_bos_token and not self._post_adds_bos:
                ids = [self.bos_id, *ids]
            if self.add_bos_token and ids[:2] == [self.bos_id, self.bos_id]:  # the text began with BOS
                ids = ids[1:]
        return ids

    def _decode_ids(self, ids: list[int]) -> str:
        text = self._tok.decode([i for i in ids if 0 <= i < self._vocab_size and i not in self._special_ids],
                                skip_special_tokens=True)
        return _clean_up_tokenization(text) if self._clean_up else text


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: the spaces a word-level tokenizer leaves before punctuation and
    English contractions removed."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text


# ---------------------------------------------------------------------------------------------------------
# Loading a model directory
# ---------------------------------------------------------------------------------------------------------


_MAX_TOKENIZER_BYTES = 2**30  # tokenizer.json / tokenizer.model (Gemma 3's tokenizer.json: 33 MB)


def _read_bytes(path: Path, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a file of the model directory: a regular file (a FIFO there would block forever), at most
    `max_bytes`; `TokenizerError` naming it otherwise."""
    try:
        return read_regular(path, max_bytes, TokenizerError)
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e.strerror or e}") from None


def _read_json(path: Path, data: bytes | None = None) -> dict[str, Any]:
    """A JSON object file of the model directory (`data`: its bytes, if already read), read with
    `models.safe_read`'s limits: one-line errors with the line for invalid JSON, too deep nesting, ..."""
    data = _read_bytes(path) if data is None else data
    data = loads_json(data, str(path), error=TokenizerError)
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _exists(path: Path) -> bool:
    """Whether the model directory has `path` in any form: a FIFO or device under the name is refused when
    read, not silently passed over."""
    return os.path.lexists(path)


def _token_string(value: Any, path: Path, key: str) -> str | None:
    """A special token entry: a string, None, or an AddedToken dict `{"content": ...}`."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{path}: {key} must be a string, null or an object with a string 'content', "
                         f"got {value!r}")


def _chat_template_from_config(value: Any, path: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for n, entry in enumerate(value):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerError(f"{path}: chat_template[{n}] must be an object with string 'name' and "
                                     f"'template', got {entry!r}")
            named[entry["name"]] = entry["template"]
        if "default" not in named:
            raise TokenizerError(f"{path}: chat_template lists no 'default' template (has {sorted(named)})")
        return named["default"]
    raise TokenizerError(f"{path}: chat_template must be a string or a list of {{name, template}} objects, "
                         f"got {type(value).__name__}")


def _generation_stop_ids(path: Path) -> list[int]:
    value = _read_json(path).get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizerError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return values


def load_tokenizer(path: str | os.PathLike, *, stop_tokens: Iterable[str] = ()) -> BaseTokenizer:
    """The tokenizer of a model directory (or of a `.model` / `tokenizer.json` file, with the config files
    next to it).

    - `tokenizer.json` -> `HFTokenizer` (preferred when a directory has both); else `tokenizer.model` or a
      `.model` file -> `SentencePieceTokenizer`.
    - Special tokens (`bos_token`, `eos_token`, `pad_token`, `unk_token`; strings or AddedToken dicts
      `{"content": ...}`, null for none) come from `tokenizer_config.json`, overridden by
      `special_tokens_map.json` only when `tokenizer_config.json` has no `added_tokens_decoder` (transformers 5's
      precedence). Without a pad token, padding uses EOS (logged).
    - BOS: with a `tokenizer.json`, exactly when its post-processor adds it (`tokenizer_config.json`'s
      `add_bos_token` is ignored, as transformers 5 ignores it; a warning when they disagree); with a `.model`,
      unless `add_bos_token` is false. `clean_up_tokenization_spaces` (`tokenizer_config.json`) applies to
      `decode`, but not for a BPE `tokenizer.json` (transformers 5 ignores it there: Llama 3 sets it).
    - `stop_ids`: EOS, the ids of `generation_config.json`'s `eos_token_id` (an int or a list), the
      `END_OF_TURN_TOKENS` the chat template uses, and `stop_tokens` (strings of the vocabulary).
    - The chat template: `chat_template.jinja` (transformers 5 writes it there), else
      `tokenizer_config.json`'s `chat_template` (a string, or a list of `{"name", "template"}`: "default").

    Raises `FileNotFoundError` for a missing path or a directory without a tokenizer, `TokenizerError` naming
    the file (and key) for unparsable JSON (with its line), bad values and special tokens not in the
    vocabulary, `ChatTemplateError` for a template that does not compile.
    """
    path = Path(path)
    if path.is_dir():
        directory = path
        if _exists(path / "tokenizer.json"):
            model_file, kind = path / "tokenizer.json", "hf"
        elif _exists(path / "tokenizer.model"):
            model_file, kind = path / "tokenizer.model", "sp"
        else:
            raise FileNotFoundError(f"{path}: no tokenizer.json or tokenizer.model in this directory")
    elif _exists(path):
        directory, model_file = path.parent, path
        if path.suffix == ".model":
            kind = "sp"
        elif path.suffix == ".json":
            kind = "hf"
        else:
            raise TokenizerError(f"{path}: not a tokenizer file (expected tokenizer.json or a .model file)")
    else:
        raise FileNotFoundError(f"{path}: no such tokenizer file or directory")

    # Special tokens, with the file each came from (for errors).
    special: dict[str, tuple[str | None, Path]] = {}
    config_file, map_file = directory / "tokenizer_config.json", directory / "special_tokens_map.json"
    config = _read_json(config_file) if _exists(config_file) else {}
    # transformers 5 reads special_tokens_map.json only for a tokenizer_config.json without `added_tokens_decoder`
    # (the files older transformers saved); a config that has one is complete and wins.
    use_map = _exists(map_file) and "added_tokens_decoder" not in config
    for source, data in ((config_file, config), (map_file, _read_json(map_file) if use_map else {})):
        for key in SPECIAL_TOKEN_KEYS:
            if key in data:
                special[key] = (_token_string(data[key], source, key), source)
    add_bos_token = config.get("add_bos_token")
    if add_bos_token is not None and not isinstance(add_bos_token, bool):
        raise TokenizerError(f"{config_file}: add_bos_token must be true, false or null, got {add_bos_token!r}")
    clean_up = config.get("clean_up_tokenization_spaces")
    if clean_up is not None and not isinstance(clean_up, bool):
        raise TokenizerError(f"{config_file}: clean_up_tokenization_spaces must be true or false, got {clean_up!r}")

    generation_file = directory / "generation_config.json"
    generation_ids = _generation_stop_ids(generation_file) if _exists(generation_file) else []

    template_file = directory / "chat_template.jinja"
    if _exists(template_file):
        try:
            chat_template, template_origin = _read_bytes(template_file).decode("utf-8"), str(template_file)
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{template_file}: cannot read: {e}") from None
    else:
        chat_template = _chat_template_from_config(config.get("chat_template"), config_file)
        template_origin = f"{config_file} (chat_template)"
    compiled = None if chat_template is None else compile_chat_template(chat_template, template_origin)

    kwargs: dict[str, Any] = {key: value for key, (value, _) in special.items()}
    if kind == "hf":
        data = _read_bytes(model_file, _MAX_TOKENIZER_BYTES)  # read once: no second open of a swapped file
        try:
            backend = tokenizers.Tokenizer.from_str(data.decode("utf-8-sig"))
        except Exception as e:  # the Rust error names no file; a JSON syntax error gets its line from json
            _read_json(model_file, data)
            raise TokenizerError(f"{model_file}: cannot load the tokenizer: {e}") from None
        make = functools.partial(HFTokenizer, backend, clean_up_tokenization_spaces=bool(clean_up))
    else:
        proto = _read_bytes(model_file, _MAX_TOKENIZER_BYTES)
        try:
            spm.SentencePieceProcessor(model_proto=proto)
        except Exception as e:
            raise TokenizerError(f"{model_file}: not a sentencepiece model: {e}") from None
        make = functools.partial(SentencePieceTokenizer, proto)
    # transformers 5 drops tokenizer_config.json's add_bos_token when there is a tokenizer.json: BOS is then
    # whatever tokenizer.json's post-processor adds (HFTokenizer's add_bos_token=None).
    try:
        tokenizer = make(**kwargs, chat_template=chat_template, add_bos_token=None if kind == "hf" else add_bos_token,
                         extra_stop_ids=generation_ids, stop_tokens=stop_tokens)
    except _UnknownToken as e:
        source = special[e.key][1] if e.key in special else "the stop_tokens argument"
        raise TokenizerError(f"{source}: {e.key} {e.token!r} is not in the vocabulary of {model_file}") from None
    except _BadStopId as e:
        raise TokenizerError(f"{generation_file}: eos_token_id {e.id} is outside the vocabulary of {model_file} "
                             f"(size {e.vocab_size})") from None
    except TokenizerError as e:
        raise TokenizerError(f"{model_file}: {e}") from None
    if kind == "hf" and add_bos_token is not None and add_bos_token != tokenizer.add_bos_token:
        logger.warning("%s: add_bos_token=%s is ignored, as transformers 5 ignores it: BOS follows %s's "
                       "post-processor, which %s", config_file, str(add_bos_token).lower(), model_file,
                       "adds it" if tokenizer.add_bos_token else "does not add it")
    tokenizer.chat_template_origin = template_origin
    tokenizer._compiled_template, tokenizer._compiled_source = compiled, chat_template
    return tokenizer


# ---------------------------------------------------------------------------------------------------------
# Batch layouts
# ---------------------------------------------------------------------------------------------------------


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def encode_prompt(tokenizer: BaseTokenizer, text: str, *, templated: bool) -> list[int]:
    """Token ids `[T]` of a prompt, BOS handled once.

    `templated=True`: `text` came from a chat template, which already wrote the BOS text if the model uses one:
    encoded without adding anything. `templated=False`: BOS is prepended when the tokenizer adds one
    (`add_bos_token`), unless the text already starts with it (never a double BOS). A sentencepiece tokenizer
    gives BOS + tokens.
    """
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_id
    if not templated and tokenizer.add_bos_token and bos is not None and ids[:1] != [bos]:
        ids = [bos, *ids]
    return ids


def encode_prompts(tokenizer: BaseTokenizer, prompts: Sequence[str], length: int, *,
                   templated: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Prompts (`encode_prompt`: BOS first when the tokenizer has one and the text is not `templated`),
    left-padded with `pad_id` to `length`.

    Returns `(tokens [P, length] int32, valid [P, length] bool)`. A prompt longer than `length` is an error,
    never silently truncated.
    """
    return left_pad([encode_prompt(tokenizer, prompt, templated=templated) for prompt in prompts], length,
                    tokenizer.pad_id, prompts)


def left_pad(rows: Sequence[Sequence[int]], length: int, pad_id: int,
             texts: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token id rows left-padded with `pad_id` to `length`: `(tokens [P, length] int32, valid [P, length]
    bool)`. A row longer than `length` is an error (quoting `texts[row]` when given), never truncated."""
    tokens = np.full((len(rows), length), pad_id, np.int32)
    valid = np.zeros((len(rows), length), bool)
    for row, ids in enumerate(rows):
        if len(ids) > length:
            quoted = f": {texts[row][:80]!r}" if texts is not None else ""
            raise ValueError(f"prompt {row} has {len(ids)} tokens, more than the prompt length {length}{quoted}")
        if len(ids):
            tokens[row, length - len(ids):] = ids
            valid[row, length - len(ids):] = True
    return tokens, valid


Segment = tuple[str, str]  # ("model" | "observation", text): a piece of a multi-turn completion
SEGMENT_KINDS = ("model", "observation")


def encode_completion(tokenizer: BaseTokenizer, completion: str | Sequence[Segment]) -> tuple[list[int], list[bool]]:
    """Token ids of one completion with EOS, and which of them are trained (`True`: model tokens).

    `completion` is a text (all model tokens), or an episode's segments `[("model", text), ("observation",
    text), ...]`, each encoded on its own (as a multi-turn sampler appends them): observation tokens are
    holes (`False`), and EOS follows the last segment, which must be a model segment.
    """
    if isinstance(completion, str):
        ids = [*tokenizer.encode(completion), tokenizer.eos_id]
        return ids, [True] * len(ids)
    if not completion:
        raise ValueError("a completion of segments needs at least one segment")
    ids, trained = [], []
    for i, segment in enumerate(completion):
        if not (isinstance(segment, (tuple, list)) and len(segment) == 2 and segment[0] in SEGMENT_KINDS
                and isinstance(segment[1], str)):
            raise ValueError(f"segment {i} must be (kind, text) with kind in {SEGMENT_KINDS}, got {segment!r:.80}")
        kind, text = segment
        piece = tokenizer.encode(text)
        ids += piece
        trained += [kind == "model"] * len(piece)
    if completion[-1][0] != "model":
        raise ValueError(f"the last segment is {completion[-1][0]!r}: a completion ends with a model segment "
                         "(EOS follows it)")
    return [*ids, tokenizer.eos_id], [*trained, True]


def encode_examples(
    tokenizer: BaseTokenizer, prompts: Sequence[str], completions: Sequence[str | Sequence[Segment]],
    prompt_length: int, completion_length: int | None = None, round_to: int = 8, *, templated: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt (left-padded, as `encode_prompts`) + completion + EOS (right-padded), the layout the sampler
    produces. A completion is a text, or a multi-turn episode's segments (`encode_completion`): its
    observation tokens are in `tokens` but not in `completion_mask`, so supervised learning never trains the
    model to predict a tool's output.

    `completion_length=None` pads to the longest completion (with EOS) rounded up to `round_to`, so that a
    stream of batches compiles a few shapes and wastes little compute on padding.

    Returns `(tokens [B, prompt_length + completion_length], prompt_valid [B, prompt_length],
    completion_mask [B, completion_length])`.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions: each prompt needs one")
    prompt_tokens, prompt_valid = encode_prompts(tokenizer, prompts, prompt_length, templated=templated)
    encoded = [encode_completion(tokenizer, completion) for completion in completions]
    if completion_length is None:
        completion_length = round_up(max(len(ids) for ids, _ in encoded), round_to)
    completion = np.full((len(prompts), completion_length), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(prompts), completion_length), bool)
    for row, (text, (ids, trained)) in enumerate(zip(completions, encoded)):
        if len(ids) > completion_length:
            shown = text if isinstance(text, str) else "".join(t for _, t in text)
            raise ValueError(f"completion {row} has {len(ids)} tokens (with EOS), more than "
                             f"{completion_length}: {shown[:80]!r}")
        completion[row, :len(ids)] = ids
        mask[row, :len(ids)] = trained
    return np.concatenate([prompt_tokens, completion], axis=1), prompt_valid, mask
