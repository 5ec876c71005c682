"""One registry for the pieces a config names: objectives, ratios, advantage estimators, loss terms, rewards,
metrics writers, environments and tools.

A piece is registered by a decorator that records its name, its signature and what it needs:

    from jaxrl import registry

    @registry.register("advantage", "median_baseline")
    def median_baseline(inputs, config):          # inputs: advantages.AdvantageInputs
        ...

A config names a piece by its registered name (built-in, or registered by a module listed under the config's
top-level `imports:`), or as `module:function` (importable from the working directory or the installed
packages; registering it is then optional). `resolve` imports, looks up and checks the piece's signature, so a
wrong one is refused when the config loads, before any model or data is read.

Kinds, and the call a piece of each kind gets:
- `objective`: `(log_ratio, advantages, logp, mask, eps_low, eps_high, dual_clip_c) -> (loss [B, N], metrics)`,
  all `[B, N]` float32 (see `jaxrl.losses.policy`).
- `ratio`: `(logp, old_logp, mask) -> log_ratio [B, N]`.
- `advantage`: `(inputs: AdvantageInputs, config: AdvantageConfig)` (by name) `-> advantages [B] or [B, N]`, or
  `(advantages [B, N], returns [B, N])` (see `jaxrl.advantages`).
- `term`: `(inputs: LossInputs, norm: Normalizers, controls: Controls) -> (scalar, metrics)`: a loss term added
  to the configured loss (`rl.loss.terms`, see `jaxrl.losses.compose`).
- `reward`: per completion, any of `prompt, completion, reference, row` by name `-> float`; or batched, any of
  `prompts, completions, references, rows` (lists) `-> sequence of floats`. A class is instantiated once per
  reward worker (no arguments) and its instances called like a function (a reward model, a judge).
- `writer`: `(directory: str, config)` (by name) `-> object with write(record: dict) and close()`: mirrors
  metrics.jsonl; turned on by a top-level bool of its name (`wandb: true`).
- `environment`: a class constructed with the run's `EnvConfig`, with `reset(row) -> (state, observation)` and
  `step(state, turn) -> EnvStep` (see `jaxrl.envs.base`); one instance per environment worker.
- `tool`: `(arguments: dict, context: ToolContext) -> str`, the result the model reads (see `jaxrl.envs.tools`).

`needs` says what a piece needs from the run: `entropy` (per-token policy entropy), `critic` (values),
`greedy_rollouts` (a greedy completion per prompt, scored), `binary_rewards` (right-or-wrong outcomes only).
Other facts are keyword `info` (e.g. a reward's `binary=True`: it scores 1 for right and 0 for wrong).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from jaxrl.errors import JaxrlError

__all__ = ["Entry", "RegistryError", "KINDS", "NEEDS", "register", "resolve", "names",
           "source_hash", "reward_arguments", "record", "changed"]


class RegistryError(JaxrlError, ValueError):
    """A config names a piece that does not exist, cannot be imported or has the wrong signature."""

    kind = "configuration error"

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        # the dotted config field at fault (default: the message's start, "rl.loss.objective: ..."), which the
        # config loader turns into the file:line that set it
        head = message.split(": ", 1)[0]
        self.field = field or (head if re.fullmatch(r"[a-z_][a-z0-9_.]*(\[\d+\])?", head) else None)


# The positional arguments each kind is called with (reward calls are by name: see `reward_arguments`).
KINDS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "objective": ("log_ratio", "advantages", "logp", "mask", "eps_low", "eps_high", "dual_clip_c"),
    "ratio": ("logp", "old_logp", "mask"),
    "advantage": ("inputs", "config"),
    "term": ("inputs", "norm", "controls"),
    "reward": (),
    "writer": ("directory", "config"),
    "environment": ("config",),
    "tool": ("arguments", "context"),
})
# Kinds called with keyword arguments (their parameter names must be the ones above); the others positionally.
KEYWORD_KINDS = frozenset({"advantage", "writer"})
NEEDS = frozenset({"entropy", "critic", "greedy_rollouts", "binary_rewards"})
REWARD_ITEM = ("prompt", "completion", "reference", "row")
REWARD_BATCH = ("prompts", "completions", "references", "rows")


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered piece: `fn` is what the config's name resolves to; `source` its `module:qualname`."""

    kind: str
    name: str
    fn: Callable
    needs: frozenset[str] = frozenset()
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    source: str = ""

    @property
    def builtin(self) -> bool:
        return self.source.startswith("jaxrl.")


_ENTRIES: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}


def _source_of(fn: Callable) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


def register(kind: str, name: str | None = None, *, needs: Iterable[str] = (), **info) -> Callable:
    """Decorator: record `fn` as the `kind` piece `name` (default: its `__name__`), with its `needs` and `info`.

    Registering a name twice with another function is an error (a module imported twice under two names would
    otherwise silently swap pieces); registering the same function again is a no-op."""
    if kind not in KINDS:
        raise ValueError(f"unknown registry kind {kind!r}; kinds: {', '.join(KINDS)}")
    unknown = set(needs) - NEEDS
    if unknown:
        raise ValueError(f"unknown needs {sorted(unknown)}; valid: {', '.join(sorted(NEEDS))}")

    def decorate(fn: Callable) -> Callable:
        key = name or fn.__name__
        _check_signature(kind, fn, f"@register({kind!r}, {key!r})")
        entry = Entry(kind, key, fn, frozenset(needs), MappingProxyType(dict(info)), _source_of(fn))
        held = _ENTRIES[kind].get(key)
        if held is not None and held.source != entry.source:
            raise ValueError(f"{kind} {key!r} is registered twice: by {held.source} and by {entry.source}")
        _ENTRIES[kind][key] = entry
        fn.__jaxrl_entry__ = entry
        return fn

    return decorate


def _builtins() -> None:
    """Import the modules that register the built-in pieces (on first use: importing them is not free)."""
    import jaxrl.advantages  # noqa: F401
    import jaxrl.envs.environments  # noqa: F401 - the `tools` environment and the built-in tools
    import jaxrl.losses.policy  # noqa: F401
    import jaxrl.metrics  # noqa: F401
    import jaxrl.rewards  # noqa: F401


def names(kind: str) -> tuple[str, ...]:
    """The registered names of `kind`, sorted (built-ins and those registered by modules imported so far)."""
    _builtins()
    return tuple(sorted(_ENTRIES[kind]))


def _path_hint(error: Exception) -> str:
    if isinstance(error, ModuleNotFoundError):
        return " (is it on the Python path? Run from the directory that holds it, or set PYTHONPATH)"
    return ""


def resolve(kind: str, ref: str, field: str) -> Entry:
    """The `kind` piece a config names at `field`: a registered name or `module:function`.

    Raises `RegistryError` naming `field`: an unknown name (with the valid ones), a module that does not import,
    a missing attribute, or a signature that does not fit `kind` (with the expected arguments)."""
    if not isinstance(ref, str) or not ref.strip():
        raise RegistryError(f"{field}: expected a {kind} name or module:function, got {ref!r}")
    if ":" not in ref:
        _builtins()
        entry = _ENTRIES[kind].get(ref)
        if entry is None:
            known = ", ".join(map(repr, names(kind)))
            raise RegistryError(f"{field}: unknown {kind} {ref!r}; registered: {known}; or name "
                                "one as module:function, or list the module that registers it under imports:")
        return entry
    module_name, _, attribute = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001
        raise RegistryError(f"{field}: cannot import module {module_name!r} of {ref!r}: {type(e).__name__}: "
                            f"{e}{_path_hint(e)}") from None
    fn: Any = module
    for part in attribute.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise RegistryError(f"{field}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                                f"{attribute!r}")
    if not callable(fn):
        raise RegistryError(f"{field}: {ref} is a {type(fn).__name__}, not a function or class")
    held = getattr(fn, "__jaxrl_entry__", None)
    if held is not None and held.kind == kind:
        return dataclasses.replace(held, name=ref)
    _check_signature(kind, fn, field)
    return Entry(kind, ref, fn, frozenset(), MappingProxyType({}), _source_of(fn))


def _is_callable_class(fn: Callable) -> bool:
    return inspect.isclass(fn) and any("__call__" in vars(c) for c in fn.__mro__[:-1])


def _check_signature(kind: str, fn: Callable, field: str) -> None:
    if kind == "reward":
        reward_arguments(fn, field)
        return
    if kind == "environment":
        _check_environment(fn, field)
        return
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: accepted as is
        return
    expected = KINDS[kind]
    try:
        if kind in KEYWORD_KINDS:
            signature.bind(**dict.fromkeys(expected))
        else:
            signature.bind(*expected)
    except TypeError as e:
        raise RegistryError(f"{field}: {_source_of(fn)}{signature} does not take a {kind}'s arguments "
                            f"({', '.join(expected)}): {e}") from None


def _check_environment(cls: Callable, field: str) -> None:
    """An environment is a class constructed with the `EnvConfig`, with `reset(row)` and `step(state, turn)`."""
    if not inspect.isclass(cls):
        raise RegistryError(f"{field}: {_source_of(cls)} is not a class: an environment is a class constructed "
                            "with the EnvConfig, with reset(row) and step(state, turn) methods")
    for method, arguments in (("reset", ("row",)), ("step", ("state", "turn"))):
        member = getattr(cls, method, None)
        if not callable(member):
            raise RegistryError(f"{field}: environment {_source_of(cls)} has no {method}{arguments} method")
        try:
            inspect.signature(member).bind(None, *arguments)  # the unbound method: self first
        except TypeError as e:
            raise RegistryError(f"{field}: environment {_source_of(cls)}.{method} does not take "
                                f"({', '.join(arguments)}): {e}") from None
        except ValueError:
            pass
    try:
        inspect.signature(cls).bind("config")
    except TypeError as e:
        raise RegistryError(f"{field}: environment {_source_of(cls)} is not constructible with the EnvConfig "
                            f"alone: {e}") from None
    except ValueError:
        pass


def reward_arguments(fn: Callable, field: str) -> tuple[tuple[str, ...], bool]:
    """`(names, batched)`: which of a reward's arguments `fn` takes, and whether it takes lists (batched).

    A class is checked by its `__call__` (it is instantiated once per worker, without arguments); `**kwargs`
    takes all four. Raises `RegistryError` naming `field` for an argument that is none of them, for a mix of
    per-item and batched names, or for a class that cannot be instantiated without arguments."""
    target = fn
    if inspect.isclass(fn):
        if not _is_callable_class(fn):
            raise RegistryError(f"{field}: class {_source_of(fn)} has no __call__: a reward class is instantiated "
                                "once per worker and its instance called with the batch")
        try:
            inspect.signature(fn).bind()
        except TypeError as e:
            raise RegistryError(f"{field}: class {_source_of(fn)} must be constructible without arguments (it is "
                                f"instantiated once per reward worker): {e}") from None
        except ValueError:
            pass
        target = fn.__call__
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return REWARD_ITEM, False
    parameters = list(signature.parameters.values())
    if inspect.isclass(fn) and parameters:  # the unbound __call__: its first parameter is the instance
        parameters = parameters[1:]
    expected = (f"per completion any of ({', '.join(REWARD_ITEM)}), or batched any of "
                f"({', '.join(REWARD_BATCH)}), by name")
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return REWARD_ITEM, False
    known = REWARD_ITEM + REWARD_BATCH
    taken = tuple(p.name for p in parameters if p.name in known)
    # any other parameter must have a default (it is never passed), e.g. math_verify's `timeout`
    unknown = [p.name for p in parameters if p.name not in known and p.default is p.empty
               and p.kind is not p.VAR_POSITIONAL]
    item, batch = [n for n in taken if n in REWARD_ITEM], [n for n in taken if n in REWARD_BATCH]
    if unknown or not taken or (item and batch):
        why = (f"takes {', '.join(unknown)}" if unknown else "takes no arguments" if not taken
               else "mixes per-completion and batched arguments")
        raise RegistryError(f"{field}: reward {_source_of(fn)}{signature} {why}; a reward takes {expected}")
    if "completion" not in item and "completions" not in batch:
        raise RegistryError(f"{field}: reward {_source_of(fn)}{signature} does not take the completion; a reward "
                            f"takes {expected}")
    return tuple(taken), bool(batch)


def source_hash(fn: Callable) -> str:
    """sha256 (hex, first 16 digits) of the source file that defines `fn` (its function's source when the
    file is not readable, as in a notebook): a resumed run compares it to the recorded one."""
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    text = None
    try:
        path = inspect.getsourcefile(module) if module is not None else None
        if path:
            with open(path, "rb") as f:
                text = f.read()
    except (OSError, TypeError):
        text = None
    if text is None:
        try:
            text = inspect.getsource(fn).encode()
        except (OSError, TypeError):
            text = _source_of(fn).encode()
    return hashlib.sha256(text).hexdigest()[:16]


def record(pieces: Mapping[str, Entry]) -> tuple[tuple[str, str, str], ...]:
    """`(field, module:qualname, source_hash)` of every piece that is not jaxrl's own, sorted by field: what a
    run writes to its config.yaml (`piece_sources`) and summary.json."""
    return tuple((field, entry.source, source_hash(entry.fn))
                 for field, entry in sorted(pieces.items()) if not entry.builtin)


def changed(recorded: Iterable[Iterable[str]], current: Iterable[Iterable[str]]) -> list[str]:
    """One line per recorded piece that `current` names differently or whose source hash differs."""
    now = {field: (source, digest) for field, source, digest in current}
    lines = []
    for field, source, digest in recorded:
        held = now.get(field)
        if held is None:
            lines.append(f"{field}: the run used {source}, the config names a built-in piece or none")
        elif held[0] != source:
            lines.append(f"{field}: the run used {source}, the config names {held[0]}")
        elif held[1] != digest:
            lines.append(f"{field}: the source of {source} changed (sha256 {digest} -> {held[1]})")
    recorded_fields = {field for field, _, _ in recorded}
    lines += [f"{field}: the config names {source}, which the run did not use"
              for field, (source, _) in now.items() if field not in recorded_fields]
    return lines
