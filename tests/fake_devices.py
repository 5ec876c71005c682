"""Run a test script in a fresh process that sees 8 fake CPU devices (`--xla_force_host_platform_device_count`):
the device count is fixed when JAX starts, so multi-device checks cannot run in the test process itself."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_on_eight_devices(script: str, timeout: float = 600) -> None:
    """Run `script` (Python source that prints "OK" when its checks pass) on 8 fake CPU devices; fail with the
    end of its stderr otherwise."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
           "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=os.path.dirname(HERE),
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
