"""Tool calls in model text: the two formats a policy writes them in, parsed and written back.

- `hermes`: `<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>`, the format of
  the Hermes / Qwen chat templates. A turn may hold several calls; the sampler stops the turn at the closing
  tag (`stop_strings`). Results come back as `<tool_response>...</tool_response>` (plain text) or through the
  chat template's tool role.
- `fenced`: a fenced code block for base models, ToRA-style: the model writes "```python\\n<code>\\n```\\n"
  and then "```output" to ask for the result, which is the turn's stop string; the result comes back as
  "\\n<output>\\n```\\n". The code goes to the `python` tool.

Parsing never trusts the text: a malformed call is a `ToolCallError` that the environment turns into an
error observation (the model sees what was wrong), never an exception that stops a batch.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

ToolFormat = Literal["hermes", "fenced"]
TOOL_FORMATS: tuple[str, ...] = ("hermes", "fenced")

_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FENCED_CODE = re.compile(r"```python\n(.*?)\n?```\s*```output\s*$", re.DOTALL)
MAX_CALLS_PER_TURN = 8  # more calls in one turn are an error, not work: a policy could ask for thousands


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the tool's registered name and its keyword arguments (JSON values)."""

    name: str
    arguments: Mapping[str, Any]


class ToolCallError(ValueError):
    """The turn's text holds a tool call that cannot be read (bad JSON, no name, too many calls)."""


def check_format(tool_format: str, field: str = "env.tool_format") -> str:
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"{field}: unknown tool-call format {tool_format!r}; formats: {', '.join(TOOL_FORMATS)}")
    return tool_format


def stop_strings(tool_format: ToolFormat) -> tuple[str, ...]:
    """The strings that end a model turn that calls a tool (besides the end-of-turn / EOS token)."""
    return {"hermes": ("</tool_call>",), "fenced": ("```output",)}[check_format(tool_format)]


def parse_tool_calls(text: str, tool_format: ToolFormat) -> list[ToolCall]:
    """The tool calls of one model turn, in order; `[]` when the turn calls no tool (it is an answer).

    Raises `ToolCallError` for a call that cannot be read: JSON that does not parse or is not an object with a
    string `name` and an object `arguments`, or more than `MAX_CALLS_PER_TURN` calls.
    """
    if check_format(tool_format) == "fenced":
        match = _FENCED_CODE.search(text)
        return [] if match is None else [ToolCall("python", {"code": match.group(1)})]
    bodies = _HERMES_CALL.findall(text)
    if len(bodies) > MAX_CALLS_PER_TURN:
        raise ToolCallError(f"{len(bodies)} tool calls in one turn; at most {MAX_CALLS_PER_TURN}")
    calls = []
    for body in bodies:
        try:
            value = json.loads(body)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ToolCallError(f"tool call is not valid JSON: {str(e)[:80]}") from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise ToolCallError('tool call must be a JSON object {"name": ..., "arguments": {...}}')
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError):
                raise ToolCallError("tool call arguments are a string that is not a JSON object") from None
        if not isinstance(arguments, dict):
            raise ToolCallError("tool call arguments must be a JSON object")
        calls.append(ToolCall(value["name"], arguments))
    if not calls and "<tool_call>" in text:
        raise ToolCallError("<tool_call> without a closing </tool_call>")
    return calls


def format_tool_call(call: ToolCall, tool_format: ToolFormat) -> str:
    """The text a model writes for `call` (the inverse of `parse_tool_calls`; demonstrations use it)."""
    if check_format(tool_format) == "fenced":
        if call.name != "python":
            raise ValueError(f"the fenced format calls the python tool only, not {call.name!r}")
        return f"```python\n{call.arguments['code']}\n```\n```output"
    return "<tool_call>" + json.dumps({"name": call.name, "arguments": dict(call.arguments)},
                                      separators=(",", ":")) + "</tool_call>"


def plain_observation(results: Sequence[str], tool_format: ToolFormat) -> str:
    """The text appended after a tool-calling turn without a chat template: each result in
    `<tool_response>...</tool_response>` (hermes), or the output block's body and closing fence (fenced)."""
    if check_format(tool_format) == "fenced":
        return "\n" + "\n".join(results) + "\n```\n"
    return "".join(f"<tool_response>{r}</tool_response>" for r in results)
