"""Hugging Face tokenizer directories: loading, special tokens, stop ids, decoding, chat templates, prompt layouts.

Every model directory is built here: a tiny byte-level BPE trained with `tokenizers` in a fixture, written
next to the config files transformers saves (no network, no transformers, no torch).
"""

import json
import logging
import time

import numpy as np
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jaxrl.tokenizer import (ChatTemplateError, HFTokenizer, SentencePieceTokenizer, TokenizerError,
                             encode_examples, encode_prompt, encode_prompts, load_tokenizer)

CORPUS = ["What is 2+2? The answer is 4.", "hello world, héllo wörld", "Be brief. Hi! Hello there.",
          "user assistant system model"] * 20

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|eom_id|>"]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]

CHATML = r"""{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

LLAMA3 = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

GEMMA = (r"{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         r"{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         r"{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         r"{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         r"{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
         r"{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

USER = [{"role": "user", "content": "What is 2+2?"}]


def train_bpe(specials: list[str], bos: str | None = None) -> str:
    """tokenizer.json text of a byte-level BPE with `specials` first; `bos`: a post-processor that prepends it."""
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_tokens(["<think>"])  # an added, non-special token (decoded as text)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok.to_str()


def unigram(specials: list[str]) -> str:
    """tokenizer.json text of a sentencepiece-style Unigram model (not BPE; a fixed vocabulary, since Unigram
    training is not deterministic): `specials` first (the last one is <unk>), then words, then characters."""
    words = ["▁Hello", "▁there", "▁world", "▁Don", "'t", "▁I", "▁'m", "▁it", "▁'s", "▁fine"]
    chars = sorted(set("".join(CORPUS).replace(" ", "")) | set(",.!?'▁"))
    vocab = [(t, 0.0) for t in specials] + [(w, -2.0) for w in words] + [(c, -5.0) for c in chars]
    tok = RawTokenizer(models.Unigram(vocab, unk_id=len(specials) - 1, byte_fallback=False))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok.to_str()


def added_tokens_decoder(tokenizer_json: str) -> dict:
    """tokenizer_config.json's `added_tokens_decoder` for `tokenizer_json`, as transformers saves it."""
    added = RawTokenizer.from_str(tokenizer_json).get_added_tokens_decoder()
    return {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special} for i, t in sorted(added.items())}


@pytest.fixture(scope="module")
def backends():
    return {"qwen": train_bpe(QWEN_SPECIALS), "llama": train_bpe(LLAMA_SPECIALS, bos="<|begin_of_text|>"),
            "gemma": train_bpe(GEMMA_SPECIALS, bos="<bos>"), "llama_no_post": train_bpe(LLAMA_SPECIALS)}


def write_dir(path, tokenizer_json, *, config=None, special_tokens_map=None, generation_config=None,
              jinja=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer_json)
    for name, data in (("tokenizer_config.json", config), ("special_tokens_map.json", special_tokens_map),
                       ("generation_config.json", generation_config)):
        if data is not None:
            (path / name).write_text(data if isinstance(data, str) else json.dumps(data, indent=2))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


@pytest.fixture
def qwen(tmp_path, backends):
    """Qwen2.5-Instruct-like: no BOS, EOS <|im_end|>, pad <|endoftext|>, ChatML in tokenizer_config.json."""
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": None, "chat_template": CHATML}
    write_dir(tmp_path / "qwen", backends["qwen"], config=config,
              generation_config={"bos_token_id": 0, "eos_token_id": [2, 0]})
    return load_tokenizer(tmp_path / "qwen")


@pytest.fixture
def llama(tmp_path, backends):
    """Llama-3-Instruct-like: BOS added by the post-processor, AddedToken dicts, no pad, chat_template.jinja."""
    config = {"bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False},
              "eos_token": {"content": "<|eot_id|>", "special": True}, "chat_template": "unused {{ x }}"}
    write_dir(tmp_path / "llama", backends["llama"], config=config, jinja=LLAMA3,
              generation_config={"eos_token_id": [1, 5, 4]})
    return load_tokenizer(tmp_path / "llama")


@pytest.fixture
def gemma(tmp_path, backends):
    """Gemma-like: <bos> from the post-processor, special tokens only in special_tokens_map.json."""
    write_dir(tmp_path / "gemma", backends["gemma"], config={"chat_template": GEMMA},
              special_tokens_map={"bos_token": {"content": "<bos>"}, "eos_token": "<eos>", "pad_token": "<pad>",
                                  "unk_token": {"content": "<unk>", "normalized": False}})
    return load_tokenizer(tmp_path / "gemma")


def ids(tokenizer, *tokens):
    return [tokenizer.token_to_id(t) for t in tokens]


# ---------------------------------------------------------------------------------------------------------
# Loading and special tokens
# ---------------------------------------------------------------------------------------------------------


def test_qwen_like_directory(qwen):
    assert isinstance(qwen, HFTokenizer) and qwen.bos_id is None and not qwen.add_bos_token
    im_end, endoftext = ids(qwen, "<|im_end|>", "<|endoftext|>")
    assert (qwen.eos_id, qwen.pad_id) == (im_end, endoftext)
    assert qwen.stop_ids == (im_end, endoftext)  # EOS, then generation_config.json's list (deduplicated)
    assert qwen.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert qwen.chat_template == CHATML
    assert qwen.vocab_size == qwen.token_to_id("<think>") + 1  # added tokens count


def test_llama_like_directory_added_token_dicts_jinja_file_and_pad_fallback(tmp_path, backends, caplog):
    with caplog.at_level(logging.INFO, logger="jaxrl.tokenizer"):
        tok = load_tokenizer(write_dir(
            tmp_path / "m", backends["llama"], jinja=LLAMA3,
            config={"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": {"content": "<|eot_id|>"}},
            generation_config={"eos_token_id": [1, 5, 4]}))
    bos, end_of_text, eot, eom = ids(tok, "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")
    assert (tok.bos_id, tok.eos_id) == (bos, eot) and tok.add_bos_token
    assert tok.pad_id == eot and "no pad token: padding with EOS" in caplog.text
    assert tok.stop_ids == (eot, end_of_text, eom)
    assert tok.chat_template == LLAMA3  # chat_template.jinja wins over tokenizer_config.json


def test_special_tokens_map_overrides_tokenizer_config(tmp_path, backends):
    tok = load_tokenizer(write_dir(tmp_path / "m", backends["gemma"],
                                   config={"eos_token": "<end_of_turn>", "pad_token": "<unk>"},
                                   special_tokens_map={"eos_token": {"content": "<eos>"}}))
    assert tok.eos_id == tok.token_to_id("<eos>") and tok.pad_id == tok.token_to_id("<unk>")
    assert tok.bos_id is None and not tok.add_bos_token  # no bos_token configured: none, whatever the post-processor


def test_eos_from_generation_config_when_unconfigured(tmp_path, backends):
    tok = load_tokenizer(write_dir(tmp_path / "m", backends["qwen"], generation_config={"eos_token_id": 0}))
    assert tok.eos_id == tok.pad_id == 0 and tok.stop_ids == (0,)


def test_end_of_turn_tokens_of_the_template_stop(tmp_path, backends):
    """A base model (EOS <|endoftext|>) with ChatML stops at <|im_end|> too; explicit stop_tokens are added."""
    path = write_dir(tmp_path / "m", backends["qwen"], config={"eos_token": "<|endoftext|>"}, jinja=CHATML)
    assert load_tokenizer(path).stop_ids == (0, 2)
    (path / "chat_template.jinja").unlink()
    assert load_tokenizer(path).stop_ids == (0,)
    assert load_tokenizer(path, stop_tokens=["<|im_start|>"]).stop_ids == (0, 1)


def test_loading_a_tokenizer_json_file_reads_its_directory(tmp_path, backends):
    path = write_dir(tmp_path / "m", backends["qwen"], config={"eos_token": "<|im_end|>"})
    assert load_tokenizer(path / "tokenizer.json").eos_id == 2


def test_prefers_tokenizer_json_over_tokenizer_model(tmp_path, backends):
    path = write_dir(tmp_path / "m", backends["qwen"], config={"eos_token": "<|im_end|>"})
    (path / "tokenizer.model").write_bytes(b"not read")
    assert isinstance(load_tokenizer(path), HFTokenizer)


# ---------------------------------------------------------------------------------------------------------
# Encoding and decoding
# ---------------------------------------------------------------------------------------------------------


def test_round_trip(qwen, llama):
    for tok in (qwen, llama):
        for text in ["What is 2+2? The answer is 4.", "héllo wörld ✓ 日本", " leading and trailing  ", ""]:
            assert tok.decode(tok.encode(text)) == text


def test_special_token_strings_encode_to_their_ids(qwen):
    start, end = ids(qwen, "<|im_start|>", "<|im_end|>")
    encoded = qwen.encode("<|im_start|>user\nHi<|im_end|>")
    assert encoded[0] == start and encoded[-1] == end and encoded.count(start) == 1


def test_decode_stops_at_every_stop_id_and_skips_special_tokens(llama):
    hello, world = llama.encode("Hello"), llama.encode(" world")
    for stop in llama.stop_ids:
        assert llama.decode([llama.bos_id, *hello, stop, *world]) == "Hello"
    header = ids(llama, "<|start_header_id|>")
    assert llama.decode([*header, *hello, *header, *world]) == "Hello world"
    think = llama.token_to_id("<think>")
    assert llama.decode([think, *hello]) == "<think>Hello"  # non-special added tokens are text


def test_decode_tolerates_out_of_range_and_negative_ids(qwen):
    hello = qwen.encode("Hello")
    row = np.array([*hello, qwen.vocab_size, qwen.vocab_size + 1000, -1, -(2**31), *qwen.encode("!")], np.int32)
    assert qwen.decode(row) == "Hello!"


def test_decode_skips_pad_and_bos_unless_pad_is_a_stop(gemma, qwen):
    hello = gemma.encode("Hello")
    assert gemma.decode([gemma.pad_id, gemma.bos_id, *hello, gemma.pad_id, gemma.eos_id, *hello]) == "Hello"
    assert qwen.pad_id in qwen.stop_ids  # Qwen's <|endoftext|> pads and, per generation_config.json, stops
    assert qwen.decode([*qwen.encode("Hello"), qwen.pad_id, *qwen.encode("!")]) == "Hello"


def test_no_double_bos(llama):
    bos, text = llama.bos_id, "Hello there."
    plain = llama.encode(text)
    assert bos not in plain
    assert llama.encode(text, add_special_tokens=True) == [bos, *plain]
    assert encode_prompt(llama, text, templated=False) == [bos, *plain]
    assert encode_prompt(llama, "<|begin_of_text|>" + text, templated=False) == [bos, *plain]
    assert llama.encode("<|begin_of_text|>" + text, add_special_tokens=True) == [bos, *plain]
    rendered = llama.apply_chat_template(USER, date_string="1 Jan 2025")
    templated = encode_prompt(llama, rendered, templated=True)
    assert templated[0] == bos and templated.count(bos) == 1
    assert llama.encode_prompt(rendered, templated=True) == templated


# Expected ids and texts in the tests below marked "transformers 5.24.0" were computed by transformers 5.24.0
# (tokenizers 0.23.3) with AutoTokenizer.from_pretrained on the very files these tests write: `tokenizer(text)`
# for raw prompts, `apply_chat_template(messages, tokenize=True, add_generation_prompt=True)` for chat prompts,
# `decode(ids, skip_special_tokens=True)`.
TEXT = "Hi <think>2+2</think> héllo ✓ 日本"  # an added non-special token, accents, multi-byte characters


def test_prompts_and_decoding_match_transformers(qwen, llama, gemma):
    """Raw prompts get the post-processor's BOS (Llama 3, Gemma), chat prompts the template's BOS only."""
    text_ids = [45, 78, 226, 320, 23, 16, 23, 33, 20, 89, 77, 78, 83, 80, 35, 306, 297, 226, 164, 256, 247, 226, 168,
                251, 104, 168, 256, 111]  # transformers 5.24.0, llama and gemma files (same trained merges)
    assert encode_prompt(llama, TEXT, templated=False) == [0, *text_ids]  # <|begin_of_text|>
    assert encode_prompt(gemma, TEXT, templated=False) == [2, *text_ids]  # <bos>
    assert encode_prompt(qwen, TEXT, templated=False) == [  # transformers 5.24.0: no BOS
        42, 75, 223, 320, 20, 13, 20, 30, 17, 86, 74, 75, 80, 77, 32, 319, 223, 161, 253, 244, 223, 165, 248, 101, 165,
        253, 108]
    chats = {
        qwen: [1, 288, 312, 201, 59, 81, 87, 223, 67, 84, 71, 223, 67, 223, 74, 259, 82, 72, 87, 78, 317, 86, 16, 2,
               201, 1, 293, 201, 311, 268, 297, 13, 20, 33, 2, 201, 1, 273, 314, 86, 201],
        llama: [0, 2, 291, 315, 3, 204, 204, 57, 84, 73, 70, 94, 226, 41, 277, 74, 31, 226, 22, 226, 47, 266, 300, 21,
                23, 26, 204, 204, 4, 2, 296, 3, 204, 204, 314, 271, 300, 16, 23, 36, 4, 2, 276, 317, 89, 3, 204, 204],
        gemma: [2, 4, 296, 204, 314, 271, 300, 16, 23, 36, 5, 204, 4, 287, 279, 204],
    }  # transformers 5.24.0
    for tok, expected in chats.items():
        rendered = tok.apply_chat_template(USER, date_string="1 Jan 2025")
        assert encode_prompt(tok, rendered, templated=True) == expected
    # Special tokens (not stops) are skipped, the added non-special <think> is text, bytes join across tokens.
    for tok, special in ((qwen, "<|im_start|>"), (llama, "<|start_header_id|>"), (gemma, "<start_of_turn>")):
        ids = tok.encode(TEXT)
        assert tok.decode([tok.token_to_id(special), *ids[:3], tok.token_to_id(special), *ids[3:]]) == TEXT


def test_add_bos_token_is_ignored_next_to_tokenizer_json(tmp_path, backends, caplog):
    """transformers 5 drops tokenizer_config.json's add_bos_token when there is a tokenizer.json, whatever the
    tokenizer class (checked: PreTrainedTokenizerFast, LlamaTokenizerFast, Qwen2TokenizerFast, GemmaTokenizerFast):
    BOS is what the post-processor adds. Expected ids: transformers 5.24.0."""
    base = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    hello = [45, 272, 309, 74, 19]  # "Hello there."
    cases = [("llama", {**base, "add_bos_token": False}, [0, *hello]), ("llama", base, [0, *hello]),
             ("llama_no_post", {**base, "add_bos_token": True}, hello), ("llama_no_post", base, hello)]
    for n, (backend, config, expected) in enumerate(cases):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jaxrl.tokenizer"):
            tok = load_tokenizer(write_dir(tmp_path / str(n), backends[backend], config=config))
        assert tok.encode("Hello there.") == hello
        assert encode_prompt(tok, "Hello there.", templated=False) == expected
        assert tok.encode("Hello there.", add_special_tokens=True) == expected
        assert encode_prompt(tok, "", templated=False) == expected[:-len(hello)]
        assert tok.add_bos_token == (expected != hello)
        flag = str(config.get("add_bos_token")).lower()  # "none": not set, no warning
        assert (f"tokenizer_config.json: add_bos_token={flag} is ignored" in caplog.text) == (flag != "none")
    # Gemma-like: <bos> from the post-processor although add_bos_token is false; the chat template writes it once.
    gemma = load_tokenizer(write_dir(tmp_path / "g", backends["gemma"],
                                     config={"chat_template": GEMMA, "add_bos_token": False},
                                     special_tokens_map={"bos_token": "<bos>", "eos_token": "<eos>"}))
    assert encode_prompt(gemma, "Hello there.", templated=False) == [2, *hello]
    assert encode_prompt(gemma, gemma.apply_chat_template([{"role": "user", "content": "Hi"}]), templated=True) == [
        2, 4, 296, 204, 45, 78, 5, 204, 4, 287, 279, 204]


def test_special_tokens_map_is_read_only_without_added_tokens_decoder(tmp_path, backends):
    """transformers 5 reads special_tokens_map.json only for a tokenizer_config.json without added_tokens_decoder.
    transformers 5.24.0: eos <|eot_id|> (4) and no pad token with added_tokens_decoder; eos <|end_of_text|> (1) and
    pad <|eom_id|> (5) without it."""
    base = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    special_tokens_map = {"eos_token": "<|end_of_text|>", "pad_token": "<|eom_id|>"}
    full = {**base, "added_tokens_decoder": added_tokens_decoder(backends["llama"])}
    tok = load_tokenizer(write_dir(tmp_path / "a", backends["llama"], config=full,
                                   special_tokens_map=special_tokens_map))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 4, 4)  # no pad token: EOS pads
    assert tok.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    tok = load_tokenizer(write_dir(tmp_path / "b", backends["llama"], config=base,
                                   special_tokens_map=special_tokens_map))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 5)


def test_clean_up_tokenization_spaces(tmp_path, backends):
    """tokenizer_config.json's clean_up_tokenization_spaces applies to decode, except for a BPE model (transformers 5
    ignores it there: Llama 3 sets it). Expected ids and texts: transformers 5.24.0."""
    text = "Hello , world . Don't ! I 'm sure it 's fine ?"
    ids = [3, 44, 16, 5, 44, 17, 6, 7, 44, 13, 8, 9, 44, 37, 39, 36, 28, 10, 11, 12, 44, 20]
    config = {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    model = unigram(["<pad>", "</s>", "<unk>"])
    clean = load_tokenizer(write_dir(tmp_path / "a", model, config={**config, "clean_up_tokenization_spaces": True}))
    assert clean.encode(text) == ids
    assert clean.decode(ids) == "Hello, world. Don't! I'm sure it's fine?"
    assert load_tokenizer(write_dir(tmp_path / "b", model, config=config)).decode(ids) == text
    llama = load_tokenizer(write_dir(tmp_path / "c", backends["llama"], config={
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True}))
    assert llama.decode(llama.encode(text)) == text


# ---------------------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------------------


def test_chatml_template(qwen):
    assert qwen.apply_chat_template(USER) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")
    conversation = [{"role": "system", "content": "Be brief."}, *USER, {"role": "assistant", "content": "4"}]
    assert qwen.apply_chat_template(conversation, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n")


def test_llama3_template(llama):
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " Hi\n"}]
    assert llama.apply_chat_template(messages, date_string="26 Jul 2024") == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nToday Date: 26 Jul 2024\n\n"
        "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert f"Today Date: {time.strftime('%d %b %Y')}" in llama.apply_chat_template(messages)  # strftime_now


def test_gemma_template_and_raise_exception(gemma):
    messages = [*USER, {"role": "assistant", "content": "4 "}, {"role": "user", "content": "And 3+3?"}]
    assert gemma.apply_chat_template(messages) == (
        "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json.*System role not supported"):
        gemma.apply_chat_template([{"role": "system", "content": "x"}, *USER])
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        gemma.apply_chat_template([*USER, *USER])
    encoded = encode_prompt(gemma, gemma.apply_chat_template(messages), templated=True)
    assert encoded[0] == gemma.bos_id and encoded.count(gemma.bos_id) == 1
    tail = ids(gemma, "<start_of_turn>") + gemma.encode("model\n")
    assert encoded[-len(tail):] == tail
    assert gemma.token_to_id("<end_of_turn>") in gemma.stop_ids  # the template ends turns with it


def test_template_environment_matches_transformers():
    """trim_blocks/lstrip_blocks, tojson (non-ASCII kept, indent), loop controls, {% generation %} blocks."""
    template = ("{% for m in messages %}\n  {% if m.skip %}{% continue %}{% endif %}\n"
                "{{ m | tojson }}|{{ m | tojson(indent=1) }}\n{% endfor %}"
                "{% generation %}{{ eos_token }}{% endgeneration %}")
    tok = HFTokenizer(RawTokenizer.from_str(train_bpe(QWEN_SPECIALS)), eos_token="<|im_end|>",
                      chat_template=template)
    rendered = tok.apply_chat_template([{"content": "é"}, {"skip": True}])
    assert rendered == '{"content": "é"}|{\n "content": "é"\n}\n<|im_end|>'


def test_tools_and_documents_are_none_unless_given():
    """As in transformers, `tools` and `documents` are defined (None): a template's `is not none` test is false."""
    template = ("{% if tools is not none %}T{{ tools | length }}|{% endif %}"
                "{% if documents is not none %}D|{% endif %}{{ messages[0].content }}")
    tok = HFTokenizer(RawTokenizer.from_str(train_bpe(QWEN_SPECIALS)), eos_token="<|im_end|>",
                      chat_template=template)
    assert tok.apply_chat_template(USER) == "What is 2+2?"
    assert tok.apply_chat_template(USER, tools=[{"name": "f"}], documents=[]) == "T1|D|What is 2+2?"


def test_template_sources(tmp_path, backends):
    qwen_json = backends["qwen"]
    as_list = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHATML}]
    tok = load_tokenizer(write_dir(tmp_path / "a", qwen_json, config={"eos_token": "<|im_end|>",
                                                                        "chat_template": as_list}))
    assert tok.chat_template == CHATML
    tok = load_tokenizer(write_dir(tmp_path / "b", qwen_json, config={"eos_token": "<|im_end|>"}, jinja="J"))
    assert tok.chat_template == "J" and tok.apply_chat_template(USER) == "J"
    tok = load_tokenizer(write_dir(tmp_path / "c", qwen_json, config={"eos_token": "<|im_end|>"}))
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(USER)


# ---------------------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------------------


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere: no such tokenizer"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no tokenizer.json or tokenizer.model"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(TokenizerError, match="weights.bin: not a tokenizer file"):
        load_tokenizer(tmp_path / "weights.bin")


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                                  "tokenizer.json"])
def test_malformed_json_names_file_and_line(tmp_path, backends, name):
    path = write_dir(tmp_path / "m", backends["qwen"], config={"eos_token": "<|im_end|>"})
    (path / name).write_text('{\n  "eos_token": "<|im_end|>",\n  "pad_token": ,\n}\n')
    with pytest.raises(TokenizerError, match=rf"{name}:3: invalid JSON"):
        load_tokenizer(path)


def test_bad_values_name_file_and_key(tmp_path, backends):
    qwen_json = backends["qwen"]
    cases = [
        (dict(config={"eos_token": "<|im_end|>", "bos_token": "<s>"}),
         r"tokenizer_config\.json: bos_token '<s>' is not in the vocabulary of .*tokenizer\.json"),
        (dict(config={"eos_token": "<|im_end|>"}, special_tokens_map={"pad_token": {"content": "<pad>"}}),
         r"special_tokens_map\.json: pad_token '<pad>' is not in the vocabulary"),
        (dict(config={"eos_token": {"text": "<|im_end|>"}}),
         r"tokenizer_config\.json: eos_token must be a string, null or an object with a string 'content'"),
        (dict(config={"eos_token": "<|im_end|>", "chat_template": [{"name": "tool_use", "template": "t"}]}),
         r"tokenizer_config\.json: chat_template lists no 'default' template"),
        (dict(config={"eos_token": "<|im_end|>", "chat_template": [{"name": "default"}]}),
         r"tokenizer_config\.json: chat_template\[0\] must be an object"),
        (dict(config={"eos_token": "<|im_end|>"}, generation_config={"eos_token_id": [2, 10**6]}),
         r"generation_config\.json: eos_token_id 1000000 is outside the vocabulary"),
        (dict(config={"eos_token": "<|im_end|>"}, generation_config={"eos_token_id": "2"}),
         r"generation_config\.json: eos_token_id must be an int or a list of ints"),
        (dict(config={"eos_token": "<|im_end|>", "add_bos_token": "yes"}),
         r"tokenizer_config\.json: add_bos_token must be"),
        (dict(config={"eos_token": "<|im_end|>", "clean_up_tokenization_spaces": 1}),
         r"tokenizer_config\.json: clean_up_tokenization_spaces must be true or false"),
        (dict(config={"bos_token": None}), r"tokenizer\.json: no EOS"),
        (dict(config="[1, 2]"), r"tokenizer_config\.json: expected a JSON object"),
        (dict(config={"eos_token": "<|im_end|>"}, jinja="{% for m in messages %}\n{{ m }"),
         r"chat_template\.jinja: invalid jinja template at line 2"),
    ]
    for n, (files, pattern) in enumerate(cases):
        with pytest.raises((TokenizerError, ChatTemplateError), match=pattern):
            load_tokenizer(write_dir(tmp_path / str(n), qwen_json, **files))
    with pytest.raises(TokenizerError, match=r"stop_tokens argument: stop token '<nope>' is not in the vocabulary"):
        load_tokenizer(write_dir(tmp_path / "s", qwen_json, config={"eos_token": "<|im_end|>"}),
                       stop_tokens=["<nope>"])
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: cannot load the tokenizer"):
        load_tokenizer(tmp_path / "t")


# ---------------------------------------------------------------------------------------------------------
# Batch layouts
# ---------------------------------------------------------------------------------------------------------


def test_prompt_layout_without_bos(qwen):
    texts = ["Hi", qwen.apply_chat_template(USER)]
    for templated in (False, True):
        tokens, valid = encode_prompts(qwen, texts, 64, templated=templated)
        for row, text in enumerate(texts):
            encoded = qwen.encode(text)
            assert valid[row].sum() == len(encoded) and valid[row, -len(encoded):].all()
            assert tokens[row, -len(encoded):].tolist() == encoded  # no BOS: the text starts right away
            assert (tokens[row, :-len(encoded)] == qwen.pad_id).all()
    full, prompt_valid, mask = encode_examples(qwen, texts[1:], ["4"], 64, templated=True)
    assert full.shape == (1, 72) and prompt_valid.sum() == len(qwen.encode(texts[1]))
    assert mask.sum() == len(qwen.encode("4")) + 1
    assert full[0, 64 + mask.sum() - 1] == qwen.eos_id and (full[0, 64 + mask.sum():] == qwen.pad_id).all()


def test_prompt_layout_with_bos(llama):
    rendered = llama.apply_chat_template(USER, date_string="1 Jan 2025")
    tokens, valid = encode_prompts(llama, ["Hi", rendered], 48)  # untemplated: BOS prepended (once)
    first = np.argmax(valid, axis=1)
    assert tokens[0, first[0]] == llama.bos_id and tokens[0, first[0] + 1:].tolist() == llama.encode("Hi")
    assert tokens[1, first[1]] == llama.bos_id != tokens[1, first[1] + 1]  # the BOS text is not doubled
    tokens, valid = encode_prompts(llama, [rendered], 48, templated=True)
    assert (tokens[valid] == llama.bos_id).sum() == 1 and tokens[0, np.argmax(valid[0])] == llama.bos_id
    assert (tokens[~valid] == llama.pad_id).all() and llama.pad_id == llama.eos_id
    with pytest.raises(ValueError, match="more than the prompt length 4"):
        encode_prompts(llama, [rendered], 4, templated=True)


def test_sentencepiece_and_hf_share_the_interface(qwen):
    for cls in (SentencePieceTokenizer, HFTokenizer):
        for name in ("encode", "decode", "apply_chat_template", "encode_prompt", "token_to_id", "vocab_size"):
            assert hasattr(cls, name)
    assert isinstance(qwen.stop_ids, tuple) and qwen.stop_ids[0] == qwen.eos_id
