"""Run untrusted, model-written Python programs against test cases.

``code_reward(completion, reference)`` extracts the last fenced Python block
(the last untagged one if none is tagged) from a completion, runs it against
the tests in ``reference`` (JSON ``{"tests": [...]}``) and returns the
fraction that pass. Each test is either

* ``{"input": str, "output": str}``: the program reads stdin and its stdout
  must equal ``output`` after normalisation (each line right-stripped, trailing
  blank lines dropped); or
* ``{"assert": "assert f(2) == 4"}`` (one or more lines): the caller decides, not the program.
  ``assert_check`` splits the test with ``ast`` into program-side expressions (``f(2)``: names the
  test does not bind, and calls, attributes and subscripts on them) and checker-side code
  (``== 4``, literals, a few pure builtins and ``math``, loop and comprehension variables). The
  program's process runs the program as ``__main__`` (``_ASSERT_HARNESS``) and then evaluates
  program-side expressions on request, sending back each value as JSON of exact built-in types; the
  caller decodes it as untrusted data and runs the checker-side code over it. The case passes iff
  every assert held. The program's process never holds the checker side, the expected values or
  anything that marks a pass. A test shape that cannot be split safely fails closed
  (``"unsupported_test"``, without running the program); ``assert_check`` lists the shapes. The
  program of an assert test cannot create processes (threads are fine): a seccomp filter makes
  ``fork``, ``subprocess`` and ``multiprocessing`` fail with EPERM. (IO tests keep ``fork``: the
  parent judges the stdout of the whole run.)

Threat model of assert tests. The program controls its whole process: the harness, its memory and
fds, what it sends and when it exits. It can therefore choose the values its program-side
expressions evaluate to (as an honest program does) and nothing more:

* it cannot read the expected values or the checker side, which stay in the caller (frames, ``gc``,
  ``/proc/self/mem`` and the inherited fds hold only the program-side code and the values sent to it);
* comparison runs on values the caller decoded itself (``assert_check.decode``: exact ``int``,
  ``float``, ``str``, ``list``, ``dict``, ... and no subclass), so an object whose ``__eq__`` is
  always true, a patched encoder or a forged reply is a ``"bad_value"``/``"bad_reply"`` or just a
  wrong value;
* exiting early (``os._exit(0)``, ``sys.exit``, ``atexit``, a signal) before every request was
  answered fails the case (``"early_exit"`` or ``"runtime_error"``), as do a crash, a timeout, junk
  on the reply pipe and replies over ``assert_check.MAX_REPLY_BYTES``;
* the values it sends cannot make the checker's work blow up: decoding is bounded (size, depth,
  colliding hashes), and checker-side ``*``, ``**``, ``<<``, ``range``, ``join``, ``sum``, ``set``
  and loops stop at limits or at the case's deadline (``"checker_limit"``);
* what it can still learn is the order of requests: a later request shows that the checker went on.
  It cannot take back an answer already sent, and each case is a fresh process, so this does not
  tell it an answer it could still use. A test that is weak in itself (``any(f(x) == 7 for x in
  range(10))`` can be met by answering 0, 1, 2, ... in turn) stays weak.

Each test case is one fresh process:

* cwd is a fresh temporary directory (deleted afterwards, even on failure)
  holding ``prog.py``; stdin comes from a file, so no pipe deadlock;
* the interpreter is the base Python (not a virtualenv link) with ``-s -S -B -P`` (no site: stdlib
  only; no user site, ``.pyc`` files or ``sys.path[0]``) with the environment scrubbed to
  ``{"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "HOME": <tmpdir>}`` (a fixed
  hash seed, so that printing a set gives the same line in every run); a small bootstrap
  (``_IO_BOOTSTRAP``, or the assert harness) defines ``exit()``/``quit()`` as ``site`` would and runs
  ``prog.py`` as ``__main__``;
* ``start_new_session=True``; the whole process group is SIGKILLed when the
  run ends (normally, on wall timeout, or on too much output, or when an
  exception such as ``RewardPool``'s SIGTERM unwinds the caller);
* it dies with the caller: the kernel SIGKILLs it when the thread that started
  it exits (``PR_SET_PDEATHSIG``, Linux), so a worker that ``RewardPool``
  SIGKILLs takes its sandbox with it; a SIGALRM at the wall limit + 1 s is a
  further backstop. Sandbox dirs are named after the creating process, and the
  first run in a process deletes those whose creator is gone;
* the process starts as a small launcher (``sandbox_child.py``, run by the
  base interpreter) which enters new namespaces where the OS permits, applies
  ``resource`` limits (CPU, address space, file size, processes, no core
  files) and, when running as root, drops to uid/gid 65534 ("nobody"; the
  tmpdir is chowned to it), then execs the program. Nothing runs between fork
  and exec in the caller (no ``preexec_fn``), so any process may call this,
  including a multi-threaded one holding JAX and gigabytes of arrays: the
  cost of a run does not grow with the caller's memory;
* stdout/stderr are read with ``select`` and at most ``max_output_bytes`` each
  is kept (for an IO test at least 2 x its expected output + 4 KiB); going over
  the cap kills the program (status ``"output_limit"``).

Namespaces (Linux, entered with ``unshare(2)`` via ctypes; as non-root a user
namespace mapping the caller to root is created first so the others become
permitted, and after the mounts a nested one where the program is uid 65534
without capabilities, so it cannot unmount what hides the host, see
``sandbox_child``):

* network: a fresh netns has only a down loopback, so every ``connect`` fails
  (``CodeResult.network_isolated`` / ``run_program``'s status reflects whether
  this actually happened; when not permitted, the program simply runs with the
  host network);
* mount: the program runs in a minimal read-only root (``pivot_root``; see ``sandbox_child``) holding
  only the base interpreter, its standard library and the shared objects it loads, a ``/dev`` with
  null, zero, random and urandom, a fresh ``/proc`` (with a PID namespace), size-limited tmpfs
  ``/tmp`` and ``/dev/shm``, and the run's own dir, a tmpfs too (holding copies of its files, capped at
  max(16, 4 x ``file_size_mb``) MB more: RLIMIT_FSIZE bounds one file, this bounds them all, so no run
  can fill the host disk). No host ``/etc``, ``/run``, ``/home``, ``/root`` or checkout is there, so
  host files and host Unix sockets cannot be named. Writes vanish with the namespace;
* seccomp (every run, ``sandbox_host.seccomp_filter``, compiled by libseccomp): EPERM for every
  socket domain but IPv4/IPv6 (named and abstract Unix sockets, netlink, ...), keyrings, ``ptrace`` and
  other processes' memory, mounts and namespaces, ``bpf``, ``io_uring`` and other kernel machinery;
* PID: the program runs under a tiny init process; when the run ends the
  namespace is torn down, so even children that ``setsid()`` away from the
  process group die;
* IPC: System V shared memory, message queues and semaphores (and POSIX
  message queues) the program creates vanish with the namespace instead of
  outliving the run (memory is freed asynchronously, within a fraction of a second), and a shared memory
  segment is destroyed at its last detach (``shm_rmid_forced``), so that detached segments, which
  RLIMIT_AS does not count, cannot pile up.

Known gaps (honest list):

* Without namespaces (e.g. an unprivileged container without user namespaces)
  the program gets the host network, can leave files in world-writable dirs
  such as ``/tmp`` (as "nobody", or as the caller when not root), can leave
  System V IPC objects (shared memory that holds RAM until removed), and a child
  that calls ``setsid()`` escapes the process-group kill. When the caller is
  not root there is also no privilege drop: the program runs as the caller's
  uid and, without a PID namespace, could read ``/proc/<pid>/environ`` of the
  caller's other processes. RLIMIT_NPROC then counts all of the caller's
  processes.
* When the caller is not root, even with namespaces the program's kernel uid is
  the caller's (it only looks like 65534): outside the private tmpfs dirs it
  can read *and write* whatever the caller can, e.g. the caller's home and a
  checkout the caller owns. Run as root (the program is then "nobody") or as a
  dedicated user where that matters. Should the nested user namespace that
  takes away its root be refused while the mount namespace was made, the run
  ends in ``"sandbox_error"`` rather than run the program as that root.
* Memory is limited per process (RLIMIT_AS; Linux has no per-user or per-group
  rlimit for it, only cgroups, which an unprivileged caller rarely may create), so
  a program that forks (in an IO test) can hold up to ``memory_mb`` x ``max_processes`` (16 GiB
  with the defaults). Lower ``max_processes`` where that matters; RLIMIT_NPROC
  counts the processes of the uid the program runs as (every concurrent run's as
  "nobody"). Nor does RLIMIT_AS count memory held in files that are not mapped: each
  process can keep 256 ``memfd_create`` files (RLIMIT_NOFILE) of up to ``file_size_mb``
  (RLIMIT_FSIZE), 1 GiB with the defaults, on top of ``memory_mb``.
* Without a mount namespace the program's files land in the sandbox dir on the
  host disk, bounded only per file by RLIMIT_FSIZE.
* An interpreter under a directory "nobody" cannot enter (pyenv in ``/root``)
  is exposed by a tmpfs over that directory plus a bind mount of the prefix,
  which also hides the rest of it (``~root``). Without a mount namespace this
  is impossible and every run as root ends in ``"sandbox_error"``: use a
  world-readable Python there.
* Without a mount namespace (or where the root cannot be built, which the first run in a process logs
  once, see ``sandbox_host.host_setup``) there is no minimal root: the program can read world-readable
  host files (e.g. the repository source, ``/etc/passwd``). A root that was asked for but cannot be
  built fails the run (``"sandbox_error"``); it never silently runs on the host's files. The read-only
  binds' host paths can be read in ``/proc/self/mountinfo``.
* All concurrent sandboxes share uid 65534, so RLIMIT_NPROC is shared: a fork
  bomb in one (IO) run can make a concurrent run fail to start (it scores 0).
* The seccomp filters exist for x86_64 and aarch64 only, and need libseccomp (``libseccomp2``),
  ``PR_SET_NO_NEW_PRIVS`` and seccomp filters (Linux >= 3.5); where they are missing the first run in
  a process logs it once and runs go on without them (the namespaces and the root still apply). A
  forked child of an assert test could then also answer requests; it learns no more than its parent
  (see the threat model above).
* The parent-death signal fires when the calling *thread* exits, so do not
  call this from a thread that may end before the run does.
* Checker-side code runs in the caller's process (in training a ``RewardPool`` worker, which the
  pool kills at its deadline). It is the dataset's code, held to a checked subset of Python with
  restricted builtins; the program's values bound the size of what it handles, but a test that
  itself loops long over them (``s.add(f(i))`` for 10^5 requests into one set) costs the caller that
  time, up to the case's wall limit plus the work between two requests.
* Orphaned sandbox dirs are found by the creator's pid: a process in another
  PID namespace sharing the same temp dir could have a live dir deleted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import marshal
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence

from jaxrl.registry import register
from jaxrl.rewards import assert_check
from jaxrl.rewards.pool import item_deadline
from jaxrl.rewards.sandbox_child import NOBODY
from jaxrl.rewards.sandbox_host import host_setup

__all__ = [
    "CaseResult",
    "CodeResult",
    "SandboxLimits",
    "code_reward",
    "extract_code",
    "run_program",
    "run_tests",
]

log = logging.getLogger(__name__)

_PROGRAM = "prog.py"
# The program's whole environment (plus HOME, its sandbox dir). A fixed hash seed: a program that prints
# a set must print the same line in every run, or its score would be a coin toss.
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
_DIR_PREFIX = "jaxrl_sandbox_"  # + creator pid + "_" + random: see _remove_orphaned_dirs
# Time code_reward keeps back from RewardPool's deadline to stop its last run, clean up and reply.
_REPLY_MARGIN_S = 0.2


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-test-case limits."""

    wall_time_s: float = 5.0  # wall clock per test case
    cpu_time_s: float = 2.0  # RLIMIT_CPU (soft; hard is +1 s)
    memory_mb: int = 512  # RLIMIT_AS, per process (see the known gaps)
    file_size_mb: int = 4  # RLIMIT_FSIZE
    max_processes: int = 32  # RLIMIT_NPROC (only effective for a non-root uid)
    # Per stream; more is discarded and kills the run. An IO test allows at least 2 x its expected
    # output + 4 KiB, so that a correct program never hits the cap.
    max_output_bytes: int = 65536
    isolate_network: bool = True  # fresh network namespace when the OS permits

    def __post_init__(self):
        # A bad limit otherwise made every run fail like a bad program (memory_mb=0: "runtime_error",
        # all rewards 0) or was quietly changed (cpu_time_s=-1 ran with 1 s).
        for name, least in (("wall_time_s", 0), ("cpu_time_s", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not least < value < math.inf:
                raise ValueError(f"SandboxLimits.{name} must be a finite number > {least}, got {value!r}")
        for name, least in (("memory_mb", 1), ("file_size_mb", 0), ("max_processes", 0), ("max_output_bytes", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"SandboxLimits.{name} must be an integer >= {least}, got {value!r}")
        if not isinstance(self.isolate_network, bool):
            raise ValueError(f"SandboxLimits.isolate_network must be a bool, got {self.isolate_network!r}")


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """One test case.

    ``status`` is one of ``"ok"``, ``"wrong_answer"`` (wrong output, or an assert
    that did not hold), ``"runtime_error"`` (the program, or its code that a test
    called, raised), ``"early_exit"`` (an assert test whose program exited with
    status 0 before answering every request), ``"timeout"`` (wall or CPU limit),
    ``"memory"``, ``"output_limit"``, ``"file_limit"``, ``"invalid_test"``,
    ``"not_run"`` (no time left in ``run_tests``' budget), ``"sandbox_error"``, or,
    for assert tests only, ``"unsupported_test"`` (the test cannot be split safely,
    see ``assert_check``; the program is not run), ``"bad_value"`` (a program-side
    expression gave something that is not a plain value), ``"bad_reply"`` (junk or
    too much on the reply pipe) or ``"checker_limit"`` (checker-side work over a
    size or step limit).
    """

    passed: bool
    status: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class CodeResult:
    """All test cases of one program; ``network_isolated`` is True iff every run had its own netns."""

    pass_fraction: float
    cases: tuple[CaseResult, ...]
    network_isolated: bool


# -- code extraction ---------------------------------------------------------

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}


def extract_code(completion: str) -> str | None:
    """The last closed fenced block tagged ``python`` (``py``, ``python3``); without one, the last untagged
    block (an untagged block after tagged code is usually its example output); None if absent.

    The block is dedented: a fence indented inside a list item indents every line of its code.
    """
    if not isinstance(completion, str):
        return None
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(completion)]
    tagged = [code for tag, code in blocks if tag in _PYTHON_TAGS]
    untagged = [code for tag, code in blocks if not tag]
    code = (tagged or untagged or [None])[-1]
    return None if code is None else textwrap.dedent(code)


# -- the assert harness ------------------------------------------------------

# What ``site`` would have added that programs use: ``exit()`` and ``quit()`` (the program runs with
# ``-S``, and ``print(ans); exit()`` must not be a NameError). Prefixed to both scripts below.
_QUIT_BUILTINS = r"""
import _sitebuiltins, builtins, sys

builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
"""

# ``python _PYTHON_FLAGS -c _IO_BOOTSTRAP /abs/path/prog.py``: runs the program as the script would run
# (``__main__``, absolute ``__file__``, ``sys.argv == ["prog.py"]``), with ``exit``/``quit`` defined.
_IO_BOOTSTRAP = _QUIT_BUILTINS + r"""

def run_script(path):
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = type(sys)("__main__")
    main.__file__, main.__builtins__ = path, builtins
    sys.modules["__main__"], sys.argv = main, ["prog.py"]
    exec(code, main.__dict__)


run_script(sys.argv[1])
"""

# ``python _PYTHON_FLAGS -c _ASSERT_HARNESS CASE_FD REQUEST_FD REPLY_FD MAX_REPLY`` in the sandbox dir: the
# program's half of an assert test (see ``assert_check``). CASE_FD is an unlinked file holding the test's
# program-side code (``marshal`` of ``(("eval", "f(2)"), ...)``, never the checker side); the harness reads
# and closes it, runs the program as the script ``prog.py`` (``__main__``, absolute ``__file__``,
# ``sys.argv == ["prog.py"]``), sends ``["ready"]`` on REPLY_FD, then answers requests ``(i, (values...))``
# (``marshal``, from the trusted caller) from REQUEST_FD with ``["ok", value]``, ``["raise", "ValueError",
# [args]]`` or ``["bad", why]`` (a value that is not plain), in JSON written by ``assert_check.encode``,
# until REQUEST_FD closes. Messages are a 4-byte big-endian length and the payload. The
# program shares this process and may rewrite any of it, or answer itself: that only changes the values
# it sends, which it controls anyway. The caller decodes them as untrusted data and decides. An exception
# while the program runs, ``SystemExit`` included, exits with status 1 before "ready". A child the program
# forks (possible only where the no-fork filter is missing) exits silently instead of serving: two readers
# of one request pipe would split its messages.
_ASSERT_HARNESS = _QUIT_BUILTINS + assert_check.CODEC_SOURCE + r"""
import marshal, os


def _send(fd, text):
    data = text.encode("utf-8", "surrogatepass")
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _builtin_name(e):
    for cls in type(e).__mro__:
        if cls.__module__ == "builtins":
            return cls.__name__
    return "Exception"


def serve(case_fd, request_fd, reply_fd, max_reply):
    harness_pid = os.getpid()  # a child the program forks must not read requests: it would split them
    with os.fdopen(case_fd, "rb") as f:
        codes = marshal.loads(f.read())
    try:
        path = os.path.abspath("prog.py")
        with open(path, "rb") as f:
            program = compile(f.read(), path, "exec", dont_inherit=True)
        compiled = [compile(src, "<test>", mode, dont_inherit=True) for mode, src in codes]
        main = type(sys)("__main__")
        main.__file__, main.__builtins__ = path, __builtins__
        sys.modules["__main__"], sys.argv = main, ["prog.py"]
        exec(program, main.__dict__)
    except BaseException as e:  # SystemExit too: the program did not finish
        if os.getpid() != harness_pid:
            os._exit(0)
        try:
            sys.__excepthook__(type(e), e, e.__traceback__)
        except BaseException:
            pass
        os._exit(1)
    if os.getpid() != harness_pid:
        os._exit(0)
    sys.settrace(None)
    sys.setprofile(None)
    _send(reply_fd, '["ready"]')
    while True:
        header = _read_exact(request_fd, 4)
        if header is None:
            os._exit(0)
        index, values = marshal.loads(_read_exact(request_fd, int.from_bytes(header, "big")))
        for k, v in enumerate(values):
            main.__dict__[f"_jaxrl_a{k}"] = v
        try:
            result = eval(compiled[index], main.__dict__)
        except BaseException as e:
            if os.getpid() != harness_pid:
                os._exit(0)
            try:
                args = encode(list(e.args))
            except BaseException:
                args = "[]"
            _send(reply_fd, '["raise",%s,%s]' % (encode(_builtin_name(e)), args))
            continue
        if os.getpid() != harness_pid:
            os._exit(0)
        try:
            reply = '["ok",%s]' % encode(result)
            if len(reply.encode("utf-8")) > max_reply:
                raise TypeError(f"the value is over {max_reply} bytes encoded")
        except BaseException as e:
            reply = '["bad",%s]' % encode(str(e)[:200])
        _send(reply_fd, reply)


serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
"""


# -- the parent side ---------------------------------------------------------


def _base_interpreter() -> str:
    """The base Python, not a virtualenv's link to it.

    The program runs with ``-I -S`` and needs only the standard library, and a virtualenv may live under a
    directory the sandbox hides (a checkout in ``/tmp``, which gets a fresh tmpfs).
    """
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidate = os.path.join(os.path.realpath(sys.base_prefix), "bin", version)
    return candidate if os.access(candidate, os.X_OK) else os.path.realpath(sys.executable)


def _namespaces_to_enter(limits: SandboxLimits) -> list[str]:
    """The namespaces the launcher asks for; those the OS refuses are done without (see the docstring)."""
    return ["mnt", "pid", "ipc", "net"] if limits.isolate_network else ["mnt", "pid", "ipc"]


# The program's (and harness's) interpreter flags: no site (stdlib only), no user site, no .pyc files,
# no unsafe sys.path[0]. Not -I/-E: they would ignore PYTHONHASHSEED (see _ENV), and the environment
# is scrubbed anyway.
_PYTHON_FLAGS = ("-s", "-S", "-B", "-P")


def _launcher_argv(
    interpreter: str, limits: SandboxLimits, tmpdir: str, report_fd: int, no_fork: bool = False
) -> list[str]:
    """``sandbox_child.py``'s command line, up to and including ``--`` (the program's argv follows).

    The minimal root's paths and the seccomp filter come from ``sandbox_host.host_setup(interpreter)``
    (found once per process; it logs what this host cannot do)."""
    setup = host_setup(interpreter, _DIR_PREFIX)
    namespaces = _namespaces_to_enter(limits)
    root = setup.root if "mnt" in namespaces else ()  # without a mount namespace: the host's files
    spec = {
        "wall_time_s": limits.wall_time_s,
        "cpu_time_s": limits.cpu_time_s,
        "memory_mb": limits.memory_mb,
        "file_size_mb": limits.file_size_mb,
        "max_processes": limits.max_processes,
        "namespaces": ",".join(namespaces),
        "no_fork": int(no_fork),
        "root": os.pathsep.join(root),
        "hide": os.pathsep.join(setup.hide if root else ()),
        "seccomp": setup.filters.get(no_fork, b"").hex(),
        "tmpdir": tmpdir,
        "report_fd": report_fd,
        "parent_pid": os.getpid(),
    }
    return [interpreter, "-I", "-S", "-B", _LAUNCHER, *(f"{k}={v}" for k, v in spec.items()), "--"]


def _read_report(fd: int) -> tuple[str | None, set[str]]:
    """The launcher's report: (error message or None, namespaces entered). See ``sandbox_child``."""
    first, _, rest = _read_now(fd).decode("utf-8", "replace").partition("\n")
    if first.startswith("ok"):
        if rest.startswith("error "):  # the exec failed
            return rest.strip()[len("error "):], set()
        return None, set(first.split()[1:])
    if first.startswith("error "):
        return first[len("error "):], set()
    return "the sandbox launcher ended before confining the program", set()


@dataclasses.dataclass(frozen=True)
class _Run:
    status: str
    stdout: str
    stderr: str
    seconds: float
    network_isolated: bool


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read_bounded(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[str | None, list]:
    """Read stdout/stderr until EOF/exit; returns (``"timeout"``/``"output_limit"``/None, [out, err])."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    outcome = None
    try:
        while sel.get_map() and outcome is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                outcome = "timeout"
                break
            exited = proc.poll() is not None
            for key, _ in sel.select(0 if exited else min(remaining, 0.1)):
                while True:  # drain what is there now
                    try:
                        data = os.read(key.fd, 65536)
                    except BlockingIOError:
                        break
                    if not data:
                        sel.unregister(key.fd)
                        break
                    buf = bufs[key.fd]
                    buf += data[: cap - len(buf) + 1]
                    if len(buf) > cap:
                        del buf[cap:]
                        outcome = "output_limit"
                        break
            if exited and outcome is None:
                break  # everything buffered has been read; stray writers are killed next
    finally:
        sel.close()
    return outcome, [bytes(b).decode("utf-8", "replace") for b in bufs.values()]


def _classify(returncode: int, stderr: str) -> str:
    sig = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else None
    if returncode == 0:
        return "ok"
    if sig in (signal.SIGXCPU, signal.SIGKILL):  # CPU soft / hard limit
        return "timeout"
    if sig == signal.SIGXFSZ:
        return "file_limit"
    if "MemoryError" in stderr[-2000:]:
        return "memory"
    return "runtime_error"


_swept = False  # whether this process has looked for orphaned sandbox dirs


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_orphaned_dirs() -> None:
    """Delete sandbox dirs whose creating process is gone (e.g. a worker SIGKILLed by ``RewardPool``).

    A dir's name holds its creator's pid; should the pid have been reused, the dir is only kept longer.
    """
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(rf"{_DIR_PREFIX}(\d+)_[a-z0-9_]+", name)
        if m and not _pid_exists(int(m.group(1))):
            _remove_dir(os.path.join(root, name))


def _read_now(fd: int) -> bytes:
    """What is in the pipe ``fd`` now (non-blocking: a stray writer may hold it open)."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 4096)
    except BlockingIOError:
        return b""


class _Conversation:
    """The caller's end of an assert test's pipes: requests out, replies in, while stdout/stderr are
    drained under the output cap. Every failure is a ``ProgramGone`` naming the case's status."""

    def __init__(self, proc: subprocess.Popen, request_w: int, reply_r: int, deadline: float, cap: int):
        self.proc, self.request_w, self.reply_r, self.deadline, self.cap = proc, request_w, reply_r, deadline, cap
        self.outputs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        self.reply = bytearray()
        self.sel = selectors.DefaultSelector()
        for fd in (*self.outputs, reply_r):
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)
        os.set_blocking(request_w, False)

    def texts(self) -> tuple[str, str]:
        return tuple(bytes(b).decode("utf-8", "replace") for b in self.outputs.values())

    def _pump(self, timeout: float, write: bytes = b"") -> int:
        """Read what is there within ``timeout`` (and write some of ``write``); returns bytes written."""
        written = 0
        if write:
            self.sel.register(self.request_w, selectors.EVENT_WRITE)
        try:
            events = self.sel.select(timeout)
        finally:
            if write:
                self.sel.unregister(self.request_w)
        for key, _ in events:
            if key.fd == self.request_w:
                try:
                    written = os.write(self.request_w, write)
                except BlockingIOError:
                    pass
                except BrokenPipeError:
                    raise assert_check.ProgramGone(self._ended()) from None
                continue
            while True:
                try:
                    data = os.read(key.fd, 65536)
                except BlockingIOError:
                    break
                if not data:
                    self.sel.unregister(key.fd)
                    break
                if key.fd == self.reply_r:
                    self.reply += data
                    if len(self.reply) > assert_check.MAX_REPLY_BYTES + 4096:
                        raise assert_check.ProgramGone("bad_reply", "a reply over the size limit")
                    continue
                buf = self.outputs[key.fd]
                buf += data[: self.cap - len(buf) + 1]
                if len(buf) > self.cap:
                    del buf[self.cap:]
                    raise assert_check.ProgramGone("output_limit")
        return written

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise assert_check.ProgramGone("timeout")
        return left

    def _ended(self) -> str:
        """The status of a program that stopped talking: wait for its exit (draining output) and name it."""
        while self.proc.poll() is None:
            self._pump(min(self._left(), 0.05))
        self._pump(0)
        return "early_exit" if self.proc.returncode == 0 else _classify(self.proc.returncode, self.texts()[1])

    def recv(self) -> list:
        """The next reply, decoded: a list whose first item is its kind. ProgramGone for anything else."""
        while True:
            if len(self.reply) >= 4:
                size = int.from_bytes(self.reply[:4], "big")
                if size > assert_check.MAX_REPLY_BYTES:
                    raise assert_check.ProgramGone("bad_reply", f"a reply of {size} bytes")
                if len(self.reply) >= 4 + size:
                    data = bytes(self.reply[4:4 + size])
                    del self.reply[:4 + size]
                    try:
                        message = assert_check.decode(data, assert_check.MAX_REPLY_BYTES)
                    except ValueError as e:
                        raise assert_check.ProgramGone("bad_reply", str(e)) from None
                    if type(message) is not list or not message or type(message[0]) is not str:
                        raise assert_check.ProgramGone("bad_reply", "a reply that is not a tagged list")
                    return message
            if self.reply_r not in self.sel.get_map() or self.proc.poll() is not None:
                self._pump(0)
                if len(self.reply) < 4 or len(self.reply) < 4 + int.from_bytes(self.reply[:4], "big"):
                    raise assert_check.ProgramGone(self._ended())
                continue
            self._pump(min(self._left(), 0.1))

    def send(self, data: bytes) -> None:
        data = len(data).to_bytes(4, "big") + data
        while data:
            data = data[self._pump(min(self._left(), 0.1), data):]

    def ask(self, index: int, values: tuple):
        """``ask`` for ``assert_check.run_checker``: evaluate program-side code ``index`` with ``values``."""
        self.send(assert_check.encode_request(index, values))
        reply = self.recv()
        kind = reply[0]
        if kind == "ok" and len(reply) == 2:
            return reply[1]
        if kind == "raise" and len(reply) == 3 and type(reply[1]) is str and type(reply[2]) is list:
            raise assert_check.program_exception(reply[1], tuple(reply[2]))
        if kind == "bad" and len(reply) == 2:
            raise assert_check.NotPlain(str(reply[1])[:200])
        raise assert_check.ProgramGone("bad_reply", f"a reply of kind {kind!r}")

    def close(self) -> None:
        self.sel.close()


def _converse(
    proc: subprocess.Popen, request_w: int, reply_r: int, test: assert_check.Plan, deadline: float, cap: int
) -> tuple[str, str, str]:
    """Run the checker of ``test`` against the program's replies; returns (status, stdout, stderr)."""
    talk = _Conversation(proc, request_w, reply_r, deadline, cap)
    try:
        try:
            if talk.recv() != ["ready"]:
                raise assert_check.ProgramGone("bad_reply", "no ready message")
            status = assert_check.run_checker(test, talk.ask, deadline)
        except assert_check.ProgramGone as gone:
            status = gone.status
        return (status, *talk.texts())
    finally:
        talk.close()


def _run(code: str, stdin: str, limits: SandboxLimits, assert_test: assert_check.Plan | None = None) -> _Run:
    """Run ``prog.py`` once on ``stdin``, or, given the split ``assert_test``, through the assert harness,
    answering its checker (see ``assert_check``)."""
    global _swept
    if not _swept:
        _swept = True
        _remove_orphaned_dirs()
    start = time.monotonic()
    tmpdir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}_")
    report_r = report_w = request_r = request_w = reply_r = reply_w = case_file = None
    try:
        with open(os.path.join(tmpdir, _PROGRAM), "w", encoding="utf-8") as f:
            f.write(code)
        stdin_path = os.path.join(tmpdir, ".stdin")
        with open(stdin_path, "w", encoding="utf-8") as f:
            f.write(stdin)
        if os.geteuid() == 0:
            for path in (tmpdir, *(os.path.join(tmpdir, n) for n in os.listdir(tmpdir))):
                os.chown(path, NOBODY, NOBODY)
        report_r, report_w = os.pipe()
        interpreter = _base_interpreter()
        program = [interpreter, *_PYTHON_FLAGS, "-c", _IO_BOOTSTRAP, os.path.join(tmpdir, _PROGRAM)]
        pass_fds = [report_w]
        if assert_test is not None:
            case_file = tempfile.TemporaryFile()  # unlinked: reachable only through the inherited fd
            case_file.write(marshal.dumps(assert_test.program_code))
            case_file.flush()
            case_file.seek(0)
            request_r, request_w = os.pipe()
            reply_r, reply_w = os.pipe()
            program[-3:] = ["-c", _ASSERT_HARNESS, *map(str, (case_file.fileno(), request_r, reply_w)),
                            str(assert_check.MAX_REPLY_BYTES)]
            pass_fds += [case_file.fileno(), request_r, reply_w]
        env = {**_ENV, "HOME": tmpdir}
        with open(stdin_path, "rb") as stdin_file:
            proc = subprocess.Popen(  # no preexec_fn: the launcher confines itself, then execs
                _launcher_argv(interpreter, limits, tmpdir, report_w, no_fork=assert_test is not None)
                + program,
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=tmpdir,
                env=env,
                start_new_session=True,
                pass_fds=pass_fds,
            )
        # Only the child keeps these: the case file then vanishes once the harness has read it.
        for fd in (report_w, request_r, reply_w):
            if fd is not None:
                os.close(fd)
        report_w = request_r = reply_w = None
        if case_file is not None:
            case_file.close()
        try:
            deadline = start + limits.wall_time_s
            if assert_test is not None:
                outcome, out, err = _converse(proc, request_w, reply_r, assert_test, deadline,
                                              limits.max_output_bytes)
            else:
                outcome, (out, err) = _read_bounded(proc, deadline, limits.max_output_bytes)
                if outcome is None:
                    try:
                        proc.wait(max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        outcome = "timeout"
        finally:
            _kill_group(proc)
            proc.stdout.close()
            proc.stderr.close()
        setup_error, namespaces = _read_report(report_r)
        if setup_error is not None and outcome in (None, "early_exit", "runtime_error", "bad_reply"):
            # the launcher failed: not the program's doing (a timeout during set-up stays a timeout)
            err = f"sandbox launcher: {setup_error}\n{err}"
            return _Run("sandbox_error", out, err, time.monotonic() - start, False)
        status = outcome or _classify(proc.returncode, err)
        return _Run(status, out, err, time.monotonic() - start, "net" in namespaces)
    except (OSError, subprocess.SubprocessError, ValueError) as e:  # e.g. no interpreter
        return _Run("sandbox_error", "", f"{type(e).__name__}: {e}", time.monotonic() - start, False)
    finally:
        for fd in (report_r, report_w, request_r, request_w, reply_r, reply_w):
            if fd is not None:
                os.close(fd)
        if case_file is not None:
            case_file.close()
        _remove_dir(tmpdir)


def _remove_dir(path: str) -> None:
    """Delete a sandbox dir; never raises. ``shutil.rmtree`` recurses once per level, so a program that
    nested thousands of directories (possible where no mount namespace gives it a tmpfs of its own) made
    it raise RecursionError: ``rm -rf`` then finishes the job at any depth. Permissions are only ever
    changed inside ``path``: its parent (the shared temp dir) is never touched."""
    top = os.path.abspath(path)

    def force_remove(func, failed, exc_info) -> None:
        """rmtree error hook: make a dir inside the sandbox dir writable (the program may chmod things)
        and retry. A path already gone (a concurrent sweep of orphaned dirs) needs nothing."""
        parent = os.path.dirname(os.path.abspath(failed))
        if isinstance(exc_info[1], FileNotFoundError) or not (parent == top or parent.startswith(top + os.sep)):
            return
        try:
            os.chmod(parent, 0o700)
            func(failed)
        except OSError:
            pass

    try:
        shutil.rmtree(top, onerror=force_remove)
    except RecursionError:
        pass
    for argv in (["chmod", "-R", "u+rwx", "--", top], ["rm", "-rf", "--", top]):
        if os.path.lexists(top):
            try:
                subprocess.run(argv, capture_output=True, check=False, timeout=60)
            except (OSError, subprocess.SubprocessError):
                pass


def run_program(
    code: str, stdin: str, limits: SandboxLimits = SandboxLimits()
) -> tuple[str, str, str]:
    """Run ``code`` once in the sandbox with ``stdin``; returns ``(status, stdout, stderr)``.

    ``status`` is ``"ok"`` (exit status 0), ``"runtime_error"``, ``"timeout"``,
    ``"memory"``, ``"output_limit"``, ``"file_limit"`` or ``"sandbox_error"``.
    """
    r = _run(code, stdin, limits)
    return r.status, r.stdout, r.stderr


def _normalise(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def run_tests(
    code: str,
    tests: Sequence[dict],
    limits: SandboxLimits = SandboxLimits(),
    budget_s: float | None = None,
) -> CodeResult:
    """Run every test case (see the module docstring); pass_fraction is 0.0 for no tests.

    ``budget_s`` bounds the wall time of all runs together: each run's ``wall_time_s`` is cut to the
    time left, and cases with no time left are not run (status ``"not_run"``).
    """
    global _unsupported_warned
    end = math.inf if budget_s is None else time.monotonic() + budget_s
    cases, isolated = [], []
    shadowed = assert_check.shadowed_builtins(code) if isinstance(code, str) else frozenset()
    for test in tests:
        is_assert = isinstance(test, dict) and isinstance(test.get("assert"), str)
        is_io = (
            not is_assert
            and isinstance(test, dict)
            and isinstance(test.get("input"), str)
            and isinstance(test.get("output"), str)
        )
        if not (is_assert or is_io):
            cases.append(CaseResult(False, "invalid_test", 0.0))
            continue
        left = end - time.monotonic()
        if left <= 0:
            cases.append(CaseResult(False, "not_run", 0.0))
            continue
        if left < limits.wall_time_s:
            run_limits = dataclasses.replace(limits, wall_time_s=left)
        else:
            run_limits = limits
        if is_assert:
            try:
                split = assert_check.plan(test["assert"], shadowed)
            except assert_check.UnsupportedTest as e:
                if not _unsupported_warned:
                    _unsupported_warned = True
                    log.warning("an assert test cannot be judged safely and scores 0 for every program: %s "
                                "(see jaxrl.rewards.assert_check; logged once per process)", e)
                cases.append(CaseResult(False, "unsupported_test", 0.0))
                continue
            r = _run(code, "", run_limits, assert_test=split)
            passed, status = r.status == "ok", r.status
        else:
            # A correct program must never hit the output cap: allow twice the expected output and then some.
            expected_bytes = len(test["output"].encode("utf-8", "replace"))
            cap = max(run_limits.max_output_bytes, 2 * expected_bytes + 4096)
            if cap != run_limits.max_output_bytes:
                run_limits = dataclasses.replace(run_limits, max_output_bytes=cap)
            r = _run(code, test["input"], run_limits)
            passed = r.status == "ok" and _normalise(r.stdout) == _normalise(test["output"])
            status = "wrong_answer" if r.status == "ok" and not passed else r.status
        cases.append(CaseResult(passed, status, r.seconds))
        isolated.append(r.network_isolated)
    fraction = sum(c.passed for c in cases) / len(cases) if cases else 0.0
    return CodeResult(fraction, tuple(cases), bool(isolated) and all(isolated))


_budget_warned = False  # whether code_reward has warned about running out of time in this process
_unsupported_warned = False  # whether run_tests has warned about an assert test it cannot split


@register("reward", "code")
def code_reward(completion: str, reference: str) -> float:
    """Pass fraction of the completion's last Python block on ``reference``'s tests; 0.0 on any problem.

    In a ``RewardPool`` worker the runs share the time left before the pool kills the item (less
    ``_REPLY_MARGIN_S``), so a slow program scores its finished cases instead of being killed; cases
    left without time score 0, and the first time that happens in a process a warning is logged.
    """
    global _budget_warned
    try:
        tests = json.loads(reference)["tests"]
        code = extract_code(completion)
        if code is None or not isinstance(tests, list):
            return 0.0
        deadline = item_deadline()
        budget = None if deadline == math.inf else deadline - time.monotonic() - _REPLY_MARGIN_S
        result = run_tests(code, tests, budget_s=budget)
        not_run = sum(c.status == "not_run" for c in result.cases)
        if not_run and not _budget_warned:
            _budget_warned = True
            log.warning(
                "code_reward ran out of time: %d of %d test cases were not run and score 0. Each case "
                "may take up to SandboxLimits.wall_time_s (%.1f s); raise the RewardPool's timeout_s "
                "(reward.timeout_s) to fit them. (Logged once per process.)",
                not_run, len(result.cases), SandboxLimits().wall_time_s,
            )
        return float(result.pass_fraction)
    except Exception:  # noqa: BLE001 - a reward must never raise
        return 0.0


def warm_up() -> None:
    """Find this host's sandbox set-up (the interpreter's files, the seccomp filters, one probe run: about
    0.2 s) once per process. ``RewardPool`` workers call it before they take items, so the first item's
    timeout does not pay for it."""
    host_setup(_base_interpreter(), _DIR_PREFIX)


code_reward.warm_up = warm_up
