"""The RL loop's orchestration (`jaxrl.loop`): what it records, when it refuses a config, what it gives back."""

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import pytest

from jaxrl import loop
from jaxrl.checkpoint import Checkpointer
from jaxrl.loop import generate, producer, progress, rl
from jaxrl.config import Config
from jaxrl.configlib import load_config
from jaxrl.metrics import read_metrics

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_rl_step import TINY  # noqa: E402


def _config(out, *extra):
    return load_config(Config, "configs/default.yaml", [*TINY, "reward.num_workers=1", f"output_dir={out}", *extra])


@pytest.mark.parametrize("setting, error", [("rl.overlap=true", "rl.overlap .* 2 processes: set rl.overlap=false"),
                                            ("rl.max_staleness=2", "rl.max_staleness .* 2 processes: set "
                                                                   "rl.max_staleness=0")])
def test_staleness_in_a_multi_process_run_is_refused_before_the_output_dir_changes(tmp_path, monkeypatch, setting,
                                                                                   error):
    """Like every other config check: before the warm start, and before overwrite=true deletes a run."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=error):
        loop.run(_config(tmp_path / "run", setting, "sft.steps=0"))
    assert not os.path.exists(tmp_path / "run")


def test_a_failed_run_gives_sigterm_back_and_counts_warm_start_steps_from_1(tmp_path, monkeypatch):
    """The preemption handler is uninstalled even when the warm-start-only checkpoint fails; the warm start's
    records count updates from 1, as RL's do (step n: the n-th update)."""
    def no_space(self, *args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(Checkpointer, "save", no_space)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(OSError, match="No space"):
        loop.run(_config(tmp_path, "rl.steps=0", "sft.steps=3"))
    assert signal.getsignal(signal.SIGTERM) == handler
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["phase"] == "sft"] == [1, 3]


def test_overlap_records_the_sampler_programs_of_its_own_steps(tmp_path, monkeypatch):
    """`sampler/compiled_programs` is counted on the producer's thread when the step's sampling ends, so it
    does not depend on how long the update takes. Here every update outlasts the next rollout's sampling, and a
    stand-in counter counts sampler calls: one more each step."""
    calls, real_sample, real_update = [], generate.sample, rl.rl_update

    def counted_sample(*args, **kwargs):
        out = real_sample(*args, **kwargs)
        calls.append(threading.current_thread().name)
        return out

    def slow_update(state, step_fn, batch, controls, config, step, *args, **kwargs):
        out = real_update(state, step_fn, batch, controls, config, step, *args, **kwargs)
        deadline = time.time() + 120
        while (step < config.rl.steps and sum(name.startswith("jaxrl-rollout") for name in calls) < step
               and time.time() < deadline):
            time.sleep(0.01)  # the rollout of step + 1 has sampled
        return out

    monkeypatch.setattr(generate, "sample", counted_sample)
    monkeypatch.setattr(producer, "compiled_programs", lambda: len(calls))
    monkeypatch.setattr(rl, "rl_update", slow_update)
    loop.run(_config(tmp_path, "rl.overlap=true", "rl.steps=3", "sft.steps=0", "rl.minibatches=1",
                     "rl.micro_batches=1", "rl.sampling.max_new_tokens=8"))
    counts = [r["sampler/compiled_programs"] for r in read_metrics(tmp_path / "metrics.jsonl")
              if "sampler/compiled_programs" in r]
    assert len(counts) == 3 and [b - a for a, b in zip(counts, counts[1:])] == [1, 1], counts


def test_sigterm_to_one_process_of_a_multi_process_run_stops_every_process_after_the_same_step(tmp_path):
    """A preemption notice reaches the processes of a job at different times, here only process 0: they agree
    on the step to stop after, save its checkpoint together and all exit 143 (not: one saving alone while
    the other goes on, which crashed and hung the job without a checkpoint)."""
    out = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONFAULTHANDLER": "1",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"}
    overrides = [*TINY, "reward.num_workers=1", "sft.steps=2", "rl.steps=500", "rl.minibatches=1",
                 "rl.micro_batches=1", "rl.sampling.max_new_tokens=8", "checkpoint.every=0", "mesh.data=-1",
                 f"output_dir={out}", f"distributed.coordinator_address=localhost:{port}",
                 "distributed.num_processes=2"]
    logs = [tmp_path / f"process_{i}.log" for i in range(2)]  # files, not pipes: nothing blocks on a full pipe
    processes = []
    for i, log in enumerate(logs):
        with open(log, "w") as stderr:  # the process keeps its own copy
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "jaxrl.cli", "train", "configs/default.yaml", *overrides,
                 f"distributed.process_id={i}"], cwd=os.path.dirname(HERE), env=env, stdout=subprocess.DEVNULL,
                stderr=stderr))
    try:
        def training() -> bool:
            path = out / "metrics.jsonl"
            return path.exists() and any("reward/mean" in r for r in read_metrics(path, torn_tail_ok=True))

        deadline = time.time() + 240
        while time.time() < deadline and all(p.poll() is None for p in processes) and not training():
            time.sleep(0.05)  # until RL is under way
        processes[0].send_signal(signal.SIGTERM)
        try:
            for p in processes:
                p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            for p in processes:
                p.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER: each log ends with where it waited
                p.wait(timeout=30)
            pytest.fail("the processes did not stop:\n" + "\n".join(log.read_text()[-3000:] for log in logs))
    finally:
        for p in processes:
            p.kill()
    stderrs = [log.read_text() for log in logs]
    for p, stderr in zip(processes, stderrs):
        assert p.returncode == 143, stderr[-3000:]
    stopped = {stderr.split("stopped by SIGTERM after RL step ")[1].split(";")[0] for stderr in stderrs}
    assert len(stopped) == 1 and Checkpointer.newest(out / "checkpoints") == int(stopped.pop())


def test_without_warm_start_steps_there_is_no_warm_start_bar_or_wording(tmp_path, caplog, capsys):
    """sft.steps=0: no warm-start progress, and the first evaluation is "before RL", not "after the warm
    start". stderr is not a terminal here, so RL's progress is plain lines (no carriage-return redraws)."""
    caplog.set_level(logging.INFO, logger="jaxrl")
    loop.run(_config(tmp_path, "sft.steps=0", "rl.steps=2", "progress=true", "eval.every=0",
                     "rl.sampling.max_new_tokens=8", "rl.minibatches=1", "rl.micro_batches=1"))
    err = capsys.readouterr().err
    assert "warm start" not in err and "\r" not in err
    assert "held-out greedy accuracy before RL" in caplog.text and "after the warm start" not in caplog.text
    lines = [line for line in err.splitlines() if line.startswith("RL: ")]
    assert [line.split(" (")[0] for line in lines] == ["RL: 1/2", "RL: 2/2"] and "reward=" in lines[-1], err


def test_log_lines_write_every_tenth_of_the_steps_or_interval_and_the_last():
    """Progress for a log file (SLURM): a line when a tenth of the steps or `interval_s` passed, and the last."""
    import io

    now = [0.0]
    out = io.StringIO()
    bar = progress.LogLines(range(1, 31), "RL", total=30, interval_s=30.0, file=out, clock=lambda: now[0])
    for step in bar:
        bar.set_postfix(reward=f"{step / 10:.2f}")
        now[0] += 40.0 if step == 7 else 0.1  # step 7 is slow: a line after it for the time
    assert out.getvalue().splitlines() == ["RL: 3/30 (10%) reward=0.30", "RL: 6/30 (20%) reward=0.60",
                                           "RL: 7/30 (23%) reward=0.70", "RL: 10/30 (33%) reward=1.00",
                                           "RL: 13/30 (43%) reward=1.30", "RL: 16/30 (53%) reward=1.60",
                                           "RL: 19/30 (63%) reward=1.90", "RL: 22/30 (73%) reward=2.20",
                                           "RL: 25/30 (83%) reward=2.50", "RL: 28/30 (93%) reward=2.80",
                                           "RL: 30/30 (100%) reward=3.00"]
    resumed = progress.LogLines(range(26, 31), "RL", total=30, initial=25, file=out)
    assert resumed.every == 1  # a tenth of the steps still to run, at least one
