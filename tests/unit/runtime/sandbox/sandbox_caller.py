"""TEST ONLY: the python tool's caller for the attack corpus (test_sandbox_attacks.py), in a process of its
own, so that an attack that kills its caller fails its test instead of killing pytest.

Reads one JSON request a line on stdin ({"code", "tempdir", "limits"}), runs the program through the
sandbox, and writes one JSON line: outcome, exit_code, text, layers, `left` (processes of the program's
session still there after the call), `programs` (the pids it started) and `scratch_left` (what remains in
tempdir, where the scratch directory was made).

Usage: python sandbox_caller.py namespaces|restricted hook|kernel-only [LAYER,...]
  namespaces   as this machine runs the sandbox (root: unshare allowed).
  restricted   as a pod under the `restricted` Pod Security Standard: no_new_privs, every capability
               dropped (bounding, effective, permitted, inheritable and ambient sets), and a seccomp
               filter that refuses unshare, setns, mounts and clone with namespace flags with EPERM, as
               the RuntimeDefault profile does for a process without CAP_SYS_ADMIN.
  kernel-only  the program runs without the audit hook: what a program that got past it meets.
  LAYER,...    kernel layers not applied (landlock, seccomp), as on a machine without them; the limits
               allow Landlock missing (agent.sandbox.allow_missing_layers), as a config must; none can
               allow seccomp missing.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import sys
import tempfile
from pathlib import Path

_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_NAMESPACE_FLAGS = 0x00020000 | 0x10000000 | 0x40000000 | 0x20000000 | 0x08000000 | 0x04000000 | 0x02000000


def _as_a_restricted_pod() -> None:
    from rldock.runtime.sandbox import kernel

    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    for capability in range(64):
        libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0)  # EINVAL past the kernel's last capability
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    assert libc.capset(ctypes.byref(Header(0x20080522, 0)), ctypes.byref((Data * 2)())) == 0
    _, numbers = kernel.SYSCALLS[os.uname().machine]
    load, jump_equal, jump_set, ret = 0x20, 0x15, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050001, 0x00050026
    refused = [numbers[name] for name in ("unshare", "setns", "mount", "umount2", "pivot_root", "fsopen", "open_tree")]
    program = [(load, 0, 0, 0)]
    for number in refused:
        program.append((jump_equal, 0, 1, number))
        program.append((ret, 0, 0, eperm))
    program += [
        (jump_equal, 0, 1, numbers["clone3"]),
        (ret, 0, 0, enosys),
        (jump_equal, 0, 3, numbers["clone"]),
        (load, 0, 0, 16),
        (jump_set, 0, 1, _NAMESPACE_FLAGS),
        (ret, 0, 0, eperm),
        (ret, 0, 0, allow),
    ]

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    instructions = (SockFilter * len(program))(*(SockFilter(*instruction) for instruction in program))
    assert (
        libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(SockFprog(len(program), instructions)), 0, 0)
        == 0
    )


def _session_members(session: int) -> list[str]:
    """Processes (pid and state) whose session is `session`: what the program left behind."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[3]) == session or int(entry.name) == session:
            members.append(f"{entry.name} {fields[0]}")
    return members


def main() -> None:
    mode, hook = sys.argv[1], sys.argv[2]
    skip = tuple(layer for layer in (sys.argv[3] if len(sys.argv) > 3 else "").split(",") if layer)
    if mode == "restricted":
        _as_a_restricted_pod()
    from rldock.config.agent import SandboxSpec
    from rldock.runtime.sandbox.runner import _required, _run_program

    started: list[int] = []
    real_exec = asyncio.create_subprocess_exec

    async def recording_exec(*argv, **options):
        process = await real_exec(*argv, **options)
        started.append(process.pid)
        return process

    asyncio.create_subprocess_exec = recording_exec  # type: ignore[assignment]
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        tempfile.tempdir = request["tempdir"]
        started.clear()
        # Without seccomp the boot refuses whatever the config says: no config can allow it.
        limits = SandboxSpec(**request["limits"], allow_missing_layers=[layer for layer in skip if layer != "seccomp"])
        run = _run_program(request["code"], limits, audit_hook=hook == "hook", required=_required(limits), skip=skip)
        result = asyncio.run(run)
        answer = {
            "outcome": result.outcome.value,
            "exit_code": result.exit_code,
            "text": result.text,
            "layers": {
                "namespaces": result.layers.namespaces,
                "landlock": result.layers.landlock,
                "seccomp": result.layers.seccomp,
            },
            "left": [member for pid in started for member in _session_members(pid)],
            "programs": list(started),
            "scratch_left": sorted(os.listdir(request["tempdir"])),
        }
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
