"""The jitted KV-cached sampler against a naive reference (full forward pass per step)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import models
from jaxrl.sampling import (FINISH_EOS, FINISH_LENGTH, SamplingConfig, compiled_programs, filter_logits,
                            sample, sample_token)

CONFIG = models.ModelConfig(vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=8, intermediate_size=64)
EOS, PAD = 3, 0


def _prompts():
    tokens = np.array([[0, 0, 2, 5, 6, 7], [2, 9, 8, 7, 6, 5], [0, 0, 0, 0, 2, 11]], np.int32)
    return jnp.asarray(tokens), jnp.asarray(tokens != 0)


_jit_forward = jax.jit(models.forward)


def _naive_sample(policy, tokens, valid, rng, config, group_size=1):
    """The reference sampler: prompts repeated per sample, a full forward pass (no cache) over the whole
    fixed-length buffer for every new token, the same per-step keys and filters as the cached sampler."""
    tokens, valid = jnp.repeat(tokens, group_size, 0), jnp.repeat(valid, group_size, 0)
    prompt_len, new = tokens.shape[1], config.max_new_tokens
    tokens = jnp.concatenate([tokens, jnp.zeros((tokens.shape[0], new), jnp.int32)], 1)
    valid = jnp.concatenate([valid, jnp.ones((valid.shape[0], new), bool)], 1)  # causal: the future is unseen
    for step in range(new):
        logits = _jit_forward(policy, tokens, valid)[:, prompt_len + step - 1]
        nxt, _ = sample_token(logits, jax.random.fold_in(rng, step), config)
        tokens = tokens.at[:, prompt_len + step].set(nxt)
    return tokens[:, prompt_len:]


def test_greedy_matches_naive_reference():
    policy = models.init(CONFIG, 0)
    tokens, valid = _prompts()
    config = SamplingConfig(max_new_tokens=10, temperature=0.0)
    rollout = sample(policy, tokens, valid, jax.random.key(0), config, eos_id=-1, pad_id=PAD)
    np.testing.assert_array_equal(rollout.completion_tokens, _naive_sample(policy, tokens, valid, jax.random.key(0), config))
    assert rollout.completion_mask.all() and (rollout.finish_reason == FINISH_LENGTH).all()


def test_sampled_logps_match_full_forward():
    policy = models.init(CONFIG, 1)
    tokens, valid = _prompts()
    rollout = sample(policy, tokens, valid, jax.random.key(3), SamplingConfig(max_new_tokens=8), EOS, PAD)
    full_valid = jnp.concatenate([valid, jnp.ones(rollout.completion_mask.shape, bool)], 1)
    logp = jax.nn.log_softmax(models.forward(policy, rollout.tokens, full_valid), -1)
    prompt_len = tokens.shape[1]
    expected = jnp.take_along_axis(logp[:, prompt_len - 1:-1], rollout.completion_tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.where(rollout.completion_mask, rollout.sampler_logp, 0),
                               np.where(rollout.completion_mask, expected, 0), atol=1e-5)


def test_sampling_is_reproducible_for_a_seed():
    policy = models.init(CONFIG, 0)
    tokens, valid = _prompts()
    config = SamplingConfig(max_new_tokens=12, temperature=1.0, top_k=10, top_p=0.9)
    a = sample(policy, tokens, valid, jax.random.key(7), config, EOS, PAD)
    b = sample(policy, tokens, valid, jax.random.key(7), config, EOS, PAD)
    c = sample(policy, tokens, valid, jax.random.key(8), config, EOS, PAD)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.tokens, c.tokens)


def test_stops_at_eos_and_masks_after_it():
    policy = models.init(CONFIG, 0)
    tokens, valid = _prompts()
    # Make EOS overwhelmingly likely by making it the greedy choice: use the greedy token as "EOS".
    first = sample(policy, tokens, valid, jax.random.key(0), SamplingConfig(1, 0.0), -1, PAD).completion_tokens
    eos = int(first[0, 0])
    rollout = sample(policy, tokens, valid, jax.random.key(0), SamplingConfig(6, 0.0), eos, PAD)
    assert rollout.finish_reason[0] == FINISH_EOS
    assert rollout.completion_mask[0].tolist() == [True] + [False] * 5
    assert (rollout.completion_tokens[0, 1:] == PAD).all()


def test_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    top2 = filter_logits(logits, SamplingConfig(top_k=2))
    assert np.isfinite(top2[0, :2]).all() and np.isneginf(top2[0, 2:]).all()
    nucleus = filter_logits(logits, SamplingConfig(top_p=0.7))  # 0.5 + 0.3 reaches 0.7
    assert np.isfinite(nucleus[0, :2]).all() and np.isneginf(nucleus[0, 2:]).all()
    tiny = filter_logits(logits, SamplingConfig(top_p=0.01))  # the top token always survives
    assert np.isfinite(tiny[0, 0]) and np.isneginf(tiny[0, 1:]).all()
    hot = filter_logits(logits, SamplingConfig(temperature=2.0))
    np.testing.assert_allclose(hot, logits / 2.0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("group_size", [1, 4])
def test_same_tokens_as_the_naive_sampler_with_and_without_prefix_sharing(temperature, group_size):
    policy = models.init(CONFIG, 2)
    tokens, valid = _prompts()
    config = SamplingConfig(max_new_tokens=10, temperature=temperature, top_k=12)
    key = jax.random.key(11)
    shared = sample(policy, tokens, valid, key, config, -1, PAD, group_size=group_size)
    repeated = sample(policy, jnp.repeat(tokens, group_size, 0), jnp.repeat(valid, group_size, 0), key, config,
                      -1, PAD)
    naive = _naive_sample(policy, tokens, valid, key, config, group_size)
    np.testing.assert_array_equal(shared.completion_tokens, naive)
    np.testing.assert_array_equal(repeated.completion_tokens, naive)
    np.testing.assert_array_equal(shared.tokens[:, :tokens.shape[1]], jnp.repeat(tokens, group_size, 0))
    np.testing.assert_allclose(shared.sampler_logp, repeated.sampler_logp, atol=1e-5)
    if temperature and group_size > 1:  # the samples of one prompt differ from each other
        assert len({tuple(row) for row in np.asarray(shared.completion_tokens[:group_size])}) > 1


def test_policy_logp_is_the_unmodified_distribution():
    policy = models.init(CONFIG, 1)
    tokens, valid = _prompts()
    config = SamplingConfig(max_new_tokens=8, temperature=0.7, top_k=5, min_p=0.05, policy_logp=True)
    rollout = sample(policy, tokens, valid, jax.random.key(3), config, EOS, PAD, group_size=2)
    full_valid = jnp.concatenate([rollout.prompt_valid, jnp.ones(rollout.completion_mask.shape, bool)], 1)
    logp = jax.nn.log_softmax(models.forward(policy, rollout.tokens, full_valid), -1)
    expected = jnp.take_along_axis(logp[:, tokens.shape[1] - 1:-1], rollout.completion_tokens[..., None], -1)[..., 0]
    mask = rollout.completion_mask
    np.testing.assert_allclose(np.where(mask, rollout.policy_logp, 0), np.where(mask, expected, 0), atol=1e-5)
    assert (np.asarray(rollout.sampler_logp)[mask] > np.asarray(rollout.policy_logp)[mask]).mean() > 0.5
    assert sample(policy, tokens, valid, jax.random.key(3), SamplingConfig(4), EOS, PAD).policy_logp is None


def test_top_k_beyond_the_vocabulary_keeps_everything():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    np.testing.assert_array_equal(filter_logits(logits, SamplingConfig(top_k=100)), logits)


def test_min_p_filter():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_logits(logits, SamplingConfig(min_p=0.2))  # threshold 0.2 * 0.5 = 0.1
    assert np.isfinite(kept[0, :3]).all() and np.isneginf(kept[0, 3])


@pytest.mark.parametrize("edit, match", [
    (lambda t, v: (t, v.at[1].set(False)), "prompt row 1 is empty"),
    (lambda t, v: (t.at[0, 5].set(CONFIG.vocab_size), v), "row 0, position 5: token id 24 is outside"),
    (lambda t, v: (t.at[2, 5].set(-1), v), "token id -1 is outside"),
    (lambda t, v: (t, v.at[0, 5].set(False)), "not left-padded"),
    (lambda t, v: (t[:0], v[:0]), r"prompt_tokens \(0, 6\) has no rows"),  # was a ZeroDivisionError while tracing
    # a padding slot beyond the embedding table read NaN, and masked attention spread it over the row
    (lambda t, v: (t.at[2, 1].set(CONFIG.vocab_size), v), r"row 2, position 1 \(a padding slot\): token id 24"),
])
def test_bad_prompts_stop_before_compiling(edit, match):
    policy = models.init(CONFIG, 0)
    tokens, valid = edit(*_prompts())
    before = compiled_programs()
    with pytest.raises(ValueError, match=match):
        sample(policy, tokens, valid, jax.random.key(0), SamplingConfig(max_new_tokens=3), EOS, PAD)
    assert compiled_programs() == before


def test_bad_lengths_and_settings():
    short = models.init(models.ModelConfig(**{**CONFIG.__dict__, "max_position_embeddings": 10}), 0)
    tokens, valid = _prompts()
    with pytest.raises(ValueError, match="prompt length 6 \\+ max_new_tokens 5 = 11 exceeds the model's "
                                         "max_position_embeddings \\(10\\)"):
        sample(short, tokens, valid, jax.random.key(0), SamplingConfig(max_new_tokens=5), EOS, PAD)
    with pytest.raises(ValueError, match="max_new_tokens must be > 0"):
        SamplingConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature must be >= 0, got nan"):  # NaN logits: token garbage
        SamplingConfig(temperature=float("nan"))
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        sample(models.init(CONFIG, 0), tokens, valid, jax.random.key(0), SamplingConfig(2), EOS, PAD, group_size=0)
    with pytest.raises(ValueError, match=r"pad_id: token id 24 is outside the model's vocabulary \[0, 24\)"):
        sample(models.init(CONFIG, 0), tokens, valid, jax.random.key(0), SamplingConfig(2), EOS, CONFIG.vocab_size)


@pytest.mark.parametrize("eos_id, stop_sequences, match", [
    (CONFIG.vocab_size, (), r"eos_id: token id 24 is outside the model's vocabulary \[0, 24\)"),  # never stops
    ((EOS, -2), (), "eos_id: token id -2 is outside"),
    ("2", (), "eos_id: expected a sequence of token ids, got '2'"),
    (EOS, (5, 6), r"stop_sequences\[0\]: expected a sequence of token ids, got 5"),  # not ((5, 6),)
    (EOS, (("a",),), r"stop_sequences\[0\]: token ids must be integers, got 'a'"),
    (EOS, ((5, 24),), r"stop_sequences\[0\]: token id 24 is outside"),
    (EOS, ((5,), (-1,)), r"stop_sequences\[1\]: token id -1 is outside"),
])
def test_bad_stop_ids_stop_before_compiling(eos_id, stop_sequences, match):
    tokens, valid = _prompts()
    before = compiled_programs()
    with pytest.raises(ValueError, match=match):
        sample(models.init(CONFIG, 0), tokens, valid, jax.random.key(0), SamplingConfig(2), eos_id, PAD,
               stop_sequences=stop_sequences)
    assert compiled_programs() == before


def test_stop_ids_given_as_lists_are_the_tuples():
    policy, (tokens, valid) = models.init(CONFIG, 0), _prompts()
    args = (policy, tokens, valid, jax.random.key(3), SamplingConfig(4))
    as_lists = sample(*args, [EOS, 5], PAD, stop_sequences=[[7, 8]])
    as_tuples = sample(*args, (EOS, 5), PAD, stop_sequences=((7, 8),))
    np.testing.assert_array_equal(as_lists.tokens, as_tuples.tokens)


def test_a_long_run_with_varying_prompt_lengths_compiles_few_sampler_programs(tmp_path):
    """200 RL steps on prompts of 2 to 6 operations: the sampler compiles a handful of programs (prompts are
    padded to one of `data.prompt_buckets` lengths), reported in metrics.jsonl as sampler/compiled_programs."""
    from jaxrl import loop
    from jaxrl.config import Config
    from jaxrl.configlib import load_config
    from jaxrl.metrics import read_metrics

    config = load_config(Config, None, [
        "model.hidden_size=32", "model.num_layers=1", "model.head_dim=8", "model.intermediate_size=64",
        "task.min_steps=2", "task.max_steps=6", "task.num_train=400", "task.num_eval=8", "sft.steps=0",
        "rl.steps=200", "rl.prompts_per_step=2", "rl.group_size=2", "rl.sampling.max_new_tokens=4",
        "eval.every=100", "eval.batch_size=8", "checkpoint.every=0", "progress=false",
        f"output_dir={tmp_path}"])
    before = compiled_programs()
    loop.run(config)
    counts = [r["sampler/compiled_programs"] - before for r in read_metrics(tmp_path / "metrics.jsonl")
              if "sampler/compiled_programs" in r]
    assert len(counts) == 200 and counts[-1] <= 8, counts[-1]
    lengths = {r["sampler/prompt_length"] for r in read_metrics(tmp_path / "metrics.jsonl")
               if "sampler/prompt_length" in r}
    assert len(lengths) >= 2, lengths  # the batches really were padded to different lengths


def test_prompt_length_buckets():
    from jaxrl.loop import prompt_length_buckets

    assert prompt_length_buckets(300, 4) == (40, 80, 152, 304)
    assert prompt_length_buckets(20, 4) == (8, 16, 24)  # distinct lengths only
    assert prompt_length_buckets(5, 3) == (8,)
    assert prompt_length_buckets(300, 1) == (304,)


def test_inverse_cdf_sampling_follows_the_distribution():
    from jaxrl.sampling import inverse_cdf_sample

    probs = jnp.array([[0.5, 0.0, 0.3, 0.2, 0.0]] * 20000)
    draws = np.asarray(inverse_cdf_sample(probs, jax.random.key(0)))
    counts = np.bincount(draws, minlength=5) / draws.size
    np.testing.assert_allclose(counts, [0.5, 0.0, 0.3, 0.2, 0.0], atol=0.015)  # ~4 sigma at n = 20000
    assert counts[1] == 0 and counts[4] == 0  # zero-probability entries are never drawn
    one_hot = jnp.zeros((3, 7)).at[:, 6].set(1.0)
    assert (np.asarray(inverse_cdf_sample(one_hot, jax.random.key(1))) == 6).all()


def test_inverse_cdf_sampling_across_blocks():
    """Two-level draw: blocks of 4 over 10 entries (a padded last block), an all-zero block in the middle."""
    from jaxrl.sampling import inverse_cdf_sample

    target = np.array([0.05, 0.0, 0.15, 0.1, 0.0, 0.0, 0.0, 0.0, 0.4, 0.3], np.float32)
    probs = jnp.asarray(np.tile(target * 7.0, (40000, 1)))  # any total
    draws = np.asarray(inverse_cdf_sample(probs, jax.random.key(3), block=4))
    counts = np.bincount(draws, minlength=10) / draws.size
    np.testing.assert_allclose(counts, target, atol=0.01)  # > 4 sigma at n = 40000
    assert (counts[target == 0] == 0).all()
    last_only = jnp.zeros((5, 10)).at[:, 9].set(1e-30)
    assert (np.asarray(inverse_cdf_sample(last_only, jax.random.key(4), block=4)) == 9).all()


@pytest.mark.parametrize("mass, mass_after, u", [
    (0.05010560527443886, 0.7346861362457275, 0.06384575366973877),
    (0.8812971115112305, 0.8142120242118835, 0.5197831392288208),
])
def test_inverse_cdf_sampling_never_draws_from_a_rounding_gap(monkeypatch, mass, mass_after, u):
    """In float32 the second block's start (its cdf minus its mass) rounds above the first block's cdf; a
    uniform value (a multiple of 2**-23) between the two once drew the block's zero-probability first entry."""
    from jaxrl.sampling import inverse_cdf_sample

    assert (np.float32(u) * 2 ** 23).is_integer()  # jax.random.uniform can return it
    probs = jnp.zeros((1, 8), jnp.float32).at[0, 0].set(mass).at[0, 5].set(mass_after)
    monkeypatch.setattr(jax.random, "uniform", lambda key, shape, dtype: jnp.full(shape, u, dtype))
    assert int(inverse_cdf_sample(probs, jax.random.key(0), block=4)[0]) == 5


def test_a_row_without_probability_mass_samples_inside_the_vocabulary():
    from jaxrl.sampling import SamplingConfig, sample_token

    logits = jnp.full((2, 300), jnp.nan).at[1].set(0.0)
    tokens, _ = sample_token(logits, jax.random.key(0), SamplingConfig(temperature=1.0))
    assert int(tokens[0]) in range(300)


def test_first_max_index_matches_argmax_with_ties():
    from jaxrl.sampling import first_max_index

    x = np.random.default_rng(0).integers(0, 5, (200, 33)).astype(np.float32)  # many ties
    np.testing.assert_array_equal(np.asarray(first_max_index(jnp.asarray(x))), np.argmax(x, axis=-1))
    assert int(first_max_index(jnp.full((1, 4), jnp.nan))[0]) == 3  # stays inside the vocabulary


def test_decode_segments():
    from jaxrl.sampling import decode_segments

    assert decode_segments(128, 4) == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert decode_segments(40, 4) == [(0, 14), (14, 28), (28, 40)]  # segments of at least 16 steps (rounded)
    assert decode_segments(10, 4) == [(0, 10)]
    assert decode_segments(100, 1) == [(0, 100)]
    with pytest.raises(ValueError, match="decode_segments must be >= 1"):
        SamplingConfig(decode_segments=0)
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'compute' or 'int8'"):
        SamplingConfig(kv_cache_dtype="int4")


@pytest.mark.parametrize("group_size", [1, 3])
def test_segmented_decoding_gives_the_naive_tokens(group_size):
    """40 new tokens in 3 segments (the cache grows between them) against one loop and the naive sampler."""
    policy = models.init(CONFIG, 4)
    tokens, valid = _prompts()
    config = SamplingConfig(max_new_tokens=40, temperature=1.0, decode_segments=4)
    key = jax.random.key(5)
    segmented = sample(policy, tokens, valid, key, config, -1, PAD, group_size=group_size)
    one_loop = sample(policy, tokens, valid, key, SamplingConfig(max_new_tokens=40, decode_segments=1), -1, PAD,
                      group_size=group_size)
    np.testing.assert_array_equal(segmented.completion_tokens, one_loop.completion_tokens)
    np.testing.assert_allclose(segmented.sampler_logp, one_loop.sampler_logp, atol=1e-5)
    np.testing.assert_array_equal(segmented.completion_tokens, _naive_sample(policy, tokens, valid, key, config,
                                                                             group_size))


def test_segments_stop_early_when_every_sequence_has_finished():
    policy = models.init(CONFIG, 0)
    tokens, valid = _prompts()
    greedy = SamplingConfig(max_new_tokens=40, temperature=0.0, decode_segments=4)
    eos = int(sample(policy, tokens, valid, jax.random.key(0), SamplingConfig(1, 0.0), -1, PAD).tokens[0, -1])
    rollout = sample(policy, tokens[:1], valid[:1], jax.random.key(0), greedy, eos, PAD)
    assert rollout.completion_mask[0].tolist() == [True] + [False] * 39
    assert (rollout.completion_tokens[0, 1:] == PAD).all() and rollout.finish_reason[0] == FINISH_EOS


@pytest.mark.parametrize("group_size", [1, 2])
def test_int8_kv_cache_log_probs_stay_close_to_the_policy(group_size):
    """With an int8 cache the sampled tokens' log-probs stay within 0.02 nats of a full float32 forward pass."""
    policy = models.init(CONFIG, 1)
    tokens, valid = _prompts()
    config = SamplingConfig(max_new_tokens=20, kv_cache_dtype="int8")
    rollout = sample(policy, tokens, valid, jax.random.key(3), config, -1, PAD, group_size=group_size)
    full_valid = jnp.concatenate([jnp.repeat(valid, group_size, 0), jnp.ones(rollout.completion_mask.shape, bool)], 1)
    logp = jax.nn.log_softmax(models.forward(policy, rollout.tokens, full_valid), -1)
    expected = jnp.take_along_axis(logp[:, tokens.shape[1] - 1:-1], rollout.completion_tokens[..., None], -1)[..., 0]
    error = np.abs(np.asarray(rollout.sampler_logp - expected))
    assert error.max() < 0.02, error.max()
    assert error.max() > 0  # the cache really was quantized


def test_stop_sequences_end_completions_and_match_only_inside_them():
    policy = models.init(CONFIG, 0)
    tokens, valid = _prompts()
    greedy = SamplingConfig(max_new_tokens=10, temperature=0.0)
    free = sample(policy, tokens, valid, jax.random.key(0), greedy, -1, PAD)
    completion = np.asarray(free.completion_tokens)
    stop = tuple(int(t) for t in completion[0, 2:4])
    stopped = sample(policy, tokens, valid, jax.random.key(0), greedy, -1, PAD, stop_sequences=(stop,))
    first = next(i for i in range(1, 10) if tuple(completion[0, i - 1:i + 1]) == stop)  # the earliest match
    assert np.asarray(stopped.completion_mask[0]).tolist() == [True] * (first + 1) + [False] * (9 - first)
    assert int(stopped.finish_reason[0]) == FINISH_EOS
    for row in range(1, 3):  # rows whose greedy completion never contains the sequence are untouched
        if not any(tuple(completion[row, i - 1:i + 1]) == stop for i in range(1, 10)):
            np.testing.assert_array_equal(stopped.completion_tokens[row], completion[row])
    # the prompt's last token followed by the first completion token is not a match: stops look only inside
    # the completion
    spanning = (int(tokens[0, -1]), int(completion[0, 0]))
    if spanning not in {tuple(completion[0, i - 1:i + 1]) for i in range(1, 10)}:
        run = sample(policy, tokens, valid, jax.random.key(0), greedy, -1, PAD, stop_sequences=(spanning,))
        assert bool(run.completion_mask[0].all())
    with pytest.raises(ValueError, match="at least one token id"):
        sample(policy, tokens, valid, jax.random.key(0), greedy, -1, PAD, stop_sequences=((),))


def test_stop_sequences_for_encodes_each_string():
    from jaxrl.sampling import stop_sequences_for

    class Tokenizer:
        def encode(self, text):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(map(chr, ids))

    assert stop_sequences_for(Tokenizer(), ["</a>", "\n\n"]) == (
        (60, 47, 97, 62), (32, 60, 47, 97, 62), (10, 10), (32, 10, 10))  # on its own, after a space
    with pytest.raises(ValueError, match="stop string '' encodes to no tokens"):
        stop_sequences_for(Tokenizer(), [""])


def _contains_one_of(ids, sequences) -> bool:
    return any(tuple(ids[i:i + len(seq)]) == seq for seq in sequences for i in range(len(ids)))


def test_stop_strings_match_mid_text_with_sentencepiece_and_byte_level_bpe():
    """On its own a sentencepiece string starts with a "▁" token the middle of a text lacks; a byte-level
    BPE merges the space before a string into its first token."""
    from tokenizers import Tokenizer, decoders, models as tokenizer_models, pre_tokenizers, trainers

    from jaxrl.data import arithmetic
    from jaxrl.sampling import stop_sequences_for
    from jaxrl.tokenizer import HFTokenizer, train_tokenizer

    train, _ = arithmetic.make_splits(arithmetic.ArithmeticTaskConfig(num_train=500, num_eval=10), 0)
    sentencepiece = train_tokenizer(arithmetic.tokenizer_corpus(train), 32)
    for stop in ("=", ","):
        sequences = stop_sequences_for(sentencepiece, [stop])
        assert not _contains_one_of(sentencepiece.encode("23+8=31,31-5=26"), sequences[:1])  # "▁" first
        assert _contains_one_of(sentencepiece.encode("23+8=31,31-5=26"), sequences)

    raw = Tokenizer(tokenizer_models.BPE())
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    raw.train_from_iterator(["so 23+8=31 #### 31", "then 5-2=3 #### 3"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    byte_level = HFTokenizer(raw, eos_token="<|endoftext|>")
    sequences = stop_sequences_for(byte_level, ["####"])
    assert not _contains_one_of(byte_level.encode("so 23+8=31 #### 31"), sequences[:1])  # "Ġ####" is one token
    assert _contains_one_of(byte_level.encode("so 23+8=31 #### 31"), sequences)
