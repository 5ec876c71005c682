"""A two-process run on localhost: JAX's multi-controller runtime (`jax.distributed`, CPU collectives over
gloo) trains a few steps of the default recipe; both processes must record the same metrics."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Per-process values: wall times, and the first decoded completion, which each process takes from its rows.
LOCAL_FIELDS = ("time/", "eval/seconds", "eval/sample", "reward/seconds")
TIMEOUT_S = 170  # the run takes about 40 s on a 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _records(path):
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(LOCAL_FIELDS)} for line in f]


def test_two_processes_train_the_default_recipe_and_agree(tmp_path):
    out = tmp_path / "run"
    (out / "process_1").mkdir(parents=True)  # an earlier run's records: a fresh run starts them empty
    (out / "process_1" / "metrics.jsonl").write_text('{"phase": "rl", "step": 99}\n')
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2",
           "PYTHONFAULTHANDLER": "1"}  # SIGABRT prints every thread's Python stack: where a hung run waits
    overrides = [f"output_dir={out}", "progress=false", "sft.steps=40", "rl.steps=3", "eval.every=2",
                 "task.num_eval=32", "eval.batch_size=16", "checkpoint.every=2", "reward.num_workers=1",
                 "mesh.data=-1", "mesh.fsdp=2",  # 4 devices over 2 processes: data 2 (across) x fsdp 2 (within)
                 f"distributed.coordinator_address=localhost:{port}", "distributed.num_processes=2"]
    processes = [subprocess.Popen([sys.executable, "-m", "jaxrl.cli", "train", "configs/default.yaml", *overrides,
                                   f"distributed.process_id={i}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        results = [p.communicate(timeout=TIMEOUT_S) for p in processes]
    except subprocess.TimeoutExpired:
        for p in processes:
            p.send_signal(signal.SIGABRT)
        stacks = [p.communicate(timeout=30)[1][-6000:] for p in processes]
        pytest.fail(f"the two processes did not finish in {TIMEOUT_S} s; their stacks:\n" + "\n\n".join(
            f"process {i}:\n{stderr}" for i, stderr in enumerate(stacks)))
    finally:
        for p in processes:
            p.kill()
    for i, (p, (stdout, stderr)) in enumerate(zip(processes, results)):
        assert p.returncode == 0, f"process {i}:\n{stdout[-2000:]}\n{stderr[-4000:]}"

    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
    assert len(summary["devices"]) == 4
    primary, other = _records(out / "metrics.jsonl"), _records(out / "process_1" / "metrics.jsonl")
    assert len(primary) == len(other) > 0
    assert primary == other, next((a, b) for a, b in zip(primary, other) if a != b)
    rl = [r for r in primary if r["phase"] == "rl" and "train/loss" in r]
    assert len(rl) == 3 and all(0.0 <= r["reward/mean"] <= 1.0 for r in rl)
    assert any("eval/accuracy" in r for r in rl), "the mid-run evaluation ran on both processes"
    assert (out / "checkpoints" / "3").is_dir() and (out / "checkpoints" / "2").is_dir()
