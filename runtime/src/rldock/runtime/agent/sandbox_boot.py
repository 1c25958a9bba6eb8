"""The first code a sandboxed program's interpreter runs (agent/sandbox.py starts it by path): it limits
itself, then runs the program. Standard library only, and nothing runs on import: the interpreter that
runs it has no site-packages of its own and cannot import rldock.

Two stages in one process:
  `start`  sets the resource limits, tries to leave the network (a new network namespace) and to
           install the seccomp filter, then re-executes a fresh interpreter as `run`. The re-exec
           keeps the pid, the process group, the limits, the namespace and the filter, and drops
           ctypes (which `start` needs for unshare(2) and prctl(2)): a program that found a loaded
           ctypes could write memory with no audit event.
  `run`    installs the audit hook, then runs program.py from the scratch directory as `__main__`.

Usage: sandbox_boot.py start|run <scratch dir> <cpu seconds> <memory MiB> <site-packages dir>...
"""

from __future__ import annotations

import os
import sys

# Exit codes that tell the parent why the program stopped (a program that exits with one of them on
# purpose is reported as that outcome; nothing else follows from it).
EXIT_MEMORY = 90  # the program ran out of its address space (RLIMIT_AS turns that into MemoryError)
EXIT_REFUSED = 91  # the audit hook refused something the program asked for and the program did not catch it
EXIT_BOOT_FAILED = 92  # this script could not set the sandbox up (a bug, a broken installation): the parent logs it

BOOT_FAILED_MESSAGE = "sandbox: could not start: "  # how stderr starts with EXIT_BOOT_FAILED
PROGRAM = "program.py"  # in the scratch directory; the name the program's tracebacks show
MAX_FILE_BYTES = 16 * 2**20  # RLIMIT_FSIZE: one file the program writes
MAX_OPEN_FILES = 64  # RLIMIT_NOFILE

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000


def _set_limits(*, cpu_seconds: float, memory_mib: int) -> None:
    import math
    import resource

    def lower(limit: int, soft: int, hard: int) -> None:
        # Never above a hard limit the worker already has: only root may raise one.
        _, current = resource.getrlimit(limit)
        if current != resource.RLIM_INFINITY:
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(limit, (soft, hard))

    # RLIMIT_CPU counts whole seconds. At the soft limit the kernel sends SIGXCPU (which ends a Python
    # process); the hard limit a second later is SIGKILL, for a program that handles SIGXCPU.
    cpu = max(1, math.ceil(cpu_seconds))
    lower(resource.RLIMIT_CPU, cpu, cpu + 1)
    memory = memory_mib * 2**20
    lower(resource.RLIMIT_AS, memory, memory)
    lower(resource.RLIMIT_FSIZE, MAX_FILE_BYTES, MAX_FILE_BYTES)
    lower(resource.RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES)
    lower(resource.RLIMIT_CORE, 0, 0)


def _leave_network() -> bool:
    """A network namespace of our own has only a loopback device, and it is down: no address is
    reachable, the host's loopback included. Unprivileged this needs a user namespace too; a seccomp
    profile (the RuntimeDefault one of a restricted pod refuses unshare(2)) or a kernel setting may
    refuse both, and then the audit hook is the only network guard. Returns whether it was entered."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError):
        return False
    return any(libc.unshare(flags) == 0 for flags in (_CLONE_NEWUSER | _CLONE_NEWNET, _CLONE_NEWNET))


# Syscall numbers of the filter below, per machine (os.uname().machine), with its AUDIT_ARCH_*; the
# numbers from 424 on are the same on every machine.
_UNIFIED_SYSCALLS = {
    "pidfd_send_signal": 424,
    "io_uring_setup": 425,  # its operations include socket and connect, which the filter would not see
    "pidfd_open": 434,
    "clone3": 435,
    "pidfd_getfd": 438,
    "process_madvise": 440,
}
_SYSCALLS = {
    "x86_64": (
        0xC000003E,
        {
            "socket": 41,
            "clone": 56,
            "fork": 57,
            "vfork": 58,
            "kill": 62,
            "ptrace": 101,
            "rt_sigqueueinfo": 129,
            "tkill": 200,
            "tgkill": 234,
            "rt_tgsigqueueinfo": 297,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            **_UNIFIED_SYSCALLS,
        },
    ),
    # The generic table (asm-generic/unistd.h): no fork or vfork, processes come from clone.
    "aarch64": (
        0xC00000B7,
        {
            "ptrace": 117,
            "kill": 129,
            "tkill": 130,
            "tgkill": 131,
            "rt_sigqueueinfo": 138,
            "socket": 198,
            "clone": 220,
            "rt_tgsigqueueinfo": 240,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            **_UNIFIED_SYSCALLS,
        },
    ),
}
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x00010000
# Fail with EPERM whatever their arguments: sockets, new processes, other processes' memory, signals
# by thread id alone or through a pidfd.
_DENIED = (
    "socket",
    "fork",
    "vfork",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "process_madvise",
    "tkill",
    "pidfd_open",
    "pidfd_getfd",
    "pidfd_send_signal",
    "io_uring_setup",
)
# Signals whose first argument is the target's process (thread group) id: allowed to this process only.
_SIGNAL_OWN_PROCESS = ("tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")


def _syscall_filter(machine: str, pid: int) -> list[tuple[int, int, int, int]] | None:
    """A seccomp BPF program (code, jump if true, jump if false, k): `_DENIED` fail with EPERM, and so
    do clone without CLONE_THREAD (a process; threads stay allowed) and signals to any process but this
    one. clone3 fails with ENOSYS, which makes the C library fall back on clone, whose flags the filter
    can read. Syscalls of another ABI (i386, x32 on x86_64) fail with ENOSYS. None for a machine not
    listed in _SYSCALLS."""
    if machine not in _SYSCALLS:
        return None
    arch, numbers = _SYSCALLS[machine]
    load, jump_equal, jump_above_or_equal, jump_set, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    nr, arch_offset, first_argument = 0, 4, 16  # offsets in struct seccomp_data (the low half of args[0])
    # Jumps name their targets; they are resolved into offsets once the program is laid out.
    program: list[tuple[int, int | str, int | str, int]] = [
        (load, 0, 0, arch_offset),
        (jump_equal, 0, "nosys", arch),
        (load, 0, 0, nr),
        (jump_above_or_equal, "nosys", 0, 0x40000000),  # x32 numbers on x86_64; none exist elsewhere
        *((jump_equal, "deny", 0, numbers[name]) for name in _DENIED if name in numbers),
        (jump_equal, "nosys", 0, numbers["clone3"]),
        (jump_equal, "clone", 0, numbers["clone"]),
        (jump_equal, "kill", 0, numbers["kill"]),
        *((jump_equal, "own", 0, numbers[name]) for name in _SIGNAL_OWN_PROCESS),
        (ret, 0, 0, 0x7FFF0000),
    ]
    labels = {"clone": len(program)}
    program += [(load, 0, 0, first_argument), (jump_set, "allow", "deny", _CLONE_THREAD)]
    labels["kill"] = len(program)
    program += [
        (load, 0, 0, first_argument),
        (jump_equal, "allow", 0, pid),
        (jump_equal, "allow", 0, 0),  # this process's group, which is only this process
        (jump_equal, "allow", "deny", -pid & 0xFFFFFFFF),
    ]
    labels["own"] = len(program)
    program += [(load, 0, 0, first_argument), (jump_equal, "allow", "deny", pid)]
    labels.update(allow=len(program), deny=len(program) + 1, nosys=len(program) + 2)
    program += [(ret, 0, 0, 0x7FFF0000), (ret, 0, 0, 0x00050000 | _EPERM), (ret, 0, 0, 0x00050000 | _ENOSYS)]

    def offset(target: int | str, at: int) -> int:
        return target if isinstance(target, int) else labels[target] - at - 1

    return [(code, offset(true, at), offset(false, at), k) for at, (code, true, false, k) in enumerate(program)]


def _restrict_syscalls() -> bool:
    """Installs `_syscall_filter` (seccomp, which needs no privilege once no_new_privs is set; the
    restricted Pod Security Standard sets it anyway). It holds for this process and what it executes,
    whatever the program does to the audit hook. Returns whether it was installed: not on a machine
    the filter does not know, nor where prctl is refused; the audit hook then stands alone."""
    program = _syscall_filter(os.uname().machine, os.getpid())
    if program is None:
        return False
    try:
        import ctypes
    except ImportError:
        return False

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    instructions = (SockFilter * len(program))(*(SockFilter(*instruction) for instruction in program))
    fprog = SockFprog(len(program), instructions)
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        return False
    return libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(fprog), 0, 0) == 0


# Isolated (no PYTHON* variables, no user site, no script directory on sys.path), no site (no .pth file
# runs), no .pyc written, unbuffered (what a killed program printed is not lost), UTF-8 streams.
INTERPRETER_FLAGS = ("-I", "-S", "-B", "-u", "-X", "utf8")


def _start(argv: list[str]) -> None:
    """Limits this process, then becomes the `run` stage (os.execv does not return)."""
    _set_limits(cpu_seconds=float(argv[1]), memory_mib=int(argv[2]))
    _leave_network()
    _restrict_syscalls()
    os.execv(sys.executable, [sys.executable, *INTERPRETER_FLAGS, __file__, "run", *argv])


class SandboxRefused(PermissionError):
    """What the audit hook raises. A PermissionError, so library code that falls back on OSError
    (platform, uuid, ...) keeps working; uncaught, the program exits with EXIT_REFUSED."""


class SandboxRefusedImport(ImportError):
    """A refused import: an ImportError, so a library with an optional dependency (numpy imports
    ctypes if it can) imports without it; uncaught, the program exits with EXIT_REFUSED."""


_PROCESSES = "starting another process"
_OBJECT_WALK = "walking the interpreter's objects"
# event -> what the program is told it may not do
_REFUSED_EVENTS = {
    "os.fork": _PROCESSES,
    "os.forkpty": _PROCESSES,
    "os.exec": _PROCESSES,
    "os.posix_spawn": _PROCESSES,
    "os.spawn": _PROCESSES,
    "os.system": _PROCESSES,
    "subprocess.Popen": _PROCESSES,
    "pty.spawn": _PROCESSES,
    # A subinterpreter gets none of this interpreter's audit hooks.
    "cpython.PyInterpreterState_New": "starting a subinterpreter",
    # Hand-built code objects can read and write memory the interpreter does not check.
    "code.__new__": "building code objects",
    "resource.setrlimit": "changing resource limits",
    "resource.prlimit": "changing resource limits",
    "gc.get_objects": _OBJECT_WALK,
    "gc.get_referrers": _OBJECT_WALK,
    "gc.get_referents": _OBJECT_WALK,
    # A link swapped between the hook's check and the open would redirect a write.
    "os.symlink": "creating symbolic links",
    # A trace function can write a frame's variables, the hook's own among them.
    "sys.settrace": "tracing",
    "sys.setprofile": "tracing",
}
# Modules that start processes (_posixsubprocess.fork_exec raises no audit event in 3.11), run
# subinterpreters, or call C and write memory without audit events.
_REFUSED_IMPORTS = frozenset(
    {"ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "_testcapi", "_testinternalcapi"}
)
# Events whose first argument is a path the call changes.
_CHANGES_PATH = frozenset(
    {
        "os.remove",
        "os.rmdir",
        "os.mkdir",
        "os.chmod",
        "os.chown",
        "os.truncate",
        "os.utime",
        "os.setxattr",
        "os.removexattr",
        "shutil.rmtree",
    }
)
# Events whose first two arguments are paths: both change (rename, link, move) or the second does (copy).
_CHANGES_BOTH = frozenset({"os.rename", "os.link", "shutil.move"})
_CHANGES_SECOND = frozenset({"shutil.copyfile", "shutil.copytree"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Readable besides the working directory and Python's installation: what the standard library and
# common packages read at run time.
_SYSTEM_READABLE = (
    "/usr",
    "/lib",
    "/lib64",
    "/etc/localtime",
    "/etc/os-release",
    "/etc/mime.types",
    "/dev/null",
    "/dev/zero",
    "/dev/urandom",
    "/dev/random",
    "/proc/cpuinfo",
    "/proc/meminfo",
    "/proc/stat",
    "/sys/devices/system/cpu",
)


def _audit_hook(*, scratch: str, readable: tuple[str, ...]):
    """The hook. Everything it calls or reads is bound here, in its closure, which no name the
    program can reach leads to: a program that replaces os.path.realpath, a builtin, or one of this
    module's tables (its globals are reachable from a traceback's frames) changes nothing the hook
    sees. Paths are turned into plain str first: a str subclass could answer the hook's comparisons
    otherwise than the kernel reads its characters."""
    import stat

    pid = os.getpid()
    # /dev/null, and the program's own pipes (/dev/stdout is /proc/self/fd/1, a link to `pipe:[...]`,
    # which resolves to no file): a descriptor that is a file resolves to the file.
    writable = (scratch, "/dev/null", f"/proc/{pid}/fd")
    refused_events = dict(_REFUSED_EVENTS)
    refused_imports, changes_path = _REFUSED_IMPORTS, _CHANGES_PATH
    changes_both, changes_second, write_flags = _CHANGES_BOTH, _CHANGES_SECOND, _WRITE_FLAGS
    lstat, stat_, readlink, getcwd, fspath = os.lstat, os.stat, os.readlink, os.getcwd, os.fspath
    is_link, is_dir = stat.S_ISLNK, stat.S_ISDIR
    exact_type, is_instance, any_of = type, isinstance, any
    str_type, bytes_type, int_type, os_error = str, bytes, int, OSError
    join, decode, refused_error, refused_import = str.join, bytes.decode, SandboxRefused, SandboxRefusedImport

    def refuse(what: str, event: str):
        raise refused_error(f"the sandbox refused {what} ({event})")

    def plain(value) -> str:
        """`value` (str, bytes, a path object) as a plain str."""
        if exact_type(value) is not str_type and exact_type(value) is not bytes_type:
            # A path object's __fspath__ is called here and again by the call itself; one that answers
            # differently the second time is a way past the hook (the module docstring of sandbox.py).
            value = fspath(value)
        if is_instance(value, bytes_type):
            return decode(value, "utf-8", "surrogateescape")
        return join("", (value,))  # a copy of the characters: a plain str even from a subclass

    def resolve(path: str, event: str) -> str:
        """The absolute path with every symbolic link followed, as the kernel would find it (what does
        not exist yet is kept as written)."""
        pending = (path if path.startswith("/") else getcwd() + "/" + path).split("/")
        pending.reverse()
        parts: list[str] = []
        links = 0
        while pending:
            part = pending.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if parts:
                    parts.pop()
                continue
            candidate = "/" + "/".join([*parts, part])
            try:
                mode = lstat(candidate).st_mode
            except os_error:
                parts.append(part)
                continue
            if not is_link(mode):
                parts.append(part)
                continue
            links += 1
            if links > 40:
                refuse("a path with too many symbolic links", event)
            target = readlink(candidate)
            if target.startswith("/"):
                parts = []
            pending.extend(reversed(target.split("/")))
        return "/" + "/".join(parts)

    def under(path: str, roots: tuple[str, ...]) -> bool:
        return any_of(path == root or path.startswith(root + "/") for root in roots)

    def check_write(value, event: str) -> None:
        if exact_type(value) is int_type:
            # By descriptor (fchmod, fchown, ftruncate): chmod and chown need no write access to the
            # file, so a read-only descriptor of a file outside would do.
            if event != "os.truncate":
                refuse("changing a file by its descriptor", event)
            return
        path = plain(value)
        if ".." in path.split("/"):
            # The hook resolves a relative path from the working directory; from a directory
            # descriptor (dir_fd=, which not every event shows) `..` could climb out of it.
            refuse("'..' in a path written to", event)
        if not under(resolve(path, event), writable):
            refuse("writing outside the working directory", event)

    def check_read(value, event: str) -> None:
        resolved = resolve(plain(value), event)
        if resolved.startswith("/proc/") and resolved.endswith("/mem"):
            refuse("reading process memory", event)
        if not under(resolved, readable):
            refuse(f"reading {resolved}: only the working directory and Python's installation are readable", event)
        if not under(resolved, (scratch,)):
            try:
                directory = is_dir(stat_(resolved).st_mode)
            except os_error:
                directory = False
            if directory:
                # A directory descriptor would let later opens relative to it (dir_fd=, which the
                # open event does not show) reach anything below it.
                refuse("opening a directory outside the working directory", event)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if path is None or exact_type(path) is int_type:
                return  # a descriptor the program holds (checked when it was opened)
            writes = (exact_type(mode) is str_type and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)) or (
                exact_type(flags) is int_type and flags & write_flags
            )
            if writes:
                check_write(path, event)
            else:
                check_read(path, event)
        elif event == "import":
            name = plain(args[0])
            if name in refused_imports:
                raise refused_import(f"the sandbox refused importing {name}", name=name)
        elif event.startswith("socket."):
            refuse("network access", event)
        elif event.startswith("ctypes."):
            refuse("ctypes", event)
        elif event in refused_events:
            refuse(refused_events[event], event)
        elif event in ("os.kill", "os.killpg"):
            # The worker that started this program runs as the same user: one signal would end it.
            if args[0] not in (0, pid, -pid):
                refuse("signalling another process", event)
        elif event in changes_path:
            check_write(args[0], event)
        elif event in changes_both:
            check_write(args[0], event)
            check_write(args[1], event)
        elif event in changes_second:
            check_write(args[1], event)

    return hook


def _run(argv: list[str]) -> int:
    """Runs program.py as `__main__` under the audit hook; returns the exit code."""
    # Before the hook, which then refuses importing it again: subprocess needs the module to import,
    # and its fork_exec, which raises no audit event in 3.11, is replaced below by a refusal.
    import _posixsubprocess
    import builtins

    # Loaded now, so that reporting a MemoryError needs no memory for an import.
    import traceback  # noqa: F401
    import types

    scratch, site_dirs = os.path.realpath(argv[0]), argv[3:]
    sys.path.extend(site_dirs)
    python = (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path)
    pid = os.getpid()
    readable = (scratch, f"/proc/{pid}", *(os.path.realpath(p) for p in python if p), *_SYSTEM_READABLE)
    readable = tuple(root.rstrip("/") or "/" for root in readable)

    def no_fork_exec(*args, **kwargs):
        raise SandboxRefused("the sandbox refused starting another process (_posixsubprocess.fork_exec)")

    _posixsubprocess.fork_exec = no_fork_exec
    with open(os.path.join(scratch, PROGRAM), encoding="utf-8") as file:
        source = file.read()
    main = types.ModuleType("__main__")
    main.__dict__.update({"__file__": PROGRAM, "__builtins__": builtins})
    sys.modules["__main__"] = main
    sys.argv = [PROGRAM]
    # The program may replace builtins (isinstance, BaseException, ...) that the report below uses.
    saved_builtins, restore_builtins = dict(vars(builtins)), vars(builtins).update
    system_exit, base_exception = SystemExit, BaseException
    sys.addaudithook(_audit_hook(scratch=scratch, readable=readable))
    try:
        exec(compile(source, PROGRAM, "exec"), main.__dict__)
    except system_exit:
        raise
    except base_exception as error:  # what the interpreter would report for any exception, with our exit code
        restore_builtins(saved_builtins)
        if isinstance(error, MemoryError):
            # Free what the program holds (its globals are this namespace), so that the report fits.
            main.__dict__.clear()
        _print_program_traceback(error)
        return _exit_code(error)
    return 0


def _print_program_traceback(error: BaseException) -> None:
    """The traceback the interpreter would print, less this script's frames (the exec in `_run`, the
    audit hook): the program's author cannot act on them."""
    import traceback

    report = traceback.TracebackException(type(error), error, error.__traceback__)
    pending, seen = [report], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        current.stack[:] = [frame for frame in current.stack if frame.filename != __file__]
        pending.extend(chained for chained in (current.__cause__, current.__context__) if chained is not None)
    print("".join(report.format()), end="", file=sys.stderr)


def _exit_code(error: BaseException) -> int:
    """EXIT_MEMORY or EXIT_REFUSED when the exception, or one it was raised from or during, says so."""
    seen: set[int] = set()
    chain: BaseException | None = error
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if isinstance(chain, MemoryError):
            return EXIT_MEMORY
        if isinstance(chain, (SandboxRefused, SandboxRefusedImport)):
            return EXIT_REFUSED
        chain = chain.__cause__ or chain.__context__
    return 1


if __name__ == "__main__":
    stage, arguments = sys.argv[1], sys.argv[2:]
    if stage == "start":
        try:
            _start(arguments)
        except (OSError, ValueError) as error:
            # No limit could be set or no interpreter started: the program has not run.
            print(f"{BOOT_FAILED_MESSAGE}{error!r}", file=sys.stderr)
            sys.exit(EXIT_BOOT_FAILED)
    else:
        sys.exit(_run(arguments))
