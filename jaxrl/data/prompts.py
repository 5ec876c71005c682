"""Prompt sets from local files: JSONL or Parquet rows -> `PromptRecord(prompt, reference, source, row, messages,
solution)`.

Which fields hold the prompt and the reference, the prompt template, and how the reference is extracted
are described by `PromptFields`. The template may use any field of the row (`"{question}\\n\\nChoices:
{choices}"`); `{prompt}` is the text of the prompt field. A string is inserted as it is, a number, list or
object as JSON; a field the template names that a row lacks (or holds null) makes that row bad. Presets for
common layouts:

- GSM8K: `PromptFields("question", "answer", reference_pattern=r"#### (.+)$")`
- MATH: `PromptFields("problem", "solution", reference_from="boxed")` (`jaxrl.rewards.math.extract_answer`:
  the last `\\boxed{...}`, falling back to `####`, "the answer is", then the last number)
- code contests: `PromptFields("prompt", "tests")`; a list/dict reference (whatever its field name) holds the
  tests `jaxrl.rewards.sandbox.code_reward` runs and becomes `json.dumps({"tests": [...]})`: a non-empty list
  whose items are `{"input": str, "output": str}` or `{"assert": str}`, or the APPS form `{"input": [str, ...],
  "output": [str, ...]}` (equal lengths; paired up into that list). Any other shape is a bad row: the reward
  would score it 0 forever. A number becomes `json.dumps(value)` (e.g. `"42"`).

Chat rows (`format="messages"`, OpenAI style): `{"messages": [{"role": "system" | "user" | "assistant", "content":
str}, ...], ...}`. When the last message is the assistant's, it is the answer: the demonstration (`solution`) and,
unless the row's reference field holds a value (not null), the reference (then `reference_pattern` /
`reference_from` apply to it); the messages before it are the prompt conversation. Otherwise the whole
conversation is the prompt (earlier assistant turns are history, not answers). The prompt conversation must end
with a user turn.
A system message may only come first. A chat record's `prompt` is its last user message; `record.messages`
is what the model sees, through the chat template (`jaxrl.data.render.render_prompt`).

Demonstrations for a supervised warm start: `solution` is the `solution` field's string (None when the row
lacks it or it is null), or a chat row's final assistant message.

Text (prompt, reference, test strings) must be valid Unicode: a lone surrogate (JSON `"\\ud83d"` without its
pair) is a bad row, since no tokenizer or program can take it.

A row nested deeper than 64 levels, or holding an integer of more than 4300 digits (Python's limit), is a bad
row too. Bad rows raise `ValueError("<file>:<line>: <reason>")` (`<file>:row <i>` for Parquet, 0-based), or with
`skip_bad_rows=True` are skipped, counted and the first few logged.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import re
import string
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import grain

from jaxrl.data.batching import shuffled_batches
from jaxrl.rewards.math import extract_answer
from jaxrl.models.safe_read import check_regular, json_depth, open_regular
from jaxrl.errors import JaxrlError

__all__ = ["DataError", "PromptFields", "PromptRecord", "ROLES", "SUPPORTED_SUFFIXES", "load_prompts", "prompt_batches",
           "template_fields"]

logger = logging.getLogger(__name__)

SUPPORTED_SUFFIXES = (".jsonl", ".parquet")
_MAX_LOGGED_BAD_ROWS = 5
_MAX_ROW_DEPTH = 64  # JSON nesting of a row (code tests nest 3 levels)


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt of a data file. Equality and hashing use `prompt`, `reference`, `source` and `solution`
    (`messages` is compared, not hashed; `row` neither: `source` names the row)."""

    prompt: str  # templated prompt text, ready for the tokenizer (a chat record: its last user message)
    reference: str  # what the reward function compares against
    source: str  # "file:line" (JSONL, 1-based) or "file:row N" (Parquet, 0-based)
    row: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)  # the row as read
    # A chat record's conversation up to the model's turn: `{"role", "content"}` dicts; None for a prompt row.
    messages: tuple[dict[str, str], ...] | None = dataclasses.field(default=None, hash=False)
    solution: str | None = None  # the demonstration of a supervised warm start, or None


ROLES = ("system", "user", "assistant")


@functools.lru_cache(maxsize=64)  # parsed once per template, not once per row
def template_fields(template: str) -> tuple[str, ...]:
    """The row fields `template` names, in order of first use; ValueError for a template that is not plain
    `str.format` fields (`{name}`, no positional fields, attribute or index access, conversions or formats)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:  # unbalanced braces
        raise ValueError(f"invalid prompt template {template!r}: {e}") from None
    names: list[str] = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise ValueError(f"invalid prompt template {template!r}: {{{name}{'!' + conversion if conversion else ''}"
                             f"{':' + spec if spec else ''}}} is not a plain field; write {{field_name}} (a row "
                             f"field, or {{prompt}} for the prompt field), and {{{{ }}}} for a literal brace")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"invalid prompt template {template!r}: it names no field; write e.g. '{{prompt}}'")
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class PromptFields:
    """Where a row keeps its prompt and reference, and how to turn them into a `PromptRecord`."""

    prompt: str = "question"  # row field holding the prompt text (must be a string)
    reference: str = "answer"  # row field holding the reference (string, number, list or dict)
    template: str = "{prompt}"  # str.format template over the row's fields; {prompt} is the prompt field
    reference_pattern: str | None = None  # regex searched in the reference; group 1 is the reference
    reference_from: Literal["field", "boxed"] = "field"  # "boxed": extract_answer() of the field
    format: Literal["prompt", "messages"] = "prompt"  # messages: OpenAI-style chat rows
    messages: str = "messages"  # row field holding a chat row's messages
    solution: str | None = None  # row field holding a worked solution (format "prompt"); None: none

    def __post_init__(self) -> None:
        template_fields(self.template)
        if self.format not in ("prompt", "messages"):
            raise ValueError(f"format must be 'prompt' or 'messages', got {self.format!r}")
        if self.format == "messages" and self.template != "{prompt}":
            raise ValueError(f"template {self.template!r} applies to format 'prompt' rows; with format 'messages' "
                             "the chat template renders each row's conversation as it is")
        if self.format == "messages" and self.solution is not None:
            raise ValueError(f"solution field {self.solution!r} applies to format 'prompt' rows; with format "
                             "'messages' a row's demonstration is its last assistant message")
        if self.reference_from not in ("field", "boxed"):
            raise ValueError(f"reference_from must be 'field' or 'boxed', got {self.reference_from!r}")
        if self.reference_pattern is not None:
            if self.reference_from != "field":
                raise ValueError("reference_pattern needs reference_from='field'")
            try:
                groups = re.compile(self.reference_pattern).groups
            except re.error as e:
                raise ValueError(f"invalid reference_pattern {self.reference_pattern!r}: {e}") from None
            if groups < 1:
                raise ValueError(f"reference_pattern {self.reference_pattern!r} needs a capture group")


class DataError(JaxrlError, ValueError):
    """A prompt file that cannot be used as configured; the message names the file, line and field."""

    kind = "data error"


class _BadRow(ValueError):
    """A row that cannot become a PromptRecord; the message is the reason, without the location."""


def _check_text(text: str, what: str) -> str:
    """`text`, or _BadRow naming `what` and the position of a lone surrogate (JSON allows `"\\ud83d"` alone;
    it is no Unicode text, and tokenizers and programs fail on it far from the row)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _BadRow(f"{what} has a lone surrogate {text[e.start]!r} at character {e.start} "
                      f"(invalid Unicode)") from None
    return text


def _code_tests(raw: list | dict, name: str) -> list[dict[str, str]]:
    """The tests `code_reward` runs (`jaxrl.rewards.sandbox`: `{"input", "output"}` or `{"assert"}` items), from
    a list of them or the APPS form `{"input": [...], "output": [...]}`; _BadRow for any other shape, which the
    reward would silently score 0."""
    if isinstance(raw, dict):
        if set(raw) != {"input", "output"} or not all(isinstance(raw[k], list) for k in ("input", "output")):
            raise _BadRow(f"field {name!r}: an object must be {{\"input\": [...], \"output\": [...]}} (lists of "
                          f"strings), got keys {', '.join(sorted(map(str, raw)))}")
        if len(raw["input"]) != len(raw["output"]):
            raise _BadRow(f"field {name!r}: 'input' has {len(raw['input'])} items but 'output' has "
                          f"{len(raw['output'])}")
        raw = [{"input": i, "output": o} for i, o in zip(raw["input"], raw["output"])]
    if not raw:
        raise _BadRow(f"field {name!r} has no tests")
    tests = []
    for n, test in enumerate(raw):
        if isinstance(test, dict) and isinstance(test.get("assert"), str):
            tests.append({"assert": _check_text(test["assert"], f"field {name!r} test {n} 'assert'")})
        elif isinstance(test, dict) and isinstance(test.get("input"), str) and isinstance(test.get("output"), str):
            tests.append({k: _check_text(test[k], f"field {name!r} test {n} {k!r}") for k in ("input", "output")})
        else:
            raise _BadRow(f"field {name!r} test {n} must have string 'input' and 'output' or a string 'assert', "
                          f"got {repr(test)[:80]}")
    return tests


def _field_value(row: dict, name: str, what: str = "field") -> Any:
    """`row[name]`, or _BadRow when it is missing or null."""
    if name not in row:
        raise _BadRow(f"{what} {name!r} missing (row keys: {', '.join(sorted(map(str, row)))})")
    if row[name] is None:
        raise _BadRow(f"{what} {name!r} is null")
    return row[name]


def _prompt_text(row: dict, fields: PromptFields) -> str:
    """The prompt field's text: a non-empty string of valid Unicode."""
    prompt = _field_value(row, fields.prompt)
    if not isinstance(prompt, str):
        raise _BadRow(f"field {fields.prompt!r} must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise _BadRow(f"field {fields.prompt!r} is empty")
    return _check_text(prompt, f"field {fields.prompt!r}")


def _template_text(value: Any, name: str) -> str:
    """A template field's value as text: a string as it is, a number, list or object as JSON."""
    if isinstance(value, str):
        return _check_text(value, f"template field {name!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise _BadRow(f"template field {name!r} is {value!r}, not a finite number")
    text = json.dumps(value, ensure_ascii=False)
    return _check_text(text, f"template field {name!r}")


def _templated_prompt(row: dict, fields: PromptFields) -> str:
    """`fields.template` filled from `row` (`{prompt}`: the prompt field's text)."""
    values = {}
    for name in template_fields(fields.template):
        values[name] = (_prompt_text(row, fields) if name == "prompt"
                        else _template_text(_field_value(row, name, "template field"), name))
    text = fields.template.format(**values)
    if not text.strip():
        raise _BadRow(f"the prompt template {fields.template!r} gives an empty prompt")
    return text


def _reference(raw: Any, fields: PromptFields, field: str | None) -> str:
    """The reference from the value `raw` of row field `field` (None: a chat row's last assistant message)."""
    name = f"field {field!r}" if field is not None else "the last assistant message"
    if isinstance(raw, str):
        reference = _check_text(raw, name)
        if fields.reference_pattern is not None:
            match = re.search(fields.reference_pattern, raw)
            if match is None:
                raise _BadRow(f"{name} does not match reference_pattern {fields.reference_pattern!r}")
            reference = match.group(1) or ""
        elif fields.reference_from == "boxed":
            reference = extract_answer(raw)
            if reference is None:
                raise _BadRow(f"no answer found in {name}")
        reference = reference.strip()
        if not reference:
            raise _BadRow(f"{name} gives an empty reference")
        return reference
    if fields.reference_pattern is not None or fields.reference_from != "field":
        raise _BadRow(f"{name} must be a string to extract the reference from, got {type(raw).__name__}")
    if isinstance(raw, (list, dict)):
        return json.dumps({"tests": _code_tests(raw, str(field))})
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        if isinstance(raw, float) and not math.isfinite(raw):  # JSON's NaN / Infinity: no answer can equal it
            raise _BadRow(f"{name} is {raw!r}, not a finite number")
        return json.dumps(raw)
    raise _BadRow(f"{name} has unsupported type {type(raw).__name__}")


def _conversation(row: dict, fields: PromptFields) -> tuple[tuple[dict[str, str], ...], str | None]:
    """`(prompt conversation, answer or None)` of a chat row: the messages before a final assistant message (the
    answer), else all of them; the prompt conversation must end with a user turn."""
    name = fields.messages
    raw = _field_value(row, name)
    if not isinstance(raw, list):
        raise _BadRow(f"field {name!r} must be a list of messages, got {type(raw).__name__}")
    if not raw:
        raise _BadRow(f"field {name!r} is an empty conversation")
    messages = []
    for n, message in enumerate(raw):
        where = f"field {name!r} message {n}"
        if not isinstance(message, dict):
            raise _BadRow(f"{where} must be an object with 'role' and 'content', got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise _BadRow(f"{where} has role {role!r}, not one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise _BadRow(f"{where} ({role}) content must be a string, got {type(content).__name__}")
        if role != "system" and not content.strip():
            raise _BadRow(f"{where} ({role}) has empty content")
        if role == "system" and n:
            raise _BadRow(f"{where} is a system message after the first message")
        messages.append({"role": role, "content": _check_text(content, f"{where} ({role}) content")})
    # Only a final assistant message is an answer: after [user, assistant, user] the model answers the last turn.
    last = len(messages) - 1 if messages[-1]["role"] == "assistant" else None
    prompt = messages if last is None else messages[:last]
    if not prompt or prompt[-1]["role"] != "user":
        ends = "nothing" if not prompt else f"message {len(prompt) - 1} ({prompt[-1]['role']})"
        if last is None:
            raise _BadRow(f"field {name!r}: the conversation must end with a user message, not {ends}")
        raise _BadRow(f"field {name!r}: the last assistant message (message {last}) must follow a user message, "
                      f"not {ends}")
    return tuple(prompt), None if last is None else messages[last]["content"]


def _to_record(row: Any, fields: PromptFields, source: str) -> PromptRecord:
    """One parsed row -> PromptRecord, or raise _BadRow with the reason."""
    if not isinstance(row, dict):
        raise _BadRow(f"expected a JSON object, got {type(row).__name__}")
    if fields.format == "messages":
        conversation, answer = _conversation(row, fields)
        if row.get(fields.reference) is not None or answer is None:  # null: absent (a Parquet column's gap)
            reference = _reference(_field_value(row, fields.reference), fields, fields.reference)
        else:
            reference = _reference(answer, fields, None)
        return PromptRecord(conversation[-1]["content"], reference, source, row, conversation, answer)
    prompt = _templated_prompt(row, fields)
    reference = _reference(_field_value(row, fields.reference), fields, fields.reference)
    solution = None
    if fields.solution is not None and row.get(fields.solution) is not None:
        solution = row[fields.solution]
        if not isinstance(solution, str):
            raise _BadRow(f"field {fields.solution!r} (the solution) must be a string, got {type(solution).__name__}")
        if not solution.strip():
            raise _BadRow(f"field {fields.solution!r} (the solution) is empty")
        _check_text(solution, f"field {fields.solution!r}")
    return PromptRecord(prompt, reference, source, row, None, solution)


def _parse_row(text: str) -> Any:
    """One JSONL line -> its value, or a _BadRow for invalid JSON, nesting deeper than `_MAX_ROW_DEPTH` (before
    parsing: Python's parser recurses per level) or an integer beyond Python's 4300-digit limit."""
    depth = json_depth(text)
    if depth > _MAX_ROW_DEPTH:
        return _BadRow(f"JSON nested {depth} levels deep, more than the limit of {_MAX_ROW_DEPTH}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return _BadRow(f"invalid JSON ({e.msg} at column {e.colno})")
    except (ValueError, RecursionError) as e:  # "Exceeds the limit (4300 digits) for integer string conversion"
        return _BadRow(f"invalid JSON ({str(e).split(';')[0]})")


def _jsonl_rows(path: str) -> Iterator[tuple[str, Any]]:
    """Yields `(location, parsed row or _BadRow)` per non-blank line; location is `path:line` (1-based)."""
    with open_regular(path, DataError) as f:
        for line_no, raw in enumerate(f, start=1):
            location = f"{path}:{line_no}"
            try:
                text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a byte-order mark opens some files
            except UnicodeDecodeError as e:
                yield location, _BadRow(f"invalid UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not text.strip():
                continue
            yield location, _parse_row(text)


def _parquet_rows(path: str) -> Iterator[tuple[str, Any]]:
    """Yields `(location, row dict)` per Parquet row; location is `path:row N` (0-based)."""
    import pyarrow.parquet as pq  # lazy: only Parquet users need pyarrow

    index = 0
    try:
        with open_regular(path, DataError) as f:
            for batch in pq.ParquetFile(f).iter_batches():
                for row in batch.to_pylist():
                    yield f"{path}:row {index}", row
                    index += 1
    except DataError:
        raise
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise DataError(f"{path}: not a readable Parquet file (after {index} rows): {e}") from None


def load_prompts(
    path: str | os.PathLike, fields: PromptFields = PromptFields(), *, skip_bad_rows: bool = False
) -> tuple[list[PromptRecord], int]:
    """Load `(records, num_skipped)` from a `.jsonl` or `.parquet` file.

    Raises FileNotFoundError for a missing file, `DataError` (a ValueError) for anything but a regular file (a
    FIFO would block the read forever), an unsupported suffix, the first bad row (unless `skip_bad_rows`), and
    when no rows load.
    """
    path = os.fspath(path)
    try:
        check_regular(path, DataError)
    except FileNotFoundError:
        raise FileNotFoundError(f"prompt file not found: {path}") from None
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif suffix == ".parquet":
        rows = _parquet_rows(path)
    else:
        raise DataError(f"unsupported prompt file {path!r}: suffix {suffix!r} is not one of "
                         f"{', '.join(SUPPORTED_SUFFIXES)}")
    records: list[PromptRecord] = []
    skipped = 0
    for location, row in rows:
        try:
            if isinstance(row, _BadRow):
                raise row
            records.append(_to_record(row, fields, location))
        except _BadRow as e:
            if not skip_bad_rows:
                raise DataError(f"{location}: {e}") from None
            if skipped < _MAX_LOGGED_BAD_ROWS:
                logger.warning("skipping bad prompt row %s: %s", location, e)
            skipped += 1
    if skipped:
        logger.warning("skipped %d bad rows of %d in %s", skipped, skipped + len(records), path)
    if not records:
        raise DataError(f"no prompts loaded from {path} ({skipped} bad rows skipped)")
    return records, skipped


def prompt_batches(records: Sequence[PromptRecord], batch_size: int, seed: int,
                   shard: tuple[int, int] = (0, 1)) -> grain.DatasetIterator:
    """Endless shuffled batches (lists of `PromptRecord`) as a checkpointable grain iterator; `shard = (index,
    count)` is this host's share of a multi-host run's global batch (`jaxrl.data.batching.shuffled_batches`)."""
    return shuffled_batches(records, batch_size, seed, shard)
