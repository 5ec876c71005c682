"""A hostile environment for the multi-turn run tests: each step, chosen by the turn's text, hangs, kills its
worker, floods the host with 1 MB, sends lone surrogates, returns bytes, or ends the episode with a reward."""

import os
import time

from jaxrl import registry
from jaxrl.envs.base import Environment, EnvStep


@registry.register("environment", "hostile")
class Hostile(Environment):
    stop_strings = tuple("0123456789")  # a random policy's turns end within a few tokens
    tool_schemas = []

    def __init__(self, config):
        self.config = config

    def reset(self, row):
        return 0, None

    def step(self, state, turn):
        kind = sum(map(ord, turn)) % 6
        if kind == 0:
            time.sleep(60)  # past env.step_timeout_s: killed
        if kind == 1:
            os._exit(3)
        if kind == 2:
            return EnvStep("7" * 1_000_000, state=state + 1, tool_calls=1)
        if kind == 3:
            return EnvStep("bad \udcff text", state=state + 1, tool_calls=1)
        if kind == 4:
            return EnvStep(b"\xff\xfe not text", state=state + 1)
        return EnvStep(None, rewards={"bonus": 0.5}, state=state + 1)
