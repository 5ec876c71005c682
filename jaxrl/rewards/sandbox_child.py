"""The sandbox launcher: confine a fresh process, then exec the untrusted program in it.

``jaxrl.rewards.sandbox`` starts every run as::

    <base python> -I -S -B sandbox_child.py KEY=VALUE... -- PROGRAM_ARGV...

in the run's temporary directory, instead of running Python between fork and exec in the caller
(``preexec_fn``). That matters because the caller is often a multi-threaded JAX process holding
gigabytes: forking it is unsafe (a lock held by another thread stays locked in the child) and slow
(copying its page tables cost about 1 s per run in the test suite). ``subprocess`` can start this
launcher with ``vfork``, and all the set-up below runs in a small single-threaded interpreter.

The settings (``spec``) are ``KEY=VALUE`` arguments (plain text, as ``json`` would add ~6 ms of
imports to every run): ``wall_time_s``, ``cpu_time_s``, ``memory_mb``, ``file_size_mb`` and
``max_processes`` (the ``SandboxLimits`` fields), ``namespaces`` (the ones wanted, comma-separated,
of ``mnt``, ``pid``, ``ipc``, ``net``; may be empty), ``no_fork`` (``1``: an assert test, whose program
may create threads but no processes), ``root`` and ``hide`` (``os.pathsep``-separated host paths: what
the minimal root binds read-only, and the dirs in it covered by an empty tmpfs; empty: no minimal root),
``seccomp`` (the filter as hex of a ``struct sock_filter`` array; empty: none, or for ``no_fork`` the
hand-built ``no_fork_filter``), ``tmpdir``, ``report_fd`` and ``parent_pid`` (the caller). The
launcher writes one line to ``report_fd``: ``ok <namespaces entered> [root] [seccomp] [nofork]`` just
before it execs the program (``root``: it runs in the minimal root; ``seccomp``: the full filter is in
place; ``nofork``: a filter against new processes is), or ``error <message>`` if the set-up or the exec
failed (then it exits with status 125). No line at all means it died before getting that far.

**The minimal root.** With a mount namespace, the program runs in a root built for it (``_build_root``):
a tmpfs (mounted over the run's dir, so no other host path is touched) holding, bound read-only at their
own paths, exactly what the base interpreter needs: its executable, its stdlib dirs (``site-packages``
covered by an empty tmpfs), the shared objects it loads and ``/etc/ld.so.cache`` (so the dynamic loader
finds them at the same paths); then ``/dev`` with only ``null``, ``zero``, ``random`` and ``urandom``
(and ``fd``/``stdin``/``stdout``/``stderr`` links), a fresh ``/proc`` where a PID namespace exists (else
the host's, as without a root), tmpfs
``/tmp`` and ``/dev/shm`` (16 MB each) and the run's dir (a size-capped tmpfs holding copies of its
files). ``pivot_root`` into it and a detach of the old root leave nothing of the host: no ``/run``,
``/var/run``, ``/etc`` but the loader cache, ``/home``, ``/root``, nor the checkout. The root and every bind are
read-only (one recursive ``mount_setattr``), its dirs are 0711 (nothing can be listed), only the
tmpfs dirs are writable. The file list is not a distro layout: the caller runs ``sandbox_host.py
--list-files`` once per process under the interpreter, which imports every extension module of its stdlib
(but ``sandbox_host._USELESS_MODULES``), loads ``libgcc_s`` (glibc needs it on ``pthread_exit``) and reports every
object mapped, by the name the loader used (``dl_iterate_phdr``) and by real path (``/proc/self/maps``).
Where a root was asked for but cannot be made, the run fails (``sandbox_error``), never runs on the host's files.

**The seccomp filter**, in every run (IO and assert tests; ``sandbox_host.seccomp_filter``): default allow, EPERM for
Unix, netlink and every socket domain but AF_INET/AF_INET6 (a fresh network namespace gives those no
peer), keyrings (``add_key``, ``request_key``, ``keyctl``: keys outlived the run),
``ptrace``, ``process_vm_*``, ``pidfd_getfd``, mounts, ``unshare``/``setns``/``clone`` with a namespace
flag, ``bpf``, ``perf_event_open``, ``io_uring`` (its operations bypass seccomp), ``userfaultfd``, module
and kexec calls and a few more (``sandbox_host._DENIED_SYSCALLS``); assert tests also get EPERM for ``fork``, ``vfork``
and ``clone`` without ``CLONE_THREAD``. ``clone3`` gets ENOSYS (glibc then uses ``clone``, whose flags a
filter can read). On x86_64, i386 (``int 0x80``) and x32 syscalls get EPERM. ``socketpair`` stays
allowed: its two ends reach only each other, and ``asyncio`` needs one for its wake-up pipe. A program that
needs ``multiprocessing.Manager`` (a named Unix socket) fails; ``multiprocessing.Pool`` (pipes) works in IO tests. *Why libseccomp, through ctypes, compiled in the caller:* hand-written BPF
must get the arch check, the x32 bit, 64-bit argument compares (``socket(0x100000001)`` is AF_UNIX to
the kernel) and jump offsets right by itself; libseccomp (``libseccomp2``, a dependency of systemd and
so on every mainstream distro) is the maintained compiler for exactly that, covers x86_64 and aarch64
(and more) from syscall names, and builds a binary tree of syscalls. The launcher runs with ``-I -S``,
so it cannot import a PyPI binding; and ``pyseccomp`` (a ctypes binding by one author) or libseccomp's
own Cython bindings (not on PyPI) would add a dependency for nine C signatures. So ``sandbox_host.host_setup``,
in the caller, compiles the two filters once with ``seccomp_export_bpf`` and passes the BPF as hex; the
launcher only installs it with ``prctl`` (no libseccomp in the launcher, no per-run compile).

**When the host cannot.** ``sandbox_host.host_setup`` also runs the launcher once on an empty program with
everything asked for, and logs one warning per process for each thing this host lacks, with the fallback:
no mount namespace (no user namespaces) -> the host's files with tmpfs over ``/tmp``, ``/var/tmp``,
``/dev/shm``, ``/run/lock`` where a mount namespace exists at all; no libseccomp -> no syscall filter, assert
tests keep the hand-built no-fork filter; no kernel seccomp -> no filter, assert tests rely on the
harness's pid check; a root that cannot be built -> the host's files as before.

**Bubblewrap and nsjail.** bubblewrap (``bwrap``, Flatpak's sandbox) gives user/mount/pid/ipc/net/uts
namespaces, ``--ro-bind``/``--dev``/``--proc``/``--tmpfs`` to build a root much like ``_build_root``,
``--die-with-parent`` and ``--seccomp FD`` (a BPF program compiled elsewhere: it has no filter of its
own), but no rlimits or size-capped work dir. nsjail (Google) adds rlimits, cgroup limits (memory and pids
per run, which would close our memory gap where cgroups are delegated), and seccomp policies in its own
language (Kafel), configured in protobuf text. Both are C/C++ binaries with no interpreter to start, where
this launcher spends 14-43 ms (measured on a loaded 2-core machine) from its start to the program's exec,
mostly Python start-up, compiling this file and the namespaces (building the root takes 2-4 ms of it). We use neither: each is a system package every user and CI
machine would have to install (neither is on PyPI; nsjail is also hard to build), while this launcher
needs only the Python that runs jaxrl, libc and the ubiquitous libseccomp, and keeps the caller free of
forks, the report protocol and the nested-namespace privilege drop below in one place we test.

As non-root, the first user namespace maps the caller to root, which makes the other namespaces and
the mounts possible; root there could also undo the mounts (``umount2("/tmp", MNT_DETACH)`` revealed
the host's ``/tmp`` and ``/proc``). So after the mounts the launcher enters a second user namespace,
with a new mount namespace, in which it is uid/gid 65534: the mounts it inherits are locked
(``MNT_LOCKED``: they can only go all together), and the program it execs holds no capability. The
processes that stay outside it (the launcher and the PID namespace's init) are made non-dumpable, so
the program, although the same kernel uid, cannot ``ptrace`` them or open their ``/proc/<pid>/mem``.

Standard library only: it runs with ``-I -S`` and cannot import jaxrl. The caller's side (the file list,
the filter, the host check) is in ``sandbox_host``: this file is compiled from source on every run.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import resource
import signal
import struct
import sys

NOBODY = 65534
SETUP_FAILED = 125  # exit status of a launcher whose set-up failed
_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_TMPFS_SIZE = "size=16m,mode=1777"
# The run's own dir (a tmpfs too, see _private_work_dir): its files plus room for this many files of the
# largest size RLIMIT_FSIZE allows, and at least _WORK_DIR_MIN_MB.
_WORK_DIR_FILES, _WORK_DIR_MIN_MB = 4, 16

# <sched.h> / <sys/mount.h> / <sys/prctl.h>
_CLONE_NEWNS = 0x00020000
_CLONE_THREAD = 0x00010000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_NAMESPACE_FLAGS = {"mnt": _CLONE_NEWNS, "pid": _CLONE_NEWPID, "ipc": _CLONE_NEWIPC, "net": _CLONE_NEWNET}
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
# statvfs f_flag bits that a read-only remount of a bind must keep (they may be locked): same values as MS_*
_KEEP_FLAGS = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | 1024 | 2048 | 4096  # + noatime, nodiratime, relatime
_MNT_DETACH = 2
_SYS_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1  # same on both arches
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # no glibc wrapper
_ROOT_TMPFS = "size=1m,mode=711"  # the skeleton root: only dirs, empty files and mount points
_DEVICES = ("null", "zero", "random", "urandom")
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = 1, 4
_PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 22, 38
_LIMITS = ("wall_time_s", "cpu_time_s", "memory_mb", "file_size_mb", "max_processes")
_SETTINGS = ("namespaces", "no_fork", "root", "hide", "seccomp", "tmpdir", "report_fd", "parent_pid")

# seccomp (<linux/seccomp.h>, <linux/filter.h>, <linux/audit.h>). Per machine: the AUDIT_ARCH value
# in seccomp_data.arch, the syscalls refused outright (nr -> errno), clone's nr, and the first nr of a
# foreign ABI sharing the arch value (x32 on x86_64), or None. clone3 gets ENOSYS, so that glibc falls
# back to clone for threads; its flags are in a struct in memory, which a filter cannot read.
_SECCOMP_MODE_FILTER = 2
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
_SECCOMP_ARCHES = {
    "x86_64": (0xC000003E, {57: errno.EPERM, 58: errno.EPERM, 435: errno.ENOSYS}, 56, 0x40000000),
    "aarch64": (0xC00000B7, {435: errno.ENOSYS}, 220, None),
}
# BPF opcodes: BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_{JEQ,JGE,JSET}|BPF_K, BPF_RET|BPF_K
_BPF = {"ld": 0x20, "jeq": 0x15, "jge": 0x35, "jset": 0x45, "ret": 0x06}

_libc = None


def _load_libc():
    """libc via ctypes (Linux), loaded before any fork so no child calls dlopen."""
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.mount.argtypes = [
                ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p
            ]
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


def _unshare(flags: int) -> bool:
    libc = _load_libc()
    return libc is not None and libc.unshare(flags) == 0


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target}: {os.strerror(errno)}")


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class _MountAttr(ctypes.Structure):  # struct mount_attr
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _make_read_only(top: str, binds: list[str], writable: str) -> None:
    """Make the mount at ``top`` and every mount below it but ``writable`` (itself, not what is below it)
    read-only: one ``mount_setattr(AT_RECURSIVE)`` and one to clear ``writable`` where the kernel has it,
    else a remount of ``top`` and of each of ``binds`` (each keeping the flags it has: a user namespace may
    not drop them; a bind ignores MS_RDONLY until remounted)."""
    size = ctypes.c_size_t(ctypes.sizeof(_MountAttr))
    read_only, read_write = _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0), _MountAttr(0, _MOUNT_ATTR_RDONLY, 0, 0)
    if _libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, top.encode(), _AT_RECURSIVE, ctypes.byref(read_only),
                     size) == 0:
        _check(_libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, writable.encode(), 0, ctypes.byref(read_write),
                             size), f"mount_setattr {writable}")
        return
    if ctypes.get_errno() not in (errno.ENOSYS, errno.EINVAL):
        err = ctypes.get_errno()
        raise OSError(err, f"mount_setattr: {os.strerror(err)}")
    for target in (*binds, top):
        keep = os.statvfs(target).f_flag & _KEEP_FLAGS
        _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | keep)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def hidden_ancestor(path: str) -> str | None:
    """The outermost directory on ``path`` that others may not search (no o+x), or None."""
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        d = os.sep.join(parts[:i])
        if not os.stat(d).st_mode & 0o001:
            return d
    return None


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the thread that forked it exits (Linux; else a no-op).

    fork() and a change of uid clear the setting, so each process arms its own, after any uid change.
    The parent may be gone already: callers check that afterwards.
    """
    libc = _load_libc()
    args = (ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if libc is not None and libc.prctl(_PR_SET_PDEATHSIG, *args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")


def no_fork_filter(machine: str) -> list[tuple[int, int, int, int]] | None:
    """A seccomp filter (``(code, jt, jf, k)`` BPF instructions) under which a process cannot create
    another: ``fork``, ``vfork`` and ``clone`` without ``CLONE_THREAD`` fail with EPERM, ``clone3``
    with ENOSYS (glibc then uses ``clone``, so ``threading`` still works); a syscall of any other ABI
    (``int 0x80`` on x86_64, x32) fails with EPERM. None for a machine not in ``_SECCOMP_ARCHES``.
    """
    if machine not in _SECCOMP_ARCHES:
        return None
    audit_arch, refused, clone_nr, foreign_from = _SECCOMP_ARCHES[machine]
    eperm = f"errno{errno.EPERM}"
    flags_offset = 16 if sys.byteorder == "little" else 20  # low half of seccomp_data.args[0]
    prog = [("ld", 4, None, None), ("jeq", audit_arch, None, eperm), ("ld", 0, None, None)]
    if foreign_from is not None:
        prog.append(("jge", foreign_from, eperm, None))
    prog += [("jeq", nr, f"errno{err}", None) for nr, err in refused.items()]
    prog += [("jeq", clone_nr, None, "allow"), ("ld", flags_offset, None, None),
             ("jset", _CLONE_THREAD, "allow", eperm)]
    returns = {"allow": _SECCOMP_RET_ALLOW}
    for e in sorted({errno.EPERM, *refused.values()}):
        returns[f"errno{e}"] = _SECCOMP_RET_ERRNO | e
    where = {label: len(prog) + i for i, label in enumerate(returns)}
    out = []
    for pc, (op, k, jt, jf) in enumerate(prog):
        hop = lambda label: 0 if label is None else where[label] - pc - 1  # noqa: E731
        out.append((_BPF[op], hop(jt), hop(jf), k))
    return out + [(_BPF["ret"], 0, 0, k) for k in returns.values()]


def _install_filter(prog: bytes) -> bool:
    """Install the seccomp filter ``prog`` (``struct sock_filter`` array) on this process (inherited through
    fork and exec, never removed); whether it is in place."""
    libc = _load_libc()
    if libc is None or not prog or len(prog) % 8:
        return False

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = SockFprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_char_p))
    one, zero = ctypes.c_ulong(1), ctypes.c_ulong(0)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, one, zero, zero, zero) != 0:
        return False
    mode = ctypes.c_ulong(_SECCOMP_MODE_FILTER)
    return libc.prctl(_PR_SET_SECCOMP, mode, ctypes.byref(fprog), zero, zero) == 0


def _forbid_new_processes() -> bool:
    """Install ``no_fork_filter`` for this machine (the fallback where libseccomp is missing)."""
    prog = no_fork_filter(os.uname().machine)
    return prog is not None and _install_filter(b"".join(struct.pack("=HBBI", *insn) for insn in prog))


def _forbid_detached_shm() -> None:
    """In this (fresh) IPC namespace, destroy a System V shared memory segment at its last detach.

    A segment outlives its detach, and RLIMIT_AS counts only attached ones: attach, fill, detach, repeat
    held any amount of RAM. Best effort: where the sysctl is not writable, segments still go with the namespace.
    """
    try:
        _write("/proc/sys/kernel/shm_rmid_forced", "1")
    except OSError:
        pass


def _at_eof(fd: int) -> bool:
    """Whether reading the pipe ``fd`` gives EOF now (every write end is closed)."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 1) == b""
    except BlockingIOError:
        return False


def _wait_and_mirror(pid: int, reap_all: bool, keep_fd: int | None = None) -> None:
    """Wait for ``pid`` (reaping any other children too) and exit with its status. Never returns.

    A child killed by signal ``s`` is reported as exit code ``128 + s``. All fds >= 3 but ``keep_fd``
    are closed first, so this process holds neither the report pipe nor anything the program gets.
    It is made non-dumpable: as non-root the program has the same kernel uid, and could otherwise
    ``ptrace`` this process (or write its ``/proc/<pid>/mem``), e.g. to have it fork for a program that
    may not.
    """
    try:
        libc = _load_libc()
        if libc is not None:
            libc.prctl(_PR_SET_DUMPABLE, *(ctypes.c_ulong(0),) * 4)
        if keep_fd is None:
            os.closerange(3, 1 << 16)
        else:
            os.closerange(3, keep_fd)
            os.closerange(keep_fd + 1, 1 << 16)
        while True:
            wpid, status = os.waitpid(-1 if reap_all else pid, 0)
            if wpid == pid:
                code = os.waitstatus_to_exitcode(status)
                os._exit(128 - code if code < 0 else code)
    finally:
        os._exit(SETUP_FAILED)


class Confinement:
    """Namespaces, mounts, rlimits and privilege drop for one run, entered by ``enter()``.

    Process tree with a PID namespace: the launcher P waits for G (pid 1 of the new namespace, reaps
    orphans) which waits for H, the process that returns from ``enter()`` and execs the program.
    Killing P's process group kills G, and the kernel then kills everything left in the namespace.
    P dies with the calling thread of the caller and G with P (parent-death signals); without a PID
    namespace P is H, which re-arms its signal after dropping privileges.
    """

    def __init__(self, spec: dict[str, str]):
        self.limits = {name: float(spec[name]) for name in _LIMITS}
        self.namespaces = [n for n in spec["namespaces"].split(",") if n]
        unknown = set(self.namespaces) - set(_NAMESPACE_FLAGS)
        if unknown:
            raise ValueError(f"unknown namespaces {sorted(unknown)}")
        self.no_fork = spec["no_fork"] == "1"
        self.tmpdir = spec["tmpdir"]
        # The minimal root: host paths bound read-only at their own paths, dirs hidden under an empty tmpfs.
        self.root = [p for p in spec["root"].split(os.pathsep) if p]
        self.hide = [p for p in spec["hide"].split(os.pathsep) if p]
        for path in self.root + self.hide:
            if not os.path.isabs(path) or os.path.normpath(path) != path:
                raise ValueError(f"root paths must be absolute and normal, got {path!r}")
        self.seccomp = bytes.fromhex(spec["seccomp"])
        self.parent_pid = int(spec["parent_pid"])
        self.is_root = os.geteuid() == 0
        self.user_namespace = False  # whether _enter_user_namespace made us root in a user namespace
        # An interpreter under a dir "nobody" cannot enter (e.g. pyenv in /root, 0700).
        self.prefix = os.path.realpath(sys.base_prefix)
        self.hidden = hidden_ancestor(self.prefix) if self.is_root else None

    def enter(self) -> set[str]:
        """Confine this process; returns (in H only) the namespaces entered, plus ``"nofork"`` if the
        seccomp filter is in place."""
        got = set()
        if self.namespaces and (self.is_root or self._enter_user_namespace()):
            got = {name for name in self.namespaces if _unshare(_NAMESPACE_FLAGS[name])}
        if "ipc" in got:
            _forbid_detached_shm()
        self._die_with_caller()
        if "pid" in got:
            lifeline_r, lifeline_w = os.pipe()  # EOF for G once P is gone
            pid = os.fork()
            if pid:
                _wait_and_mirror(pid, reap_all=False, keep_fd=lifeline_w)  # P
            os.close(lifeline_w)
            die_with_parent()
            if _at_eof(lifeline_r):  # P died before G armed its signal
                os._exit(SETUP_FAILED)
            os.close(lifeline_r)
            pid = os.fork()
            if pid:
                _wait_and_mirror(pid, reap_all=True)  # G, pid 1 in the namespace
        if self.root and "mnt" not in got:  # never run with the host's files when a root was asked for
            raise RuntimeError("a minimal root was asked for, but no mount namespace was granted")
        if "mnt" in got and self.root:  # H from here on
            self._build_root(fresh_proc="pid" in got)
            got.add("root")
        elif "mnt" in got:
            try:
                self._mount_private_dirs(fresh_proc="pid" in got)
            except OSError:
                got.discard("mnt")
        if self.hidden and "mnt" not in got:
            raise RuntimeError(
                f"the interpreter under {self.hidden} is not accessible to uid {NOBODY} and no "
                "mount namespace is available to expose it; use a world-readable Python"
            )
        if self.user_namespace:
            self._give_up_namespace_root(must="mnt" in got)
        self._set_rlimits()
        if self.is_root:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            if os.getuid() != NOBODY or os.geteuid() != NOBODY:  # never run untrusted code as root
                raise RuntimeError("failed to drop privileges")
        if "pid" not in got:
            self._die_with_caller()  # P is H: the uid change cleared the signal
        # Last: nothing after it needs a new process or a mount.
        if self.seccomp:
            if _install_filter(self.seccomp):
                got |= {"seccomp", "nofork"} if self.no_fork else {"seccomp"}
        elif self.no_fork and _forbid_new_processes():
            got.add("nofork")
        # Backstop should the death signal be unavailable; inherited through exec, the caller kills first.
        signal.alarm(math.ceil(self.limits["wall_time_s"]) + 1)
        return got

    def _die_with_caller(self) -> None:
        """Die with the caller's thread that started us; exit if it is already gone."""
        die_with_parent()
        if os.getppid() != self.parent_pid:
            os._exit(SETUP_FAILED)

    def _enter_user_namespace(self) -> bool:
        """Non-root: a user namespace where we are root, so other namespaces are permitted."""
        uid, gid = os.getuid(), os.getgid()
        if not _unshare(_CLONE_NEWUSER):
            return False
        self.user_namespace = True
        try:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"0 {uid} 1")
            _write("/proc/self/gid_map", f"0 {gid} 1")
        except OSError:
            pass  # unmapped: unsharing may still work, mounts will likely fail (handled)
        return True

    def _give_up_namespace_root(self, must: bool) -> None:
        """Non-root, after the mounts: become uid/gid 65534 in a nested user namespace with a new mount
        namespace. Its mounts, copied from a namespace owned by a more privileged user namespace, are
        locked, and the program execs with no capability, so it can neither unmount the tmpfs over
        ``/tmp`` or ``/proc`` nor mount anything. ``must``: fail rather than run the program as the root
        that made the mounts (it could undo them).
        """
        try:
            if not _unshare(_CLONE_NEWUSER | _CLONE_NEWNS):
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{NOBODY} 0 1")
            _write("/proc/self/gid_map", f"{NOBODY} 0 1")
        except OSError as e:
            if must:
                raise RuntimeError(f"cannot leave the root of the sandbox's user namespace: {e}") from e

    def _build_root(self, fresh_proc: bool) -> None:
        """Make a read-only tmpfs holding only ``self.root`` (bound read-only at their own paths), a minimal
        ``/dev``, ``/proc``, tmpfs ``/tmp`` and ``/dev/shm`` and the run's dir, and ``pivot_root`` into it.

        The skeleton is built on a tmpfs mounted over the run's dir (reached before through an fd), so no
        other host path is touched; its dirs are 0711, so nothing but the bound paths can be listed. The
        binds and the skeleton are made read-only in one ``mount_setattr`` (Linux >= 5.12; else one
        remount each). Raises OSError/RuntimeError: the caller reports it, and the program never runs.
        """
        machine = os.uname().machine
        if machine not in _SYS_PIVOT_ROOT:
            raise RuntimeError(f"no pivot_root syscall number known for {machine}")
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
        real = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
        umask = os.umask(0o066)  # dirs 0711, files 0600 (only mount points)
        try:
            _mount("tmpfs", self.tmpdir, "tmpfs", _MS_NOSUID | _MS_NODEV, _ROOT_TMPFS)
            os.chdir(self.tmpdir)  # the new root; everything below is relative to it
            work = self.tmpdir.lstrip("/")
            for d in ("dev/shm", "tmp", "proc"):
                os.makedirs(d, exist_ok=True)
            for name in _DEVICES:
                os.close(os.open(f"dev/{name}", os.O_WRONLY | os.O_CREAT, 0o600))
            for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                                 ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
                os.symlink(target, f"dev/{name}")
            # /tmp first: an interpreter under /tmp is then bound inside it, not hidden by it
            _mount("tmpfs", "tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, _TMPFS_SIZE)
            for path in self.root:
                target = path.lstrip("/")
                if os.path.isdir(path):
                    os.makedirs(target, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
                    os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o600))
                _mount(path, target, None, _MS_BIND | _MS_REC)
            for path in self.hide:
                if os.path.isdir(path.lstrip("/")):
                    _mount("tmpfs", path.lstrip("/"), "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "size=4k")
            os.makedirs(work, exist_ok=True)  # for a run dir outside /tmp, while the skeleton is writable
            _make_read_only(".", [p.lstrip("/") for p in self.root], writable="tmp")
            for name in _DEVICES:
                _mount(f"/dev/{name}", f"dev/{name}", None, _MS_BIND)
            _mount("tmpfs", "dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, _TMPFS_SIZE)
            if fresh_proc:  # before the host's /proc goes: a user namespace may mount proc only while one is visible
                _mount("proc", "proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
            else:  # no PID namespace: the host's /proc, as without a root (a known gap), which the uid drop needs
                _mount("/proc", "proc", None, _MS_BIND | _MS_REC)
            os.makedirs(work, exist_ok=True)
            self._copy_work_dir(real, work)
            _check(_libc.syscall(_SYS_PIVOT_ROOT[machine], b".", b"."), "pivot_root")
            _check(_libc.umount2(b".", _MNT_DETACH), "umount2 of the old root")  # the host's root, stacked on "."
            os.chdir(self.tmpdir)
        finally:
            os.umask(umask)
            os.close(real)

    def _mount_private_dirs(self, fresh_proc: bool) -> None:
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
        if self.hidden:  # tmpfs over e.g. /root (hiding its contents), then bind the prefix back
            fd = os.open(self.prefix, os.O_PATH | os.O_DIRECTORY)
            try:
                _mount("tmpfs", self.hidden, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
                os.makedirs(self.prefix, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", self.prefix, None, _MS_BIND | _MS_REC)
            finally:
                os.close(fd)
        for d in _WORLD_WRITABLE:
            if os.path.isdir(d) and not os.path.islink(d):
                _mount("tmpfs", d, "tmpfs", _MS_NOSUID | _MS_NODEV, _TMPFS_SIZE)
        self._private_work_dir()
        if fresh_proc:
            _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)

    def _private_work_dir(self) -> None:
        """A size-capped tmpfs at the sandbox dir's path, holding copies of its files, as the cwd.

        RLIMIT_FSIZE caps each file, not their number: on the host disk a run could fill it in a second
        (``fallocate`` of many files). cwd still refers to the real dir, which the /tmp tmpfs may hide.
        """
        real = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.makedirs(self.tmpdir, exist_ok=True)
            self._copy_work_dir(real, self.tmpdir)
        finally:
            os.close(real)
        os.chdir(self.tmpdir)

    def _copy_work_dir(self, real: int, target: str) -> None:
        """Mount the size-capped tmpfs at ``target`` and copy the files of the dir ``real`` (an fd) into it."""
        files = [e for e in os.scandir(real) if e.is_file(follow_symlinks=False)]
        size = sum(e.stat(follow_symlinks=False).st_size for e in files)
        cap = size + max(_WORK_DIR_MIN_MB, _WORK_DIR_FILES * int(self.limits["file_size_mb"])) * 2**20
        _mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={cap},mode=1777")
        for entry in files:
            src = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=real)
            dst = os.open(os.path.join(target, entry.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                while chunk := os.read(src, 1 << 20):
                    os.write(dst, chunk)
                if self.is_root:
                    os.fchown(dst, NOBODY, NOBODY)
            finally:
                os.close(src)
                os.close(dst)

    def _set_rlimits(self) -> None:
        lim = self.limits
        cpu = max(1, int(lim["cpu_time_s"] + 0.999))
        mb = 1024 * 1024
        for res, value in (
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_AS, (int(lim["memory_mb"]) * mb,) * 2),
            (resource.RLIMIT_FSIZE, (int(lim["file_size_mb"]) * mb,) * 2),
            (resource.RLIMIT_NPROC, (int(lim["max_processes"]),) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
            (resource.RLIMIT_NOFILE, (256, 256)),
        ):
            resource.setrlimit(res, value)


def parse_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """``[KEY=VALUE..., "--", *program_argv]`` -> (settings, program argv)."""
    if "--" not in argv:
        raise ValueError(f"expected KEY=VALUE... -- PROGRAM..., got {argv!r}")
    split = argv.index("--")
    spec = dict(arg.partition("=")[::2] for arg in argv[:split])
    missing = {*_LIMITS, *_SETTINGS} - spec.keys()
    if missing or split == len(argv) - 1:
        raise ValueError(f"missing settings {sorted(missing)} or program in {argv!r}")
    return spec, argv[split + 1:]


def main(argv: list[str]) -> None:
    """Confine this process as ``argv`` says (see the module docstring) and exec the program. Never returns."""
    report_fd = next((int(a[10:]) for a in argv if a.startswith("report_fd=")), None)
    try:
        spec, program = parse_args(argv)
        got = Confinement(spec).enter()
        os.set_inheritable(report_fd, False)  # closed by a successful exec; kept to report a failed one
        os.write(report_fd, ("ok " + " ".join(sorted(got)) + "\n").encode())
        os.execv(program[0], program)
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then this process ends
        if report_fd is not None:
            try:
                os.write(report_fd, f"error {type(e).__name__}: {e}\n".encode())
            except OSError:
                pass
    os._exit(SETUP_FAILED)


if __name__ == "__main__":
    main(sys.argv[1:])
