"""Environment servers `rldock train` runs itself (`servers.command`): `replicas` processes of the
command on free ports of this machine, each waited for at `/health`, replaced when it dies, stopped
with the job.

Ports: with `{listen_fd}` in the command, rldock binds a socket to port 0 of 127.0.0.1, reads the port
back and passes the socket itself to the process (`rldock env serve --listen-fd`), keeping it for the
job, so no other process on the machine can take the port before the server listens, nor while a
replica is replaced. `{port}` gets a port found free a moment before (a server that can only bind one
itself); another process could take it in between, so rldock sends such a server nothing, not even
`/health`, until every socket listening on the port is held by the server's own session
(listeners.py): a port taken by another process fails the start naming `{listen_fd}`, and a replica
whose port was taken while it was down is not started again (the clients' episodes there end with a
counted reason, but the other process is then reached with the job's token: use `{listen_fd}`).

Each process gets a clean environment (`clean_environment`: PATH, HOME, LANG, TMPDIR, the job's token
and `servers.env`; never the trainer's other variables, its credentials among them), its own process
group and the parent-death signal, so none outlives the trainer even when it is SIGKILLed; its output
goes to `<output>/environments/<name>-<i>.log`. A replacement listens on the dead one's port, so the
URLs the rollout engines hold stay right; the episodes whose sessions were on it end as
`agent/ended/environment_error` and the others go on. The job's token (auth.job_token) is made before
the servers start and asked of every client.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from rldock.config.agent_environment import EnvironmentServersSpec
from rldock.config.job import JobConfig
from rldock.runtime.agent.service.auth import TOKEN_ENV, job_token
from rldock.runtime.agent.service.env_probe import health, replica_problems
from rldock.runtime.agent.service.listeners import held_by_session

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often the watcher looks at the processes, and startup polls /health
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long
_PR_SET_PDEATHSIG = 1
# The trainer's variables a server process gets besides PATH: where its home and temporary files are and
# its locale, none of them a credential.
PASSED_VARIABLES = ("HOME", "LANG", "LC_ALL", "TMPDIR")


class EnvironmentStartError(RuntimeError):
    """The servers did not come up: the message names the field, the command and what it printed."""


def free_port() -> int:
    """A port free now (for a `{port}` command; another process may take it before the server binds it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def bound_socket() -> socket.socket:
    """A listening socket on a free port of 127.0.0.1 (port 0, read back with getsockname)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def clean_environment(servers: EnvironmentServersSpec, token: str) -> dict[str, str]:
    """A server process's whole environment: PATH with the trainer's Python's scripts first (so `rldock` in a
    command is the trainer's own also where the venv is not activated: `.venv/bin/rldock train ...`),
    PASSED_VARIABLES where set, the job's token and `servers.env`, nothing else of the trainer's."""
    scripts = os.path.dirname(sys.executable)
    passed = {name: os.environ[name] for name in PASSED_VARIABLES if name in os.environ}
    path = os.pathsep.join([scripts, os.environ.get("PATH", os.defpath)])
    return {**passed, "PATH": path, **servers.env, TOKEN_ENV: token}


class LocalServers:
    """The processes of one `servers.command`, kept running until `stop`."""

    def __init__(self, servers: EnvironmentServersSpec, *, field: str, log_dir: Path):
        assert servers.command is not None, "LocalServers runs a servers.command"
        self.servers, self.field, self.log_dir = servers, field, log_dir
        self.token = job_token()
        passes_socket = any("{listen_fd}" in argument for argument in servers.command)
        # Held until stop: a replacement replica gets the same socket, so its port never comes free.
        self.sockets = [bound_socket() for _ in range(servers.replicas)] if passes_socket else []
        self.ports = (
            [sock.getsockname()[1] for sock in self.sockets]
            if passes_socket
            else [free_port() for _ in range(servers.replicas)]
        )
        self.processes: list[subprocess.Popen | None] = [None] * len(self.ports)
        self.restarts = 0
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def start(self) -> list[str]:
        """Start every replica and wait for all to answer `/health`; the replicas' base URLs."""
        log_dir = self.log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        for index in range(len(self.ports)):
            self._spawn(index)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._watch, name="environment-servers", daemon=True)
        self._watcher.start()
        logger.info("%s: %d server(s) up at %s", self.field, len(self.ports), ", ".join(self.urls))
        return self.urls

    def _log(self, index: int) -> Path:
        return self.log_dir / f"{self.field.replace('.', '-')}-{index}.log"

    def _spawn(self, index: int) -> None:
        port = str(self.ports[index])
        passed = (self.sockets[index].fileno(),) if self.sockets else ()
        listen_fd = str(passed[0]) if passed else ""
        command = [
            argument.replace("{port}", port).replace("{listen_fd}", listen_fd)
            for argument in self.servers.command or ()
        ]
        with open(self._log(index), "ab") as log:
            try:
                self.processes[index] = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,
                    env=clean_environment(self.servers, self.token),
                    pass_fds=passed,
                )
            except OSError as error:
                message = f"{self.field}.servers.command: cannot start {command!r}: {error}"
                raise EnvironmentStartError(message) from error

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.servers.startup_timeout_s
        waiting = dict(enumerate(self.urls))
        answers: dict[int, str] = {}
        while waiting:
            for index, base in list(waiting.items()):
                process = self.processes[index]
                assert process is not None
                if process.poll() is not None:
                    raise EnvironmentStartError(
                        f"{self.field}.servers.command: replica {index} exited with status {process.returncode} before "
                        f"answering {base}/health; its output ({self._log(index)}) ends:\n{self.tail(index)}"
                    )
                if not self.sockets:  # `{port}`: nothing is sent before the port is known to be the server's
                    held = held_by_session(self.ports[index], process.pid)
                    if held is None:
                        answers[index] = f"nothing listens on port {self.ports[index]} yet"
                        continue
                    if not held:
                        raise EnvironmentStartError(self._port_taken(index))
                problem = health(base)
                if problem is None:
                    del waiting[index]
                else:
                    answers[index] = problem
            if not waiting:
                return
            if time.monotonic() > deadline:
                index = next(iter(waiting))
                raise EnvironmentStartError(
                    f"{self.field}.servers.startup_timeout_s: {len(waiting)} of {len(self.ports)} server(s) did not "
                    f"answer /health within {self.servers.startup_timeout_s:g} s; {self.urls[index]} last answered "
                    f"{answers.get(index)}; its output ({self._log(index)}) ends:\n{self.tail(index)}"
                )
            time.sleep(POLL_S)

    def _port_taken(self, index: int) -> str:
        return (
            f"{self.field}.servers.command: port {self.ports[index]} of replica {index} is listened on by a process "
            "that is not the server's (another process took it after rldock found it free); nothing was sent to it. "
            "Pass the port as {listen_fd} instead of {port} (`rldock env serve --listen-fd {listen_fd}`): rldock then "
            "holds the bound socket for the job"
        )

    def tail(self, index: int, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self._log(index).read_text(errors="replace").splitlines()[-lines:])
        return "(no output)"

    def _watch(self) -> None:
        """Replace a replica that died, on its port, until `stop`."""
        while not self._stopping.wait(POLL_S):
            for index, process in enumerate(self.processes):
                if process is None or process.poll() is None or self._stopping.is_set():
                    continue
                if not self.sockets and held_by_session(self.ports[index], process.pid) is False:
                    # Taken while the replica was down: starting it again would fail to bind, and the
                    # rollouts' clients already reach the other process (logged, as they cannot be stopped).
                    logger.error("%s; replica %d is not started again", self._port_taken(index), index)
                    self.processes[index] = None
                    continue
                logger.warning(
                    "%s: replica %d (%s) exited with status %s; starting it again",
                    self.field,
                    index,
                    self.urls[index],
                    process.returncode,
                )
                self.restarts += 1
                try:
                    self._spawn(index)
                except EnvironmentStartError as error:  # the next look tries again
                    logger.warning("%s", error)

    def stop(self) -> None:
        """Stop every replica's process group: SIGTERM, SIGKILL after STOP_GRACE_S."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
        running = [p for p in self.processes if p is not None and p.poll() is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in running:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for sock in self.sockets:
            sock.close()


class JobEnvironmentServers:
    """Every `servers.command` of a job's agent section (agent.environment, agent.sandbox with the python
    tool), started together and asked the preflight's questions (env_probe.py); `urls` by config field."""

    def __init__(self, cfg: JobConfig, *, log_dir: Path):
        # field -> servers, the action field they take
        self.groups: dict[str, tuple[LocalServers, str]] = {
            field: (LocalServers(servers, field=field, log_dir=log_dir), action_field)
            for field, (servers, action_field) in command_servers(cfg).items()
        }

    def start(self) -> dict[str, list[str]]:
        """Start every group, wait for /health, check /schema; the base URLs by field. Stops what it
        started before raising EnvironmentStartError."""
        urls: dict[str, list[str]] = {}
        try:
            for field, (group, action_field) in self.groups.items():
                urls[field] = group.start()
                found = replica_problems(urls[field], action_field=action_field)
                if found is not None:
                    kind, problem = found
                    at = f"{field}.action_field" if kind == "action_field" else f"{field}.servers.command"
                    raise EnvironmentStartError(f"{at}: {problem}")
        except BaseException:
            self.stop()
            raise
        return urls

    def stop(self) -> None:
        for group, _ in self.groups.values():
            group.stop()


def command_servers(cfg: JobConfig) -> dict[str, tuple[EnvironmentServersSpec, str]]:
    """The job's `servers.command` sections by config field, with the action field their servers take."""
    agent = cfg.agent
    found: dict[str, tuple[EnvironmentServersSpec, str]] = {}
    if agent is None:
        return found
    environment = agent.environment
    if environment is not None and environment.servers is not None and environment.servers.command is not None:
        found["agent.environment"] = (environment.servers, environment.action_field)
    sandbox = agent.sandbox.servers
    if sandbox is not None and sandbox.command is not None and any(tool.name == "python" for tool in agent.tools):
        found["agent.sandbox"] = (sandbox, "message")
    return found


def token_variables(cfg: JobConfig) -> dict[str, str]:
    """RLDOCK_ENV_TOKEN for the job's Ray workers, whose clients send it: the job's token where it starts
    servers itself (made now, before Ray starts its workers), else the one this process was given, if any."""
    if command_servers(cfg):
        return {TOKEN_ENV: job_token()}
    return {TOKEN_ENV: os.environ[TOKEN_ENV]} if TOKEN_ENV in os.environ else {}
