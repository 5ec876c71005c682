"""The sampler's host-side front end: prompt records in, rollouts (global arrays) and decoded texts out."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from jaxrl.data.render import render_prompt
from jaxrl.sampling import Rollout, SamplingConfig, sample, stop_sequences_for
from jaxrl.sharding import data_shard, from_process_local, process_local, process_max
from jaxrl.tokenizer import BaseTokenizer, encode_prompt, left_pad, round_up


@dataclasses.dataclass(frozen=True)
class Generation:
    """One `Generator` call. In a multi-host run each process has the rows of its own prompts."""

    rollout: Rollout  # global arrays on the mesh, rows split over the data axes
    local: Rollout  # this process's rows of it, as numpy
    texts: list[str]  # decoded completions of `local` (of an episode: the model's turns, without observations)
    episodes: list | None = None  # multi-turn: each row's `jaxrl.loop.episodes.Episode`, else None


@dataclasses.dataclass
class Generator:
    """Host-side wrapper around the jitted sampler: prompt records (or strings) in, rollouts and texts out.

    With `chat_template`, each prompt becomes the user turn (after an optional system turn) of the
    tokenizer's chat template, ending with the assistant's generation prompt; a chat record's conversation
    is rendered as it is (`jaxrl.data.render`).
    """

    tokenizer: BaseTokenizer
    prompt_lengths: tuple[int, ...]  # padded prompt lengths, ascending: one compiled program per length
    mesh: jax.sharding.Mesh
    chat_template: bool = False
    system_prompt: str | None = None
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # token sequences that end a completion
    tool_schemas: tuple[dict, ...] = ()  # the chat template's `tools=` (a multi-turn run's tools)

    @classmethod
    def fitting(cls, prompts: Sequence, tokenizer: BaseTokenizer, mesh, chat_template: bool = False,
                system_prompt: str | None = None, buckets: int = 4,
                stop_strings: Sequence[str] = (), tool_schemas: Sequence[dict] = ()) -> "Generator":
        """A generator whose longest padded prompt length fits every one of `prompts`, with `buckets`
        lengths in all (`prompt_length_buckets`), stopping at `stop_strings` (`stop_sequences_for`)."""
        generate = cls(tokenizer, (), mesh, chat_template, system_prompt,
                       stop_sequences_for(tokenizer, stop_strings), tuple(tool_schemas))
        longest = max(map(len, map(generate.prompt_tokens, prompts)))
        return dataclasses.replace(generate, prompt_lengths=prompt_length_buckets(longest, buckets))

    @property
    def prompt_length(self) -> int:
        """The longest padded prompt length."""
        return self.prompt_lengths[-1]

    def render(self, item) -> str:
        """The text the model sees for a prompt record (`.prompt`, and `.messages` for a chat record; see
        `jaxrl.data.render.render_prompt`) or a prompt string."""
        record = _Prompt(item) if isinstance(item, str) else item
        return render_prompt(record, self.tokenizer, chat_template=self.chat_template,
                             system_prompt=self.system_prompt, tools=self.tool_schemas)

    def prompt_tokens(self, item) -> list[int]:
        return encode_prompt(self.tokenizer, self.render(item), templated=self.chat_template)

    def prompt_batch(self, texts: Sequence[str], group_size: int) -> tuple[jax.Array, jax.Array, int]:
        """Rendered prompt `texts` (this process's) encoded and left-padded to the shortest bucket of
        `prompt_lengths` that fits the longest on any process (rounded up to a multiple of 8 beyond them), as
        global arrays `(tokens [P, L], valid [P, L])`, and the group size to sample with: prompts that do not
        split over the mesh's data axes are repeated `group_size` times and sampled with a group of 1."""
        rows = [encode_prompt(self.tokenizer, text, templated=self.chat_template) for text in texts]
        longest = process_max(max(map(len, rows)))  # every process pads to the same length
        length = next((n for n in self.prompt_lengths if n >= longest), round_up(longest, 8))
        tokens, valid = left_pad(rows, length, self.tokenizer.pad_id, texts)
        parallel = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        if (len(texts) * data_shard(self.mesh)[1]) % parallel:  # prompts do not split over the mesh: share
            tokens, valid, group_size = np.repeat(tokens, group_size, 0), np.repeat(valid, group_size, 0), 1
        tokens, valid = from_process_local((tokens, valid), self.mesh)
        return tokens, valid, group_size

    def __call__(self, policy, prompts: Sequence, rng, config: SamplingConfig,
                 temperature=None, group_size: int = 1) -> Generation:
        """Rollout rows `p * group_size + g`: sample g of `prompts[p]` (each prompt prefilled once).

        `prompts`: this process's prompt records (or strings; all of them in a single-process run); every
        process passes as many.
        """
        tokens, valid, group_size = self.prompt_batch([self.render(p) for p in prompts], group_size)
        rollout = sample(policy, tokens, valid, rng, config, self.tokenizer.stop_ids, self.tokenizer.pad_id,
                         temperature, group_size=group_size, stop_sequences=self.stop_sequences)
        local = process_local(rollout, self.mesh)
        return Generation(rollout, local, [self.tokenizer.decode(row) for row in local.completion_tokens])


    def continue_rows(self, policy, rows: Sequence[np.ndarray], rng, config: SamplingConfig, temperature=None,
                      lengths: Sequence[int] = (), row_counts: Sequence[int] = ()) -> Rollout:
        """Sample one continuation of each of `rows` (a prompt and the completion so far, token ids `[T_i]`) with
        `config` (its `max_new_tokens` the segment); returns this process's rollout as numpy, a row per row.

        Single-process (partial rollouts run on the producer thread of a one-process run). The batch is padded
        to the first of `row_counts` that holds it (copies of the first row, dropped after; else a power of two)
        and its length to the first of `lengths` that fits (else a multiple of 8), so a run compiles few sampler
        programs."""
        longest = max(map(len, rows))
        length = next((n for n in sorted(lengths) if n >= longest), round_up(longest, 8))
        parallel = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        count = next((n for n in sorted(row_counts) if n >= len(rows)), 1 << (len(rows) - 1).bit_length())
        count = round_up(max(count, parallel), parallel)
        padded = list(rows) + [rows[0]] * (count - len(rows))
        tokens, valid = left_pad(padded, length, self.tokenizer.pad_id)
        tokens, valid = from_process_local((tokens, valid), self.mesh)
        rollout = sample(policy, tokens, valid, rng, config, self.tokenizer.stop_ids, self.tokenizer.pad_id,
                         temperature, group_size=1, stop_sequences=self.stop_sequences)
        local = process_local(rollout, self.mesh)
        return Rollout(*(None if x is None else np.asarray(x)[:len(rows)] for x in local))


@dataclasses.dataclass(frozen=True)
class _Prompt:
    """A bare prompt string as a record."""

    prompt: str


def prompt_length_buckets(longest: int, count: int, multiple: int = 8) -> tuple[int, ...]:
    """Up to `count` padded prompt lengths, ascending: `longest` rounded up to `multiple`, then its successive
    halves (rounded up likewise, distinct, at least `multiple`). A batch is padded to the shortest that fits
    its longest prompt, so a run compiles at most `count` sampler programs per batch size while a batch of
    short prompts does not pay for the longest prompt of the data set (at most 2x padding beyond a bucket)."""
    lengths = {round_up(max(-(-longest // 2**i), 1), multiple) for i in range(count)}
    return tuple(sorted(lengths))
