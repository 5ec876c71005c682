"""Tests for the sandbox's confinement: a minimal read-only root and a seccomp filter in every run.

Each hostile case was reproduced against the code before them (issue 31): a socket bound at ``/run/x.sock``
accepted connections, a key stored by one run was read by the next, and ``/etc/passwd`` and the checkout
were readable.
"""

import errno
import json
import logging
import os
import socket
import struct
import uuid

import pytest

import jaxrl.rewards.sandbox as sandbox
from jaxrl.rewards import sandbox_child, sandbox_host
from jaxrl.rewards.sandbox import SandboxLimits, run_program, run_tests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = SandboxLimits(wall_time_s=5.0, cpu_time_s=2.0)


def _setup() -> sandbox_host.HostSetup:
    return sandbox_host.host_setup(sandbox._base_interpreter(), sandbox._DIR_PREFIX)


def _needs_root():
    if not _setup().root:
        pytest.skip("no minimal root on this host (no mount namespace or user namespaces; see the warning logged)")


def _needs_filter():
    _needs_root()
    status, out, _ = run_program("print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])", "")
    if not _setup().filters or (status, out) != ("ok", "2\n"):
        pytest.skip(f"no seccomp filter on this host (libseccomp or the kernel's seccomp missing; got {out!r})")


# A program printing one line per probe: the probe's value, or the errno (or exception name) it failed with.
PROBE = r"""
import ctypes, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def probe(name, f):
    try:
        print(name, f())
    except OSError as e:
        print(name, "errno", e.errno)
    except Exception as e:
        print(name, type(e).__name__)

def sys_call(nr, *args):
    r = libc.syscall(nr, *args)
    return r if r >= 0 else f"errno {ctypes.get_errno()}"
"""


def _probe(body: str, limits: SandboxLimits = FAST) -> dict[str, str]:
    status, out, err = run_program(PROBE + body, "", limits)
    assert status == "ok", err
    return dict(line.split(" ", 1) for line in out.splitlines())


_NR = {  # syscall numbers: x86_64, aarch64
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219), "ptrace": (101, 117),
    "unshare": (272, 97), "mount": (165, 40), "bpf": (321, 280), "perf_event_open": (298, 241),
    "userfaultfd": (323, 282), "io_uring_setup": (425, 425), "socket": (41, 198), "getpid": (39, 172),
    "process_vm_readv": (310, 270), "setns": (308, 268), "clone": (56, 220),
}


def _nr(name: str) -> int:
    machine = os.uname().machine
    if machine not in ("x86_64", "aarch64"):
        pytest.skip(f"syscall numbers known for x86_64 and aarch64, not {machine}")
    return _NR[name][machine == "aarch64"]


# -- the acceptance lines: host sockets, keyrings, host files ------------------------------------


@pytest.mark.parametrize("where", ["/run", "/tmp"])
def test_host_unix_sockets_are_unreachable(where):
    _needs_root()
    if not os.access(where, os.W_OK):
        pytest.skip(f"cannot bind a socket under {where} here")
    path = os.path.join(where, f"jaxrl_confine_{uuid.uuid4().hex[:8]}.sock")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen(4)
        server.settimeout(0.2)
        code = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\nprint('connected')\n"
        for limits in (FAST, SandboxLimits(wall_time_s=5.0, cpu_time_s=2.0, isolate_network=False)):
            status, out, err = run_program(code, "", limits)
            assert (status, out) == ("runtime_error", ""), (status, out, err)
            assert "PermissionError" in err or "FileNotFoundError" in err, err
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
        os.unlink(path)


def test_unix_and_netlink_sockets_are_refused_by_the_filter():
    # Even where no file names a socket (abstract addresses): the filter refuses the socket itself. A
    # socketpair is allowed: its two ends are connected to each other only (asyncio's wake-up pipe).
    _needs_filter()
    nr = _nr("socket")
    got = _probe(
        "probe('unix', lambda: socket.socket(socket.AF_UNIX).close())\n"
        "probe('pair', lambda: [s.close() for s in socket.socketpair()][0])\n"
        "probe('netlink', lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW).close())\n"
        f"probe('unix_high_bits', lambda: sys_call({nr}, ctypes.c_long(0x100000001), 1, 0))\n"
        "probe('inet', lambda: socket.socket(socket.AF_INET).close())\n"
    )
    assert got == {"unix": f"errno {errno.EPERM}", "pair": "None",
                   "netlink": f"errno {errno.EPERM}", "unix_high_bits": f"errno {errno.EPERM}",
                   "inet": "None"}, got


def test_keyring_calls_fail_and_no_key_outlives_a_run():
    _needs_filter()
    name = f"jaxrl_confine_{uuid.uuid4().hex[:8]}".encode()
    store = (
        f"probe('add_key', lambda: sys_call({_nr('add_key')}, b'user', {name!r}, b'secret', 6, ctypes.c_long(-4)))\n"
        f"probe('keyctl', lambda: sys_call({_nr('keyctl')}, 0, ctypes.c_long(-4), 0))  # KEYCTL_GET_KEYRING_ID\n"
    )
    assert _probe(store) == {"add_key": f"errno {errno.EPERM}", "keyctl": f"errno {errno.EPERM}"}
    find = f"probe('request_key', lambda: sys_call({_nr('request_key')}, b'user', {name!r}, None, ctypes.c_long(0)))\n"
    assert _probe(find) == {"request_key": f"errno {errno.EPERM}"}


def test_host_files_are_not_readable():
    _needs_root()
    paths = {"passwd": "/etc/passwd", "readme": os.path.join(REPO, "README.md"), "checkout": REPO,
             "run": "/run", "var_run": "/var/run", "sandbox_src": sandbox._LAUNCHER}
    assert os.path.exists(paths["passwd"]) and os.path.exists(paths["readme"])
    body = "".join(
        f"probe({k + '_read'!r}, lambda: len(open({p!r}, 'rb').read()) if os.path.isfile({p!r}) "
        f"else len(os.listdir({p!r})))\n"
        f"probe({k + '_exists'!r}, lambda: os.path.exists({p!r}))\n"
        for k, p in paths.items()
    )
    got = _probe(body)
    for key, path in paths.items():
        assert got[f"{key}_exists"] == "False", (path, got)
        assert got[f"{key}_read"] == f"errno {errno.ENOENT}", (path, got)


def test_home_is_not_readable():
    # $HOME may hold the interpreter (pyenv in /root): then its dir exists in the root, but only the
    # interpreter's own path is there, and the dir cannot be listed.
    _needs_root()
    home = os.path.realpath(os.path.expanduser("~"))
    interpreter = os.path.realpath(sandbox._base_interpreter())
    entries = sorted(os.listdir(home))[:50] if os.access(home, os.R_OK) else []
    others = [os.path.join(home, e) for e in entries if not interpreter.startswith(os.path.join(home, e) + os.sep)]
    body = f"probe('list', lambda: os.listdir({home!r}))\n" + "".join(
        f"probe({'entry' + str(i)!r}, lambda: os.path.lexists({p!r}))\n" for i, p in enumerate(others))
    got = _probe(body)
    assert got.pop("list") in (f"errno {errno.ENOENT}", f"errno {errno.EACCES}"), got
    assert set(got.values()) <= {"False"}, {others[int(k[5:])]: v for k, v in got.items() if v != "False"}


def test_the_root_is_read_only_and_lists_nothing():
    _needs_root()
    got = _probe(
        "probe('write_root', lambda: open('/jaxrl_confine', 'w'))\n"
        "probe('mkdir_root', lambda: os.mkdir('/jaxrl_confine'))\n"
        "probe('write_stdlib_dir', lambda: open(os.path.join(os.path.dirname(os.__file__), 'x.py'), 'w'))\n"
        "probe('list_root', lambda: os.listdir('/'))\n"
        "probe('list_stdlib', lambda: 'os.py' in os.listdir(os.path.dirname(os.__file__)))\n"
        "probe('site_packages', lambda: os.listdir(os.path.join(os.path.dirname(os.__file__), 'site-packages'))"
        " if os.path.isdir(os.path.join(os.path.dirname(os.__file__), 'site-packages')) else [])\n"
        "probe('etc', lambda: os.listdir('/etc'))\n"
        # the PID namespace's init kept the host's cwd (the run's real dir): it is not reachable through /proc
        "probe('init_cwd', lambda: os.listdir('/proc/1/cwd'))\n"
        "probe('init_root', lambda: os.listdir('/proc/1/root'))\n"
        "probe('devices', lambda: (open('/dev/null', 'w').write('x'), len(open('/dev/urandom', 'rb').read(4)),"
        " open('/dev/zero', 'rb').read(2)))\n"
    )
    assert got["write_root"] in (f"errno {errno.EROFS}", f"errno {errno.EACCES}"), got
    assert got["mkdir_root"] in (f"errno {errno.EROFS}", f"errno {errno.EACCES}"), got
    assert got["write_stdlib_dir"] in (f"errno {errno.EROFS}", f"errno {errno.EACCES}"), got
    assert got["list_root"] == f"errno {errno.EACCES}", got
    assert got["list_stdlib"] == "True" and got["site_packages"] == "[]", got
    assert got["etc"] == f"errno {errno.EACCES}", got  # /etc holds only ld.so.cache, and cannot be listed
    assert got["init_cwd"] == got["init_root"] == f"errno {errno.EACCES}", got
    assert got["devices"] == "(1, 4, b'\\x00\\x00')", got


def test_kernel_surfaces_are_refused():
    _needs_filter()
    got = _probe(
        f"probe('ptrace', lambda: sys_call({_nr('ptrace')}, 0, 0, 0, 0))  # PTRACE_TRACEME\n"
        f"probe('unshare', lambda: sys_call({_nr('unshare')}, 0x10000000))  # CLONE_NEWUSER\n"
        f"probe('setns', lambda: sys_call({_nr('setns')}, 0, 0))\n"
        f"probe('mount', lambda: sys_call({_nr('mount')}, b'none', b'/tmp', b'tmpfs', 0, None))\n"
        f"probe('bpf', lambda: sys_call({_nr('bpf')}, 0, None, 0))\n"
        f"probe('perf_event_open', lambda: sys_call({_nr('perf_event_open')}, None, 0, -1, -1, 0))\n"
        f"probe('userfaultfd', lambda: sys_call({_nr('userfaultfd')}, 0))\n"
        f"probe('io_uring_setup', lambda: sys_call({_nr('io_uring_setup')}, 1, None))\n"
        f"probe('process_vm_readv', lambda: sys_call({_nr('process_vm_readv')}, 1, None, 0, None, 0, 0))\n"
        # clone with CLONE_NEWUSER | SIGCHLD: a new user namespace through clone instead of unshare
        f"probe('clone_newuser', lambda: sys_call({_nr('clone')}, ctypes.c_ulong(0x10000000 | 17), None, None,"
        " None, None))\n"
        f"probe('getpid', lambda: sys_call({_nr('getpid')}) == os.getpid())\n"
    )
    expected = {name: f"errno {errno.EPERM}" for name in got} | {"getpid": "True"}
    # a clone that got through returns twice; the filter refuses it before that
    assert got == expected, got


def test_other_abis_are_refused_on_x86_64():
    _needs_filter()
    if os.uname().machine != "x86_64":
        pytest.skip("x32 exists on x86_64 only")
    got = _probe(f"probe('x32_getpid', lambda: sys_call(0x40000000 | {_nr('getpid')}))\n")
    assert got == {"x32_getpid": f"errno {errno.EPERM}"}, got


# -- what honest programs need --------------------------------------------------------------------

HONEST = r"""
import bisect, collections, decimal, fractions, functools, hashlib, heapq, itertools, json, math, os, re
import statistics, string, sys, threading

data = [int(tok) for tok in sys.stdin.read().split()]
counts = collections.Counter(x % 3 for x in data)
pairs = list(itertools.combinations(sorted(data), 2))
frac = sum(fractions.Fraction(1, x) for x in data)
decimal.getcontext().prec = 30
root2 = decimal.Decimal(2).sqrt()
found = re.findall(r"\d+", "a1b22c333")
results = []
threads = [threading.Thread(target=lambda i=i: results.append(i * i)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with open("scratch.txt", "w") as f:
    f.write(json.dumps({"n": len(data)}))
with open("/tmp/scratch.txt", "w") as f:
    f.write("tmp")
ok_files = json.load(open("scratch.txt"))["n"] == len(data) and open("/tmp/scratch.txt").read() == "tmp"
print(sum(data), math.comb(5, 2), dict(sorted(counts.items())), len(pairs), frac)
print(str(root2)[:10], found, sorted(results), ok_files, hashlib.sha256(b"x").hexdigest()[:8])
print(heapq.nsmallest(2, data), bisect.bisect(sorted(data), 3), statistics.mean(data), functools.reduce(max, data))


def solve(xs):
    return sum(xs)
"""
HONEST_OUT = (
    "15 10 {0: 1, 1: 2, 2: 2} 10 137/60\n"
    "1.41421356 ['1', '22', '333'] [0, 1, 4, 9] True 2d711642\n"
    "[1, 2] 3 3 5\n"
)


def test_honest_programs_still_run():
    tests = [{"input": "1 2 3 4 5\n", "output": HONEST_OUT}, {"assert": "assert solve([1, 2]) == 3"}]
    result = run_tests(HONEST, [tests[0]], FAST)
    assert result.pass_fraction == 1.0, (result, run_program(HONEST, "1 2 3 4 5\n", FAST))
    # the assert harness reads stdin too: give it the same numbers through the test's own input
    assert run_tests(HONEST.replace("sys.stdin.read()", "'1 2 3 4 5'"), [tests[1]], FAST).pass_fraction == 1.0


def test_io_tests_that_fork_still_work():
    code = (
        "import os, multiprocessing\n"
        "pid = os.fork()\n"
        "if pid == 0:\n    os._exit(7)\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
        "with multiprocessing.Pool(2) as pool:\n    print(pool.map(abs, [-1, -2, -3]))\n"
    )
    assert run_tests(code, [{"input": "", "output": "7\n[1, 2, 3]\n"}], FAST).pass_fraction == 1.0


def test_asyncio_programs_run():
    # asyncio's event loop wakes itself through a socketpair: the filter allows socketpair (its ends reach
    # only each other) while it refuses every named Unix socket.
    code = (
        "import asyncio\n"
        "async def twice(x):\n    await asyncio.sleep(0)\n    return 2 * x\n"
        "async def main():\n    return await asyncio.gather(*(twice(i) for i in range(3)))\n"
        "print(asyncio.run(main()))\n"
    )
    assert run_program(code, "", FAST)[:2] == ("ok", "[0, 2, 4]\n")


def test_assert_tests_still_cannot_fork():
    _needs_filter()
    check = "import os\ntry:\n    os.fork()\nexcept PermissionError:\n    ok = True\nelse:\n    ok = False\n"
    assert run_tests(check, [{"assert": "assert ok"}], FAST).pass_fraction == 1.0


# -- the filter itself, and the fallbacks --------------------------------------------------------


def _instructions(prog: bytes) -> list[tuple[int, int, int, int]]:
    return [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]


@pytest.mark.parametrize("machine, audit_arch", [("x86_64", 0xC000003E), ("aarch64", 0xC00000B7)])
def test_the_filter_builds_for_both_arches(machine, audit_arch):
    if sandbox_host._load_libseccomp() is None:
        pytest.skip("no libseccomp here")
    for no_fork in (False, True):
        insns = _instructions(sandbox_host.seccomp_filter(no_fork, machine))
        # load seccomp_data.arch, compare with this arch; anything else gets EPERM (not allowed)
        assert insns[0] == (0x20, 0, 0, 4) and insns[1][0] == 0x15 and insns[1][3] == audit_arch
        returns = {k for code, _, _, k in insns if code == 0x06}
        assert returns == {0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS}, returns
        if machine == "x86_64":  # x32 syscalls (nr | 0x40000000) take the foreign-ABI action
            assert any(code == 0x35 and k == 0x40000000 for code, _, _, k in insns)
    no_fork_len = len(sandbox_host.seccomp_filter(True, machine))
    assert no_fork_len > len(sandbox_host.seccomp_filter(False, machine))


def test_missing_libseccomp_is_said_once_and_runs_fall_back(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_host, "_host_setups", {})
    monkeypatch.setattr(sandbox_host, "_load_libseccomp", lambda: None)
    with caplog.at_level(logging.WARNING, logger="jaxrl.rewards.sandbox"):
        assert run_program("print(1)", "", FAST)[:2] == ("ok", "1\n")
        assert run_tests("def f(x): return x", [{"assert": "assert f(1) == 1"}], FAST).pass_fraction == 1.0
    said = [r.getMessage() for r in caplog.records if "libseccomp" in r.getMessage()]
    assert len(said) == 1 and "hand-built no-fork filter" in said[0], said
    assert not _setup().filters


def test_launcher_gets_the_root_and_filter():
    setup = _setup()
    argv = sandbox._launcher_argv(sandbox._base_interpreter(), FAST, "/tmp/x", 5, no_fork=True)
    spec, _ = sandbox_child.parse_args(argv[5:] + ["prog"])
    assert spec["root"].split(os.pathsep) == list(setup.root) if setup.root else spec["root"] == ""
    assert bytes.fromhex(spec["seccomp"]) == setup.filters.get(True, b"")
    if setup.root:
        assert any(p.endswith("ld.so.cache") for p in setup.root)
        assert not any(p == REPO or p.startswith(REPO + os.sep) for p in setup.root), setup.root
    no_mount = SandboxLimits(isolate_network=False)
    original = sandbox._namespaces_to_enter
    try:
        sandbox._namespaces_to_enter = lambda limits: ["pid"]
        spec, _ = sandbox_child.parse_args(sandbox._launcher_argv("python", no_mount, "/tmp/x", 5)[5:] + ["p"])
        assert spec["root"] == "" and spec["hide"] == ""  # no mount namespace: no root asked for
    finally:
        sandbox._namespaces_to_enter = original


def test_reference_json_tests_run_confined():
    # code_reward end to end: an honest solution scores 1, a reader of the checkout 0
    from jaxrl.rewards.sandbox import code_reward

    _needs_root()
    reference = json.dumps({"tests": [{"input": "2\n", "output": "4\n"}]})
    assert code_reward("```python\nprint(int(input()) ** 2)\n```", reference) == 1.0
    cheat = f"```python\nprint(open({os.path.join(REPO, 'README.md')!r}).read() and 4)\n```"
    assert code_reward(cheat, reference) == 0.0


def test_a_root_that_cannot_be_built_fails_closed(monkeypatch):
    # A run asked to use a root never falls back to the host's files on its own: it is a sandbox_error.
    _needs_root()
    broken = sandbox_host.HostSetup(_setup().root + ("/nonexistent/jaxrl_confine.so",), _setup().hide,
                                    _setup().filters)
    monkeypatch.setitem(sandbox_host._host_setups, sandbox._base_interpreter(), broken)
    status, out, err = run_program("print('ran')", "", FAST)
    assert (status, out) == ("sandbox_error", ""), (status, out, err)
    assert "nonexistent" in err


def test_a_host_without_the_root_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_host, "_host_setups", {})
    with caplog.at_level(logging.WARNING, logger="jaxrl.rewards.sandbox"):
        first = sandbox_host.host_setup("/nonexistent/python3")
        second = sandbox_host.host_setup("/nonexistent/python3")
    assert first is second and first.root == () and first.hide == ()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == len(set(said)) >= 1, said  # each problem once, not again on the second call
    assert any("cannot list the files" in m and "programs see the host's files" in m for m in said), said


def test_every_denied_syscall_name_is_known():
    # A misspelt name would be skipped like a syscall missing on the arch: a silent hole in the filter.
    lib = sandbox_host._load_libseccomp()
    if lib is None:
        pytest.skip("no libseccomp here")
    names = (*sandbox_host._DENIED_SYSCALLS, "clone3", "clone", "fork", "vfork", "socket")
    unknown = [n for n in names if lib.seccomp_syscall_resolve_name_arch(0xC000003E, n.encode()) == -1]
    assert not unknown, unknown  # -1 is __NR_SCMP_ERROR: libseccomp knows no syscall of that name
    # x86_64 numbers for a few, from the kernel's syscall_64.tbl
    for name, nr in (("keyctl", 250), ("ptrace", 101), ("io_uring_setup", 425), ("bpf", 321)):
        assert lib.seccomp_syscall_resolve_name_arch(0xC000003E, name.encode()) == nr
