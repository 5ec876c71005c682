"""Progress of the warm start and of RL: a redrawn bar on a terminal, plain lines in a log file.

A batch job's stderr (SLURM, a redirect) is not a terminal: there a carriage-return bar becomes one huge
line, so `steps` writes a line at most every `interval_s` seconds or every tenth of the steps, and the last.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator

from tqdm.auto import tqdm


class LogLines:
    """An iterable over `steps` that prints `<desc>: <i>/<total> (<pct>%) key=value ...` to `file` after a step
    when `interval_s` seconds or a tenth of the steps passed since the last line, and after the last step.
    `set_postfix(**values)` sets the key=value part, as on a tqdm bar."""

    def __init__(self, steps: Iterable[int], desc: str, total: int, initial: int = 0, interval_s: float = 30.0,
                 file=None, clock=time.monotonic):
        self.steps, self.desc, self.total, self.initial = steps, desc, total, initial
        self.interval_s, self.file, self.clock = interval_s, file, clock
        self.every = max(1, (total - initial) // 10)
        self.postfix: dict[str, str] = {}

    def set_postfix(self, values: dict[str, str] | None = None, **kwargs) -> None:
        self.postfix = {**(values or {}), **kwargs}

    def __iter__(self) -> Iterator[int]:
        last_time, last_done = self.clock(), self.initial
        for done, step in enumerate(self.steps, start=self.initial + 1):
            yield step
            if done == self.total or done - last_done >= self.every or self.clock() - last_time >= self.interval_s:
                self._write(done)
                last_time, last_done = self.clock(), done

    def _write(self, done: int) -> None:
        values = " ".join(f"{k}={v}" for k, v in self.postfix.items())
        percent = 100 * done // max(self.total, 1)
        print(f"{self.desc}: {done}/{self.total} ({percent}%) {values}".rstrip(), file=self.file or sys.stderr,
              flush=True)


def bars(enabled: bool) -> bool:
    """Whether byte-counting bars (loading and saving checkpoints) are drawn: `progress` is on and stderr is a
    terminal (in a log file their redraws would be one huge line; the load or save is logged instead)."""
    return enabled and sys.stderr.isatty()


def steps(first: int, last: int, desc: str, enabled: bool, total: int | None = None):
    """Steps `first..last` (inclusive) with progress: a tqdm bar on a terminal, `LogLines` otherwise, nothing
    when `enabled` is false or there is no step to run. `total`: the run's step count (default `last`)."""
    total = last if total is None else total
    numbers = range(first, last + 1)
    if not enabled or not numbers:
        return tqdm(numbers, disable=True)  # set_postfix is a no-op
    if sys.stderr.isatty():
        return tqdm(numbers, desc=desc, dynamic_ncols=True, initial=first - 1, total=total)
    return LogLines(numbers, desc, total, initial=first - 1)
