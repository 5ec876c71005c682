"""jaxrl.envs.pool.EnvPool: environment steps in worker processes. A step that hangs, crashes, floods, returns
bad text or garbage ends that episode with a recorded error; the other episodes of the batch get their results,
and the pool goes on."""

import math
import os
import signal
import time

import pytest

from jaxrl.envs.base import MAX_OBSERVATION_CHARS, EnvStep, Environment
from jaxrl.envs.config import EnvConfig
from jaxrl.envs.pool import EnvPool, ResetFailed
from jaxrl.envs.tool_calls import ToolCall, format_tool_call


class Hostile(Environment):
    """Does what the turn says: `ok <n>` answers `n+1`; the rest misbehave in one way each."""

    stop_strings = ("<end>",)

    def reset(self, row):
        if row.get("reset") == "raise":
            raise ValueError("bad row")
        if row.get("reset") == "exit":
            os._exit(5)
        return {"seen": 0, "row": row.get("id")}, f"start {row.get('id')}"

    def step(self, state, turn):
        kind, _, arg = turn.partition(" ")
        if kind == "ok":
            state = {**state, "seen": state["seen"] + 1}
            return EnvStep(str(int(arg) + 1), rewards={"turn": 0.5}, state=state, tool_calls=1, tool_s=0.01)
        if kind == "hang":
            time.sleep(60)
        if kind == "exit":
            os._exit(3)
        if kind == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if kind == "raise":
            raise RuntimeError("the environment broke")
        if kind == "big":
            return EnvStep("x" * 1_000_000, state=state)
        if kind == "surrogate":
            return EnvStep("bad \udcff\ud800 text", rewards={"r\udcff": 1.0}, state=state)
        if kind == "garbage":
            return {"observation": "not an EnvStep"}
        if kind == "nan":
            return EnvStep("x", rewards={"r": math.nan}, state=state)
        if kind == "unpicklable":
            return EnvStep("x", state=lambda: None)
        if kind == "done":
            return EnvStep(None, rewards={"final": 1.0}, state=state)
        raise AssertionError(kind)


def hang_tool(arguments, context):
    time.sleep(60)
    return "never"


def crash_tool(arguments, context):
    os._exit(9)


def _config(**kwargs):
    defaults = dict(name="test_env_pool:Hostile", step_timeout_s=1.0, num_workers=2)
    return EnvConfig(**{**defaults, **kwargs})


@pytest.fixture(scope="module")
def pool():
    with EnvPool(_config()) as p:
        yield p


def test_reset_and_healthy_steps(pool):
    assert pool.stop_strings == ("<end>",) and pool.tool_schemas == []
    episodes = pool.reset([{"id": i} for i in range(5)])
    assert episodes == [({"seen": 0, "row": i}, f"start {i}") for i in range(5)]
    steps = pool.step([s for s, _ in episodes], [f"ok {i}" for i in range(5)])
    assert [s.observation for s in steps] == [str(i + 1) for i in range(5)]
    assert all(s.rewards == {"turn": 0.5} and s.state["seen"] == 1 and s.tool_calls == 1 for s in steps)
    done = pool.step([s.state for s in steps], ["done"] * 5)
    assert all(s.observation is None and s.rewards == {"final": 1.0} and s.error is None for s in done)


@pytest.mark.parametrize("turn, timeout, message", [
    ("hang", True, "took longer than env.step_timeout_s (1 s)"),
    ("exit", False, "killed its worker (exit code 3)"),
    ("segv", False, f"killed its worker (exit code {-signal.SIGSEGV})"),
    ("raise", False, "raised RuntimeError: the environment broke"),
    ("garbage", False, "returned dict, not an EnvStep"),
    ("nan", False, "not a name -> finite float"),
    ("unpicklable", False, "cannot be sent"),
])
def test_a_failing_step_ends_only_its_episode(pool, turn, timeout, message):
    episodes = pool.reset([{"id": i} for i in range(4)])
    turns = ["ok 10", turn, "ok 20", "ok 30"]
    start = time.monotonic()
    steps = pool.step([s for s, _ in episodes], turns)
    assert time.monotonic() - start < 10
    bad = steps[1]
    assert bad.observation is None and bad.done and message in bad.error, bad
    assert (bad.tool_timeouts, bad.tool_errors) == ((1, 0) if timeout else (0, 1))
    assert bad.rewards == {}
    assert [steps[i].observation for i in (0, 2, 3)] == ["11", "21", "31"]
    # the pool goes on: the next batch is served in full
    again = pool.step([s for s, _ in episodes], ["ok 1"] * 4)
    assert [s.observation for s in again] == ["2"] * 4


def test_a_megabyte_observation_is_cut_and_bad_text_is_cleaned(pool):
    episodes = pool.reset([{"id": 0}, {"id": 1}, {"id": 2}])
    steps = pool.step([s for s, _ in episodes], ["big", "surrogate", "ok 1"])
    assert steps[0].observation == "x" * MAX_OBSERVATION_CHARS
    assert steps[1].observation == "bad ?? text" and list(steps[1].rewards) == ["r?"]
    steps[1].observation.encode("utf-8")
    assert steps[2].observation == "2"


def test_a_failed_reset_ends_that_episode_at_its_first_step(pool):
    episodes = pool.reset([{"id": 0}, {"id": 1, "reset": "raise"}, {"id": 2, "reset": "exit"}, {"id": 3}])
    assert isinstance(episodes[1][0], ResetFailed) and "ValueError: bad row" in episodes[1][0].error
    assert isinstance(episodes[2][0], ResetFailed) and "exit code 5" in episodes[2][0].error
    assert episodes[1][1] is None and episodes[3] == ({"seen": 0, "row": 3}, "start 3")
    steps = pool.step([s for s, _ in episodes], ["ok 1"] * 4)
    assert steps[1].done and steps[1].tool_errors == 1 and "bad row" in steps[1].error
    assert steps[2].done and "exit code 5" in steps[2].error
    assert [steps[i].observation for i in (0, 3)] == ["2", "2"]


def test_hanging_and_crashing_tools_in_the_tools_environment():
    config = EnvConfig(name="tools", tools=("calculator", "python", "test_env_pool:hang_tool",
                                            "test_env_pool:crash_tool"), step_timeout_s=2.0, max_tool_s=5.0)

    def call(name, **arguments):
        return format_tool_call(ToolCall(name, arguments), "hermes")

    with EnvPool(config) as pool:
        assert pool.stop_strings == ("</tool_call>",)
        assert [s["function"]["name"] for s in pool.tool_schemas][:2] == ["calculator", "python"]
        episodes = pool.reset([{}] * 5)
        turns = [call("test_env_pool:hang_tool"), call("calculator", expression="6*7"),
                 call("test_env_pool:crash_tool"), call("python", code="print('y' * 1_000_000)"),
                 call("python", code="import sys\nn = sys.stdout.buffer.write(b'\\xff ok')")]
        steps = pool.step([s for s, _ in episodes], turns)
        assert steps[0].done and steps[0].tool_timeouts == 1 and "env.step_timeout_s" in steps[0].error
        assert steps[1].observation == [{"role": "tool", "name": "calculator", "content": "42"}]
        assert steps[2].done and steps[2].tool_errors == 1 and "exit code 9" in steps[2].error
        out = steps[3].observation[0]["content"]
        assert out.startswith("y" * 1000) and len(out) < 5000 and not steps[3].done
        assert steps[4].observation[0]["content"] == "\ufffd ok"


def test_pool_refuses_a_single_turn_config():
    with pytest.raises(ValueError, match="env.name"):
        EnvPool(EnvConfig())
