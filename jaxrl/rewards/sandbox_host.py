"""The caller's side of the sandbox's confinement: what the minimal root holds, the seccomp filter, and
one check of what this host grants (see ``sandbox_child``'s docstring for the design).

Kept out of ``sandbox_child.py`` because that file is compiled from source on every run (a script has no
cached bytecode): these ~300 lines cost about 5 ms of compiling per run there (measured under load). Standard library only, since this file
also runs as ``<base python> -I -S sandbox_host.py --list-files`` under the interpreter it describes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

# Syscalls no test program needs, refused with EPERM in every run (names missing on an arch are skipped):
# keyrings (they outlive the run), other processes' memory and fds, mounts and namespaces (clone's
# namespace flags too), the kernel's own machinery, and io_uring (its operations bypass seccomp).
_DENIED_SYSCALLS = (
    "add_key", "request_key", "keyctl",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "acct", "swapon", "swapoff", "reboot", "sethostname", "setdomainname", "iopl", "ioperm",
    "quotactl", "quotactl_fd", "lookup_dcookie", "personality", "syslog", "vhangup", "uselib", "ustat",
    "sysfs", "_sysctl", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "open_by_handle_at", "name_to_handle_at", "fanotify_init", "move_pages", "migrate_pages",
)
_AF_INET, _AF_INET6 = 2, 10  # the only socket domains allowed (the network namespace leaves them no peer)
# NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (NEWTIME is unshare/clone3 only: its bit is
# part of clone's exit signal)
_CLONE_NAMESPACE_BITS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
# libseccomp's stable ABI (<seccomp.h>, 2.x)
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_FLTATR_ACT_BADARCH, _SCMP_FLTATR_CTL_OPTIMIZE = 2, 8
_SCMP_CMP_LT, _SCMP_CMP_EQ, _SCMP_CMP_GT, _SCMP_CMP_MASKED_EQ = 2, 4, 6, 7


def _load_libseccomp():
    """libseccomp via ctypes, or None where it is not installed."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        from ctypes.util import find_library

        name = find_library("seccomp")
        try:
            lib = ctypes.CDLL(name, use_errno=True) if name else None
        except OSError:
            lib = None
    if lib is None:
        return None
    ctx, u32, c_int = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int
    for fn, restype, argtypes in (
        ("seccomp_init", ctx, [u32]),
        ("seccomp_release", None, [ctx]),
        ("seccomp_arch_native", u32, []),
        ("seccomp_arch_add", c_int, [ctx, u32]),
        ("seccomp_arch_remove", c_int, [ctx, u32]),
        ("seccomp_attr_set", c_int, [ctx, c_int, u32]),
        ("seccomp_syscall_resolve_name_arch", c_int, [u32, ctypes.c_char_p]),
        ("seccomp_rule_add_array", c_int, [ctx, u32, c_int, ctypes.c_uint, ctypes.c_void_p]),
        ("seccomp_export_bpf", c_int, [ctx, c_int]),
    ):
        try:
            getattr(lib, fn).restype, getattr(lib, fn).argtypes = restype, argtypes
        except AttributeError:  # a libseccomp too old for this binding
            return None
    return lib


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def seccomp_filter(no_fork: bool, machine: str | None = None) -> bytes | None:
    """The sandbox's seccomp filter, compiled by libseccomp to BPF (``struct sock_filter`` array, this
    machine's byte order) for ``machine`` (``os.uname().machine``; default this one's). None without libseccomp.

    Default allow; EPERM for ``_DENIED_SYSCALLS``, ``socket`` of any domain but AF_INET/AF_INET6 (Unix,
    netlink, packet, vsock, ...; compared as 64-bit, so high bits cannot smuggle AF_UNIX through), ``clone``
    with a namespace flag; ENOSYS for ``clone3`` (its flags are in memory, which a filter cannot read; glibc
    then uses ``clone``). ``no_fork``: also EPERM for ``fork``, ``vfork`` and ``clone`` without
    ``CLONE_THREAD`` (threads still work). A syscall of another ABI (i386 ``int 0x80``, x32 on x86_64)
    gets EPERM: libseccomp checks the arch and the x32 bit.
    """
    from jaxrl.rewards.sandbox_child import _CLONE_THREAD, _SECCOMP_ARCHES

    lib = _load_libseccomp()
    if lib is None:
        return None
    eperm = 0x00050000 | errno.EPERM
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        arch = lib.seccomp_arch_native()
        if machine is not None and machine != os.uname().machine:
            if machine not in _SECCOMP_ARCHES:
                raise ValueError(f"no seccomp arch known for machine {machine!r}")
            other = _SECCOMP_ARCHES[machine][0]
            if lib.seccomp_arch_add(ctx, other) != 0 or lib.seccomp_arch_remove(ctx, arch) != 0:
                raise OSError(f"libseccomp cannot build a filter for {machine}")
            arch = other
        if lib.seccomp_attr_set(ctx, _SCMP_FLTATR_ACT_BADARCH, eperm) != 0:
            raise OSError("libseccomp: cannot set the action for foreign ABIs")
        lib.seccomp_attr_set(ctx, _SCMP_FLTATR_CTL_OPTIMIZE, 2)  # a binary tree of syscalls (libseccomp >= 2.5)

        def rule(name: str, action: int, *cmps: tuple[int, int, int, int]) -> None:
            nr = lib.seccomp_syscall_resolve_name_arch(arch, name.encode())
            if nr < 0:  # not a syscall on this arch
                return
            args = (_ArgCmp * len(cmps))(*(_ArgCmp(*c) for c in cmps)) if cmps else None
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), args)
            if rc != 0:
                raise OSError(-rc, f"libseccomp: rule for {name}: {os.strerror(-rc)}")

        for name in _DENIED_SYSCALLS:
            rule(name, eperm)
        rule("clone3", 0x00050000 | errno.ENOSYS)
        rule("socket", eperm, (0, _SCMP_CMP_LT, _AF_INET, 0))
        rule("socket", eperm, (0, _SCMP_CMP_GT, _AF_INET6, 0))
        for domain in range(_AF_INET + 1, _AF_INET6):
            rule("socket", eperm, (0, _SCMP_CMP_EQ, domain, 0))
        for bit in _CLONE_NAMESPACE_BITS:
            rule("clone", eperm, (0, _SCMP_CMP_MASKED_EQ, bit, bit))
        if no_fork:
            rule("fork", eperm)
            rule("vfork", eperm)
            rule("clone", eperm, (0, _SCMP_CMP_MASKED_EQ, _CLONE_THREAD, 0))
        read_fd, write_fd = os.pipe()
        try:
            rc = lib.seccomp_export_bpf(ctx, write_fd)
            os.close(write_fd)
            write_fd = None
            if rc != 0:
                raise OSError(-rc, f"seccomp_export_bpf: {os.strerror(-rc)}")
            chunks = []
            while chunk := os.read(read_fd, 65536):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(read_fd)
            if write_fd is not None:
                os.close(write_fd)
    finally:
        lib.seccomp_release(ctx)


# Extension modules that cannot work in the sandbox (no display, terminal, sound device, NIS or /etc/shadow):
# the libraries only they load stay out of the root (tkinter alone brings X11, Tcl/Tk and fonts).
_USELESS_MODULES = {"_tkinter", "readline", "_curses", "_curses_panel", "ossaudiodev", "nis", "spwd"}


def _list_interpreter_files() -> None:
    """``--list-files``: print what this interpreter needs, one ``bind\tPATH`` or ``hide\tPATH`` a line.

    Binds: its stdlib dirs (``sys.path`` under ``-I -S``), its executable, ``/etc/ld.so.cache`` and every
    shared object it maps after importing each extension module of the stdlib (but ``_USELESS_MODULES``)
    and loading ``libgcc_s``
    (glibc loads it on ``pthread_exit``): each by the name the dynamic loader opened it under
    (``dl_iterate_phdr``, so ``/lib64/ld-linux-x86-64.so.2`` and ``/lib/...`` work in the root) and by its
    real path (``/proc/self/maps``). Hides: ``site-packages`` / ``dist-packages`` in the stdlib dirs.
    """
    import threading

    stdlib = [os.path.normpath(p) for p in sys.path if os.path.isdir(p)]  # as the program's interpreter names them
    for d in stdlib:
        for name in sorted(os.listdir(d)):
            if name.endswith(".so") and name.split(".")[0] not in _USELESS_MODULES:
                try:
                    __import__(name.split(".")[0])
                except BaseException:  # noqa: BLE001 - a module whose library is missing is not needed
                    pass
    try:
        ctypes.CDLL("libgcc_s.so.1")
    except OSError:
        pass
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    names = {sys.executable, "/etc/ld.so.cache"}

    class Info(ctypes.Structure):  # the head of struct dl_phdr_info
        _fields_ = [("addr", ctypes.c_void_p), ("name", ctypes.c_char_p)]

    def seen(info, size, data):
        if info.contents.name:
            names.add(os.fsdecode(info.contents.name))
        return 0

    callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Info), ctypes.c_size_t, ctypes.c_void_p)(seen)
    ctypes.CDLL(None).dl_iterate_phdr(callback, None)
    names = {os.path.normpath(p) for p in names if os.path.isabs(p) and os.path.isfile(p)}  # no "..": stays in the root
    inodes = {(st.st_dev, st.st_ino) for st in map(os.stat, names)}
    with open("/proc/self/maps") as f:  # files mapped under no name the loader knows (locale data, ...)
        for line in f:
            fields = line.rstrip("\n").split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/") and os.path.isfile(fields[5]):
                st = os.stat(fields[5])
                if (st.st_dev, st.st_ino) not in inodes:
                    inodes.add((st.st_dev, st.st_ino))
                    names.add(os.path.normpath(fields[5]))
    dirs = [d for d in stdlib if not any(d.startswith(o + os.sep) for o in stdlib)]
    files = sorted(
        p for p in names if not any(p.startswith(d + os.sep) for d in dirs)
    )
    lines = [f"bind\t{p}" for p in dirs + files]
    lines += [f"hide\t{d}/{sub}" for d in dirs for sub in ("site-packages", "dist-packages")
              if os.path.isdir(os.path.join(d, sub))]
    sys.stdout.write("\n" + "\n".join(lines) + "\n")  # a newline first: an imported module may write junk


class HostSetup:
    """What every run of one interpreter on this host gets: ``root`` and ``hide`` (paths, empty where no
    minimal root can be built) and ``filters`` (``no_fork`` -> BPF bytes, empty without libseccomp)."""

    def __init__(self, root: tuple[str, ...], hide: tuple[str, ...], filters: dict[bool, bytes]):
        self.root, self.hide, self.filters = root, hide, filters


_host_setups: dict[str, HostSetup] = {}


def host_setup(interpreter: str, tmp_prefix: str = "jaxrl_sandbox_") -> HostSetup:
    """The ``HostSetup`` for ``interpreter``, found once per process (about 0.2 s): list its files, compile
    the filters, run the launcher once on an empty program with everything asked for, and log one warning
    per thing this host cannot do, naming what the sandbox falls back to. Runs as the caller (parent)."""
    if interpreter in _host_setups:
        return _host_setups[interpreter]
    import logging
    import subprocess
    import tempfile

    from jaxrl.rewards import sandbox_child
    from jaxrl.rewards.sandbox_child import _LIMITS, _NAMESPACE_FLAGS

    log = logging.getLogger("jaxrl.rewards.sandbox")
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    root: list[str] = []
    hide: list[str] = []
    problems = []
    list_error = f"{interpreter} listed no files"
    try:
        out = subprocess.run([interpreter, "-I", "-S", "-B", os.path.abspath(__file__), "--list-files"],
                             capture_output=True, text=True, env=env, timeout=60, check=True).stdout
        for line in out.splitlines():
            kind, _, path = line.partition("\t")
            if kind in ("bind", "hide") and os.pathsep not in path:
                (root if kind == "bind" else hide).append(path)
    except (OSError, subprocess.SubprocessError) as e:
        list_error = f"cannot list the files of {interpreter} ({e})"
    filters: dict[bool, bytes] = {}
    filter_error = "libseccomp is not installed"
    try:
        for no_fork in (False, True):
            prog = seccomp_filter(no_fork)
            if prog is not None:
                filters[no_fork] = prog
    except (OSError, ValueError) as e:
        filters, filter_error = {}, f"libseccomp failed: {e}"
    # One real run: what does this host grant?
    got, error = set(), None
    tmpdir = tempfile.mkdtemp(prefix=f"{tmp_prefix}{os.getpid()}_")
    read_fd, write_fd = os.pipe()
    try:
        spec = {name: 1 for name in _LIMITS} | {
            "wall_time_s": 10, "cpu_time_s": 5, "memory_mb": 512, "max_processes": 32,
            "namespaces": ",".join(_NAMESPACE_FLAGS), "no_fork": 1, "root": os.pathsep.join(root),
            "hide": os.pathsep.join(hide), "seccomp": filters.get(True, b"").hex(), "tmpdir": tmpdir,
            "report_fd": write_fd, "parent_pid": os.getpid(),
        }
        argv = [interpreter, "-I", "-S", "-B", os.path.abspath(sandbox_child.__file__),
                *(f"{k}={v}" for k, v in spec.items()), "--", interpreter, "-S", "-c", "pass"]
        subprocess.run(argv, cwd=tmpdir, env=env, pass_fds=[write_fd], capture_output=True, timeout=60,
                       start_new_session=True, check=False)
        os.close(write_fd)
        write_fd = None
        report = os.read(read_fd, 4096).decode("utf-8", "replace").splitlines() or ["error (no report)"]
        if report[0].startswith("ok"):
            got = set(report[0].split()[1:])
        error = next((line[6:] for line in report if line.startswith("error ")), None)
    except (OSError, subprocess.SubprocessError) as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        for fd in (read_fd, write_fd):
            if fd is not None:
                os.close(fd)
        subprocess.run(["rm", "-rf", "--", tmpdir], check=False, capture_output=True)
    host_files = ("programs see the host's files (whatever uid 65534 may read), with private tmpfs over /tmp,"
                  " /var/tmp, /dev/shm and /run/lock where a mount namespace exists")
    if not root:
        problems.append(f"no minimal root, as {list_error}: {host_files}")
    elif error is not None:  # runs go on without the root (a run that asks for one and fails is an error)
        why = "no mount namespace (no user namespaces here?)" if "no mount namespace" in error else error
        problems.append(f"the minimal root cannot be built ({why}): {host_files}")
        root, hide = [], []
    missing = {"pid", "ipc", "net"} - got
    if missing and error is None:
        problems.append(f"no {', '.join(sorted(missing))} namespace(s): see the known gaps in jaxrl.rewards.sandbox")
    if not filters:
        problems.append(f"{filter_error}: no syscall filter (Unix sockets, keyrings, ptrace, mount stay open);"
                        " assert tests keep the hand-built no-fork filter")
    elif "seccomp" not in got and error is None:
        problems.append("the kernel refused the seccomp filter: no syscall filter, and assert tests rely on"
                        " the harness's pid check alone")
    for problem in problems:
        log.warning("sandbox: %s. (Logged once per process.)", problem)
    setup = HostSetup(tuple(root), tuple(hide), filters)
    _host_setups[interpreter] = setup
    return setup


if __name__ == "__main__":
    if sys.argv[1:] == ["--list-files"]:
        _list_interpreter_files()
