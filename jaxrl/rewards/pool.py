"""Process pool that scores completions with hard per-item timeouts.

Reward functions run model-generated text through parsers (sympy, regexes...)
that can hang, blow up memory or crash. ``RewardPool`` runs them in separate
"spawn" processes (the parent runs multi-threaded JAX, so fork is unsafe):

* the parent hands one item at a time to each idle worker and waits with
  ``multiprocessing.connection.wait``;
* a worker still busy ``timeout_s`` after its item was dispatched is killed and
  replaced, and the item scores 0 (a *timeout*). Killing is SIGTERM, which
  raises an exception in the worker so the reward code's ``finally`` blocks
  run (``code_reward`` kills its sandboxed program and removes its temp dir),
  then SIGKILL after a short grace;
* inside a worker, ``item_deadline()`` tells the reward function when its item
  will be killed, so it can stop in time (``code_reward`` does);
* an item that raises, returns a non-finite / non-numeric value, or kills its
  worker scores 0 (an *error*); dead workers are replaced;
* a reward function with a ``warm_up`` attribute (a callable of no arguments)
  has it called once in each worker before the worker reports ready, outside
  every timeout: import heavy modules there (``math_verify`` and
  ``arithmetic_reward`` load sympy's parser, which otherwise costs the first
  symbolic answer of each worker 0.2-0.7 s on a 2-core CPU, and more where
  sympy's bytecode is not cached). A ``warm_up`` that raises stops the pool;
* optionally (``batch_timeout_s``), the whole ``score()`` call has a hard
  budget: when it runs out, every item not yet finished -- running *or* still
  queued -- scores 0 as a timeout and the busy workers are killed and replaced,
  so a batch made only of hanging items costs about one ``batch_timeout_s``
  instead of ``ceil(N / num_workers) * timeout_s``.

Workers start lazily on the first ``score()`` and are reused across calls.
They die with the pool: the kernel SIGKILLs each one when the pool's own
spawning thread ends (``close()``, or the parent dying in any way, SIGKILL
included), so a worker hung on an item never outlives a crashed trainer.
The pool is not thread-safe: call ``score()`` from one thread at a time.

Example::

    with RewardPool(math_verify, num_workers=4, timeout_s=2.0) as pool:
        result = pool.score(completions, references)
        log(result.metrics())
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import numbers
import pickle
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import wait

import numpy as np

from jaxrl.rewards.sandbox_child import die_with_parent

__all__ = ["RewardPool", "RewardResult", "item_deadline"]

log = logging.getLogger(__name__)

_READY = "ready"
# Seconds a fresh worker may take to import its modules and report ready.
_STARTUP_TIMEOUT_S = 60.0
# Seconds to wait for a terminated worker before escalating to SIGKILL.
_KILL_GRACE_S = 0.2

# In a worker: time.monotonic() by which the parent kills the item being scored.
_item_deadline = math.inf
_FLOAT32_MAX = float(np.finfo(np.float32).max)  # a larger reward would become inf in the float32 result


def item_deadline() -> float:
    """``time.monotonic()`` by which ``RewardPool`` kills the item being scored; inf outside a worker.

    Measured from when the worker received the item, so slightly later than the parent's own clock:
    keep a margin.
    """
    return _item_deadline


@dataclasses.dataclass(frozen=True, eq=False)
class RewardResult:
    """Outcome of one ``RewardPool.score`` call.

    Attributes:
      rewards: [N] float32; 0.0 for any item that timed out, raised, crashed its
        worker or returned a non-numeric value or one that is not finite in float32.
      timeouts: items killed at their deadline.
      errors: items that raised, returned garbage, or crashed their worker.
      seconds: wall time of the whole ``score()`` call.
    """

    rewards: np.ndarray
    timeouts: int
    errors: int
    seconds: float

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Scalars for logging: ``{prefix}mean``, ``std``, ``timeouts``, ``errors``, ``seconds``."""
        n = self.rewards.size
        return {
            f"{prefix}mean": float(self.rewards.mean()) if n else 0.0,
            f"{prefix}std": float(self.rewards.std()) if n else 0.0,
            f"{prefix}timeouts": float(self.timeouts),
            f"{prefix}errors": float(self.errors),
            f"{prefix}seconds": float(self.seconds),
        }


class _Terminated(BaseException):
    """Raised in a worker by SIGTERM, so that the reward code unwinds (and cleans up) before it exits."""


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the cleanup short
    raise _Terminated


def _worker_main(conn, reward_fn: Callable[[str, str], float], parent_pid: int) -> None:
    """Worker loop: recv ``(index, completion, reference, budget_s)``, send ``(index, ok, value)``.

    ``value`` is the float reward when ``ok`` else a short error string. A
    ``None`` message (or a closed pipe) ends the loop, and so does SIGTERM,
    after unwinding the reward function. The worker is SIGKILLed when the thread
    that started it ends: a closed pipe is only noticed between items.
    """
    global _item_deadline
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business.
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        die_with_parent()
    except OSError:
        pass  # no parent-death signal: the worker ends at the next item instead
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        return
    try:
        warm_up = getattr(reward_fn, "warm_up", None)
        if callable(warm_up):  # before "ready": slow first imports are not charged to an item's timeout
            warm_up()
        conn.send(_READY)
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            index, completion, reference, budget_s = msg
            _item_deadline = time.monotonic() + budget_s
            try:
                value = reward_fn(completion, reference)
                if not isinstance(value, (numbers.Real, np.bool_)):  # np.bool_ is no numbers.Real
                    raise TypeError(f"reward_fn returned {type(value).__name__}, not a number")
                value = float(value)
                if not math.isfinite(value):
                    raise ValueError(f"reward_fn returned non-finite {value}")
                reply = (index, True, value)
            except _Terminated:
                raise
            except BaseException as e:  # noqa: BLE001 - includes SystemExit from reward_fn
                try:
                    reason = f"{type(e).__name__}: {e}"[:500]
                except BaseException:  # noqa: BLE001 - a broken __str__
                    reason = type(e).__name__
                reply = (index, False, reason)
            finally:
                _item_deadline = math.inf
            conn.send(reply)
    except _Terminated:
        return


def _as_text(x) -> str:
    """Coerce a completion/reference to ``str`` (bytes are decoded leniently)."""
    if isinstance(x, str):
        return x
    if isinstance(x, (bytes, bytearray)):
        return bytes(x).decode("utf-8", errors="replace")
    return str(x)


def _encode_item(index: int, completion, reference, budget_s: float) -> bytes | None:
    """Pickle one work item; lone surrogates are replaced if they cannot be sent."""
    try:
        item = (index, _as_text(completion), _as_text(reference))
        try:
            return pickle.dumps((*item, budget_s), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001
            clean = [s.encode("utf-8", "replace").decode("utf-8") for s in item[1:]]
            return pickle.dumps((index, *clean, budget_s), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - e.g. a __str__ that raises
        return None


class _Worker:
    """One spawned worker process and the parent's end of its pipe."""

    def __init__(self, ctx, reward_fn: Callable[[str, str], float]):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, reward_fn, os.getpid()), daemon=True, name="reward-worker"
        )
        self.process.start()
        child_conn.close()
        self.ready = False
        self.started = time.monotonic()
        self.index: int | None = None  # item being scored, None when idle
        self.deadline = math.inf
        self.killed = False

    def dispatch(self, index: int, payload: bytes, timeout_s: float) -> None:
        self.conn.send_bytes(payload)
        self.index, self.deadline = index, time.monotonic() + timeout_s

    def kill(self) -> None:
        """Stop the process (terminate, then kill) and release its resources. Idempotent."""
        if self.killed:
            return
        self.killed = True
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(_KILL_GRACE_S)
            if self.process.is_alive():
                self.process.kill()
        self.process.join()
        self.conn.close()
        self.process.close()


class RewardPool:
    """Scores ``(completion, reference)`` pairs in worker processes with timeouts.

    Args:
      reward_fn: picklable module-level function ``(completion, reference) -> float``.
      num_workers: number of worker processes (>= 1).
      timeout_s: per-item wall-clock limit in seconds (> 0), counted from
        dispatch to a ready worker. Without a batch budget, N items that all
        hang take about ``ceil(N / num_workers) * timeout_s`` (plus restarts).
      batch_timeout_s: optional hard budget in seconds (> 0) for a whole
        ``score()`` call. ``None`` (default) keeps pure per-item semantics.
        The clock starts when the call has a ready worker (so spawning workers
        on the first call or after a crash is not charged to the batch); once
        it runs out, every unfinished item -- running or never dispatched --
        scores 0 and counts as a timeout, and busy workers are killed and
        replaced (replacements start in the background for the next call).
        Per-item ``timeout_s`` still applies inside the budget, so a
        hang costs ``min(timeout_s, remaining budget)``.

        Design: a single deadline rather than extra temporary workers keeps
        the process count fixed and the worst case obvious (about
        ``batch_timeout_s`` + one kill, whatever N is). The price is that
        the budget must cover a *normal* batch: fast items that are merely
        queued are only zeroed if the budget itself is too small, so choose
        it >= ``timeout_s`` plus the usual time of a healthy batch (about
        ``N / num_workers`` x typical item time). 128 sub-millisecond
        ``math_verify`` items on 2 workers take well under 0.5 s.
    """

    def __init__(
        self,
        reward_fn: Callable[[str, str], float],
        *,
        num_workers: int = 2,
        timeout_s: float = 2.0,
        batch_timeout_s: float | None = None,
    ):
        if not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}")
        if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        if batch_timeout_s is not None and (
            isinstance(batch_timeout_s, bool)
            or not isinstance(batch_timeout_s, (int, float))
            or not 0 < batch_timeout_s < math.inf
        ):
            raise ValueError(
                f"batch_timeout_s must be None or a finite number > 0, got {batch_timeout_s!r}"
            )
        try:
            pickle.dumps(reward_fn)
        except Exception as e:
            raise TypeError(
                f"reward_fn must be picklable (a module-level function) to run in spawned "
                f"workers: {e}"
            ) from e
        self.reward_fn = reward_fn
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.batch_timeout_s = None if batch_timeout_s is None else float(batch_timeout_s)
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        # Workers die with the thread that started them (see _worker_main): start them all on this one,
        # which lives as long as the pool, not on whichever thread (perhaps short-lived) calls score().
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="reward-pool-spawner")
        self._closed = False

    # -- lifecycle -------------------------------------------------------------

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop all workers. Idempotent; the pool cannot be used afterwards."""
        self._closed = True
        workers, self._workers = self._workers, []
        for w in workers:
            if w.index is None:
                try:
                    w.conn.send(None)  # polite shutdown for idle workers
                except (OSError, ValueError):
                    pass
        for w in workers:
            w.process.join(0.5 if w.index is None else 0)
            w.kill()
        self._spawner.shutdown()

    def _new_worker(self) -> _Worker:
        return self._spawner.submit(_Worker, self._ctx, self.reward_fn).result()

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = self._new_worker()

    # -- scoring ---------------------------------------------------------------

    def score(self, completions: Sequence[str], references: Sequence[str]) -> RewardResult:
        """Rewards for ``completions[i]`` against ``references[i]``.

        Args:
          completions: N completion strings.
          references: N reference answers.

        Returns:
          ``RewardResult`` with ``rewards`` of shape [N] (float32).
        """
        start = time.monotonic()
        if len(completions) != len(references):
            raise ValueError(
                f"completions and references must have the same length, got "
                f"len(completions)={len(completions)} and len(references)={len(references)}"
            )
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        n = len(completions)
        rewards = np.zeros(n, dtype=np.float32)
        timeouts = errors = 0
        pending = deque(range(n))
        for w in list(self._workers):
            if w.index is not None:  # left busy by an interrupted call: results are stale
                self._replace(w)
        if n:
            while len(self._workers) < self.num_workers:
                self._workers.append(self._new_worker())

        # Hard deadline of the whole call (batch_timeout_s); set once a worker is ready.
        batch_deadline = math.inf

        while pending or any(w.index is not None for w in self._workers):
            if batch_deadline == math.inf and self.batch_timeout_s is not None:
                if any(w.ready for w in self._workers):
                    batch_deadline = time.monotonic() + self.batch_timeout_s
            if time.monotonic() >= batch_deadline:
                # Budget spent: everything unfinished is a timeout. Signal every
                # busy worker first so their kill grace periods overlap.
                for w in self._workers:
                    if w.index is not None and w.process.is_alive():
                        w.process.terminate()
                for w in list(self._workers):
                    if w.index is not None:
                        log.debug("reward item %d hit the batch deadline", w.index)
                        timeouts += 1
                        self._replace(w)
                timeouts += len(pending)
                pending.clear()
                break

            # 1. Hand out work to idle, ready workers.
            for w in self._workers:
                while w.ready and w.index is None and pending:
                    i = pending.popleft()
                    budget_s = min(self.timeout_s, batch_deadline - time.monotonic())
                    payload = _encode_item(i, completions[i], references[i], budget_s)
                    if payload is None:
                        errors += 1
                        continue
                    try:
                        w.dispatch(i, payload, self.timeout_s)
                    except (OSError, ValueError):  # worker died while idle: retry later
                        pending.appendleft(i)
                        self._replace(w)
                        break

            # 2. Wait for a result, a death, a ready signal, or the next deadline.
            waiting = [w for w in self._workers if w.index is not None or not w.ready]
            now = time.monotonic()
            deadlines = [
                w.deadline if w.ready else w.started + _STARTUP_TIMEOUT_S for w in waiting
            ]
            if waiting:
                deadlines.append(batch_deadline)
            timeout = max(0.0, min(deadlines, default=now) - now)
            handles = [w.conn for w in waiting] + [w.process.sentinel for w in waiting]
            ready = set(wait(handles, timeout=timeout))

            # 3. Collect results, detect deaths and expired deadlines.
            now = time.monotonic()
            for w in waiting:
                msg, died = None, False
                if w.conn in ready or w.process.sentinel in ready:
                    try:
                        if w.conn.poll():
                            msg = w.conn.recv()
                    except Exception:  # noqa: BLE001 - EOF (worker died) or a corrupt stream
                        died = True
                    died = died or (msg is None and not w.process.is_alive())
                if not w.ready:
                    if msg == _READY:
                        w.ready = True
                    elif died or now >= w.started + _STARTUP_TIMEOUT_S:
                        w.process.join(_KILL_GRACE_S)
                        reason = (
                            f"exit code {w.process.exitcode}" if died else "startup timed out"
                        )
                        self.close()
                        raise RuntimeError(
                            f"reward worker failed to start ({reason}); is reward_fn "
                            "importable in a fresh process, and is the main script guarded by "
                            "`if __name__ == '__main__':`?"
                        )
                    continue
                if isinstance(msg, tuple) and len(msg) == 3 and msg[0] == w.index:
                    _, ok, value = msg
                    if ok and isinstance(value, float) and abs(value) <= _FLOAT32_MAX:  # nan fails too
                        rewards[w.index] = value
                    else:
                        errors += 1
                        log.debug("reward item %d failed: %s", w.index, value)
                    w.index, w.deadline = None, math.inf
                elif died or msg is not None:
                    errors += 1
                    log.debug("reward worker died on item %d", w.index)
                    self._replace(w)
                elif now >= w.deadline:
                    timeouts += 1
                    log.debug("reward item %d timed out after %.2fs", w.index, self.timeout_s)
                    self._replace(w)

        return RewardResult(rewards, timeouts, errors, time.monotonic() - start)
