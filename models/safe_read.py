"""Reading files from directories we do not control (HF checkpoints, tokenizers, prompt sets): with limits.

A downloaded directory may hold a FIFO, a device or a socket under an expected name (reading it hangs or
never ends), a file far larger than its kind ever is, or JSON nested deep enough to exhaust Python's
stack. These helpers refuse each with a `ValueError` of the caller's class whose one-line message names the
file (and line), before anything blocks:

- `open_regular(path)`: `os.stat` the path (symlinks followed, as HF's cache uses them) and refuse anything
  that is not a regular file *before* opening it (opening a device can have side effects); then open with
  `O_NONBLOCK` (a FIFO swapped in meanwhile cannot block the open) and check the descriptor with `fstat`.
- `read_regular(path, max_bytes)`: its bytes, at most `max_bytes`.
- `loads_json(text, where, max_depth)`: `json.loads` with nesting bounded by a bracket count before parsing,
  and every parse failure (syntax, Python's 4300-digit int limit, recursion) as one line with the line number.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import sys
from itertools import accumulate
from typing import Any

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "check_regular", "json_depth", "loads_json", "open_regular",
           "read_json_file", "read_regular"]

MAX_JSON_BYTES = 64 * 2**20  # config.json, index, tokenizer_config.json, ...: kilobytes in practice
MAX_JSON_DEPTH = 64  # HF files nest a few levels; serde_json (the tokenizers library) stops at 128

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
# A JSON string (its brackets are not structure). An unterminated one runs to the end of the text: a match that
# could fail after its opening quote would be retried from every later quote (quadratic on '"\\"\\"\\"...').
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DELTA = {"[": 1, "{": 1, "]": -1, "}": -1}


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), f"a file of mode {mode:#o}")


def check_regular(path: str | os.PathLike, error: type[Exception] = ValueError) -> os.stat_result:
    """`os.stat(path)` of a regular file (symlinks followed); `error` naming the path for anything else.
    `FileNotFoundError` passes through."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{os.fspath(path)}: not a regular file but {_kind(st.st_mode)}")
    return st


def open_regular(path: str | os.PathLike, error: type[Exception] = ValueError) -> io.BufferedReader:
    """The regular file at `path` opened for binary reading; `error` for a FIFO, device, socket or directory,
    checked before opening and again on the open descriptor (no race with a file swapped in between)."""
    check_regular(path, error)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{os.fspath(path)}: not a regular file but {_kind(mode)}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, max_bytes: int, error: type[Exception] = ValueError) -> bytes:
    """The bytes of the regular file at `path` (`open_regular`), `error` when it holds more than `max_bytes`."""
    with open_regular(path, error) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{os.fspath(path)}: larger than {max_bytes:,} bytes (the limit for this file)")
    return data


def json_depth(text: str) -> int:
    """Nesting depth of JSON `text` (0 for a scalar), counted on its brackets outside strings: linear time, no
    recursion. Meaningful for valid JSON; for invalid JSON, only an estimate (the parser then says what is
    wrong)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_DELTA.__getitem__, brackets)), default=0)


def _line(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def loads_json(text: str | bytes, where: str, *, max_depth: int = MAX_JSON_DEPTH,
               error: type[Exception] = ValueError) -> Any:
    """`json.loads(text)`, or `error` with a one-line message starting with `where` (and `:line` where the
    parser knows it) for invalid UTF-8 or JSON, nesting deeper than `max_depth`, or an integer beyond Python's
    digit limit."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            line = text.count(b"\n", 0, e.start) + 1
            raise error(f"{where}:{line}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise error(f"{where}: JSON nested {depth} levels deep, more than the limit of {max_depth}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:  # not reached after the depth check; kept so that no traceback can escape
        raise error(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion: ..." names no line
        long = re.search(rf"\d{{{max(sys.get_int_max_str_digits(), 1) + 1},}}", text)
        line = f":{_line(text, long.start())}" if long else ""
        raise error(f"{where}{line}: invalid JSON: {str(e).split(';')[0]}") from None


def read_json_file(path: str | os.PathLike, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH,
                   error: type[Exception] = ValueError) -> Any:
    """The parsed JSON of the regular file at `path`, with `read_regular`'s and `loads_json`'s limits."""
    path = os.fspath(path)
    try:
        data = read_regular(path, max_bytes, error)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    return loads_json(data, path, max_depth=max_depth, error=error)
