"""Verifiable math rewards: answer extraction, normalisation and equivalence.

Everything here is a pure function of strings and never ``eval``s or ``exec``s
model text directly. Symbolic comparison goes through
``sympy.parsing.sympy_parser.parse_expr`` only after the string has passed a
strict whitelist (characters, identifiers, exponent sizes), and the parsed
tree is valued bottom-up at low precision before anything is evaluated exactly
or simplified (``_is_tame``). sympy is imported lazily so that
``import jaxrl.rewards`` stays fast.

LaTeX that this whitelist refuses (matrices, unions of intervals, ``\\binom``, ``\\left|x\\right|``...) is
read by Hugging Face's Math-Verify (``jaxrl.rewards.math_library``), bounded before and after it parses, and
compared here by the same rules. Its own signal-based timeouts are off (they break in threads and cancel
the timer of ``jaxrl.rewards.timeout``); the pool's kill and ``math_verify(..., timeout=)`` are the limits.

All scanning is linear-time (no backtracking-prone regexes, no recursion over
the input), so megabyte-sized or deeply nested completions return quickly.
"""

from __future__ import annotations

import math
import re
import string
from decimal import Decimal
from fractions import Fraction

from jaxrl.registry import register

__all__ = [
    "arithmetic_reward",
    "extract_answer",
    "is_equivalent",
    "math_verify",
    "normalize_answer",
]

# Answers longer than this (after normalisation) are never parsed: they are
# only equivalent to a reference if the normalised strings are identical.
MAX_PARSE_CHARS = 200
# Exponent literals with more digits than this are rejected unevaluated.
MAX_EXPONENT_DIGITS = 3
# Powers and ``exp`` beyond 10**this, and sin/cos/tan of arguments beyond it, are
# rejected before they are evaluated (exactly or to high precision).
MAX_VALUE_DIGITS = 3000
# ``\\sqrt[n]{x}`` / ``root(x, n)``: only integer indices 2..this.
MAX_ROOT_INDEX = 99
# sin/cos/tan/log/exp nested deeper than this are rejected: simplify() is
# exponential in the depth (``\\tan(\\tan(\\tan(\\tan(\\tan(1)))))`` takes minutes).
MAX_FUNCTION_DEPTH = 3
# A power whose exponent exceeds this in magnitude is rejected unless its base is exactly 0, 1 or -1: a
# base that 15 digits round to 1 hides the size of an exact result ((1+10^{-20})^{10^{30}}).
MAX_EXPONENT_VALUE = 10_000
# Power towers (powers nested in exponents) taller than this are rejected:
# ``e^{x^2}`` and ``2^{2^{2^2}}`` pass, ``x^{x^{x^{x}}}`` does not.
MAX_POWER_HEIGHT = 3

# ---------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------

_ANSWER_OPEN_RE = re.compile(r"<answer>", re.IGNORECASE)
_ANSWER_CLOSE_RE = re.compile(r"</answer>", re.IGNORECASE)
# Group 1 is the "{" of a braced box; without it the box holds one token ("\\boxed 12").
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])[ \t]*(\{)?")
# The token of a brace-less box: number- or LaTeX-like only (prose naming the command, "in \\boxed form", is
# no answer), and never past the next box, so that many brace-less boxes stay linear.
_BARE_BOX_TOKEN_RE = re.compile(r"(?!\\(?:boxed|fbox))[-+.(\[\\0-9](?:(?!\\(?:boxed|fbox))[^\s$])*")
# Escaped braces (``\{``, ``\}``) are literal characters, not groups.
_BRACE_RE = re.compile(r"\\[{}]|[{}]")
_ANSWER_MARKER = r"(?:the[ \t]+(?:final[ \t]+)?answer[ \t]+is[ \t]*:?|answer[ \t]*:)[ \t]*"
_ANSWER_MARKER_RE = re.compile(_ANSWER_MARKER, re.IGNORECASE)
_THE_ANSWER_RE = re.compile(_ANSWER_MARKER + r"([^\n]*)", re.IGNORECASE)
# Optional sign (only when not a binary minus), integer with optional
# thousands separators, optional decimals, optional ``/denominator``.
_NUMBER_RE = re.compile(
    r"(?:(?<![0-9A-Za-z)\]}])[-+])?"
    r"(?:(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)"
    r"(?:/[0-9]+(?:\.[0-9]+)?)?"
)


def _last_match(pattern: re.Pattern, text: str, pos: int = 0, endpos: int | None = None):
    last = None
    for last in pattern.finditer(text, pos, len(text) if endpos is None else endpos):
        pass
    return last


_WHITESPACE = "".join(chr(c) for c in range(0x3000 + 1) if chr(c).isspace())  # what str.strip() strips


def _clean(s: str | None) -> str | None:
    """Strip whitespace, ``$`` and markdown ``*`` at either end and periods at the end; None if empty.

    ``str.strip`` with a character set: linear, however many ``.*`` pairs a completion ends with.
    """
    if s is None:
        return None
    return s.lstrip(_WHITESPACE + "$*").rstrip(_WHITESPACE + "$*.") or None


def _answer_tag(text: str) -> str | None:
    """Content of the last complete ``<answer>...</answer>`` pair."""
    close = _last_match(_ANSWER_CLOSE_RE, text)
    if close is None:
        return None
    opening = _last_match(_ANSWER_OPEN_RE, text, 0, close.start())
    if opening is None:
        return None
    content = text[opening.end() : close.start()]
    # ``<answer>... \boxed{5}</answer>``, ``<answer>The answer is 5</answer>``: prefer the marked part.
    return _last_boxed(content) or _clean(_the_answer_is(content)) or content


def _last_boxed(text: str) -> str | None:
    """Content of the last non-blank ``\\boxed{...}``/``\\fbox{...}`` whose braces balance, or the token of a
    brace-less ``\\boxed 12``; blank boxes (``\\boxed{}`` echoing an instruction) are skipped.

    One linear pass with an explicit stack: no regex recursion, no Python
    recursion, so 10k nested braces or 1 MB of ``{`` are fine.
    """
    boxes = list(_BOXED_RE.finditer(text))
    if not boxes:
        return None
    starts = [m.start(1) for m in boxes if m.group(1)]  # positions of "{"
    wanted = set(starts)
    close_of: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACE_RE.finditer(text, starts[0] if starts else len(text)):
        tok = m.group()
        if tok == "{":
            # Only remember positions we care about; -1 keeps the stack cheap.
            stack.append(m.start() if m.start() in wanted else -1)
        elif tok == "}" and stack:
            opened = stack.pop()
            if opened >= 0:
                close_of[opened] = m.start()
    for box in reversed(boxes):
        if box.group(1):
            end = close_of.get(box.start(1))
            content = None if end is None else text[box.start(1) + 1 : end]
        else:
            token = _BARE_BOX_TOKEN_RE.match(text, box.end())
            content = None if token is None else token.group().rstrip(",;:")
        if _clean(content) is not None:  # blank boxes hold no answer (disjoint, so this stays linear)
            return content
    return None


def _after_hashes(text: str) -> str | None:
    """Text after the last ``####`` up to the end of that line (GSM8K format)."""
    i = text.rfind("####")
    if i < 0:
        return None
    j = text.find("\n", i + 4)
    return text[i + 4 : j if j >= 0 else len(text)]


def _the_answer_is(text: str) -> str | None:
    """``the answer is X`` / ``answer: X`` (last occurrence, to end of sentence)."""
    m = _last_match(_THE_ANSWER_RE, text)
    if m is None:
        return None
    # Markers right after the marker ("Final Answer: The final answer is $X$", Minerva's format) introduce
    # the answer too. Matched in place, without slicing: linear however many there are.
    start = m.start(1)
    while (inner := _ANSWER_MARKER_RE.match(text, start, m.end(1))) is not None:
        start = inner.end()
    content = text[start : m.end(1)]
    end = re.search(r"\.\s", content)  # "42. Hope this helps" -> "42"
    return content[: end.start()] if end else content


def _last_number(text: str) -> str | None:
    m = _last_match(_NUMBER_RE, text)
    return None if m is None else m.group()


# Math delimiters of an unboxed answer: display (``\\[...\\]``, ``$$...$$``) and inline (``\\(...\\)``, ``$...$``).
_MATH_DELIMITERS = (("\\[", "\\]"), ("$$", "$$"), ("\\(", "\\)"))


def _last_math_or_number(text: str) -> str | None:
    """The last math span (``\\(...\\)``, ``\\[...\\]``, ``$$...$$``, ``$...$``) of an answer given without a box,
    unless a number follows it (``Let $x$ be ... so it is 5``): then that number. Linear: ``rfind`` only.

    A ``$...$`` span must not start or end with a blank ("costs $5 and $10": currency, not math), and ``\\$``
    is a dollar sign, never a delimiter.
    """
    best = None  # (end, content)
    for opening, closing in _MATH_DELIMITERS:
        close = text.rfind(closing)
        start = text.rfind(opening, 0, close) if close > 0 else -1
        if start >= 0 and (best is None or close > best[0]):
            best = (close, text[start + len(opening) : close])
    dollars = [i for i in (text.rfind("$"),) if i >= 0 and not text.startswith("$$", i - 1)]
    if dollars and (best is None or dollars[0] > best[0]):
        close = dollars[0]
        start = text.rfind("$", 0, close)
        while start > 0 and text[start - 1] == "\\":  # an escaped \\$ is a dollar sign
            start = text.rfind("$", 0, start - 1)
        content = text[start + 1 : close] if start >= 0 and text[close - 1] != "\\" else ""
        if content[:1].strip() and content[-1:].strip():
            best = (close, content)
    number = _last_match(_NUMBER_RE, text)
    if best is None or (number is not None and number.start() > best[0]):
        return None if number is None else number.group()
    return best[1]


def extract_answer(completion: str) -> str | None:
    """Final answer of a completion, or None.

    Priority: last ``<answer>...</answer>``; last balanced ``\\boxed{...}`` or
    ``\\fbox{...}``; text after the last ``####`` (to end of line);
    ``the answer is X`` / ``answer: X``; the last math span (``\\(...\\)``, ``\\[...\\]``, ``$$...$$``,
    ``$...$``) unless a number follows it; the last number (signed integers,
    ``1,234`` thousands separators, decimals, ``a/b``). The result is stripped of
    whitespace, ``$`` and a trailing ``.``. Linear time in ``len(completion)``.
    """
    if not isinstance(completion, str):
        return None
    for finder in (_answer_tag, _last_boxed, _after_hashes, _the_answer_is, _last_math_or_number):
        found = _clean(finder(completion))
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------

_UNICODE_MAP = str.maketrans(
    {
        "\u2212": "-",  # minus sign
        "\u2013": "-",  # en dash
        "\u00d7": r"\times ",
        "\u22c5": r"\cdot ",
        "\u00b7": r"\cdot ",
        "\u00f7": r"\div ",
        "\u03c0": r"\pi ",
        "\u221e": r"\infty ",
        "\u00b0": r"^\circ",  # degree sign: 90°C goes with _DEGREES_RE
        "\u00a0": " ",
        "\u2009": " ",
        "\u202f": " ",
        "~": " ",  # LaTeX's non-breaking space: 5~\text{cm}, 1~000
    }
)
# Not the "\\" of a matrix row break followed by a space. Math delimiters \( \) \[ \] go as well.
_LATEX_SPACING_RE = re.compile(
    r"\\(?:left|right|displaystyle|quad|qquad)(?![A-Za-z])|(?<!\\)\\[!,;: ]|(?<!\\)\\[()\[\]]")
# ^\circ, ^{\circ}, \degree, \textdegree and a Celsius/Fahrenheit letter after them. Every \s* ends at a
# required character (or the match) before the next starts: linear on long blank runs.
_DEGREES_RE = re.compile(
    r"(?:\^\s*(?:\{\s*)?\\circ(?:\s*\})?|\\(?:text)?degree(?![A-Za-z]))(?:\s*[CF](?![A-Za-z0-9]))?")
_TEXT_RE = re.compile(
    r"\\(?:text|textrm|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}"
)
_UNIT_TAIL_RE = re.compile(r"\s*(?:\^\s*(?:\{\s*)?[0-9]\s*\}?\s*)?\Z")
# Keep one space between a LaTeX command and a following letter ("\pi r").
_SPACE_RE = re.compile(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])|\s+")
# A plain number followed by words ("5 cm", "4 hours", "40 percent", "12 cm^2",
# "5 million", "5cm"); _drop_unit_words decides whether the words are units.
_PLAIN_UNITS_RE = re.compile(
    r"([-+]?(?:[0-9][0-9,]*(?:\.[0-9]+)?|\.[0-9]+))([ \t]*)"
    r"([A-Za-z]{2,}\.?(?:[ \t]+[A-Za-z]{2,}\.?)*)([ \t]*\^[ \t]*\{?[0-9]\}?)?"
)
# Units that may follow a number without a space ("5cm", "12km^2"): only these, as "6xy" is a product.
_ATTACHED_UNITS = frozenset(
    "mm cm dm km in ft yd mi nm um mg kg lb lbs oz ml cl dl cc sec secs min mins hr hrs ms ns mph kph kmh"
    " kwh mah mb gb kb tb hz khz mhz ghz kw mw gw kj cal kcal kpa atm deg rad pct usd"
    " meter meters metre metres inch inches foot feet yard yards mile miles gram grams pound pounds ounce"
    " ounces liter liters litre litres second seconds minute minutes hour hours day days week weeks month"
    " months year years dollar dollars cent cents degree degrees percent units unit".split()
)
# A leading scale word multiplies the number ("5 million" -> 5000000).
_SCALES = {"hundred": 10**2, "thousand": 10**3, "million": 10**6, "billion": 10**9,
           "trillion": 10**12}
# Words (any case) that change the value, so are never dropped as units:
# mathematics ("2 pi"), operators and bounds ("12 squared", "5 or more"), scales.
_NOT_UNIT_WORDS = frozenset(
    "pi sqrt ln log sin cos tan exp infty infinity oo squared cubed or and more less than"
    " fewer times plus minus over dozen to".split()
) | frozenset(_SCALES)
_ASSIGNMENT_RE = re.compile(r"[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?=")
# A mixed number, the whole answer: "2\frac{1}{2}" is 2 + 1/2 (not the product 2 * 1/2) when the
# fraction is proper.
_MIXED_NUMBER_RE = re.compile(r"([-+]?)([0-9]+)\\frac\{([0-9]+)\}\{([0-9]+)\}")
# The same in plain text, "2 1/2" (read before whitespace goes: "21/2" would be another number).
_PLAIN_MIXED_NUMBER_RE = re.compile(r"([-+]?)([0-9]+)[ \t]+([0-9]+)/([0-9]+)")
_MAX_MIXED_NUMBER_DIGITS = 100
_THOUSANDS_RE = re.compile(r"[-+]?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?")
# A repeating decimal, read after whitespace goes: "0.\overline{3}", "1.2\overline{36}", "0.\bar{6}",
# "0.\dot{3}" (one repeating digit: "0.\dot{1}\dot{6}" is not read). Starting
# only where a run of digits starts keeps it linear.
_REPEATING_DECIMAL_RE = re.compile(
    r"(?<![0-9])([0-9]*)\.([0-9]*)\\(?:overline|bar|dot)(?:\{([0-9]+)\}|([0-9]))(?![0-9]|\\dot)")
_MAX_REPEATING_DIGITS = 100
# A leading membership, "x\in(1,2)" -> "(1,2)", like the assignment "x=5" -> "5".
_MEMBERSHIP_RE = re.compile(r"[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?\\in(?![A-Za-z])")


def _are_unit_words(text: str) -> bool:
    return not any(w.casefold() in _NOT_UNIT_WORDS for w in re.findall(r"[A-Za-z]+", text))


def _strip_text_wrappers(s: str) -> str:
    """Drop a trailing ``\\text{units}`` after a value; unwrap other ``\\text{X}``
    (``5\\text{ to 8}`` is not a unit: digits never are)."""
    last = _last_match(_TEXT_RE, s)
    if (last is not None and s[: last.start()].strip() and _UNIT_TAIL_RE.match(s, last.end())
            and not any(c.isdigit() for c in last.group(1)) and _are_unit_words(last.group(1))):
        s = s[: last.start()]
    return _TEXT_RE.sub(lambda m: m.group(1), s)


def _drop_unit_words(m: re.Match) -> str | None:
    """The number of a ``_PLAIN_UNITS_RE`` match, scaled by a leading scale word; None if
    a word is not a unit (``12 squared``, ``5 or more``, ``4 Pi``), or if it follows the number
    without a space and is not one of ``_ATTACHED_UNITS`` (``6xy`` is a product)."""
    number, space, words = m.group(1), m.group(2), m.group(3).replace(".", " ").casefold().split()
    if not space and words[0] not in _ATTACHED_UNITS and words[0] not in _SCALES:
        return None
    scale = _SCALES.get(words[0]) if m.group(4) is None else None
    if scale is not None:
        words = words[1:]
    if not _are_unit_words(" ".join(words)):
        return None
    if scale is None:
        return number
    if "," in number and not _THOUSANDS_RE.fullmatch(number):
        return None
    value = format(Decimal(number.replace(",", "")) * scale, "f")
    return value.rstrip("0").rstrip(".") if "." in value else value


def normalize_answer(s: str) -> str:
    """Canonical string form of an answer, for exact comparison.

    Removes whitespace, ``$`` and ``\\(``/``\\[`` delimiters, ``\\!``/``\\,``-style spacing, ``\\left``/``\\right``,
    ``\\text{...}`` unit wrappers, plain unit words after a number (``5 cm``,
    ``40 percent``; never words that change the value: ``12 squared``, ``5 or
    more``, ``4 Pi`` stay, and a leading scale word multiplies: ``5 million`` ->
    ``5000000``), degrees (``^\\circ``, ``\\degree``, and a C or F after them), percent signs, trailing
    periods, thousands separators (``1,234`` but not ``(1,2)`` or the list ``2, 100``) and a leading
    single-variable assignment (``x=5`` -> ``5``); maps ``\\dfrac``/``\\tfrac``/``\\cfrac`` to
    ``\\frac``, expands ``\\frac12``/``\\sqrt2`` shorthands, reads a repeating decimal (``0.\\overline{3}``
    -> ``\\frac{3}{9}``), drops a leading membership (``x\\in(1,2)``) and writes a mixed number
    (``2\\frac{1}{2}``, ``2 1/2``) as one fraction (``\\frac{5}{2}``). Linear time.
    """
    if not isinstance(s, str):
        s = str(s)
    s = s.translate(_UNICODE_MAP)
    s = s.replace("\\$", "").replace("$", "")
    s = _LATEX_SPACING_RE.sub("", s)
    s = re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", s)
    s = _DEGREES_RE.sub("", s)
    s = s.replace("\\%", "%").replace("{,}", ",")
    s = _strip_text_wrappers(s)
    m = _PLAIN_UNITS_RE.fullmatch(s.strip())
    if m is not None:
        s = _drop_unit_words(m) or s
    m = _PLAIN_MIXED_NUMBER_RE.fullmatch(s.strip())
    if m is not None:
        s = _mixed_number(*m.groups()) or s
    spaced_commas = re.search(r",\s", s) is not None  # "2, 100" is a list, "2,100" a number
    s = _SPACE_RE.sub(lambda m: m.group(1) + " " if m.group(1) else "", s).strip()
    s = s.rstrip(".")
    if s.endswith("%"):
        s = s[:-1]
    m = _ASSIGNMENT_RE.match(s)
    if m is not None and s.count("=") == 1:
        s = s[m.end() :]
    m = _MEMBERSHIP_RE.match(s)
    if m is not None:
        s = s[m.end() :]
    s = _REPEATING_DECIMAL_RE.sub(_repeating_decimal, s)
    if not spaced_commas and _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    s = re.sub(r"\\frac([0-9])([0-9])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac([0-9])\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac(\{[^{}]*\})([0-9])", r"\\frac\1{\2}", s)
    s = re.sub(r"\\sqrt ?([0-9]|[A-Za-z](?![A-Za-z]))", r"\\sqrt{\1}", s)
    m = _MIXED_NUMBER_RE.fullmatch(s)
    if m is not None:
        s = _mixed_number(*m.groups()) or s
    return s.rstrip(".")


def _repeating_decimal(m: re.Match) -> str:
    """``1.2\\overline{3}`` -> ``\\frac{111}{90}``: the digits through one period, less those before it,
    over 10**(fixed digits) * (10**(period) - 1); unchanged if too long."""
    whole, fixed, period = m.group(1) or "0", m.group(2), m.group(3) or m.group(4)
    if len(whole) + len(fixed) + len(period) > _MAX_REPEATING_DIGITS:
        return m.group(0)
    numerator = int(whole + fixed + period) - int(whole + fixed)
    return f"\\frac{{{numerator}}}{{{10 ** len(fixed) * (10 ** len(period) - 1)}}}"


def _mixed_number(sign: str, whole: str, num: str, den: str) -> str | None:
    """``\\frac{whole * den + num}{den}`` (negative for sign ``-``) for a proper fraction num/den; else None."""
    if max(len(whole), len(num), len(den)) > _MAX_MIXED_NUMBER_DIGITS or not 0 < int(num) < int(den):
        return None
    return f"{'-' if sign == '-' else ''}\\frac{{{int(whole) * int(den) + int(num)}}}{{{den}}}"


# ---------------------------------------------------------------------------
# Equivalence
# ---------------------------------------------------------------------------

_DECIMAL_RE = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]{1,3})?")
_LATEX_FRAC_RE = re.compile(r"([-+]?)\\frac\{([^{}]+)\}\{([^{}]+)\}")
_WORD_RE = re.compile(r"[A-Za-z]{2,}")
_OPENERS = {"(": ")", "[": "]", "{": "}"}
_CLOSERS = {")", "]", "}"}


def _decimal(s: str) -> Fraction | None:
    return Fraction(s) if _DECIMAL_RE.fullmatch(s) else None


def _to_fraction(s: str) -> Fraction | None:
    """Exact value of ``12``, ``-0.5``, ``1e3``, ``3/4`` or ``\\frac{3}{4}``, else None."""
    m = _LATEX_FRAC_RE.fullmatch(s)
    if m is not None:
        sign, num, den = -1 if m.group(1) == "-" else 1, _decimal(m.group(2)), _decimal(m.group(3))
    elif s.count("/") == 1:
        sign, (num, den) = 1, (_decimal(part) for part in s.split("/"))
    else:
        return _decimal(s)
    if num is None or den is None or den == 0:
        return None
    return sign * num / den


def _split_top_level(s: str) -> list[str] | None:
    """Split on commas outside brackets; None if brackets are unbalanced."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in _OPENERS:
            depth += 1
        elif ch in _CLOSERS:
            depth -= 1
            if depth < 0:
                return None
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    return parts + [s[start:]] if depth == 0 else None


def _as_sequence(s: str) -> tuple[str, list[str]] | None:
    """``(1,2)`` -> ("()", ["1", "2"]); ``\\{1,2\\}`` and ``{1,2}`` -> ("set", ...); None if not a tuple."""
    kind, inner = "", s
    if s.startswith("\\{") and s.endswith("\\}"):
        kind, inner = "set", s[2:-2]
    elif len(s) >= 2 and s[0] == "{" and s[-1] == "}" and _split_top_level(s[1:-1]) is not None:
        kind, inner = "set", s[1:-1]  # a set written without LaTeX escapes
    elif len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        whole = _split_top_level(s[1:-1])  # outer pair must enclose everything
        if whole is not None:
            kind, inner = s[0] + s[-1], s[1:-1]
    parts = _split_top_level(inner)
    if parts is None or len(parts) < 2:
        return None
    return kind, parts


_FUNCTIONS = {"sqrt": "sqrt", "root": "root", "log": "log", "ln": "log", "exp": "exp",
              "sin": "sin", "cos": "cos", "tan": "tan"}
_CONSTANTS = {"pi": "pi", "oo": "oo", "infty": "oo"}
_LATEX_WORDS = {"cdot": "*", "times": "*", "div": "/", "pi": " pi ", "infty": " oo ",
                **{name: f" {target}" for name, target in _FUNCTIONS.items()}}


def _brace_group(s: str, i: int, open_ch: str = "{", close_ch: str = "}") -> int | None:
    """Index just past the group starting at ``s[i] == open_ch``, or None."""
    if i >= len(s) or s[i] != open_ch:
        return None
    depth = 0
    for j in range(i, len(s)):
        if s[j] == open_ch:
            depth += 1
        elif s[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _latex_to_sympy(s: str) -> str | None:
    """Rewrite the small LaTeX subset we support into sympy syntax, or None.

    Handles ``\\frac{a}{b}``, ``\\sqrt{x}``, ``\\sqrt[n]{x}`` (integer n in
    2..``MAX_ROOT_INDEX``), ``\\pi``, ``\\cdot``, ``\\times``, ``\\div``, ``\\infty``,
    ``\\ln``/``\\log``/``\\sin``... (``\\sin^2 x`` is ``(\\sin x)^2``; ``\\log_b x`` is
    ``log(x, b)``), ``^`` and ``{}``
    grouping. Any other backslash command -> None.
    """
    # Innermost-last: the last \frac / \sqrt never contains another one.
    while True:
        i = max(s.rfind("\\frac"), s.rfind("\\sqrt"))
        if i < 0:
            break
        if s.startswith("\\frac", i):
            a_end = _brace_group(s, i + 5)
            b_end = _brace_group(s, a_end) if a_end is not None else None
            if b_end is None:
                return None
            repl = f"(({s[i + 6 : a_end - 1]})/({s[a_end + 1 : b_end - 1]}))"
            s = s[:i] + repl + s[b_end:]
        else:
            j, index = i + 5, None
            if s.startswith("[", j):
                k = _brace_group(s, j, "[", "]")
                if k is None:
                    return None
                index, j = s[j + 1 : k - 1].strip(), k
                # \sqrt[1/999]{x} would be x^999: no guard would see that power.
                if not (re.fullmatch(r"[0-9]{1,2}", index) and 2 <= int(index) <= MAX_ROOT_INDEX):
                    return None
            k = _brace_group(s, j)
            if k is None:
                return None
            body = s[j + 1 : k - 1]
            negative = re.fullmatch(r"\s*-\s*([0-9]+(?:\.[0-9]+)?)\s*", body)
            if index is not None and int(index) % 2 == 1 and negative is not None:
                repl = f" (-root({negative.group(1)},{index}))"  # the real odd root: \sqrt[3]{-8} is -2
            else:
                repl = f" sqrt({body})" if index is None else f" root({body},{index})"
            s = s[:i] + repl + s[k:]
    # "\sin^2 x", "\cos^{2}(x)" -> "(\sin(x))^{2}"; not "\sin^{-1}" (arcsin)
    s = re.sub(
        r"\\(sin|cos|tan|ln|log)\^(?:([0-9])|\{([0-9])\}) ?"
        r"(\([^()]*\)|[0-9]+(?:\.[0-9]+)?|\\pi(?![A-Za-z])|[A-Za-z](?![A-Za-z]))",
        r"(\\\1(\4))^{\2\3}",
        s,
    )
    # "\log_2 8", "\log_{10}(x)" -> "\log(8,2)": sympy's log(x, base)
    s = re.sub(
        r"\\log_(?:\{([^{}]+)\}|([0-9A-Za-z])) ?"
        r"(\([^()]*\)|\{[^{}]*\}|[0-9]+(?:\.[0-9]+)?|\\pi(?![A-Za-z])|[A-Za-z](?![A-Za-z]))",
        lambda m: f"\\log({m.group(3)},{m.group(1) or m.group(2)})",
        s,
    )
    # "\ln 2", "\sin x", "\cos\pi", "\cos 2x" (the argument is 2x, as in print) -> call syntax
    s = re.sub(
        r"\\(ln|log|sin|cos|tan|exp) ?([0-9]+(?:\.[0-9]+)?(?:[A-Za-z](?![A-Za-z]))?|\\pi(?![A-Za-z])"
        r"|[A-Za-z](?![A-Za-z]))",
        r"\\\1(\2)",
        s,
    )
    s = re.sub(r"\\([A-Za-z]+)", lambda m: _LATEX_WORDS.get(m.group(1), "\\" + m.group(1)), s)
    if "\\" in s:
        return None
    return s.replace("{", "(").replace("}", ")").replace("^", "**")


_SCIENTIFIC_OR_NAME_RE = re.compile(
    r"(?<![A-Za-z0-9.])(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+(?![A-Za-z])|[A-Za-z]+"
)


def _split_identifiers(s: str) -> str:
    """Split unknown multi-letter names into single-letter symbols (``xy`` -> ``x y``).

    Scientific literals (``2.5e3``) are kept intact.
    """
    def repl(m: re.Match) -> str:
        word = m.group()
        if not word[0].isalpha():
            return word
        if word in _FUNCTIONS or word in _CONSTANTS:
            return f" {_FUNCTIONS.get(word) or _CONSTANTS[word]} "
        return " " + " ".join(word) + " "

    return _SCIENTIFIC_OR_NAME_RE.sub(repl, s)


def _operand_end(s: str, j: int) -> int | None:
    """End index of the power operand starting at ``s[j]`` (after signs/spaces)."""
    n = len(s)
    while j < n and s[j] in " +-":
        j += 1
    if j < n and s[j] == "(":
        return _brace_group(s, j, "(", ")")
    m = re.compile(r"[A-Za-z0-9.]+").match(s, j)
    if m is None:
        return None
    end = m.end()
    if m.group()[:1].isalpha() and end < n and s[end] == "(":  # function call
        return _brace_group(s, end, "(", ")")
    return end


def _exponent_literals_are_small(s: str) -> bool:
    """Whether every integer literal in every ``**`` operand has <= ``MAX_EXPONENT_DIGITS`` digits.

    A cheap first filter only: what a power may grow to is bounded on the parsed tree (``_parse``:
    ``MAX_POWER_HEIGHT``, and ``_is_tame`` before anything is evaluated).
    """
    i = s.find("**")
    while i >= 0:
        end = _operand_end(s, i + 2)
        if end is None:
            return False
        if any(len(d) > MAX_EXPONENT_DIGITS for d in re.findall(r"[0-9]+", s[i + 2 : end])):
            return False
        i = s.find("**", i + 2)
    return True


def _to_sympy_syntax(s: str) -> str | None:
    """Whitelisted sympy source for an answer, or None if it is not safe/supported."""
    code = _latex_to_sympy(s)
    if code is None or not re.fullmatch(r"[0-9A-Za-z+\-*/()., ]*", code):
        return None
    if re.search(r"\.\s*[A-Za-z_]", code):  # no attribute access
        return None
    if re.search(r"[eE][-+]?[0-9]{%d,}" % (MAX_EXPONENT_DIGITS + 1), code):  # 1e99999
        return None
    code = _split_identifiers(code)
    if not code.strip() or not _exponent_literals_are_small(code):
        return None
    return code


def _root(radicand, index):
    """``root`` for the parser: a small integer index only (``root(9, 1/999)`` is ``9**999``)."""
    import sympy

    if not (isinstance(index, sympy.Integer) and 2 <= index <= MAX_ROOT_INDEX):
        raise ValueError(f"unsupported root index {index}")
    return sympy.root(radicand, index, evaluate=False)


def _mp(value, bits: int = 64):
    """An evaluated sympy number as an mpmath complex (maybe infinite), or None if not a number."""
    import mpmath

    try:
        z = mpmath.mpmathify(value._to_mpmath(bits))
    except Exception:  # noqa: BLE001 - not a number (a symbol left, nan, AccumBounds...)
        return None
    return None if mpmath.isnan(z) else z


def _base_and_exponent(power) -> tuple:
    """``(base, exponent)`` of a ``Pow`` or ``exp`` node as its own children (base None for ``exp``).

    Not ``as_base_exp()``: that rewrites ``(1/2)**x`` as ``2**(-x)`` and ``exp(x)`` as ``E**x``, new nodes
    that a walk over the tree never visited.
    """
    return (power.base, power.exp) if power.is_Pow else (None, power.args[0])


def _is_tame(expr, point: dict) -> bool:
    """Whether ``expr`` (symbols -> ``point``) evaluates without astronomically large numbers.

    Bottom-up, each node without free symbols is valued at 15 digits once its
    children passed: every power and ``exp``, however produced (``^``, ``root``,
    ``\\exp``), must stay below 10**``MAX_VALUE_DIGITS``, and so must sin/cos/tan
    arguments (``\\sin(e^{e^{99}})`` needs e^{99} digits of pi). Symbolic nodes are
    skipped; the numeric comparison checks again at each sample point.
    """
    import mpmath
    import sympy

    max_log, limit = MAX_VALUE_DIGITS * math.log(10), mpmath.mpf(10) ** MAX_VALUE_DIGITS
    values = {}
    for node in sympy.postorder_traversal(expr):
        if node in values or node.free_symbols - point.keys():
            continue
        if node.is_Pow or isinstance(node, sympy.exp):
            base, power = _base_and_exponent(node)
            b, p = mpmath.e if base is None else values.get(base), values.get(power)
            if b is None or p is None:
                return False
            trivial_base = base is not None and base in (sympy.S.Zero, sympy.S.One, sympy.S.NegativeOne)
            if mpmath.isfinite(p) and abs(p) > MAX_EXPONENT_VALUE and not trivial_base:
                return False
            if b != 0 and mpmath.isfinite(b) and mpmath.isfinite(p):  # oo stays symbolic
                w = p * mpmath.log(b)  # |b**p| = exp(re(w))
                if abs(w.real) > max_log or abs(w.imag) > limit:
                    return False
        elif isinstance(node, (sympy.sin, sympy.cos, sympy.tan)):
            arg = values.get(node.args[0])  # |sin(z)| ~ exp(|im(z)|)
            if arg is None:
                return False
            if mpmath.isfinite(arg) and (abs(arg) > limit or abs(arg.imag) > max_log):
                return False
        values[node] = _mp(node.evalf(15, subs=point))
    return True


def _function_depth(expr) -> int:
    """Deepest nesting of function calls (sin, log, ...) in ``expr``."""
    import sympy

    depth = {}
    for node in sympy.postorder_traversal(expr):
        depth[node] = max((depth[a] for a in node.args), default=0) + isinstance(node, sympy.Function)
    return depth[expr]


def _power_height(expr) -> int:
    """Height of the tallest power tower in ``expr``: nesting through exponents (``x^2``: 1, ``e^{x^2}``: 2)."""
    import sympy

    height = {}
    for node in sympy.postorder_traversal(expr):
        below = max((height[a] for a in node.args), default=0)
        if node.is_Pow or isinstance(node, sympy.exp):
            base, exponent = _base_and_exponent(node)
            below = max(height.get(base, 0), 1 + height[exponent])
        height[node] = below
    return height[expr]


def _parse(code: str):
    """``parse_expr`` with ``evaluate=False`` in a minimal namespace; None if not tame."""
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication,
        parse_expr,
        standard_transformations,
    )

    # Every single letter is a plain symbol (shadowing sympy's S, N, O, Q, ...),
    # except lowercase e (Euler's number) and i (imaginary unit).
    names = {letter: sympy.Symbol(letter) for letter in string.ascii_letters}
    names.update(e=sympy.E, i=sympy.I, pi=sympy.pi, oo=sympy.oo)
    global_dict = {"__builtins__": {}, "root": _root}
    for name in ("Integer", "Float", "Rational", "Symbol", "Function", "Add", "Mul", "Pow",
                 "sqrt", "log", "exp", "sin", "cos", "tan"):
        global_dict[name] = getattr(sympy, name)
    expr = parse_expr(
        code,
        local_dict=names,
        global_dict=global_dict,
        transformations=standard_transformations + (implicit_multiplication, convert_xor),
        evaluate=False,
    )
    return _guarded(expr)


def _guarded(expr):
    """``expr`` evaluated (``doit``) with its decimals made exact, or None if it is not an ``Expr`` or not tame:
    functions nested deeper than ``MAX_FUNCTION_DEPTH``, towers above ``MAX_POWER_HEIGHT``, or ``_is_tame``
    failing with its symbols free or bound to 3/2. Both readers (ours and Math-Verify's) go through it."""
    import sympy

    if not isinstance(expr, sympy.Expr) or _function_depth(expr) > MAX_FUNCTION_DEPTH:
        return None
    if _power_height(expr) > MAX_POWER_HEIGHT:
        return None
    # Symbols bound too: doit() may cancel them (2^{10^{30}x/x} is 2^{10^{30}}), leaving powers unchecked.
    point = {x: sympy.Rational(3, 2) for x in expr.free_symbols}
    if not _is_tame(expr, {}) or (point and not _is_tame(expr, point)):
        return None
    expr = expr.doit()  # evaluate now that the power guards have passed
    if expr.has(sympy.nan, sympy.zoo):
        return None
    # Decimal literals -> exact rationals, so 1000001.0 != 10**6 exactly.
    return expr.xreplace({f: sympy.Rational(str(f)) for f in expr.atoms(sympy.Float)})


# Expressions in symbols whose polynomial degree may exceed this (``_degree``) are
# compared at random points instead of with simplify(), which would expand them;
# so are all rational functions, exactly (``(x+y+z+w)^{16}`` took 2 s to simplify).
_MAX_SYMBOLIC_POWER = 16
# Rational functions up to this degree are evaluated exactly at the points (the
# point's denominator 1000 gives ~3 digits per degree); above it, numerically.
_MAX_EXACT_DEGREE = 1000
# Random points of the identity test: this many must be defined for both sides,
# out of at most _MAX_POINTS drawn (a pole at a point skips it).
_POINTS, _MAX_POINTS = 3, 8
# Closed forms (and values at sample points) agree if they differ by less than
# 10**-this times min(1, |value|): relative below 1, absolute above.
_AGREE_DIGITS = 50


# A decimal against an exact irrational value states its precision: it must give at least this many places
# (Math-Verify's default ``float_rounding``), and be within one unit of its last place.
MIN_STATED_PLACES = 6


def _decimal_places(s: str | None) -> int | None:
    """Places after the point of a plain decimal literal (``3.140`` -> 3), else None (integers, forms)."""
    if s is None:
        return None
    m = re.fullmatch(r"[-+]?[0-9]*\.([0-9]+)", s)
    return None if m is None else len(m.group(1))


def _stated_precision_agrees(x, y, x_text: str | None, y_text: str | None) -> bool:
    """Whether two constants that are not equal to 50 digits agree at the precision a decimal states.

    One side must be a decimal literal of k >= ``MIN_STATED_PLACES`` places and the other not a decimal
    or integer literal; they match if they differ by less than 10**-k (``1.414214`` and ``\\sqrt{2}``, either
    way round). ``3.14`` and ``\\pi`` do not match (as in Math-Verify, which rounds to 6 places), and an
    integer never matches a value that is not that integer (``10000009000`` and ``10^{10}+\\pi``).
    """
    import mpmath

    places = [_decimal_places(x_text), _decimal_places(y_text)]
    if (places[0] is None) == (places[1] is None):
        return False
    k, other = (places[0], y_text) if places[0] is not None else (places[1], x_text)
    if k < MIN_STATED_PLACES or other is None or _decimal(other) is not None:
        return False
    digits = 30 + k
    vx = _mp(x.evalf(digits), int(digits * 3.33) + 16)
    vy = _mp(y.evalf(digits), int(digits * 3.33) + 16)
    if vx is None or vy is None or not (mpmath.isfinite(vx) and mpmath.isfinite(vy)):
        return False
    return abs(vx - vy) < mpmath.mpf(10) ** -k


def _degree(expr) -> float:
    """An upper bound on the polynomial degree ``expr`` or any part of it could expand to.

    Powers with a rational exponent multiply it through nesting (``((x+1)^{16}+1)^{16}``: 256),
    products add, and anything else (sums, functions, symbolic exponents) takes its largest argument's.
    """
    import sympy

    degree = {}
    for node in sympy.postorder_traversal(expr):  # children before their parent
        if node.is_Symbol:
            d = 1.0
        elif node.is_Pow and node.exp.is_Rational:
            d = degree[node.base] * abs(float(node.exp))
        elif node.is_Mul:
            d = sum(degree[a] for a in node.args)
        else:
            d = max((degree[a] for a in node.args), default=0.0)
        degree[node] = d
    return max(degree.values())


def _agree_at(a, b, point: dict, exact: bool) -> bool | None:
    """Whether ``a`` and ``b`` are equal at ``point`` (symbols -> Rationals); None if either is undefined there.

    Exactly if ``exact`` (both are rational functions of degree <= ``_MAX_EXACT_DEGREE``); otherwise to
    within 10**-``_AGREE_DIGITS`` times min(1, |value|), evaluated with the precision raised to the
    magnitude, so that a large leading term cannot swamp the difference (``x^{100}`` vs ``x^{100}+1``).
    Evaluates only ``_is_tame`` input (anything else is False).
    """
    import mpmath
    import sympy

    if not (_is_tame(a, point) and _is_tame(b, point)):
        return False
    if exact:
        va, vb = a.xreplace(point), b.xreplace(point)
        undefined = (sympy.zoo, sympy.nan, sympy.oo, -sympy.oo)
        if va.has(*undefined) or vb.has(*undefined):
            return None
        if va.is_Rational and vb.is_Rational:
            return va == vb
    va, vb = _mp(a.evalf(15, subs=point)), _mp(b.evalf(15, subs=point))
    if va is None or vb is None or not (mpmath.isfinite(va) and mpmath.isfinite(vb)):
        return None
    scale = max(abs(va), abs(vb))
    digits = _AGREE_DIGITS + 10 + (max(0, int(mpmath.log10(scale)) + 1) if scale else 0)
    if digits > 2 * MAX_VALUE_DIGITS:
        return False
    bits = int(digits * 3.33) + 16
    va = _mp(a.evalf(digits, subs=point, maxn=2 * digits), bits)
    vb = _mp(b.evalf(digits, subs=point, maxn=2 * digits), bits)
    if va is None or vb is None:
        return False
    return abs(va - vb) <= min(scale, 1) * mpmath.mpf(10) ** -_AGREE_DIGITS


def _points_rng(a, b, stream: int):
    """A ``random.Random`` seeded from the two expressions (in either order), one of 4 independent ``stream``s:
    the same pair always gets the same points (rewards are reproducible), and no answer can be built to
    vanish at points known in advance."""
    import hashlib
    import random

    import sympy

    digest = hashlib.sha256("\0".join(sorted((sympy.srepr(a), sympy.srepr(b)))).encode()).digest()
    return random.Random(int.from_bytes(digest[8 * stream : 8 * stream + 8], "little"))


def _agree_at_random_points(a, b, symbols: list, exact: bool) -> bool | None:
    """Randomised identity test: True if ``a`` and ``b`` agree at ``_POINTS`` points in [1, 2]^n where both are
    defined, False if they differ at one, None if too few of ``_MAX_POINTS`` are defined.

    The points are drawn by ``_points_rng``.
    """
    import sympy

    rng, defined = _points_rng(a, b, 0), 0
    for _ in range(_MAX_POINTS):
        point = {x: sympy.Rational(rng.randint(1000, 2000), 1000) for x in symbols}
        agree = _agree_at(a, b, point, exact)
        if agree is False:
            return False
        defined += agree is True
        if defined == _POINTS:
            return True
    return None


def _sympy_equivalent(a: str, b: str) -> bool | None:
    """Whether answer ``a`` equals reference ``b`` read by our whitelisted reader; None if either is unreadable."""
    code_a, code_b = _to_sympy_syntax(a), _to_sympy_syntax(b)
    if code_a is None or code_b is None:
        return None
    ea, eb = _parse(code_a), _parse(code_b)
    if ea is None or eb is None:
        return None
    return compare_exprs(ea, eb, a, b)


def compare_exprs(ea, eb, answer_text: str | None = None, reference_text: str | None = None) -> bool:
    """Whether two guarded (``_guarded``) sympy expressions are equal; the texts carry the stated precision.

    With symbols: random points, then ``simplify`` (see ``is_equivalent``). Constants: equal to 50 digits, or
    at the precision a decimal states (``_stated_precision_agrees``).
    """
    import sympy

    if ea == eb:
        return True
    diff = ea - eb  # cheap: like terms cancel ((x+1)^{17}+1 - (x+1)^{17} -> 1)
    if diff == 0 or diff.is_Rational:
        return diff == 0
    symbols = sorted(ea.free_symbols | eb.free_symbols, key=str)
    if symbols:
        rational = ea.is_rational_function() and eb.is_rational_function()
        degree = max(_degree(ea), _degree(eb))
        agree = _agree_at_random_points(ea, eb, symbols, exact=rational and degree <= _MAX_EXACT_DEGREE)
        if agree is False:  # the common case (a wrong answer), decided without simplify()
            return False
        if rational or degree > _MAX_SYMBOLIC_POWER:
            return agree is True  # exact at the points, or too large to simplify()
    else:
        # Constants must agree to 50 digits (pi^{100} vs pi^{100}+sqrt(2); an integer against a closed form),
        # else at the precision a decimal states. Numerically first: simplify() can take minutes on a short
        # constant ((sqrt 2+sqrt 3+sqrt 5+sqrt 7)^{99}); it only decides what the digits cannot.
        agree = _agree_at(ea, eb, {}, exact=False)
        if agree is True:
            return True
        if agree is False or ea.is_Rational or eb.is_Rational:
            return _stated_precision_agrees(ea, eb, answer_text, reference_text)
    if sympy.simplify(diff) == 0:
        return True
    # simplify() keeps log(x^3) - 3 log(x) for complex x; on the real domain they are equal.
    return bool(symbols) and agree is True and _equal_on_real_domain(ea, eb, symbols)


def _real_at(expr, point: dict) -> bool:
    """Whether ``point`` is in ``expr``'s real domain: every subexpression real and finite there."""
    import mpmath
    import sympy

    if not _is_tame(expr, point):
        return False
    for node in sympy.postorder_traversal(expr):
        value = _mp(node.evalf(15, subs=point))
        if value is None or not mpmath.isfinite(value) or abs(mpmath.im(value)) > 1e-12 * max(1, abs(value)):
            return False
    return True


def _equal_on_real_domain(a, b, symbols: list) -> bool:
    """Whether ``a == b`` wherever both are real (``\\log(x^3)`` and ``3\\log x``; ``\\sqrt{x}\\sqrt{y}`` and
    ``\\sqrt{xy}``): ``simplify`` proves it for positive symbols, and at random points with a negative
    coordinate where every subexpression of both is real they must agree too (``\\sqrt{x^2}`` is not ``x``:
    both are real at x = -3/2 and differ)."""
    import sympy

    positive = {x: sympy.Symbol(x.name, positive=True) for x in symbols}
    if sympy.simplify((a - b).xreplace(positive)) != 0:
        return False
    rng = _points_rng(a, b, 1)
    for _ in range(_MAX_POINTS):
        point = {x: sympy.Rational(rng.choice((-1, 1)) * rng.randint(1000, 2000), 1000) for x in symbols}
        if all(v > 0 for v in point.values()) or not (_real_at(a, point) and _real_at(b, point)):
            continue
        if _agree_at(a, b, point, exact=False) is not True:
            return False
    return True


_PLUS_MINUS_RE = re.compile(r"\\pm(?![a-zA-Z])|\\mp(?![a-zA-Z])|\u00b1|\u2213")


def _expand_plus_minus(s: str) -> str | None:
    """``1\\pm\\sqrt{2}`` -> ``1+\\sqrt{2},1-\\sqrt{2}``: one plus-minus sign (``\\pm``, ``\\mp``, ``±``, ``∓``)
    in a single answer (no top-level comma) becomes the list of its two values; None otherwise."""
    signs, parts = list(_PLUS_MINUS_RE.finditer(s)), _split_top_level(s)
    if len(signs) != 1 or parts is None or len(parts) > 1:
        return None
    sign = signs[0]
    return f"{s[:sign.start()]}+{s[sign.end():]},{s[:sign.start()]}-{s[sign.end():]}"


def _lone_element(s: str, other: str) -> str:
    """``x`` for a one-element set ``\\{x\\}`` (or ``{x}``) when ``other`` is not a set; else ``s``."""
    seq = _as_sequence(other)
    if seq is not None and seq[0] == "set" or other.startswith("\\{"):
        return s
    inner = s[2:-2] if s.startswith("\\{") and s.endswith("\\}") else None
    if inner is None or _split_top_level(inner) != [inner] or not inner.strip():
        return s
    return inner


def _equivalent(a: str, b: str) -> bool:
    a, b = normalize_answer(a), normalize_answer(b)
    if not a or not b:
        return False
    if a == b:
        return True
    a, b = _expand_plus_minus(a) or a, _expand_plus_minus(b) or b  # one \pm: the list of both values
    a, b = _lone_element(a, b), _lone_element(b, a)  # the set \{1\} and the value 1 name one answer
    if len(a) > MAX_PARSE_CHARS or len(b) > MAX_PARSE_CHARS:
        return False
    if _WORD_RE.fullmatch(a) and _WORD_RE.fullmatch(b):
        # Text answers ("Yes", "True", "Monday"): case-insensitive, never
        # symbolic (as products of symbols "on" would equal "no").
        return a.casefold() == b.casefold()
    fa, fb = _to_fraction(a), _to_fraction(b)
    if fa is not None and fb is not None:
        return fa == fb
    sa, sb = _as_sequence(a), _as_sequence(b)
    if sa is not None or sb is not None:
        unordered = ("set", "")  # a set and a bare list of solutions are the same answer
        if sa is None or sb is None or len(sa[1]) != len(sb[1]) or (
                sa[0] != sb[0] and not (sa[0] in unordered and sb[0] in unordered)):
            return False
        if sa[0] not in ("set", ""):  # tuples and intervals in order; sets and bare lists ("1, 2") in any
            return all(_equivalent(x, y) for x, y in zip(sa[1], sb[1]))
        unmatched = list(sb[1])
        for x in sa[1]:
            hit = next((k for k, y in enumerate(unmatched) if _equivalent(x, y)), None)
            if hit is None:
                return False
            unmatched.pop(hit)
        return True
    verdict = _sympy_equivalent(a, b)
    if verdict is None:  # LaTeX our reader refuses (matrices, unions, \\binom...): Math-Verify reads it
        from jaxrl.rewards.math_library import library_equivalent

        verdict = library_equivalent(a, b)
    return verdict


# A multiple-choice letter leading an answer: "(B)", "(b)", "b)", "B", "B." or "B:" before a space or the
# end, a lone "b", each optionally after "Option"/"Choice"; what follows is its value ("(B) 12").
_CHOICE_RE = re.compile(
    r"(?:(?i:option|choice)[ \t]*:?[ \t]*)?"
    r"(?:\(([A-Ja-j])\)|([A-Ja-j])\)|([A-J])(?:[.:](?=\s|\Z))?(?=\s|\Z)|([a-j])\Z)\s*(.*)",
    re.DOTALL,
)
_BARE_CHOICE_RE = re.compile(r"\(?([A-J])\)?")  # a reference that is only a letter: "B", "(B)"
_OTHER_CHOICE_RE = re.compile(r"\b[A-J]\b|\([a-j]\)|\A[=<>^*/]")  # "(B) or C", "(B) = 5": not one choice


def _choice_text(s: str) -> str:
    """``s`` without ``$``, ``\\text{}`` wrappers and LaTeX spacing, spaces kept: ``\\text{(B)} 12`` -> ``(B) 12``."""
    s = _strip_text_wrappers(_LATEX_SPACING_RE.sub("", s.translate(_UNICODE_MAP).replace("$", "")))
    return s.strip().rstrip(".").strip()


def _leading_choice(s: str) -> tuple[str, str] | None:
    """``(letter, value)`` of an answer that starts with one multiple-choice letter (upper case), else None."""
    m = _CHOICE_RE.fullmatch(s)
    if m is None or _OTHER_CHOICE_RE.search(m.group(5)):
        return None
    return next(g for g in m.groups()[:4] if g).upper(), m.group(5)


def _choice_equivalent(a: str, b: str) -> bool | None:
    """Multiple choice: a bare letter (``B``, ``(B)``) matches an answer that leads with that letter in any
    case (``b``, ``(b)``, ``B) 12``, ``Option B``); two answers leading with letters match if the letters do;
    a letter with a value matches a plain value equal to its value. None (compare as usual) otherwise."""
    a, b = _choice_text(a), _choice_text(b)
    choice_a, choice_b = _leading_choice(a), _leading_choice(b)
    if choice_a is None and choice_b is None:
        return None
    bare = _BARE_CHOICE_RE.fullmatch(a) or _BARE_CHOICE_RE.fullmatch(b)
    if bare is not None or (choice_a is not None and choice_b is not None):
        return choice_a is not None and choice_b is not None and choice_a[0] == choice_b[0]
    _, value = choice_a or choice_b
    return True if value and _equivalent(value, b if choice_a else a) else None


def is_equivalent(answer: str, reference: str) -> bool:
    """Whether ``answer`` and ``reference`` denote the same mathematical value.

    Fast paths: equal normalised strings; two purely alphabetic words of 2+
    letters are text answers compared case-insensitively (``Yes`` == ``yes``,
    and so ``xy`` != ``yx``); then exact rationals (ints, decimals,
    ``1e3``, ``a/b``, ``\\frac{a}{b}``; ``50%`` counts as ``50``), then tuples /
    intervals element-wise (``\\{..\\}`` sets and bare lists such as the solutions
    ``1, 2`` order-insensitively, and alike: ``\\{1, 2\\}`` == ``2, 1``; one ``\\pm`` makes a list:
    ``\\pm 2`` == ``-2, 2``). A multiple-choice letter (``B``, ``(B)``) matches an answer leading with it in
    any case and nothing else (``(b) 12`` yes, ``A or B`` no). Otherwise
    both sides are rewritten from LaTeX to sympy syntax, guarded (length
    <= ``MAX_PARSE_CHARS``, exponent literals of at most ``MAX_EXPONENT_DIGITS``
    digits, power towers at most ``MAX_POWER_HEIGHT`` high, no value, ``exp`` or
    trig argument beyond 10**``MAX_VALUE_DIGITS``, root indices
    2..``MAX_ROOT_INDEX``, functions nested at most ``MAX_FUNCTION_DEPTH`` deep).
    With symbols, both are first evaluated at 3 random points in [1, 2]^n (seeded by the two expressions)
    (exactly for rational functions, else to 50 digits; points where either is
    undefined are skipped): any disagreement gives False, agreement gives True
    for rational functions and for degrees above 16, and otherwise must be
    confirmed by ``simplify(a - b) == 0``, or, for the real domain, by ``simplify`` with positive symbols and
    agreement at points with negative coordinates where every subexpression of both is real. Without symbols,
    two values must agree to 50 digits (so an integer never matches a closed form that is not that integer:
    ``10000009000`` != ``10^{10}+\\pi``, ``485165000`` != ``e^{20}``), or at the precision a decimal states:
    a decimal (answer or reference) with at least ``MIN_STATED_PLACES`` places within one unit of its last
    place of an irrational value (``1.414214`` == ``\\sqrt{2}``; ``3.14`` != ``\\pi`` either way round, as
    Math-Verify rounds to 6 places). Rationals compare exactly (``0.333333`` != ``\\frac13``). ``simplify(a - b) == 0`` decides only where the values cannot be evaluated.
    LaTeX our reader refuses (matrices, unions of intervals, ``\\binom``...) is read by Math-Verify
    (``jaxrl.rewards.math_library``) and compared by the same rules, element by element.
    Anything that fails, raises or is undefined (``1/0``, nan) gives False.
    """
    try:
        if isinstance(reference, (int, float, Fraction)) and not isinstance(reference, bool):
            reference = str(reference)
        if not isinstance(answer, str) or not isinstance(reference, str):
            return False
        choice = _choice_equivalent(answer, reference)
        return _equivalent(answer, reference) if choice is None else choice
    except Exception:  # noqa: BLE001 - graders must never crash training
        return False


@register("reward", "math", binary=True, answers=True)
def math_verify(completion: str, reference: str, *, timeout: float | None = None) -> float:
    """1.0 if the extracted final answer is equivalent to ``reference``, else 0.0.

    Never raises. ``timeout`` (seconds) bounds the call's wall time: past it the answer scores 0.0 (see
    ``jaxrl.rewards.timeout``); in a ``RewardPool`` leave it None, the pool kills stuck workers itself.
    """
    if timeout is not None:
        from jaxrl.rewards.timeout import call_with_timeout

        return call_with_timeout(_math_verify, (completion, reference), timeout, default=0.0)
    return _math_verify(completion, reference)


def _math_verify(completion: str, reference: str) -> float:
    try:
        answer = extract_answer(completion)
        return 1.0 if answer is not None and is_equivalent(answer, reference) else 0.0
    except Exception:  # noqa: BLE001
        return 0.0


@register("reward", "arithmetic", binary=True, answers=True)
def arithmetic_reward(completion: str, reference: str) -> float:
    """Default task reward: 1.0 iff the answer after the last ``####`` is correct.

    Only the ``####`` format counts (no fallbacks: the model must follow the
    format). Never raises.
    """
    try:
        if not isinstance(completion, str):
            return 0.0
        answer = _clean(_after_hashes(completion))
        return 1.0 if answer is not None and is_equivalent(answer, reference) else 0.0
    except Exception:  # noqa: BLE001
        return 0.0


def _warm_up_sympy() -> None:
    """Load and run the symbolic checker once: sympy's import and parser take 0.2-0.7 s in a fresh process on
    a 2-core CPU (longer where sympy's bytecode is not cached). `RewardPool` workers call this before they
    report ready (the `warm_up` attributes below), so the cost never falls inside an item's timeout."""
    if not is_equivalent("x + 1", "1 + x"):
        raise RuntimeError("the symbolic answer checker failed its warm-up comparison (x + 1 == 1 + x)")


def warm_up() -> None:
    """`_warm_up_sympy`, then Math-Verify's reader (latex2sympy2 + ANTLR: another ~0.4 s to import and build
    its parser), which `math_verify` hands the LaTeX our own reader refuses (matrices, unions, binomials)."""
    _warm_up_sympy()
    try:
        import math_verify as _  # noqa: F401
    except ImportError as e:
        raise RuntimeError("math-verify is not installed (pip install 'math-verify>=0.9,<0.10'); jaxrl reads "
                           "matrices, unions of intervals and binomials with it") from e
    if not is_equivalent(r"\begin{pmatrix}\frac12\end{pmatrix}", r"\begin{bmatrix}0.5\end{bmatrix}"):
        raise RuntimeError("the Math-Verify answer reader failed its warm-up comparison (pmatrix 1/2 == bmatrix 0.5)")


math_verify.warm_up = warm_up
# Arithmetic answers are numbers: Math-Verify's reader is loaded only if a completion ever needs it.
arithmetic_reward.warm_up = _warm_up_sympy
