"""The compacted decode (`SamplingConfig.compaction`): finished rows are dropped between decode segments, and
with `live_rows` their slots are refilled with waiting rows; the rollout is the single-program sampler's (same
seed, same tokens, log-probs to float rounding)."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import models, sampling
from jaxrl.sampling import (FINISH_EOS, SamplingConfig, compacted_layout, compiled_programs, default_batch_buckets,
                            sample)

CONFIG = models.ModelConfig(vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=8, intermediate_size=64)
PAD = 0
STOPS = (3, 5)  # two of 24 ids: rows end after a few to a few dozen tokens


def _prompts(rows: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(6, CONFIG.vocab_size, (rows, 6)).astype(np.int32)
    valid = np.arange(6)[None] >= rng.integers(0, 4, (rows, 1))  # ragged, left-padded
    return jnp.asarray(np.where(valid, tokens, PAD)), jnp.asarray(valid)


@pytest.fixture
def compactions(monkeypatch):
    """The `(rows before, rows after)` of every compaction the sampler runs."""
    seen, real = [], sampling._regather_program

    def spy(outputs, state, initial, plan, **kwargs):
        if state is not None:
            seen.append((state.done.shape[0], len(plan[1])))
        return real(outputs, state, initial, plan, **kwargs)

    monkeypatch.setattr(sampling, "_regather_program", spy)
    return seen


def _assert_same(on, off, logp_atol=1e-6):
    np.testing.assert_array_equal(on.tokens, off.tokens)
    np.testing.assert_array_equal(on.completion_mask, off.completion_mask)
    np.testing.assert_array_equal(on.finish_reason, off.finish_reason)
    np.testing.assert_array_equal(on.prompt_valid, off.prompt_valid)
    np.testing.assert_allclose(on.sampler_logp, off.sampler_logp, rtol=0, atol=logp_atol)
    assert (on.policy_logp is None) == (off.policy_logp is None)
    if on.policy_logp is not None:
        np.testing.assert_allclose(on.policy_logp, off.policy_logp, rtol=0, atol=logp_atol)


@pytest.mark.parametrize("settings, group_size, extra", [
    (dict(), 4, {}),
    (dict(), 1, {}),
    (dict(temperature=0.0), 4, {}),  # greedy
    (dict(policy_logp=True, top_k=8, top_p=0.9, temperature=0.8), 4, {}),
    (dict(kv_cache_dtype="int8"), 4, {}),
    (dict(compaction_segments=6), 3, dict(stop_sequences=((7, 8), (9,)))),
    (dict(batch_buckets=(5, 12)), 4, dict(temperature=jnp.float32(1.3))),  # a traced temperature
])
def test_compaction_gives_the_tokens_and_log_probs_of_one_program(compactions, settings, group_size, extra):
    policy = models.init(CONFIG, 1)
    tokens, valid = _prompts()
    config = SamplingConfig(max_new_tokens=64, decode_segments=4, **settings)
    assert config.compaction  # the default
    temperature = extra.pop("temperature", None)
    key = jax.random.key(2)
    stops = STOPS
    if config.temperature == 0:  # greedy rows loop without stopping: stop at a token row 0 writes by step 20
        free = sample(policy, tokens, valid, key, dataclasses.replace(config, compaction=False), -1, PAD)
        stops = (int(free.completion_tokens[0, 20]), int(free.completion_tokens[1, 5]))
    on = sample(policy, tokens, valid, key, config, stops, PAD, temperature, group_size=group_size, **extra)
    assert compactions, "no row finished early enough to compact: the test would prove nothing"
    assert all(after < before for before, after in compactions)
    off = sample(policy, tokens, valid, key, dataclasses.replace(config, compaction=False), stops, PAD, temperature,
                 group_size=group_size, **extra)
    _assert_same(on, off)
    lengths = np.asarray(on.completion_mask.sum(1))
    assert len(set(lengths.tolist())) >= 2 and (np.asarray(on.finish_reason) == FINISH_EOS).any()


def test_compacted_rows_keep_their_draws_inside_a_callers_jit():
    """Traced inputs: the sampler falls back to one program (the host cannot read the finished rows), same result."""
    policy = models.init(CONFIG, 1)
    tokens, valid = _prompts()
    config = SamplingConfig(max_new_tokens=48, decode_segments=3)
    eager = sample(policy, tokens, valid, jax.random.key(4), config, STOPS, PAD, group_size=2)
    traced = jax.jit(lambda t, v, k: sample(policy, t, v, k, config, STOPS, PAD, group_size=2))(
        tokens, valid, jax.random.key(4))
    _assert_same(eager, traced)


def test_forced_lengths_end_each_row_there_with_the_first_stop_id():
    policy = models.init(CONFIG, 0)
    tokens, valid = _prompts(2)
    lengths = np.array([1, 17, 40, 3, 64, 9], np.int32)
    config = SamplingConfig(max_new_tokens=64, decode_segments=4)
    for compaction in (True, False):
        rollout = sample(policy, tokens, valid, jax.random.key(0), dataclasses.replace(config, compaction=compaction),
                         (-1, 4, 5), PAD, group_size=3, forced_lengths=lengths)
        np.testing.assert_array_equal(rollout.completion_mask.sum(1), lengths)
        assert (np.asarray(rollout.finish_reason) == FINISH_EOS).all()
        completion = np.asarray(rollout.completion_tokens)
        np.testing.assert_array_equal(completion[np.arange(6), lengths - 1], 4)  # the first id that is not -1
        full_valid = jnp.concatenate([rollout.prompt_valid, jnp.ones(rollout.completion_mask.shape, bool)], 1)
        logp = jax.nn.log_softmax(models.forward(policy, rollout.tokens, full_valid), -1)
        expected = np.take_along_axis(np.asarray(logp[:, tokens.shape[1] - 1:-1]), completion[..., None], -1)[..., 0]
        mask = np.asarray(rollout.completion_mask)
        np.testing.assert_allclose(np.where(mask, rollout.sampler_logp, 0), np.where(mask, expected, 0), atol=1e-5)
    with pytest.raises(ValueError, match=r"forced_lengths must lie in \[1, max_new_tokens=64\]"):
        sample(policy, tokens, valid, jax.random.key(0), config, 4, PAD, group_size=3, forced_lengths=lengths + 1)
    with pytest.raises(ValueError, match=r"forced_lengths must be 2 ints \(one per sampled row\), got shape \(6,\)"):
        sample(policy, tokens, valid, jax.random.key(0), config, 4, PAD, forced_lengths=lengths)
    with pytest.raises(ValueError, match="forced_lengths needs a stop id"):
        sample(policy, tokens, valid, jax.random.key(0), config, -1, PAD, group_size=3, forced_lengths=lengths)


def test_batch_buckets_must_cover_the_batch():
    policy = models.init(CONFIG, 0)
    tokens, valid = _prompts()
    before = compiled_programs()
    with pytest.raises(ValueError, match=r"SamplingConfig.batch_buckets \(2, 8\) do not cover the batch of 12 "):
        sample(policy, tokens, valid, jax.random.key(0), SamplingConfig(32, batch_buckets=(2, 8)), STOPS, PAD,
               group_size=4)
    assert compiled_programs() == before
    with pytest.raises(ValueError, match="batch_buckets must be a tuple of positive ints"):
        SamplingConfig(batch_buckets=(4, 0))
    with pytest.raises(ValueError, match="batch_buckets must be a tuple of positive ints"):
        SamplingConfig(batch_buckets=[4, 8])


def test_default_batch_buckets():
    assert default_batch_buckets(64) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # halvings and 3/4 of each
    assert default_batch_buckets(12) == (1, 2, 3, 5, 6, 9, 12)
    assert default_batch_buckets(16, parallel=8) == (8, 16)
    assert default_batch_buckets(24, parallel=4) == (4, 8, 12, 20, 24)
    assert default_batch_buckets(1) == (1,)


def test_compacted_layout_packs_live_rows_into_the_smallest_bucket_with_the_most_sharing():
    # group 4: prompt 0 has rows 0, 1, 2 live, prompt 1 row 5, prompt 2 row 9 (5 rows)
    live = np.array([0, 1, 2, 5, 9])
    slots, rows = compacted_layout(live, 4, (1, 2, 4, 8, 16))
    # bucket 8: groups of 4 need 3 slots (12 rows); a slot per row: 8 rows
    assert slots.tolist() == [0, 0, 0, 1, 2, 0, 0, 0] and rows.tolist() == [0, 1, 2, 5, 9, -1, -1, -1]
    slots, rows = compacted_layout(live, 4, (1, 2, 4, 12, 16))  # 12 = 3 groups of 4: sharing where it fits
    assert slots.tolist() == [0, 1, 2] and rows.tolist() == [0, 1, 2, -1, 5, -1, -1, -1, 9, -1, -1, -1]
    slots, rows = compacted_layout(np.array([4, 6, 7]), 4, (1, 2, 4, 8))  # one prompt: a group of 4 still shares
    assert slots.tolist() == [1] and rows.tolist() == [4, 6, 7, -1]
    slots, rows = compacted_layout(np.array([1, 13]), 4, (2, 4, 8, 16), parallel=2)
    assert slots.tolist() == [0, 3] and rows.tolist() == [1, 13]
    slots, rows = compacted_layout(np.array([1]), 4, (4, 8), parallel=8)  # 8 slots (a multiple of 8)
    assert slots.tolist() == [0] * 8 and rows.tolist() == [1] + [-1] * 7
    for seed in range(20):  # every live row placed once, in a slot of its own prompt
        rng = np.random.default_rng(seed)
        live = np.flatnonzero(rng.random(32) < rng.random())
        if not live.size:
            continue
        slots, rows = compacted_layout(live, 8, default_batch_buckets(32))
        width = rows.size // slots.size
        assert sorted(rows[rows >= 0].tolist()) == live.tolist()
        assert all(r // 8 == slots[j // width] for j, r in enumerate(rows) if r >= 0)
        assert rows.size in default_batch_buckets(32) and rows.size < 2 * max(live.size, 1) + 8


@pytest.mark.slow  # 46 s of the fast suite's 15 minutes; the sampler's own compile bound stays fast (test_sampling)
def test_compiles_stay_bounded_over_200_calls_of_random_lengths(compactions):
    """200 calls, each with random row lengths (forced) and a random seed: every compacted shape the run uses
    is compiled once; the count stays below a small constant however the rows finish."""
    config_model = dataclasses.replace(CONFIG, num_layers=1)
    policy = models.init(config_model, 0)
    tokens, valid = _prompts(4)
    config = SamplingConfig(max_new_tokens=64, decode_segments=4)
    rng = np.random.default_rng(0)
    before, decode_before = compiled_programs(), sampling._segment_program._cache_size()
    counts = []
    for call in range(200):
        lengths = np.minimum(rng.geometric(rng.choice([0.01, 0.05, 0.2]), 16), 64).astype(np.int32)
        rollout = sample(policy, tokens, valid, jax.random.key(call), config, STOPS, PAD, group_size=4,
                         forced_lengths=lengths)
        if call % 50 == 0:
            np.testing.assert_array_equal(rollout.completion_mask.sum(1), lengths)
        counts.append(compiled_programs() - before)
    shapes = {after for _, after in compactions}
    assert len(shapes) >= 4, shapes  # the calls really ran at many batch sizes
    # 12 batch shapes (buckets 1, 2, 3, 4, 6, 8, 12, 16; those of 4 or more rows as slots of 4 rows or of 1): one
    # prefill, a finishing program per shape, a decode program per segment (8) and shape, and a gather per pair of
    # shapes and segment (small programs: no model in them). 26 decode programs and 80 in all in practice
    # (2026-11-28). Bounds that do not grow with the number of calls:
    assert sampling._segment_program._cache_size() - decode_before <= 1 + 7 * 12, counts[-1]
    assert counts[-1] <= 100, counts[-1]
    assert counts[-1] - counts[99] <= counts[99] // 4, counts  # the second 100 calls compile little that is new


@pytest.fixture
def refills(monkeypatch):
    """`(rows decoding, rows that start now)` of every batch the refilled decode forms."""
    seen, real = [], sampling._regather_program

    def spy(outputs, state, initial, plan, **kwargs):
        seen.append((int(np.sum((plan[1] >= 0) | (plan[2] >= 0))), int(np.sum(plan[2] >= 0))))
        return real(outputs, state, initial, plan, **kwargs)

    monkeypatch.setattr(sampling, "_regather_program", spy)
    return seen


@pytest.mark.parametrize("settings, group_size, live_rows, extra", [
    (dict(), 4, 8, {}),
    # greedy: every row runs to max_new_tokens (finish "length")
    pytest.param(dict(temperature=0.0), 2, 4, {}, marks=pytest.mark.slow),
    # 5 live rows: groups split over slots; some rows reach max_new_tokens
    (dict(policy_logp=True, top_k=8, top_p=0.9, temperature=0.8, batch_buckets=(2, 5)), 4, 5,
     dict(temperature=jnp.float32(1.3))),
    pytest.param(dict(kv_cache_dtype="int8", compaction_segments=6), 3, 6, dict(stop_sequences=((7, 8), (9,))),
                 marks=pytest.mark.slow),
])
def test_refilled_slots_give_the_tokens_and_log_probs_of_one_program(refills, settings, group_size, live_rows,
                                                                      extra):
    """`live_rows`: a batch decoded a few rows at a time, each finished row's slot taken by a waiting row at the
    next segment, is the rollout of the whole batch decoded at once (the same draws per row and step)."""
    policy = models.init(CONFIG, 1)
    tokens, valid = _prompts(6)
    config = SamplingConfig(max_new_tokens=64, decode_segments=4, live_rows=live_rows, **settings)
    temperature = extra.pop("temperature", None)
    key = jax.random.key(2)
    on = sample(policy, tokens, valid, key, config, STOPS, PAD, temperature, group_size=group_size, **extra)
    off = sample(policy, tokens, valid, key, dataclasses.replace(config, compaction=False, live_rows=None), STOPS,
                 PAD, temperature, group_size=group_size, **extra)
    _assert_same(on, off)
    batch = 6 * group_size
    assert all(decoding <= live_rows for decoding, _ in refills), refills
    assert sum(fresh for _, fresh in refills) == batch  # every row started exactly once
    lengths = np.asarray(off.completion_mask.sum(1))
    if config.temperature == 0:  # every row runs to the end: the batches follow one another
        assert (lengths == 64).all() and len(refills) > 1
    else:
        assert any(fresh and fresh < decoding for decoding, fresh in refills), "no slot was refilled mid-decode"
        assert len(set(lengths.tolist())) >= 2


@pytest.mark.slow  # about a minute; the compacted decode's bound test above runs in `make test`
def test_refilled_compiles_stay_bounded_over_60_calls_of_random_lengths():
    config_model = dataclasses.replace(CONFIG, num_layers=1)
    policy = models.init(config_model, 0)
    tokens, valid = _prompts(8)
    config = SamplingConfig(max_new_tokens=64, live_rows=8)
    rng = np.random.default_rng(1)
    before, decode_before = compiled_programs(), sampling._segment_program._cache_size()
    counts = []
    for call in range(60):
        lengths = np.minimum(rng.geometric(rng.choice([0.01, 0.05, 0.2]), 32), 64).astype(np.int32)
        rollout = sample(policy, tokens, valid, jax.random.key(call), config, STOPS, PAD, group_size=4,
                         forced_lengths=lengths)
        if call % 20 == 0:
            np.testing.assert_array_equal(rollout.completion_mask.sum(1), lengths)
        counts.append(compiled_programs() - before)
    # a prefill, and per batch shape (buckets 1, 2, 3, 4, 6, 8; 4 and 8 also as slots of 4 rows) a finishing
    # program and a decode program, and a gather per pair of shapes: 9 decode programs and 45 in all after 60
    # calls (2026-11-28). Bounds that do not grow with the number of calls:
    assert sampling._segment_program._cache_size() - decode_before <= 2 * 8, counts[-1]
    assert counts[-1] <= 64, counts[-1]
    assert counts[-1] - counts[29] <= counts[29] // 4, counts


def test_live_rows_is_checked():
    policy = models.init(CONFIG, 0)
    tokens, valid = _prompts()
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="live_rows must be a positive int or None"):
            SamplingConfig(live_rows=bad)
    with pytest.raises(ValueError, match=r"batch_buckets \(2, 4\) do not cover the batch of 6 sequences "
                                         r"\(prompts x group_size, or live_rows if fewer\)"):
        sample(policy, tokens, valid, jax.random.key(0), SamplingConfig(32, live_rows=6, batch_buckets=(2, 4)),
               STOPS, PAD, group_size=4)
    # live_rows at least the batch: the whole batch at once, as without it
    config = SamplingConfig(32, decode_segments=2)
    whole = sample(policy, tokens, valid, jax.random.key(0), config, STOPS, PAD, group_size=2)
    _assert_same(sample(policy, tokens, valid, jax.random.key(0), dataclasses.replace(config, live_rows=64), STOPS,
                        PAD, group_size=2), whole)


SHARDED = """
    import dataclasses, jax, jax.numpy as jnp, numpy as np
    from jaxrl import models, sampling
    from jaxrl.sampling import SamplingConfig, sample
    from jaxrl.sharding import make_mesh, shard_batch

    config = models.ModelConfig(vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                head_dim=8, intermediate_size=64)
    policy = models.init(config, 0)
    rng = np.random.default_rng(0)
    valid = np.arange(6)[None] >= rng.integers(0, 4, size=(8, 1))
    tokens = np.where(valid, rng.integers(6, 24, size=(8, 6)), 0).astype(np.int32)
    settings = SamplingConfig(max_new_tokens=48, decode_segments=3)
    off = sample(policy, tokens, valid, jax.random.key(1), dataclasses.replace(settings, compaction=False), (3, 5),
                 0, group_size=2)
    sizes = []
    real = sampling._regather_program

    def spy(outputs, state, initial, plan, **kwargs):
        sizes.append(len(plan[1]))
        return real(outputs, state, initial, plan, **kwargs)

    sampling._regather_program = spy
    for shape in [(8, 1, 1), (2, 2, 2)]:
        layout = models.Layout(make_mesh(*shape))
        sharded = models.shard(policy, layout)
        t, v = shard_batch((tokens, valid), layout.mesh)
        on = sample(sharded, t, v, jax.random.key(1), settings, (3, 5), 0, group_size=2)
        assert (np.asarray(on.tokens) == np.asarray(off.tokens)).all(), shape
        assert np.allclose(np.asarray(on.sampler_logp), np.asarray(off.sampler_logp), atol=1e-5), shape
        print(shape, "same tokens", sizes)
        refilled = sample(sharded, t, v, jax.random.key(1), dataclasses.replace(settings, live_rows=8), (3, 5), 0,
                          group_size=2)
        assert (np.asarray(refilled.tokens) == np.asarray(off.tokens)).all(), shape
        print(shape, "refilled: same tokens")
    assert sizes and all(size % 4 == 0 for size in sizes), sizes
    print("OK")
"""


@pytest.mark.slow
def test_compaction_on_a_sharded_policy_gives_the_single_device_tokens():
    """8 fake CPU devices, batch split 8 ways (data) and 4 ways (data x fsdp): compacted batches stay multiples
    of the data-parallel size and the tokens are those of one device without compaction."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(SHARDED)], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.count("same tokens") == 4


@pytest.mark.slow
def test_compaction_on_bench_small_shapes():
    """The benchmark model's shapes (32k vocabulary, 8 layers): same tokens and log-probs with compaction."""
    from jaxrl.bench import ragged_lengths

    policy = models.init(models.PRESETS["bench-small"], 0)
    rng = np.random.default_rng(0)
    tokens, valid = jnp.asarray(rng.integers(0, 32_000, (2, 16), dtype=np.int32)), jnp.ones((2, 16), bool)
    config = SamplingConfig(max_new_tokens=64, decode_segments=4)
    lengths = ragged_lengths(8, 64, seed=1)
    on = sample(policy, tokens, valid, jax.random.key(0), config, 1, PAD, group_size=4, forced_lengths=lengths)
    off = sample(policy, tokens, valid, jax.random.key(0), dataclasses.replace(config, compaction=False), 1, PAD,
                 group_size=4, forced_lengths=lengths)
    _assert_same(on, off, logp_atol=1e-5)
