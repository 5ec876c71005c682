"""The sentencepiece tokenizer of the built-in task and the batch layouts built from it."""

import io
import json

import numpy as np
import pytest
import sentencepiece as spm

from jaxrl.data import arithmetic
from jaxrl.tokenizer import (SentencePieceTokenizer, Tokenizer, TokenizerError, encode_examples, encode_prompt,
                             encode_prompts, load_tokenizer, train_tokenizer)


@pytest.fixture(scope="module")
def tokenizer():
    train, _ = arithmetic.make_splits(arithmetic.ArithmeticTaskConfig(num_train=500, num_eval=10), 0)
    return train_tokenizer(arithmetic.tokenizer_corpus(train), 32)


def test_round_trip_and_digits_split(tokenizer, tmp_path):
    text = "23+8=31,31-5=26 #### 26"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("1234")]
    assert "".join(pieces) == "1234" and all(len(p) <= 1 for p in pieces)
    tokenizer.save(tmp_path / "t.model")
    assert Tokenizer.from_file(tmp_path / "t.model").encode(text) == tokenizer.encode(text)


def test_training_is_deterministic(tokenizer):
    train, _ = arithmetic.make_splits(arithmetic.ArithmeticTaskConfig(num_train=500, num_eval=10), 0)
    assert train_tokenizer(arithmetic.tokenizer_corpus(train), 32).model_proto == tokenizer.model_proto


def test_text_is_not_normalised():
    """Newlines, tabs, repeated and leading spaces and characters like ½ survive encode/decode; sentencepiece's
    default normaliser turned them into spaces (a policy could never write a newline) and ½ into 1⁄2."""
    code = "def f(x):\n    if x:\n        return x\n\treturn 0"
    texts = [code, "Write a function.\nIt returns ½ or ２.", "a  b", " lead\n\n"]
    tokenizer = train_tokenizer(texts * 30, 64)
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.token_to_id("\n") is not None  # a policy can emit a newline
    assert train_tokenizer(texts * 30, 64).model_proto == tokenizer.model_proto  # still deterministic


def test_arithmetic_vocabulary_is_what_the_default_normaliser_gave(tokenizer):
    """The built-in task's text is ASCII with single spaces, so not normalising it changes nothing: same pieces
    and encodings as a model trained with sentencepiece's default normaliser (the one used before)."""
    train, _ = arithmetic.make_splits(arithmetic.ArithmeticTaskConfig(num_train=500, num_eval=10), 0)
    corpus = arithmetic.tokenizer_corpus(train)
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=proto, vocab_size=32, model_type="bpe", split_digits=True,
        hard_vocab_limit=False, character_coverage=1.0, num_threads=1, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        minloglevel=2)
    default = SentencePieceTokenizer(proto.getvalue())
    pieces = lambda t: [t._sp.id_to_piece(i) for i in range(t.vocab_size)]  # noqa: E731
    assert pieces(tokenizer) == pieces(default)
    assert [tokenizer.encode(t) for t in corpus] == [default.encode(t) for t in corpus]


def test_decode_stops_at_eos_and_tolerates_out_of_range_ids(tokenizer):
    ids = [tokenizer.bos_id, *tokenizer.encode("12"), tokenizer.eos_id, *tokenizer.encode("99")]
    assert tokenizer.decode(ids) == "12"
    assert "12" in tokenizer.decode([*tokenizer.encode("12"), tokenizer.vocab_size + 3, -1])


def test_layouts(tokenizer):
    tokens, valid = encode_prompts(tokenizer, ["1+2=", "10+20-3="], 12)
    assert tokens.shape == (2, 12) and valid[:, -1].all() and not valid[0, 0]
    assert tokens[0, np.argmax(valid[0])] == tokenizer.bos_id  # BOS right after the left padding
    with pytest.raises(ValueError, match="more than the prompt length 3"):
        encode_prompts(tokenizer, ["10+20-3="], 3)
    full, prompt_valid, mask = encode_examples(tokenizer, ["1+2="], ["1+2=3 #### 3"], 8, 16)
    assert full.shape == (1, 24) and mask.sum() == len(tokenizer.encode("1+2=3 #### 3")) + 1
    assert full[0, 8 + mask.sum() - 1] == tokenizer.eos_id


def test_common_interface(tokenizer):
    assert Tokenizer is SentencePieceTokenizer
    assert tokenizer.stop_ids == (tokenizer.eos_id,) and tokenizer.chat_template is None
    assert tokenizer.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
                                        "unk_token": "<unk>"}
    ids = tokenizer.encode("1+2=")
    assert tokenizer.add_bos_token and tokenizer.encode("1+2=", add_special_tokens=True) == [tokenizer.bos_id, *ids]
    assert encode_prompt(tokenizer, "1+2=", templated=False) == [tokenizer.bos_id, *ids]  # as before: BOS + text
    assert encode_prompt(tokenizer, "1+2=", templated=True) == ids
    assert tokenizer.encode("<s>1+2=</s>") == [tokenizer.bos_id, *ids, tokenizer.eos_id]  # control pieces in text


def test_model_directory(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "tokenizer.model")
    assert load_tokenizer(tmp_path / "tokenizer.model").model_proto == tokenizer.model_proto
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": None, "chat_template": template}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, SentencePieceTokenizer) and tok.chat_template == template
    assert tok.pad_id == tok.eos_id == 3 and tok.stop_ids == (3, 7)  # no pad token: EOS pads
    assert tok.decode([*tok.encode("12"), 7, *tok.encode("34")]) == "12"
    rendered = tok.apply_chat_template([{"role": "user", "content": "1+2="}])
    assert rendered == "<s>1+2="
    assert encode_prompt(tok, rendered, templated=True) == encode_prompt(tok, "1+2=", templated=False)
    templated, _ = encode_prompts(tok, [rendered], 8, templated=True)
    assert (templated == encode_prompts(tok, ["1+2="], 8)[0]).all()

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert encode_prompt(load_tokenizer(tmp_path), "1+2=", templated=False) == tokenizer.encode("1+2=")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>"}))
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: bos_token '<bos>' is not in the vocab"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"garbage")
    with pytest.raises(TokenizerError, match=r"tokenizer\.model: not a sentencepiece model"):
        load_tokenizer(tmp_path)


def test_held_out_problems_never_in_training_split():
    config = arithmetic.ArithmeticTaskConfig(num_train=5000, num_eval=256)
    train, held_out = arithmetic.make_splits(config, 7)
    assert len(held_out) == 256 and not {p.prompt for p in train} & {p.prompt for p in held_out}
    assert arithmetic.make_splits(config, 7)[1] == held_out


def test_sloppy_teacher_forgets_carries_only():
    problem = arithmetic.Problem(23, (("+", 8), ("-", 5), ("+", 1)))
    assert arithmetic.solution(problem) == "23+8=31,31-5=26,26+1=27 #### 27"
    always = arithmetic.solution(problem, 1.0, np.random.default_rng(0))
    assert always == "23+8=21,21-5=26,26+1=27 #### 27"  # 23+8 carries (forgot); 21-5 borrows (forgot: 26)
    assert problem.answer == 27 and problem.prompt == "23+8-5+1="


def test_encode_examples_refuses_prompts_and_completions_of_different_counts(tokenizer):
    """A missing completion was a row of padding with an all-false mask (trained on nothing, silently)."""
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        encode_examples(tokenizer, ["1+2=", "3+4="], ["3"], 8, 8)
    with pytest.raises(ValueError, match="1 prompts but 2 completions"):
        encode_examples(tokenizer, ["1+2="], ["3", "7"], 8, 8)


def test_long_texts_are_trained_on():
    """sentencepiece skips texts over 4192 bytes by default: a character only they hold encoded as <unk>."""
    long = "x = 1\n" * 1000 + "Ω"
    tokenizer = train_tokenizer(["abc"] * 10 + [long], 24)
    assert tokenizer.token_to_id("Ω") is not None
    assert tokenizer.decode(tokenizer.encode(long)) == long


def test_a_corrupted_model_file_is_named(tmp_path):
    (tmp_path / "t.model").write_bytes(b"garbage")
    with pytest.raises(TokenizerError, match=r"t\.model: not a sentencepiece model"):
        SentencePieceTokenizer.from_file(tmp_path / "t.model")
    with pytest.raises(TokenizerError, match="not a sentencepiece model"):
        SentencePieceTokenizer(b"garbage")


def test_unicode_round_trips_and_a_lone_surrogate_is_named():
    texts = ["emoji 😀, CJK 中文, e\u0301 combining", ""]
    tokenizer = train_tokenizer(texts * 20, 60)
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    # json.loads('"\\ud83d"') gives such a str; sentencepiece's error named neither the text nor the cause
    with pytest.raises(ValueError, match=r"lone surrogate '\\ud83d' at 3 .*'hi \\ud83d there'"):
        tokenizer.encode("hi \ud83d there")
