"""Multi-turn rollouts: the host side of an episode (`jaxrl.multiturn` is the device side).

`EpisodeGenerator` is called like `Generator` and returns the same `Generation`, so the RL step, dynamic
sampling and the held-out evaluation work unchanged. Per turn: decode every live episode's model turn
(`multiturn.decode_turn`), send each finished turn's text to the environment in its worker pool (the same
timeouts and isolation as rewards), render and tokenize each observation, and append the observations to the
kept KV cache (`multiturn.append_observation`: only their tokens are prefilled). An episode ends when the
environment says so (a turn without a tool call is the answer), or at a limit: `env.max_turns` model turns,
`env.max_tokens` episode tokens, `env.turn_tokens` tokens in one turn.

The rollout's completion mask is True on model tokens only (observations are holes); the texts the rewards
score are the model's turns joined, without the observations (a tool's output cannot pose as the model's
answer); `Generation.episodes` keeps each whole episode for samples.jsonl and the episode metrics.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import multiturn
from jaxrl.envs.config import EnvConfig
from jaxrl.envs.render import observation_text
from jaxrl.loop.generate import Generation, Generator
from jaxrl.loop.rollout import row_of
from jaxrl.sampling import FINISH_EOS, FINISH_LENGTH, Rollout, SamplingConfig, stop_sequences_for
from jaxrl.sharding import from_process_local, process_local, process_max
from jaxrl.tokenizer import round_up

OBSERVATION_BUCKET = 8  # observation widths are rounded up to a multiple: few compiled append programs

# Why an episode ended.
ANSWERED = "answer"  # the environment ended it (a turn without a tool call)
MAX_TURNS = "max_turns"
MAX_TOKENS = "max_tokens"  # the episode's token budget (env.max_tokens)
TURN_TOKENS = "turn_tokens"  # one turn's budget (env.turn_tokens)
ENV_ERROR = "env_error"  # the environment's step failed (hung, crashed, returned junk)
TRUNCATED = frozenset({MAX_TURNS, MAX_TOKENS, TURN_TOKENS})


@dataclasses.dataclass
class Episode:
    """One row's episode as the host saw it: its turns in order, `("model" | "observation", text)`, the
    environment's reward parts per model turn, tool counts, and why it ended."""

    turns: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # each model turn's [start, end) tokens
    turn_rewards: list[dict[str, float]] = dataclasses.field(default_factory=list)  # one per model turn
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_s: float = 0.0
    observation_tokens: int = 0
    observation_cut: int = 0  # observations cut to env.observation_tokens or to the episode's room
    errors: list[str] = dataclasses.field(default_factory=list)
    finish: str | None = None

    @property
    def model_text(self) -> str:
        """The model's turns joined: what the rewards score."""
        return "".join(text for kind, text in self.turns if kind == "model")

    @property
    def model_turns(self) -> int:
        return sum(kind == "model" for kind, _ in self.turns)

    def reward_totals(self) -> dict[str, float]:
        """Each environment reward part summed over the turns."""
        totals: dict[str, float] = {}
        for parts in self.turn_rewards:
            for name, value in parts.items():
                totals[name] = totals.get(name, 0.0) + float(value)
        return totals

    def record(self) -> dict[str, Any]:
        """The episode for samples.jsonl."""
        return {"turns": [{"role": kind, "text": text} for kind, text in self.turns],
                "turn_rewards": self.turn_rewards, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "tool_timeouts": self.tool_timeouts, "finish": self.finish, "errors": self.errors[:3]}


def episode_metrics(episodes: Sequence[Episode], model_tokens: np.ndarray, prefix: str = "episode/"
                    ) -> dict[str, float]:
    """Turns per episode, tool calls, errors and timeouts (per episode), the share of episodes that called a
    tool, tokens of model text against observation text (per episode), tool seconds, and the share of each
    way an episode ended. `model_tokens [B]`: model tokens of each episode."""
    n = max(len(episodes), 1)
    metrics = {
        "turns_mean": sum(e.model_turns for e in episodes) / n,
        "tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
        "tool_use_rate": sum(e.tool_calls > 0 for e in episodes) / n,
        "tool_errors_mean": sum(e.tool_errors for e in episodes) / n,
        "tool_timeouts_mean": sum(e.tool_timeouts for e in episodes) / n,
        "tool_s_mean": sum(e.tool_s for e in episodes) / n,
        "model_tokens_mean": float(np.mean(model_tokens)) if len(model_tokens) else 0.0,
        "observation_tokens_mean": sum(e.observation_tokens for e in episodes) / n,
        "observation_cut_frac": sum(e.observation_cut > 0 for e in episodes) / n,
        "env_errors_mean": sum(len(e.errors) for e in episodes) / n,
    }
    for reason in (ANSWERED, MAX_TURNS, MAX_TOKENS, TURN_TOKENS, ENV_ERROR):
        metrics[f"finish_{reason}_frac"] = sum(e.finish == reason for e in episodes) / n
    return {prefix + k: float(v) for k, v in metrics.items()}


def turn_credit_arrays(episodes: Sequence[Episode], totals: np.ndarray, width: int
                       ) -> tuple[np.ndarray, np.ndarray]:
    """`(token_rewards [B, N] float32, turn_ids [B, N] int32)` for per-turn credit
    (`rl.loss.advantage.turn_credit`): each model turn's environment rewards on its last token, the rest of
    the episode's reward (`totals [B]` less the environment's part: the verifiable reward and shaping) on the
    episode's last model token, so each row's token rewards sum to its total; each model token's turn index,
    -1 on observations and padding. `N = width`: the episode capacity."""
    token_rewards = np.zeros((len(episodes), width), np.float32)
    turn_ids = np.full((len(episodes), width), -1, np.int32)
    for b, episode in enumerate(episodes):
        spans = [(k, start, end) for k, (start, end) in enumerate(episode.spans) if end > start]
        for k, start, end in spans:
            turn_ids[b, start:end] = k
            token_rewards[b, end - 1] += sum(episode.turn_rewards[k].values()) if k < len(episode.turn_rewards) else 0
        if spans:
            token_rewards[b, spans[-1][2] - 1] += totals[b] - sum(episode.reward_totals().values())
    return token_rewards, turn_ids


@dataclasses.dataclass
class EpisodeGenerator:
    """Multi-turn sampler front end: a `Generator` (prompt rendering, tokenizer, mesh) plus an environment pool.

    `pool`: has `reset(rows) -> [(state, first observation | None)]`, `step(states, turns) -> [EnvStep]` and
    `stop_strings` (`jaxrl.envs.EnvPool`). `env`: the limits (`max_turns`, `max_tokens`, `turn_tokens`,
    `observation_tokens`) and the tool-call format observations are rendered in (`jaxrl.envs.render`).
    """

    generate: Generator
    pool: Any
    env: EnvConfig

    def __post_init__(self):
        stop_strings = tuple(getattr(self.pool, "stop_strings", ()))
        self.stop_sequences = tuple(dict.fromkeys(
            self.generate.stop_sequences + stop_sequences_for(self.generate.tokenizer, stop_strings)))
        self.spare = round_up(self.env.observation_tokens, OBSERVATION_BUCKET)
        self.prefilled_tokens = 0  # observation tokens run through the model so far (with bucket padding)

    def observation_text(self, observation, turn: str) -> str:
        """The text appended for an `EnvStep.observation` after the model's `turn`: a string as is; tool
        messages through the chat template's tool role, or the plain format without a template."""
        return observation_text(observation, turn, self.generate.tokenizer, self.generate.chat_template,
                                self.env.tool_format)

    # The `Generator` attributes the rest of the loop reads (evaluation, warm start, samples).
    @property
    def tokenizer(self):
        return self.generate.tokenizer

    @property
    def mesh(self):
        return self.generate.mesh

    @property
    def chat_template(self) -> bool:
        return self.generate.chat_template

    @property
    def prompt_length(self) -> int:
        return self.generate.prompt_length

    def render(self, item) -> str:
        return self.generate.render(item)

    def __call__(self, policy, prompts: Sequence, rng, config: SamplingConfig, temperature=None,
                 group_size: int = 1) -> Generation:
        """Episodes for rows `p * group_size + g` (sample g of `prompts[p]`); `config.max_new_tokens` is
        replaced by the episode budget `env.max_tokens`."""
        tokenizer, mesh = self.generate.tokenizer, self.generate.mesh
        starts = self.pool.reset([row_of(p) for p in prompts])
        texts = [self.generate.render(p) + (first or "") for p, (_, first) in zip(prompts, starts)]
        states = [copy.deepcopy(state) for state, _ in starts for _ in range(group_size)]  # row p * G + g
        global_tokens, global_valid, group_size = self.generate.prompt_batch(texts, group_size)
        batch = len(states)
        episodes = multiturn.start(policy, global_tokens, global_valid, group_size=group_size,
                                   capacity=self.env.max_tokens, spare=self.spare, pad_id=tokenizer.pad_id,
                                   int8=config.kv_cache_dtype == "int8", policy_logp=config.policy_logp)
        records = [Episode() for _ in range(batch)]
        done = np.zeros(batch, bool)
        stop_ids = tuple(tokenizer.stop_ids)
        for turn in range(self.env.max_turns):
            if not process_max(int((~done).any())):
                break
            before = process_local(episodes.length, mesh)
            episodes, why = multiturn.decode_turn(
                policy, episodes, from_process_local(~done, mesh), jax.random.fold_in(rng, turn), config,
                stop_ids, tokenizer.pad_id, temperature, turn_tokens=self.env.turn_tokens,
                stop_sequences=self.stop_sequences)
            after, ids, why = process_local((episodes.length, episodes.tokens, why), mesh)
            stepping = []
            for b in np.flatnonzero(~done):
                records[b].turns.append(("model", tokenizer.decode(ids[b, before[b]:after[b]])))
                records[b].spans.append((int(before[b]), int(after[b])))
                if why[b] != multiturn.TURN_STOPPED:
                    full = why[b] == multiturn.EPISODE_FULL
                    done[b], records[b].finish = True, MAX_TOKENS if full else TURN_TOKENS
                    records[b].turn_rewards.append({})
                else:
                    stepping.append(b)
            observations = self._step(stepping, states, records, done, after,
                                      last_turn=turn == self.env.max_turns - 1)
            width = process_max(max((len(o) for o in observations.values()), default=0))
            if width:
                width = round_up(width, OBSERVATION_BUCKET)
                observation = np.full((batch, width), tokenizer.pad_id, np.int32)
                observation_len = np.zeros(batch, np.int32)
                for b, ids_b in observations.items():
                    observation[b, :len(ids_b)], observation_len[b] = ids_b, len(ids_b)
                episodes = multiturn.append_observation(policy, episodes,
                                                        *from_process_local((observation, observation_len), mesh))
                self.prefilled_tokens += batch * width
        for b in np.flatnonzero(~done):
            records[b].finish = MAX_TURNS  # the last allowed turn called a tool
        return self._generation(episodes, global_tokens, group_size, records)

    def _step(self, stepping: list[int], states: list, records: list[Episode], done: np.ndarray,
              lengths: np.ndarray, last_turn: bool) -> dict[int, list[int]]:
        """Run the environment on the turns of rows `stepping`; returns the observation tokens to append per
        row (ending the episodes that are over)."""
        if not stepping:
            return {}
        results = self.pool.step([states[b] for b in stepping], [records[b].turns[-1][1] for b in stepping])
        observations = {}
        for b, result in zip(stepping, results):
            record = records[b]
            states[b] = result.state
            record.turn_rewards.append(dict(result.rewards))
            record.tool_calls += result.tool_calls
            record.tool_errors += result.tool_errors
            record.tool_timeouts += result.tool_timeouts
            record.tool_s += result.tool_s
            if result.error:
                record.errors.append(result.error)
            if result.observation is None:
                done[b], record.finish = True, ENV_ERROR if result.error and not result.tool_calls else ANSWERED
                continue
            if last_turn:
                continue  # ends as MAX_TURNS: no turn is left to read the observation
            text = self.observation_text(result.observation, record.turns[-1][1])
            ids = self.generate.tokenizer.encode(text)
            room = min(self.env.observation_tokens, self.env.max_tokens - int(lengths[b]) - 1)  # >= 1 to answer
            if room <= 0:
                done[b], record.finish = True, MAX_TOKENS
                continue
            if len(ids) > room:
                ids, text = ids[:room], self.generate.tokenizer.decode(ids[:room])
                record.observation_cut += 1
            record.turns.append(("observation", text))
            record.observation_tokens += len(ids)
            observations[b] = ids
        return observations

    def _generation(self, episodes: multiturn.Episodes, prompt_tokens, group_size: int,
                    records: list[Episode]) -> Generation:
        finished = [FINISH_LENGTH if r.finish in TRUNCATED else FINISH_EOS for r in records]
        mesh = self.generate.mesh
        rollout = Rollout(
            tokens=jnp.concatenate([jnp.repeat(prompt_tokens, group_size, axis=0), episodes.tokens], axis=1),
            prompt_valid=episodes.prompt_valid,
            completion_mask=episodes.model_mask,
            sampler_logp=episodes.sampler_logp,
            finish_reason=from_process_local(np.asarray(finished, np.int32), mesh),
            policy_logp=episodes.policy_logp if episodes.policy_logp.ndim else None,
        )
        local = process_local(rollout, mesh)
        return Generation(rollout, local, [r.model_text for r in records], episodes=records)
