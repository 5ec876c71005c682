"""The text the model sees for a prompt record: `render_prompt(record, tokenizer, chat_template=, system_prompt=)`.

- A prompt record without `chat_template`: its templated prompt, as it is.
- With `chat_template`: `[system_prompt?] + user(prompt)` through the tokenizer's chat template, ending with the
  assistant's generation prompt.
- A chat record (`record.messages`, from `data.format: messages`): its conversation through the chat template;
  `system_prompt` is put first only when the conversation has no system message of its own.

Pure: the same record and tokenizer give the same text. Encode the result with
`jaxrl.tokenizer.encode_prompt(tokenizer, text, templated=chat_template)` (a rendered chat template already holds
its BOS).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["conversation", "render_prompt"]


class _Record(Protocol):
    prompt: str


def conversation(record: _Record, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The messages the chat template renders for `record`: its own conversation (a chat record), else
    `[system?, user(prompt)]`; `system_prompt` leads unless the conversation has a system message."""
    messages: Sequence[dict[str, Any]] | None = getattr(record, "messages", None)
    turns = [dict(m) for m in messages] if messages is not None else [{"role": "user", "content": record.prompt}]
    if system_prompt is not None and not any(m["role"] == "system" for m in turns):
        turns.insert(0, {"role": "system", "content": system_prompt})
    return turns


def render_prompt(record: _Record, tokenizer, *, chat_template: bool, system_prompt: str | None = None,
                  tools: Sequence[dict] = ()) -> str:
    """The prompt text of `record` (anything with `.prompt`; a `PromptRecord` may carry `.messages`); with a
    chat template, `tools` (JSON schemas) go to its `tools=` when given.

    ValueError for a chat record without `chat_template` or a `system_prompt` without it (config validation
    refuses both first: `data.format: messages` and `data.system_prompt` need `data.chat_template: true`).
    """
    if not chat_template:
        if getattr(record, "messages", None) is not None:
            raise ValueError(f"{getattr(record, 'source', 'a chat record')}: a messages conversation needs "
                             "data.chat_template: true")
        if system_prompt is not None:
            raise ValueError("data.system_prompt needs data.chat_template: true")
        return record.prompt
    if tools:
        return tokenizer.apply_chat_template(conversation(record, system_prompt), tools=list(tools))
    return tokenizer.apply_chat_template(conversation(record, system_prompt))
