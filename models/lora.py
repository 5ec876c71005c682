"""LoRA and QLoRA adapters on a frozen base, through qwix (the library Tunix uses for both).

`add_adapters` intercepts the chosen projections' matmuls with `qwix.LoraProvider`: each target `Linear` gets
`weight_lora_a [in, rank]` and `weight_lora_b [rank, out]` (`nnx.LoRAParam`), and computes
`y = x W^T + (alpha / rank) (x A) B`, with B zero at the start, so the adapted policy starts equal to the base.
With `quantize` the base's projection weights are stored as qwix `QArray`s (int8 per output channel, or 4-bit
in groups of `QUANT_GROUP` inputs), read by qwix's quantized matmul; adapters and activations stay in the
compute dtype.

The adapted policy is a `Policy` whose `params` are the adapters alone and whose `frozen` holds the base: every
function that differentiates, updates, shards or checkpoints `policy.params` therefore touches only the adapters,
and the sampler runs the adapted policy as it is (no weight merge). `adapters_off` is the same base with zero
adapters: the KL reference, without a second copy of the model. `merged` folds the adapters into plain
weights (the merged HF export).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

from jaxrl.models.transformer import Linear, Policy, Transformer, abstract, positions_from_mask

# The projections of each block that adapters can target (the output head is not: its matmul runs outside the
# model, in `logits_from_hidden`).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANTIZATIONS = ("int8", "int4", "nf4")
QUANT_GROUP = 64  # inputs per scale of a 4-bit base (QLoRA's block size)
BASE_RECORD = "lora_base.json"  # in a LoRA run's directory: the base its adapters go on (`jaxrl.loop.adapters`)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What `add_adapters` builds. `targets`: regular expressions, each matching a projection's name
    (`q_proj`) or its whole path (`layers/0/self_attn/q_proj`). `quantize`: None (the base as loaded) or a
    qwix weight type for the frozen base (`int8`, `int4`, `nf4`)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = PROJECTIONS
    quantize: str | None = None

    def __post_init__(self):
        if self.rank <= 0:
            raise ValueError(f"rank must be positive, got {self.rank}")
        if not self.targets:
            raise ValueError("targets is empty: name at least one projection (" + ", ".join(PROJECTIONS) + ")")
        if self.quantize is not None and self.quantize not in QUANTIZATIONS:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZATIONS)} (or null), got {self.quantize!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, settings) -> "LoraSpec":
        """The spec of a run's `rl.lora` section (`jaxrl.config.LoraConfig`: rank, alpha, targets, quantize)."""
        return cls(rank=settings.rank, alpha=settings.alpha, targets=tuple(settings.targets),
                   quantize=settings.quantize)


def projection_paths(config) -> list[str]:
    """Every projection an adapter can target, as `layers/<i>/<self_attn|mlp>/<name>`."""
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return ["/".join(map(str, path)) for path, module in model.iter_modules()
            if isinstance(module, Linear) and path and path[-1] in PROJECTIONS]


def target_paths(config, targets: tuple[str, ...]) -> list[str]:
    """The projection paths `targets` select. A pattern that selects nothing raises a `ValueError` listing
    the names it could have matched."""
    paths = projection_paths(config)
    chosen = set()
    for pattern in targets:
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"target {pattern!r} is not a regular expression: {e}") from None
        hits = [p for p in paths if regex.fullmatch(p) or regex.fullmatch(p.rsplit("/", 1)[-1])]
        if not hits:
            names = sorted({p.rsplit("/", 1)[-1] for p in paths}, key=PROJECTIONS.index)
            raise ValueError(f"target {pattern!r} matches no projection of this model; its projections are "
                             f"{', '.join(names)} (by name), or paths such as {paths[0]}")
        chosen.update(hits)
    return [p for p in paths if p in chosen]


def _union(paths) -> str:
    return "(" + "|".join(re.escape(p) for p in paths) + ")"


def is_adapted(policy: Policy) -> bool:
    return policy.frozen is not None


def add_adapters(policy: Policy, spec: LoraSpec, seed: int) -> Policy:
    """`policy` with LoRA adapters on `spec.targets` (A from He-uniform draws of `seed`, B zero), and its base
    quantized when `spec.quantize` is set. Returns a policy whose `params` are the adapters and `frozen` the
    base; its `layout` is kept (place it with `models.shard`). The base's arrays are shared, not copied."""
    if is_adapted(policy):
        raise ValueError("the policy already has adapters")
    targets = target_paths(policy.config, spec.targets)
    rules = [qwix.LoraRule(module_path=_union(targets), rank=spec.rank, alpha=float(spec.alpha),
                           weight_qtype=spec.quantize, tile_size=_tile_size(spec.quantize, policy.config))]
    others = [p for p in projection_paths(policy.config) if p not in targets]
    if spec.quantize is not None and others:  # QLoRA keeps every projection of the base quantized
        rules.append(qwix.QuantizationRule(module_path=_union(others), weight_qtype=spec.quantize,
                                           tile_size=_tile_size(spec.quantize, policy.config)))
    provider = qwix.LoraProvider(rules)
    # the dummy call below runs without rematerialisation: inside a checkpointed block, qwix would create the
    # adapters on a copy of the block; the policy's own `remat` is set back afterwards
    plain = abstract(dataclasses.replace(policy.config, remat="none")).graphdef
    shared = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(policy.params)}
    traced = {}

    def build(params):
        model = nnx.merge(plain, params)
        if spec.quantize is not None:  # qwix quantizes weights in their compute dtype (its astype takes no QArray)
            compute = jnp.dtype(policy.config.dtype)
            for path, module in model.iter_modules():  # (the projections only: the output head stays as it is)
                if path and path[-1] in PROJECTIONS and module.weight[...].dtype != compute:
                    module.weight = nnx.Param(module.weight[...].astype(compute))
        tokens = jnp.zeros((1, 2), jnp.int32)
        valid = jnp.ones((1, 2), bool)
        # qwix creates the adapters (and quantizes the base) while running the model once on a dummy input
        adapted = qwix.apply_lora_to_model(model, provider, tokens, positions_from_mask(valid), valid,
                                           rngs=nnx.Rngs(seed))
        adapted.config = policy.config  # (a static attribute: only `Transformer.__call__` reads `remat`)
        graphdef, adapters, frozen = nnx.split(adapted, nnx.LoRAParam, ...)
        leaves = jax.tree_util.tree_leaves_with_path(frozen)
        traced.update(graphdef=graphdef, structure=jax.tree.structure(frozen),
                      paths=[jax.tree_util.keystr(path) for path, _ in leaves])
        # the base's own arrays are not returned (a copy of the whole base): only what qwix made of them
        return adapters, {key: x for key, (_, x) in zip(traced["paths"], leaves) if key not in shared}

    # one compiled program instead of the dummy forward's ops one by one
    adapters, made = jax.jit(build)(policy.params)
    base = {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_leaves_with_path(policy.params)}
    frozen = jax.tree.unflatten(traced["structure"], [made[k] if k in made else base[k] for k in traced["paths"]])
    graphdef = traced["graphdef"]
    return Policy(graphdef, policy.config, adapters, policy.layout, frozen)


def _tile_size(quantize: str | None, config) -> int | None:
    """Inputs per scale: one scale per output channel for int8; for 4 bits, groups of `QUANT_GROUP` inputs, or
    of the largest size that divides every projection's inputs when that does not."""
    if quantize not in ("int4", "nf4"):
        return None
    return math.gcd(QUANT_GROUP, config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim)


def adapters_off(policy: Policy) -> Policy:
    """The base alone: `policy` with zero adapters (same graph, same base arrays; only the adapters' small
    zero arrays are new). Its outputs equal the base model's exactly."""
    return policy.replace(params=jax.tree.map(jnp.zeros_like, policy.params))


def adapter_weights(policy: Policy) -> dict[str, tuple[jax.Array, jax.Array]]:
    """`{path: (A [in, rank], B [rank, out])}` for every adapted projection (`layers/0/self_attn/q_proj`)."""
    flat = {tuple(map(str, k)): v for k, v in nnx.to_flat_state(policy.params)}
    out = {}
    for key, value in flat.items():
        if key[-1] == "weight_lora_a":
            path = "/".join(key[:-1])
            out[path] = (value[...], flat[key[:-1] + ("weight_lora_b",)][...])
    return out


def _module(model: nnx.Module, path: str) -> nnx.Module:
    for part in path.split("/"):
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


def base_weights(policy: Policy) -> dict[str, jax.Array]:
    """`{path: W [out, in]}` of every projection of the base, dequantized where the base is quantized."""
    model = nnx.merge(policy.graphdef, policy.params, policy.frozen)
    out = {}
    for path in projection_paths(policy.config):
        weight = _module(model, path).weight
        out[path] = qwix.dequantize(weight.array) if hasattr(weight, "array") else weight[...]
    return out


def merged(policy: Policy, spec: LoraSpec) -> Policy:
    """The adapted `policy` as a plain policy: each adapted weight `W + (alpha / rank) (A B)^T` (summed in
    float32, stored in the parameter dtype), the rest of the base as it is. A quantized base is dequantized."""
    plain = abstract(policy.config)
    adapters = adapter_weights(policy)
    bases = base_weights(policy)
    frozen = {tuple(map(str, k)): v for k, v in nnx.to_flat_state(policy.frozen)}
    values = []
    for key, template in nnx.to_flat_state(plain.params):
        key = tuple(map(str, key))
        path = "/".join(key[:-1])
        value = bases[path] if key[-1] == "weight" and path in bases else frozen[key][...]
        if key[-1] == "weight" and path in adapters:
            a, b = adapters[path]
            delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)).T * spec.scale
            value = value.astype(jnp.float32) + delta
        values.append(jnp.asarray(value).astype(template.dtype))
    state = jax.tree.unflatten(jax.tree.structure(plain.params), values)
    return Policy(plain.graphdef, policy.config, state, policy.layout)


def fingerprint(policy: Policy) -> str:
    """A digest of a plain policy's weights: each parameter's path, shape, dtype, and its sum and sum of squares
    (float32 on the devices, 6 significant digits, so the digest does not depend on the sharding)."""
    sums = jax.jit(lambda params: jax.tree.map(
        lambda x: jnp.stack([jnp.sum(x.astype(jnp.float32)), jnp.sum(jnp.square(x.astype(jnp.float32)))]),
        params))(policy.params)
    digest = hashlib.sha256()
    for (path, x), (_, s) in zip(jax.tree_util.tree_leaves_with_path(policy.params),
                                 jax.tree_util.tree_leaves_with_path(sums)):
        s = np.asarray(jax.device_get(s), np.float64)
        digest.update(f"{jax.tree_util.keystr(path)} {x.shape} {x.dtype} {s[0]:.6g} {s[1]:.6g}\n".encode())
    return digest.hexdigest()[:16]


def count(tree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))
