"""The controller host's local socket (local_socket.py) without Ray: a server on an event loop in a
thread, answering the calls it was given, and clients calling it as the route does."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from rldock.runtime.dock import DockActorDiedError, DockTimeoutError, local_socket
from rldock.runtime.dock.rpc import Peer

HOST = Peer("dock controller host (test)", None)


class Served:
    """An event loop in a thread serving `calls` at a socket in a private directory, as the host does."""

    def __init__(self, directory: Path) -> None:
        directory.chmod(0o700)
        self.path = str(directory / local_socket.SOCKET_NAME)
        self.released = asyncio.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        calls = {"echo": self.echo, "fail": self.fail, "wait": self.wait}
        self.server = self.run(local_socket.serve(self.path, calls))

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=10)

    async def echo(self, *args, **kwargs):
        return args, kwargs

    async def fail(self, message):
        raise ValueError(message)

    async def wait(self):
        await self.released.wait()
        return "released"

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.released.set)

    def stop(self) -> None:
        async def close():
            self.server.close()
            handlers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in handlers:  # the connections' coroutines, as a host's end with its process
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

        self.run(close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    server = Served(tmp_path)
    yield server
    server.stop()


def test_a_call_returns_what_the_host_answered_with_arrays_and_keywords(served: Served) -> None:
    host = local_socket.LocalHost(served.path, HOST)
    args, kwargs = host.call("echo", np.arange(5), "x", read_here=[0])
    assert np.array_equal(args[0], np.arange(5)) and args[1] == "x" and kwargs == {"read_here": [0]}


def test_only_the_owner_can_connect(served: Served) -> None:
    mode = os.stat(served.path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(os.stat(Path(served.path).parent).st_mode) == 0o700


def test_a_call_outside_the_list_is_refused_and_the_connection_stays_usable(served: Served) -> None:
    host = local_socket.LocalHost(served.path, HOST)
    with pytest.raises(ValueError, match="no local call 'stop'"):
        host.call("stop")
    with pytest.raises(ValueError, match="a caller's mistake"):
        host.call("fail", "a caller's mistake")  # raised as itself, as through Ray
    assert host.call("echo", 1) == ((1,), {})


def test_each_thread_has_its_own_connection_and_a_waiting_call_holds_only_its_own(served: Served) -> None:
    host = local_socket.LocalHost(served.path, HOST)
    with ThreadPoolExecutor(max_workers=2) as pool:
        waiting = pool.submit(host.call, "wait")
        assert pool.submit(host.call, "echo", 2).result(timeout=10) == ((2,), {})  # not queued behind it
        assert not waiting.done()
        served.release()
        assert waiting.result(timeout=10) == "released"


def test_an_unanswered_call_times_out_and_the_next_call_starts_over(served: Served) -> None:
    host = local_socket.LocalHost(served.path, HOST)
    with pytest.raises(DockTimeoutError, match="did not answer within 0.2s"):
        host.call("wait", timeout=0.2)
    assert host.call("echo", 3) == ((3,), {})  # a new connection: the late reply cannot be mistaken for this one


# A host in a process of its own, killed as a dead actor's would be: its connections close with it.
HOST_PROCESS = """
import asyncio, sys
from rldock.runtime.dock import local_socket

async def main():
    never = asyncio.Event()
    async def echo(*args, **kwargs):
        return args, kwargs
    async def wait():
        print("waiting", flush=True)
        await never.wait()
    await local_socket.serve(sys.argv[1], {"echo": echo, "wait": wait})
    print("serving", flush=True)
    await never.wait()

asyncio.run(main())
"""


def test_a_host_that_died_fails_waiting_and_new_calls_naming_it(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    path = str(tmp_path / local_socket.SOCKET_NAME)
    process = subprocess.Popen([sys.executable, "-c", HOST_PROCESS, path], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "serving"
        host = local_socket.LocalHost(path, HOST)
        assert host.call("echo") == ((), {})
        with ThreadPoolExecutor(max_workers=1) as pool:
            waiting = pool.submit(host.call, "wait")
            assert process.stdout.readline().strip() == "waiting"  # the call is in the host, unanswered
            process.kill()
            process.wait(timeout=10)
            with pytest.raises(DockActorDiedError, match=r"dock controller host \(test\) is dead"):
                waiting.result(timeout=10)
        with pytest.raises(DockActorDiedError, match=r"dock controller host \(test\) is dead"):
            host.call("echo")  # the socket file is left behind, nobody answers it
    finally:
        process.kill()
        process.wait(timeout=10)
