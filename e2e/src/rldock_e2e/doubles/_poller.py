"""A background thread that runs a function every `interval` seconds until stopped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Poller:
    def __init__(self, name: str, step: Callable[[], None], *, interval: float) -> None:
        self._name, self._step, self._interval = name, step, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[BaseException] = []

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception as error:  # a test double must keep going; the test sees .errors
                log.warning("%s: %s: %s", self._name, type(error).__name__, error)
                self.errors.append(error)
            self._stop.wait(self._interval)
