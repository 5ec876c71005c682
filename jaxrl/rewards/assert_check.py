"""Assert tests judged outside the tested program: the split, the value codec and the trusted checker.

An assert test (``"assert f(2) == 4"``, or several lines) is parsed with ``ast`` in the caller and
split in two:

* **program-side** expressions: a name the test does not bind itself (the program's ``f``, ``Solution``,
  a global, or a builtin outside ``CHECKER_BUILTINS`` such as ``print`` or ``hash``) and the calls,
  attributes and subscripts on it (``f(2)``, ``Solution().twoSum(nums, 9)``, ``RESULT[0]``). Only their
  source goes to the program's process, which evaluates them on request and returns the value;
* **checker-side** code: everything else (comparisons, literals, ``CHECKER_BUILTINS``, the parts of
  ``math``, ``random``, ``string`` and ``copy`` in ``_MODULES``, comprehension and loop variables,
  names the test assigns). The checker runs it in the caller over plain values and decides. The
  program never sees it: for ``assert f(2) == 4`` it sees ``f(2)`` only. Test inputs the test draws
  with ``random`` are drawn by the checker and sent, so the program cannot misreport them.

Arguments of a program-side call that use checker-side names (``f(x)`` in
``all(f(x) == x * x for x in range(5))``) are evaluated by the checker and sent as values. A statement
whose value is program-side (``s = Solution()``, ``s.push(3)``, ``import os``) runs in the program's
process, and the names it binds are program-side from then on.

Values come back as JSON written by ``encode`` (the program's harness runs a copy of it, see
``CODEC_SOURCE``) and are read by ``decode``, which trusts nothing: at most ``MAX_REPLY_BYTES``, exact
built-in types only (``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``list``,
``tuple``, ``dict``, ``set``, ``frozenset``; ``range`` and iterators such as ``map`` become a list
iterator), no subclass and no object of the program, so comparing them calls no method the program
wrote; more than 16 distinct parts with one hash (which would make a set of them quadratic) and
nesting deeper than 100 are refused. Requests (the values the checker sends) go the other way as ``marshal``, from the trusted
side, after the same exact-type check.

Checker-side code runs with a restricted builtins dict and under guards: ``*``, ``**``, ``<<``, ``%``,
``pow``, ``join`` and ``sum`` refuse results over ``MAX_ITEMS`` items or ``MAX_INT_BITS`` bits,
``range`` over ``MAX_ITEMS``, ``set``/``dict`` colliding keys, and loops stop after ``MAX_STEPS`` steps
or at the deadline. A test shape the split cannot take safely raises ``UnsupportedTest`` (the case
then fails closed with status ``"unsupported_test"``): ``while``, ``def`` (but see below), ``class``,
``with``, ``:=``, a bare ``except:`` or one naming a non-built-in exception, dunder attributes, a
checker-side attribute outside ``_METHODS``/``_MODULES``, ``is`` except against ``None``/``True``/
``False`` or a type, format specs in f-strings, a name bound both by the checker and by the program,
assignments to anything but names, or (when the case runs) a checker value that cannot be sent (a
lambda the test assigned, passed to a program function).
HumanEval-style ``def check(candidate): ...`` followed by ``check(name)`` is taken apart: its body runs
with ``candidate`` meaning the program's ``name``.

Differences from running the statement in the program's namespace, all failing closed: a program
function passed to a checker function (``map(f, xs)``, ``sorted(xs, key=f)``) is not a plain value
(``"bad_value"``; ``map(lambda x: f(x), xs)`` works); names the test assigns on the checker side are
not visible to the program's code; a ``StopIteration``, ``SystemExit`` or ``KeyboardInterrupt`` raised
by the program's code cannot be caught by the test; values the test reads back from a name that one
of its program-side statements bound (``x = helper()``, then ``f(x) == x + 1``) are the program's to
report, as they were before; ``startswith``, ``endswith``, ``issubset``, ``issuperset``,
``isdisjoint``, ``keys``, ``values`` and ``items`` (``_VERDICT_METHODS``) are the checker's, called on
the program's value, so an object of the program with such a method is a ``"bad_value"``; a program that defines a name of
``CHECKER_BUILTINS`` (``def sum(a, b)``) gets its own only in tests that call nothing else of it (see
``plan``).
"""

from __future__ import annotations

import ast
import builtins
import copy
import dataclasses
import functools
import json
import marshal
import math
import random
import re
import string
import time
import types
from collections.abc import Callable

__all__ = ["CHECKER_BUILTINS", "CODEC_SOURCE", "Plan", "UnsupportedTest", "plan", "run_checker"]

MAX_REPLY_BYTES = 1 << 20  # one reply from the program, encoded
MAX_ITEMS = 1_000_000  # length of a sequence the checker builds with * or range
MAX_INT_BITS = 1 << 17  # an int the checker builds with ** or <<
MAX_STEPS = 2_000_000  # loop and comprehension iterations of one test
_PREFIX = "_jaxrl_"  # helper and placeholder names; a test may not use names starting with it


class UnsupportedTest(Exception):
    """The test cannot be split safely; the case fails closed."""


# The three below derive from BaseException: a test's ``except Exception:`` must not swallow them.
class CheckerLimit(BaseException):
    """Checker-side work went over a guard (size, steps, deadline)."""


class NotPlain(BaseException):
    """The program's code returned something that is not a plain value."""


class ProgramGone(BaseException):
    """The program's process ended, timed out, or sent something that is not a reply."""

    def __init__(self, status: str, detail: str = ""):
        super().__init__(detail or status)
        self.status = status


class Unsendable(BaseException):
    """A checker-side value the test passes to the program's code is not plain (e.g. a lambda)."""


class _ProgramBaseException(BaseException):
    """Stands for a SystemExit, KeyboardInterrupt, ... raised by the program's code."""

    from_program = True


# The encoder, as source: the program's harness runs this text (it imports nothing, so the program's
# start is not slowed by ``json``'s imports), and so does this module, for its tests. The caller's
# ``decode`` below is what decides; what the program does to its own encoder only changes the values
# it sends, which it controls anyway.
CODEC_SOURCE = r'''
_ITER_TYPES = tuple(type(x) for x in (
    iter([]), iter(()), iter(""), iter(b""), iter(range(0)), iter({}), iter(set()), {}.keys(), {}.values(),
    {}.items(), map(abs, []), filter(None, []), zip(), enumerate([]), reversed([]), (x for x in ()),
))


def _stdlib_kind(t):
    # collections' Counter, OrderedDict and defaultdict are sent as dicts, deque as a list: honest
    # programs return them. What is sent is their contents, read with dict's and list's own methods.
    collections = __import__("sys").modules.get("collections")
    if collections is None:
        return None
    if t is collections.Counter or t is collections.OrderedDict or t is collections.defaultdict:
        return dict
    if t is collections.deque:
        return list
    return None
_ESCAPES = {}  # filled on first need: most programs never send an unusual string


_PLAIN = (str, type(None), bool, int, float, complex, bytes, list, tuple, set, frozenset, range, dict)


def _json_str(v):
    if v.isascii() and v.isprintable():
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if not _ESCAPES:
        _ESCAPES.update({i: "\\u%04x" % i for i in (*range(0x20), 0x7F, *range(0xD800, 0xE000))})
        _ESCAPES.update({ord('"'): '\\"', ord("\\"): "\\\\"})
    return '"' + v.translate(_ESCAPES) + '"'


def encode(value, max_items=100000, max_int_bits=1 << 17):
    # JSON text of a plain value; TypeError names the first thing that is not one (exact types only).
    left = [max_items]
    out = []
    put = out.append

    def enc(v, depth):
        if depth > 100:
            raise TypeError("nested deeper than 100")
        left[0] -= 1
        if left[0] < 0:
            raise TypeError(f"more than {max_items} items")
        t = type(v)
        if t is str:
            put(_json_str(v))
        elif v is None:
            put("null")
        elif t is bool:
            put("true" if v else "false")
        elif t is int:
            if v.bit_length() > max_int_bits:
                raise TypeError(f"an int over {max_int_bits} bits")
            put(int.__repr__(v) if v.bit_length() < 10000 else '{"I":"%s"}' % format(v, "x"))
        elif t is float:
            put(float.__repr__(v) if v - v == 0 else '{"x":"%s"}' % v.hex())  # nan, inf: hex
        elif t is complex:
            put('{"c":["%s","%s"]}' % (v.real.hex(), v.imag.hex()))
        elif t is bytes:
            put('{"b":"%s"}' % v.hex())
        elif t is list or t is tuple or t is set or t is frozenset or t is range or t in _ITER_TYPES:
            put("[" if t is list else '{"%s":[' % ("t" if t is tuple else "s" if t is set else
                                                   "F" if t is frozenset else "i"))
            first = True
            for x in v:  # each item counts against max_items: an endless iterator stops there
                if not first:
                    put(",")
                first = False
                enc(x, depth + 1)
            put("]" if t is list else "]}")
        elif t is dict or (t not in _PLAIN and _stdlib_kind(t) is dict):
            put('{"d":[')
            first = True
            for k, x in dict.items(v):
                put("[" if first else ",[")
                first = False
                enc(k, depth + 1)
                put(",")
                enc(x, depth + 1)
                put("]")
            put("]}")
        elif t not in _PLAIN and _stdlib_kind(t) is list:
            enc(list(v), depth)
        else:
            raise TypeError(f"a {t.__module__}.{t.__qualname__} is not a plain value")

    enc(value, 0)
    return "".join(out)
'''
_codec: dict = {}
exec(compile(CODEC_SOURCE, "<jaxrl codec>", "exec"), _codec)  # noqa: S102 - our own source
encode: Callable[..., str] = _codec["encode"]
_ITER_TYPES: tuple = _codec["_ITER_TYPES"]


def _hash_guard(keys: list) -> None:
    """Refuse keys that share hashes: inserting n equal-hash keys takes n**2 / 2 comparisons."""
    if len(keys) > 64:
        counts: dict[int, int] = {}
        for k in keys:
            h = hash(k)
            counts[h] = counts.get(h, 0) + 1
            if counts[h] > 16:
                raise ValueError("too many keys with one hash")


def _tagged(pairs: list) -> object:
    """A JSON object of ``encode``: one tag and its value."""
    if len(pairs) != 1:
        raise ValueError("a JSON object must be one tagged value")
    tag, v = pairs[0]
    if tag == "t" and type(v) is list:
        return tuple(v)
    if tag in ("s", "F") and type(v) is list:
        _hash_guard(v)
        return set(v) if tag == "s" else frozenset(v)
    if tag == "d" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
        _hash_guard([p[0] for p in v])
        return {k: x for k, x in v}
    if tag == "x" and type(v) is str:
        return float.fromhex(v)
    if tag == "c" and type(v) is list and len(v) == 2 and all(type(p) is str for p in v):
        return complex(float.fromhex(v[0]), float.fromhex(v[1]))
    if tag == "b" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "I" and type(v) is str and len(v) <= MAX_INT_BITS // 4 + 2:
        return int(v, 16)
    if tag == "i" and type(v) is list:
        return iter(v)
    raise ValueError(f"unknown tag {tag!r}")


def _collision_guard(value: object) -> None:
    """Refuse a value holding more than 16 distinct hashable parts with one hash: whatever the checker
    later builds from them (a set, dict keys) could take quadratic time."""
    buckets: dict[int, list] = {}
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        t = type(v)
        if depth > 101:  # encode() refuses deeper values; hashing a tuple costs its depth
            raise ValueError("nested deeper than 100")
        if t is list or t is set or t is frozenset or t is tuple:
            stack.extend((x, depth + 1) for x in v)
        elif t is dict:
            stack.extend((x, depth + 1) for x in v)
            stack.extend((x, depth + 1) for x in v.values())
        elif t in _ITER_TYPES:
            stack.extend((x, depth + 1) for x in v.__reduce__()[1][0])
        if t is list or t is set or t is dict or t in _ITER_TYPES:
            continue
        try:
            h = hash(v)
        except TypeError:
            continue
        bucket = buckets.setdefault(h, [])
        if not any(b == v for b in bucket):
            bucket.append(v)
            if len(bucket) > 16:
                raise ValueError("too many distinct values with one hash")


def decode(data: bytes | str, max_bytes: int = MAX_REPLY_BYTES) -> object:
    """The plain value in ``data`` (JSON from ``encode``, sent by the program); ValueError for anything
    else: over ``max_bytes``, not JSON, an unknown tag, a set of unhashables, colliding hashes, ..."""
    if len(data) > max_bytes:
        raise ValueError(f"over {max_bytes} bytes")
    try:
        value = json.loads(data, object_pairs_hook=_tagged)
        _collision_guard(value)
        return value
    except (RecursionError, TypeError, OverflowError, MemoryError) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None


def encode_request(index: int, values: tuple) -> bytes:
    """A request to the program's harness (``marshal``: built in, so nothing to import there; the
    caller is trusted). ``Unsendable`` if a value is not plain."""
    try:
        encode(values, max_items=MAX_ITEMS)  # the same exact-type check as for replies
        return marshal.dumps((index, values))
    except (TypeError, ValueError) as e:
        raise Unsendable(f"a value the test sends to the program: {e}") from None


# -- what the checker may use ---------------------------------------------------------

# The modules a test may use on the checker side, and what of each (nothing that grows its result
# beyond its inputs: no math.factorial, random.choices, random.getrandbits).
_MODULES = {
    "math": frozenset(
        "isclose fabs sqrt floor ceil trunc isnan isinf isfinite pi e tau inf nan log log2 log10 exp sin cos "
        "tan asin acos atan atan2 hypot gcd copysign radians degrees fsum dist".split()
    ),
    "random": frozenset("Random seed random randint randrange uniform choice shuffle sample".split()),
    "string": frozenset("ascii_letters ascii_lowercase ascii_uppercase digits hexdigits octdigits punctuation "
                        "whitespace printable".split()),
    "copy": frozenset("copy deepcopy".split()),
}
_MODULE_OBJECTS = {"math": math, "random": random, "string": string, "copy": copy}


def _module_view(name: str) -> types.SimpleNamespace:
    """The checker's view of a module: the names in ``_MODULES[name]`` only. ``random``'s functions are
    those of a fresh ``random.Random``, so that a test's ``random.seed`` leaves the caller's alone."""
    source = random.Random() if name == "random" else _MODULE_OBJECTS[name]
    view = {a: getattr(source, a) for a in _MODULES[name] if a != "Random"}
    if name == "random":
        view["Random"] = random.Random
    return types.SimpleNamespace(**view)


# Methods of plain values a checker-side expression may call; none grows its result beyond its inputs.
_METHODS = frozenset(
    "lower upper strip lstrip rstrip split rsplit splitlines startswith endswith isdigit isalpha isalnum "
    "isspace islower isupper isdecimal isnumeric count index find rfind keys values items get title "
    "capitalize casefold swapcase issubset issuperset union intersection difference symmetric_difference "
    "isdisjoint copy append extend sort reverse add update pop remove insert discard as_integer_ratio "
    "is_integer bit_length conjugate real imag args errno strerror join "
    # random.Random's, for rng = random.Random(42); rng.randint(1, 9)
    "seed random randint randrange uniform choice shuffle sample".split()
)
# Methods called by the checker on the program's value, which must be plain, never by the program's code:
# those whose argument is often the expected answer and whose result is the verdict
# (``f(x).startswith("ab")``: the program's code would see the answer and could say True), and dict views
# (``f(x).keys() == {"a"}``: a view is compared as a set, which an iterator sent back is not).
_VERDICT_METHODS = frozenset("startswith endswith issubset issuperset isdisjoint keys values items".split())
_EXCEPTIONS = {
    name: obj for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, Exception) and not name.startswith("_")
}


class _Guarded:
    """Checker-side helpers bound to one test's step counter and deadline."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.steps = 0
        self.made = 0  # items built by * and join

    def tick(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_STEPS:
            raise CheckerLimit(f"more than {MAX_STEPS} loop steps")
        if self.steps % 1024 < n and time.monotonic() > self.deadline:
            raise CheckerLimit("out of time")

    def iterate(self, iterable):
        for item in iterable:
            self.tick()
            yield item

    def range(self, *args):
        r = range(*args)
        if len(r) > MAX_ITEMS:
            raise CheckerLimit(f"range of {len(r)} items")
        return r

    def set(self, iterable=()):
        items = list(self.iterate(iterable))
        self.keys(items)
        return set(items)

    @staticmethod
    def keys(items: list) -> None:
        try:
            _hash_guard(items)
        except ValueError as e:
            raise CheckerLimit(str(e)) from None

    def frozenset(self, iterable=()):
        return frozenset(self.set(iterable))

    def dict(self, source=(), **kwargs):
        if type(source) is dict:  # already checked when it was built
            pairs = list(source.items())
        else:
            pairs = [tuple(p) for p in self.iterate(source)]
            if any(len(p) != 2 for p in pairs):
                raise ValueError("dict() wants pairs")
            self.keys([p[0] for p in pairs])
        out = dict(pairs)
        out.update(kwargs)
        return out

    def binop(self, op: str, a, b):
        if op == "Mult":
            for seq, n in ((a, b), (b, a)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                    self.allocate(len(seq) * max(n, 0))
            return a * b
        if op == "Pow":
            if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
                if a.bit_length() * b > MAX_INT_BITS:
                    raise CheckerLimit("an int over the size limit")
            return a**b
        if op == "LShift":
            if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b > MAX_INT_BITS:
                raise CheckerLimit("an int over the size limit")
            return a << b
        if op == "Mod":
            if isinstance(a, (str, bytes)):
                raise CheckerLimit("%-formatting is not supported in a test")
            return a % b
        raise AssertionError(op)

    def pow(self, a, b, m=None):
        if m is None:
            return self.binop("Pow", a, b)
        if isinstance(b, int) and isinstance(m, int) and b.bit_length() * m.bit_length() ** 1.6 > 1e9:
            raise CheckerLimit("a modular power over the size limit")
        return pow(a, b, m)

    def round(self, number, ndigits=None):
        if isinstance(ndigits, int) and abs(ndigits) > 10_000:  # round(int, -10**9) builds 10**(10**9)
            raise CheckerLimit("round() to more than 10000 digits")
        return round(number) if ndigits is None else round(number, ndigits)

    def sum(self, iterable, start=0):
        if not isinstance(start, (int, float, complex)):  # sum(lists, []) is quadratic
            raise CheckerLimit("sum() of sequences is not supported in a test")
        return sum(self.iterate(iterable), start)

    def join(self, sep, iterable):
        items = list(self.iterate(iterable))
        if isinstance(sep, (str, bytes)):
            self.allocate(len(sep) * len(items))
        return sep.join(items)

    def allocate(self, n: int) -> None:
        """Count ``n`` items about to be made by ``*`` or ``join``: at most ``MAX_ITEMS`` at once, and
        ``10 * MAX_ITEMS`` in the whole test (``[[0] * n for _ in range(m)]``)."""
        self.made += n
        if n > MAX_ITEMS or self.made > 10 * MAX_ITEMS:
            raise CheckerLimit("a sequence over the size limit")


def _builtins(g: _Guarded) -> dict:
    plain = (
        "abs all any bool chr complex divmod enumerate filter float int isinstance len list map max min "
        "ord repr reversed round sorted str sum tuple type zip".split()
    )
    table = {name: getattr(builtins, name) for name in plain}
    table.update(
        range=g.range, set=g.set, frozenset=g.frozenset, dict=g.dict, pow=g.pow, sum=g.sum, round=g.round,
        math=_module_view("math"), **_EXCEPTIONS,
    )
    return table


CHECKER_BUILTINS = frozenset(
    "abs all any bool chr complex divmod enumerate filter float int isinstance len list map max min ord repr "
    "reversed round sorted str sum tuple type zip range set frozenset dict pow math".split()
) | frozenset(_EXCEPTIONS)
_TYPE_NAMES = frozenset("bool int float complex str bytes list tuple dict set frozenset type".split())


# -- the split ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """One test, split. ``program_code[i]`` is the source the program's process evaluates for request
    ``i`` (``("eval" | "exec", source)``, with placeholders ``_jaxrl_a<k>`` for sent values);
    ``checker`` is the compiled checker-side module, calling ``_jaxrl_ask(i, values)``."""

    program_code: tuple[tuple[str, str], ...]
    checker: object  # a code object


_ALLOWED_EXPR = (
    ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Lambda, ast.IfExp, ast.Dict, ast.Set, ast.ListComp, ast.SetComp,
    ast.DictComp, ast.GeneratorExp, ast.Compare, ast.Call, ast.FormattedValue, ast.JoinedStr, ast.Constant,
    ast.Attribute, ast.Subscript, ast.Starred, ast.Name, ast.List, ast.Tuple, ast.Slice,
    ast.keyword, ast.comprehension, ast.arguments, ast.arg, ast.expr_context, ast.boolop, ast.operator,
    ast.unaryop, ast.cmpop,
)
_GUARDED_OPS = {ast.Mult: "Mult", ast.Pow: "Pow", ast.LShift: "LShift", ast.Mod: "Mod"}


def _bound_by(target: ast.AST) -> list[str]:
    """Names a comprehension/for/assignment target binds; UnsupportedTest for other targets."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _bound_by(elt.value if isinstance(elt, ast.Starred) else elt)]
    raise UnsupportedTest(f"line {getattr(target, 'lineno', '?')}: only names can be assigned in a test")


def _lambda_args(args: ast.arguments) -> list[str]:
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg) if a]


class _Splitter:
    def __init__(self, theirs: frozenset = frozenset()):
        self.program_code: list[tuple[str, str]] = []
        self.checker_names: set[str] = set(CHECKER_BUILTINS - theirs)  # names that mean a checker value
        self.program_names: set[str] = set()  # names a program-side statement of the test bound
        self.checks: dict[str, ast.FunctionDef] = {}  # HumanEval's check(candidate), by name
        self.modules: dict[str, str] = {"math": "math"}  # checker name -> module in _MODULES

    # expressions ------------------------------------------------------------------

    def is_program(self, node: ast.AST, scope: frozenset) -> bool:
        """Whether ``node`` is a program-side root: a program name and calls/attributes/subscripts on it,
        up to a call of a method in ``_VERDICT_METHODS``, which the checker makes on the value."""
        while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
            if isinstance(node, ast.Attribute) and node.attr in _VERDICT_METHODS:
                return False
            node = node.func if isinstance(node, ast.Call) else node.value
        return isinstance(node, ast.Name) and not (node.id in scope or node.id in self.checker_names)

    def expr(self, node: ast.expr, scope: frozenset) -> ast.expr:
        """The checker-side version of ``node``: program-side roots become ``_jaxrl_ask`` calls."""
        if self.is_program(node, scope):
            return self.ask(node, scope, "eval")
        if not isinstance(node, _ALLOWED_EXPR):
            raise UnsupportedTest(f"line {node.lineno}: {type(node).__name__} is not supported in a test")
        if isinstance(node, ast.Name):
            if node.id.startswith(_PREFIX):
                raise UnsupportedTest(f"line {node.lineno}: the name {node.id} is reserved")
            return node
        if isinstance(node, ast.Attribute):
            module = self.modules.get(node.value.id) if isinstance(node.value, ast.Name) else None
            if node.attr.startswith("_") or (
                node.attr not in (_MODULES[module] if module and node.value.id not in scope else _METHODS)
            ):
                raise UnsupportedTest(f"line {node.lineno}: the attribute .{node.attr} is not supported in a test")
            return ast.copy_location(ast.Attribute(self.expr(node.value, scope), node.attr, node.ctx), node)
        if isinstance(node, ast.Compare):
            for op, left, right in zip(node.ops, [node.left, *node.comparators], node.comparators):
                if isinstance(op, (ast.Is, ast.IsNot)) and not any(
                    (isinstance(x, ast.Constant) and (x.value is None or x.value is True or x.value is False))
                    or (isinstance(x, ast.Name) and x.id in _TYPE_NAMES and x.id not in scope)
                    for x in (left, right)
                ):
                    raise UnsupportedTest(f"line {node.lineno}: `is` compares only with None, True, False or a type")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
                and len(node.args) == 1 and not node.keywords and not isinstance(node.args[0], ast.Starred)
                and not self.is_program(node.func, scope)):
            return ast.copy_location(ast.Call(
                ast.Name(f"{_PREFIX}join", ast.Load()),
                [self.expr(node.func.value, scope), self.expr(node.args[0], scope)], [],
            ), node)
        if isinstance(node, ast.FormattedValue) and node.format_spec is not None:
            raise UnsupportedTest(f"line {node.lineno}: format specs are not supported in a test")
        if isinstance(node, ast.BinOp) and type(node.op) in _GUARDED_OPS:
            return ast.copy_location(ast.Call(
                ast.Name(f"{_PREFIX}binop", ast.Load()),
                [ast.Constant(_GUARDED_OPS[type(node.op)]), self.expr(node.left, scope), self.expr(node.right, scope)],
                [],
            ), node)
        if isinstance(node, ast.Lambda):
            inner = scope | frozenset(_lambda_args(node.args))
            args = self.generic(node.args, scope)
            return ast.copy_location(ast.Lambda(args, self.expr(node.body, inner)), node)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return self.comprehension(node, scope)
        return self.generic(node, scope)

    def generic(self, node: ast.AST, scope: frozenset) -> ast.AST:
        new = copy.copy(node)
        for field, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                setattr(new, field, self.expr(value, scope))
            elif isinstance(value, list):
                setattr(new, field, [self.expr(v, scope) if isinstance(v, ast.expr) else
                                     self.generic(v, scope) if isinstance(v, ast.AST) else v for v in value])
            elif isinstance(value, ast.AST):
                if not isinstance(value, _ALLOWED_EXPR):
                    raise UnsupportedTest(f"{type(value).__name__} is not supported in a test")
                setattr(new, field, self.generic(value, scope))
        return new

    def comprehension(self, node, scope: frozenset) -> ast.expr:
        gens = []
        for gen in node.generators:
            if gen.is_async:
                raise UnsupportedTest(f"line {node.lineno}: async comprehensions are not supported")
            iter_ = ast.Call(ast.Name(f"{_PREFIX}iter", ast.Load()), [self.expr(gen.iter, scope)], [])
            scope = scope | frozenset(_bound_by(gen.target))
            gens.append(ast.comprehension(gen.target, iter_, [self.expr(c, scope) for c in gen.ifs], 0))
        if isinstance(node, ast.DictComp):
            pairs = ast.GeneratorExp(ast.Tuple([self.expr(node.key, scope), self.expr(node.value, scope)],
                                               ast.Load()), gens)
            out = ast.Call(ast.Name("dict", ast.Load()), [pairs], [])
        elif isinstance(node, ast.SetComp):
            out = ast.Call(ast.Name("set", ast.Load()), [ast.GeneratorExp(self.expr(node.elt, scope), gens)], [])
        else:
            out = type(node)(self.expr(node.elt, scope), gens)
        return ast.copy_location(out, node)

    def ask(self, node: ast.AST, scope: frozenset, mode: str) -> ast.expr:
        """A ``_jaxrl_ask(i, (values...))`` call; ``program_code[i]`` is ``node`` with each checker-side
        part that uses a checker name replaced by a placeholder whose value is sent along."""
        sent: list[ast.expr] = []
        program_node = _Placeholders(self, scope, sent).visit(copy.deepcopy(node))
        ast.fix_missing_locations(program_node)
        self.program_code.append((mode, ast.unparse(program_node)))
        call = ast.Call(ast.Name(f"{_PREFIX}ask", ast.Load()),
                        [ast.Constant(len(self.program_code) - 1), ast.Tuple(sent, ast.Load())], [])
        return ast.copy_location(call, node)

    # statements ---------------------------------------------------------------------

    def block(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out = []
        for stmt in body:
            out.extend(self.stmt(stmt))
        return out or [ast.Pass()]

    def bind_checker(self, names: list[str], lineno: int) -> None:
        for name in names:
            if name.startswith(_PREFIX) or name in self.program_names:
                raise UnsupportedTest(f"line {lineno}: {name} is bound by both the test and the program")
            self.checker_names.add(name)

    def bind_program(self, names: list[str], lineno: int) -> None:
        for name in names:
            if name in self.checker_names or name.startswith(_PREFIX):
                raise UnsupportedTest(f"line {lineno}: {name} is bound by both the test and the program")
            self.program_names.add(name)

    def stmt(self, node: ast.stmt) -> list[ast.stmt]:
        empty = frozenset()
        line = node.lineno
        if isinstance(node, ast.Assert):  # the message is dropped: it does not decide anything
            return [ast.copy_location(ast.Assert(self.expr(node.test, empty), None), node)]
        if isinstance(node, ast.Pass | ast.Break | ast.Continue):
            return [node]
        if isinstance(node, ast.Expr):
            check = self.check_call(node.value)
            if check is not None:
                return check
            if self.is_program(node.value, empty):
                return [ast.copy_location(ast.Expr(self.ask(node, empty, "exec")), node)]
            return [ast.copy_location(ast.Expr(self.expr(node.value, empty)), node)]
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, ast.Assign | ast.AugAssign) and all(
            isinstance(t, ast.Attribute | ast.Subscript) and self.is_program(t, empty) for t in targets
        ):  # root.left = Node(2): a change to the program's objects, made by its code
            return [ast.copy_location(ast.Expr(self.ask(node, empty, "exec")), node)]
        if isinstance(node, ast.Assign):
            names = [n for t in node.targets for n in _bound_by(t)]
            if self.is_program(node.value, empty):
                self.bind_program(names, line)
                return [ast.copy_location(ast.Expr(self.ask(node, empty, "exec")), node)]
            value = self.expr(node.value, empty)
            self.bind_checker(names, line)
            return [ast.copy_location(ast.Assign(node.targets, value), node)]
        if isinstance(node, ast.AugAssign):
            names = _bound_by(node.target)
            if names[0] in self.program_names:
                return [ast.copy_location(ast.Expr(self.ask(node, empty, "exec")), node)]
            self.bind_checker(names, line)
            value = ast.BinOp(ast.Name(names[0], ast.Load()), node.op, node.value)
            return [ast.copy_location(ast.Assign([node.target], self.expr(value, empty)), node)]
        if isinstance(node, ast.Import | ast.ImportFrom):
            checker = self.checker_import(node)
            if checker is not None:
                return checker
            self.bind_program([(a.asname or a.name).split(".")[0] for a in node.names], line)
            return [ast.copy_location(ast.Expr(self.ask(node, empty, "exec")), node)]
        if isinstance(node, ast.If):
            return [ast.copy_location(ast.If(self.expr(node.test, empty), self.block(node.body),
                                             self.block(node.orelse) if node.orelse else []), node)]
        if isinstance(node, ast.For):
            iter_ = ast.Call(ast.Name(f"{_PREFIX}iter", ast.Load()), [self.expr(node.iter, empty)], [])
            self.bind_checker(_bound_by(node.target), line)
            return [ast.copy_location(ast.For(node.target, iter_, self.block(node.body),
                                              self.block(node.orelse) if node.orelse else []), node)]
        if isinstance(node, ast.Raise):
            if node.cause is not None or node.exc is None:
                raise UnsupportedTest(f"line {line}: only `raise Exception(...)` is supported in a test")
            return [ast.copy_location(ast.Raise(self.expr(node.exc, empty), None), node)]
        if isinstance(node, ast.Try):
            handlers = []
            for h in node.handlers:
                types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type] if h.type else [None]
                if not all(isinstance(t, ast.Name) and t.id in _EXCEPTIONS for t in types):
                    raise UnsupportedTest(f"line {h.lineno}: `except` takes built-in exception names only")
                if h.name:
                    self.bind_checker([h.name], h.lineno)
                handlers.append(ast.copy_location(ast.ExceptHandler(h.type, h.name, self.block(h.body)), h))
            return [ast.copy_location(ast.Try(self.block(node.body), handlers,
                                              self.block(node.orelse) if node.orelse else [],
                                              self.block(node.finalbody) if node.finalbody else []), node)]
        if isinstance(node, ast.FunctionDef) and self.check_def(node):
            return []
        raise UnsupportedTest(f"line {line}: {type(node).__name__} is not supported in a test")

    def checker_import(self, node: ast.Import | ast.ImportFrom) -> list[ast.stmt] | None:
        """``import math``, ``from random import randint``, ... of ``_MODULES`` as checker-side
        assignments (``math = _jaxrl_module("math")``); None if any name is not in ``_MODULES``."""
        out = []
        if isinstance(node, ast.Import):
            if not all(a.name in _MODULES for a in node.names):
                return None
            for a in node.names:
                name = a.asname or a.name
                self.bind_checker([name], node.lineno)
                self.modules[name] = a.name
                view = ast.Call(ast.Name(f"{_PREFIX}module", ast.Load()), [ast.Constant(a.name)], [])
                out.append(ast.Assign([ast.Name(name, ast.Store())], view))
        else:
            if node.level or node.module not in _MODULES or not all(a.name in _MODULES[node.module]
                                                                     for a in node.names):
                return None
            for a in node.names:
                self.bind_checker([a.asname or a.name], node.lineno)
                view = ast.Call(ast.Name(f"{_PREFIX}module", ast.Load()), [ast.Constant(node.module)], [])
                value = ast.Attribute(view, a.name, ast.Load())
                out.append(ast.Assign([ast.Name(a.asname or a.name, ast.Store())], value))
        return [ast.copy_location(stmt, node) for stmt in out]

    # HumanEval: def check(candidate): ...; check(entry_point) ---------------------------

    def check_def(self, node: ast.FunctionDef) -> bool:
        args = node.args
        if node.decorator_list or args.posonlyargs or args.kwonlyargs or args.vararg or args.kwarg \
                or args.defaults or len(args.args) != 1:
            return False
        self.checks[node.name] = node
        return True

    def check_call(self, node: ast.expr) -> list[ast.stmt] | None:
        checks = self.checks
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in checks
                and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Name)):
            return None
        fn = checks.pop(node.func.id)  # once: a second call would need the body twice
        param, target = fn.args.args[0].arg, node.args[0].id
        if target in self.checker_names:
            raise UnsupportedTest(f"line {node.lineno}: {fn.name}() must be given a name of the program")
        body = _Rename(param, target).visit(copy.deepcopy(ast.Module(fn.body, [])))
        return self.block(body.body)


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.copy_location(ast.Name(self.new, node.ctx), node) if node.id == self.old else node


class _Placeholders(ast.NodeTransformer):
    """Inside a program-side node: replace each largest part that uses a checker name (and no program
    name) by ``_jaxrl_a<k>``, appending its checker-side version to ``sent``."""

    def __init__(self, splitter: _Splitter, scope: frozenset, sent: list):
        self.s, self.scope, self.sent, self.local = splitter, scope, sent, frozenset()

    def names(self, node: ast.AST) -> set[str]:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    def checker_only(self, node: ast.AST) -> bool:
        names = self.names(node)
        if names & self.local:  # uses a name bound inside the program-side code (a lambda's argument)
            return False
        uses_checker = any(
            n in self.scope or (n in self.s.checker_names and n not in CHECKER_BUILTINS) or n in self.s.modules
            for n in names
        )
        return uses_checker and all(n in self.scope or n in self.s.checker_names for n in names)

    def visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.expr) and not isinstance(node, ast.Starred) and self.checker_only(node):
            self.sent.append(self.s.expr(node, self.scope))
            return ast.copy_location(ast.Name(f"{_PREFIX}a{len(self.sent) - 1}", ast.Load()), node)
        if isinstance(node, ast.Name) and node.id.startswith(_PREFIX):
            raise UnsupportedTest(f"line {node.lineno}: the name {node.id} is reserved")
        if isinstance(node, ast.Lambda | ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp):
            bound = _lambda_args(node.args) if isinstance(node, ast.Lambda) else [
                n for g in node.generators for n in _bound_by(g.target)]
            outer, self.local = self.local, self.local | frozenset(bound)
            try:
                return self.generic_visit(node)
            finally:
                self.local = outer
        if isinstance(node, ast.NamedExpr):
            raise UnsupportedTest(f"line {node.lineno}: := is not supported in a test")
        return self.generic_visit(node)


_TOP_LEVEL_NAME = re.compile(r"^(?:(?:async\s+)?def|class)\s+(\w+)|^(\w+)\s*(?::[^=\n]*)?=(?!=)", re.MULTILINE)


def shadowed_builtins(program: str) -> frozenset:
    """Names of ``CHECKER_BUILTINS`` the program defines at its top level (``def sum(a, b):``), found
    by a pattern (the caller does not parse untrusted source)."""
    found = {a or b for a, b in _TOP_LEVEL_NAME.findall(program)}
    return frozenset(found & CHECKER_BUILTINS)


@functools.lru_cache(maxsize=4096)  # a dataset's tests recur every epoch; a Plan is immutable
def plan(source: str, shadowed: frozenset = frozenset()) -> Plan:
    """Split the test ``source``; UnsupportedTest (one line, naming the test line) if it cannot be.

    ``shadowed``: ``shadowed_builtins`` of the program. A test that would never reach the program
    (``assert sum(10, 15) == 6`` where the task is to write ``sum``, MBPP 126) is split again with
    those names meaning the program's. Only then: in a test that also calls the program's ``f``,
    ``sorted(...)`` of the expected value must stay the checker's, or the program could answer it.
    """
    split = _plan(source, frozenset())
    if split.program_code or not shadowed:
        return split
    tree = ast.parse(source, "<test>")
    used = shadowed & {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return _plan(source, frozenset(used)) if used else split


def _plan(source: str, theirs: frozenset) -> Plan:
    try:
        tree = ast.parse(source, "<test>")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise UnsupportedTest(f"the test does not parse: {type(e).__name__}: {e}") from None
    try:
        splitter = _Splitter(theirs)
        body = splitter.block(tree.body)
        module = ast.fix_missing_locations(ast.Module(body, []))
        code = compile(module, "<test>", "exec", dont_inherit=True)
    except RecursionError:
        raise UnsupportedTest("the test is nested too deeply") from None
    except (SyntaxError, ValueError, TypeError) as e:
        raise UnsupportedTest(f"the split test does not compile: {e}") from None
    return Plan(tuple(splitter.program_code), code)


# -- the checker ----------------------------------------------------------------------

_RAISED: dict[str, type] = {}


def program_exception(name: str, args: tuple) -> Exception:
    """The exception the checker raises for one the program's code raised: a subclass of the built-in
    ``name`` (``Exception`` if ``name`` is none), marked as the program's."""
    if name in ("StopIteration", "StopAsyncIteration") or (
        isinstance(getattr(builtins, name, None), type) and issubclass(getattr(builtins, name), BaseException)
        and name not in _EXCEPTIONS  # SystemExit, KeyboardInterrupt, GeneratorExit, BaseException
    ):  # uncatchable by the test: a StopIteration inside map() would end it early, all(map(...)) is True
        return _ProgramBaseException(name)
    base = _EXCEPTIONS.get(name, Exception)
    cls = _RAISED.get(base.__name__)
    if cls is None:
        cls = _RAISED[base.__name__] = type(base.__name__, (base,), {"from_program": True})
    for attempt in (args, ()):
        try:
            return cls(*attempt)
        except Exception:  # noqa: BLE001 - e.g. UnicodeDecodeError wants 5 arguments
            pass
    return _ProgramBaseException(name)  # ExceptionGroup & co.: not to be caught as something else


def run_checker(p: Plan, ask: Callable[[int, tuple], object], deadline: float) -> str:
    """Run the checker side of ``p``; ``ask(i, values)`` evaluates ``p.program_code[i]`` in the program's
    process (raising what the program raised, as ``program_exception``, or ``ProgramGone``).

    Returns ``"ok"`` (every assert held), ``"wrong_answer"`` (an assert failed, or checker-side code
    failed on the program's values), ``"runtime_error"`` (the program's code raised and the test did
    not catch it), ``"bad_value"`` (``ask`` raised ``NotPlain``) or ``"checker_limit"``;
    ``ProgramGone`` propagates.
    """
    g = _Guarded(deadline)
    env = {
        "__builtins__": _builtins(g),
        f"{_PREFIX}ask": ask,
        f"{_PREFIX}iter": g.iterate,
        f"{_PREFIX}binop": g.binop,
        f"{_PREFIX}join": g.join,
        f"{_PREFIX}module": _module_view,
    }
    try:
        exec(p.checker, env)  # noqa: S102 - checked AST, restricted builtins, plain values
    except ProgramGone:
        raise
    except (CheckerLimit, RecursionError, MemoryError):
        return "checker_limit"
    except NotPlain:
        return "bad_value"
    except Unsendable:
        return "unsupported_test"
    except _ProgramBaseException:
        return "runtime_error"
    except AssertionError as e:
        return "runtime_error" if getattr(e, "from_program", False) else "wrong_answer"
    except Exception as e:  # noqa: BLE001 - the program's values broke checker-side code
        return "runtime_error" if getattr(e, "from_program", False) else "wrong_answer"
    return "ok"
