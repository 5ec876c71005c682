"""Observations as text, on the host: what is appended to an episode after a model turn.

- A string observation is appended as is.
- Tool messages without a chat template: `plain_observation` of their contents (`<tool_response>...` for
  hermes, the output block's body and closing fence for fenced).
- Tool messages with a chat template: the text the template puts between the end of the assistant's turn (as
  the model wrote it, stopped at its stop string) and the next assistant generation prompt, found by rendering
  a short conversation whose assistant turn ends with a random marker: what follows the marker is the
  observation (e.g. Qwen2.5's `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n5\\n</tool_response><|im_end|>\\n
  <|im_start|>assistant\\n`). The marker is random per call, so no model or tool text can imitate it.

`check_tool_role(tokenizer)` refuses (`ChatTemplateError`) a template without a tool role: one that raises on a
tool message or drops its content.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from jaxrl.envs.tool_calls import plain_observation
from jaxrl.tokenizer import ChatTemplateError

__all__ = ["observation_text", "check_tool_role"]


def _conversation(turn: str, marker: str, messages: Sequence[dict]) -> list[dict]:
    return [{"role": "user", "content": "."}, {"role": "assistant", "content": turn + marker}, *messages]


def _tool_messages(observation) -> list[dict]:
    if not isinstance(observation, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                    for m in observation):
        raise TypeError(f"observation must be a str, None or a list of tool messages, got {observation!r:.100}")
    return [{"role": "tool", "content": m["content"], **({"name": m["name"]} if "name" in m else {})}
            for m in observation]


def observation_text(observation: str | list[dict] | None, turn: str, tokenizer, chat_template: bool,
                     tool_format: str) -> str:
    """The text appended after the model's `turn` for `observation` ("" for None: the episode is over).

    Args:
      observation: an `EnvStep.observation`: text, or tool messages `[{"role": "tool", "content": ...}]`.
      turn: the model turn's text as written (it ended at a stop string).
      tokenizer: a `jaxrl.tokenizer.BaseTokenizer` (used only with `chat_template`).
      chat_template: whether the run renders prompts with the tokenizer's chat template.
      tool_format: `env.tool_format` ("hermes" or "fenced"), for the plain rendering.

    Raises `ChatTemplateError` when the template cannot render the tool messages after the turn.
    """
    if observation is None:
        return ""
    if isinstance(observation, str):
        return observation
    messages = _tool_messages(observation)
    if not chat_template:
        return plain_observation([m["content"] for m in messages], tool_format)
    marker = f"JAXRL{secrets.token_hex(8)}"
    text = tokenizer.apply_chat_template(_conversation(turn, marker, messages), add_generation_prompt=True)
    at = text.find(marker)
    if at < 0:
        raise ChatTemplateError("the chat template does not keep the assistant's turn text as written, so the "
                                "text of a tool observation after it cannot be found")
    return text[at + len(marker):]


def check_tool_role(tokenizer) -> None:
    """Raise `ChatTemplateError` unless the tokenizer's chat template renders a tool message (its content
    appears after the assistant's turn). A tool recipe with a chat template needs one."""
    probe = f"probe{secrets.token_hex(6)}"
    try:
        text = observation_text([{"role": "tool", "name": "calculator", "content": probe}], "call", tokenizer,
                                True, "hermes")
    except ChatTemplateError as e:
        raise ChatTemplateError(f"the chat template has no tool role (a tool message cannot be rendered: {e}); "
                                "use a chat model's template with one (e.g. Qwen2.5's) or data.chat_template: "
                                "false with env.tool_format's plain observations") from None
    if probe not in text:
        raise ChatTemplateError("the chat template has no tool role: it drops a tool message's content; use a "
                                "chat model's template with one (e.g. Qwen2.5's) or data.chat_template: false "
                                "with env.tool_format's plain observations")
