"""jaxrl.data.render.render_prompt: the text the model sees for a plain, a chat-templated and a chat
`messages` record (with the tiny checkpoint's ChatML tokenizer), and the config checks around it."""

import pytest

from jaxrl.config import Config
from jaxrl.configlib import ConfigError, load_config
from jaxrl.data import arithmetic
from jaxrl.data.prompts import PromptRecord
from jaxrl.data.render import conversation, render_prompt
from jaxrl.tiny import write_tiny_checkpoint
from jaxrl.tokenizer import load_tokenizer

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "2+2?"}
TURNS = (USER, {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", layers=1, hidden=16))


def _im(role, content):
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


ASSISTANT = "<|im_start|>assistant\n"


def test_a_plain_prompt_is_the_templated_text(tokenizer):
    record = PromptRecord("Q: 2+2?\nA:", "4", "f:1")
    assert render_prompt(record, tokenizer, chat_template=False) == "Q: 2+2?\nA:"
    # The built-in task's problems render the same way (anything with `.prompt`).
    problem = arithmetic.make_splits(arithmetic.ArithmeticTaskConfig(num_train=4, num_eval=2), 0)[0][0]
    assert render_prompt(problem, tokenizer, chat_template=False) == problem.prompt
    assert render_prompt(problem, tokenizer, chat_template=True) == _im("user", problem.prompt) + ASSISTANT


def test_a_chat_templated_prompt(tokenizer):
    record = PromptRecord("2+2?", "4", "f:1")
    assert render_prompt(record, tokenizer, chat_template=True) == _im("user", "2+2?") + ASSISTANT
    assert render_prompt(record, tokenizer, chat_template=True, system_prompt="Be brief.") == (
        _im("system", "Be brief.") + _im("user", "2+2?") + ASSISTANT)


def test_a_messages_record_renders_its_conversation(tokenizer):
    record = PromptRecord("and 3+3?", "6", "f:1", messages=TURNS, solution="6")
    want = _im("user", "2+2?") + _im("assistant", "4") + _im("user", "and 3+3?") + ASSISTANT
    assert render_prompt(record, tokenizer, chat_template=True) == want
    # The config's system prompt goes first only when the conversation has none of its own.
    assert render_prompt(record, tokenizer, chat_template=True, system_prompt="Hi.") == _im("system", "Hi.") + want
    own = PromptRecord("2+2?", "4", "f:2", messages=(SYSTEM, USER))
    assert render_prompt(own, tokenizer, chat_template=True, system_prompt="Hi.") == (
        _im("system", "Be brief.") + _im("user", "2+2?") + ASSISTANT)
    conversation(own, "Hi.")[0]["content"] = "changed"  # a copy: the record keeps its messages
    assert own.messages[0]["content"] == "Be brief."


def test_what_needs_a_chat_template_is_refused(tokenizer):
    with pytest.raises(ValueError, match="f:3: a messages conversation needs data.chat_template: true"):
        render_prompt(PromptRecord("q", "a", "f:3", messages=(USER,)), tokenizer, chat_template=False)
    with pytest.raises(ValueError, match="data.system_prompt needs data.chat_template"):
        render_prompt(PromptRecord("q", "a", "f:3"), tokenizer, chat_template=False, system_prompt="x")


def test_config_checks():
    files = ["data.train_file=t.jsonl", "data.eval_file=e.jsonl", "sft.steps=0"]
    with pytest.raises(ConfigError, match="data.format 'messages' needs data.chat_template: true"):
        load_config(Config, None, [*files, "data.format=messages"])
    config = load_config(Config, None, [*files, "data.format=messages", "data.chat_template=true",
                                        "data.messages_field=conversation"])
    assert config.data.prompt_fields().messages == "conversation"
    with pytest.raises(ConfigError, match="template 'Q: {prompt}' applies to format 'prompt' rows"):
        load_config(Config, None, [*files, "data.format=messages", "data.chat_template=true",
                                   "data.template='Q: {prompt}'"])
    # Any row field in a template; invalid syntax is refused when the config loads.
    assert load_config(Config, None, [*files, "data.template='{question} Choices: {choices}'"])
    with pytest.raises(ConfigError, match=r"data: invalid prompt template '\{question\} \{choices:>3\}'"):
        load_config(Config, None, [*files, "data.template='{question} {choices:>3}'"])
