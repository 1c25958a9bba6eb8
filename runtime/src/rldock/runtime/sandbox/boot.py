"""The first code a sandboxed program's interpreter runs (sandbox/runner.py starts it by path). Standard
library only, and nothing runs on import: the interpreter runs with -I -S, has no site-packages of its own
and cannot import rldock; it loads kernel.py and hook.py beside this file by their paths.

Two stages in one process:
  `start`  applies the kernel layers (kernel.py) to itself, writes which of them held to the report
           descriptor, then re-executes a fresh interpreter as `run` through the descriptor that
           kernel.hold_interpreter opened, with the path at the address kernel.exec_path_page chose:
           the only exec the seccomp filter lets through (kernel.exec_held). The re-exec
           keeps the pid, the process group, the limits, the namespaces, Landlock and the filter, and
           drops ctypes (which `start` needs for the syscalls): a program that found a loaded ctypes
           could write memory with no audit event.
  `run`    installs the audit hook (hook.py), then runs program.py from the scratch directory as
           `__main__`.

Usage: boot.py start|run <configuration as JSON>. `start` reads scratch, cpu_seconds, memory_mib,
disk_bytes, max_files, parent (the caller's pid), report_fd, site (site-packages directories), required
(the layers without which the program must not run: `start` fails instead), audit_hook (false only in
tests of the kernel layers alone) and skip (layers not applied, as on a machine without them: tests
only); it adds what `run` needs.
"""

from __future__ import annotations

import os
import sys

# Exit codes that tell the parent why the program stopped (a program that exits with one of them on
# purpose is reported as that outcome; nothing else follows from it).
EXIT_MEMORY = 90  # the program ran out of its address space (RLIMIT_AS turns that into MemoryError)
EXIT_REFUSED = 91  # the audit hook refused something the program asked for and the program did not catch it
EXIT_BOOT_FAILED = 92  # this script could not set the sandbox up (a bug, a broken installation): the parent logs it
EXIT_UNJUDGED = 93  # the audit hook could not judge an event (out of memory, an error in it) and ended the program

BOOT_FAILED_MESSAGE = "sandbox: could not start: "  # how stderr starts with EXIT_BOOT_FAILED
# After BOOT_FAILED_MESSAGE when a required layer did not hold: the layers, comma-separated, follow.
LAYERS_MISSING_MESSAGE = "this machine lacks layers the sandbox requires (agent.sandbox.allow_missing_layers): "
PROGRAM = "program.py"  # in the scratch directory; the name the program's tracebacks show
HERE = os.path.dirname(os.path.abspath(__file__))

# Isolated (no PYTHON* variables, no user site, no script directory on sys.path), no site (no .pth file
# runs), no .pyc written, unbuffered (what a killed program printed is not lost), UTF-8 streams.
INTERPRETER_FLAGS = ("-I", "-S", "-B", "-u", "-X", "utf8")

# Readable besides the scratch directory and Python's installation: the system's libraries, and the
# files the interpreter, the C library and common packages read at run time.
_SYSTEM_ROOTS = ("/usr", "/lib", "/lib64")
_SYSTEM_FILES = (
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/etc/os-release",
    "/etc/mime.types",
    "/dev/zero",
    "/dev/urandom",
    "/dev/random",
    "/proc/cpuinfo",
    "/proc/meminfo",
    "/proc/stat",
    "/sys/devices/system/cpu",
)
_DEV_NULL = "/dev/null"


def _import_beside(name: str):
    """kernel.py or hook.py, loaded from this folder by path: not through sys.path, and not left in
    sys.modules (a program's own `import hook` must not find ours)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"rldock_sandbox_{name}", os.path.join(HERE, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _readable(config: dict) -> tuple[list[str], list[str]]:
    """The directories the program may read, and load native modules from: Python's installation, this
    folder and the system's libraries; then the single files it may read besides. Absolute, links
    resolved."""
    python = (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *config["site"], HERE)
    installation = sorted({os.path.realpath(path) for path in (*python, *_SYSTEM_ROOTS) if os.path.exists(path)})
    files = sorted({os.path.realpath(path) for path in _SYSTEM_FILES if os.path.exists(path)})
    return installation, files


def _start(config: dict) -> None:
    """Applies the kernel layers, then becomes the `run` stage (the exec does not return)."""
    import json

    kernel = _import_beside("kernel")
    # The report descriptor keeps whatever number it had in the caller, which could be the one
    # hold_interpreter takes: moved to the lowest free one (the child has only 0-2 besides it).
    report = os.dup(config["report_fd"])
    os.close(config["report_fd"])
    scratch = config["scratch"]
    with open(os.path.join(scratch, PROGRAM), "rb") as file:
        program = file.read()
    exec_fd = kernel.hold_interpreter(sys.executable)
    exec_path = kernel.exec_path_page()
    namespaces = kernel.isolate(
        scratch=scratch, program=program, disk_bytes=config["disk_bytes"], max_files=config["max_files"]
    )
    kernel.set_limits(
        cpu_seconds=config["cpu_seconds"],
        memory_mib=config["memory_mib"],
        file_bytes=min(kernel.MAX_FILE_BYTES, config["disk_bytes"]),
        open_files=exec_fd,
        processes=kernel.MAX_THREADS if "user" in namespaces else None,
    )
    kernel.die_with_parent(config["parent"])
    installation, files = _readable(config)
    landlock, seccomp = 0, False
    skip = config.get("skip", ())
    if kernel.no_new_privileges():
        native_directories = [path for path in sys.path if path.endswith("lib-dynload")] + config["site"]
        excluded = kernel.native_files(native_directories)
        rules = [
            (scratch, kernel.SCRATCH),
            (_DEV_NULL, kernel.FS_READ_FILE | kernel.FS_WRITE_FILE | kernel.FS_TRUNCATE),
        ]
        for root in installation:
            rules.extend(kernel.grants(root, kernel.READ, excluded))
        rules.extend((path, kernel.READ) for path in files)
        landlock = 0 if "landlock" in skip else kernel.restrict_files(rules)
        seccomp = False if "seccomp" in skip else kernel.restrict_syscalls(exec_fd, exec_path)
    layers = {"namespaces": list(namespaces), "landlock": landlock, "seccomp": seccomp}
    os.write(report, json.dumps(layers).encode())
    os.close(report)
    held = {"landlock": landlock > 0, "seccomp": seccomp}
    missing = [layer for layer in config["required"] if not held[layer]]
    if missing:
        raise OSError(f"{LAYERS_MISSING_MESSAGE}{', '.join(missing)}")
    run = {
        **config,
        "readable": [scratch, *installation, *files, _DEV_NULL],
        "installation": installation,
        "refused_native": sorted(kernel.REFUSED_NATIVE),
        # Without Landlock the hook guards files alone: it then refuses what it cannot resolve as the
        # kernel will (`..`, which a directory descriptor would resolve elsewhere; leaving the scratch
        # directory as the working directory).
        "strict_paths": landlock == 0,
    }
    argv = [sys.executable, *INTERPRETER_FLAGS, __file__, "run", json.dumps(run)]
    kernel.exec_held(exec_fd, exec_path, argv, dict(os.environ))


class SandboxRefused(PermissionError):
    """What the audit hook raises. A PermissionError, so library code that falls back on OSError
    (platform, uuid, ...) keeps working; uncaught, the program exits with EXIT_REFUSED."""


class SandboxRefusedImport(ImportError):
    """A refused import: an ImportError, so a library with an optional dependency (numpy imports
    ctypes if it can) imports without it; uncaught, the program exits with EXIT_REFUSED."""


def _run(config: dict) -> int:
    """Runs program.py as `__main__` under the audit hook; returns the exit code."""
    # Before the hook, which then refuses importing it again: subprocess needs the module to import,
    # and its fork_exec, which raises no audit event in 3.11, is replaced below by a refusal (the
    # seccomp filter refuses the processes anyway).
    import _posixsubprocess
    import builtins

    # Loaded now, so that reporting a MemoryError needs no memory for an import.
    import traceback  # noqa: F401
    import types

    hook = _import_beside("hook")
    scratch = os.path.realpath(config["scratch"])
    sys.path.extend(config["site"])

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
    if config["audit_hook"]:
        sys.addaudithook(
            hook.audit_hook(
                scratch=scratch,
                readable=tuple(config["readable"]),
                installation=tuple(config["installation"]),
                refused_native=frozenset(config["refused_native"]),
                refused_error=SandboxRefused,
                refused_import=SandboxRefusedImport,
                unjudged_exit_code=EXIT_UNJUDGED,
                strict_paths=config["strict_paths"],
            )
        )
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
    """The traceback the interpreter would print, less the sandbox's frames (the exec in `_run`, the
    audit hook): the program's author cannot act on them."""
    import traceback

    report = traceback.TracebackException(type(error), error, error.__traceback__)
    pending, seen = [report], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        current.stack[:] = [frame for frame in current.stack if os.path.dirname(frame.filename) != HERE]
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
    import json

    if sys.argv[1] == "start":
        try:
            _start(json.loads(sys.argv[2]))
        except (OSError, ValueError, KeyError, IndexError) as error:
            # No layer could be set or no interpreter started: the program has not run.
            print(f"{BOOT_FAILED_MESSAGE}{error!r}", file=sys.stderr)
            sys.exit(EXIT_BOOT_FAILED)
    else:
        sys.exit(_run(json.loads(sys.argv[2])))
