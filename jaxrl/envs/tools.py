"""Built-in tools (registry kind `tool`): `calculator`, `python`, `retrieval`.

A tool is `(arguments: dict, context: ToolContext) -> str`: its result as the model will read it. A failure the
model should read is a `ToolError` (a `ToolTimeout` when cut off at a time limit): the environment turns it into
`error: <message>` and counts it. Each tool has a `schema` attribute (JSON schema of its arguments, for a chat
template's `tools=`).

Everything a tool gets comes from the model's text: every input is bounded before work starts.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import os
import re
from collections.abc import Callable

from jaxrl import registry
from jaxrl.envs.base import ToolContext, ToolError, ToolTimeout, clean_text

__all__ = ["calculator", "python", "retrieval", "tool_schema", "load_corpus", "MAX_RESULT_CHARS"]

MAX_RESULT_CHARS = 4000  # a tool's result is cut to this many characters, with a note
MAX_EXPRESSION_CHARS = 500
MAX_INT_DIGITS = 100  # a calculator operand or result of more digits is an error
MAX_EXPONENT = 1000


def _schema(name: str, description: str, argument: str, about: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {argument: {"type": "string", "description": about}},
                       "required": [argument]}}}


def _argument(arguments: dict, name: str, limit: int) -> str:
    value = arguments.get(name) if isinstance(arguments, dict) else None
    if not isinstance(value, str):
        raise ToolError(f'expected the argument {{"{name}": "<string>"}}, got {json.dumps(arguments)[:100]}')
    extra = sorted(set(arguments) - {name})
    if extra:
        raise ToolError(f"unexpected arguments {extra}; the tool takes {name!r} only")
    if len(value) > limit:
        raise ToolError(f"{name} is {len(value)} characters long; at most {limit}")
    return value


def cut(text: str, limit: int = MAX_RESULT_CHARS) -> str:
    """`text` cleaned of unencodable characters and cut to `limit` characters with a note of how much went."""
    text = clean_text(text)
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[output cut: {len(text) - limit} more characters]"


# -- calculator ---------------------------------------------------------------------------------------------

_BINARY: dict[type, Callable] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                 ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
                                 ast.Pow: operator.pow}
_UNARY: dict[type, Callable] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _check_size(value):
    if isinstance(value, int) and abs(value) >= 10**MAX_INT_DIGITS:
        raise ToolError(f"number too large (more than {MAX_INT_DIGITS} digits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not finite")
    return value


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check_size(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise ToolError(f"exponent {right} too large (at most {MAX_EXPONENT})")
            if isinstance(left, int) and isinstance(right, int) and right >= 0 and left not in (-1, 0, 1) \
                    and right * math.log10(abs(left)) >= MAX_INT_DIGITS:
                raise ToolError(f"number too large (more than {MAX_INT_DIGITS} digits)")
            if left == 0 and right < 0:
                raise ToolError("division by zero")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("number too large") from None
        if isinstance(value, complex):
            raise ToolError("complex result")
        return _check_size(value)
    raise ToolError(f"unsupported expression: {type(node).__name__} (numbers, + - * / // % **, parentheses only)")


def format_number(value) -> str:
    """An exact integer as its digits ("62"); a float short ("0.333333333333"), integral floats as integers."""
    if isinstance(value, int):
        return str(value)
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}"


@registry.register("tool", "calculator")
def calculator(arguments: dict, context: ToolContext) -> str:
    """`{"expression": "12*(3+4)"}` -> "84": numbers, + - * / // % **, unary minus, parentheses; bounded
    (expression length, operand and result digits, exponents)."""
    expression = _argument(arguments, "expression", MAX_EXPRESSION_CHARS)
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        raise ToolError(f"cannot parse {expression[:80]!r}") from None
    except (RecursionError, MemoryError):
        raise ToolError("expression nested too deeply") from None
    try:
        return format_number(_evaluate(tree))
    except RecursionError:
        raise ToolError("expression nested too deeply") from None


calculator.schema = _schema("calculator", "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** "
                            "and parentheses.", "expression", "e.g. 12*(3+4)")


# -- python -------------------------------------------------------------------------------------------------

MAX_CODE_CHARS = 8000
MAX_CELLS = 16  # earlier cells kept per episode (older ones are dropped)
PYTHON_CALL_S = 5.0  # one python call's wall time at most (less when the episode's tool time runs out first)
_MARK = "\x00__jaxrl_cell_output__\x00"

# Runs the episode's earlier cells with their output discarded, then the new one; the value of a final
# expression is printed (as a notebook would). Cells are passed as a JSON literal: no code is formatted in.
_CELL_RUNNER = r'''
import ast, json, sys, traceback
_cells = json.loads(%s)
_g = {"__name__": "__main__"}
class _Null:
    def write(self, s): return len(s)
    def flush(self): pass
_out, _err = sys.stdout, sys.stderr
sys.stdout = sys.stderr = _Null()
for _c in _cells[:-1]:
    try:
        exec(compile(_c, "<cell>", "exec"), _g)
    except BaseException:
        pass
sys.stdout, sys.stderr = _out, _err
sys.stdout.write(%r); sys.stdout.flush()
_code = _cells[-1]
try:
    _tree = ast.parse(_code, "<cell>")
    _last = _tree.body.pop() if _tree.body and isinstance(_tree.body[-1], ast.Expr) else None
    exec(compile(_tree, "<cell>", "exec"), _g)
    if _last is not None:
        _v = eval(compile(ast.Expression(_last.value), "<cell>", "eval"), _g)
        if _v is not None:
            print(repr(_v))
except SystemExit:
    pass
except BaseException as _e:
    _tb = [f for f in traceback.extract_tb(_e.__traceback__) if f.filename == "<cell>"]
    sys.stdout.flush()
    print("Traceback (most recent call last):", file=sys.stderr)
    print("".join(traceback.format_list(_tb)), end="", file=sys.stderr)
    print("".join(traceback.format_exception_only(type(_e), _e)), end="", file=sys.stderr)
'''


@registry.register("tool", "python")
def python(arguments: dict, context: ToolContext) -> str:
    """`{"code": "print(2+3)"}` -> "5": runs the cell in the code sandbox (`jaxrl.rewards.sandbox`), after the
    episode's earlier cells (re-run with their output discarded), so names defined earlier are defined; a
    final expression's value is printed. Output (stdout, then stderr, trailing newlines dropped) is cut to
    `MAX_RESULT_CHARS` with a note; the sandbox's wall-time limit is a `ToolTimeout`."""
    from jaxrl.rewards.sandbox import SandboxLimits, run_program

    code = _argument(arguments, "code", MAX_CODE_CHARS)
    cells = list(context.state.get("cells", []))[-(MAX_CELLS - 1):] + [code]
    wall = min(PYTHON_CALL_S, context.time_left())
    if wall <= 0.05:
        raise ToolTimeout("no tool time left in this episode")
    limits = SandboxLimits(wall_time_s=wall, cpu_time_s=max(wall, 0.1),
                           max_output_bytes=4 * MAX_RESULT_CHARS + len(_MARK) + 1024)
    status, stdout, stderr = run_program(_CELL_RUNNER % (repr(json.dumps(cells)), _MARK), "", limits)
    context.state["cells"] = cells  # the cell ran (even if it raised): later cells see what it defined
    _, marked, stdout = stdout.partition(_MARK)
    if not marked:  # an earlier cell wrote past the sink (os.write) or killed the run before the new cell
        stdout = ""
    text = (stdout + stderr).rstrip("\n")  # "42", not "42\n": the observation formats add their own newlines
    if status == "timeout":
        raise ToolTimeout(f"the code ran longer than {wall:.1f} s" + (f"; output so far:\n{cut(text, 500)}"
                                                                        if text else ""))
    if status == "output_limit":
        return cut(text) + "\n[output limit reached: the program was stopped]"
    if status in ("memory", "file_limit", "sandbox_error"):
        raise ToolError(f"{status.replace('_', ' ')}" + (f":\n{cut(text, 500)}" if text else ""))
    return cut(text) if text else "(no output)"


python.schema = _schema("python", "Run Python code; variables persist across calls. Print what you need, or end "
                        "with an expression to see its value.", "code", "Python source")


# -- retrieval ----------------------------------------------------------------------------------------------

TOP_K = 2
MAX_QUERY_CHARS = 1000
_WORD = re.compile(r"\w+")
_CORPORA: dict[tuple[str, float], list[str]] = {}  # (path, mtime) -> passages, per worker


def load_corpus(path: str) -> list[str]:
    """The passages of a retrieval file: each JSONL row's "text" (a `.jsonl` file), or the blocks of a text file
    split at blank lines. Cached per process (by path and modification time). ToolError for a missing or bad
    file."""
    try:
        key = (path, os.path.getmtime(path))
    except OSError:
        raise ToolError(f"retrieval file {path!r} not found (env.retrieval_file)") from None
    if key not in _CORPORA:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if path.endswith((".jsonl", ".json")):
            passages = []
            for i, line in enumerate(text.splitlines()):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        raise ToolError(f"retrieval file {path!r} line {i + 1} is not JSON") from None
                    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                        raise ToolError(f"retrieval file {path!r} line {i + 1} has no \"text\" string")
                    passages.append(row["text"])
        else:
            passages = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
        _CORPORA[key] = passages
    return _CORPORA[key]


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def search(passages: list[str], query: str, k: int = TOP_K) -> list[str]:
    """The `k` passages sharing the most distinct words with `query` (ties: the earlier passage), none with 0."""
    words = _words(query)
    scored = sorted(((-len(words & _words(p)), i) for i, p in enumerate(passages)))
    return [passages[i] for score, i in scored[:k] if score < 0]


@registry.register("tool", "retrieval")
def retrieval(arguments: dict, context: ToolContext) -> str:
    """`{"query": "..."}` -> the top-2 passages of `env.retrieval_file` by word overlap, one per paragraph
    ("no match" when none shares a word)."""
    query = _argument(arguments, "query", MAX_QUERY_CHARS)
    path = getattr(context.config, "retrieval_file", None)
    if path is None:
        raise ToolError("no retrieval file (env.retrieval_file)")
    found = search(load_corpus(path), query)
    return cut("\n\n".join(found)) if found else "no match"


retrieval.schema = _schema("retrieval", "Search the reference passages for words of the query.", "query",
                           "words to look for")


def tool_schema(name: str, fn: Callable) -> dict:
    """A tool's JSON schema: its `schema` attribute, or a generic one (any JSON object of arguments)."""
    schema = getattr(fn, "schema", None)
    if isinstance(schema, dict):
        return schema
    return {"type": "function", "function": {"name": name, "description": (fn.__doc__ or name).strip()[:200],
                                             "parameters": {"type": "object"}}}
