"""Attention kernels: the shared-prefix form and int8 caches against plain attention over explicit keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernels.attention import KV, attention, causal_padding_mask, quantize_int8, shared_prefix_attention

PROMPTS, GROUP, HEADS, KV_HEADS, HEAD_DIM, PREFIX, OWN = 3, 4, 8, 2, 16, 7, 5


def _normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _case(q_len):
    rng = np.random.default_rng(q_len)
    batch = PROMPTS * GROUP
    q = _normal(rng, batch, q_len, HEADS, HEAD_DIM)
    prefix = KV(_normal(rng, PROMPTS, KV_HEADS, PREFIX, HEAD_DIM), _normal(rng, PROMPTS, KV_HEADS, PREFIX, HEAD_DIM))
    own = KV(_normal(rng, batch, KV_HEADS, OWN, HEAD_DIM), _normal(rng, batch, KV_HEADS, OWN, HEAD_DIM))
    prefix_valid = np.ones((PROMPTS, PREFIX), bool)
    prefix_valid[1, :3] = False  # a left-padded prompt
    key_valid = jnp.concatenate([jnp.repeat(jnp.asarray(prefix_valid), GROUP, 0), jnp.ones((batch, OWN), bool)], 1)
    query_index = jnp.broadcast_to(PREFIX + OWN - q_len + jnp.arange(q_len), (batch, q_len))
    mask = causal_padding_mask(query_index, key_valid)
    return q, prefix, own, mask


def _repeated(prefix: KV, own: KV) -> KV:
    """The prefix copied to every sequence of its group, followed by the sequence's own keys."""
    def join(a, b):
        return None if a is None else jnp.concatenate([jnp.repeat(a, GROUP, 0), b], axis=2)
    return KV(*(join(a, b) for a, b in zip(prefix, own)))


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_shared_prefix_attention_equals_attention_over_repeated_keys(q_len, softcap):
    q, prefix, own, mask = _case(q_len)
    shared = shared_prefix_attention(q, prefix, own, mask, softcap=softcap)
    reference = attention(q, _repeated(prefix, own), mask, softcap=softcap)
    np.testing.assert_allclose(shared, reference, atol=1e-5, rtol=1e-5)


def test_quantize_int8_error_bound():
    x = _normal(np.random.default_rng(0), 4, 6, 16) * 3.0
    quantized, scale = quantize_int8(x)
    assert quantized.dtype == jnp.int8 and scale.shape == (4, 6)
    error = np.abs(np.asarray(quantized.astype(jnp.float32) * scale[..., None] - x))
    assert (error <= np.asarray(scale)[..., None] / 2 + 1e-6).all()
    zeros, zero_scale = quantize_int8(jnp.zeros((2, 8)))
    assert (zeros == 0).all() and (zero_scale == 0).all()


def _int8(kv: KV) -> tuple[KV, KV]:
    """`kv` quantized, and the float values it stands for."""
    (k, k_scale), (v, v_scale) = quantize_int8(kv.k), quantize_int8(kv.v)
    return KV(k, v, k_scale, v_scale), KV(k * k_scale[..., None], v * v_scale[..., None])


@pytest.mark.parametrize("q_len", [1, 3])
def test_int8_caches_equal_attention_over_their_dequantized_values(q_len):
    q, prefix, own, mask = _case(q_len)
    (prefix8, prefix_values), (own8, own_values) = _int8(prefix), _int8(own)
    np.testing.assert_allclose(shared_prefix_attention(q, prefix8, own8, mask),
                               attention(q, _repeated(prefix_values, own_values), mask), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(attention(q, _repeated(prefix8, own8), mask),
                               attention(q, _repeated(prefix_values, own_values), mask), atol=1e-5, rtol=1e-5)
    exact = attention(q, _repeated(prefix, own), mask)
    assert np.abs(np.asarray(shared_prefix_attention(q, prefix8, own8, mask) - exact)).max() < 0.05


@pytest.mark.parametrize("q_len", [1, 3])
def test_bfloat16_shared_prefix_decode_matches_the_xla_reference(q_len):
    """bf16: the shared-prefix decode against the XLA reference (plain attention over the repeated keys) in
    bf16, relative error norm <= 2e-3 (a max-abs bound below one bf16 ulp, 3.9e-3 relative, would fail on any
    single rounding difference); both within 5e-3 of float32 attention on the same bf16-rounded inputs."""
    q, prefix, own, mask = _case(q_len)
    q, prefix, own = jax.tree.map(lambda x: x.astype(jnp.bfloat16), (q, prefix, own))
    shared = np.asarray(shared_prefix_attention(q, prefix, own, mask), np.float32)
    reference = np.asarray(attention(q, _repeated(prefix, own), mask), np.float32)
    exact = np.asarray(attention(*jax.tree.map(lambda x: x.astype(jnp.float32), (q, _repeated(prefix, own))), mask))
    assert np.linalg.norm(shared - reference) / np.linalg.norm(reference) <= 2e-3
    for out in (shared, reference):
        assert np.linalg.norm(out - exact) / np.linalg.norm(exact) <= 5e-3


def _self_attention_case(dtype, seq=40, heads=4, kv_heads=2, head_dim=16, batch=2):
    rng = np.random.default_rng(seq)
    q, k, v = (jnp.asarray(rng.standard_normal((batch, seq, h, head_dim)), dtype)
               for h in (heads, kv_heads, kv_heads))
    valid = np.ones((batch, seq), bool)
    valid[1, :9] = False  # left padding
    return q, k, v, jnp.asarray(valid)


SELF_CASES = [dict(), dict(window=7), dict(softcap=3.0), dict(window=5, softcap=2.0, scale=0.2)]


@pytest.mark.parametrize("case", SELF_CASES)
@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-3)])
def test_splash_self_attention_in_interpret_mode_matches_xla(case, dtype, tolerance):
    from jaxrl.kernels.attention import self_attention

    q, k, v, valid = _self_attention_case(dtype)
    splash = self_attention(q, k, v, valid, implementation="splash", interpret=True, **case)
    assert splash.dtype == dtype
    real = np.asarray(valid)[..., None, None]  # padding query rows are unspecified
    # the float32 reference on the same (bf16-rounded) inputs
    exact = self_attention(*(x.astype(jnp.float32) for x in (q, k, v)), valid, **case)
    difference = np.where(real, np.asarray(splash, np.float32) - np.asarray(exact), 0)
    if dtype == jnp.float32:
        assert np.abs(difference).max() <= tolerance, np.abs(difference).max()
    else:  # bf16 keeps 8 bits (one ulp is 3.9e-3 relative), so compare error norms: against the XLA
        # reference in bf16 (the acceptance bound) and against float32 on the same inputs
        xla = np.asarray(self_attention(q, k, v, valid, **case), np.float32)
        norm = np.linalg.norm(np.where(real, xla, 0))
        assert np.linalg.norm(np.where(real, np.asarray(splash, np.float32) - xla, 0)) / norm <= tolerance
        assert np.linalg.norm(difference) / np.linalg.norm(np.where(real, exact, 0)) <= tolerance


def test_splash_gradients_match_xla():
    q, k, v, valid = _self_attention_case(jnp.float32, seq=24)
    _assert_splash_gradients_match_xla(q, k, v, valid, window=9, seed=0)


@pytest.mark.parametrize("window", [None, 6])
def test_cudnn_path_arguments_match_xla(window):
    """The cuDNN path is `jax.nn.dot_product_attention`: its XLA implementation, with the same arguments,
    checks the masks, GQA, scale and window the wrapper passes (the kernel itself needs an NVIDIA GPU)."""
    from jaxrl.kernels.attention import _cudnn_self_attention, self_attention

    q, k, v, valid = _self_attention_case(jnp.float32)
    got = _cudnn_self_attention(q, k, v, valid, 0.3, window, "xla")
    want = self_attention(q, k, v, valid, scale=0.3, window=window)
    real = np.asarray(valid)[..., None, None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=1e-5, rtol=1e-5)


def test_resolve_implementation():
    from jaxrl.kernels.attention import resolve_implementation

    assert resolve_implementation("auto", "cpu") == "xla"
    assert resolve_implementation("auto", "tpu") == "splash"
    assert resolve_implementation("splash", "cpu") == "splash"
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        resolve_implementation("flash")


def test_cudnn_falls_back_to_xla_where_cudnn_cannot_run():
    """float32 inputs (the CPU presets) or a head size cuDNN rejects take the XLA path, so `auto` on a GPU never
    hands cuDNN what it cannot compute; bf16 inputs with head_dim 64 would go to cuDNN."""
    from jaxrl.kernels.attention import cudnn_supports, self_attention

    q, k, v, valid = _self_attention_case(jnp.float32)
    got = self_attention(q, k, v, valid, implementation="cudnn")  # would raise on CPU if it reached cuDNN
    np.testing.assert_array_equal(got, self_attention(q, k, v, valid))
    assert not cudnn_supports(jnp.float32, 64) and not cudnn_supports(jnp.bfloat16, 60)
    assert cudnn_supports(jnp.bfloat16, 64) and cudnn_supports(jnp.float16, 128)


# ---------------------------------------------------------------- splash per chip on a (data, fsdp, tensor) mesh

SHARDED_SCRIPT = """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jaxrl import models
    from jaxrl import sampling
    from jaxrl.sharding import make_mesh, shard_batch
    from jaxrl.kernels.attention import self_attention
    from jaxrl.models.partitioning import Layout

    layout = Layout(make_mesh(2, 2, 2))  # 8 CPU devices: batch over data x fsdp, heads over tensor
    rng = np.random.default_rng(0)
    out = {}
    # KV heads split with the query heads (2 on tensor=2); not split, one per chip (1 KV head, 2 query heads per
    # chip); not split, 3 KV heads for 6 query heads (3 per chip: 3 KV copies per chip, one per query head).
    # Gradients where K/V are repeated (their transpose sums the copies back).
    # Packed rows (int segment ids, trailing padding; a window reaching across segment starts): "packed 4/2".
    segments = np.zeros((4, 40), np.int32)
    segments[0, :7], segments[0, 7:20], segments[0, 20:33] = 1, 2, 3
    segments[1, :], segments[2, :11], segments[2, 11:38], segments[3, :5] = 1, 1, 2, 1
    for heads, kv_heads, window, grads, packed in ((4, 2, None, False, False), (4, 1, 9, True, False),
                                                   (6, 3, None, False, False), (4, 2, 6, True, True)):
        q, k, v = (jnp.asarray(rng.standard_normal((4, 40, h, 16)), jnp.float32) for h in (heads, kv_heads, kv_heads))
        valid = jnp.asarray(np.arange(40)[None] >= np.array([[0], [9], [3], [39]]))  # left padding
        if packed:
            valid = jnp.asarray(segments)
        weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32) * (valid != 0)[..., None, None]

        def loss(q, k, v, impl):
            o = self_attention(q, k, v, valid, window=window, implementation=impl,
                               layout=layout if impl == "splash" else None)
            return jnp.sum(o * weights), o
        run = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True) if grads else \
            lambda *args: (loss(*args), (jnp.zeros(()),))
        lowered = jax.jit(run, static_argnums=3).lower(q, k, v, "splash")
        (_, got), got_grads = lowered.compile()(q, k, v)
        (_, want), want_grads = jax.jit(run, static_argnums=3)(q, k, v, "xla")
        real = np.asarray(valid != 0)[..., None, None]
        out[("packed " if packed else "") + f"{heads}/{kv_heads}"] = dict(
            error=float(np.abs(np.where(real, got - want, 0)).max()),
            grad_error=max(float(np.abs(g - w).max()) for g, w in zip(got_grads, want_grads)),
            shard_map="sdy.manual_computation" in lowered.as_text())

    # greedy sampling: splash (prefill per chip, interpret mode) against xla, the same sharded weights
    config = models.ModelConfig(vocab_size=48, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                                head_dim=16, intermediate_size=128, sliding_window=5,
                                layer_types=("sliding",), attention_impl="xla")
    policy = models.init(config, 0)  # weights x 10: peaked logits that depend on the context
    policy = models.shard(policy.replace(params=jax.tree.map(lambda x: x * 10, policy.params)), layout)
    prompts = rng.integers(0, 48, (4, 12)).astype(np.int32)
    prompt_valid = np.arange(12)[None] >= np.array([[0], [4], [7], [2]])
    prompts, prompt_valid = shard_batch((prompts, prompt_valid), layout.mesh)
    sample_config = sampling.SamplingConfig(max_new_tokens=5, temperature=0.0, decode_segments=1)
    tokens = {impl: np.asarray(sampling.sample(models.replace_config(policy, attention_impl=impl), prompts,
                                               prompt_valid, jax.random.key(0), sample_config, eos_id=-1, pad_id=0,
                                               group_size=2).tokens)
              for impl in ("xla", "splash")}
    out["sample_equal"] = bool((tokens["xla"] == tokens["splash"]).all())
    out["sample_tokens"] = tokens["splash"][:, 12:].tolist()
    print("RESULT", json.dumps(out))
    print("OK")
"""


@pytest.fixture(scope="module")
def sharded_results():
    """One 8-device subprocess (JAX starts once) for the checks below: `{case: errors}` and sampled tokens."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
           "PYTHONPATH": os.pathsep.join([here, root, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(SHARDED_SCRIPT)], env=env, cwd=root,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(result.stdout.split("RESULT ", 1)[1].splitlines()[0])


@pytest.mark.parametrize("case", ["4/2", "4/1", "6/3", "packed 4/2"])
def test_sharded_splash_matches_xla_on_a_data_fsdp_tensor_mesh(sharded_results, case):
    """Splash inside `shard_map` (interpret mode: the mesh is CPU) on a (data=2, fsdp=2, tensor=2) mesh against
    the XLA reference, outputs and q/k/v gradients, for `heads/kv_heads` = 4/2 (KV heads split with the query
    heads), 4/1 (one KV head: each chip gets a copy) and 6/3 (3 query heads per chip over 2 KV heads: one copy
    per query head); and packed rows (int segment ids split with the batch, sliding window 6)."""
    result = sharded_results[case]
    assert result["shard_map"]
    assert result["error"] <= 1e-5, result
    assert result["grad_error"] <= 1e-5, result


def test_sharded_splash_sampling_gives_the_xla_tokens(sharded_results):
    """Greedy sampling with `attention_impl=splash` (its prefill through the kernel, per chip) gives the same
    tokens as `xla` on the same sharded weights (a sliding-window and a full layer)."""
    assert sharded_results["sample_equal"], sharded_results["sample_tokens"]


def test_prefill_goes_through_the_kernel_unless_xla():
    """A segment filling a `KVCache` from a static slot 0 (the sampler's prompt pass) runs the self-attention
    kernel (a Pallas call for splash); `xla`, and a decode step at a traced slot, keep the dense attention."""
    from jaxrl import models
    from jaxrl.models import KVCache

    config = models.ModelConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                head_dim=8, intermediate_size=64, attention_impl="splash")
    splash = models.abstract(config)
    xla = models.replace_config(splash, attention_impl="xla")
    tokens = jnp.ones((2, 6), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))

    def jaxpr(policy, length, index):
        cache = KVCache.zeros(config, 2, length)
        return str(jax.make_jaxpr(lambda p, i: models.apply(policy.replace(params=p), tokens, positions,
                                                            jnp.ones((2, length), bool), cache,
                                                            index if index is not None else i))(policy.params, 0))

    assert "pallas_call" in jaxpr(splash, 6, 0)
    assert "pallas_call" not in jaxpr(xla, 6, 0)
    assert "pallas_call" not in jaxpr(splash, 6, None)  # traced slot: not known to be 0
    assert "pallas_call" not in jaxpr(splash, 9, 0)  # a longer cache: its other slots may hold keys


# ---------------------------------------------------------------- packed rows: int segment ids

def _packed_case(dtype=jnp.float32, seq=40, heads=4, kv_heads=2, head_dim=16):
    """Three rows of packed sequences (segments of lengths 7, 13, 5 then padding; 40 slots of one segment; ids
    1, 2 then padding, then nothing) and q, k, v."""
    rng = np.random.default_rng(seq + heads)
    segments = np.zeros((3, seq), np.int32)
    segments[0, :7], segments[0, 7:20], segments[0, 20:25] = 1, 2, 3
    segments[1, :] = 1
    segments[2, :11], segments[2, 11:30] = 1, 2
    q, k, v = (jnp.asarray(rng.standard_normal((3, seq, h, head_dim)), dtype) for h in (heads, kv_heads, kv_heads))
    return q, k, v, jnp.asarray(segments)


def _reference_packed_attention(q, k, v, segments, scale=None, window=None, softcap=None):
    """float64 numpy: each query attends to earlier keys of its own segment (and the last `window` slots)."""
    q, k, v, segments = (np.asarray(x, np.float64) for x in (q, k, v, segments))
    batch, seq, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(batch):
        for i in range(seq):
            if segments[b, i] == 0:
                continue
            keys = [j for j in range(i + 1) if segments[b, j] == segments[b, i] and (window is None or i - j < window)]
            for h in range(heads):
                s = k[b, keys, h // groups] @ q[b, i, h] * (head_dim ** -0.5 if scale is None else scale)
                if softcap is not None:
                    s = np.tanh(s / softcap) * softcap
                w = np.exp(s - s.max())
                out[b, i, h] = (w / w.sum()) @ v[b, keys, h // groups]
    return out


PACKED_CASES = [dict(), dict(window=4), dict(window=9, softcap=3.0, scale=0.2)]


@pytest.mark.parametrize("case", PACKED_CASES)
@pytest.mark.parametrize("implementation", ["xla", "splash"])
def test_packed_self_attention_matches_a_numpy_reference(case, implementation):
    """Int segment ids: no query sees another segment (a window of 4 or 9 reaches back across segment starts and is
    cut there), GQA, soft-capping; padding query rows are left out (unspecified)."""
    from jaxrl.kernels.attention import self_attention

    q, k, v, segments = _packed_case()
    got = self_attention(q, k, v, segments, implementation=implementation, interpret=True, **case)
    real = np.asarray(segments != 0)[..., None, None]
    want = _reference_packed_attention(q, k, v, segments, **case)
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=2e-5, rtol=1e-5)


def test_packed_splash_gradients_match_xla():
    q, k, v, segments = _packed_case(seq=24)
    _assert_splash_gradients_match_xla(q, k, v, segments, window=6, seed=1)


def _reference_segment_ranges(segments, max_segments):
    """numpy: runs of equal non-zero ids, left to right."""
    batch = segments.shape[0]
    lengths = -np.ones((batch, max_segments), np.int32)
    starts = -np.ones((batch, max_segments + 1), np.int32)
    count = np.zeros(batch, np.int32)
    for b, row in enumerate(segments):
        runs = []
        for i, s in enumerate(row):
            if s != 0 and (i == 0 or row[i - 1] != s):
                runs.append([i, 0])
            if s != 0:
                runs[-1][1] += 1
        count[b] = len(runs)
        for m, (start, length) in enumerate(runs[:max_segments]):
            starts[b, m], lengths[b, m] = start, length
    return lengths, starts, count


@pytest.mark.parametrize("max_segments", [2, 3, 5, 40])
def test_segment_ranges_match_numpy(max_segments):
    """Start slots and lengths of each row's segments (cuDNN's ragged description), -1 past the last; rows with
    more segments than the bound keep their first `max_segments`; padding between segments, an id repeated in
    two runs (two segments), an all-padding row."""
    from jaxrl.kernels.attention import segment_ranges

    rng = np.random.default_rng(max_segments)
    segments = np.zeros((6, 40), np.int32)
    for b in range(4):  # random runs, some of them padding
        i = 0
        while i < 40:
            n = int(rng.integers(1, 9))
            segments[b, i:i + n] = rng.integers(0, 4)
            i += n
    segments[4, 3:9], segments[4, 9:12], segments[4, 15:20] = 2, 1, 2
    lengths, starts, count = jax.jit(segment_ranges, static_argnums=1)(jnp.asarray(segments), max_segments)
    want = _reference_segment_ranges(segments, max_segments)
    for got, expected in zip((lengths, starts, count), want):
        np.testing.assert_array_equal(np.asarray(got), expected)
    assert (count[5] == 0) and (np.asarray(lengths[5]) == -1).all()


def _ragged_attention_on_cpu(q, k, v, lengths, starts, scale, window):
    """What cuDNN's variable-length kernel computes, rendered for the CPU: segment m of a row is the slots
    `[starts[m], starts[m] + lengths[m])`, attended causally (and within `window`) on its own; slots in no
    described segment see nothing (their output is garbage here: zeros attention weights -> uniform)."""
    seq = q.shape[1]
    slot = jnp.arange(seq)
    starts = starts[:, :-1]
    inside = (slot[None, None, :] >= starts[:, :, None]) & (slot[None, None, :] < (starts + lengths)[:, :, None])
    inside &= (lengths >= 0)[:, :, None]  # [batch, M, seq]
    same = jnp.einsum("bmi,bmj->bij", inside.astype(jnp.int32), inside.astype(jnp.int32)) > 0
    mask = same & (slot[None, :, None] >= slot[None, None, :])
    if window is not None:
        mask &= slot[None, :, None] - slot[None, None, :] < window
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation="xla")


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("repeat_kv", [True, False])
def test_cudnn_packed_wrapper_matches_xla(window, repeat_kv):
    """The cuDNN packed path around its kernel (segment ranges, KV heads repeated or not, the sequence padded to
    a multiple of 64, padding outputs zeroed) with the kernel's semantics rendered on the CPU, against the XLA
    path: outputs and gradients (finite: padding rows must not leak NaN)."""
    from jaxrl.kernels.attention import _cudnn_packed_self_attention, self_attention

    q, k, v, segments = _packed_case()
    real = (segments != 0)[..., None, None]
    weights = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32) * real

    def loss(fn):
        return lambda q, k, v: (jnp.sum(fn(q, k, v) * weights), fn(q, k, v))
    packed = loss(lambda q, k, v: _cudnn_packed_self_attention(q, k, v, segments, 0.3, window, 3,
                                                               _ragged_attention_on_cpu, repeat_kv))
    xla = loss(lambda q, k, v: self_attention(q, k, v, segments, scale=0.3, window=window))
    (_, got), got_grads = jax.value_and_grad(packed, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    (_, want), want_grads = jax.value_and_grad(xla, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=1e-5, rtol=1e-5)
    assert (np.asarray(got)[~np.asarray(real[..., 0, 0])] == 0).all()
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_cudnn_packed_rows_over_the_segment_bound_are_nan():
    """Row 0 has 3 segments: with `max_segments=2` its real outputs are NaN (never silently wrong), the other
    rows (1 and 2 segments) are right."""
    from jaxrl.kernels.attention import _cudnn_packed_self_attention, self_attention

    q, k, v, segments = _packed_case()
    got = np.asarray(_cudnn_packed_self_attention(q, k, v, segments, None, None, 2, _ragged_attention_on_cpu))
    want = np.asarray(self_attention(q, k, v, segments))
    real = np.asarray(segments != 0)
    assert np.isnan(got[0][real[0]]).all() and not np.isnan(got[0][~real[0]]).any()
    np.testing.assert_allclose(got[1:][real[1:]], want[1:][real[1:]], atol=1e-5, rtol=1e-5)


def test_packed_rows_take_xla_where_cudnn_packed_cannot_run():
    """On a CPU (or a GPU before Hopper) packed bf16 rows with `implementation="cudnn"` take the XLA path."""
    from jaxrl.kernels.attention import cudnn_packed_available, self_attention

    assert not cudnn_packed_available()
    q, k, v, segments = _packed_case(jnp.bfloat16)
    np.testing.assert_array_equal(self_attention(q, k, v, segments, implementation="cudnn"),
                                  self_attention(q, k, v, segments))


def _assert_splash_gradients_match_xla(q, k, v, valid, window, seed):
    """Gradients of a random weighting of the real rows' outputs agree between splash (interpret) and XLA;
    `valid`: bool padding or int segment ids."""
    from jaxrl.kernels.attention import self_attention

    weights = jnp.asarray(np.random.default_rng(seed).standard_normal(q.shape), jnp.float32) * (valid != 0)[
        ..., None, None]

    def loss(impl):
        return lambda q, k, v: jnp.sum(self_attention(q, k, v, valid, window=window, implementation=impl,
                                                      interpret=True) * weights)
    want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(loss("splash"), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
