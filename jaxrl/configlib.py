"""Typed configuration: YAML files + ``key=value`` overrides -> frozen dataclasses.

A schema is a tree of (frozen) dataclasses whose fields all have defaults and
are typed as ``int``, ``float``, ``str``, ``bool``, ``X | None``,
``Literal[...]``, ``tuple[T, ...]``, ``dict[str, T]`` (or ``Mapping[str, T]``: free string keys, each value
checked as a ``T`` with the field's bounds, stored as a read-only, hashable :class:`FrozenMapping` that keeps
the keys' order) or a nested dataclass::

    @dataclass(frozen=True)
    class Optim:
        learning_rate: float = field(default=3e-4, metadata={"gt": 0})
        schedule: Literal["constant", "cosine"] = "cosine"

    @dataclass(frozen=True)
    class Root:
        seed: int = 0
        optim: Optim = field(default_factory=Optim)

    cfg = load_config(Root, "configs/default.yaml", ["optim.learning_rate=1e-3"])

A YAML file lists only what it changes; overrides apply after it, in order.
Nothing is coerced silently (``"3"`` is not an int, ``true`` is not a number);
the one exception is PyYAML's YAML 1.1 quirk that reads plain ``1e-3`` as a
string: unquoted scalars and override values that ``float()`` accepts are taken
for float fields, NaN for none. Bounds come from ``field(metadata={"gt"|"ge"|"lt"|"le": x})``
(element-wise for tuples and mappings) and cross-field checks from an optional ``validate(self)`` method raising
``ValueError``. A float is finite unless its bounds admit infinity explicitly (``le=math.inf``, or
``ge=-math.inf`` for -inf), and an int fits in 64 bits. A dataclass with a ``PRESETS`` class attribute (name -> mapping
of field values) and a ``preset`` field is built from the named preset first;
the section's explicitly set fields then apply on top, whatever their order. A mapping field is written as a
YAML mapping (``extra: {my_rewards:brevity: 0.1}``) or an override (``reward.extra={my_rewards:brevity: 0.1}``,
or ``reward.extra.brevity=0.1`` for a key without dots); like a section, it merges into the field's present
mapping key by key. :func:`dump_yaml` writes
such a section as its preset (if set) plus only the fields that differ from what that preset alone, or the
defaults, give (:func:`to_dict` keeps every field),
so a dumped config loads back equal and a ``preset=`` override on it acts as on the original recipe.
A config file must be a regular file of at most 256 KiB; its YAML may use anchors, aliases and merge keys
(``<<: *defaults``), but no document (file or override value) may hold or expand through its aliases to more
than 20,000 nodes or nest deeper than 32 levels (an alias bomb of a few hundred bytes describes 10^9 nodes).
Every problem raises :class:`ConfigError`, whose message names
the dotted field and, when known, ``file:line`` or the offending override, e.g.
``configs/default.yaml:12: optim.learning_rate: expected a float, got 'abc' (str)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import operator
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

import yaml

from jaxrl.errors import JaxrlError

__all__ = ["ConfigError", "FrozenMapping", "load_config", "load_yaml", "from_dict", "to_dict", "dump_yaml",
           "replace_path", "describe"]

T = TypeVar("T")

_SCALARS = {bool: "a bool (true or false)", int: "an int", float: "a float", str: "a str"}
_BOUNDS = {"gt": (operator.gt, ">"), "ge": (operator.ge, ">="),
           "lt": (operator.lt, "<"), "le": (operator.le, "<=")}


class ConfigError(JaxrlError, ValueError):
    """Bad configuration: the message names the dotted field path and, when known, 'file:line'."""

    kind = "configuration error"


class FrozenMapping(Mapping):
    """The value of a ``dict[str, T]`` config field: a read-only mapping that keeps its keys' order, compares
    equal to any mapping with the same items (order aside), hashes (so a frozen config stays hashable) and
    pickles."""

    __slots__ = ("_items",)

    def __init__(self, items=()):
        object.__setattr__(self, "_items", dict(items))

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and self._items == dict(other.items())

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __reduce__(self):
        return type(self), (self._items,)

    def __repr__(self) -> str:
        return repr(self._items)


class _PlainStr(str):
    """A string from an unquoted YAML scalar or an override: may be read as a float."""


# Limits of a config document. Aliases make a small file describe a huge tree (the "billion laughs": ten
# aliases of ten aliases of ... is 10^9 nodes in under 1 kB), and every consumer (sections, construction, error
# messages) walks the tree with aliases expanded; nesting exhausts Python's stack. A recipe has a few hundred
# nodes and nests 5 levels.
_MAX_NODES = 20_000  # nodes of the document, written or with every alias expanded
_MAX_DEPTH = 32  # nesting, with aliases expanded
_MAX_BYTES = 256 * 2**10  # of a config file (a recipe is a few kB, and PyYAML is pure Python)


class _Loader(yaml.SafeLoader):
    """SafeLoader that marks strings coming from plain (unquoted) scalars and refuses nesting deeper than
    `_MAX_DEPTH` while composing (PyYAML's composer recurses once per level)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = self._nodes = 0

    def compose_node(self, parent, index):
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > _MAX_DEPTH or self._nodes > _MAX_NODES:
                problem = (f"nested deeper than {_MAX_DEPTH} levels" if self._depth > _MAX_DEPTH else
                           f"more than {_MAX_NODES:,} values")
                raise yaml.composer.ComposerError(None, None, problem, self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _construct_str(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> str:
    text = loader.construct_scalar(node)
    return _PlainStr(text) if node.style is None else text


_Loader.add_constructor("tag:yaml.org,2002:str", _construct_str)

# YAML 1.2's scalars, not PyYAML's YAML 1.1 ones: only true/false are bools (``initialize=on`` is the string
# "on", ``yes`` a string), an int is decimal (``seed=010`` is 10, not octal 8) or 0x/0o-prefixed, and there
# are no base-60 numbers (``steps=1:30`` is a string, not 90).
_BOOL, _INT, _FLOAT = (f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float"))
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL, _INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9][0-9_]*|0x[0-9a-fA-F_]+|0o[0-7_]+)$"), list("-+0123456789"))
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    base = {"0x": 16, "0o": 8}.get(text[:2].lower(), 10)
    return int(text[2:] if base != 10 else text, base)


def _construct_bool(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> bool:
    return loader.construct_scalar(node).lower() == "true"


_Loader.add_constructor(_INT, _construct_int)
_Loader.add_constructor(_BOOL, _construct_bool)


@dataclasses.dataclass
class _Value:
    """A raw leaf value and where it came from ('file:line', "override '...'", ...)."""
    value: Any
    where: str


@dataclasses.dataclass
class _Section:
    """A raw mapping of field name -> _Value | _Section, and where it came from."""
    items: dict[str, _Value | _Section]
    where: str


# --------------------------------------------------------------------------- public API


def load_config(cls: type[T], path: str | os.PathLike | None = None,
                overrides: Sequence[str] = ()) -> T:
    """Build ``cls`` from its defaults, the YAML file at ``path`` (if any), then ``overrides``."""
    _require_dataclass_type(cls)
    tree = _Section({}, "") if path is None else _read_yaml(path)
    for item in overrides:
        _apply_override(tree, item)
    return _merge(cls(), tree, "")


def from_dict(cls: type[T], data: Mapping, *, source: str = "<dict>") -> T:
    """Build ``cls`` from a nested mapping (strict types; ``source`` labels errors)."""
    _require_dataclass_type(cls)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping of fields, got {_show(data)}")
    return _merge(cls(), _entry(dict(data), source), "")


def to_dict(config) -> dict:
    """Plain nested dict of a config (tuples become lists), e.g. for YAML/JSON dumps."""
    if not _is_dataclass_instance(config):
        raise TypeError(f"to_dict expects a dataclass instance, got {type(config).__name__}")
    return {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}


def dump_yaml(config) -> str:
    """YAML text of a config; ``load_config(type(config), file_with_this_text)`` gives it back.

    Unlike :func:`to_dict`, a section with presets is written as ``preset: <name>`` (if set) plus only the fields
    that differ from what that preset alone (or the defaults) give, so that overriding the preset on the dumped
    file changes what the preset governs, as it would on the original recipe.
    """
    if not _is_dataclass_instance(config):
        raise TypeError(f"dump_yaml expects a dataclass instance, got {type(config).__name__}")
    return yaml.safe_dump(_dump(config, type(config)()), sort_keys=False)


def describe(config, choices: Mapping[str, str] | None = None) -> str:
    """Every field of ``config`` as YAML-like lines (sections indented), each with its type, bounds and default::

        seed: 1  # int >= 0, <= 4294967295; default 0 (changed)
        optim:
          schedule: "cosine"  # one of 'constant', 'cosine'; default "cosine"

    ``choices``: dotted field -> text appended to its line (e.g. the registered names a field may take). The
    default of a field is the schema's (the field's dataclass built without arguments); a value that differs
    from it is marked ``(changed)``."""
    if not _is_dataclass_instance(config):
        raise TypeError(f"describe expects a dataclass instance, got {type(config).__name__}")
    lines: list[str] = []
    _describe_section(config, type(config)(), "", 0, dict(choices or {}), lines)
    return "\n".join(lines) + "\n"


def _describe_section(config, default, path: str, depth: int, choices: dict, lines: list[str]) -> None:
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        if not f.init:
            continue
        value, start, sub, indent = getattr(config, f.name), getattr(default, f.name), _join(path, f.name), \
            "  " * depth
        if _is_dataclass_instance(value):
            lines.append(f"{indent}{f.name}:")
            _describe_section(value, start if isinstance(start, type(value)) else type(value)(), sub, depth + 1,
                              choices, lines)
            continue
        bounds = ", ".join(f"{_BOUNDS[k][1]} {_flow(f.metadata[k])}" for k in _BOUNDS if k in f.metadata)
        note = _type_name(hints[f.name]) + (f" {bounds}" if bounds else "") + f"; default {_flow(start)}"
        if value != start:
            note += " (changed)"
        if sub in choices:
            note += f"; {choices[sub]}"
        lines.append(f"{indent}{f.name}: {_flow(value)}  # {note}")


def _type_name(tp) -> str:
    """Short type name of a schema field: ``int``, ``str or null``, ``list of float``, ``one of 'a', 'b'``."""
    inner, optional = _unwrap_optional(tp)
    if optional:
        return f"{_type_name(inner)} or null"
    if inner in _SCALARS:
        return inner.__name__
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple and args:
        if args[-1] is Ellipsis:
            return f"list of {_type_name(args[0])}"
        return "list of " + ", ".join(_type_name(a) for a in args)
    if _is_mapping_type(inner):
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    return getattr(inner, "__name__", str(inner))


def _flow(value) -> str:
    """A value as one line of YAML flow syntax (strings quoted as JSON, which YAML reads back)."""
    import json

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, float) and math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def replace_path(config: T, dotted: str, value) -> T:
    """Return ``config`` with the field at ``dotted`` (e.g. 'optim.learning_rate') set to ``value``.

    The value is checked exactly like an override (types, bounds, ``validate``).
    """
    where = f"replace_path({dotted!r})"
    keys = [k.strip() for k in dotted.split(".")]
    if not all(keys):
        raise ConfigError(f"{where}: expected a dotted field path like 'section.field'")
    tree = _Section({}, "")
    _set(tree, keys, _entry(_PlainStr(value) if isinstance(value, str) else value, where))
    return _merge(config, tree, "")


# --------------------------------------------------------------------------- reading sources


def load_yaml(path: str | os.PathLike) -> Any:
    """The plain data (dicts, lists, scalars) of a YAML file, read with this module's scalars and limits (a
    regular file, 256 KiB, at most 20,000 nodes with aliases expanded, 32 levels); ConfigError naming the file
    and line. For files that are not one schema, e.g. a section of a run's config.yaml."""
    def build(node, loader, name, text):
        if node is None:
            return None
        try:
            return loader.construct_document(node)
        except ValueError as e:  # an impossible timestamp, an int beyond Python's 4300 digits, ...
            raise ConfigError(f"{name}: invalid value: {str(e).split(';')[0]}") from None
    return _read_yaml(path, build)


def _read_yaml(path: str | os.PathLike, build=None):
    """Parse a YAML file into a raw section tree that remembers each key's line (or ``build(node, loader,
    name, text)`` of its composed, size-checked document)."""
    from jaxrl.models.safe_read import read_regular  # lazy: `models` imports jax

    name = str(path)
    try:
        data = read_regular(path, _MAX_BYTES, ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"{name}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{name}: cannot read config file: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as text mode
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(f"{name}:{line}: not UTF-8 text: byte {data[e.start]:#04x} ({e.reason}); save the file "
                          "as UTF-8") from None
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if build is not None:
            if node is not None:
                _check_size(node, name)
            return build(node, loader, name, text)
        if node is None:  # empty file: defaults only
            return _Section({}, name)
        if not isinstance(node, yaml.MappingNode):
            raise ConfigError(f"{name}:{node.start_mark.line + 1}: the top level must be a "
                              f"mapping of 'field: value' pairs, got a {node.id}")
        _check_size(node, name)
        return _section_from_node(node, loader, name, "", name, text)
    except yaml.MarkedYAMLError as e:
        mark, opened = e.problem_mark or e.context_mark, e.context_mark
        reason = _yaml_reason(e)
        if opened is not None and mark is not None and opened.line != mark.line:
            if mark.index >= len(text.rstrip()):  # at the end of the file: where the open thing began says more
                mark = opened
            else:
                reason += f" (it began at line {opened.line + 1})"
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{name}{line}: invalid YAML: {reason}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{name}: invalid YAML: {e}") from None
    finally:
        loader.dispose()


def _check_size(root: yaml.Node, name: str, lines: bool = True) -> None:
    """Refuse a composed document (``name``: its file, with ``lines``; or an override) whose tree, with every
    alias expanded, has more than ``_MAX_NODES`` nodes, nests deeper than ``_MAX_DEPTH`` levels, or contains
    itself (``&a [*a]``). Linear in the composed nodes: each shared node's expanded size is computed once
    (iteratively)."""
    size: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, expanded depth)
    open_nodes: set[int] = set()  # the current path from the root
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else
                    node.value if isinstance(node, yaml.SequenceNode) else [])
        line = f"{name}:{node.start_mark.line + 1}" if lines else name
        if finished:
            open_nodes.discard(id(node))
            nodes = 1 + sum(size[id(c)][0] for c in children)
            depth = 1 + max((size[id(c)][1] for c in children), default=0)
            if nodes > _MAX_NODES:
                raise ConfigError(f"{line}: this value has more than {_MAX_NODES:,} nodes with its YAML aliases "
                                  "expanded (an alias bomb?)")
            if depth > _MAX_DEPTH:
                raise ConfigError(f"{line}: invalid YAML: nested deeper than {_MAX_DEPTH} levels with aliases "
                                  "expanded")
            size[id(node)] = nodes, depth
        elif id(node) not in size:
            open_nodes.add(id(node))
            stack.append((node, True))
            for child in children:
                if id(child) in open_nodes:
                    raise ConfigError(f"{line}: invalid YAML: an alias refers to a value that contains it "
                                      "(a recursive structure)")
                if id(child) not in size:
                    stack.append((child, False))


_MERGE = "tag:yaml.org,2002:merge"


def _section_from_node(node: yaml.MappingNode, loader: yaml.SafeLoader, file: str,
                       path: str, where: str, text: str) -> _Section:
    """Convert a composed mapping node (``text``: the file's), rejecting duplicate keys and comment-cut values.

    A merge key (``<<: *defaults`` or ``<<: [*a, *b]``) brings in the keys of the mapping(s) it names, as YAML
    defines it: keys written in this mapping win, then the earlier of the merged mappings; the merge is shallow
    (a section written here replaces the merged one)."""
    items: dict[str, _Value | _Section] = {}
    first_line: dict[str, int] = {}
    merged: dict[str, _Value | _Section] = {}
    for key_node, value_node in node.value:
        line = key_node.start_mark.line + 1
        key_where = f"{file}:{line}"
        if not isinstance(key_node, yaml.ScalarNode):
            raise _error(key_where, path, "mapping keys must be plain field names")
        key = key_node.value
        if key_node.tag == _MERGE:
            if "<<" in first_line:
                raise _error(key_where, path, f"duplicate merge key '<<' (first at line {first_line['<<']}); "
                                              "merge several mappings with <<: [*a, *b]")
            first_line["<<"] = line
            sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            if not sources or not all(isinstance(n, yaml.MappingNode) for n in sources):
                raise _error(key_where, path, "a merge key '<<' takes a mapping or a list of mappings, e.g. "
                                              "<<: *defaults")
            for source in reversed(sources):
                merged.update(_section_from_node(source, loader, file, path, key_where, text).items)
            continue
        sub = _join(path, key)
        if key in first_line:
            raise _error(key_where, sub, f"duplicate key (first defined at line {first_line[key]})")
        first_line[key] = line
        if isinstance(value_node, yaml.MappingNode):
            items[key] = _section_from_node(value_node, loader, file, sub, key_where, text)
        else:
            _reject_comment_as_value(key_node, value_node, text, key_where, sub)
            try:
                items[key] = _Value(loader.construct_document(value_node), key_where)
            except ValueError as e:  # e.g. an impossible timestamp, an int beyond Python's 4300 digits
                raise _error(key_where, sub, f"invalid value: {str(e).split(';')[0]}") from None
    return _Section({**merged, **items}, where)


_REST_OF_LINE = re.compile("[^\n\r\x85\u2028\u2029]*")  # YAML's line breaks


def _reject_comment_as_value(key_node: yaml.Node, value_node: yaml.Node, text: str, where: str,
                             path: str) -> None:
    """``key: #### (.+)$`` is an empty value (null) and a comment to YAML: a value would vanish silently."""
    if not (isinstance(value_node, yaml.ScalarNode) and value_node.style is None and value_node.value == ""):
        return
    rest = _REST_OF_LINE.match(text, key_node.end_mark.index).group().lstrip(":").strip()
    if rest.startswith("#"):
        key = key_node.value
        raise _error(where, path, f"YAML reads {rest!r} as a comment and the value as empty (null); quote the "
                                  f"value, e.g. {key}: '{rest}', or write {key}: null")


def _apply_override(tree: _Section, item: str) -> None:
    """Apply one ``a.b.c=value`` override (value parsed as YAML) to the raw tree."""
    where = f"override {_cut(item)!r}"
    key, sep, text = item.partition("=")
    keys = [k.strip() for k in key.split(".")]
    if not sep or not all(keys):
        raise ConfigError(f"{where}: expected the form key=value, e.g. rl.optim.learning_rate=3e-4")
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_size(node, where, lines=False)
        value = None if node is None else loader.construct_document(node)
    except ConfigError as e:  # _check_size's, which names `where` first
        raise ConfigError(f"{where}: cannot parse value {_cut(text)!r}: {str(e)[len(where) + 2:]}") from None
    except (yaml.YAMLError, ValueError) as e:
        raise ConfigError(f"{where}: cannot parse value {_cut(text)!r}: {_yaml_reason(e)}; if it is text, quote "
                          f"the value, e.g. \"{key}='{_cut(text)}'\" in the shell") from None
    finally:
        loader.dispose()
    dropped = text[node.end_mark.index if node is not None else 0:].strip()
    if dropped:  # YAML reads `#` at the start or after a space as a comment: it would vanish silently
        raise ConfigError(f"{where}: YAML reads {dropped!r} as a comment and would drop it; quote the value, "
                          f"e.g. \"{key}='{text}'\" in the shell")
    if isinstance(value, str):
        value = _PlainStr(value)  # any override string may be read as a float
    _set(tree, keys, _entry(value, where))


def _entry(value, where: str) -> _Value | _Section:
    """Wrap a Python value as a raw tree entry (mappings and dataclasses become sections)."""
    if _is_dataclass_instance(value):
        value = to_dict(value)
    if isinstance(value, Mapping):
        return _Section({str(k): _entry(v, where) for k, v in value.items()}, where)
    return _Value(value, where)


def _set(tree: _Section, keys: list[str], entry: _Value | _Section) -> None:
    """Put ``entry`` at ``keys`` in the raw tree; a mapping onto a section merges into it."""
    node = tree
    for key in keys[:-1]:
        child = node.items.get(key)
        if not isinstance(child, _Section):
            child = node.items[key] = _Section({}, entry.where)
        node = child
    old = node.items.get(keys[-1])
    if isinstance(old, _Section) and isinstance(entry, _Section):
        for key, sub in entry.items.items():
            _set(old, [key], sub)
    else:
        node.items[keys[-1]] = entry


# --------------------------------------------------------------------------- building dataclasses


def _merge(base, section: _Section, path: str):
    """Return ``base`` (a dataclass instance) updated with ``section``, fully checked."""
    cls = type(base)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key, entry in section.items.items():
        if key not in fields:
            raise _unknown_field(key, fields, path, entry.where)
    base = _apply_preset(cls, base, section, path, hints)
    _import_listed_modules(fields, section, path, hints)
    changes = {}
    for name, f in fields.items():
        _describe(hints[name])  # rejects unsupported schema types up front
        entry, current, sub = section.items.get(name), getattr(base, name), _join(path, name)
        if entry is not None:
            value = _convert(hints[name], entry, sub, current)
        elif _is_dataclass_instance(current):
            value = _merge(current, _Section({}, ""), sub)  # re-check nested defaults too
        else:
            value = current
        if isinstance(value, Mapping) and not isinstance(value, FrozenMapping) and \
                _is_mapping_type(_unwrap_optional(hints[name])[0]):
            value = FrozenMapping(value)  # a schema default given as a dict (default_factory=dict)
        wheres = ({k: v.where for k, v in entry.items.items()} if isinstance(entry, _Section) else None)
        _check_bounds(f, value, sub, entry.where if entry else "", wheres)
        changes[name] = value
    try:
        obj = dataclasses.replace(base, **changes)
        validate = getattr(obj, "validate", None)
        if callable(validate):
            validate()
    except ConfigError:
        raise
    except ValueError as e:  # a cross-field check: name the section and any override that changed it
        overrides = dict.fromkeys(w for w in _leaf_sources(section)
                                  if w.startswith("override") and w != section.where)
        where = " with ".join([section.where, *overrides]) if section.where else ", ".join(overrides)
        field = _leaf_where(section, getattr(e, "field", None), path)  # the error names the field: its line
        raise _error(field or where, path, str(e)) from e
    return obj


def _import_listed_modules(fields, section: _Section, path: str, hints) -> None:
    """Import the modules of a field marked ``metadata={"import_modules": True}`` before any other field of
    the section is built, so that the names their import registers can be checked by ``validate``."""
    for name, f in fields.items():
        entry = section.items.get(name)
        if not f.metadata.get("import_modules") or entry is None:
            continue
        sub = _join(path, name)
        for i, module in enumerate(_convert(hints[name], entry, sub, getattr(f, "default", ()))):
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - any failure of the user's module is this field's error
                hint = (" (is it on the Python path? run from the directory that holds it, or set PYTHONPATH)"
                        if isinstance(e, ModuleNotFoundError) else "")
                raise _error(entry.where, f"{sub}[{i}]", f"cannot import module {module!r}: "
                                                         f"{type(e).__name__}: {e}{hint}") from None


def _leaf_where(section: _Section, field: str | None, path: str) -> str | None:
    """Where the value of the dotted `field` (relative to the root) was set in `section` (at `path`): its
    `file:line` or override; None when the field is unset here or unknown."""
    if not field:
        return None
    prefix = f"{path}." if path else ""
    if not field.startswith(prefix):
        return None
    node: _Section | _Value = section
    rest = re.sub(r"\[\d+\]$", "", field[len(prefix):])
    while rest:
        if not isinstance(node, _Section):
            return None
        if rest in node.items:  # a whole key, dots and all (a mapping field's free keys: `pkg.mod:fn`)
            return node.items[rest].where
        key, _, rest = rest.partition(".")
        if key not in node.items:
            return None
        node = node.items[key]
    return node.where


def _leaf_sources(section: _Section):
    """Where each leaf value of ``section`` (nested sections included) came from."""
    for entry in section.items.values():
        if isinstance(entry, _Section):
            yield from _leaf_sources(entry)
        else:
            yield entry.where


def _apply_preset(cls, base, section: _Section, path: str, hints):
    """A schema with a ``PRESETS`` mapping and a ``preset`` field: naming a preset starts the section from
    the defaults updated with the preset's values; the section's other fields then apply on top of it."""
    entry = section.items.get("preset")
    presets = getattr(cls, "PRESETS", None)
    if presets is None or not isinstance(entry, _Value) or entry.value is None:
        return base
    name = _coerce(hints["preset"], entry.value, _join(path, "preset"), entry.where)
    return _merge(cls(), _entry(dict(presets[name]), f"{entry.where} (preset {name!r})"), path)


def _convert(tp, entry: _Value | _Section, path: str, current):
    """Convert a raw entry for a field of type ``tp`` (``current`` is its present value)."""
    inner, _ = _unwrap_optional(tp)
    if isinstance(entry, _Section) and _is_mapping_type(inner):
        return _convert_mapping(inner, entry, path, current)
    if isinstance(entry, _Section):
        if not _is_dataclass_type(inner):
            hint = ""
            if inner is str:
                quoted = (f"\"{path}='...'\" in the shell" if entry.where.startswith("override")
                          else f"{path.rpartition('.')[2]}: '...' in the file")
                hint = f"; YAML reads braces or 'key: value' as a mapping: quote the value, e.g. {quoted}"
            raise _error(entry.where, path, f"expected {_describe(tp)}, got a mapping{hint}")
        return _merge(current if isinstance(current, inner) else inner(), entry, path)
    return _coerce(tp, entry.value, path, entry.where)


def _convert_mapping(tp, entry: _Section, path: str, current) -> FrozenMapping:
    """A ``dict[str, T]`` field from a raw section: ``current`` (the field's present mapping) updated key by key,
    each value checked as a ``T``."""
    value_type = typing.get_args(tp)[1]
    items = dict(current) if isinstance(current, Mapping) else {}
    for key, sub in entry.items.items():
        sub_path = f"{path}.{key}"
        if isinstance(sub, _Section):
            raise _error(sub.where, sub_path, f"expected {_describe(value_type)}, got a mapping (a key with dots "
                                              f"is written whole: {path}={{{key}.<rest>: <value>}})")
        items[key] = _coerce(value_type, sub.value, sub_path, sub.where)
    return FrozenMapping(items)


def _coerce(tp, value, path: str, where: str):
    """Check a leaf value against ``tp`` and return it converted (int -> float, list -> tuple)."""
    inner, optional = _unwrap_optional(tp)
    lenient = type(value) is _PlainStr
    if lenient:
        value = str(value)
    mismatch = _error(where, path, f"expected {_describe(tp)}, got {_show(value)}")
    if value is None:
        if optional:
            return None
        raise mismatch
    if typing.get_origin(inner) is tuple:
        if not isinstance(value, (list, tuple)):
            raise mismatch
        args = typing.get_args(inner)
        if args[-1] is Ellipsis:
            args = args[:1] * len(value)
        elif len(args) != len(value):
            raise mismatch
        return tuple(_coerce(t, v, f"{path}[{i}]", where) for i, (t, v) in enumerate(zip(args, value)))
    ok, out = _scalar(inner, value, lenient)
    if not ok:
        raise mismatch
    return out


def _scalar(tp, value, lenient: bool) -> tuple[bool, Any]:
    """(accepted, converted) for a scalar or Literal type; no silent coercion."""
    if typing.get_origin(tp) is Literal:
        return any(value == c and type(value) is type(c) for c in typing.get_args(tp)), value
    if tp is bool or tp is str:
        return isinstance(value, tp), value
    if isinstance(value, bool):
        return False, value  # bool is an int subclass, but never a number here
    if tp is int:
        return isinstance(value, int), value
    if tp is float:
        if isinstance(value, float):
            return True, value
        if isinstance(value, int):
            try:
                return True, float(value)
            except OverflowError:  # beyond float's range (1e309 written as digits): an infinity, refused as such
                return True, math.inf if value > 0 else -math.inf
        if isinstance(value, str) and lenient:  # YAML 1.1 reads plain 1e-3 as a string
            try:
                return True, float(value)
            except ValueError:
                pass
    return False, value  # dataclass types etc.: a scalar where a section is expected


def _check_bounds(f: dataclasses.Field, value, path: str, where: str, wheres: Mapping[str, str] | None = None
                  ) -> None:
    """Enforce ``metadata={"gt"|"ge"|"lt"|"le": bound}`` (element-wise for tuples). NaN is no value of any field,
    and a float is finite unless the bounds admit that infinity explicitly (``le=math.inf`` or
    ``ge=-math.inf``: e.g. a gradient-norm limit where inf means no clipping)."""
    if isinstance(value, Mapping) and not _is_dataclass_instance(value):  # a dict[str, T] field: key by key
        for key, v in value.items():
            _check_bounds(f, v, f"{path}.{key}", wheres.get(key, where) if wheres else where)
        return
    for v in value if isinstance(value, tuple) else (value,):
        if isinstance(v, float) and math.isnan(v):
            raise _error(where, path, "must be a number, got nan")
        if isinstance(v, float) and math.isinf(v) and f.metadata.get("le" if v > 0 else "ge") != v:
            raise _error(where, path, f"must be finite, got {v!r}")
        if isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63:
            raise _error(where, path, f"must fit in 64 bits, got {_cut(str(v), 40)}")
    for key, (op, symbol) in _BOUNDS.items():
        if key not in f.metadata:
            continue
        for v in value if isinstance(value, tuple) else (value,):
            if v is not None and not op(v, f.metadata[key]):
                raise _error(where, path, f"must be {symbol} {f.metadata[key]}, got {v!r}")


# --------------------------------------------------------------------------- helpers


def _describe(tp) -> str:
    """Human description of a field type; TypeError for types this module cannot handle."""
    inner, optional = _unwrap_optional(tp)
    if optional:
        return f"{_describe(inner)} or null"
    if inner in _SCALARS:
        return _SCALARS[inner]
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if origin is Literal and all(isinstance(a, (str, int)) for a in args):
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple and args and args != ((),):
        items = args[:1] if args[-1] is Ellipsis else args
        for item in items:
            _describe(item)
        return "a list" if args[-1] is Ellipsis else f"a list of {len(args)} items"
    if _is_dataclass_type(inner):
        return f"a mapping of {inner.__name__} fields"
    if _is_mapping_type(inner):
        key, value = typing.get_args(inner)
        if key is not str:
            raise TypeError(f"unsupported config field type: {tp!r} (a mapping's keys are str)")
        return f"a mapping of names to values ({_describe(value)} each)"
    raise TypeError(f"unsupported config field type: {tp!r}")


def _is_mapping_type(tp) -> bool:
    """``dict[K, V]`` or ``Mapping[K, V]``."""
    return typing.get_origin(tp) in (dict, Mapping) and len(typing.get_args(tp)) == 2


def _unwrap_optional(tp) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (tp, False)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        rest = [a for a in args if a is not type(None)]
        if len(args) != 2 or len(rest) != 1:
            raise TypeError(f"unsupported config field type: {tp!r} (only 'X | None' unions)")
        return rest[0], True
    return tp, False


def _unknown_field(key: str, fields: Mapping, path: str, where: str) -> ConfigError:
    """Error for a key that is not a field, with a 'did you mean' hint when one is close."""
    msg = f"unknown field {key!r} " + (f"in {path}" if path else "at top level")
    close = difflib.get_close_matches(key, list(fields), n=1)
    if close:
        msg += f" (did you mean {close[0]!r}?)"
    return _error(where, "", f"{msg}; valid fields: {', '.join(sorted(fields))}")


def _yaml_reason(e: Exception) -> str:
    """One-line reason of a YAML error (without PyYAML's multi-line snippets)."""
    if isinstance(e, yaml.MarkedYAMLError):
        return "; ".join(part for part in (e.context, e.problem) if part)
    return str(e)


def _error(where: str, path: str, msg: str) -> ConfigError:
    return ConfigError(": ".join(part for part in (where, path, msg) if part))


def _show(value) -> str:
    return f"{_cut(repr(value))} ({type(value).__name__})"


def _cut(text: str, limit: int = 200) -> str:
    """``text``, shortened to ``limit`` characters for a one-line message."""
    return text if len(text) <= limit else text[:limit] + "..."


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _dump(config, start, minimal: bool = False) -> dict:
    """The fields of ``config`` for :func:`dump_yaml`, given ``start``: the value loading starts this section
    from. A section with presets (and everything in it) lists only the fields that differ from ``start``,
    after its preset when ``start`` has another one (loading then restarts from the defaults updated with it);
    other sections list every field."""
    cls, out = type(config), {}
    if getattr(cls, "PRESETS", None) is not None and "preset" in {f.name for f in dataclasses.fields(cls)}:
        minimal = True
        preset = config.preset
        if preset != start.preset:
            out["preset"] = preset
            if preset is not None:  # loading restarts from it; an explicit null keeps what loading had
                start = from_dict(cls, {"preset": preset}, source=f"preset {preset!r}")
    for f in dataclasses.fields(config):
        if not f.init or f.name in out:
            continue
        value, begin = getattr(config, f.name), getattr(start, f.name)
        if minimal and value == begin:
            continue
        if _is_dataclass_instance(value):  # a section merges into the value loading has for it
            out[f.name] = _dump(value, begin if isinstance(begin, type(value)) else type(value)(), minimal)
        else:
            out[f.name] = _plain(value)
    return out


def _plain(value):
    if _is_dataclass_instance(value):
        return to_dict(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_dataclass_instance(value) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _require_dataclass_type(cls) -> None:
    if not _is_dataclass_type(cls):
        raise TypeError(f"expected a dataclass type, got {cls!r}")
