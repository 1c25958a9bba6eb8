"""The episode runner of an RLJob's agent pods (`spec.agents`): leases the job's episodes from its
gateway and runs the user's command once per episode, as `agent.harness_command` runs on the Ray pods.

Standard library only, one file: the operator mounts it from a ConfigMap into the user's image, which
needs `python3` and nothing of rldock's (docs/agentic.md, Agents as pods). Run as

    python3 agent_runner.py [--episodes N] -- COMMAND [ARG...]

with `RLDOCK_GATEWAY` (`host:port`; the host may resolve to several addresses, one per Ray pod) and
`RLDOCK_ENV_TOKEN` (the job's pod token) in its environment. The protocol, over HTTP/1.1 with
`Authorization: Bearer <token>` and JSON bodies:

    POST /episodes/lease               -> 200 {"episode", "lease", "path", "api_key", "task", "timeout_s"}
                                          204: none now (Retry-After: seconds)
    POST /episodes/<id>/heartbeat      -> 200 while the lease holds; 410: the episode ended (stop it)
    POST /episodes/<id>/result         {"exit_code", "output"} -> 200

the last two with the lease's secret in `X-Rldock-Lease` (another pod's runner cannot post for it).

Each episode's command gets the runner's environment plus `OPENAI_BASE_URL` (`http://<the address it
leased from><path>`), `OPENAI_API_KEY` and `RLDOCK_TASK` (the data row as JSON); its stdout and stderr
end in `output` (the last 2,000 characters; only the tail is kept while it runs), whose last line is its
reward (a number, or a JSON object with `reward`): the pods' channel, where `agent.harness_command` on the
Ray pods writes a result file instead. Its process group is killed when it exits or runs past `timeout_s`, so
nothing it left in the background outlives its episode or holds the runner; a lease whose heartbeats stop
(the pod died) is ended by the gateway.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

GATEWAY_ENV = "RLDOCK_GATEWAY"
TOKEN_ENV = "RLDOCK_ENV_TOKEN"
HEARTBEAT_S = 2.0  # the gateway ends a lease after several missed heartbeats
OUTPUT_TAIL_CHARS = 2000
OUTPUT_KEPT_BYTES = 64 << 10  # what is kept of a command's output while it runs: its tail
PIPE_DRAIN_S = 5.0  # after the command's group was killed, how long its output pipe may stay open
LEASE_HEADER = "X-Rldock-Lease"
REQUEST_TIMEOUT_S = 10.0
MAX_IDLE_S = 5.0  # the longest wait between lease attempts


class Gateway:
    """The job's gateway addresses (one per Ray pod), asked in turn."""

    def __init__(self, target: str, token: str):
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit():
            raise SystemExit(f"{GATEWAY_ENV}={target!r} is not host:port")
        self.host, self.port, self.token = host, int(port), token
        self._turn = 0
        self._lock = threading.Lock()

    def addresses(self) -> list[str]:
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            return []  # no Ray pod ready yet
        found = sorted({str(info[4][0]) for info in infos})
        return [f"[{a}]:{self.port}" if ":" in a else f"{a}:{self.port}" for a in found]

    def next_address(self) -> str | None:
        addresses = self.addresses()
        if not addresses:
            return None
        with self._lock:
            self._turn += 1
            return addresses[self._turn % len(addresses)]

    def post(self, address: str, path: str, body: dict, lease: str = "") -> tuple[int, dict, dict]:
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        if lease:
            headers[LEASE_HEADER] = lease
        request = urllib.request.Request(
            f"http://{address}{path}", data=json.dumps(body).encode(), method="POST", headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                text = response.read().decode() or "{}"
                return response.status, dict(response.headers), json.loads(text) if response.status == 200 else {}
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers or {}), {}


def run_episode(gateway: Gateway, address: str, lease: dict, command: list[str], stopping: threading.Event) -> None:
    episode, secret = lease["episode"], str(lease.get("lease", ""))
    env = dict(os.environ)
    env.pop(TOKEN_ENV, None)  # the pod token leases episodes; a harness has the episode's key
    env.update(
        OPENAI_BASE_URL=f"http://{address}{lease['path']}",
        OPENAI_API_KEY=lease["api_key"],
        RLDOCK_TASK=json.dumps(lease["task"], ensure_ascii=False),
    )
    try:
        process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as error:  # not found, not executable, a task too long for the environment: its result
        with contextlib.suppress(OSError):
            gateway.post(address, f"/episodes/{episode}/result", {"exit_code": 127, "output": str(error)}, secret)
        return
    kept = bytearray()
    stdout = process.stdout
    assert stdout is not None

    def read() -> None:
        for chunk in iter(lambda: stdout.read(4096), b""):
            kept.extend(chunk)
            del kept[: max(0, len(kept) - OUTPUT_KEPT_BYTES)]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + float(lease["timeout_s"])
    ended = False
    while process.poll() is None:
        try:
            process.wait(HEARTBEAT_S)
            break
        except subprocess.TimeoutExpired:
            pass
        try:
            status, _, _ = gateway.post(address, f"/episodes/{episode}/heartbeat", {}, secret)
        except OSError:  # the Ray pod is unreachable for now: the deadline still holds
            status = 0
        if status == 410 or time.monotonic() > deadline or stopping.is_set():
            ended = status == 410
            _kill(process)
            break
    _kill(process)  # exited: what it left running in its group goes with it (and lets go of the pipe)
    process.wait()
    reader.join(PIPE_DRAIN_S)  # only a process that left the group (setsid) still holds the pipe: not waited for
    if ended:
        return  # the gateway already counted it
    output = bytes(kept).decode(errors="replace")[-OUTPUT_TAIL_CHARS:]
    result = {"exit_code": process.returncode, "output": output}
    with contextlib.suppress(OSError):  # the gateway went: its lease ends there without this result
        gateway.post(address, f"/episodes/{episode}/result", result, secret)


def _kill(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def worker(gateway: Gateway, command: list[str], stopping: threading.Event, refusals: list[str]) -> None:
    idle = 0.2
    while not stopping.is_set():
        address = gateway.next_address()
        lease: dict | None = None
        if address is not None:
            try:
                status, headers, lease = gateway.post(address, "/episodes/lease", {"runner": socket.gethostname()})
            except OSError:  # a Ray pod not serving (yet, or any more)
                status, headers = 0, {}
            if status == 200 and lease:
                idle = 0.2
                run_episode(gateway, address, lease, command, stopping)
                continue
            if status == 401:
                refusals.append(f"the gateway at {address} refused the token in {TOKEN_ENV}")
                stopping.set()
                return
            retry = headers.get("Retry-After")
            if retry is not None and retry.replace(".", "", 1).isdigit():
                idle = float(retry)
        stopping.wait(idle)
        idle = min(idle * 2, MAX_IDLE_S)


PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4  # prctl(2)


def undumpable() -> bool:
    """Make this process non-dumpable (prctl PR_SET_DUMPABLE 0): its /proc files (its environ, which holds
    the pod token) and its memory become root's, so a command the runner starts under the same uid, or
    another pod's runner, cannot read the token and lease this pod's episodes. Each command is dumpable
    again once it execs (the kernel resets the flag), and is given no pod token (`run_episode`). Linux only:
    elsewhere, or where prctl cannot be called, nothing changes. True when the process is non-dumpable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0 and libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=1, help="episodes run at once")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...], run once per episode")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: give it after --")
    for name in (GATEWAY_ENV, TOKEN_ENV):
        if not os.environ.get(name):
            parser.error(f"{name} is not set")
    gateway = Gateway(os.environ[GATEWAY_ENV], os.environ[TOKEN_ENV])
    undumpable()  # before any command runs: none can read the token from this process
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    refusals: list[str] = []  # why a worker stopped the runner
    threads = [
        threading.Thread(target=worker, args=(gateway, command, stopping, refusals), daemon=True)
        for _ in range(args.episodes)
    ]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        for thread in threads:
            thread.join(0.5)
    for refusal in refusals[:1]:
        print(f"agent_runner: {refusal}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
