"""Leader election on a coordination.k8s.io/v1 Lease, so that of several operator replicas one
reconciles and the others stand by.

The protocol is the one kube-controller-manager and client-go's leaderelection use, written for
this synchronous operator:

- every replica reads the Lease `<lease name>` in its own namespace (POD_NAMESPACE) every
  `retry_period`; it takes the Lease when it is absent, released (no holder), its own (a restarted
  container of the same pod: the identity is the pod name), or when its record (holder, renewTime)
  has not changed for `lease_duration` as measured on this replica's own monotonic clock since it
  saw the record change. Clocks of different machines are never compared.
- every write is a replace conditioned on the resourceVersion read, so of two replicas taking an
  expired Lease at once exactly one succeeds (the other gets 409 Conflict and stays standby).
- the leader renews every `retry_period`. Each renewal's requests may last only until
  `renew_deadline` after the last successful renewal; when that passes without one, the leader has
  lost the Lease and must stop reconciling at once: the operator exits (__main__), and the kubelet
  restarts it as a standby, as kube-controller-manager does. Because renew_deadline <
  lease_duration, the old leader has stopped before any standby can see the Lease expire.
- a graceful stop (SIGTERM, after kopf has stopped) releases the Lease: holder cleared, so a
  standby takes it at its next read, within `retry_period`.

Figures (LeaseTimings, the chart's leaderElection values): lease 15 s, renew deadline 10 s, retry
2 s. After a SIGKILL of the leader (no release), a standby takes over at most lease_duration +
2 x retry_period = 19 s after the leader's last renewal, plus kopf's start-up: within 30 s.

RBAC (lease_rules): create Leases in the operator's namespace, get and update the one named Lease.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

log = logging.getLogger(__name__)

LEASE_API_GROUP = "coordination.k8s.io"
# Of client-go's leaderelection: a retry waits retry_period to retry_period * (1 + JITTER).
JITTER = 0.2


@dataclass(frozen=True)
class LeaseTimings:
    lease_duration: float = 15.0  # how long a standby waits, after the record last changed, to take over
    renew_deadline: float = 10.0  # how long the leader keeps trying to renew before it gives up
    retry_period: float = 2.0  # between two reads (standby) or renewals (leader)

    def __post_init__(self) -> None:
        if not self.retry_period > 0:
            raise ValueError(f"the retry period must be positive, got {self.retry_period}")
        if not self.renew_deadline > self.retry_period * (1 + JITTER):
            raise ValueError(
                f"the renew deadline ({self.renew_deadline} s) must exceed the retry period with "
                f"its jitter ({self.retry_period * (1 + JITTER):g} s)"
            )
        if not self.lease_duration > self.renew_deadline:
            raise ValueError(
                f"the lease duration ({self.lease_duration} s) must exceed the renew deadline "
                f"({self.renew_deadline} s), so a leader stops before a standby takes over"
            )


def lease_rules(lease_name: str) -> list[dict[str, Any]]:
    """The RBAC rules leader election needs in the operator's namespace: `create` (which cannot
    be narrowed to a name) and `get`/`update` of the one Lease."""
    return [
        {"apiGroups": [LEASE_API_GROUP], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": [LEASE_API_GROUP],
            "resources": ["leases"],
            "resourceNames": [lease_name],
            "verbs": ["get", "update"],
        },
    ]


class LeaseError(Exception):
    """A Lease call failed: `status` is the API server's HTTP status (409: another replica wrote
    first), None when there was no answer."""

    def __init__(self, status: int | None, reason: str) -> None:
        super().__init__(f"{status} {reason}" if status else reason)
        self.status = status


class LeaseApi:
    """The three Lease calls, on plain dicts (so MicroTime values are written as the API server
    expects them), each with a total timeout in seconds; failures are LeaseError. A fake of it
    drives the unit tests. The Kubernetes client is imported here, not by the module, which
    settings.py imports for LeaseTimings."""

    def __init__(self, api: Any) -> None:
        from kubernetes import client

        self._coordination = client.CoordinationV1Api(api)

    def read(self, namespace: str, name: str, *, timeout: float) -> dict[str, Any] | None:
        try:
            return self._call(self._coordination.read_namespaced_lease, name, namespace, timeout=timeout)
        except LeaseError as error:
            if error.status == 404:
                return None
            raise

    def create(self, namespace: str, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        return self._call(self._coordination.create_namespaced_lease, namespace, body, timeout=timeout)

    def replace(self, namespace: str, name: str, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        return self._call(self._coordination.replace_namespaced_lease, name, namespace, body, timeout=timeout)

    @staticmethod
    def _call(method: Callable[..., Any], *args: Any, timeout: float) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            response = method(*args, _preload_content=False, _request_timeout=timeout)
        except ApiException as error:
            raise LeaseError(error.status, str(error.reason)) from None
        except (HTTPError, OSError) as error:  # no answer: refused, reset, timed out
            raise LeaseError(None, str(error) or type(error).__name__) from None
        return json.loads(response.data)


def micro_time(moment: datetime) -> str:
    """A MicroTime as the API server writes it: RFC 3339 with exactly six fraction digits."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """One replica's side of the election: `acquire` blocks until it leads, `keep_leading` renews
    in a thread and calls `on_lost` when it cannot, `release` hands the Lease back."""

    def __init__(
        self,
        api: Any,
        *,
        namespace: str,
        name: str,
        identity: str,
        timings: LeaseTimings = LeaseTimings(),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
        sleep: Callable[[float], Any] = time.sleep,
        on_change: Callable[[bool], None] = lambda leading: None,
    ) -> None:
        if not identity:
            raise ValueError("leader election needs an identity (the pod name, POD_NAME)")
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.timings = timings
        self._clock, self._wall_clock, self._sleep = clock, wall_clock, sleep
        self._on_change = on_change
        self._observed: tuple[Any, ...] | None = None  # (holder, renewTime, resourceVersion) last seen
        self._observed_at = 0.0  # clock() when `_observed` last changed
        self._last_renewal = 0.0  # clock() of this replica's last successful write as leader
        self._leading = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def leading(self) -> bool:
        return self._leading

    # --- standby --------------------------------------------------------------------------------
    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Block until this replica holds the Lease (True), or `stop` is set (False)."""
        stop = stop or threading.Event()
        log.info("leader election: %s waits for Lease %s/%s", self.identity, self.namespace, self.name)
        while not stop.is_set():
            if self.try_acquire_or_renew():
                log.info("leader election: %s leads (Lease %s/%s)", self.identity, self.namespace, self.name)
                return True
            self._sleep(self._jittered())
        return False

    # --- leader ---------------------------------------------------------------------------------
    def keep_leading(self, on_lost: Callable[[], None]) -> None:
        """Renew every retry period in a daemon thread; `on_lost()` once renewing failed for the
        renew deadline (or another replica holds the Lease), after which the thread ends."""
        assert self._leading, "keep_leading() after acquire()"

        def renew() -> None:
            while not self._stop.wait(self._until_next_renewal()):
                if self.try_acquire_or_renew():
                    continue
                if not self._leading:  # another holder, or the renew deadline passed
                    log.error("leader election: %s lost Lease %s/%s", self.identity, self.namespace, self.name)
                    on_lost()
                    return

        self._renewer = threading.Thread(target=renew, name="rldock-lease-renewal", daemon=True)
        self._renewer.start()

    def release(self) -> None:
        """Stop renewing and clear the holder, so a standby takes over at its next read."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=self.timings.renew_deadline)
        if not self._leading:
            return
        self._set_leading(False)
        try:
            lease = self.api.read(self.namespace, self.name, timeout=self.timings.retry_period)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            now = micro_time(self._wall_clock())
            lease["spec"].update(holderIdentity=None, leaseDurationSeconds=1, renewTime=now, acquireTime=now)
            self.api.replace(self.namespace, self.name, lease, timeout=self.timings.retry_period)
            log.info("leader election: %s released Lease %s/%s", self.identity, self.namespace, self.name)
        except LeaseError as error:  # it expires by itself then
            log.warning(
                "leader election: could not release Lease %s/%s (%s); it expires in %g s",
                self.namespace,
                self.name,
                error,
                self.timings.lease_duration,
            )

    # --- one attempt ----------------------------------------------------------------------------
    def try_acquire_or_renew(self) -> bool:
        """One read and, when this replica may hold the Lease, one conditional write. True while
        this replica leads; as leader, False only after the renew deadline or when another
        replica holds the Lease (then `leading` turns False)."""
        try:
            return self._attempt()
        except LeaseError as error:
            log.warning("leader election: Lease %s/%s: %s", self.namespace, self.name, error)
            return self._still_leading()

    def _attempt(self) -> bool:
        timeout = self._request_timeout()
        if timeout is None:
            return self._still_leading()
        now = self._wall_clock()
        lease = self.api.read(self.namespace, self.name, timeout=timeout)
        if lease is None:
            body = {
                "apiVersion": f"{LEASE_API_GROUP}/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(now, acquired=micro_time(now), transitions=0),
            }
            return self._write(lambda t: self.api.create(self.namespace, body, timeout=t))
        spec = lease.get("spec") or {}
        self._observe(spec, lease["metadata"].get("resourceVersion"))
        holder = spec.get("holderIdentity")
        if holder and holder != self.identity:
            if self._leading:  # someone took it while this replica could not renew
                self._set_leading(False)
                return False
            duration = float(spec.get("leaseDurationSeconds") or self.timings.lease_duration)
            if self._clock() < self._observed_at + duration:
                return False  # held, and renewed within its duration as far as this replica saw
            log.info("leader election: Lease %s/%s of %s expired; taking it", self.namespace, self.name, holder)
        ours = holder == self.identity
        lease["spec"] = self._spec(
            now,
            acquired=spec.get("acquireTime") if ours else micro_time(now),
            transitions=int(spec.get("leaseTransitions") or 0) + (0 if ours else 1),
        )
        return self._write(lambda t: self.api.replace(self.namespace, self.name, lease, timeout=t))

    def _write(self, call: Callable[[float], dict[str, Any]]) -> bool:
        timeout = self._request_timeout()
        if timeout is None:
            return self._still_leading()
        try:
            written = call(timeout)
        except LeaseError as error:
            if error.status != 409:  # 409: another replica wrote first
                raise
            log.info("leader election: Lease %s/%s changed meanwhile", self.namespace, self.name)
            return self._still_leading()
        self._observe(written.get("spec") or {}, written["metadata"].get("resourceVersion"))
        self._last_renewal = self._clock()
        self._set_leading(True)
        return True

    def _observe(self, spec: dict[str, Any], resource_version: str | None) -> None:
        record = (spec.get("holderIdentity"), spec.get("renewTime"), resource_version)
        if record != self._observed:
            self._observed, self._observed_at = record, self._clock()

    def _spec(self, now: datetime, *, acquired: str | None, transitions: int) -> dict[str, Any]:
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(round(self.timings.lease_duration)),
            "acquireTime": acquired,
            "renewTime": micro_time(now),
            "leaseTransitions": transitions,
        }

    def _request_timeout(self) -> float | None:
        """Seconds a request may take: as leader, only until the renew deadline (None once it
        passed, so no call outlives it); as standby, one retry period."""
        if not self._leading:
            return self.timings.retry_period
        left = self._last_renewal + self.timings.renew_deadline - self._clock()
        return left if left > 0 else None

    def _until_next_renewal(self) -> float:
        """A retry period, but never past the renew deadline, so a lost Lease is noticed then."""
        left = self._last_renewal + self.timings.renew_deadline - self._clock()
        return max(0.0, min(self.timings.retry_period, left))

    def _still_leading(self) -> bool:
        if self._leading and self._clock() >= self._last_renewal + self.timings.renew_deadline:
            self._set_leading(False)
        return self._leading

    def _set_leading(self, leading: bool) -> None:
        if leading != self._leading:
            self._leading = leading
            self._on_change(leading)

    def _jittered(self) -> float:
        return self.timings.retry_period * (1 + JITTER * random.random())
