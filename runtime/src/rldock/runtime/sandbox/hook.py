"""The sandbox's audit hook (sys.addaudithook), installed in the program's interpreter before its first
line. It turns what the kernel layers (kernel.py) would refuse anyway into a clear PermissionError, and
it is the only file guard where the kernel has no Landlock. It is a convenience, not a boundary: a
memory-unsafe API (numpy's as_strided reaches any address) or native code gets past any in-process hook.

It refuses: sockets and name lookups; starting processes (fork, exec, spawn, subprocess, os.system);
ctypes, cffi and the test modules that reach C (kernel.REFUSED_NATIVE), by any module name and by file,
and native modules from outside the installation (a .so the program wrote); subinterpreters; code
objects built by hand, marshal.loads of anything but an installed module's bytecode, and replacing
a function's code; tracing; changing
resource limits; walking the interpreter's objects (gc); signalling other processes; symbolic links;
writing outside the scratch directory; reading or listing outside it and the readable roots.

Nothing it relies on can be changed by the program. A refusal's traceback shows the hook's frames, whose
f_locals and f_globals a program can reach and mutate, so:
- the hook closes over immutable values only (str, int, tuples, frozensets, builtins), and its own
  function object, whose cells are writable, is referenced by the interpreter alone;
- its helpers are module functions with no closure and no global or builtin lookup (everything they
  call arrives as an argument; test_sandbox.py::test_nothing_the_hook_relies_on_is_reachable_and_mutable
  checks their bytecode), and replacing a function's __code__ is refused.

It fails closed. Raising is how an audit hook refuses, and CPython then refuses the event, except for a
few events whose failure it only reports (`Exception ignored in audit hook`) and goes on; and a hook
that raised for want of memory has judged nothing. So any exception of the hook's own but its refusals
(MemoryError when the program used up its address space, RecursionError, an error a path object's
`__fspath__` raised) ends the program at once with boot.EXIT_UNJUDGED, reported as the outcome
`hook_failed`: with nothing allocated on that path, and from any thread. A failure before the hook's
first line (CPython could not allocate the event's arguments or the hook's frame, as in a thread that has
just started) is CPython's to handle: it refuses the event (the call raises MemoryError, or that thread
ends) and nothing is let through.
"""

from __future__ import annotations

import os
import stat
import sys

_PROCESSES = "starting another process"
_OBJECT_WALK = "walking the interpreter's objects"
_CODE = "building or loading code objects"
# event -> what the program is told it may not do
REFUSED_EVENTS = (
    ("os.fork", _PROCESSES),
    ("os.forkpty", _PROCESSES),
    ("os.exec", _PROCESSES),
    ("os.posix_spawn", _PROCESSES),
    ("os.spawn", _PROCESSES),
    ("os.system", _PROCESSES),
    ("subprocess.Popen", _PROCESSES),
    ("pty.spawn", _PROCESSES),
    # A subinterpreter gets none of this interpreter's audit hooks.
    ("cpython.PyInterpreterState_New", "starting a subinterpreter"),
    # Hand-built or unmarshalled code objects can read and write memory the interpreter does not check.
    ("code.__new__", _CODE),
    ("marshal.load", _CODE),
    ("resource.setrlimit", "changing resource limits"),
    ("resource.prlimit", "changing resource limits"),
    ("gc.get_objects", _OBJECT_WALK),
    ("gc.get_referrers", _OBJECT_WALK),
    ("gc.get_referents", _OBJECT_WALK),
    # A link swapped between the hook's check and the open would redirect a write.
    ("os.symlink", "creating symbolic links"),
    # A trace function can write a frame's variables.
    ("sys.settrace", "tracing"),
    ("sys.setprofile", "tracing"),
)
# Modules that start processes (_posixsubprocess.fork_exec raises no audit event in 3.11), run
# subinterpreters, or call C and write memory without audit events; refused as any part of a dotted name.
REFUSED_IMPORTS = frozenset({"ctypes", "cffi", "_posixsubprocess"})
# A function's code: replacing it rewrites what a helper of this hook runs. (Its defaults may change, as
# namedtuple does: the helpers have none and are always called with every argument.)
_FUNCTION_INTERNALS = frozenset({"__code__"})
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
# Events whose first argument is a path the call reads (lists).
_READS_PATH = frozenset({"os.listdir", "os.scandir", "os.listxattr", "os.getxattr"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Written to stderr when the hook could not judge an event and ended the program.
_UNJUDGED_MESSAGE = b"\nsandbox: the audit hook could not check an operation (out of memory, or an error in it)\n"


# The helpers below take everything they call as the `tools` tuple (built in `audit_hook`): no global
# or builtin name is looked up when they run, so a program that rewrites this module's globals or the
# builtins changes nothing they do.


def _refuse(what, event, tools):
    raise tools[13](f"the sandbox refused {what} ({event})")


def _plain(value, tools):
    """`value` (str, bytes, a path object) as a plain str."""
    exact_type, str_type, bytes_type, fspath, is_instance = tools[10], tools[7], tools[8], tools[4], tools[11]
    if exact_type(value) is not str_type and exact_type(value) is not bytes_type:
        # A path object's __fspath__ is called here and again by the call itself; one that answers
        # differently the second time gets past this check, not past Landlock's.
        value = fspath(value)
    if is_instance(value, bytes_type):
        return bytes_type.decode(value, "utf-8", "surrogateescape")
    return str_type.join("", (value,))  # a copy of the characters: a plain str even from a subclass


def _resolve(path, event, tools):
    """The absolute path with every symbolic link followed, as the kernel would find it (what does not
    exist yet is kept as written)."""
    lstat, readlink, getcwd, is_link, os_error = tools[0], tools[2], tools[3], tools[5], tools[12]
    pending = (path if path.startswith("/") else getcwd() + "/" + path).split("/")
    pending.reverse()
    parts: list[str] = []
    links = 0
    while pending:
        part = pending.pop()
        if part == "" or part == ".":
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
            tools[15]("a path with too many symbolic links", event, tools)
        target = readlink(candidate)
        if target.startswith("/"):
            parts = []
        pending.extend(target.split("/")[::-1])
    return "/" + "/".join(parts)


def _under(path, roots):
    # Not any(): a builtin, which the program may replace.
    for root in roots:  # noqa: SIM110
        if path == root or path.startswith(root + "/"):
            return True
    return False


def _check_write(value, event, writable, tools):
    refuse, plain, resolve, under, int_type, exact_type = (
        tools[15],
        tools[16],
        tools[17],
        tools[18],
        tools[9],
        tools[10],
    )
    if exact_type(value) is int_type:
        # By descriptor (fchmod, fchown, ftruncate): chmod and chown need no write access to the file,
        # so a read-only descriptor of a file outside would do.
        if event != "os.truncate":
            refuse("changing a file by its descriptor", event, tools)
        return
    path = plain(value, tools)
    if ".." in path.split("/"):
        # The hook resolves a relative path from the working directory; from a directory descriptor
        # (dir_fd=, which not every event shows) `..` could climb out of it.
        refuse("'..' in a path written to", event, tools)
    if not under(resolve(path, event, tools), writable):
        refuse("writing outside the working directory", event, tools)


def _check_read(value, event, readable, scratch, strict, refused_native, tools):
    refuse, plain, resolve, under = tools[15], tools[16], tools[17], tools[18]
    stat_, is_dir, os_error = tools[1], tools[6], tools[12]
    path = plain(value, tools)
    if strict and ".." in path.split("/"):
        # Without Landlock: from a directory descriptor (dir_fd=, which the open event does not show)
        # `..` climbs from where the kernel starts, not from the working directory the hook resolves by.
        refuse("'..' in a path (this machine has no Landlock)", event, tools)
    resolved = resolve(path, event, tools)
    if resolved.startswith("/proc/") and resolved.endswith("/mem"):
        refuse("reading process memory", event, tools)
    if resolved.endswith(".so") and resolved.split("/")[-1].split(".")[0] in refused_native:
        # Its bytes, copied and loaded from elsewhere, are refused as native code from outside the
        # installation; reading them is refused here as Landlock refuses it.
        refuse(f"reading {resolved}, a refused native module", event, tools)
    if not under(resolved, readable):
        refuse(f"reading {resolved}: only the working directory and Python's installation are readable", event, tools)
    if not under(resolved, (scratch,)) and event == "open":
        try:
            directory = is_dir(stat_(resolved).st_mode)
        except os_error:
            directory = False
        if directory:
            # A directory descriptor would let later opens relative to it (dir_fd=, which the open
            # event does not show) reach anything below it.
            refuse("opening a directory outside the working directory", event, tools)


def _check_import(args, installation, refused_native, tools):
    """Refuses a refused module under any dotted name, a refused native module's file under any name,
    and a native module from outside the installation (a .so the program wrote)."""
    refuse, plain, resolve, under = tools[15], tools[16], tools[17], tools[18]
    name = plain(args[0], tools)
    for part in name.split("."):
        if part in tools[19] or part in refused_native:
            raise tools[14](f"the sandbox refused importing {name}", name=name)
    filename = args[1]
    if filename is None:
        return
    path = resolve(plain(filename, tools), "import", tools)
    if path.endswith(".so"):
        if path.split("/")[-1].split(".")[0] in refused_native:
            raise tools[14](f"the sandbox refused importing {name} from {path}", name=name)
        if not under(path, installation):
            refuse(f"loading native code from {path}", "import", tools)


def _check_unmarshal(data, installation, tools):
    """marshal.loads is allowed for one thing: importlib loading an installed module's cached bytecode.
    The bytes must be exactly a .pyc file's under the installation, less its 16-byte header; the caller's
    `bytecode_path` (importlib's _compile_bytecode names it) says which, and is checked, not trusted."""
    refuse, resolve, under, getframe, str_type, exact_type = (
        tools[15],
        tools[17],
        tools[18],
        tools[20],
        tools[7],
        tools[10],
    )
    read_file = tools[21]
    path = getframe(2).f_locals.get("bytecode_path")
    if exact_type(path) is str_type and path.endswith(".pyc"):
        resolved = resolve(path, "marshal.loads", tools)
        if under(resolved, installation) and read_file(resolved, tools)[16:] == data:
            return
    refuse("building or loading code objects", "marshal.loads", tools)


def _read_file(path, tools):
    open_, flags, fstat, read, close = tools[22], tools[23], tools[24], tools[26], tools[25]
    descriptor = open_(path, flags)
    try:
        return read(descriptor, fstat(descriptor).st_size)
    finally:
        close(descriptor)


def audit_hook(
    *,
    scratch: str,
    readable: tuple[str, ...],
    installation: tuple[str, ...],
    refused_native: frozenset[str],
    refused_error: type[Exception],
    refused_import: type[Exception],
    unjudged_exit_code: int,
    strict_paths: bool,
):
    """The hook. `readable`: roots the program may read (the scratch directory, Python's installation,
    system libraries and files); `installation`: where native modules may load from. Paths are resolved
    and absolute. `strict_paths` (where the kernel has no Landlock and the hook guards files alone): `..`
    is refused in any path, and the working directory may not leave the scratch directory, so that a path
    resolves within the scratch directory from wherever the kernel starts it. An event it cannot judge
    (any exception of its own but a refusal, MemoryError included) ends the process with
    `unjudged_exit_code`: fail closed."""
    pid = os.getpid()
    # /dev/null, and the program's own pipes (/dev/stdout is /proc/self/fd/1, a link to `pipe:[...]`,
    # which resolves to no file): a descriptor that is a file resolves to the file.
    writable = (scratch, "/dev/null", f"/proc/{pid}/fd")
    refused_events = REFUSED_EVENTS
    refused_event_names = frozenset(event for event, _ in REFUSED_EVENTS)
    changes_path, changes_both, changes_second, reads_path = _CHANGES_PATH, _CHANGES_BOTH, _CHANGES_SECOND, _READS_PATH
    write_flags, function_internals = _WRITE_FLAGS, _FUNCTION_INTERNALS
    tools = (
        os.lstat,  # 0
        os.stat,  # 1
        os.readlink,  # 2
        os.getcwd,  # 3
        os.fspath,  # 4
        stat.S_ISLNK,  # 5
        stat.S_ISDIR,  # 6
        str,  # 7
        bytes,  # 8
        int,  # 9
        type,  # 10
        isinstance,  # 11
        OSError,  # 12
        refused_error,  # 13
        refused_import,  # 14
        _refuse,  # 15
        _plain,  # 16
        _resolve,  # 17
        _under,  # 18
        REFUSED_IMPORTS,  # 19
        sys._getframe,  # 20
        _read_file,  # 21
        os.open,  # 22
        os.O_RDONLY | os.O_CLOEXEC,  # 23
        os.fstat,  # 24
        os.close,  # 25
        os.read,  # 26
    )
    refuse, plain, check_read, check_write, check_import = _refuse, _plain, _check_read, _check_write, _check_import
    resolve, under = _resolve, _under
    check_unmarshal = _check_unmarshal
    str_type, int_type, exact_type = str, int, type
    # What failing closed needs, made now: it runs when nothing can be allocated (even `except (A, B)`
    # builds a tuple), so the message is encoded, the classes matched by identity and the exit needs no
    # object. os._exit ends every thread of the process at once, without unwinding into the program.
    refusals, base_exception = (refused_error, refused_import), BaseException
    write, exit_process, unjudged_message = os.write, os._exit, _UNJUDGED_MESSAGE

    def hook(event, args):
        try:
            if event == "open":
                path, mode, flags = args
                if path is None or exact_type(path) is int_type:
                    return  # a descriptor the program holds (checked when it was opened)
                writes = (
                    exact_type(mode) is str_type and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)
                ) or (exact_type(flags) is int_type and flags & write_flags)
                if writes:
                    check_write(path, event, writable, tools)
                else:
                    check_read(path, event, readable, scratch, strict_paths, refused_native, tools)
            elif event == "import":
                check_import(args, installation, refused_native, tools)
            elif event == "marshal.loads":
                check_unmarshal(args[0], installation, tools)
            elif event.startswith("socket."):
                refuse("network access", event, tools)
            elif event.startswith("ctypes."):
                refuse("ctypes", event, tools)
            elif event in refused_event_names:
                for name, what in refused_events:
                    if name == event:
                        refuse(what, event, tools)
            elif event == "object.__setattr__":
                if exact_type(args[1]) is str_type and args[1] in function_internals:
                    refuse("replacing a function's code", event, tools)
            elif event == "os.kill" or event == "os.killpg":
                # The worker that started this program runs as the same user: one signal would end it.
                if args[0] != 0 and args[0] != pid and args[0] != -pid:
                    refuse("signalling another process", event, tools)
            elif event in changes_path:
                check_write(args[0], event, writable, tools)
            elif event in changes_both:
                check_write(args[0], event, writable, tools)
                check_write(args[1], event, writable, tools)
            elif event in changes_second:
                check_write(args[1], event, writable, tools)
            elif event in reads_path:
                target = args[0]
                if target is not None and exact_type(target) is not int_type:
                    check_read(plain(target, tools), event, readable, scratch, strict_paths, refused_native, tools)
            elif event == "os.chdir":
                target = args[0]
                if (
                    strict_paths
                    and exact_type(target) is not int_type  # a descriptor: a directory opened inside
                    and not under(resolve(plain(target, tools), event, tools), (scratch,))
                ):
                    refuse("leaving the working directory (this machine has no Landlock)", event, tools)
        except refusals:
            raise
        except base_exception:  # an event it could not judge: refused by ending the program
            try:
                write(2, unjudged_message)
            finally:
                exit_process(unjudged_exit_code)

    return hook
