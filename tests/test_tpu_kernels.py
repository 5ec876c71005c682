"""Pallas splash attention compiled for TPU pods on this CPU: the programs of an RL step (log-prob pass, its
gradient, the sampler's prefill and decode) of a tiny bf16 model, sharded over an unattached v5e:2x2 and
v5p:2x2x2 topology, are compiled ahead of time by libtpu, and their optimized HLO holds the Mosaic splash
kernels (a Mosaic kernel that could not run on a TPU, or could not be partitioned, fails this compile).

The tiny model meets Mosaic's constraints on splash: head_dim 128 (a full TPU lane width), sequences padded to
the 128-slot kernel blocks by `kernels.attention`, bf16 inputs.
"""

import base64
import collections
import dataclasses
import os
import re

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test processes on this host may hold libtpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import models  # noqa: E402
from jaxrl import sampling, train  # noqa: E402
from jaxrl.sharding import BATCH_AXES, make_mesh  # noqa: E402
from jaxrl.models.partitioning import Layout  # noqa: E402
from jaxrl.models.transformer import attention_implementation  # noqa: E402

_MOSAIC = re.compile(r'custom_call_target="tpu_custom_call"')
_BODY = re.compile(r'"body":"([A-Za-z0-9+/=]+)"')
_SPLASH = re.compile(rb"splash_m[hq]a_(?:fwd|dq|dkv)\w*")


def splash_kernels(hlo: str) -> collections.Counter:
    """`{kernel name: count}` of the Mosaic splash kernels in optimized HLO text (`compiled.as_text()`).

    A Pallas TPU kernel is a `custom-call` with `custom_call_target="tpu_custom_call"`; its `backend_config`
    carries the kernel as serialized MLIR (base64 `custom_call_config.body`), whose function is named by
    splash as `splash_{mha|mqa}_{fwd|dq|dkv}[_segmented]_{residuals|no_residuals}` (`get_kernel_name` in
    `jax.experimental.pallas.ops.tpu.splash_attention`). Other Mosaic kernels are not counted.
    """
    names = collections.Counter()
    for call in _MOSAIC.finditer(hlo):
        end = hlo.find("\n  %", call.end())
        body = _BODY.search(hlo, call.end(), end if end != -1 else len(hlo))
        found = body and _SPLASH.search(base64.b64decode(body.group(1)))
        if found:
            names[found.group(0).decode()] += 1
    return names


# topology -> (data, fsdp, tensor) mesh, KV heads of the 4 query heads (split over tensor: 2, or not: 1) and
# the layer's type (splash's local or causal mask)
TOPOLOGIES = {"v5e:2x2": ((1, 2, 2), 2, "sliding"), "v5p:2x2x2": ((2, 2, 2), 1, "full")}
PROMPTS, GROUP, PROMPT_LEN, NEW = 4, 2, 128, 8


def _config(kv_heads: int, layer_type: str) -> models.ModelConfig:
    """One layer of 4 query heads of 128 (one layer: each compile costs seconds of the suite's budget)."""
    return models.ModelConfig(vocab_size=256, hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=kv_heads,
                              head_dim=128, intermediate_size=512, sliding_window=64, layer_types=(layer_type,),
                              dtype="bfloat16", attention_impl="splash")


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def pod(request):
    """`(policy, batch sharding)`: an abstract policy whose parameters are `ShapeDtypeStruct`s placed by the
    default rules on a mesh over the topology's devices."""
    mesh_shape, kv_heads, layer_type = TOPOLOGIES[request.param]
    devices = topologies.get_topology_desc(platform="tpu", topology_name=request.param).devices
    assert devices[0].platform == "tpu" and jax.default_backend() == "cpu"
    config = _config(kv_heads, layer_type)
    layout = Layout(make_mesh(*mesh_shape, devices=devices)).for_model(config)
    abstract = models.abstract(config)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract.params,
                          layout.param_shardings(abstract.params))
    return abstract.replace(params=params, layout=layout), NamedSharding(layout.mesh, PartitionSpec(BATCH_AXES))


def _batch(rows: int, length: int, sharding, dtype=jnp.int32):
    return jax.ShapeDtypeStruct((rows, length), dtype, sharding=sharding)


def test_auto_picks_splash_by_the_mesh_devices_not_the_default_backend(pod):
    policy, _ = pod
    auto = dataclasses.replace(policy.config, attention_impl="auto")
    assert attention_implementation(auto, policy.layout) == "splash"
    assert attention_implementation(auto, None) == "xla"  # the CPU this runs on


def test_logprob_pass_and_its_gradient_compile_with_the_splash_kernels(pod):
    """One program: the log-prob forward (splash forward kernel) and the gradient of a loss through it (the
    forward that saves residuals, and splash's own dq and dkv kernels), one of each per layer."""
    policy, rows = pod
    tokens, prompt_valid = _batch(8, PROMPT_LEN + NEW, rows), _batch(8, PROMPT_LEN, rows, bool)

    def logprobs_and_gradient(params, tokens, prompt_valid):
        def loss(params):
            return train.completion_logprobs(policy.replace(params=params), tokens, prompt_valid)[0].sum()
        logp, _ = train.completion_logprobs(policy.replace(params=params), tokens, prompt_valid)
        return logp, jax.grad(loss)(params)

    hlo = jax.jit(logprobs_and_gradient).lower(policy.params, tokens, prompt_valid).compile().as_text()
    layers = policy.config.num_layers
    assert splash_kernels(hlo) == {"splash_mqa_fwd_segmented_no_residuals": layers,
                                   "splash_mqa_fwd_segmented_residuals": layers,
                                   "splash_mqa_dq_segmented_no_residuals": layers,
                                   "splash_mqa_dkv_segmented_no_residuals": layers}, splash_kernels(hlo)


def test_sampler_compiles_with_a_splash_prefill_and_the_xla_decode(pod):
    """The sampler (prefill of the prompts, then the decode loop over the shared prompt cache) compiles; its
    prefill runs the splash forward kernel once per layer, its decode no Mosaic kernel."""
    policy, rows = pod
    prompts, prompt_valid = _batch(PROMPTS, PROMPT_LEN, rows), _batch(PROMPTS, PROMPT_LEN, rows, bool)
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(rows.mesh, PartitionSpec()))
    config = sampling.SamplingConfig(max_new_tokens=NEW, decode_segments=1)
    compiled = sampling._sample.lower(policy, prompts, prompt_valid, rng, config, 1, 0, None,
                                      group_size=GROUP).compile()
    hlo = compiled.as_text()
    assert splash_kernels(hlo) == {"splash_mqa_fwd_segmented_no_residuals": policy.config.num_layers}
    assert hlo.count('custom_call_target="tpu_custom_call"') == policy.config.num_layers
