"""Logical axis names of the policy's parameters and activations, mapped to a device mesh by rules.

MaxText-style: every parameter dimension and every activation that matters carries a logical name
(`embed`, `heads`, `mlp`, `vocab`, `batch`, ...), and `rules` map each name to mesh axes (`data`, `fsdp`,
`tensor`). The default rules give FSDP (parameters' `embed` dimension over `fsdp`), tensor parallelism
(attention heads, MLP columns and the vocabulary over `tensor`) and data parallelism (the batch over `data`
and `fsdp`). A `Layout` (mesh + rules) travels with a `Policy` as static data; the model calls
`Layout.constrain` on its activations and the train step on gradients, parameters and optimizer state.

A dimension that the mesh axes of its rule do not divide (2 KV heads on `tensor=4`) keeps only the leading
axes that do divide it (replicated in the worst case), and is reported once in the log. A weight dimension
labelled by a heads axis is the flattened `heads * head_dim`: with the model's `head_dim` known
(`Layout.for_model`) it is tested on its number of heads, so that q/k/v/o weights split whole heads exactly
when the heads of the activations and the KV cache are split.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger("jaxrl")

Rules = tuple[tuple[str, tuple[str, ...]], ...]  # (logical name, mesh axes it is split over)

# Names of parameter dimensions. `heads` / `kv_heads` / `mlp` label the flattened `heads * head_dim` and
# intermediate dimensions of the HF `[out, in]` weight layout.
PARAM_AXES = ("embed", "vocab", "heads", "kv_heads", "mlp", "norm", "lora_rank")
# Axes counting attention heads: `[heads]` in activations and KV caches, `[heads * head_dim]` in weights.
HEAD_AXES = ("heads", "kv_heads")
# Names of activation dimensions: `[batch, seq, activation_embed]` hidden states, `[batch, seq, heads,
# head_dim]` queries, `[batch, kv_heads, cache_len, head_dim]` KV caches, `[batch, mlp]` MLP hiddens.
ACTIVATION_AXES = ("batch", "seq", "activation_embed", "head_dim", "cache_len")
LOGICAL_AXES = PARAM_AXES + ACTIVATION_AXES

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("embed", ("fsdp",)),
    ("vocab", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("norm", ()),
    ("lora_rank", ()),
    ("seq", ()),
    ("activation_embed", ()),
    ("head_dim", ()),
    ("cache_len", ()),
)

# (module name, parameter name) -> logical axes of the weight, in HF's `[out, in]` layout.
_WEIGHT_AXES = {
    ("embed_tokens", "weight"): ("vocab", "embed"),
    ("lm_head", "weight"): ("vocab", "embed"),
    ("q_proj", "weight"): ("heads", "embed"),
    ("k_proj", "weight"): ("kv_heads", "embed"),
    ("v_proj", "weight"): ("kv_heads", "embed"),
    ("o_proj", "weight"): ("embed", "heads"),
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "bias"): ("norm",),
    ("gate_proj", "weight"): ("mlp", "embed"),
    ("up_proj", "weight"): ("mlp", "embed"),
    ("down_proj", "weight"): ("embed", "mlp"),
}


def check_rules(rules: Rules, mesh_axes: tuple[str, ...]) -> None:
    """Raise a `ValueError` naming the rule if it names an unknown logical or mesh axis, or a name twice."""
    seen = set()
    for i, rule in enumerate(rules):
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise ValueError(f"mesh.rules[{i}] = {rule!r}: expected [logical_name, mesh axes...]")
        name, axes = rule
        if name not in LOGICAL_AXES:
            raise ValueError(f"mesh.rules[{i}] names the unknown logical axis {name!r}; known: "
                             f"{', '.join(LOGICAL_AXES)}")
        if name in seen:
            raise ValueError(f"mesh.rules[{i}]: logical axis {name!r} has a rule already")
        seen.add(name)
        for axis in axes:
            if axis not in mesh_axes:
                raise ValueError(f"mesh.rules[{i}] maps {name!r} to the unknown mesh axis {axis!r}; the mesh "
                                 f"has {', '.join(mesh_axes)}")
        repeated = [axis for axis in axes if axes.count(axis) > 1]
        if repeated:
            raise ValueError(f"mesh.rules[{i}] maps {name!r} to the mesh axis {repeated[0]!r} more than once: "
                             f"{tuple(axes)}")


def param_axes(path: tuple, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the parameter at `path` (keys of the policy's params, e.g. `('layers', 0, 'mlp',
    'up_proj', 'weight')`). Norm scales are replicated."""
    names = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
    names = [str(n) for n in names]
    if names and names[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
        names = names[:-1]  # an nnx.Variable's array
    if len(names) >= 4 and names[-3:-1] == ["weight", "array"] and names[-1] in ("qvalue", "scale", "zero_point"):
        # a qwix-quantized base weight (`models.lora`): values `[out, in]`, scales `[out, 1]` (int8) or `[out, in / 64]` (4-bit)
        out_axis = _WEIGHT_AXES[(names[-4], "weight")][0]
        axes = (out_axis, _WEIGHT_AXES[(names[-4], "weight")][1] if names[-1] == "qvalue" else None)
        return axes
    if len(names) >= 2 and names[-1] in ("weight_lora_a", "weight_lora_b"):  # LoRA: A [in, rank], B [rank, out]
        inputs, outputs = _WEIGHT_AXES[(names[-2], "weight")][::-1]
        return (inputs, "lora_rank") if names[-1] == "weight_lora_a" else ("lora_rank", outputs)
    if len(names) >= 2 and (names[-2], names[-1]) in _WEIGHT_AXES:
        axes = _WEIGHT_AXES[(names[-2], names[-1])]
    elif any("norm" in n for n in names[-2:]):
        axes = ("norm",) * ndim
    else:
        raise ValueError(f"no logical axes known for the parameter {'.'.join(names)} (shape rank {ndim}); "
                         "add it to models.partitioning._WEIGHT_AXES")
    if len(axes) != ndim:
        raise ValueError(f"parameter {'.'.join(names)} has rank {ndim}, its logical axes {axes} rank {len(axes)}")
    return axes


@dataclasses.dataclass(frozen=True)
class Layout:
    """A device mesh and the rules placing logical axes on it (hashable: a static part of a `Policy`)."""

    mesh: Mesh
    rules: Rules = DEFAULT_RULES
    # The size of one attention head of the model whose parameters this layout places (`for_model`). A weight
    # dimension labelled by a heads axis is then split only over mesh axes that divide its number of heads,
    # as its activations and KV cache are. None: on its flattened size (may split heads and all-gather them).
    head_dim: int | None = None

    def __post_init__(self):
        check_rules(self.rules, tuple(self.mesh.axis_names))
        if self.head_dim is not None and self.head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {self.head_dim}")

    def for_model(self, config: Any) -> "Layout":
        """This layout for the parameters of a model of `config` (a `ModelConfig`: its `head_dim`)."""
        return dataclasses.replace(self, head_dim=config.head_dim)

    def spec(self, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> PartitionSpec:
        """The `PartitionSpec` of an array of `shape` whose dimensions have logical names `axes`."""
        table, used, spec = dict(self.rules), set(), []
        for name, size in zip(axes, shape):
            # Axes of size 1 split nothing; leaving them out gives one spelling for each layout.
            mesh_axes = [a for a in table.get(name, ()) if a not in used and self.mesh.shape[a] > 1]
            while mesh_axes and size % math.prod(self.mesh.shape[a] for a in mesh_axes):
                dropped = mesh_axes.pop()
                _report_uneven(name, size, dropped, self.mesh.shape[dropped])
            used.update(mesh_axes)
            spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes))
        while spec and spec[-1] is None:  # P(None,) is P(): one spelling, so equal layouts compare equal
            spec.pop()
        return PartitionSpec(*spec)

    def sharding(self, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape))

    def constrain(self, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
        """`x` constrained to its logical layout (inside `jax.jit`; guidance for XLA's propagation)."""
        return jax.lax.with_sharding_constraint(x, self.sharding(axes, x.shape))

    def param_sharding(self, path: tuple, shape: tuple[int, ...]) -> NamedSharding:
        """The `NamedSharding` of the parameter at `path` (as `param_axes`) of `shape`. A dimension labelled by
        a heads axis is tested on its number of heads, `size // head_dim`, when `head_dim` is known: whole
        heads per device, as in the activations and the KV cache (`heads` / `kv_heads` of both)."""
        axes = param_axes(path, len(shape))
        if self.head_dim is not None:
            for name, size in zip(axes, shape):
                if name in HEAD_AXES and size % self.head_dim:
                    raise ValueError(f"parameter dimension {name!r} of size {size} is not a whole number of "
                                     f"heads of head_dim {self.head_dim}")
            shape = tuple(size // self.head_dim if name in HEAD_AXES else size for name, size in zip(axes, shape))
        return self.sharding(axes, shape)  # axes that divide the head count divide heads * head_dim too

    def param_shardings(self, params: Any) -> Any:
        """A `NamedSharding` for every parameter of a policy's params (or of any tree shaped like them)."""
        return jax.tree_util.tree_map_with_path(lambda path, x: self.param_sharding(path, x.shape), params)

    def constrain_params(self, params: Any) -> Any:
        return jax.tree.map(jax.lax.with_sharding_constraint, params, self.param_shardings(params))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


_REPORTED: set = set()


def _report_uneven(name, size, axis, axis_size) -> None:
    key = (name, size, axis, axis_size)
    if key not in _REPORTED:  # a log line, not state that changes results
        _REPORTED.add(key)
        log.info("logical axis %r of size %d is not split over mesh axis %r (size %d does not divide it)",
                 name, size, axis, axis_size)
