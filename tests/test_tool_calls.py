"""jaxrl.envs.tool_calls: the exact text formats of tool calls (demonstrations rely on them), parsed and written."""

import json

import pytest

from jaxrl.envs.tool_calls import (
    MAX_CALLS_PER_TURN,
    ToolCall,
    ToolCallError,
    check_format,
    format_tool_call,
    parse_tool_calls,
    plain_observation,
    stop_strings,
)


def test_hermes_call_text_is_compact_json_in_tags():
    call = ToolCall("calculator", {"expression": "2+3"})
    text = format_tool_call(call, "hermes")
    assert text == '<tool_call>{"name":"calculator","arguments":{"expression":"2+3"}}</tool_call>'
    assert parse_tool_calls("Let me compute. " + text, "hermes") == [call]


def test_fenced_call_text_and_its_stop_string():
    call = ToolCall("python", {"code": "print(6*7)"})
    text = format_tool_call(call, "fenced")
    assert text == "```python\nprint(6*7)\n```\n```output"
    assert text.endswith(stop_strings("fenced")[0])
    assert parse_tool_calls("We run it.\n" + text, "fenced") == [call]
    assert parse_tool_calls("```python\nprint(1)\n```\nno output block asked", "fenced") == []


def test_several_hermes_calls_in_order_and_a_turn_without_a_call():
    calls = [ToolCall("calculator", {"expression": str(i)}) for i in range(3)]
    text = " and ".join(format_tool_call(c, "hermes") for c in calls)
    assert parse_tool_calls(text, "hermes") == calls
    assert parse_tool_calls("The answer is 5.", "hermes") == []


def test_arguments_written_as_a_json_string_are_read():
    body = json.dumps({"name": "python", "arguments": json.dumps({"code": "1"})})
    assert parse_tool_calls(f"<tool_call>{body}</tool_call>", "hermes") == [ToolCall("python", {"code": "1"})]


@pytest.mark.parametrize("text, message", [
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", "JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "JSON object"),
    ('<tool_call>{"name": 3}</tool_call>', "JSON object"),
    ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', "arguments must be a JSON object"),
    ('<tool_call>{"name": "c", "arguments": "[1]"}</tool_call>', "arguments must be a JSON object"),
    ('<tool_call>{"name": "c", "arguments": "{"}</tool_call>', "string that is not a JSON object"),
    ('<tool_call>{"name": "c"', "without a closing"),
    ("<tool_call>" + "[" * 100000 + "</tool_call>", "not valid JSON"),  # deep nesting: no RecursionError out
])
def test_malformed_calls_are_tool_call_errors(text, message):
    with pytest.raises(ToolCallError, match=message):
        parse_tool_calls(text, "hermes")


def test_too_many_calls_in_one_turn_is_an_error_not_work():
    one = format_tool_call(ToolCall("calculator", {"expression": "1"}), "hermes")
    assert len(parse_tool_calls(one * MAX_CALLS_PER_TURN, "hermes")) == MAX_CALLS_PER_TURN
    with pytest.raises(ToolCallError, match="at most"):
        parse_tool_calls(one * (MAX_CALLS_PER_TURN + 1), "hermes")


def test_plain_observations():
    assert plain_observation(["5", "x"], "hermes") == "<tool_response>5</tool_response><tool_response>x</tool_response>"
    assert plain_observation(["42"], "fenced") == "\n42\n```\n"


def test_unknown_format_names_the_field():
    with pytest.raises(ValueError, match=r"env.tool_format: unknown tool-call format 'xml'; formats: hermes, fenced"):
        check_format("xml")
    with pytest.raises(ValueError, match="env.tool_format"):
        stop_strings("json")
    with pytest.raises(ValueError, match="python tool only"):
        format_tool_call(ToolCall("calculator", {"expression": "1"}), "fenced")
