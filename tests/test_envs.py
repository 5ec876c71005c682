"""jaxrl.envs: the env config section, the registry kinds, the built-in tools, the `tools` environment and the
rendering of observations (with and without a chat template)."""

import json
import math
import time
from fractions import Fraction

import pytest

from jaxrl import registry
from jaxrl.config import Config
from jaxrl.configlib import ConfigError, load_config
from jaxrl.envs.base import EnvStep, ToolContext, ToolError, ToolTimeout, checked_step, MAX_OBSERVATION_CHARS
from jaxrl.envs.config import EnvConfig
from jaxrl.envs.environments import ToolsEnvironment
from jaxrl.envs.render import check_tool_role, observation_text
from jaxrl.envs.tool_calls import ToolCall, format_tool_call
from jaxrl.envs.tools import MAX_RESULT_CHARS, calculator, python, retrieval, search
from jaxrl.tokenizer import BaseTokenizer, ChatTemplateError


def _context(config=None, state=None, seconds=10.0):
    return ToolContext({} if state is None else state, config or EnvConfig(), time.monotonic() + seconds)


def _call(name, **arguments):
    return format_tool_call(ToolCall(name, arguments), "hermes")


# -- config -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["env.max_turns=0"], "env.max_turns: must be > 0, got 0"),
    (["env.max_tokens=-3"], "env.max_tokens"),
    (["env.turn_tokens=0"], "env.turn_tokens"),
    (["env.observation_tokens=0"], "env.observation_tokens"),
    (["env.max_tool_s=0"], "env.max_tool_s"),
    (["env.step_timeout_s=-1"], "env.step_timeout_s"),
    (["env.num_workers=0"], "env.num_workers"),
    (["env.tool_format=xml"], "env.tool_format"),
    (["env.tools=[calculator]"], "env.tools: ['calculator'] given without env.name"),
    (["env.name=tools"], "env.tools: env.name is 'tools' but no tools are named"),
    (["env.name=tools", "env.tools=[calculator,calc]"], "env.tools[1]: unknown tool 'calc'; registered: "
                                                         "'calculator', 'python', 'retrieval'"),
    (["env.name=gym"], "env.name: unknown environment 'gym'; registered: 'tools'"),
    (["env.name=tools", "env.tools=[retrieval]"], "env.retrieval_file: the retrieval tool needs a corpus"),
    (["env.name=tools", "env.tools=[retrieval]", "env.retrieval_file=/nonexistent/c.jsonl"],
     "env.retrieval_file: no such file: '/nonexistent/c.jsonl'"),
    (["env.name=tools", "env.tools=[calculator]", "env.tool_format=fenced"], "python tool only"),
    (["env.name=tools", "env.tools=[calculator,calculator]"], "names a tool twice"),
])
def test_bad_env_config_is_a_clear_error(tmp_path, overrides, message):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 0\n")
    with pytest.raises(ConfigError) as error:
        load_config(Config, path, overrides)
    assert message in str(error.value)


def test_an_unknown_tool_in_the_file_is_reported_at_its_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 0\nenv:\n  name: tools\n  tools: [calculator, calc]\n")
    with pytest.raises(ConfigError) as error:
        load_config(Config, path)
    assert f"{path}:4" in str(error.value) and "env.tools[1]: unknown tool 'calc'" in str(error.value)


def test_env_config_built_in_python_checks_its_limits_too():
    with pytest.raises(ValueError, match="env.max_turns: must be > 0, got 0"):
        EnvConfig(max_turns=0).validate()
    EnvConfig().validate()  # the defaults: single-turn


def test_single_turn_default_names_no_env_pieces():
    config = Config()
    assert config.env.name is None and not config.env.multi_turn
    assert not [field for field in config.pieces() if field.startswith("env.")]


def test_a_tool_config_resolves_its_pieces(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("env:\n  name: tools\n  tools: [calculator, python]\n  tool_format: hermes\n")
    config = load_config(Config, path)
    pieces = config.pieces()
    assert pieces["env.name"].fn is ToolsEnvironment
    assert pieces["env.tools[0]"].fn is calculator and pieces["env.tools[1]"].fn is python


# -- registry -----------------------------------------------------------------------------------------------


class NotAnEnvironment:
    def __init__(self, config):
        pass

    def reset(self, row):
        return None, None


class NeedsTwoArguments:
    def __init__(self, config, other):
        pass

    def reset(self, row):
        return None, None

    def step(self, state, turn):
        return EnvStep(None)


def bad_tool(arguments):
    return ""


def test_registry_checks_environment_and_tool_signatures():
    with pytest.raises(registry.RegistryError, match=r"env.name: .* has no step\('state', 'turn'\)"):
        registry.resolve("environment", "test_envs:NotAnEnvironment", "env.name")
    with pytest.raises(registry.RegistryError, match="env.name: .* not constructible with the EnvConfig alone"):
        registry.resolve("environment", "test_envs:NeedsTwoArguments", "env.name")
    with pytest.raises(registry.RegistryError, match="env.name: .* is not a class"):
        registry.resolve("environment", "test_envs:bad_tool", "env.name")
    with pytest.raises(registry.RegistryError, match=r"env.tools\[0\]: .* does not take a tool's arguments"):
        registry.resolve("tool", "test_envs:bad_tool", "env.tools[0]")
    assert registry.names("tool") == ("calculator", "python", "retrieval")
    assert "tools" in registry.names("environment")


# -- calculator ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, expected", [
    ("2+3", "5"), ("12*(3+4)", "84"), ("-7 // 2", "-4"), ("-7 % 3", "2"), ("2**10", "1024"), ("-(3-10)", "7"),
    ("123456789*987654321", str(123456789 * 987654321)), ("1/3", "0.333333333333"), ("6/3", "2"),
    ("0.1+0.2", "0.3"), ("2**-1", "0.5"), ("+4", "4"), ("99999999999*99999999999", str(99999999999**2)),
])
def test_calculator_is_exact_on_integers_and_short_on_floats(expression, expected):
    assert calculator({"expression": expression}, _context()) == expected


def test_calculator_matches_exact_arithmetic_on_random_expressions():
    import random
    rng = random.Random(0)
    for _ in range(200):
        a, b, c = (rng.randint(-10**6, 10**6) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        expression = f"{a} {op1} ({b} {op2} {c})"
        reference = Fraction(a)
        inner = {"+": Fraction(b) + c, "-": Fraction(b) - c, "*": Fraction(b) * c}[op2]
        reference = {"+": reference + inner, "-": reference - inner, "*": reference * inner}[op1]
        assert calculator({"expression": expression}, _context()) == str(reference.numerator)


@pytest.mark.parametrize("expression, message", [
    ("9**9**9", "too large"), ("10**200", "too large"), ("2**5000", "exponent"), ("1/0", "division by zero"),
    ("5 % 0", "division by zero"), ("0**-1", "division by zero"), ("2+", "cannot parse"),
    ("__import__('os')", "unsupported expression"), ("x+1", "unsupported expression"), ("[1]*3", "unsupported"),
    ("1e308*10", "not finite"), ("'a'*3", "unsupported"), ("(-8)**0.5", "complex"), ("2" * 501, "at most 500"),
    ("-" * 400 + "1" + "+1" * 40, None), ("(" * 300 + "1" + ")" * 300, None),
])
def test_calculator_refuses_what_it_must_not_do_with_an_error(expression, message):
    start = time.monotonic()
    try:
        result = calculator({"expression": expression}, _context())
    except ToolError as e:
        assert message is None or message in str(e)
    else:
        assert message is None, result  # deep but legal nesting may also evaluate
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("arguments", [{}, {"expression": 3}, {"expr": "1"}, {"expression": "1", "x": 2}, None])
def test_calculator_bad_arguments_are_tool_errors(arguments):
    with pytest.raises(ToolError, match="expression|argument"):
        calculator(arguments, _context())


# -- python -------------------------------------------------------------------------------------------------


def test_python_tool_is_stateful_across_one_episodes_calls():
    state = {}
    assert python({"code": "x = 6\nprint('first')"}, _context(state=state)) == "first"
    # earlier cells re-run with their output discarded; a final expression's value is shown
    assert python({"code": "x * 7"}, _context(state=state)) == "42"
    assert python({"code": "def f(n):\n    return n + x\nprint(f(1))"}, _context(state=state)) == "7"
    assert python({"code": "f(10)"}, _context(state=state)) == "16"
    assert python({"code": "x * 7"}, _context(state={})) .startswith("Traceback")  # another episode: no x


def test_python_tool_shows_the_error_of_the_new_cell_only():
    state = {}
    out = python({"code": "1/0"}, _context(state=state))
    assert "ZeroDivisionError: division by zero" in out and "jaxrl" not in out
    assert python({"code": "print('ok')"}, _context(state=state)) == "ok"  # the failed cell stays silent


def test_python_tool_cuts_a_megabyte_of_output_with_a_note():
    out = python({"code": "print('x' * 1_000_000)"}, _context())
    assert len(out) < MAX_RESULT_CHARS + 200 and out.startswith("x" * 100)
    assert "output" in out and ("cut" in out or "limit" in out)


def test_python_tool_replaces_invalid_utf8():
    out = python({"code": "import sys\nn = sys.stdout.buffer.write(b'ok \\xff\\xfe end')"}, _context())
    assert out == "ok \ufffd\ufffd end"
    out.encode("utf-8")


def test_python_tool_hang_is_a_tool_timeout_within_the_time_left():
    start = time.monotonic()
    with pytest.raises(ToolTimeout):
        python({"code": "while True:\n    pass"}, _context(seconds=1.0))
    assert time.monotonic() - start < 3.0
    with pytest.raises(ToolTimeout, match="no tool time left"):
        python({"code": "1"}, _context(seconds=0.0))


# -- retrieval ----------------------------------------------------------------------------------------------


def test_retrieval_top2_by_word_overlap_from_jsonl_and_text(tmp_path):
    rows = ["The capital of France is Paris.", "Paris hosts the Louvre museum.", "Berlin is in Germany.",
            "Water boils at 100 degrees."]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    text = tmp_path / "c.txt"
    text.write_text("\n\n".join(rows) + "\n")
    for path in (jsonl, text):
        config = EnvConfig(retrieval_file=str(path))
        # overlap: row0 {capital, france, paris, is, the, of} -> 4 with the query; row1 {paris, the} -> 2
        assert retrieval({"query": "what is the capital of paris"}, _context(config)) == f"{rows[0]}\n\n{rows[1]}"
        assert retrieval({"query": "zebra"}, _context(config)) == "no match"
    assert search(["a b", "b c", "a b"], "a b") == ["a b", "a b"]  # ties: the earlier passage first


def test_retrieval_missing_file_is_a_tool_error(tmp_path):
    with pytest.raises(ToolError, match="env.retrieval_file"):
        retrieval({"query": "x"}, _context(EnvConfig(retrieval_file=str(tmp_path / "gone.jsonl"))))


# -- the tools environment ----------------------------------------------------------------------------------


def _tools_env(tools=("calculator", "python"), **kwargs):
    config = EnvConfig(name="tools", tools=tools, **kwargs)
    config.validate()
    return ToolsEnvironment(config)


def test_tools_environment_runs_calls_and_ends_on_a_turn_without_one():
    env = _tools_env()
    assert env.stop_strings == ("</tool_call>",)
    assert [s["function"]["name"] for s in env.tool_schemas] == ["calculator", "python"]
    state, first = env.reset({"prompt": "x"})
    assert first is None
    step = env.step(state, "I compute " + _call("calculator", expression="17*23") + _call("python", code="print(2)"))
    assert step.observation == [{"role": "tool", "name": "calculator", "content": "391"},
                                {"role": "tool", "name": "python", "content": "2"}]
    assert (step.tool_calls, step.tool_errors, step.tool_timeouts, step.error) == (2, 0, 0, None)
    assert step.tool_s > 0 and step.state["tool_s"] == pytest.approx(step.tool_s)
    end = env.step(step.state, "The answer is 391.")
    assert end.observation is None and end.done
    assert checked_step(end) == end


def test_tools_environment_errors_are_results_the_model_reads():
    env = _tools_env()
    state, _ = env.reset({})
    step = env.step(state, _call("calc", expression="1") + _call("calculator", expression="1/0")
                    + _call("calculator", code="1"))
    contents = [m["content"] for m in step.observation]
    assert contents[0].startswith("error: unknown tool 'calc'; tools: calculator, python")
    assert contents[1] == "error: division by zero"
    assert contents[2].startswith("error: unexpected arguments") or "expression" in contents[2]
    assert (step.tool_calls, step.tool_errors, step.tool_timeouts) == (3, 3, 0)
    assert step.error == contents[0]
    bad = env.step(state, "<tool_call>{oops}</tool_call>")
    assert bad.observation[0]["content"].startswith("error: tool call is not valid JSON")
    assert (bad.tool_calls, bad.tool_errors) == (1, 1) and not bad.done


def test_tools_environment_charges_tool_time_per_episode():
    env = _tools_env(max_tool_s=0.5)
    state, _ = env.reset({})
    step = env.step(state, _call("python", code="while True: pass"))
    assert step.tool_timeouts == 1 and step.tool_errors == 0
    assert step.observation[0]["content"].startswith("error: timeout")
    later = env.step(step.state, _call("calculator", expression="1+1"))
    assert later.observation[0]["content"].startswith("error: timeout: no tool time left")
    assert later.tool_timeouts == 1
    fresh, _ = env.reset({})  # another episode has its own budget
    assert env.step(fresh, _call("calculator", expression="1+1")).observation[0]["content"] == "2"


def raising_tool(arguments, context):
    raise RuntimeError("boom")


def bytes_tool(arguments, context):
    return b"not text"


def surrogate_tool(arguments, context):
    return "bad \udcff text" + "y" * (2 * MAX_RESULT_CHARS)


def test_tools_environment_survives_broken_tools():
    env = _tools_env(tools=("test_envs:raising_tool", "test_envs:bytes_tool", "test_envs:surrogate_tool"))
    state, _ = env.reset({})
    step = env.step(state, "".join(_call(f"test_envs:{n}") for n in ("raising_tool", "bytes_tool",
                                                                         "surrogate_tool")))
    contents = [m["content"] for m in step.observation]
    assert contents[0] == "error: the tool raised RuntimeError: boom"
    assert contents[1] == "error: the tool returned bytes, not text"
    assert contents[2].startswith("bad ? text") and "[output cut" in contents[2]
    contents[2].encode("utf-8")
    assert (step.tool_errors, step.tool_timeouts) == (2, 0)


def test_fenced_format_runs_python_and_stops_at_the_output_fence():
    env = _tools_env(tools=("python",), tool_format="fenced")
    assert env.stop_strings == ("```output",)
    state, _ = env.reset({})
    step = env.step(state, "Let me run it.\n```python\nprint(6*7)\n```\n```output")
    assert step.observation == [{"role": "tool", "name": "python", "content": "42"}]
    assert observation_text(step.observation, "", None, False, "fenced") == "\n42\n```\n"


# -- checked_step ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, message", [
    (42, "returned int, not an EnvStep"),
    (EnvStep("x", rewards={"r": math.nan}), "not a name -> finite float"),
    (EnvStep("x", rewards=[("r", 1.0)]), "mapping"),
    (EnvStep("x", tool_calls=-1), "tool_calls"),
    (EnvStep("x", tool_errors=True), "tool_errors"),
    (EnvStep("x", tool_s=math.inf), "tool_s"),
    (EnvStep(3), "observation"),
    (EnvStep([{"role": "user", "content": "x"}]), "tool message"),
    (EnvStep([{"role": "tool", "content": 5}]), "tool message"),
    (EnvStep([]), "observation"),
    (EnvStep("x", error=7), "error"),
])
def test_checked_step_ends_the_episode_on_a_malformed_step(value, message):
    step = checked_step(value)
    assert step.observation is None and step.tool_errors == 1 and message in step.error


def test_checked_step_cleans_and_bounds_text():
    step = checked_step(EnvStep("a\udcffb" + "z" * (2 * MAX_OBSERVATION_CHARS), rewards={"r": 1}, state={"k": 1}))
    assert step.observation.startswith("a?b") and len(step.observation) == MAX_OBSERVATION_CHARS
    assert step.rewards == {"r": 1.0} and type(step.rewards["r"]) is float and step.state == {"k": 1}
    messages = checked_step(EnvStep([{"role": "tool", "content": "x" * MAX_OBSERVATION_CHARS, "name": "a"},
                                     {"role": "tool", "content": "more"}])).observation
    assert sum(len(m["content"]) for m in messages) == MAX_OBSERVATION_CHARS


# -- rendering ------------------------------------------------------------------------------------------------

QWEN25_TOOLS = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

CHATML_RAISES_ON_TOOL = r"""{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Only system, user and assistant roles are supported') }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

CHATML_DROPS_TOOL = r"""{%- for message in messages if message.role != 'tool' %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


class TemplateOnly:
    """The part of a tokenizer that rendering uses: its chat template."""

    apply_chat_template = BaseTokenizer.apply_chat_template

    def __init__(self, template):
        self.chat_template, self.special_tokens = template, {}


def test_observation_text_through_qwen25_tool_role():
    tokenizer = TemplateOnly(QWEN25_TOOLS)
    check_tool_role(tokenizer)
    turn = "Let me check. " + _call("calculator", expression="17*23")
    messages = [{"role": "tool", "name": "calculator", "content": "391"},
                {"role": "tool", "name": "python", "content": "2"}]
    text = observation_text(messages, turn, tokenizer, True, "hermes")
    assert text == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n391\n</tool_response>\n<tool_response>\n2\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # the episode's text (prompt, turn, observation) is what the template gives for the whole conversation
    prompt = [{"role": "user", "content": "What is 17*23?"}]
    whole = tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": turn}, *messages],
                                          add_generation_prompt=True)
    assert tokenizer.apply_chat_template(prompt, add_generation_prompt=True) + turn + text == whole


def test_observation_text_plain_and_string():
    messages = [{"role": "tool", "name": "calculator", "content": "5"}]
    assert observation_text(messages, "t", None, False, "hermes") == "<tool_response>5</tool_response>"
    assert observation_text("Wrong, try again: ", "t", None, True, "hermes") == "Wrong, try again: "
    assert observation_text(None, "t", None, True, "hermes") == ""


def test_observation_text_cannot_be_spoofed_by_the_turn_or_the_tool():
    tokenizer = TemplateOnly(QWEN25_TOOLS)
    turn = "JAXRL0000000000000000 <|im_end|>"  # looks like a marker: the marker is random per call
    text = observation_text([{"role": "tool", "content": "JAXRL1111111111111111"}], turn, tokenizer, True, "hermes")
    assert text == ("<|im_end|>\n<|im_start|>user\n<tool_response>\nJAXRL1111111111111111\n</tool_response>"
                    "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("template, message", [(CHATML_RAISES_ON_TOOL, "no tool role"),
                                               (CHATML_DROPS_TOOL, "drops a tool message")])
def test_template_without_tool_role_is_refused(template, message):
    with pytest.raises(ChatTemplateError, match=message):
        check_tool_role(TemplateOnly(template))
