"""What a compiled program communicates and which Pallas kernels it runs, read from its optimized HLO text.

Input: `compiled.as_text()` of a `jax.jit(f).lower(...).compile()` (the partitioned, scheduled HLO module of
one program, per device). Pure functions over that text; no jax needed.

- `collectives(text)`: every all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute, each
  counted once: an async `*-start`/`*-done` pair is one op, and so is a collective that TPU's async collective
  fusion splits into start/continuation/done fusions (the pieces share one `channel_id`). Ops inside fusions,
  async wrappers, calls, conditionals and `while` bodies are found, and each carries how many times it runs per
  program call: the product of the trip counts of the loops around it.
- `summarize(collectives)`: count, bytes and ring-model traffic per kind, per program call.
- `pallas_kernels(text)`: Mosaic (`tpu_custom_call`) kernels by name, with the same execution counts;
  `splash_phase(name)` tells splash attention's forward kernels from its backward ones.

Trip counts: XLA's GPU and CPU backends record a loop's count in the `while` op's
`backend_config={"known_trip_count":{"n":"6"}}`; the TPU backend's final HLO does not, so it is read from the
loop itself: a condition `compare(i, N)` (LT/LE/GT/GE/NE) on a tuple element `i` that starts at a constant and
that the body steps by a constant (`lax.scan`, `fori_loop` and `while_loop` with a static bound all lower to
this). A loop whose bound is data (the sampler's decode loop stops when every row is done) has no known count:
its ops count `default_trip_count` times per entry (1 unless given) and are flagged `trip_count_known=False`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# Bits per element of every HLO primitive type (xla/xla_data.proto PrimitiveType; sub-byte types are packed).
# Tokens and opaque values occupy no array memory.
DTYPE_BITS: dict[str, int] = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4,
    "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f4e2m1fn": 4, "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e4m3fnuz": 8,
    "f8e5m2": 8, "f8e5m2fnuz": 8, "f8e8m0fnu": 8,
    "bf16": 16, "f16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "token": 0, "opaque": 0,
}


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of an HLO element type (`bf16` -> 2, `s4` -> 0.5, `token` -> 0)."""
    try:
        return DTYPE_BITS[dtype] / 8
    except KeyError:
        raise ValueError(f"unknown HLO element type {dtype!r}; known: {', '.join(DTYPE_BITS)}") from None


_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_LAYOUT = re.compile(r"\{[^{}]*\}")
_COMMENT = re.compile(r"/\*.*?\*/")


def _clean_shape(shape: str) -> str:
    """`(bf16[16,256]{1,0:T(8,128)(2,1)}, /*index=1*/u32[]{:S(2)})` -> `(bf16[16,256], u32[])`."""
    shape = _COMMENT.sub("", shape)
    while True:  # layouts may nest braces only one level deep, but strip until none are left
        stripped = _LAYOUT.sub("", shape)
        if stripped == shape:
            return re.sub(r"\s+", " ", stripped).replace("( ", "(").strip()
        shape = stripped


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (`bf16[3584,2368]`, a tuple `(f32[8], bf16[2,4])`, `f32[<=16]` at its bound),
    sub-byte types packed and rounded up per array."""
    total = 0
    for dtype, dims in _ARRAY.findall(_clean_shape(shape)):
        sizes = [int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip()]
        total += math.ceil(math.prod(sizes) * dtype_bytes(dtype))
    return total


def ring_traffic(kind: str, nbytes: int, group_size: int) -> int:
    """Bytes one device sends per execution under the ring model, from the per-device result size `nbytes`
    and `group_size` devices: all-gather out*(n-1)/n, reduce-scatter in*(n-1)/n (in = out*n), all-reduce
    2*size*(n-1)/n, all-to-all size*(n-1)/n, collective-permute size."""
    n = max(group_size, 1)
    if kind == "all-gather":
        return nbytes * (n - 1) // n
    if kind == "reduce-scatter":
        return nbytes * (n - 1)
    if kind == "all-reduce":
        return 2 * nbytes * (n - 1) // n
    if kind == "all-to-all":
        return nbytes * (n - 1) // n
    if kind == "collective-permute":
        return nbytes
    raise ValueError(f"unknown collective kind {kind!r}; known: {', '.join(KINDS)}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of a compiled program, per device.

    `shape`: its result per device (`bf16[3584,2368]`; a tuple for combined collectives); `bytes`: that result's
    bytes; `group_size`: devices per replica group (devices named in the pairs, for collective-permute);
    `executions`: times it runs per program call (product of the trip counts of the loops around it);
    `trip_count_known`: False where a loop around it has a data-dependent bound; `traffic_bytes`: bytes sent
    per device per execution, ring model (`ring_traffic`); `computation`: the HLO computation holding it (the
    loop body or entry, not the fusion it may sit in); `name`/`op_name`: its HLO name and the jax op it came from.
    """

    kind: str
    shape: str
    bytes: int
    group_size: int
    executions: int
    computation: str
    traffic_bytes: int
    trip_count_known: bool = True
    name: str = ""
    op_name: str = ""


# ---------------------------------------------------------------------------------------------------------------
# Parsing: computations of instructions
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]  # operand instruction names, in order
    raw_operands: str  # text inside the opcode's parentheses (a constant's literal, a parameter's number)
    attrs: str  # everything after the operands
    root: bool


_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s+(ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at `text[start]`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced parentheses in HLO instruction: {text[:120]!r}")


def _parse_instr(text: str) -> _Instr | None:
    m = _INSTR.match(text)
    if not m:
        return None
    pos = m.end()
    if text[pos] == "(":
        end = _balanced(text, pos)
    else:
        end = text.index(" ", pos)
    shape = text[pos:end]
    op = re.compile(r"\s*([\w\-]+)\(").match(text, end)
    if not op:
        return None
    close = _balanced(text, op.end() - 1)
    raw = text[op.end():close - 1]
    return _Instr(name=m.group(2), shape=shape, opcode=op.group(1),
                  operands=re.findall(r"%([\w.\-]+)", raw), raw_operands=raw.strip(), attrs=text[close:],
                  root=bool(m.group(1)))


def _computations(text: str) -> tuple[dict[str, dict[str, _Instr]], dict[str, str], str]:
    """{computation: {instruction name: instruction}}, {computation: root name}, entry name."""
    comps: dict[str, dict[str, _Instr]] = {}
    roots: dict[str, str] = {}
    entry = ""
    current: str | None = None
    pending: list[str] = []

    def flush():
        if current is not None and pending:
            instr = _parse_instr("\n".join(pending))
            if instr is not None:
                comps[current][instr.name] = instr
                if instr.root:
                    roots[current] = instr.name
        pending.clear()

    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = {}
                if m.group(1):
                    entry = current
            continue
        if line == "}":
            flush()
            current = None
        elif _INSTR.match(line):
            flush()
            pending.append(line)
        elif pending:  # continuation of a multi-line instruction (frontend attributes may hold newlines)
            pending.append(line)
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text: pass compiled.as_text() of a compiled program")
    return comps, roots, entry


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(rf"(?:^|[\s,]){re.escape(key)}=([^\s,]+)", attrs)
    return m.group(1) if m else None


def _called(attrs: str, key: str) -> list[str]:
    m = re.search(rf"(?:^|[\s,]){re.escape(key)}=(\{{[^}}]*\}}|%?[\w.\-]+)", attrs)
    return re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []


def _op_name(attrs: str) -> str:
    m = re.search(r'op_name="([^"]*)"', attrs)
    return m.group(1) if m else ""


# ---------------------------------------------------------------------------------------------------------------
# Loop trip counts
# ---------------------------------------------------------------------------------------------------------------

_PASS_THROUGH = {"copy", "bitcast", "convert", "reshape"}


def _affine(comps, comp: str, name: str, leaf, depth: int = 0) -> tuple[int, int] | None:
    """`name` in `comp` as `a * X + b` (a in {0, 1}) for the loop variable X, or None. `leaf(instr)` resolves
    `get-tuple-element`s and `parameter`s."""
    instr = comps[comp].get(name)
    if instr is None or depth > 32:
        return None
    if instr.opcode == "constant":
        try:
            return 0, int(instr.raw_operands)
        except ValueError:
            return None
    if instr.opcode in ("get-tuple-element", "parameter"):
        return leaf(comp, instr)
    if instr.opcode in _PASS_THROUGH and len(instr.operands) == 1:
        return _affine(comps, comp, instr.operands[0], leaf, depth + 1)
    if instr.opcode in ("add", "subtract") and len(instr.operands) == 2:
        x = _affine(comps, comp, instr.operands[0], leaf, depth + 1)
        y = _affine(comps, comp, instr.operands[1], leaf, depth + 1)
        if x is None or y is None:
            return None
        sign = 1 if instr.opcode == "add" else -1
        a, b = x[0] + sign * y[0], x[1] + sign * y[1]
        return (a, b) if a in (0, 1) else None
    return None


def _trip_count(comps, roots, parent: str, loop: _Instr) -> int | None:
    """Iterations of the `while` op `loop` (in computation `parent`), or None where it is not static."""
    m = re.search(r'"known_trip_count":\{"n":"?(\d+)"?\}', loop.attrs)
    if m:
        return int(m.group(1))
    cond, body = (_called(loop.attrs, "condition") or [None])[0], (_called(loop.attrs, "body") or [None])[0]
    if cond not in comps or body not in comps or len(loop.operands) != 1:
        return None
    init = comps[parent].get(loop.operands[0])
    if init is None or init.opcode != "tuple":
        return None
    body_root = comps[body].get(roots.get(body, ""))
    if body_root is None or body_root.opcode != "tuple":
        return None

    def initial(index: int) -> int | None:
        if index >= len(init.operands):
            return None
        value = _affine(comps, parent, init.operands[index], lambda c, i: None)
        return value[1] if value is not None else None

    def invariant(index: int) -> bool:  # the body passes tuple element `index` through unchanged
        if index >= len(body_root.operands):
            return False
        passed = comps[body].get(body_root.operands[index])
        return (passed is not None and passed.opcode == "get-tuple-element"
                and _attr(passed.attrs, "index") == str(index))

    def leaf_for(var: int):
        def leaf(comp, instr):
            if instr.opcode == "get-tuple-element":
                index = int(_attr(instr.attrs, "index") or -1)
                source = comps[comp].get(instr.operands[0]) if instr.operands else None
                if source is None or source.opcode != "parameter":
                    return None
                if index == var:
                    return 1, 0
                value = initial(index)
                return (0, value) if value is not None and invariant(index) else None
            return None
        return leaf

    # The compare at the condition's root, through one fusion where XLA fused it.
    cond_comp, compare = cond, comps[cond].get(roots.get(cond, ""))
    outer: dict[str, _Instr] = {}
    if compare is not None and compare.opcode == "fusion":
        inner = (_called(compare.attrs, "calls") or [""])[0]
        fused_root = comps.get(inner, {}).get(roots.get(inner, ""))
        if fused_root is not None:
            outer = {instr.raw_operands: comps[cond].get(compare.operands[int(instr.raw_operands)])
                     for instr in comps[inner].values() if instr.opcode == "parameter"
                     and int(instr.raw_operands) < len(compare.operands)}
            cond_comp, compare = inner, fused_root
    if compare is None or compare.opcode != "compare" or len(compare.operands) != 2:
        return None
    direction = _attr(compare.attrs, "direction")

    candidates = sorted({int(_attr(i.attrs, "index")) for i in comps[cond].values()
                         if i.opcode == "get-tuple-element" and _attr(i.attrs, "index") is not None})
    for var in candidates:
        base = leaf_for(var)

        def leaf(comp, instr, base=base):
            if comp == cond_comp and instr.opcode == "parameter" and outer:
                source = outer.get(instr.raw_operands)
                return None if source is None else _affine(comps, cond, source.name, base)
            return base(comp, instr)

        lhs = _affine(comps, cond_comp, compare.operands[0], leaf)
        rhs = _affine(comps, cond_comp, compare.operands[1], leaf)
        if lhs is None or rhs is None or {lhs[0], rhs[0]} != {0, 1}:
            continue
        step = _affine(comps, body, body_root.operands[var], leaf_for(var)) if var < len(body_root.operands) \
            else None
        start = initial(var)
        if step is None or step[0] != 1 or step[1] == 0 or start is None:
            continue
        flip = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE", "EQ": "EQ"}
        # Loop while `X <dir> bound`, X = start + step * t; shift so the variable is on the left.
        if lhs[0] == 1:
            bound, op = rhs[1] - lhs[1], direction
        else:
            bound, op = lhs[1] - rhs[1], flip.get(direction or "", "")
        return _count(start, step[1], bound, op)
    return None


def _count(start: int, step: int, bound: int, op: str) -> int | None:
    """How many t = 0, 1, ... satisfy `start + step * t <op> bound` before the first that does not."""
    if op == "LT" and step > 0:
        return max(0, -(-(bound - start) // step))
    if op == "LE" and step > 0:
        return max(0, (bound - start) // step + 1)
    if op == "GT" and step < 0:
        return max(0, -(-(start - bound) // -step))
    if op == "GE" and step < 0:
        return max(0, (start - bound) // -step + 1)
    if op == "NE" and (bound - start) % step == 0 and (bound - start) // step >= 0:
        return (bound - start) // step
    return None


# ---------------------------------------------------------------------------------------------------------------
# Call graph: how often each computation runs per program call
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Module:
    comps: dict[str, dict[str, _Instr]]
    executions: dict[str, int]  # computation -> runs per program call
    known: dict[str, bool]  # computation -> every loop around it has a static trip count
    owner: dict[str, str]  # computation -> the non-fused computation it belongs to (itself unless fused)
    devices: int  # num_partitions * replica_count


def _module(text: str, default_trip_count: int) -> _Module:
    comps, roots, entry = _computations(text)
    # edges: caller -> [(callee, factor, factor known, fused into caller)]
    edges: dict[str, list[tuple[str, int, bool, bool]]] = {c: [] for c in comps}
    for comp, instrs in comps.items():
        for instr in instrs.values():
            op = instr.opcode
            if op == "while":
                trips = _trip_count(comps, roots, comp, instr)
                n, known = (trips, True) if trips is not None else (default_trip_count, False)
                edges[comp] += [(c, n, known, False) for c in _called(instr.attrs, "body")]
                edges[comp] += [(c, n + 1, known, False) for c in _called(instr.attrs, "condition")]
            elif op == "conditional":  # each branch counted as if taken: an upper bound
                for key in ("branch_computations", "true_computation", "false_computation"):
                    edges[comp] += [(c, 1, True, False) for c in _called(instr.attrs, key)]
            elif op == "call":
                edges[comp] += [(c, 1, True, False) for c in _called(instr.attrs, "to_apply")]
            elif op in ("fusion", "async-start"):  # async-update/-done name the same computation: skip them
                edges[comp] += [(c, 1, True, True) for c in _called(instr.attrs, "calls")]
            elif op == "custom-call":
                edges[comp] += [(c, 1, True, True) for c in _called(instr.attrs, "called_computations")]

    executions = {c: 0 for c in comps}
    known = {c: True for c in comps}
    owner = {entry: entry}
    # Callers before callees: the call graph is a DAG; visit in reverse post-order from the entry.
    order: list[str] = []
    seen: set[str] = set()

    def visit(c: str):
        seen.add(c)
        for callee, *_ in edges.get(c, []):
            if callee in comps and callee not in seen:
                visit(callee)
        order.append(c)

    visit(entry)
    executions[entry] = 1
    for comp in reversed(order):
        for callee, factor, factor_known, fused in edges[comp]:
            if callee not in comps:
                continue
            executions[callee] += executions[comp] * factor
            known[callee] = known[callee] and known[comp] and factor_known
            owner.setdefault(callee, owner.get(comp, comp) if fused else callee)

    header = text[:text.find("\n")] if "\n" in text else text
    partitions = int(_attr(header, "num_partitions") or 1)
    replicas = int(_attr(header, "replica_count") or 1)
    return _Module(comps, {c: executions[c] for c in order}, known, owner, partitions * replicas)


# ---------------------------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------------------------

_OPCODES = {
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute", "collective-permute-start": "collective-permute",
}


def _group_size(attrs: str, devices: int) -> int:
    """Devices per replica group, from any of XLA's printed forms: `{{0,1},{2,3}}`, `{}` (all devices), iota
    `[2,4]<=[8]` / `[2,4]<=[4,2]T(1,0)`, or mesh axes `mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))}
        size = 1
        for axis, sub in re.findall(r"'([^']+)'(?::\(\d+\)(\d+))?", m.group(2)):
            if sub:  # a sub-axis 'x':(pre)size
                size *= int(sub)
            elif axis in sizes:
                size *= sizes[axis]
            else:
                raise ValueError(f"replica_groups names mesh axis {axis!r} not in mesh[{m.group(1)}]")
        return size
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{(\{[^}]*\})?", attrs)
    if m:
        first = m.group(1)
        return len(re.findall(r"\d+", first)) if first else devices
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if m:
        return len(set(re.findall(r"\d+", m.group(1))))
    raise ValueError(f"collective without replica_groups or source_target_pairs: {attrs[:160]!r}")


def collectives(hlo_text: str, default_trip_count: int = 1) -> list[Collective]:
    """Every collective of the program in `hlo_text` (`compiled.as_text()`), each op once, with how many times it
    runs per program call. Loops with no static trip count run `default_trip_count` times (flagged)."""
    mod = _module(hlo_text, default_trip_count)
    found: list[Collective] = []
    seen: set[tuple[str, str, str]] = set()
    for comp in mod.executions:
        instrs = mod.comps[comp]
        done_shape = {i.operands[0]: i.shape for i in instrs.values() if i.opcode.endswith("-done") and i.operands}
        for instr in instrs.values():
            kind = _OPCODES.get(instr.opcode)
            if kind is None:
                continue
            channel = _attr(instr.attrs, "channel_id")
            owner = mod.owner.get(comp, comp)
            if channel is not None:  # the pieces of one async collective fusion share their channel
                key = (owner, kind, channel)
                if key in seen:
                    continue
                seen.add(key)
            shape = done_shape.get(instr.name) if instr.opcode.endswith("-start") else instr.shape
            if shape is None:  # a -start without its -done here: the output sits in the start's tuple
                shape = _start_output(instr)
            shape = _clean_shape(shape)
            nbytes = shape_bytes(shape)
            group = _group_size(instr.attrs, mod.devices)
            found.append(Collective(kind=kind, shape=shape, bytes=nbytes, group_size=group,
                                    executions=mod.executions[comp], computation=owner,
                                    traffic_bytes=ring_traffic(kind, nbytes, group),
                                    trip_count_known=mod.known[comp], name=instr.name,
                                    op_name=_op_name(instr.attrs)))
    return found


def _split_tuple(shape: str) -> list[str]:
    """Top-level elements of a tuple shape `(a, (b, c), d)`."""
    inner, parts, depth, start = _clean_shape(shape)[1:-1], [], 0, 0
    for i, ch in enumerate(inner):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    parts.append(inner[start:].strip())
    return parts


def _start_output(instr: _Instr) -> str:
    """The result of an async start op from its own shape: `(operands, outputs, context...)` for all-gather and
    collective-permute, the output itself for all-reduce."""
    if instr.opcode == "all-reduce-start" or not _clean_shape(instr.shape).startswith("("):
        return instr.shape
    return _split_tuple(instr.shape)[1]


def summarize(found: Iterable[Collective]) -> dict[str, dict[str, int]]:
    """Per kind, per program call: `count` (executions), `bytes` (result bytes) and `traffic_bytes` (ring model),
    per device. Every kind is present (zeros where absent)."""
    out = {kind: {"count": 0, "bytes": 0, "traffic_bytes": 0} for kind in KINDS}
    for c in found:
        row = out[c.kind]
        row["count"] += c.executions
        row["bytes"] += c.bytes * c.executions
        row["traffic_bytes"] += c.traffic_bytes * c.executions
    return out


# ---------------------------------------------------------------------------------------------------------------
# Pallas (Mosaic) kernels
# ---------------------------------------------------------------------------------------------------------------

_SPLASH = re.compile(r"^splash_(mha|mqa)_(fwd|dq|dkv)(_segmented)?(_residuals|_no_residuals)$")


def _kernel_name(instr: _Instr) -> str:
    """A Mosaic kernel's name. JAX passes the `pallas_call`'s name as the custom call's `kernel_name`, which XLA
    makes the instruction's name (`splash_mha_fwd_no_residuals.1`); strip XLA's `.N`/`.clone` suffixes. Where a
    pass renamed it, the jax op path in the metadata ends in `<name>/pallas_call`."""
    name = re.sub(r"(\.clone|\.\d+)+$", "", instr.name)
    if name and not name.startswith("custom-call") and not name.startswith("custom_call"):
        return name
    m = re.search(r"([^/]+)/pallas_call$", _op_name(instr.attrs))
    return m.group(1) if m else "tpu_custom_call"


def pallas_kernels(hlo_text: str, default_trip_count: int = 1) -> dict[str, int]:
    """Mosaic kernels (`custom_call_target="tpu_custom_call"`) of the program in `hlo_text`: {kernel name: runs
    per program call}, loops counted as in `collectives`."""
    mod = _module(hlo_text, default_trip_count)
    out: dict[str, int] = {}
    for comp, runs in mod.executions.items():
        for instr in mod.comps[comp].values():
            if instr.opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in instr.attrs:
                name = _kernel_name(instr)
                out[name] = out.get(name, 0) + runs
    return out


def splash_phase(kernel: str) -> str | None:
    """`forward` for splash attention's forward kernels (`splash_mha_fwd_no_residuals`, `splash_mqa_fwd_...`),
    `backward` for its gradient kernels (`..._dq_...`, `..._dkv_...`), None for any other kernel."""
    m = _SPLASH.match(kernel)
    if not m:
        return None
    return "forward" if m.group(2) == "fwd" else "backward"
