"""Tests for jaxrl.rewards.sandbox: correctness of scoring and containment of hostile programs."""

import glob
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import psutil
import pytest
import reward_fns

import jaxrl.rewards.sandbox as sandbox
from jaxrl.rewards.pool import RewardPool
from jaxrl.rewards.sandbox import (
    NOBODY,
    SandboxLimits,
    code_reward,
    extract_code,
    run_program,
    run_tests,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = SandboxLimits(wall_time_s=2.0, cpu_time_s=1.0)

SQUARE = "import sys\n\ndef f(x):\n    return x * x\n\nfor tok in sys.stdin.read().split():\n    print(f(int(tok)))\n"
TESTS = [
    {"input": "2\n", "output": "4\n"},
    {"input": "3", "output": "9   \n\n\n"},  # whitespace-normalised comparison
    {"assert": "assert f(5) == 25"},
    {"assert": "assert f(-1) == 1"},
]


def _completion(code: str) -> str:
    return f"Let me think.\n```python\n{code}```\nDone."


def _reference(tests) -> str:
    return json.dumps({"tests": tests})


def _nobody_pids() -> set[int]:
    pids = set()
    for p in psutil.process_iter(["uids"]):
        uids = p.info["uids"]
        if uids is not None and NOBODY in (uids.real, uids.effective):
            pids.add(p.pid)
    return pids


def _assert_no_new_nobody_processes(before: set[int], wait_s: float = 3.0) -> None:
    deadline = time.monotonic() + wait_s
    while (extra := _nobody_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not extra, f"stray sandbox processes survived: {extra}"


@pytest.fixture
def nobody_baseline():
    before = _nobody_pids()
    yield before
    _assert_no_new_nobody_processes(before)


# -- extraction ----------------------------------------------------------------


def test_extract_code():
    assert extract_code("```python\nprint(1)\n```") == "print(1)\n"
    assert extract_code("```\nprint(2)\n```") == "print(2)\n"
    two = "```python\nprint(1)\n```\ntext\n```py\nprint(3)\n```\n```text\nnot code\n```"
    assert extract_code(two) == "print(3)\n"  # last python/untagged block; other languages skipped
    with_output = "```python\nprint(4)\n```\nOutput:\n```\n4\n```"
    assert extract_code(with_output) == "print(4)\n"  # a tagged block wins over a later untagged one
    assert extract_code("```\nprint(5)\n```\n```text\n5\n```") == "print(5)\n"
    assert extract_code("no code here") is None
    assert extract_code("```python\nprint(1)\n") is None  # unterminated
    assert extract_code(None) is None


def test_extract_code_from_an_indented_fence():
    # A fence inside a list item indents every line of the code: run as is, it was an IndentationError.
    listed = "Steps:\n1. Square the input:\n   ```python\n   n = int(input())\n   if n:\n       print(n * n)\n   ```\n"
    assert extract_code(listed) == "n = int(input())\nif n:\n    print(n * n)\n"
    assert code_reward(listed, _reference([{"input": "3\n", "output": "9\n"}])) == 1.0


# -- scoring -------------------------------------------------------------------


def test_correct_program_passes_all():
    result = run_tests(SQUARE, TESTS, FAST)
    assert result.pass_fraction == 1.0, result
    assert [c.status for c in result.cases] == ["ok"] * 4
    assert code_reward(_completion(SQUARE), _reference(TESTS)) == 1.0


def test_wrong_program_gets_partial_credit():
    wrong = SQUARE.replace("x * x", "x + x")  # right only for x == 2
    result = run_tests(wrong, TESTS, FAST)
    assert [c.status for c in result.cases] == ["ok", "wrong_answer", "wrong_answer", "wrong_answer"]
    assert result.pass_fraction == 0.25
    assert code_reward(_completion("print(0)\n"), _reference(TESTS[:2])) == 0.0


def test_run_program_and_sandbox_dir():
    code = (
        "import os, sys\n"
        "open('scratch.txt', 'w').write(sys.stdin.read())\n"
        "print(open('scratch.txt').read(), os.getcwd())\n"
    )
    status, out, _ = run_program(code, "hello", FAST)
    assert status == "ok"
    text, cwd = out.split()
    assert text == "hello"
    assert not os.path.exists(cwd), "sandbox dir must be deleted after the run"


@pytest.mark.parametrize(
    "reference",
    ["not json", "{}", '{"tests": 3}', '{"tests": [{"bogus": 1}]}', "null", ""],
)
def test_code_reward_bad_reference(reference):
    assert code_reward(_completion(SQUARE), reference) == 0.0


def test_code_reward_without_code_block():
    assert code_reward("the answer is 4", _reference(TESTS)) == 0.0


def test_reward_pool():
    completions = [_completion(SQUARE), _completion("print(0)\n"), "no code", _completion(SQUARE)]
    references = [_reference(TESTS), _reference(TESTS[:2]), _reference(TESTS), "{malformed"]
    with RewardPool(code_reward, num_workers=2, timeout_s=30.0) as pool:
        result = pool.score(completions, references)
    assert result.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert result.timeouts == 0 and result.errors == 0


# -- containment -----------------------------------------------------------------


def test_infinite_loop_times_out_and_group_is_killed(nobody_baseline):
    # A child that leaves the process group must die as well.
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\n"
        "while True:\n    pass\n"
    )
    start = time.monotonic()
    status, _, _ = run_program(code, "", SandboxLimits(wall_time_s=1.0, cpu_time_s=5.0))
    assert status == "timeout"
    assert time.monotonic() - start < 3.0
    _assert_no_new_nobody_processes(nobody_baseline)


def test_cpu_limit():
    status, _, _ = run_program("while True:\n    pass\n", "", SandboxLimits(wall_time_s=10.0, cpu_time_s=1.0))
    assert status == "timeout"


def test_fork_bomb_is_contained(nobody_baseline):
    if os.geteuid() != 0:
        pytest.skip("RLIMIT_NPROC is only bounded per uid when the sandbox can drop to 'nobody' (root)")
    bomb = "import os\nwhile True:\n    os.fork()\n"
    start = time.monotonic()
    assert code_reward(_completion(bomb), _reference([{"input": "", "output": "x"}])) == 0.0
    status, _, _ = run_program(bomb, "", FAST)
    assert status in ("runtime_error", "timeout")
    assert time.monotonic() - start < 15.0
    _assert_no_new_nobody_processes(nobody_baseline)


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(10**10)\n", "x = []\nwhile True:\n    x.append(bytearray(10**7))\n"],
)
def test_memory_bomb(code):
    # Generous time limits, so that on a loaded machine the memory limit, not the clock, stops the program.
    status, _, _ = run_program(code, "", SandboxLimits(wall_time_s=10.0, cpu_time_s=5.0))
    assert status == "memory"
    assert code_reward(_completion(code), _reference([{"assert": "pass"}])) == 0.0


def test_cannot_write_outside_sandbox():
    name = f"jaxrl_sandbox_escape_{uuid.uuid4().hex}"
    targets = [f"/tmp/{name}", f"/var/tmp/{name}", f"/dev/shm/{name}", os.path.join(REPO, name)]
    code = "".join(
        f"try:\n    open({t!r}, 'w').write('x')\n    print('wrote', {t!r})\n"
        f"except OSError as e:\n    print('denied', {t!r}, e)\n"
        for t in targets
    ) + f"open({targets[-1]!r}, 'w').write('x')\n"  # the repo write must fail -> no reward
    try:
        result = run_tests(code, [{"assert": "pass"}], FAST)
        assert result.pass_fraction == 0.0
        status, out, _ = run_program(code, "", FAST)
        assert status == "runtime_error"
        assert f"denied {targets[-1]}" in out
        for t in targets:
            assert not os.path.exists(t), f"sandboxed program left {t} on the host"
    finally:
        for t in targets:
            if os.path.exists(t):
                os.remove(t)


def test_file_size_limit():
    code = "open('big', 'wb').write(b'x' * (8 * 2**20))\n"
    status, _, _ = run_program(code, "", SandboxLimits(wall_time_s=2.0, file_size_mb=1))
    assert status in ("file_limit", "runtime_error")


def test_many_files_cannot_fill_the_disk():
    # RLIMIT_FSIZE caps each file, not how many: the run's dir is a tmpfs of max(16, 4 x file_size_mb) MB
    # plus the program, so 64 files of 1 MB stop at about 16 MB (all 64 reached the host disk before).
    code = ("import os\nwritten = 0\ntry:\n    for i in range(64):\n"
            "        with open(f'f{i}', 'wb') as f:\n            f.write(b'x' * 2**20)\n        written += 1\n"
            "except OSError as e:\n    print(written, e.errno)\nelse:\n    print(written, 0)\n")
    status, out, _ = run_program(code, "", SandboxLimits(wall_time_s=5.0, file_size_mb=1))
    written, errno_ = map(int, out.split())
    assert status == "ok" and errno_ == 28 and 10 <= written <= 16, out  # ENOSPC


def test_environment_secrets_not_visible(monkeypatch):
    monkeypatch.setenv("JAXRL_TEST_SECRET", "s3cr3t")
    code = (
        "import os\nprint(dict(os.environ))\n"
        f"for pid in (1, {os.getpid()}, os.getppid()):\n"
        "    try:\n        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as e:\n        print(e)\n"
    )
    status, out, err = run_program(code, "", FAST)
    assert status == "ok", err
    assert "PATH" in out  # the scrubbed environment was printed
    assert "s3cr3t" not in out and "s3cr3t" not in err


def _connect_code(port: int) -> str:
    return (
        "import socket\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
        "print('connected')\n"
    )


def test_network_is_isolated():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        code = _connect_code(server.getsockname()[1])

        # Control: without isolation the same program does reach the listener.
        status, out, _ = run_program(code, "", SandboxLimits(wall_time_s=3.0, isolate_network=False))
        assert (status, out.strip()) == ("ok", "connected")
        server.accept()[0].close()

        result = run_tests(code, [{"assert": "pass"}], SandboxLimits(wall_time_s=3.0))
        assert result.network_isolated, "unshare works on this machine, so the netns must be used"
        assert result.pass_fraction == 0.0
        assert result.cases[0].status == "runtime_error"
        with pytest.raises(socket.timeout):
            server.accept()


def test_degrades_without_namespaces(monkeypatch):
    import jaxrl.rewards.sandbox as sandbox

    monkeypatch.setattr(sandbox, "_namespaces_to_enter", lambda limits: [])  # as if unshare(2) were denied
    result = run_tests(SQUARE, TESTS[:1], FAST)
    assert not result.network_isolated
    # Runs unisolated, unless the interpreter is hidden from "nobody" (pyenv under /root) and
    # no mount namespace can expose it: then the sandbox refuses to run (never as root).
    assert result.cases[0].status in ("ok", "sandbox_error")
    assert code_reward(_completion(SQUARE), _reference(TESTS[:1])) in (0.0, 1.0)


def test_code_reward_warm_up_finds_the_host_setup_before_any_item():
    # The set-up (file list, filters, probe run: ~0.2 s) fell inside the first item's timeout in each worker.
    probe = (
        "import jaxrl.rewards.sandbox as s, jaxrl.rewards.sandbox_host as h\n"
        "assert not h._host_setups\n"
        "s.code_reward.warm_up()\n"
        "print(list(h._host_setups) == [s._base_interpreter()])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout == "True\n", out.stderr


def test_removing_a_sandbox_dir_never_changes_its_parents_mode(tmp_path):
    # rmtree's error hook made the failed path's parent 0700: for a dir already gone (a concurrent sweep of
    # orphaned dirs), that parent is the shared temp dir, and /tmp became 0700 for every user.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    sandbox._remove_dir(str(shared / "jaxrl_sandbox_1_gone"))
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    locked = shared / "jaxrl_sandbox_1_locked"  # the program made a dir of its own unwritable
    (locked / "sub").mkdir(parents=True)
    (locked / "sub" / "file").write_text("x")
    (locked / "sub").chmod(0o500)
    sandbox._remove_dir(str(locked))
    assert not locked.exists()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777


def test_deeply_nested_dirs_are_removed():
    # Where no mount namespace gives the program a tmpfs, it writes to the real sandbox dir: shutil.rmtree
    # of 3000 nested dirs raised RecursionError, so run_program raised, the dir stayed, and every later
    # process's sweep of orphaned dirs raised too (its first code_reward then scored 0).
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = os.path.join(tempfile.gettempdir(), f"jaxrl_sandbox_{int(dead.stdout)}_deep")
    os.mkdir(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(3000):  # fd-relative: the path grows past PATH_MAX
        os.mkdir("d", dir_fd=fd)
        fd, parent = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
        os.close(parent)
    os.close(fd)
    try:
        sandbox._remove_orphaned_dirs()
        assert not os.path.exists(path)
    finally:
        subprocess.run(["rm", "-rf", "--", path], check=False)


def test_the_caller_is_never_forked():
    """The launcher confines itself: no Python runs between fork and exec in a (multi-threaded) caller."""
    script = (
        "import os, threading, time\n"
        "forks = []\n"
        "os.register_at_fork(before=lambda: forks.append(1))\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # as JAX's threads would be\n"
        "from jaxrl.rewards.sandbox import run_program, run_tests\n"
        "assert run_program('print(6 * 7)', '')[:2] == ('ok', '42\\n')\n"
        "assert run_tests('def f(x): return x', [{'assert': 'assert f(1) == 1'}]).pass_fraction == 1.0\n"
        "print(len(forks))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0", "the sandbox forked its caller (preexec_fn or os.fork)"


def test_launcher_failure_is_a_sandbox_error(monkeypatch):
    monkeypatch.setattr(sandbox, "_namespaces_to_enter", lambda limits: ["mnt", "no_such_namespace"])
    status, out, err = run_program("print(1)", "", FAST)
    assert (status, out) == ("sandbox_error", "")
    assert "unknown namespaces ['no_such_namespace']" in err
    assert run_tests(SQUARE, TESTS, FAST).cases[0].status == "sandbox_error"


@pytest.mark.parametrize(
    "report, expected",
    [
        (b"ok mnt net pid\n", (None, {"mnt", "net", "pid"})),
        (b"ok\n", (None, set())),
        (b"ok mnt\nerror FileNotFoundError: no python\n", ("FileNotFoundError: no python", set())),
        (b"error RuntimeError: failed to drop privileges\n", ("RuntimeError: failed to drop privileges", set())),
        (b"", ("the sandbox launcher ended before confining the program", set())),
    ],
)
def test_launcher_report(report, expected):
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, report)
        os.close(write_fd)
        assert sandbox._read_report(read_fd) == expected
    finally:
        os.close(read_fd)


def test_launcher_arguments_are_checked():
    from jaxrl.rewards import sandbox_child

    argv = sandbox._launcher_argv("python", FAST, "/tmp/x=y", 5)
    assert argv[:5] == ["python", "-I", "-S", "-B", sandbox._LAUNCHER] and argv[-1] == "--"
    spec, program = sandbox_child.parse_args(argv[5:] + ["prog", "arg"])
    assert program == ["prog", "arg"]
    assert spec["tmpdir"] == "/tmp/x=y" and spec["namespaces"] == "mnt,pid,ipc,net"
    assert spec["no_fork"] == "0" and sandbox_child.parse_args(
        sandbox._launcher_argv("python", FAST, "/tmp", 5, no_fork=True)[5:] + ["prog"])[0]["no_fork"] == "1"
    assert float(spec["wall_time_s"]) == FAST.wall_time_s
    with pytest.raises(ValueError, match="missing settings"):
        sandbox_child.parse_args(argv[6:] + ["prog"])  # no wall_time_s
    with pytest.raises(ValueError, match="missing settings"):
        sandbox_child.parse_args(argv[5:])  # no program


@pytest.mark.parametrize(
    "field, value",
    [("wall_time_s", 0), ("cpu_time_s", -1.0), ("wall_time_s", float("nan")), ("memory_mb", 0),
     ("memory_mb", 1.5), ("file_size_mb", -1), ("max_processes", True), ("max_output_bytes", "64k"),
     ("isolate_network", "no")],
)
def test_bad_limits_are_refused_by_name(field, value):
    # memory_mb=0 failed every run as "runtime_error" (a correct program scored 0), cpu_time_s=-1 ran with 1 s.
    with pytest.raises(ValueError, match=f"SandboxLimits.{field} must be"):
        SandboxLimits(**{field: value})
    assert SandboxLimits(max_processes=0, file_size_mb=0, wall_time_s=1).wall_time_s == 1


def test_huge_output_is_capped():
    limits = SandboxLimits(wall_time_s=5.0, max_output_bytes=1000)
    for code in ("print('x' * 10**8)\n", "while True:\n    print('x' * 1000)\n"):
        start = time.monotonic()
        status, out, _ = run_program(code, "", limits)
        assert status == "output_limit"
        assert len(out) <= 1000
        assert time.monotonic() - start < 4.0


# -- assert tests cannot be passed by exiting early ----------------------------

# Each program tries to score on tests it cannot pass. Before the harness, every
# one of them exited with status 0, which used to count as passing.
EXIT_HACKS = {
    "sys.exit": "import sys\nsys.exit(0)\n",
    "os._exit": "import os\nos._exit(0)\n",
    "SystemExit(0)": "raise SystemExit(0)\n",
    "SystemExit": "raise SystemExit\n",
    "exit()": "exit()\n",
    "quit()": "quit(0)\n",
    "exec /bin/true": "import os\nos.execv('/bin/true', ['true'])\n",
    "fork, parent exits": "import os\nif os.fork():\n    os._exit(0)\n",
    "atexit": "import atexit, os\natexit.register(os._exit, 0)\n",
    "excepthook": "import os, sys\nsys.excepthook = lambda *exc: os._exit(0)\n",
    "patched builtins": (
        "import builtins\n"
        "builtins.AssertionError = type('Harmless', (Warning,), {})\n"
        "builtins.exec = builtins.compile = lambda *args, **kwargs: None\n"
    ),
    "fake markers": (
        "import os\n"
        "print('ok')\n"
        "for fd in range(1, 256):\n"
        "    try:\n"
        "        os.write(fd, b'ok\\n0123456789abcdef0123456789abcdef')\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"
    ),
}
UNPASSABLE = [{"assert": "assert f(2) == 4"}, {"assert": "assert False"}, {"input": "2\n", "output": "4\n"}]


@pytest.mark.parametrize("code", EXIT_HACKS.values(), ids=EXIT_HACKS.keys())
def test_exiting_early_does_not_pass_assert_tests(code):
    result = run_tests(code, UNPASSABLE, FAST)
    assert result.pass_fraction == 0.0, result


def test_early_exit_status():
    # code_reward goes through run_tests; one hack end to end (each sandbox run forks the test process,
    # which inside the full suite holds JAX: about 1 s a run there, against 0.1 s alone)
    assert code_reward(_completion(EXIT_HACKS["sys.exit"]), _reference(UNPASSABLE)) == 0.0
    result = run_tests("import sys\nsys.exit(0)\n", [{"assert": "pass"}], FAST)
    assert [c.status for c in result.cases] == ["runtime_error"]  # SystemExit is caught by the harness
    result = run_tests("import os\nos._exit(0)\n", [{"assert": "pass"}], FAST)
    assert [c.status for c in result.cases] == ["early_exit"]


def test_assert_harness_runs_ordinary_programs_as_scripts():
    code = (
        "import pickle, sys\n"
        "class Point:\n    def __init__(self, x):\n        self.x = x\n"
        "def f(x):\n    return x * x\n"
        "if __name__ == '__main__':\n"
        "    MAIN = (__file__, sys.argv, pickle.loads(pickle.dumps(Point(3))).x)\n"
        "    print('some output')\n"
    )
    tests = [
        {"assert": "assert f(5) == 25"},
        {"assert": "import os\nassert os.path.isabs(MAIN[0]) and MAIN[0].endswith('/prog.py'), MAIN"},
        {"assert": "assert MAIN[1:] == (['prog.py'], 3), MAIN"},
        {"assert": "import sys\nassert id(sys.modules['__main__'].f) == id(f)"},
        {"assert": "assert f(2) == 5"},
    ]
    result = run_tests(code, tests, FAST)
    assert [c.status for c in result.cases] == ["ok", "ok", "ok", "ok", "wrong_answer"], result
    syntax_error = run_tests("def f(:\n", [{"assert": "pass"}], FAST)
    assert syntax_error.cases[0].status == "runtime_error"
    assert run_tests("x = bytearray(10**10)\n", [{"assert": "pass"}], FAST).cases[0].status == "memory"


def test_assert_text_is_not_visible_to_the_program():
    # The test's text lives only in the harness: no file in the sandbox dir (prog.py included) holds it.
    code = (
        "import os\n"
        "def f(x):\n    return x * x\n"
        "TOKEN = str(31336 + 1)  # not spelled out, so that prog.py does not contain it\n"
        "LEAKED = [n for n in os.listdir('.')\n"
        "          if os.path.isfile(n) and TOKEN in open(n, errors='replace').read()]\n"
    )
    result = run_tests(code, [{"assert": "assert not LEAKED and f(31337) == 31337 ** 2, LEAKED"}], FAST)
    assert result.pass_fraction == 1.0, result


# -- assert tests cannot learn the answer by forking ----------------------------------

# Knows nothing about the answer: forks one child per guess; each child returns its guess and runs
# into the hidden statement; the parent exits 0 once a child passed (that child wrote the nonce).
_GUESS_IN_CHILDREN = (  # the body of a function returning, in each of its children, one guess
    "    for guess in range(-3, 30):\n"
    "        pid = os.fork()\n"
    "        if pid == 0:\n"
    "            return guess\n"
    "        _, st = os.waitpid(pid, 0)\n"
    "        if os.waitstatus_to_exitcode(st) == 0:\n"
    "            os._exit(0)\n"
    "    os._exit(1)\n"
)
FORK_ORACLE = ("import os\ndef _try():\n" + _GUESS_IN_CHILDREN +
               "_answer = _try()\ndef add(*a):\n    return _answer\n")
# The same, forking inside the function, i.e. while the statement runs.
FORK_ORACLE_IN_CALL = "import os\ndef add(*a):\n" + _GUESS_IN_CHILDREN
ADD_TESTS = [{"assert": "assert add(2, 3) == 5"}, {"assert": "assert add(10, 13) == 23"}]


def test_assert_tests_cannot_fork_an_oracle():
    for code in (FORK_ORACLE, FORK_ORACLE_IN_CALL):
        result = run_tests(code, ADD_TESTS, FAST)
        assert result.pass_fraction == 0.0, result
    # The program of an assert test gets EPERM from fork and subprocess; threads still work.
    code = (
        "import errno, os, subprocess, threading\ndef f(x):\n    return x * x\n"
        "def threaded():\n    out = []\n"
        "    ts = [threading.Thread(target=lambda i=i: out.append(f(i))) for i in range(4)]\n"
        "    [t.start() for t in ts]\n    [t.join() for t in ts]\n    return sorted(out)\n"
    )
    tests = [
        {"assert": "try:\n    os.fork()\nexcept OSError as e:\n    assert e.errno == errno.EPERM\n"
                   "else:\n    os._exit(0)  # early_exit in parent and child"},
        {"assert": "try:\n    subprocess.run(['true'])\nexcept OSError as e:\n"
                   "    assert e.errno == errno.EPERM\nelse:\n    raise AssertionError('subprocess ran')"},
        {"assert": "assert threaded() == [0, 1, 4, 9]"},
    ]
    result = run_tests(code, tests, FAST)
    assert [c.status for c in result.cases] == ["ok"] * 3, result
    # IO tests may still fork: the parent judges the whole run's stdout.
    forking = (
        "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('forked')\n"
    )
    assert run_program(forking, "", FAST)[:2] == ("ok", "forked\n")


def test_forked_children_cannot_pass_without_seccomp(monkeypatch):
    # Where the seccomp filter is unavailable, forked children still cannot pass: the caller decides.
    launcher_argv = sandbox._launcher_argv
    monkeypatch.setattr(sandbox, "_launcher_argv", lambda *a, no_fork=False: launcher_argv(*a))
    forks = {"assert": "pid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)"}
    assert run_tests("import os\n", [forks], FAST).pass_fraction == 1.0  # the filter is off
    for code in (FORK_ORACLE, FORK_ORACLE_IN_CALL):
        result = run_tests(code, ADD_TESTS[:1], FAST)
        assert result.pass_fraction == 0.0, result


# fork through the i386 ABI (``int 0x80``, nr 2), which a filter on x86_64 syscall numbers alone would miss
# (the test adds x32: nr 57 | 0x40000000). Prints "forked" in a successful fork's parent.
I386_FORK = (
    "import ctypes, mmap, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
    "buf.write(bytes([0xB8, 2, 0, 0, 0, 0xCD, 0x80, 0xC3]))  # mov eax, 2; int 0x80; ret\n"
    "pid = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))()\n"
    "if pid == 0:\n    os._exit(0)\n"
    "print('forked' if pid > 0 else 'refused', flush=True)\n"
    "assert pid < 0\n"
)


def test_no_fork_filter_covers_other_abis():
    if os.uname().machine != "x86_64":
        pytest.skip("the i386 ABI exists on x86_64 only")
    status, out, _ = run_program(I386_FORK, "", FAST)  # IO runs may fork: does int 0x80 work here?
    if out != "forked\n":
        pytest.skip(f"no i386 syscalls or no executable mmap here ({status}, {out!r})")
    x32_fork = "assert libc.syscall(0x40000000 | 57) == -1 and ctypes.get_errno() == 1  # EPERM"
    result = run_tests(I386_FORK, [{"assert": "pass"}, {"assert": x32_fork}], FAST)
    assert [c.status for c in result.cases] == ["ok", "ok"], result  # the filter refused both forks


def test_no_fork_filter_arches():
    from jaxrl.rewards import sandbox_child

    for machine, nr_clone in (("x86_64", 56), ("aarch64", 220)):
        prog = sandbox_child.no_fork_filter(machine)
        assert prog and prog[0] == (0x20, 0, 0, 4) and prog[-3][0] == 0x06  # load arch ... returns
        assert any(k == nr_clone for _, _, _, k in prog) and all(0 <= jt < 256 > jf for _, jt, jf, _ in prog)
    assert sandbox_child.no_fork_filter("riscv64") is None  # unknown: only the harness's pid check


# -- namespaces: IPC, and no way back to the host for a non-root caller ------------------


def _sysv_keys(kind: str) -> set[int]:
    """Keys of the System V IPC objects of ``kind`` ("shm", "msg", "sem") in this IPC namespace."""
    try:
        with open(f"/proc/sysvipc/{kind}") as f:
            return {int(line.split()[0]) for line in f.readlines()[1:]}
    except OSError:
        return set()


def test_sysv_ipc_objects_do_not_outlive_the_run():
    key = 0x4A58_0000 + os.getpid() % 0x10000
    code = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"shm = libc.shmget({key}, ctypes.c_size_t(1 << 20), 0o1000 | 0o600)\n"
        f"msg = libc.msgget({key}, 0o1000 | 0o600)\n"
        f"sem = libc.semget({key}, 1, 0o1000 | 0o600)\n"
        "print(shm >= 0, msg >= 0, sem >= 0)\n"
    )
    try:
        status, out, err = run_program(code, "", FAST)
        assert (status, out) == ("ok", "True True True\n"), err
        left = [kind for kind in ("shm", "msg", "sem") if key in _sysv_keys(kind)]
        assert not left, f"the program's System V {left} outlived the run"
    finally:
        for kind, flag in (("shm", "-M"), ("msg", "-Q"), ("sem", "-S")):
            if key in _sysv_keys(kind):
                subprocess.run(["ipcrm", flag, str(key)], check=False, capture_output=True)


def test_sysv_shared_memory_cannot_pile_up_past_the_memory_limit():
    # A segment outlived its detach, so attach, fill, detach, repeat held any amount of RAM in one run
    # (600 MB with memory_mb=128; enough segments take the host down). Now a segment goes with its last detach.
    code = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.shmat.restype = ctypes.c_void_p\n"
        "for _ in range(3):\n"
        "    sid = libc.shmget(0, ctypes.c_size_t(40 << 20), 0o1000 | 0o600)\n"
        "    addr = libc.shmat(sid, None, 0)\n"
        "    ctypes.memset(addr, 1, 40 << 20)\n"
        "    libc.shmdt(ctypes.c_void_p(addr))\n"
        "print(len(open('/proc/sysvipc/shm').readlines()) - 1)\n"
    )
    status, out, err = run_program(code, "", SandboxLimits(wall_time_s=5.0, memory_mb=96))
    assert (status, out) == ("ok", "0\n"), (status, out, err)


def _interpreter_for(uid: int) -> str | None:
    """A Python >= 3.8 that ``uid`` can run (the base interpreter may be under /root), or None."""
    from jaxrl.rewards.sandbox_child import hidden_ancestor

    for py in (sandbox._base_interpreter(), "/usr/bin/python3", "/bin/python3"):
        if os.path.exists(py) and hidden_ancestor(os.path.realpath(py)) is None:
            probe = subprocess.run(
                ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", py, "-S", "-c",
                 "import sys; assert sys.version_info >= (3, 8)"], capture_output=True, check=False)
            if probe.returncode == 0:
                return py
    return None


UNMOUNT_ESCAPE = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "print('uid', os.getuid())\n"
    "for d in (b'/tmp', b'/proc'):\n"
    "    print('umount', d.decode(), libc.umount2(d, 2))  # MNT_DETACH\n"
    "try:\n    open('/proc/1/environ', 'rb').read()\n    print('read /proc/1/environ')\n"
    "except OSError:\n    print('denied /proc/1/environ')\n"
    "print('host /tmp visible', os.path.exists(sys.argv[1]))\n"
)


def test_non_root_program_cannot_unmount_its_confinement():
    """As non-root the program was root in the user namespace owning its mounts: ``umount2("/tmp")`` and
    ``/proc`` gave it the host's /tmp and processes. Now it is uid 65534 in a nested user namespace."""
    marker = tempfile.NamedTemporaryFile(prefix="jaxrl_host_tmp_marker_")  # in the host /tmp
    if os.geteuid() != 0:  # the suite itself runs as non-root: the real thing
        status, out, err = run_program(UNMOUNT_ESCAPE.replace("sys.argv[1]", repr(marker.name)), "", FAST)
        assert status == "ok", err
    else:  # run the launcher as another uid (setpriv execs it, so its parent is still this process)
        uid = 43_210
        if shutil.which("setpriv") is None or (py := _interpreter_for(uid)) is None:
            pytest.skip(f"needs setpriv and a Python that uid {uid} may run, to run the sandbox as non-root")
        tmpdir = tempfile.mkdtemp(prefix=f"jaxrl_sandbox_{os.getpid()}_")
        os.chown(tmpdir, uid, uid)
        # a copy of the launcher that uid may read (the checkout may be in a dir private to root)
        launcher = shutil.copy(sandbox._LAUNCHER, os.path.join(tmpdir, "launcher.py"))
        report_r, report_w = os.pipe()
        try:
            argv = [launcher if a == sandbox._LAUNCHER else a
                    for a in sandbox._launcher_argv(py, FAST, tmpdir, report_w)]
            proc = subprocess.run(
                ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv,
                 py, "-S", "-c", UNMOUNT_ESCAPE, marker.name],
                cwd=tmpdir, env={"PATH": "/usr/bin:/bin", "HOME": tmpdir}, pass_fds=[report_w],
                capture_output=True, text=True, timeout=30, check=False,
            )
            os.close(report_w)
            report_w = None
            error, namespaces = sandbox._read_report(report_r)
        finally:
            for fd in (report_r, report_w):
                if fd is not None:
                    os.close(fd)
            shutil.rmtree(tmpdir, ignore_errors=True)
        if error is None and "mnt" not in namespaces:
            pytest.skip(f"no unprivileged user namespaces here (uid {uid} got only {namespaces})")
        assert error is None and proc.returncode == 0, (error, proc.stderr)
        out = proc.stdout
    assert out.splitlines() == [
        "uid 65534", "umount /tmp -1", "umount /proc -1", "denied /proc/1/environ", "host /tmp visible False",
    ], out


# -- what correct programs need --------------------------------------------------------


def test_exit_and_quit_work_and_programs_run_as_scripts():
    # -S (no site) left exit()/quit() undefined: `print(ans); exit()` was a NameError and scored 0.
    code = (
        "n = int(input())\nif n < 0:\n    print('NO')\n    exit()\n"
        "print('YES')\nquit()\nprint('unreachable')\n"
    )
    result = run_tests(code, [{"input": "-1\n", "output": "NO\n"}, {"input": "5\n", "output": "YES\n"}], FAST)
    assert result.pass_fraction == 1.0, result
    assert run_program("print(1)\nexit(3)\n", "", FAST)[:2] == ("runtime_error", "1\n")
    exits = run_tests("def f(x):\n    return x\n", [{"assert": "assert f(1) == 1\nexit()"}], FAST)
    assert exits.pass_fraction == 0.0  # SystemExit: the statement did not complete
    script = (
        "import os, pickle, sys\n"
        "class P:\n    pass\n"
        "print(__name__, os.path.isabs(__file__) and __file__.endswith('/prog.py'), sys.argv,\n"
        "      type(pickle.loads(pickle.dumps(P()))).__name__, sys.modules['__main__'].P is P)\n"
    )
    assert run_program(script, "", FAST)[:2] == ("ok", "__main__ True ['prog.py'] P True\n")


def test_output_cap_fits_the_expected_output():
    # 109 KB of expected output, over the default 64 KiB cap: a correct program hit "output_limit".
    n = 20_000
    expected = "\n".join(map(str, range(n))) + "\n"
    code = "n = int(input())\nprint('\\n'.join(map(str, range(n))))\n"
    result = run_tests(code, [{"input": f"{n}\n", "output": expected}], SandboxLimits(wall_time_s=5.0))
    assert [c.status for c in result.cases] == ["ok"], result
    flood = "while True:\n    print('x' * 1000)\n"  # still capped: at 2 x expected + 4 KiB
    result = run_tests(flood, [{"input": "", "output": expected}], SandboxLimits(wall_time_s=5.0))
    assert [c.status for c in result.cases] == ["output_limit"], result


def test_hash_seed_is_fixed():
    # -I implied -E, so every run drew a random PYTHONHASHSEED: printing a set scored at random.
    env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}
    expected = subprocess.run([sandbox._base_interpreter(), "-S", "-c", "print(hash('jaxrl'))"],
                              env=env, capture_output=True, text=True, check=True).stdout
    for _ in range(2):
        assert run_program("print(hash('jaxrl'))\n", "", FAST)[:2] == ("ok", expected)
    result = run_tests("x = 1\n", [{"assert": f"assert hash('jaxrl') == {expected.strip()}"}], FAST)
    assert result.pass_fraction == 1.0, result


# -- time budgets and orphans --------------------------------------------------------

SLEEPER = "import time\ntime.sleep(25)\ndef f(x):\n    return x * x\n"


def test_run_tests_budget():
    limits = SandboxLimits(wall_time_s=5.0, cpu_time_s=1.0)
    tests = [{"assert": "assert f(2) == 4"}, {"bogus": 1}, {"input": "", "output": ""}]
    start = time.monotonic()
    result = run_tests(SLEEPER, tests, limits, budget_s=1.0)
    assert time.monotonic() - start < 3.0
    assert [c.status for c in result.cases] == ["timeout", "invalid_test", "not_run"]
    assert run_tests(SQUARE, TESTS, FAST, budget_s=30.0).pass_fraction == 1.0


def test_code_reward_stays_within_the_pool_deadline(monkeypatch, caplog):
    tests = [{"assert": f"assert f({i}) == {i * i}"} for i in range(40)]
    monkeypatch.setattr(sandbox, "item_deadline", lambda: time.monotonic() + 0.6)
    monkeypatch.setattr(sandbox, "_budget_warned", False)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
        reward = code_reward(_completion(SQUARE), _reference(tests))
    assert time.monotonic() - start < 1.5
    assert 0.0 <= reward < 1.0  # a correct program, but there was no time for all of its tests
    assert "reward.timeout_s" in caplog.text


def test_code_reward_in_a_pool_stops_before_the_pool_kills_it():
    tests = [{"assert": "assert f(2) == 4"}, {"input": "3\n", "output": "9\n"}]
    with RewardPool(code_reward, num_workers=1, timeout_s=1.5) as pool:
        pool.score(["warm"], ["{}"])
        start = time.monotonic()
        result = pool.score([_completion(SLEEPER), _completion(SQUARE)], [_reference(tests)] * 2)
        elapsed = time.monotonic() - start
    # The sleeper's runs were cut short by code_reward itself: no kill, no worker restart.
    assert (result.timeouts, result.errors) == (0, 0)
    assert result.rewards.tolist() == [0.0, 1.0]
    assert elapsed < 3.0


def _tagged_sleeper(tag: str) -> str:
    """A program with ``tag`` in its text that sleeps in a process with ``tag`` in its argv."""
    return (
        "import os, sys\n"
        f"os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(25)', {tag!r}])\n"
    )


def _tagged_processes(tag: str) -> list:
    return [p for p in psutil.process_iter(["cmdline"]) if tag in (p.info["cmdline"] or ())]


def _tagged_dirs(tag: str) -> list[str]:
    """The host's sandbox dirs whose program (written there by the caller) contains ``tag``."""
    def holds_tag(path):
        try:
            with open(os.path.join(path, "prog.py")) as f:
                return tag in f.read()
        except OSError:
            return False
    return [d for d in glob.glob(os.path.join(tempfile.gettempdir(), "jaxrl_sandbox_*")) if holds_tag(d)]


def _wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def tag():
    tag = f"jaxrl_orphan_{uuid.uuid4().hex}"
    yield tag
    for p in _tagged_processes(tag):  # only reached when the test failed
        p.kill()
    for path in _tagged_dirs(tag):
        shutil.rmtree(path, ignore_errors=True)


def run_without_deadline(completion: str, reference: str) -> float:
    """Runs the completion with the default 5 s wall limit, longer than the pool timeouts below allow."""
    status, _, _ = run_program(completion, reference)
    return float(status == "ok")


def test_pool_timeout_ends_the_sandboxed_program_and_removes_its_dir(tag):
    with RewardPool(run_without_deadline, num_workers=1, timeout_s=1.0) as pool:
        assert pool.score(["print(1)\n"], [""]).rewards.tolist() == [1.0]  # worker started
        result = pool.score([_tagged_sleeper(tag)], [""])
        assert (result.timeouts, result.rewards.tolist()) == (1, [0.0])
        assert _wait_until(lambda: not _tagged_processes(tag), 2.0), "the program outlived its worker"
        assert _wait_until(lambda: not _tagged_dirs(tag), 2.0), "the sandbox dir was left behind"


def test_killed_worker_takes_its_sandboxed_program_with_it(tag):
    ctx = multiprocessing.get_context("spawn")
    worker = ctx.Process(target=run_program, args=(_tagged_sleeper(tag), ""))
    worker.start()
    try:
        started = _wait_until(lambda: _tagged_processes(tag) and _tagged_dirs(tag), 8.0)
        assert started, "the program never started"
        os.kill(worker.pid, signal.SIGKILL)  # no chance to clean up
        worker.join()
        assert _wait_until(lambda: not _tagged_processes(tag), 2.0), "the program outlived its worker"
        assert _tagged_dirs(tag)
        sandbox._remove_orphaned_dirs()  # what the next sandbox process does first
        assert not _tagged_dirs(tag)
    finally:
        worker.kill()
        worker.join()


# -- the pool's workers do not outlive it ----------------------------------------------------

_HUNG_POOL = """
import sys
sys.path.insert(0, {tests!r})
import reward_fns
from jaxrl.rewards.pool import RewardPool
pool = RewardPool(reward_fns.chaos, num_workers=1, timeout_s=60.0)
pool.score(["a"], ["a"])
print(pool._pool._workers[0].process.pid, flush=True)
pool.score(["hang"], [""])
"""


def test_busy_worker_dies_with_a_killed_parent():
    # A parent SIGKILLed (OOM killer, a crash) while a worker hung on an item left that worker spinning forever.
    parent = subprocess.Popen([sys.executable, "-c", _HUNG_POOL.format(tests=os.path.dirname(__file__))],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = psutil.Process(int(parent.stdout.readline()))
        time.sleep(0.2)  # the worker is now in the hanging item
        parent.kill()
        parent.wait()
        assert _wait_until(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 2.0), \
            "the pool's worker outlived its parent"
    finally:
        parent.kill()
        if worker is not None and worker.is_running():
            worker.kill()


def test_numpy_bool_rewards_are_numbers():
    # `return np.isclose(...)` and the like give an np.bool_: every item scored 0 as an error.
    with RewardPool(reward_fns.numpy_match, num_workers=1, timeout_s=5.0) as pool:
        result = pool.score(["1", "2"], ["1", "3"])
    assert result.rewards.tolist() == [1.0, 0.0] and result.errors == 0


def test_workers_survive_the_thread_that_started_them():
    # Workers die with their parent thread (see above): the pool starts them on a thread of its own, so that
    # scoring from a short-lived thread (a rollout executor) does not kill them when that thread ends.
    with RewardPool(reward_fns.exact_match, num_workers=1, timeout_s=5.0) as pool:
        results = []
        scorer = threading.Thread(target=lambda: results.append(pool.score(["1"], ["1"])))
        scorer.start()
        scorer.join()
        pid = pool._pool._workers[0].process.pid
        time.sleep(0.2)
        result = pool.score(["1", "2"], ["1", "3"])
        assert pool._pool._workers[0].process.pid == pid, "the worker died with the thread that started it"
    assert results[0].rewards.tolist() == [1.0] and result.rewards.tolist() == [1.0, 0.0]
    assert (result.errors, result.timeouts) == (0, 0)
