"""The python tool's sandbox, with real interpreter processes: each limit stops its program and says
so, the audit hook refuses network, processes and files outside, the seccomp filter holds without the
hook, and the caller (the worker) is unharmed: after every test a plain program still runs (the
autouse fixture)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from sandbox_attacks import USE_UP_THE_MEMORY

from rldock.config.agent import SandboxSpec
from rldock.runtime.sandbox import boot, kernel
from rldock.runtime.sandbox.runner import Outcome, SandboxResult, _required, _run, _run_program, run_python

# The wall clock counts the interpreter's boot, which a loaded machine can stretch past seconds (a fresh clone's
# CI killed a program that must be refused at 3 s, before any layer was set up). A test of another outcome
# gives the wall clock a minute; the tests of the wall clock set their own.
LIMITS = SandboxSpec(cpu_seconds=1, wall_seconds=60, memory_mib=256, max_output_chars=2000)


def run(code: str, limits: SandboxSpec = LIMITS) -> SandboxResult:
    return asyncio.run(run_python(textwrap.dedent(code), limits))


@pytest.fixture(autouse=True)
def sandbox_still_works():
    """Whatever a test's program did, the worker is alive and the next program runs normally."""
    yield
    result = run("print(6 * 7)")
    assert (result.outcome, result.stdout, result.text) == (Outcome.OK, "42\n", "42\n")


def wait_until_dead(pid: int, timeout_s: float = 30.0) -> None:
    """Returns once `pid` has exited: gone, or a zombie (a container's PID 1 may never reap it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)  # polls the state it waits for
    raise AssertionError(f"process {pid} still runs {timeout_s} s after its group was killed")


def test_a_program_prints_and_exits():
    result = run("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert result.outcome is Outcome.OK and result.exit_code == 0
    assert (result.stdout, result.stderr, result.text) == ("out\n", "err\n", "out\nerr\n")


def test_an_exception_is_an_error_with_the_programs_traceback_only():
    result = run("def f():\n    return 1 / 0\nf()")
    assert result.outcome is Outcome.ERROR and result.exit_code == 1
    assert 'File "program.py", line 2, in f' in result.stderr and "ZeroDivisionError" in result.stderr
    assert "sandbox_boot" not in result.stderr
    assert result.text == result.stderr  # an error is not a limit: no reason line


def test_a_nonzero_exit_is_an_error():
    result = run("import sys\nsys.exit(3)")
    assert (result.outcome, result.exit_code) == (Outcome.ERROR, 3)


def test_a_loop_is_stopped_by_the_cpu_or_the_wall_clock_limit():
    # On a loaded machine the wall clock can come first: both are the loop being stopped.
    result = run("print('looping')\nwhile True:\n    pass")
    assert result.outcome in (Outcome.CPU_LIMIT, Outcome.WALL_LIMIT)
    assert result.text.startswith("looping\n") and result.text.endswith("]")
    assert "CPU time" in result.text or "time limit" in result.text


def test_a_program_that_handles_sigxcpu_is_still_stopped():
    result = run(
        """
        import signal
        signal.signal(signal.SIGXCPU, lambda *_: None)
        while True:
            pass
        """,
        SandboxSpec(cpu_seconds=1, wall_seconds=60),
    )
    assert result.outcome is Outcome.CPU_LIMIT and result.exit_code == -9


def test_allocating_10_gb_is_the_memory_limit():
    result = run("data = bytearray(10 * 2**30)")
    assert result.outcome is Outcome.MEMORY_LIMIT
    assert "MemoryError" in result.stderr
    assert result.text.endswith("[stopped: the program ran out of its 256 MiB of memory]")


def test_growing_until_memory_runs_out_is_the_memory_limit():
    result = run("chunks = []\nwhile True:\n    chunks.append(bytearray(2**20))", SandboxSpec(memory_mib=128))
    assert result.outcome is Outcome.MEMORY_LIMIT


def test_sleeping_forever_is_the_wall_limit_and_what_it_printed_is_kept():
    result = run("import time\nprint('started')\ntime.sleep(3600)", SandboxSpec(wall_seconds=3))
    assert result.outcome is Outcome.WALL_LIMIT and result.exit_code == -9
    assert result.text == "started\n[stopped: the program ran for 3 s, its time limit]"


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.fork()",
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.system('true')",
        "import os\nos.execv('/bin/true', ['true'])",
        "import os\nos.posix_spawn('/bin/true', ['true'], {})",
        "import multiprocessing\nmultiprocessing.Process(target=print).start()",
        # The module subprocess forks with: no audit event of its own in Python 3.11.
        "import _posixsubprocess\n_posixsubprocess.fork_exec()",
        "import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess",
        "import ctypes",
        "import _ctypes",
    ],
)
def test_starting_a_process_or_reaching_c_is_refused(code):
    result = run(code)
    assert result.outcome is Outcome.REFUSED and result.exit_code == 91, result.text
    assert "the sandbox refused" in result.stderr
    assert result.text.endswith("[stopped: the sandbox refused an operation (network, processes, files or ctypes)]")


@pytest.mark.parametrize(
    "connect",
    [
        "socket.create_connection(('127.0.0.1', PORT), timeout=1)",
        "socket.socket(socket.AF_INET, socket.SOCK_STREAM).connect(('127.0.0.1', PORT))",
        "import _socket; _socket.socket()",
        "socket.socketpair()",
        "socket.getaddrinfo('example.com', 80)",
    ],
)
def test_network_access_is_refused_and_nothing_connects(connect):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        result = run(f"import socket\n{connect.replace('PORT', str(port))}")
        assert result.outcome is Outcome.REFUSED, result.text
        # The program has ended: a connection it made would be waiting in the listener's queue.
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_a_refusal_is_an_oserror_a_program_can_catch():
    result = run(
        """
        import os, platform
        try:
            os.fork()
        except PermissionError as error:
            print("caught:", error)
        print(platform.architecture()[0])  # runs `file` in a subprocess and falls back on OSError
        """
    )
    assert result.outcome is Outcome.OK
    assert result.stdout.startswith("caught: the sandbox refused starting another process (os.fork)\n")


def test_signalling_the_worker_is_refused():
    result = run("import os, signal\nos.kill(os.getppid(), signal.SIGTERM)")
    assert result.outcome is Outcome.REFUSED and "signalling another process" in result.stderr


def test_the_worker_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("RLDOCK_TEST_SECRET", "hunter2")
    result = run("import os\nprint(sorted(os.environ))")
    assert result.outcome is Outcome.OK and "RLDOCK_TEST_SECRET" not in result.text and "hunter2" not in result.text
    # /proc is not readable, neither its own files nor another process's (which tell its environment).
    for path in ("/proc/self/environ", "/proc/{os.getppid()}/environ"):
        result = run(f"import os\nprint(open(f'{path}').read())")
        assert result.outcome is Outcome.REFUSED and "hunter2" not in result.text


def test_files_outside_the_working_directory_are_neither_written_nor_read(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("the answers")
    for code in (
        f"open({str(outside)!r}, 'w').write('x')",
        f"import os\nos.remove({str(outside)!r})",
        f"import os\nos.rename({str(outside)!r}, 'mine.txt')",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        f"print(open({str(outside)!r}).read())",
        "import os, sys\nos.open(sys.prefix, os.O_RDONLY)",  # readable, but a directory descriptor reaches below it
        "open('../escape.txt', 'w')",
    ):
        result = run(code)
        assert result.outcome is Outcome.REFUSED, (code, result.text)
        assert "the answers" not in result.text
    assert outside.read_text() == "the answers"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["outside.txt"]


def test_the_working_directory_is_the_programs_and_is_removed_afterwards():
    result = run(
        """
        import os, tempfile
        os.makedirs("a/b")
        with open("a/b/data.txt", "w") as file:
            file.write("kept for this call")
        os.mkdir("a/locked", 0o300)  # removal copes with a directory the program cannot list
        with open("a/locked/data.txt", "w") as file:
            file.write("hidden")
        print(os.getcwd())
        print(tempfile.gettempdir() == os.getcwd() == os.path.expanduser("~"))
        """
    )
    assert result.outcome is Outcome.OK, result.text
    scratch, same = result.stdout.splitlines()
    assert same == "True" and Path(scratch).name.startswith("rldock-sandbox-")
    assert not Path(scratch).exists()


def test_long_output_is_cut_keeping_its_beginning_and_end():
    limits = SandboxSpec(max_output_chars=100)
    result = run("print('BEGIN' + 'x' * 100_000 + 'END')", limits)
    assert result.outcome is Outcome.OK
    assert result.stdout.startswith("BEGIN") and result.stdout.endswith("END\n")
    assert "[... output cut: 100009 bytes in all ...]" in result.stdout
    assert len(result.stdout) == 100 + len("\n[... output cut: 100009 bytes in all ...]\n")
    assert result.text == result.stdout


def test_stdout_and_stderr_share_the_models_text():
    limits = SandboxSpec(max_output_chars=100)
    result = run("import sys\nprint('o' * 1000)\nprint('e' * 30, file=sys.stderr)\nraise SystemExit(1)", limits)
    assert result.outcome is Outcome.ERROR
    assert result.text.startswith("o") and result.text.endswith("e" * 30 + "\n")  # stderr's end survives
    assert len(result.text) < 100 + 50


def test_installed_packages_import():
    pytest.importorskip("numpy")
    result = run("import numpy\nprint(int(numpy.arange(10).sum()))", SandboxSpec(wall_seconds=60, cpu_seconds=30))
    assert (result.outcome, result.stdout) == (Outcome.OK, "45\n"), result.text


def test_programs_run_at_the_same_time():
    # Four calls at once: all four programs are seen running together (run one after another, at most one
    # would be); then the calls are cancelled, which kills them (the test below).
    code = "import time\ntime.sleep(3600)"

    async def four() -> list[int]:
        calls = [asyncio.ensure_future(run_python(code, SandboxSpec(wall_seconds=600))) for _ in range(4)]
        deadline = time.monotonic() + 60
        try:
            while len(programs := running_programs()) < 4:
                assert time.monotonic() < deadline, f"never four programs at once in 60 s (at most {len(programs)})"
                await asyncio.sleep(0.01)  # polls the state it waits for
            return programs
        finally:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)

    for program in asyncio.run(four()):
        wait_until_dead(program)


def running_programs(parent: int | None = None) -> list[int]:
    """The children of `parent` (this process) that reached the boot's `run` stage: the program runs."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat_fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # the process ended meanwhile
            continue
        if int(stat_fields[1]) == (parent or os.getpid()) and b"run" in command and boot.__file__.encode() in command:
            found.append(int(entry.name))
    return found


def test_the_wall_limit_kills_the_whole_process_group(tmp_path):
    # A process group the audit hook would not let a program make, so started without the boot script.
    pid_file = tmp_path / "grandchild.pid"
    code = f"""
        import os, time
        pid = os.fork()
        if pid == 0:
            time.sleep(3600)
        else:
            with open({str(pid_file)!r}, "w") as file:
                file.write(str(pid))
            time.sleep(3600)
        """
    command = [sys.executable, "-c", textwrap.dedent(code)]
    result = asyncio.run(_run(command, cwd=str(tmp_path), env={}, limits=SandboxSpec(wall_seconds=5)))
    assert result.outcome is Outcome.WALL_LIMIT
    wait_until_dead(int(pid_file.read_text()))


def test_cancelling_a_call_kills_its_program_and_removes_its_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    async def cancel_while_running() -> int:
        task = asyncio.ensure_future(run_python("import time\nprint('running')\ntime.sleep(3600)", LIMITS))
        while not (pids := running_programs()):
            await asyncio.sleep(0.01)  # polls the state it waits for
        [pid] = pids
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pid

    wait_until_dead(asyncio.run(cancel_while_running()))
    assert list(tmp_path.iterdir()) == []


def test_limits_of_the_child_are_the_configured_ones():
    result = run(
        """
        import resource
        for name in ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE"):
            print(name, *resource.getrlimit(getattr(resource, name)))
        """,
        SandboxSpec(cpu_seconds=2.5, memory_mib=300),
    )
    assert result.stdout.splitlines() == [
        "RLIMIT_CPU 3 4",
        f"RLIMIT_AS {300 * 2**20} {300 * 2**20}",
        f"RLIMIT_FSIZE {16 * 2**20} {16 * 2**20}",
        "RLIMIT_NOFILE 64 64",
        "RLIMIT_CORE 0 0",
    ]
    assert run("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (4, 4))").outcome is Outcome.REFUSED


def test_a_file_larger_than_16_mib_is_not_written():
    # Python ignores SIGXFSZ: the write past RLIMIT_FSIZE fails with EFBIG.
    result = run("open('big', 'wb').write(b'x' * (17 * 2**20))")
    assert result.outcome is Outcome.ERROR and "File too large" in result.stderr


@pytest.mark.parametrize(
    "program",
    [
        # Replacing what the hook calls.
        "import os\nos.path.realpath = lambda path: os.getcwd() + '/mine'\nopen(OUTSIDE, 'w')",
        "import os, posixpath\nos.getcwd = lambda: '/nowhere'\nposixpath.realpath = lambda path: '/nowhere'\n"
        "open(OUTSIDE, 'w')",
        "import builtins\nbuiltins.isinstance = lambda *_: True\nbuiltins.any = lambda *_: True\nopen(OUTSIDE, 'w')",
        "import sys\nsys.settrace(lambda *_: None)\nopen(OUTSIDE, 'w')",
        # A str subclass that tells the hook another path than the kernel reads.
        "open(type('Lying', (str,), {'split': lambda *_: ['mine'], 'startswith': lambda *_: True})(OUTSIDE), 'w')",
        # Symbolic links the system already has.
        "open('/proc/self/root' + OUTSIDE, 'w')",
        "open('/proc/self/cwd/../../' + OUTSIDE, 'w')",
    ],
)
def test_the_hook_checks_a_path_as_the_kernel_reads_it_whatever_the_program_replaced(tmp_path, program):
    outside = tmp_path / "outside.txt"
    result = run(f"OUTSIDE = {str(outside)!r}\n{program}")
    assert result.outcome is Outcome.REFUSED, result.text
    assert not outside.exists()


def test_the_programs_own_streams_and_dev_null_are_writable():
    result = run("open('/dev/stdout', 'w').write('out\\n')\nopen('/dev/null', 'w').write('gone')")
    assert (result.outcome, result.stdout) == (Outcome.OK, "out\n"), result.text
    # Through /proc, the descriptor of a file (one readable, in the standard library) is that file.
    result = run("import os\nfd = os.open(os.__file__, os.O_RDONLY)\nopen(f'/proc/self/fd/{fd}', 'a')")
    assert result.outcome is Outcome.REFUSED and "writing outside the working directory" in result.stderr


def test_a_lower_hard_limit_of_the_worker_is_kept(monkeypatch):
    # Only root may raise a hard limit: the sandbox lowers what it can and keeps what is lower already
    # (one descriptor below the worker's, where it holds the interpreter for its own exec).
    real_exec = asyncio.create_subprocess_exec

    async def with_32_files(*argv, **options):
        return await real_exec("/bin/sh", "-c", 'ulimit -n 32 && exec "$@"', "sh", *argv, **options)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", with_32_files)
    result = run("import resource\nprint(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    assert (result.outcome, result.stdout) == (Outcome.OK, "31 31\n"), result.text


def test_a_sandbox_that_cannot_start_is_logged_and_a_program_cannot_fake_it(tmp_path, caplog):
    command = [sys.executable, *boot.INTERPRETER_FLAGS, boot.__file__, "start", '{"scratch": "/nowhere"}']
    result = asyncio.run(_run(command, cwd=str(tmp_path), env={}, limits=LIMITS))
    assert result.outcome is Outcome.ERROR and result.stderr.startswith(boot.BOOT_FAILED_MESSAGE)
    assert [record.levelname for record in caplog.records] == ["ERROR"]
    assert "the python tool's sandbox did not start" in caplog.records[0].getMessage()
    # The same exit from a program is its own error, never an exception in the worker.
    caplog.clear()
    result = run(f"import sys\nprint({boot.BOOT_FAILED_MESSAGE!r}, file=sys.stderr)\nsys.exit(92)")
    assert (result.outcome, result.exit_code) == (Outcome.ERROR, 92)


def test_every_kernel_layer_holds_on_this_machine():
    # Linux 5.13+ with Landlock, x86_64 or aarch64, root: what CI runs on. docs/agentic.md says which
    # layer holds where; the attack corpus (test_sandbox_attacks.py) runs without the namespaces too.
    result = run("print('in')")
    assert result.layers.landlock >= 1 and result.layers.seccomp, result.layers
    assert result.layers.namespaces == ("user", "mount", "network", "scratch_filesystem")
    assert result.layers.missing == ()
    # Threads are not processes: they stay allowed.
    result = run("import threading\nthread = threading.Thread(target=print, args=('a thread',))\nthread.start()")
    assert (result.outcome, result.stdout) == (Outcome.OK, "a thread\n"), result.text


_KERNEL_ONLY = """
import errno, os, signal, socket, threading

def attempt(call):
    try:
        call()
    except OSError as error:
        return errno.errorcode[error.errno]
    return "allowed"

print("fork", attempt(os.fork))
print("posix_spawn", attempt(lambda: os.posix_spawn("/bin/true", ["true"], {})))
print("exec", attempt(lambda: os.execv("/bin/true", ["true"])))
print("socket", attempt(socket.socket))
print("signal the parent", attempt(lambda: os.kill(os.getppid(), 0)))
print("signal itself", attempt(lambda: os.kill(os.getpid(), 0)))
print("signal its own thread", attempt(lambda: signal.pthread_kill(threading.get_ident(), 0)))
print("pidfd of the parent", attempt(lambda: os.pidfd_open(os.getppid())))
print("read /etc/passwd", attempt(lambda: open("/etc/passwd").read()))
print("list /", attempt(lambda: os.listdir("/")))
print("write here", attempt(lambda: open("mine.txt", "w").write("x")))
thread = threading.Thread(target=print, args=("a thread runs",))
thread.start()
thread.join()
"""


def test_the_kernel_layers_hold_without_the_audit_hook():
    # What a program that got past the audit hook meets.
    result = asyncio.run(_run_program(_KERNEL_ONLY, LIMITS, audit_hook=False, required=()))
    assert result.stdout.splitlines() == [
        "fork EPERM",
        "posix_spawn EPERM",
        "exec EPERM",
        "socket EPERM",
        "signal the parent EPERM",
        "signal itself allowed",
        "signal its own thread allowed",
        "pidfd of the parent EPERM",
        "read /etc/passwd EACCES",
        "list / EACCES",
        "write here allowed",
        "a thread runs",
    ], result.text


@pytest.mark.parametrize("machine", sorted(kernel.SYSCALLS))
def test_the_syscall_filter_is_a_valid_program(machine):
    _, numbers = kernel.SYSCALLS[machine]
    needed = {*kernel.DENIED, *kernel._OWN_PROCESS, "clone", "clone3", "kill", "execveat", "fcntl", "ioctl"}
    needed |= {name for name, _ in kernel._OWN_PRIORITY}
    # The generic table has none of these: the *at forms (in the table) cover them.
    assert needed - set(numbers) <= {
        "fork",
        "vfork",
        "mknod",
        "chmod",
        "chown",
        "lchown",
        "utime",
        "utimes",
        "futimesat",
    }
    program = kernel.syscall_filter(machine, 4242, 64, 0x7F12_3456_7000)
    assert program is not None and len(program) < 256
    for at, (code, true, false, _) in enumerate(program):
        if code & 0x07 == 0x05:  # a jump: forward (classic BPF cannot jump back), inside the program, in a byte
            assert min(true, false) >= 0 and at + 1 + max(true, false) < len(program)
            assert max(true, false) <= 255
    assert program[-1][0] == 0x06  # it ends with a return
    assert kernel.syscall_filter("sparc64", 4242, 64, 0x7F12_3456_7000) is None


# Installs the filter in a process of its own (it stays for the process's life) and makes the calls with
# ctypes, as native code in a program could; each line: the call, then its errno name or "allowed".
_CROSSING_PROCESSES = """
import ctypes, errno, os, sys
from rldock.runtime.sandbox import kernel

libc = ctypes.CDLL(None, use_errno=True)
_, numbers = kernel.SYSCALLS[os.uname().machine]
parent = os.getppid()
held = kernel.hold_interpreter(sys.executable)
page = kernel.exec_path_page()
assert kernel.no_new_privileges() and kernel.restrict_syscalls(held, page)
argv = (ctypes.c_char_p * 2)(b"echo", None)

def call(name, *args):
    result = libc.syscall(ctypes.c_long(numbers[name]), *args)
    print(name, "allowed" if result >= 0 else errno.errorcode[ctypes.get_errno()])

long = ctypes.c_long
call("setpriority", long(0), long(parent), long(19))
call("setpriority", long(2), long(0), long(19))  # PRIO_USER: every process of the user
call("setpriority", long(0), long(0), long(1))
call("sched_setaffinity", long(parent), long(8), ctypes.byref(ctypes.c_ulong(1)))
call("sched_setaffinity", long(0), long(8), ctypes.byref(ctypes.c_ulong(1)))
call("sched_setscheduler", long(parent), long(5), ctypes.byref(ctypes.c_int(0)))  # SCHED_IDLE
call("sched_setparam", long(parent), ctypes.byref(ctypes.c_int(0)))
call("sched_setattr", long(parent), ctypes.byref((ctypes.c_uint32 * 14)(56)), long(0))
call("ioprio_set", long(1), long(parent), long(7 << 13))
call("prlimit64", long(parent), long(7), None, ctypes.byref((ctypes.c_uint64 * 2)()))
call("prlimit64", long(0), long(7), None, ctypes.byref((ctypes.c_uint64 * 2)()))
call("shmget", long(0), long(2**20), long(0o1600))  # IPC_PRIVATE, IPC_CREAT
call("semget", long(0), long(1), long(0o1600))
call("msgget", long(0), long(0o1600))
call("mq_open", b"rldock-test", long(0o100 | 0o2), long(0o600), None)
echo = os.open("/bin/echo", os.O_RDONLY)
call("execveat", long(held), b"/bin/echo", argv, argv, long(0))
call("execveat", long(held), b"/bin/echo", argv, argv, long(0x1000))
call("execveat", long(echo), b"", argv, argv, long(0x1000))
call("execveat", long(held), b"", argv, argv, long(0x1000))  # the right descriptor, another path address
"""


def test_the_filter_refuses_what_crosses_processes():
    # Issue 50: the caller reniced, pinned and made SCHED_IDLE, a SysV segment outliving the program, and
    # execveat of an absolute path through the held descriptor. The program's own process stays its own.
    output = subprocess.run([sys.executable, "-c", _CROSSING_PROCESSES], capture_output=True, text=True)
    assert output.stdout.splitlines() == [
        "setpriority EPERM",
        "setpriority EPERM",
        "setpriority allowed",
        "sched_setaffinity EPERM",
        "sched_setaffinity allowed",
        "sched_setscheduler EPERM",
        "sched_setparam EPERM",
        "sched_setattr EPERM",
        "ioprio_set EPERM",
        "prlimit64 EPERM",
        "prlimit64 allowed",
        "shmget EPERM",
        "semget EPERM",
        "msgget EPERM",
        "mq_open EPERM",
        "execveat EPERM",
        "execveat EPERM",
        "execveat EPERM",
        "execveat EPERM",
    ], output.stderr


def test_a_program_never_runs_without_a_layer_the_config_requires():
    # Issue 50: where the kernel has no Landlock (simulated: the boot does not apply it), the boot stops
    # before the program's first line unless agent.sandbox.allow_missing_layers names the layer.
    code = "print('ran')"
    allowed = LIMITS.model_copy(update={"allow_missing_layers": ["landlock"]})
    for missing, limits, runs in [
        (("landlock",), LIMITS, False),
        (("landlock",), allowed, True),
        (("seccomp",), allowed, False),  # no config allows it
        (("landlock", "seccomp"), allowed, False),
    ]:
        result = asyncio.run(_run_program(code, limits, audit_hook=True, required=_required(limits), skip=missing))
        assert result.layers.missing == missing
        if runs:
            assert (result.outcome, result.stdout) == (Outcome.OK, "ran\n")
            continue
        assert (result.outcome, result.exit_code, result.stdout) == (Outcome.ERROR, boot.EXIT_BOOT_FAILED, "")
        refused = [layer for layer in missing if layer in _required(limits)]
        assert f"{boot.LAYERS_MISSING_MESSAGE}{', '.join(refused)}" in result.stderr


def test_the_tool_start_and_validate_say_what_a_machine_lacks(monkeypatch, caplog):
    from rldock.runtime.sandbox import runner

    no_landlock = runner.Layers(namespaces=(), landlock=0, seccomp=True, reported=True)
    monkeypatch.setattr(runner, "machine_layers", lambda limits: no_landlock)
    problem = runner.missing_layers_problem(no_landlock, SandboxSpec())
    assert problem is not None and problem.startswith("agent.sandbox.allow_missing_layers: this machine lacks Landlock")
    with pytest.raises(runner.SandboxLayersMissing, match=r"allow_missing_layers"):
        runner.require_layers(SandboxSpec())
    assert runner.require_layers(SandboxSpec(allow_missing_layers=["landlock"])) == no_landlock
    assert runner.describe_layers(no_landlock) == "no Landlock; seccomp filter; no namespaces"
    # On this machine every layer holds.
    monkeypatch.undo()
    assert runner.describe_layers(runner.machine_layers(SandboxSpec())) == (
        f"Landlock ABI {kernel.landlock_abi()}; seccomp filter; namespaces: user, mount, network, scratch_filesystem"
    )


def test_a_client_cannot_lower_the_served_sandbox():
    from rldock.runtime.agent.sandbox_service import sandbox_limits

    with pytest.raises(ValueError, match="allow_missing_layers not a sandbox limit"):
        sandbox_limits({"sandbox": {"allow_missing_layers": ["landlock"]}})


@pytest.mark.parametrize(
    "options, allowed",
    [
        ({}, []),
        ({"allow_missing_layers": "landlock"}, ["landlock"]),
        ({"allow_missing_layers": "landlock", "memory_mib": "256"}, ["landlock"]),
    ],
)
def test_only_the_served_sandbox_s_admin_opts_into_a_missing_landlock(options, allowed, monkeypatch):
    """Issue 50: a served sandbox on a machine without Landlock refused every program, with no way to run
    with what remains. Its own option opts in, by name, as agent.sandbox.allow_missing_layers does; every
    call then runs with it (a client's limits cannot drop it), and without it every call is refused."""
    from rldock.runtime.agent.interfaces import EpisodeContext
    from rldock.runtime.agent.sandbox_service import PythonSandbox
    from rldock.runtime.sandbox import runner

    no_landlock = runner.Layers(landlock=0, seccomp=True, namespaces=(), reported=True)
    monkeypatch.setattr(runner, "machine_layers", lambda limits: no_landlock)
    server = PythonSandbox(**options)
    assert server.ceiling.allow_missing_layers == allowed
    session = server.session()
    context = EpisodeContext(ground_truth="", data_source="", extra_info={"sandbox": {"cpu_seconds": 2}})
    asyncio.run(session.reset(seed=0, episode_id="e", context=context))
    assert session.tool.limits.allow_missing_layers == allowed  # the server's, through the client's limits
    if allowed:
        assert runner.require_layers(session.tool.limits) == no_landlock
    else:
        with pytest.raises(runner.SandboxLayersMissing, match="allow_missing_layers"):
            runner.require_layers(session.tool.limits)


def test_a_served_sandbox_may_not_do_without_its_filter():
    from rldock.runtime.agent.sandbox_service import PythonSandbox

    with pytest.raises(ValueError, match="--option allow_missing_layers=seccomp: only 'landlock' may be missing"):
        PythonSandbox(allow_missing_layers="seccomp")


def test_the_watchdog_walks_off_the_event_loop(tmp_path, monkeypatch):
    # Issue 50: a walk of max_files entries took 93 ms on the loop every 20 ms poll, stalling every other
    # call of the rollout. Where no tmpfs caps the scratch directory (a restricted pod), each walk runs in
    # a worker thread, and a directory over the limit still stops the program.
    from rldock.runtime.sandbox import runner

    walked_on: list[threading.Thread] = []
    real_within = runner._within

    def recording_within(*args, **kwargs):
        walked_on.append(threading.current_thread())
        return real_within(*args, **kwargs)

    monkeypatch.setattr(runner, "_within", recording_within)
    program = (
        "import os, time\n"
        f"for index in range(50):\n    open(os.path.join({str(tmp_path)!r}, str(index)), 'w').close()\n"
        "time.sleep(60)"
    )
    limits = SandboxSpec(wall_seconds=30, max_files=10)

    async def run_and_find_the_loop_thread():
        argv = [sys.executable, "-c", program]
        result = await _run(argv, cwd=str(tmp_path), env={}, limits=limits, watch=str(tmp_path))
        return result, threading.current_thread()

    result, loop_thread = asyncio.run(run_and_find_the_loop_thread())
    assert result.outcome is Outcome.DISK_LIMIT
    assert walked_on and loop_thread not in walked_on


def test_a_boot_that_failed_counts_no_layer_as_missing(tmp_path, monkeypatch, caplog):
    # It reports nothing; only its error is logged (the program never ran, under no layer at all).
    failing = tmp_path / "failing_boot.py"
    failing.write_text(f"import sys\nprint({boot.BOOT_FAILED_MESSAGE!r} + 'test', file=sys.stderr)\nsys.exit(92)")
    monkeypatch.setattr(boot, "__file__", str(failing))
    result = run("print(1)")
    assert result.outcome is Outcome.ERROR and not result.layers.reported and result.layers.missing == ()
    assert [record.levelname for record in caplog.records] == ["ERROR"]


def test_a_missing_layer_is_logged_once_per_process(monkeypatch, caplog):
    from rldock.runtime.sandbox import runner

    async def on_an_old_kernel(code, limits, *, audit_hook, required):
        assert audit_hook
        return SandboxResult(
            "", "", 0, Outcome.OK, "", runner.Layers(namespaces=("network",), seccomp=True, reported=True)
        )

    monkeypatch.setattr(runner, "_run_program", on_an_old_kernel)
    monkeypatch.setattr(runner, "_missing_logged", set())
    for _ in range(3):
        assert run("print(1)").layers.missing == ("landlock",)
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "without Landlock" in warnings[0] and "agent/sandbox/without_landlock" in warnings[0]


def _code_objects(code):
    yield code
    for constant in code.co_consts:
        if hasattr(constant, "co_code"):
            yield from _code_objects(constant)


def test_nothing_the_hook_relies_on_is_reachable_and_mutable():
    # A refusal's traceback shows the hook's frames: their f_locals and f_globals are the program's to
    # change. So the helpers look up no global or builtin name and close over nothing, and the hook
    # closes over immutable values, builtins and those helpers only (its own cells are unreachable).
    import dis
    import types

    from rldock.runtime.sandbox import hook

    helpers = [
        value for name, value in vars(hook).items() if name.startswith("_") and isinstance(value, types.FunctionType)
    ]
    assert len(helpers) >= 8
    installed = hook.audit_hook(
        scratch="/s",
        readable=("/s",),
        installation=("/usr",),
        refused_native=frozenset(),
        refused_error=PermissionError,
        refused_import=ImportError,
        unjudged_exit_code=boot.EXIT_UNJUDGED,
        strict_paths=True,
    )
    for function in [*helpers, installed]:
        for code in _code_objects(function.__code__):
            operations = {instruction.opname for instruction in dis.get_instructions(code)}
            assert not operations & {"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "STORE_NAME"}, code.co_name
    assert all(helper.__closure__ is None for helper in helpers)
    immutable = (str, bytes, int, bool, frozenset, type, types.BuiltinFunctionType)

    def safe(value) -> bool:
        if isinstance(value, tuple):
            return all(safe(item) for item in value)
        return isinstance(value, immutable) or value in helpers

    for cell in installed.__closure__:
        assert safe(cell.cell_contents), cell.cell_contents


# Memory used up, then a read whose check needs more than is left: a bytes path passes the open call as it
# is, and the hook makes a str of it, then one per part. The same as an attack: sandbox_attacks.py.
_HOOK_OUT_OF_MEMORY = (
    """
import os
path = b"/etc/passwd" + b"/.." * 500
attempts, failures = [None] * 100, [0]
"""
    + USE_UP_THE_MEMORY
    + """for attempt in attempts:
    try:
        open(path)
    except MemoryError:
        failures[0] += 1
    except OSError:
        pass
del hoard
print("went on after", failures[0], "failed checks")
"""
)
# A path object that raises when the hook asks it (shutil's event carries the object as given).
_HOOK_RAISES = """
import shutil
class Broken:
    def __fspath__(self):
        raise ValueError("no path")
try:
    shutil.rmtree(Broken())
except ValueError:
    print("went on after a failed check")
"""


@pytest.mark.parametrize("code", [_HOOK_OUT_OF_MEMORY, _HOOK_RAISES], ids=["out of memory", "an error in it"])
def test_an_event_the_hook_cannot_judge_ends_the_program(code):
    # Raising is how the hook refuses, and a program can catch that: an exception of the hook's own
    # (out of memory, an error) instead ends the program, so an unjudged event never passes.
    result = run(code, SandboxSpec(cpu_seconds=5, wall_seconds=20, memory_mib=256))
    assert (result.outcome, result.exit_code) == (Outcome.HOOK_FAILED, boot.EXIT_UNJUDGED), result.text
    assert "went on" not in result.stdout
    assert "the audit hook could not check an operation" in result.stderr
    assert result.text.endswith(
        "[stopped: the sandbox could not check an operation (out of memory or an error in the check) and ended the "
        "program]"
    )


_REPORT_AT_64 = """
import asyncio, os
from rldock.config.agent import SandboxSpec
from rldock.runtime.sandbox import runner

real_pipe = os.pipe

def pipe_writing_at_64():  # the report's pipe, the first made; subprocess makes its own after
    os.pipe = real_pipe
    read, write = real_pipe()
    os.dup2(write, 64)  # a fresh interpreter: 64 is free
    os.close(write)
    return read, 64

os.pipe = pipe_writing_at_64
result = asyncio.run(runner.run_python("print(1)", SandboxSpec()))
print(result.outcome.value, result.layers.landlock > 0, result.layers.seccomp)
"""


def test_the_layers_are_reported_whatever_number_the_report_descriptor_has():
    # The caller's pipe can have the very number the boot holds the interpreter at (64).
    assert kernel.MAX_OPEN_FILES == 64
    output = subprocess.run([sys.executable, "-c", _REPORT_AT_64], capture_output=True, text=True, check=True)
    assert output.stdout == "ok True True\n", output.stderr
