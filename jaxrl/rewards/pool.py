"""Process pool that scores completions with hard per-item timeouts.

Reward functions run model-generated text through parsers (sympy, regexes...)
that can hang, blow up memory or crash. ``RewardPool`` runs them in separate
"spawn" processes (the parent runs multi-threaded JAX, so fork is unsafe):

* the parent hands one item (of a batched reward: one chunk, see below) at a
  time to each idle worker and waits with ``multiprocessing.connection.wait``;
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

What a reward function receives (see ``jaxrl.registry.reward_arguments``): a
*per-item* reward takes any of ``prompt, completion, reference, row`` by name
and returns a float; a *batched* reward takes any of ``prompts, completions,
references, rows`` (lists) and returns a sequence of floats of the same length
(a list, a tuple or a 1-D array). The pool passes only the arguments the
function takes; prompts, completions and references arrive as ``str``, rows as
the caller gave them (one data row each, e.g. a dict of its fields).

A reward may be a class: one instance is created in each worker (without
arguments) before the worker reports ready, outside every timeout, like
``warm_up`` (its own ``warm_up``, if any, runs after it); the instance is then
called with each item or chunk. Load a reward model or connect to a locally
served judge in ``__init__``. A worker replaced after a timeout or a crash
creates a new instance; a constructor that raises stops the pool.

Batched rewards get *chunks*: the N items of a ``score()`` call are split into
contiguous chunks of at most ``batch_size`` items, their number a multiple of
``num_workers`` where N allows (so that every worker gets work), sizes
differing by at most one. Each chunk is one job for one worker, with a budget
of ``timeout_s x len(chunk)``: ``timeout_s`` keeps meaning seconds per
completion whichever form the reward takes, so neither ``batch_size`` nor the
number of workers changes whether a healthy batch fits its budget, and the
worst case of a hanging reward stays ``ceil(N / num_workers) * timeout_s``
without ``batch_timeout_s``, as for per-item rewards. Failures are counted per
item: a chunk that times out counts each of its items as a timeout; one that
raises, kills its worker, or returns something that is not a sequence of
``len(chunk)`` entries counts each of its items as an error; an entry that is
not a number, or not finite in float32, is an error for that item only (the
chunk's other items keep their rewards). ``batch_timeout_s`` applies to the
whole call as for per-item rewards.

Workers start lazily on the first ``score()`` and are reused across calls.
They die with the pool: the kernel SIGKILLs each one when the pool's own
spawning thread ends (``close()``, or the parent dying in any way, SIGKILL
included), so a worker hung on an item never outlives a crashed trainer.
The pool is not thread-safe: call ``score()`` from one thread at a time.

Example::

    with RewardPool(math_verify, num_workers=4, timeout_s=2.0) as pool:
        result = pool.score(completions, references)
        log(result.metrics())

    with RewardPool(my_rewards.Judge, num_workers=1, timeout_s=0.5, batch_size=32) as pool:
        result = pool.score(completions, references, prompts=prompts, rows=rows)
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import multiprocessing
import numbers
import pickle
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import wait

import numpy as np

from jaxrl.registry import reward_arguments
from jaxrl.rewards.sandbox_child import die_with_parent

__all__ = ["Outcome", "PoolOwner", "RewardPool", "RewardResult", "WorkerPool", "encode_job", "item_deadline"]

log = logging.getLogger(__name__)

_READY = "ready"
_FAILED = "failed"  # a worker's startup (warm_up, a reward class's constructor) raised: ("failed", reason)
# Seconds a fresh worker may take by default to import its modules, warm up (and create its reward instance).
_STARTUP_TIMEOUT_S = 60.0
# Seconds to wait for a terminated worker before escalating to SIGKILL.
_KILL_GRACE_S = 0.2

# In a worker: time.monotonic() by which the parent kills the item being scored.
_item_deadline = math.inf
_FLOAT32_MAX = float(np.finfo(np.float32).max)  # a larger reward would become inf in the float32 result


def item_deadline() -> float:
    """``time.monotonic()`` by which ``RewardPool`` kills the item (or a batched reward's chunk) being scored;
    inf outside a worker.

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
      first_failure: what went wrong with the first item that failed (e.g. the exception the reward raised), or
        None when none did.
    """

    rewards: np.ndarray
    timeouts: int
    errors: int
    seconds: float
    first_failure: str | None = None

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


def _reason(e: BaseException) -> str:
    try:
        return f"{type(e).__name__}: {e}"[:500]
    except BaseException:  # noqa: BLE001 - a broken __str__
        return type(e).__name__


def _as_reward(value) -> float:
    """A reward function's value as a float; TypeError / ValueError for a non-number or a non-finite one."""
    if not isinstance(value, (numbers.Real, np.bool_)):  # np.bool_ is no numbers.Real
        raise TypeError(f"reward_fn returned {type(value).__name__}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward_fn returned non-finite {value}")
    return value


def _as_rewards(values, n: int) -> list[float]:
    """A batched reward's output as `n` floats, NaN for each entry that is not a number (the parent counts
    those, and non-finite ones, as that item's error); TypeError / ValueError for anything but a sequence of
    `n` entries (the whole chunk's error)."""
    if hasattr(values, "__array__") and not isinstance(values, (str, bytes)):  # numpy, jax, torch (CPU)
        array = np.asarray(values)
        if array.ndim != 1 or array.dtype.kind not in "biuf":
            raise TypeError(f"batched reward_fn returned an array of shape {array.shape} and dtype {array.dtype}; "
                            f"expected {n} numbers")
        values = array.tolist()
    if isinstance(values, (str, bytes, bytearray, Mapping)) or not isinstance(values, Sequence):
        raise TypeError(f"batched reward_fn returned {type(values).__name__}, not a sequence of {n} numbers")
    if len(values) != n:
        raise ValueError(f"batched reward_fn returned {len(values)} values for {n} items")
    out = []
    for v in values:
        try:
            out.append(_as_reward(v))
        except (TypeError, ValueError, OverflowError):
            out.append(math.nan)
    return out


class _RewardSetup:
    """What a reward worker builds before it reports ready (see `WorkerPool`'s `setup`): the reward (one
    instance of a reward class), warmed up; returns the handler that scores one job's arguments."""

    def __init__(self, reward_fn: Callable, batched: bool):
        self.reward_fn, self.batched = reward_fn, batched

    def __call__(self) -> Callable:
        reward_fn = self.reward_fn() if inspect.isclass(self.reward_fn) else self.reward_fn  # one per worker
        warm_up = getattr(reward_fn, "warm_up", None)
        if callable(warm_up):
            warm_up()
        batched = self.batched

        def handle(arguments: dict):
            value = reward_fn(**arguments)
            return _as_rewards(value, len(arguments["completions"])) if batched else _as_reward(value)

        return handle


def _worker_main(conn, setup: Callable, parent_pid: int) -> None:
    """Worker loop: build the handler (``setup()``), then recv ``(job, arguments, budget_s)``, send
    ``(job, ok, value)``.

    ``value`` is what ``handler(arguments)`` returned when ``ok``, else a short error string. A ``None``
    message (or a closed pipe) ends the loop, and so does SIGTERM, after unwinding the handler. The worker is
    SIGKILLed when the thread that started it ends: a closed pipe is only noticed between items.
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
        try:  # before "ready": slow first imports, model loads are not charged to an item's timeout
            handler = setup()
        except _Terminated:
            raise
        except BaseException as e:  # noqa: BLE001
            conn.send((_FAILED, _reason(e)))
            return
        conn.send(_READY)
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            job, arguments, budget_s = msg
            _item_deadline = time.monotonic() + budget_s
            try:
                reply = (job, True, handler(arguments))
            except _Terminated:
                raise
            except BaseException as e:  # noqa: BLE001 - includes SystemExit from the handler
                reply = (job, False, _reason(e))
            finally:
                _item_deadline = math.inf
            try:
                conn.send(reply)
            except _Terminated:
                raise
            except Exception as e:  # noqa: BLE001 - a value that cannot be pickled: the job's error
                conn.send((job, False, f"returned a value that cannot be sent: {_reason(e)}"))
    except _Terminated:
        return


def _as_text(x) -> str:
    """Coerce a completion/reference/prompt to ``str`` (bytes are decoded leniently)."""
    if isinstance(x, str):
        return x
    if isinstance(x, (bytes, bytearray)):
        return bytes(x).decode("utf-8", errors="replace")
    return str(x)


def _clean(x):
    """``x`` with lone surrogates replaced in its strings (also inside lists), so that it can be sent."""
    if isinstance(x, str):
        return x.encode("utf-8", "replace").decode("utf-8")
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def _chunks(n: int, num_workers: int, batch_size: int) -> list[range]:
    """Contiguous chunks of `range(n)` for a batched reward: at most `batch_size` items each, their number a
    multiple of `num_workers` (at most n), sizes differing by at most one."""
    if n == 0:
        return []
    count = -(-n // batch_size)
    count = min(n, -(-count // num_workers) * num_workers)
    bounds = [n * i // count for i in range(count + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _takes_var_keyword(fn: Callable) -> bool:
    """Whether `fn` (a class: its `__call__`) takes `**kwargs`."""
    try:
        signature = inspect.signature(fn.__call__ if inspect.isclass(fn) else fn)
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())


class _Worker:
    """One spawned worker process and the parent's end of its pipe."""

    def __init__(self, ctx, setup: Callable, name: str):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child_conn, setup, os.getpid()), daemon=True,
                                   name=name)
        self.process.start()
        child_conn.close()
        self.ready = False
        self.started = time.monotonic()
        self.job: int | None = None  # job being run, None when idle
        self.deadline = math.inf
        self.killed = False

    def dispatch(self, job: int, payload: bytes, timeout_s: float) -> None:
        self.conn.send_bytes(payload)
        self.job, self.deadline = job, time.monotonic() + timeout_s

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


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What became of one job of `WorkerPool.run`.

    kind: ``ok`` (``value``: the handler's return value), ``raised`` (``value``: the exception, short),
      ``died`` (the worker died: ``value`` its exit code), ``timeout`` (killed at its own deadline: ``value``
      the seconds it had), ``batch_timeout`` (running when the call's budget ran out), ``queued_timeout``
      (never started before the budget ran out) or ``unsendable`` (its arguments could not be pickled).
    """

    kind: str
    value: object = None


def encode_job(job: int, arguments: dict, budget_s: float) -> bytes | None:
    """Pickle one job; lone surrogates are replaced if they cannot be sent; None if it cannot be pickled (a
    row holding an object that pickle refuses)."""
    try:
        return pickle.dumps((job, arguments, budget_s), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001
        try:
            clean = {name: _clean(value) for name, value in arguments.items()}
            return pickle.dumps((job, clean, budget_s), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001
            return None


class WorkerPool:
    """The one dispatch loop of the reward pool and the environment pool (`jaxrl.envs.pool.EnvPool`).

    Spawned workers each build a handler once (`setup()`, a picklable callable, outside every timeout) and
    then run jobs with it; `run` hands jobs out to ready workers, waits, kills a worker at its job's deadline
    or the call's budget and replaces dead or killed workers. What a job's value means is the caller's.

    Args:
      setup: picklable callable of no arguments, run once in each worker; returns `handler(arguments) -> value`.
      num_workers: worker processes (>= 1).
      startup_timeout_s: seconds a worker may take to import and run `setup` before the pool gives up.
      what: the pool's name in errors and process names ("reward", "environment").
      hint: (what raised in a failed `setup`, what to check when a worker died or hung while starting).
    """

    def __init__(self, setup: Callable, *, num_workers: int, startup_timeout_s: float, what: str,
                 hint: tuple[str, str]):
        self.setup, self.num_workers, self.startup_timeout_s = setup, num_workers, float(startup_timeout_s)
        self.what, self.hint = what, hint
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        # Workers die with the thread that started them (see _worker_main): start them all on this one,
        # which lives as long as the pool, not on whichever thread (perhaps short-lived) calls run().
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix=f"{what}-pool-spawner")

    def close(self) -> None:
        """Stop all workers. Idempotent."""
        workers, self._workers = self._workers, []
        for w in workers:
            if w.job is None:
                try:
                    w.conn.send(None)  # polite shutdown for idle workers
                except (OSError, ValueError):
                    pass
        for w in workers:
            w.process.join(0.5 if w.job is None else 0)
            w.kill()
        self._spawner.shutdown()

    def _new_worker(self) -> _Worker:
        return self._spawner.submit(_Worker, self._ctx, self.setup, f"{self.what}-worker").result()

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = self._new_worker()

    def run(self, n_jobs: int, encode: Callable[[int, float], bytes | None], timeout_of: Callable[[int], float],
            batch_timeout_s: float | None = None) -> tuple[list[Outcome], list[int]]:
        """Run jobs `0..n_jobs-1`: `(outcomes [n_jobs], the jobs in the order their outcomes were seen)`.

        `encode(job, budget_s)` pickles a job's message (`encode_job`) when it is handed out (`budget_s`: the
        seconds it has, which the worker's `item_deadline()` tells), or None when it cannot be sent;
        `timeout_of(job)` is its hard limit in seconds from dispatch. With `batch_timeout_s`, every job
        unfinished that long after the first worker is ready is cut off (busy workers are killed).
        Raises RuntimeError when a worker fails to start (the pool is closed).
        """
        outcomes: list[Outcome | None] = [None] * n_jobs
        order: list[int] = []

        def done(job: int, outcome: Outcome) -> None:
            outcomes[job] = outcome
            order.append(job)

        pending = deque(range(n_jobs))
        for w in list(self._workers):
            if w.job is not None:  # left busy by an interrupted call: results are stale
                self._replace(w)
        if n_jobs:
            while len(self._workers) < self.num_workers:
                self._workers.append(self._new_worker())

        # Hard deadline of the whole call (batch_timeout_s); set once a worker is ready.
        batch_deadline = math.inf

        while pending or any(w.job is not None for w in self._workers):
            if batch_deadline == math.inf and batch_timeout_s is not None:
                if any(w.ready for w in self._workers):
                    batch_deadline = time.monotonic() + batch_timeout_s
            if time.monotonic() >= batch_deadline:
                # Budget spent: everything unfinished is a timeout. Signal every
                # busy worker first so their kill grace periods overlap.
                for w in self._workers:
                    if w.job is not None and w.process.is_alive():
                        w.process.terminate()
                for w in list(self._workers):
                    if w.job is not None:
                        log.debug("%s job %s hit the batch deadline", self.what, w.job)
                        done(w.job, Outcome("batch_timeout"))
                        self._replace(w)
                for j in pending:
                    done(j, Outcome("queued_timeout"))
                pending.clear()
                break

            # 1. Hand out work to idle, ready workers.
            for w in self._workers:
                while w.ready and w.job is None and pending:
                    j = pending.popleft()
                    timeout_s = timeout_of(j)
                    payload = encode(j, min(timeout_s, batch_deadline - time.monotonic()))
                    if payload is None:
                        done(j, Outcome("unsendable"))
                        continue
                    try:
                        w.dispatch(j, payload, timeout_s)
                    except (OSError, ValueError):  # worker died while idle: retry later
                        pending.appendleft(j)
                        self._replace(w)
                        break

            # 2. Wait for a result, a death, a ready signal, or the next deadline.
            waiting = [w for w in self._workers if w.job is not None or not w.ready]
            now = time.monotonic()
            deadlines = [w.deadline if w.ready else w.started + self.startup_timeout_s for w in waiting]
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
                    elif died or isinstance(msg, tuple) or now >= w.started + self.startup_timeout_s:
                        w.process.join(_KILL_GRACE_S)
                        self.close()
                        if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == _FAILED:
                            raise RuntimeError(f"{self.what} worker failed to start: {msg[1]} ({self.hint[0]})")
                        reason = (f"exit code {w.process.exitcode}" if died else
                                  f"startup took longer than {self.startup_timeout_s:g} s")
                        raise RuntimeError(f"{self.what} worker failed to start ({reason}); {self.hint[1]}")
                    continue
                if isinstance(msg, tuple) and len(msg) == 3 and msg[0] == w.job:
                    _, ok, value = msg
                    done(w.job, Outcome("ok", value) if ok else Outcome("raised", value))
                    w.job, w.deadline = None, math.inf
                elif died or msg is not None:
                    if died:  # its pipe can close before the process is reaped: wait for the exit code
                        w.process.join(_KILL_GRACE_S)
                    done(w.job, Outcome("died", w.process.exitcode))
                    log.debug("%s worker died on job %s", self.what, w.job)
                    self._replace(w)
                elif now >= w.deadline:
                    done(w.job, Outcome("timeout", timeout_of(w.job)))
                    log.debug("%s job %s timed out after %.2fs", self.what, w.job, timeout_of(w.job))
                    self._replace(w)
        return outcomes, order


class PoolOwner:
    """What a pool built on `WorkerPool` (`self._pool`) shares: a context manager whose `close` stops the workers."""

    _pool: WorkerPool
    _closed: bool = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers. Idempotent; the pool cannot be used afterwards."""
        self._closed = True
        self._pool.close()


class RewardPool(PoolOwner):
    """Scores items ``(prompt, completion, reference, row)`` in worker processes with timeouts.

    Args:
      reward_fn: picklable module-level function or class taking the reward arguments by name (see the
        module docstring): per item, e.g. ``(completion, reference) -> float``, or batched, e.g.
        ``(prompts, completions) -> [float, ...]``.
      num_workers: number of worker processes (>= 1).
      timeout_s: per-item wall-clock limit in seconds (> 0), counted from
        dispatch to a ready worker (a batched reward's chunk gets ``timeout_s x
        len(chunk)``). Without a batch budget, N items that all
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
      batch_size: the largest chunk a batched reward is called with (>= 1); unused for per-item rewards.
      startup_timeout_s: seconds a worker may take to start (imports, ``warm_up``, a reward class's
        instance: a reward model loads here) before the pool gives up (> 0).

    Attributes:
      arguments: the reward arguments ``reward_fn`` takes, e.g. ``("completion", "reference")``.
      batched: whether it takes lists (chunks) rather than one item.
    """

    def __init__(
        self,
        reward_fn: Callable,
        *,
        num_workers: int = 2,
        timeout_s: float = 2.0,
        batch_timeout_s: float | None = None,
        batch_size: int = 64,
        startup_timeout_s: float = _STARTUP_TIMEOUT_S,
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
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if not isinstance(startup_timeout_s, (int, float)) or not 0 < startup_timeout_s < math.inf:
            raise ValueError(f"startup_timeout_s must be a finite number > 0, got {startup_timeout_s!r}")
        try:
            pickle.dumps(reward_fn)
        except Exception as e:
            raise TypeError(
                f"reward_fn must be picklable (a module-level function) to run in spawned "
                f"workers: {e}"
            ) from e
        self.arguments, self.batched = reward_arguments(reward_fn, "reward_fn")
        self._takes_any = _takes_var_keyword(reward_fn)  # **kwargs: gets whichever arguments score() was given
        self.reward_fn = reward_fn
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.batch_timeout_s = None if batch_timeout_s is None else float(batch_timeout_s)
        self.batch_size = batch_size
        self.startup_timeout_s = float(startup_timeout_s)
        self._pool = WorkerPool(
            _RewardSetup(reward_fn, self.batched), num_workers=num_workers, startup_timeout_s=startup_timeout_s,
            what="reward", hint=("raised by the reward class's constructor or its warm_up",
                                 "is reward_fn importable in a fresh process, and is the main script guarded by "
                                 "`if __name__ == '__main__':`?"))
        self._closed = False
        self._warned = False  # the first failed item is logged as a warning, once per pool
        self.name = f"{getattr(reward_fn, '__module__', '?')}:{getattr(reward_fn, '__qualname__', reward_fn)}"

    # -- scoring ---------------------------------------------------------------

    def _columns(self, completions, references, prompts, rows) -> tuple[int, dict[str, list]]:
        """(N, argument name -> its N values) for the arguments the reward takes, checked for length."""
        given = {"completion": completions, "reference": references, "prompt": prompts, "row": rows}
        lengths = {f"len({name}s)": len(v) for name, v in given.items() if v is not None}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"completions, references, prompts and rows must have the same length, got "
                             f"{' and '.join(f'{k}={v}' for k, v in lengths.items())}")
        columns = {}
        for name in self.arguments:
            item = name[:-1] if self.batched else name  # "prompts" -> "prompt"
            if given[item] is None and self._takes_any:
                continue
            if given[item] is None:
                raise ValueError(f"reward_fn takes {name!r} but score() was given no {item}s: pass {item}s=[...]")
            values = given[item]
            columns[name] = list(values) if item == "row" else [_as_text(v) for v in values]
        return len(completions), columns

    def score(self, completions: Sequence[str], references: Sequence[str], *,
              prompts: Sequence[str] | None = None, rows: Sequence | None = None) -> RewardResult:
        """Rewards for ``completions[i]`` against ``references[i]`` (and ``prompts[i]``, ``rows[i]``).

        Args:
          completions: N completion strings.
          references: N reference answers.
          prompts: N prompts, needed when the reward takes ``prompt(s)``.
          rows: N data rows (e.g. dicts of a JSONL row's fields), needed when the reward takes ``row(s)``.

        Returns:
          ``RewardResult`` with ``rewards`` of shape [N] (float32).
        """
        start = time.monotonic()
        n, columns = self._columns(completions, references, prompts, rows)
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        jobs = _chunks(n, self.num_workers, self.batch_size) if self.batched else [range(i, i + 1) for i in range(n)]

        def encode(j: int, budget_s: float) -> bytes | None:
            items = jobs[j]
            if self.batched:
                arguments = {name: column[items.start:items.stop] for name, column in columns.items()}
            else:
                arguments = {name: column[items.start] for name, column in columns.items()}
            return encode_job(j, arguments, budget_s)

        outcomes, order = self._pool.run(len(jobs), encode, lambda j: self.timeout_s * len(jobs[j]),
                                         self.batch_timeout_s)
        rewards = np.zeros(n, dtype=np.float32)
        timeouts = errors = 0
        failures: list[str] = []  # what went wrong, in the order it was seen
        for j in order:
            outcome, items = outcomes[j], jobs[j]
            if outcome.kind == "ok":
                values = outcome.value if self.batched else [outcome.value]
                if not isinstance(values, list) or len(values) != len(items):
                    errors += len(items)
                    failures.append(f"returned {type(outcome.value).__name__} of {len(items)} items, not a list "
                                    f"of {len(items)} floats")
                    continue
                for i, v in zip(items, values):
                    if isinstance(v, float) and abs(v) <= _FLOAT32_MAX:  # nan fails too
                        rewards[i] = v
                    else:
                        errors += 1
                        failures.append(f"returned {v!r}, not a finite float")
                        log.debug("reward item %d: %r is not a finite float32", i, v)
            elif outcome.kind == "raised":
                errors += len(items)
                failures.append(f"raised {outcome.value}")
                log.debug("reward items %s failed: %s", items, outcome.value)
            elif outcome.kind == "died":
                errors += len(items)
                failures.append(f"killed its worker (exit code {outcome.value})")
            elif outcome.kind == "timeout":
                timeouts += len(items)
                failures.append(f"took longer than {outcome.value:g} s")
            elif outcome.kind == "batch_timeout":
                timeouts += len(items)
                failures.append(f"was unfinished when reward.batch_timeout_s ({self.batch_timeout_s:g} s) ran out")
            elif outcome.kind == "queued_timeout":
                timeouts += len(items)
            else:  # unsendable
                errors += len(items)

        first = failures[0] if failures else None
        if first is not None and not self._warned:  # once per pool: the rest are counted (reward/errors, ...)
            self._warned = True
            log.warning("reward %s: an item %s; it scores 0, as every failed item does (counted as reward "
                        "timeouts and errors; this warning is not repeated)", self.name, first)
        return RewardResult(rewards, timeouts, errors, time.monotonic() - start, first)
