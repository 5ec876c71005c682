"""Math-Verify (``math-verify``, Hugging Face) as the LaTeX reader for answers our whitelisted reader refuses.

jaxrl reads a small LaTeX subset itself (``jaxrl.rewards.math._latex_to_sympy``): every node it can produce
is bounded before anything is evaluated. Math-Verify's reader (latex2sympy2-extended, ANTLR) reads far more:
matrices (``pmatrix``, ``bmatrix``...), unions of intervals, ``\\binom``, and so on. This module hands it
what ours refuses, and keeps three things in jaxrl's hands:

* **Time.** Math-Verify's own timeouts use ``signal.alarm``: in a thread they raise ``ValueError`` (which
  ``verify`` turns into a silent False), and in the main thread they re-arm and then cancel the one real-time
  timer that ``jaxrl.rewards.timeout`` uses for a direct ``math_verify(..., timeout=)`` call, so the caller's
  hard deadline would be lost. We call it with ``parsing_timeout=None``; the hard limits are the reward pool
  (a worker past its deadline is killed) and ``call_with_timeout``. Inputs are bounded before parsing
  (``_refuse``), and what it parsed is bounded before anything is evaluated (``_guarded``).
* **Equality.** Its ``verify`` compares numbers after rounding to 6 places or ``evalf(chop=True)``, which
  makes tiny unequal values equal (Math-Verify issue #14: ``\\frac{1}{2^{99}}`` vs ``\\frac{1}{2^{98}}``), and
  compares relations by one side (issue #14 ``n=2,3,4`` vs ``n=1,2,3``; issue #60 two different equations that
  both parse to ``0``). Here only the parsed objects are used: matrices, intervals, unions, sets and tuples
  are compared element by element with jaxrl's ``compare_exprs``; relations and booleans are refused (the
  main path handles ``x = 3``).
* **Partial reads.** An input it reads only in part (issue #41: ``4\\sqrt(2)`` read as ``4``) gives no
  sympy object, or one whose extracted text is not the whole input: both are refused.
"""

from __future__ import annotations

import re

__all__ = ["library_equivalent", "library_parse"]

# Bounds on what is handed to the library (on top of jaxrl.rewards.math.MAX_PARSE_CHARS).
MAX_LIBRARY_POWERS = 6  # "^" per answer: towers such as 5^{5^{5^{5^5}}} hang its parser (issue #65)
MAX_BRACE_DEPTH = 12
MAX_COMBINATORIAL_ARGUMENT = 999  # n! and binomials of integers up to this (999! has 2,565 digits)
# Big-operator and special-function commands whose parse or evaluation is unbounded or open-ended.
_REFUSED_RE = re.compile(
    r"\\(?:sum|prod|int|iint|iiint|oint|lim|limsup|liminf|partial|nabla|Gamma|zeta|operatorname|mathrm\s*\{\s*d\s*\}"
    r"|ldots|cdots|dots|vdots|ddots)(?![A-Za-z])|[:;=<>_]|\\(?:le|ge|leq|geq|ne|neq|lt|gt|approx|equiv|to|rightarrow"
    r"|implies|iff|land|lor|wedge|vee|neg|forall|exists)(?![A-Za-z])"
)
# Factorials and binomials are evaluated while parsing: only with no power and small integers.
_COMBINATORIAL_RE = re.compile(r"!|\\[dt]?binom(?![A-Za-z])|\\choose(?![A-Za-z])")
_LONG_DIGITS_RE = re.compile(r"[0-9]{4,}")
# The library evaluates integer powers while it parses (9^{9^{9}} would never return): an exponent must be one
# small token. Towers and long exponents are left to our own reader, which bounds them before evaluating.
_SMALL_EXPONENT_RE = re.compile(
    r"[-+]?(?:[0-9]{1,3}|[A-Za-z]|\\pi|\\circ|\\prime|\\frac\{[0-9]{1,2}\}\{[0-9]{1,2}\}|[0-9]{1,2}/[0-9]{1,2}|T)")
# A matrix raised to a power is multiplied out while parsing (symbolic entries grow without bound).
_MATRIX_POWER_RE = re.compile(r"\\end\s*\{[A-Za-z*]*\}\s*\^")
# \sqrt[n]{x}: an integer index 2..99 only (\sqrt[1/999]{9} is 9^{999}).
_ROOT_INDEX_RE = re.compile(r"\\sqrt\s*\[(?!\s*(?:[2-9]|[1-9][0-9])\s*\])")


def _exponents_small(s: str) -> bool:
    """Whether every ``^`` of ``s`` is followed by one small token (``_SMALL_EXPONENT_RE``), braced or not."""
    i = s.find("^")
    while i >= 0:
        j = i + 1
        while j < len(s) and s[j] == " ":
            j += 1
        if j < len(s) and s[j] == "{":
            depth, k = 0, j
            for k in range(j, len(s)):
                depth += (s[k] == "{") - (s[k] == "}")
                if depth == 0:
                    break
            if depth != 0 or not _SMALL_EXPONENT_RE.fullmatch(s[j + 1 : k].strip()):
                return False
        elif not re.match(r"[0-9A-Za-z]", s[j : j + 1]):
            return False
        i = s.find("^", j)
    return True


def _refuse(s: str) -> bool:
    """Whether ``s`` is not handed to the library: too long, too deep, a relation, a big operator, a long power
    or a factorial/binomial of anything but small integers."""
    from jaxrl.rewards.math import MAX_PARSE_CHARS

    if not s or len(s) > MAX_PARSE_CHARS or s.count("^") > MAX_LIBRARY_POWERS or _REFUSED_RE.search(s):
        return True
    if _ROOT_INDEX_RE.search(s) or _MATRIX_POWER_RE.search(s) or not _exponents_small(s):
        return True
    if _COMBINATORIAL_RE.search(s) and ("^" in s or _LONG_DIGITS_RE.search(s)):
        return True
    depth = 0
    for ch in s:
        depth += (ch == "{") - (ch == "}")
        if depth > MAX_BRACE_DEPTH:
            return True
    return False


def _squash(s: str) -> str:
    return re.sub(r"\s+|\\[,;:! ]|\\(?:left|right)(?![A-Za-z])|[{}$]", "", s)


class _OurTimeoutsApply:
    """Drops the library's one-time warning that its timeouts are off: jaxrl's hard timeouts apply instead."""

    def filter(self, record) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_QUIET = _OurTimeoutsApply()


def library_parse(s: str):
    """The sympy object Math-Verify reads from the LaTeX answer ``s`` (no ``$`` needed), or None.

    None if ``_refuse`` refuses it, if the library reads nothing, or if what it read is not the whole of ``s``.
    """
    if not isinstance(s, str) or _refuse(s):
        return None
    import logging

    from math_verify import LatexExtractionConfig, parse

    logging.getLogger("math_verify.parser").addFilter(_QUIET)  # idempotent: a filter is added once

    try:
        found = parse(f"${s}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    except Exception:  # noqa: BLE001 - the library's own errors are a refusal here
        return None
    if len(found) != 2 or isinstance(found[0], str) or not isinstance(found[1], str):
        return None
    if _squash(found[1]) != _squash(s):  # read only a part of the answer
        return None
    return found[0]


def _matched(xs: list, ys: list, same) -> bool:
    """Whether the lists are equal as multisets under ``same`` (greedy; ``same`` is an equivalence)."""
    if len(xs) != len(ys):
        return False
    unmatched = list(ys)
    for x in xs:
        hit = next((k for k, y in enumerate(unmatched) if same(x, y)), None)
        if hit is None:
            return False
        unmatched.pop(hit)
    return True


def _union_parts(union) -> list:
    """The sets a (possibly nested, unevaluated) ``Union`` joins: ``A ∪ (B ∪ C)`` -> ``[A, B, C]``."""
    import sympy

    parts, stack = [], [union]
    while stack:
        node = stack.pop()
        if isinstance(node, sympy.Union):
            stack.extend(node.args)
        else:
            parts.append(node)
    return parts


def _same(a, b) -> bool:
    """Structural equality of two library-read objects; numbers and expressions by ``compare_exprs``."""
    import sympy
    from sympy.matrices import MatrixBase

    from jaxrl.rewards.math import _guarded, compare_exprs

    if isinstance(a, MatrixBase) or isinstance(b, MatrixBase):
        return (isinstance(a, MatrixBase) and isinstance(b, MatrixBase) and a.shape == b.shape
                and all(_same(x, y) for x, y in zip(a, b)))
    if isinstance(a, sympy.Interval) or isinstance(b, sympy.Interval):
        return (isinstance(a, sympy.Interval) and isinstance(b, sympy.Interval)
                and a.left_open == b.left_open and a.right_open == b.right_open
                and _same(a.start, b.start) and _same(a.end, b.end))
    if isinstance(a, sympy.Union) or isinstance(b, sympy.Union):
        return (isinstance(a, sympy.Union) and isinstance(b, sympy.Union)
                and _matched(_union_parts(a), _union_parts(b), _same))
    if isinstance(a, sympy.FiniteSet) or isinstance(b, sympy.FiniteSet):
        return (isinstance(a, sympy.FiniteSet) and isinstance(b, sympy.FiniteSet)
                and _matched(list(a.args), list(b.args), _same))
    if isinstance(a, sympy.Tuple) or isinstance(b, sympy.Tuple):
        return (isinstance(a, sympy.Tuple) and isinstance(b, sympy.Tuple) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    if a in (sympy.oo, -sympy.oo) or b in (sympy.oo, -sympy.oo):
        return a == b
    if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr)) or not (_allowed(a) and _allowed(b)):
        return False  # relations, booleans, sets of other kinds, unknown functions
    ga, gb = _guarded(a), _guarded(b)
    return ga is not None and gb is not None and compare_exprs(ga, gb)


def _allowed(expr) -> bool:
    """Whether every node of ``expr`` is one the guards know how to bound (as our own reader produces)."""
    import sympy

    allowed = (sympy.Number, sympy.NumberSymbol, sympy.Symbol, sympy.Add, sympy.Mul, sympy.Pow, sympy.exp,
               sympy.log, sympy.sin, sympy.cos, sympy.tan, sympy.Abs)
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, (sympy.factorial, sympy.binomial)):  # of small integers only: 10!, \binom{10}{3}
            if not all(isinstance(a, sympy.Integer) and 0 <= a <= MAX_COMBINATORIAL_ARGUMENT for a in node.args):
                return False
        elif not (isinstance(node, allowed) or node in (sympy.I, sympy.oo, -sympy.oo, sympy.zoo)):
            return False
    return True


def library_equivalent(answer: str, reference: str) -> bool:
    """Whether Math-Verify reads both normalised answers, and what it reads is equal by ``_same``."""
    a, b = library_parse(answer), library_parse(reference)
    return a is not None and b is not None and _same(a, b)
