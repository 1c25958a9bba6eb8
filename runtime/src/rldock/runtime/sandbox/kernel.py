"""The sandbox's kernel layers: what holds whatever the program does inside its interpreter (the audit
hook in hook.py does not; a memory-unsafe API such as numpy's as_strided, or native code, gets past any
in-process hook). boot.py's `start` stage applies them to itself, in this order, before it becomes the
program's interpreter; all survive that exec and bind everything the program does:

1. `hold_interpreter`: the interpreter's file open at the one descriptor the seccomp filter lets
   `execveat` run (the boot's own re-exec); the program cannot make a descriptor that high.
2. `isolate`: new user, mount and network namespaces where the kernel allows them (root, or unprivileged
   user namespaces), with the scratch directory replaced by a tmpfs capped at the disk limit (bytes and
   files) and mounted noexec, which the kernel tears down with the namespace. Where unshare(2) is
   refused (the RuntimeDefault seccomp profile of a pod under the `restricted` Pod Security Standard),
   none of this: the caller's disk watchdog caps the scratch directory instead (sandbox/runner.py).
3. `set_limits`: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE and, in a user
   namespace of its own, RLIMIT_NPROC (MAX_THREADS).
4. `die_with_parent`: PR_SET_PDEATHSIG, so the program dies with its caller (whose process-group kill
   enforces the wall clock) even when the caller is killed.
5. `restrict_files`: Landlock (Linux 5.13+, no privilege needed once no_new_privs is set, so it holds in a
   restricted pod too): read and execute only the interpreter's installation, the system libraries and
   a few listed files, less the native modules that reach raw memory (`REFUSED_NATIVE`, by file);
   read and write only the scratch directory; no TCP (ABI 4+); no signals or abstract unix sockets out
   of the sandbox (ABI 6+).
6. `restrict_syscalls`: a seccomp filter (`syscall_filter`) refusing what the program never needs and
   what would get it out: a second program (execve, and execveat but the boot's own: `exec_held`),
   processes, sockets, signals, file-owner signals, scheduling, priorities and limits of others, raising
   limits, SysV IPC and POSIX message queues, namespaces and mounts, kernel keyrings, BPF, and the rest of
   `DENIED`.

Each returns what it managed, so the caller can log and count a layer a kernel lacks. Standard library
only: the program's interpreter must never hold ctypes, which this module needs, so boot.py uses it in
the `start` stage only.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Iterator

# The interpreter is held open at a descriptor the program can never make: RLIMIT_NOFILE is lowered to
# that very number right after (soft and hard), so the program's descriptors are all below it, and the
# filter refuses raising the limit. It is close-on-exec: the program's interpreter does not have it.
MAX_OPEN_FILES = 64
MAX_FILE_BYTES = 16 * 2**20  # RLIMIT_FSIZE: one file (or the disk limit, if lower)
# Threads (and processes, which the filter refuses) one program may run: RLIMIT_NPROC where it runs in a
# user namespace of its own, whose count is then the program's alone. The kernel exempts a process whose
# real uid is root on the host (the namespace maps the program to it when the worker is root), and Python
# 3.11 raises no audit event for a new thread: there, and in a restricted pod, RLIMIT_AS is the bound
# (about 700 threads of 64 KiB stacks at 512 MiB).
MAX_THREADS = 64

# Native modules that read and write raw memory, or make objects outside the sandbox, with no audit event:
# their files are left out of what Landlock lets the program read, so no name or path loads them; the
# audit hook refuses the names too.
REFUSED_NATIVE = frozenset(
    {
        "_ctypes",
        "_ctypes_test",
        "_cffi_backend",
        "_testcapi",
        "_testinternalcapi",
        "_testmultiphase",
        "_testsinglephase",
        "_testbuffer",
        "_testimportmultiple",
        "_testclinic",
        "_xxsubinterpreters",
        "_xxinterpchannels",
        "_xxtestfuzz",
        # POSIX shared memory and semaphores: files in /dev/shm that outlive the program (Landlock keeps
        # /dev/shm out of reach too; without it, these are how Python makes them).
        "_posixshmem",
        "_multiprocessing",
    }
)

_libc_handle = None


def _libc():
    global _libc_handle
    if _libc_handle is None:
        import ctypes

        _libc_handle = ctypes.CDLL(None, use_errno=True)
    return _libc_handle


def _raise_errno(what: str) -> None:
    import ctypes

    number = ctypes.get_errno()
    raise OSError(number, f"{what}: {os.strerror(number)}")


def hold_interpreter(executable: str) -> int:
    """Opens the interpreter (close-on-exec) at MAX_OPEN_FILES, or one below the worker's hard limit on
    open files where that is lower, and returns the descriptor: the program's RLIMIT_NOFILE (set_limits'
    open_files)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    number = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY or hard > MAX_OPEN_FILES else hard - 1
    if soft <= number:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # raising the soft limit needs no privilege
    descriptor = os.open(os.path.realpath(executable), os.O_RDONLY | os.O_CLOEXEC)
    if descriptor != number:
        os.dup2(descriptor, number, inheritable=False)
        os.close(descriptor)
    return number


# --- namespaces and the scratch filesystem -------------------------------------------------------------

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
# Tried in order: unprivileged needs the user namespace; root without one keeps its host capabilities.
_UNSHARE_ATTEMPTS = (
    (_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET, ("user", "mount", "network")),
    (_CLONE_NEWNS | _CLONE_NEWNET, ("mount", "network")),
    (_CLONE_NEWNET, ("network",)),
)
_NOBODY = 65534


def isolate(*, scratch: str, program: bytes, disk_bytes: int, max_files: int) -> tuple[str, ...]:
    """Enters what namespaces the kernel allows and, with a mount namespace, mounts a tmpfs of
    `disk_bytes` and `max_files` over `scratch` and writes `program` into it. Returns the layers entered
    (`user`, `mount`, `network` namespaces, `scratch_filesystem`); () where unshare is refused.

    In a user namespace the process is mapped to its own uid, or to 65534 when it is root, so that the
    program's interpreter (exec drops a non-root user's capabilities) runs with no capability at all."""
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    entered = next((names for flags, names in _UNSHARE_ATTEMPTS if libc.unshare(flags) == 0), None)
    if entered is None:
        return ()
    if "user" in entered:
        with open("/proc/self/setgroups", "w") as file:
            file.write("deny")
        with open("/proc/self/uid_map", "w") as file:
            file.write(f"{uid or _NOBODY} {uid} 1")
        with open("/proc/self/gid_map", "w") as file:
            file.write(f"{gid or _NOBODY} {gid} 1")
    if "mount" not in entered:
        return entered
    # Private first, so that the tmpfs stays in this namespace and never reaches the host's.
    if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        _raise_errno("making the mounts private")
    # Two inodes more than max_files: the root directory and the program's file.
    options = f"size={disk_bytes},nr_inodes={max_files + 2},mode=0700".encode()
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC  # noexec: no native code written by the program maps
    if libc.mount(b"tmpfs", scratch.encode(), b"tmpfs", flags, options) != 0:
        return entered  # a kernel without tmpfs: the caller's watchdog caps the disk
    os.chdir(scratch)  # the working directory was the directory under the mount
    with open(os.path.join(scratch, "program.py"), "wb") as file:
        file.write(program)
    return (*entered, "scratch_filesystem")


# --- resource limits and the caller's death ------------------------------------------------------------


def set_limits(*, cpu_seconds: float, memory_mib: int, file_bytes: int, open_files: int, processes: int | None) -> None:
    """The program's resource limits; `processes` (RLIMIT_NPROC) only where it runs in a user namespace
    of its own: outside one the count is the user's across the whole machine (its other pods and the
    worker's threads included)."""
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
    lower(resource.RLIMIT_FSIZE, file_bytes, file_bytes)
    lower(resource.RLIMIT_NOFILE, open_files, open_files)
    lower(resource.RLIMIT_CORE, 0, 0)
    if processes is not None:
        lower(resource.RLIMIT_NPROC, processes, processes)


_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 1, 38, 22, 2


def die_with_parent(parent: int) -> None:
    """SIGKILL when the caller's thread that started this process ends. Set after the namespaces (a new
    user namespace's credentials clear it); raises if the caller already ended before it was set."""
    if _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        _raise_errno("setting the parent-death signal")
    if os.getppid() != parent:
        raise OSError(f"the caller (pid {parent}) ended before the sandbox started")


def no_new_privileges() -> bool:
    """What Landlock and seccomp need of an unprivileged process (a restricted pod sets it anyway).
    Returns whether it is set."""
    return _libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0


# --- Landlock -----------------------------------------------------------------------------------------

_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446  # every machine
_LANDLOCK_CREATE_RULESET_VERSION, _LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK, FS_MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
# What a rule on a file (not a directory) may grant.
_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
# The scratch directory: files and directories of the program's own; no devices, fifos, sockets or links.
SCRATCH = (
    FS_READ_FILE
    | FS_WRITE_FILE
    | FS_READ_DIR
    | FS_REMOVE_DIR
    | FS_REMOVE_FILE
    | FS_MAKE_DIR
    | FS_MAKE_REG
    | FS_REFER
    | FS_TRUNCATE
)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (before 5.13, or not enabled)."""
    version = _libc().syscall(_LANDLOCK_CREATE_RULESET, None, 0, _LANDLOCK_CREATE_RULESET_VERSION)
    return max(int(version), 0)


def _handled_fs(abi: int) -> int:
    handled = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        handled |= FS_REFER
    if abi >= 3:
        handled |= FS_TRUNCATE
    if abi >= 5:
        handled |= FS_IOCTL_DEV
    return handled


def grants(root: str, access: int, excluded: frozenset[str]) -> Iterator[tuple[str, int]]:
    """Rules granting `access` beneath `root` except on the files in `excluded`: a rule grants a whole
    hierarchy, so a directory above an excluded file gets READ_DIR alone and each of its other entries a
    rule of its own. Symbolic links get none (what they lead to is checked where it is)."""
    if not any(path.startswith(root + "/") for path in excluded):
        yield root, access
        return
    yield root, access & FS_READ_DIR
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.path not in excluded and not entry.is_symlink():
                yield from grants(entry.path, access, excluded)


def native_files(directories: Iterable[str]) -> frozenset[str]:
    """The files of REFUSED_NATIVE modules in `directories` (lib-dynload, site-packages)."""
    found = set()
    for directory in directories:
        if not os.path.isdir(directory):
            continue
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.endswith(".so") and entry.name.split(".")[0] in REFUSED_NATIVE:
                    found.add(os.path.realpath(entry.path))
    return frozenset(found)


def restrict_files(rules: Iterable[tuple[str, int]]) -> int:
    """Landlock: from here on this process and what it executes may reach only the paths in `rules`
    (path, access; a missing path is skipped), make no TCP connection and signal nothing outside.
    Returns the ABI version enforced; 0 where the kernel has no Landlock (nothing is changed then)."""
    import ctypes

    abi = landlock_abi()
    if abi < 1:
        return 0

    class RulesetAttr(ctypes.Structure):
        _fields_ = [
            ("handled_access_fs", ctypes.c_uint64),
            ("handled_access_net", ctypes.c_uint64),
            ("scoped", ctypes.c_uint64),
        ]

    class PathBeneathAttr(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    handled = _handled_fs(abi)
    # Fields an older kernel does not know must be zero, which it then accepts.
    attr = RulesetAttr(
        handled,
        _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0,
        _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0,
    )
    libc = _libc()
    ruleset = libc.syscall(_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.sizeof(attr), 0)
    if ruleset < 0:
        _raise_errno("creating the Landlock ruleset")
    try:
        for path, access in rules:
            try:
                descriptor = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                is_directory = os.path.isdir(f"/proc/self/fd/{descriptor}")
                allowed = access & handled & (-1 if is_directory else _FILE_RIGHTS)
                rule = PathBeneathAttr(allowed, descriptor)
                if allowed and libc.syscall(
                    _LANDLOCK_ADD_RULE, ruleset, _LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0
                ):
                    _raise_errno(f"adding the Landlock rule for {path}")
            finally:
                os.close(descriptor)
        if libc.syscall(_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            _raise_errno("enforcing the Landlock ruleset")
    finally:
        os.close(ruleset)
    return abi


# --- seccomp ------------------------------------------------------------------------------------------

# Syscall numbers per machine (os.uname().machine), with its AUDIT_ARCH_*; the numbers from 424 on are the
# same on every machine.
_UNIFIED_SYSCALLS = {
    "pidfd_send_signal": 424,
    "io_uring_setup": 425,  # its operations include socket and connect, which the filter would not see
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "pidfd_open": 434,
    "clone3": 435,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
    "process_mrelease": 448,
    "statmount": 457,
    "listmount": 458,
    "setxattrat": 463,
    "getxattrat": 464,
    "listxattrat": 465,
    "removexattrat": 466,
    "open_tree_attr": 467,
    "fchmodat2": 452,
}
SYSCALLS = {
    "x86_64": (
        0xC000003E,
        {
            "ioctl": 16,
            "shmget": 29,
            "shmat": 30,
            "shmctl": 31,
            "socket": 41,
            "clone": 56,
            "fork": 57,
            "vfork": 58,
            "execve": 59,
            "kill": 62,
            "semget": 64,
            "semop": 65,
            "semctl": 66,
            "shmdt": 67,
            "msgget": 68,
            "msgsnd": 69,
            "msgrcv": 70,
            "msgctl": 71,
            "fcntl": 72,
            "chmod": 90,
            "chown": 92,
            "lchown": 94,
            "utime": 132,
            "ptrace": 101,
            "rt_sigqueueinfo": 129,
            "mknod": 133,
            "setpriority": 141,
            "sched_setparam": 142,
            "sched_setscheduler": 144,
            "pivot_root": 155,
            "setrlimit": 160,
            "chroot": 161,
            "acct": 163,
            "mount": 165,
            "umount2": 166,
            "swapon": 167,
            "swapoff": 168,
            "reboot": 169,
            "init_module": 175,
            "delete_module": 176,
            "quotactl": 179,
            "setxattr": 188,
            "lsetxattr": 189,
            "fsetxattr": 190,
            "getxattr": 191,
            "lgetxattr": 192,
            "fgetxattr": 193,
            "listxattr": 194,
            "llistxattr": 195,
            "flistxattr": 196,
            "removexattr": 197,
            "lremovexattr": 198,
            "fremovexattr": 199,
            "tkill": 200,
            "sched_setaffinity": 203,
            "semtimedop": 220,
            "tgkill": 234,
            "utimes": 235,
            "mq_open": 240,
            "mq_unlink": 241,
            "mq_timedsend": 242,
            "mq_timedreceive": 243,
            "mq_notify": 244,
            "mq_getsetattr": 245,
            "kexec_load": 246,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "ioprio_set": 251,
            "migrate_pages": 256,
            "mknodat": 259,
            "fchownat": 260,
            "futimesat": 261,
            "fchmodat": 268,
            "unshare": 272,
            "rt_tgsigqueueinfo": 297,
            "move_pages": 279,
            "utimensat": 280,
            "perf_event_open": 298,
            "fanotify_init": 300,
            "prlimit64": 302,
            "name_to_handle_at": 303,
            "open_by_handle_at": 304,
            "setns": 308,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "kcmp": 312,
            "finit_module": 313,
            "sched_setattr": 314,
            "memfd_create": 319,
            "kexec_file_load": 320,
            "bpf": 321,
            "execveat": 322,
            "userfaultfd": 323,
            **_UNIFIED_SYSCALLS,
        },
    ),
    # The generic table (asm-generic/unistd.h): no fork, vfork or mknod; processes come from clone.
    "aarch64": (
        0xC00000B7,
        {
            "setxattr": 5,
            "lsetxattr": 6,
            "fsetxattr": 7,
            "getxattr": 8,
            "lgetxattr": 9,
            "fgetxattr": 10,
            "listxattr": 11,
            "llistxattr": 12,
            "flistxattr": 13,
            "removexattr": 14,
            "lremovexattr": 15,
            "fremovexattr": 16,
            "fcntl": 25,
            "ioctl": 29,
            "ioprio_set": 30,
            "mknodat": 33,
            "umount2": 39,
            "mount": 40,
            "pivot_root": 41,
            "chroot": 51,
            "fchmodat": 53,
            "fchownat": 54,
            "quotactl": 60,
            "utimensat": 88,
            "acct": 89,
            "unshare": 97,
            "kexec_load": 104,
            "init_module": 105,
            "delete_module": 106,
            "ptrace": 117,
            "sched_setparam": 118,
            "sched_setscheduler": 119,
            "sched_setaffinity": 122,
            "kill": 129,
            "tkill": 130,
            "tgkill": 131,
            "rt_sigqueueinfo": 138,
            "reboot": 142,
            "setpriority": 140,
            "setrlimit": 164,
            "mq_open": 180,
            "mq_unlink": 181,
            "mq_timedsend": 182,
            "mq_timedreceive": 183,
            "mq_notify": 184,
            "mq_getsetattr": 185,
            "msgget": 186,
            "msgctl": 187,
            "msgrcv": 188,
            "msgsnd": 189,
            "semget": 190,
            "semctl": 191,
            "semtimedop": 192,
            "semop": 193,
            "shmget": 194,
            "shmctl": 195,
            "shmat": 196,
            "shmdt": 197,
            "socket": 198,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "clone": 220,
            "execve": 221,
            "swapon": 224,
            "swapoff": 225,
            "migrate_pages": 238,
            "move_pages": 239,
            "rt_tgsigqueueinfo": 240,
            "perf_event_open": 241,
            "prlimit64": 261,
            "fanotify_init": 262,
            "name_to_handle_at": 264,
            "open_by_handle_at": 265,
            "setns": 268,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "kcmp": 272,
            "finit_module": 273,
            "memfd_create": 279,
            "bpf": 280,
            "execveat": 281,
            "userfaultfd": 282,
            "sched_setattr": 274,
            "kexec_file_load": 294,
            **_UNIFIED_SYSCALLS,
        },
    ),
}
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x00010000
# Fail with EPERM whatever their arguments.
DENIED = (
    # Another program: the boot's own exec goes through execveat on the held descriptor (below).
    "execve",
    # Sockets; processes; other processes' memory; signals by thread id alone or through a pidfd.
    "socket",
    "fork",
    "vfork",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "process_madvise",
    "process_mrelease",
    "kcmp",
    "tkill",
    "pidfd_open",
    "pidfd_getfd",
    "pidfd_send_signal",
    "io_uring_setup",
    # Raising a limit (prlimit64 is allowed to read its own only, below).
    "setrlimit",
    # SysV IPC and POSIX message queues: objects that outlive the program, outside its memory limit, and
    # a channel between calls (or to the worker).
    "shmget",
    "shmat",
    "shmctl",
    "shmdt",
    "semget",
    "semop",
    "semctl",
    "semtimedop",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "mq_open",
    "mq_unlink",
    "mq_timedsend",
    "mq_timedreceive",
    "mq_notify",
    "mq_getsetattr",
    # Another process's memory placement.
    "migrate_pages",
    # Device nodes and fifos, anywhere.
    "mknod",
    "mknodat",
    # Modes, owners and times by path (or by an O_PATH descriptor, which Landlock lets open anything):
    # Landlock rules contents, not metadata, so these would reach files outside. By an open descriptor
    # (fchmod, fchown) they stay allowed: the descriptor was checked when it was opened.
    "chmod",
    "fchmodat",
    "fchmodat2",
    "chown",
    "lchown",
    "fchownat",
    "utime",
    "utimes",
    "futimesat",
    "utimensat",
    # Namespaces, mounts, the root directory: a way around Landlock's view of paths.
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "open_tree_attr",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "statmount",
    "listmount",
    # Opening a file by handle skips path checks; extended attributes leak and tag files.
    "name_to_handle_at",
    "open_by_handle_at",
    "setxattr",
    "lsetxattr",
    "fsetxattr",
    "getxattr",
    "lgetxattr",
    "fgetxattr",
    "listxattr",
    "llistxattr",
    "flistxattr",
    "removexattr",
    "lremovexattr",
    "fremovexattr",
    "setxattrat",
    "getxattrat",
    "listxattrat",
    "removexattrat",
    # The kernel's own interfaces: none is a program's business.
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "fanotify_init",
    "memfd_create",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "swapon",
    "swapoff",
    "reboot",
    "acct",
    "quotactl",
)
# Calls whose first argument is the process they act on (signals: its thread group id; scheduling: a
# thread id, 0 the caller): allowed on this process only, by 0 or its pid. A thread's own id is refused
# too, as the filter cannot tell the program's threads from another process.
_OWN_PROCESS = (
    "tgkill",
    "rt_sigqueueinfo",
    "rt_tgsigqueueinfo",
    "sched_setparam",
    "sched_setscheduler",
    "sched_setaffinity",
    "sched_setattr",
    "move_pages",
)
# Calls of (which, who, ...): allowed for `which` one process, `who` this one (0 or its pid).
# setpriority's PRIO_PROCESS and ioprio_set's IOPRIO_WHO_PROCESS; a group or a user is refused.
_OWN_PRIORITY = (("setpriority", 0), ("ioprio_set", 1))
_AT_EMPTY_PATH = 0x1000
# fcntl and ioctl commands that make the kernel signal a process the program names (F_SETOWN and its
# ioctl twins, with O_ASYNC: SIGIO, or any signal F_SETSIG picks, on the next write), or type into a tty.
_F_SETOWN, _F_SETSIG, _F_SETOWN_EX = 8, 10, 15
_FIOSETOWN, _SIOCSPGRP, _TIOCSTI = 0x8901, 0x8902, 0x5412


def syscall_filter(machine: str, pid: int, exec_fd: int, exec_path: int) -> list[tuple[int, int, int, int]] | None:
    """A seccomp BPF program (code, jump if true, jump if false, k): `DENIED` fail with EPERM; so do
    clone without CLONE_THREAD (a process; threads stay allowed), signals, scheduling and priorities of
    any process but this one (`_OWN_PROCESS`, `_OWN_PRIORITY`), execveat but the boot's own (below), the
    owner-signal commands of fcntl and ioctl, and prlimit64 on another process or with a new limit.
    clone3 fails with ENOSYS, which makes the C library fall back on clone, whose flags the filter can
    read. Syscalls of another ABI (i386, x32 on x86_64) fail with ENOSYS. None for a machine not listed
    in SYSCALLS.

    The one execveat allowed is `exec_held`'s: descriptor `exec_fd`, AT_EMPTY_PATH, and as its path the
    address `exec_path` (a page `exec_path_page` mapped at random). A filter cannot read the string a
    path points to, and with an absolute path the kernel ignores the descriptor: so the path's address
    is what it checks, one the program's own image never has (it was the boot's, before the exec) and
    can only guess among 2**35 pages, one refused execveat per guess."""
    if machine not in SYSCALLS:
        return None
    arch, numbers = SYSCALLS[machine]
    load, jump_equal, jump_above_or_equal, jump_set, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    nr, arch_offset = 0, 4  # offsets in struct seccomp_data

    def argument(index: int, high: bool = False) -> int:
        return 16 + 8 * index + (4 if high else 0)  # args[] are 64-bit, little-endian on both machines

    # Jumps name their targets; they are resolved into offsets once the program is laid out.
    program: list[tuple[int, int | str, int | str, int]] = [
        (load, 0, 0, arch_offset),
        (jump_equal, 0, "nosys", arch),
        (load, 0, 0, nr),
        (jump_above_or_equal, "nosys", 0, 0x40000000),  # x32 numbers on x86_64; none exist elsewhere
        *((jump_equal, "deny", 0, numbers[name]) for name in DENIED if name in numbers),
        (jump_equal, "nosys", 0, numbers["clone3"]),
        (jump_equal, "clone", 0, numbers["clone"]),
        (jump_equal, "kill", 0, numbers["kill"]),
        *((jump_equal, "own", 0, numbers[name]) for name in _OWN_PROCESS),
        *((jump_equal, f"priority_{name}", 0, numbers[name]) for name, _ in _OWN_PRIORITY),
        (jump_equal, "execveat", 0, numbers["execveat"]),
        (jump_equal, "fcntl", 0, numbers["fcntl"]),
        (jump_equal, "ioctl", 0, numbers["ioctl"]),
        (jump_equal, "prlimit", 0, numbers["prlimit64"]),
        (ret, 0, 0, 0x7FFF0000),
    ]
    labels = {"clone": len(program)}
    program += [(load, 0, 0, argument(0)), (jump_set, "allow", "deny", _CLONE_THREAD)]
    labels["kill"] = len(program)
    program += [
        (load, 0, 0, argument(0)),
        (jump_equal, "allow", 0, pid),
        (jump_equal, "allow", 0, 0),  # this process's group, which is only this process
        (jump_equal, "allow", "deny", -pid & 0xFFFFFFFF),
    ]
    labels["own"] = len(program)
    program += [(load, 0, 0, argument(0)), (jump_equal, "allow", 0, pid), (jump_equal, "allow", "deny", 0)]
    for name, which in _OWN_PRIORITY:
        labels[f"priority_{name}"] = len(program)
        program += [
            (load, 0, 0, argument(0)),
            (jump_equal, 0, "deny", which),
            (load, 0, 0, argument(1)),
            (jump_equal, "allow", 0, pid),
            (jump_equal, "allow", "deny", 0),
        ]
    labels["execveat"] = len(program)
    program += [
        (load, 0, 0, argument(0)),
        (jump_equal, 0, "deny", exec_fd),
        (load, 0, 0, argument(1)),
        (jump_equal, 0, "deny", exec_path & 0xFFFFFFFF),
        (load, 0, 0, argument(1, high=True)),
        (jump_equal, 0, "deny", exec_path >> 32),
        (load, 0, 0, argument(4)),
        (jump_equal, "allow", "deny", _AT_EMPTY_PATH),
    ]
    labels["fcntl"] = len(program)
    program += [
        (load, 0, 0, argument(1)),
        (jump_equal, "deny", 0, _F_SETOWN),
        (jump_equal, "deny", 0, _F_SETSIG),
        (jump_equal, "deny", "allow", _F_SETOWN_EX),
    ]
    labels["ioctl"] = len(program)
    program += [
        (load, 0, 0, argument(1)),
        (jump_equal, "deny", 0, _FIOSETOWN),
        (jump_equal, "deny", 0, _SIOCSPGRP),
        (jump_equal, "deny", "allow", _TIOCSTI),
    ]
    labels["prlimit"] = len(program)
    program += [
        (load, 0, 0, argument(0)),  # this process: 0 or its pid
        (jump_equal, 2, 0, 0),
        (jump_equal, 0, "deny", pid),
        (load, 0, 0, argument(2)),  # the new limit's address: NULL only reads
        (jump_equal, 0, "deny", 0),
        (load, 0, 0, argument(2, high=True)),
        (jump_equal, "allow", "deny", 0),
    ]
    labels.update(allow=len(program), deny=len(program) + 1, nosys=len(program) + 2)
    program += [(ret, 0, 0, 0x7FFF0000), (ret, 0, 0, 0x00050000 | _EPERM), (ret, 0, 0, 0x00050000 | _ENOSYS)]

    def offset(target: int | str, at: int) -> int:
        return target if isinstance(target, int) else labels[target] - at - 1

    return [(code, offset(true, at), offset(false, at), k) for at, (code, true, false, k) in enumerate(program)]


def restrict_syscalls(exec_fd: int, exec_path: int) -> bool:
    """Installs `syscall_filter` (needs no_new_privs, set before). It holds for this process and what it
    executes, whatever the program does. Returns whether it was installed: not on a machine the filter
    does not know, nor where prctl is refused."""
    program = syscall_filter(os.uname().machine, os.getpid(), exec_fd, exec_path)
    if program is None:
        return False
    import ctypes

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    instructions = (SockFilter * len(program))(*(SockFilter(*instruction) for instruction in program))
    fprog = SockFprog(len(program), instructions)
    return _libc().prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0


# --- the boot's exec ----------------------------------------------------------------------------------

_PROT_READ, _MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_FIXED_NOREPLACE = 0x1, 0x02, 0x20, 0x100000
_PAGE = 4096
_PAGE_TRIES = 64


def exec_path_page() -> int:
    """Maps a zeroed, read-only page at a random address (below 2**47, the smallest user address space of
    x86_64 and aarch64) and returns it: its first byte is the empty path of `exec_held`, and its address
    is what the seccomp filter lets execveat name. Never unmapped: the exec drops it."""
    import ctypes
    import secrets

    libc = _libc()
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE
    for _ in range(_PAGE_TRIES):  # a taken address fails (EEXIST) or, before Linux 4.17, maps elsewhere
        wanted = secrets.randbelow(2**47 // _PAGE - 2**20) * _PAGE + 2**32
        got = libc.mmap(wanted, _PAGE, _PROT_READ, flags, -1, 0)
        if got == wanted:
            return wanted
        if got not in (None, 2**64 - 1):  # mapped, but elsewhere
            libc.munmap(ctypes.c_void_p(got), ctypes.c_size_t(_PAGE))
    raise OSError(f"could not map the exec path's page at a random address in {_PAGE_TRIES} tries")


def exec_held(exec_fd: int, exec_path: int, argv: list[str], environment: dict[str, str]) -> None:
    """execveat(exec_fd, exec_path, argv, environment, AT_EMPTY_PATH): runs the interpreter held open by
    `hold_interpreter`, the one exec the seccomp filter allows. Returns only by raising."""
    import ctypes

    def strings(values: list[str]):
        array = (ctypes.c_char_p * (len(values) + 1))()
        array[:-1] = [os.fsencode(value) for value in values]
        return array

    machine = os.uname().machine
    if machine not in SYSCALLS:  # no filter on this machine: the C library's fexecve
        os.execve(exec_fd, argv, environment)
    number = SYSCALLS[machine][1]["execveat"]
    environ = strings([f"{key}={value}" for key, value in environment.items()])
    _libc().syscall(
        ctypes.c_long(number),
        ctypes.c_long(exec_fd),
        ctypes.c_void_p(exec_path),
        strings(argv),
        environ,
        ctypes.c_long(_AT_EMPTY_PATH),
    )
    _raise_errno("executing the held interpreter")
