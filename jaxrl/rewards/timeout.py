"""A hard wall-clock limit for one call of a reward function, outside the worker pool.

`RewardPool` already bounds every item of a batch by killing its worker. This module bounds a single
direct call (a notebook checking one completion): in the main thread of a Unix process it arms a real-time
interval timer whose SIGALRM interrupts the Python code (reward code guards the few C-level operations a
signal cannot interrupt, e.g. huge powers), though never an import in progress, which would leave its
module broken for the rest of the process: the deadline then falls as soon as the import ends. Anywhere
else (another thread, a timer already armed, no SIGALRM) it runs the call in a spawned process and kills it
at the deadline.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
from collections.abc import Callable
from typing import Any


class _Deadline(BaseException):
    """Raised by the alarm; a BaseException so that the reward code's `except Exception` cannot swallow it."""


def _can_use_alarm() -> bool:
    return (hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
            and signal.getitimer(signal.ITIMER_REAL)[0] == 0.0)


# While an import is running the deadline waits this long and looks again: a module interrupted mid-import
# stays half-initialised in sys.modules for the rest of the process (a first sympy import takes ~1 s).
_IMPORT_RETRY_S = 0.01


def _inside_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _call_with_alarm(fn: Callable[..., Any], args: tuple, timeout_s: float, default: Any) -> Any:
    def on_alarm(signum, frame):
        if _inside_import(frame):
            signal.setitimer(signal.ITIMER_REAL, _IMPORT_RETRY_S)
            return
        raise _Deadline

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return fn(*args)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
    except _Deadline:
        return default
    finally:
        signal.signal(signal.SIGALRM, previous)


_STARTED = "started"
_START_TIMEOUT_S = 60.0  # a spawned interpreter importing the reward code; not part of the call's budget


def _child(conn, fn, args) -> None:
    conn.send(_STARTED)
    try:
        conn.send(("ok", fn(*args)))
    except Exception:  # noqa: BLE001 - the parent returns its default
        conn.send(("error", None))


def _call_in_process(fn: Callable[..., Any], args: tuple, timeout_s: float, default: Any) -> Any:
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(send, fn, args), daemon=True)
    process.start()
    send.close()
    try:
        try:
            started = receive.poll(_START_TIMEOUT_S) and receive.recv() == _STARTED
        except EOFError:
            started = False
        if not started:
            process.join(1.0)
            raise RuntimeError(f"the process running {getattr(fn, '__name__', fn)!r} under a timeout failed to "
                               f"start (exit code {process.exitcode}); is it importable in a fresh process, and "
                               "is the main script guarded by `if __name__ == '__main__':`?")
        if not receive.poll(timeout_s):
            return default
        status, result = receive.recv()
        return result if status == "ok" else default
    except EOFError:  # the call crashed its process
        return default
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        receive.close()


def call_with_timeout(fn: Callable[..., Any], args: tuple, timeout_s: float, default: Any) -> Any:
    """`fn(*args)`, or `default` if it has not returned after `timeout_s` seconds (or raised, in a process).

    `fn` and `args` must be picklable (module-level function, plain values) for the process path.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if _can_use_alarm():
        return _call_with_alarm(fn, args, timeout_s, default)
    return _call_in_process(fn, args, timeout_s, default)
