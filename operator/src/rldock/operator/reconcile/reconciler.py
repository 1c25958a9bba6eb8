"""The reconciler: one round of one RLJob (the package's docstring), in ordered small steps: its children
(children.py, pod_set_children.py), what it sees of the cluster (observing.py), the facts classified once
(rules.classify), the status (status.py) and the actions (actions.py, done by acting.py)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from rldock.operator.actions import next_actions
from rldock.operator.builders import RLJobRef
from rldock.operator.constants import ANNOTATION_SPEC_HASH, EventReason, Phase
from rldock.operator.desired import DesiredCache
from rldock.operator.facts import ACTIVE_JOB_STATES, RoundFacts, scheduling_labels
from rldock.operator.kube import Kube
from rldock.operator.metrics import Metrics
from rldock.operator.observe import Ownership, admitted, dashboard_url, owned_by, ownership, ready_to_submit
from rldock.operator.rayjobs import RayJobsClient, RayJobsError
from rldock.operator.reconcile.acting import apply
from rldock.operator.reconcile.children import Children
from rldock.operator.reconcile.observing import Observer
from rldock.operator.reconcile.pod_set_children import PodSets
from rldock.operator.reconcile.round import (
    BlockedRound,
    JobsClientFactory,
    Outcome,
    Round,
    SkipRound,
    begin_round,
    looked_rule,
    managed_elsewhere,
)
from rldock.operator.reconcile.writing import write_status
from rldock.operator.rules import Rule, classify
from rldock.operator.settings import OperatorSettings
from rldock.operator.status import (
    Event,
    compute_status,
    seconds_until_expiry,
    status_events,
)
from rldock.operator.tokens import job_token

log = logging.getLogger(__name__)


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        settings: OperatorSettings,
        *,
        jobs_client: JobsClientFactory | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
        metrics: Metrics | None = None,
        draw_token: Callable[[], str] = lambda: secrets.token_urlsafe(32),
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics  # the operator's Prometheus metrics (metrics.py); None: not counted
        # `ray_timeout` is each Jobs API request's total deadline; the client caps what it reads.
        self._jobs_client = jobs_client or (
            lambda url, token: RayJobsClient(url, token=token, timeout=settings.ray_timeout, metrics=metrics)
        )
        self._clock = clock
        self.desired = DesiredCache(settings)  # each RLJob's spec generation worked out once
        self.children = Children(kube, settings, draw_token=draw_token)
        self.pod_sets = PodSets(kube, settings, self.children)
        self.observer = Observer(kube, settings, self.children, jobs_client=self._jobs_client)

    # --- the round ---------------------------------------------------------------------------
    def reconcile(self, body: Mapping[str, Any]) -> Outcome:
        out = Outcome()
        if managed_elsewhere(body):
            # Its spec is not even parsed (it may be another release's): the facts say only that.
            ref = RLJobRef.from_body(body)
            rule = classify(RoundFacts(name=ref.name, now=self._clock(), managed_elsewhere=True))
            assert rule is Rule.MANAGED_ELSEWHERE
            return out
        rnd = begin_round(body, self._clock(), self.desired.of(body))
        rule = classify(rnd.facts)
        try:
            if rule is None:  # no rule of the spec holds: look at the cluster
                self._run(rnd, out)
            else:
                self._settle(rnd, out, rule)
        except SkipRound as why:
            log.info("%s/%s: nothing decided this round: %s", rnd.ref.namespace, rnd.ref.name, why)
            out.status = None
        if out.status is not None:
            out.events += status_events(rnd.raw_status, out.status)
        return out

    def _settle(self, rnd: Round, out: Outcome, rule: Rule) -> None:
        """FINISHED, or REFUSED (an invalid spec, or one the admin's policy refuses): nothing of it
        may run; the checkpoint stays (for when a refused spec is fixed). A finished RLJob goes after
        its TTL."""
        self._forget(rnd.ref)
        if rule is Rule.FINISHED:
            assert rnd.previous.phase is not None  # FINISHED holds only for a terminal phase (facts.finished)
            why = f"the RLJob {rnd.previous.phase.value.lower()}"
        else:
            why = "the spec is invalid" if rnd.problems else "the cluster's policy refuses the spec"
        self._release(rnd, out, why=why)
        pod_sets = self.pod_sets.release(rnd)
        out.status = compute_status(
            replace(rnd.facts, environments=pod_sets.environments, agents=pod_sets.agents), rule
        )
        if rule is not Rule.FINISHED or rnd.spec is None:
            return
        remaining = seconds_until_expiry(spec=rnd.spec, status=rnd.raw_status, now=rnd.now)
        if remaining is not None and remaining <= 0:
            out.event(
                "Normal",
                EventReason.TTL_EXPIRED,
                f"ttlSecondsAfterFinished ({rnd.spec.ttl_seconds_after_finished} s) passed; deleting the RLJob",
            )
            self.kube.delete("RLJob", rnd.ref.namespace, rnd.ref.name, uid=rnd.ref.uid)

    def _forget(self, ref: RLJobRef) -> None:
        """Drop what this process remembers of an RLJob that stopped running."""
        self.observer.logs.forget(ref)
        self.children.forget(ref.uid)
        self.pod_sets.forget(ref.uid)

    def _run(self, rnd: Round, out: Outcome) -> None:
        try:
            self._advance(rnd, out)
        except BlockedRound as why:
            log.warning("%s/%s: %s", rnd.ref.namespace, rnd.ref.name, why)
            facts = replace(rnd.facts, looked=True, blocked=why.blocked)
            out.status = compute_status(facts, looked_rule(facts))

    def _advance(self, rnd: Round, out: Outcome) -> None:
        spec = rnd.spec
        assert spec is not None, "a spec without problems parsed"
        token = self._token(rnd.ref)
        for child in self.children.ordered(rnd, spec, token):
            self.children.ensure(rnd, child, out)
        desired = rnd.desired.ray_cluster()
        cluster = self.children.read_owned(rnd, "RayCluster", rnd.cluster_name)
        seen = self.observer.observe(rnd, spec, cluster, token)
        # The environments' and agents' pods only while the job is admitted: none while it waits in a queue.
        pod_sets = self.pod_sets.ensure(rnd, spec, out, admitted=admitted(spec, cluster, seen.summary))
        facts = replace(
            rnd.facts,
            looked=True,
            cluster=cluster,
            desired_spec_hash=desired["metadata"]["annotations"][ANNOTATION_SPEC_HASH],
            desired_scheduling_labels=scheduling_labels(desired),
            ray_job=seen.job,
            previous_attempt=seen.previous_attempt,
            ready_to_submit=cluster is not None
            and ready_to_submit(cluster, seen.summary, num_workers=spec.job.resources.num_nodes),
            metrics=seen.progress.metrics,
            last_checkpoint=seen.progress.last_checkpoint,
            # the pool's pods too: the condition names them, though they hold back no submission
            unschedulable=(*seen.summary.unschedulable, *seen.summary.pool_unschedulable),
            lost_pods=seen.lost,
            head_terminating=seen.summary.head_terminating,
            workers_terminating=seen.workers_terminating,
            environments=pod_sets.environments,
            agents=pod_sets.agents,
        )
        rule = looked_rule(facts)
        status = compute_status(facts, rule)
        for action in next_actions(facts, rule):
            apply(
                self.kube,
                self.settings,
                action,
                rnd,
                spec,
                desired=desired,
                cluster=cluster,
                seen=seen,
                status=status,
                out=out,
            )
        if Phase(status["phase"]).is_terminal:
            # As the cluster is released; the next round (woken by the Deployments' change) reports it.
            self.pod_sets.release(rnd)
        out.status = status

    def _token(self, ref: RLJobRef) -> str:
        if self.settings.token_key is None:
            raise ValueError("the operator has no token key (RLDOCK_TOKEN_KEY, settings.token_key)")
        return job_token(self.settings.token_key, ref)

    def _release(self, rnd: Round, out: Outcome, *, why: str) -> None:
        """Delete the RayCluster (the job on its head goes with it); idempotent."""
        cluster = self.kube.get("RayCluster", rnd.ref.namespace, rnd.cluster_name)
        if cluster is None or ownership(cluster, uid=rnd.ref.uid, rljob_name=rnd.ref.name) is not Ownership.OURS:
            return
        if cluster["metadata"].get("deletionTimestamp"):
            return
        if self.kube.delete("RayCluster", rnd.ref.namespace, rnd.cluster_name, uid=cluster["metadata"]["uid"]):
            out.event("Normal", EventReason.RELEASED_RAY_CLUSTER, f"deleted RayCluster {rnd.cluster_name}: {why}")

    # --- writing the status ----------------------------------------------------------------------
    def write_status(self, body: Mapping[str, Any], new: Mapping[str, Any]) -> list[Event]:
        """Patch the status subresource to `new`; the Events the write itself calls for (writing.py)."""
        return write_status(self.kube, body, new, now=self._clock())

    # --- deletion ----------------------------------------------------------------------------
    def stop_for_deletion(self, body: Mapping[str, Any]) -> str | None:
        """Stop the current attempt's driver before the RLJob (and, by owner references, its
        cluster) goes. Best effort: a cluster that cannot be reached is deleted with its job anyway."""
        rnd = begin_round(body, self._clock(), self.desired.of(body))
        self._forget(rnd.ref)
        self.desired.forget(rnd.ref.uid)
        if managed_elsewhere(body):
            return None
        cluster = self.kube.get("RayCluster", rnd.ref.namespace, rnd.cluster_name)
        if cluster is None or not owned_by(cluster, rnd.ref.uid):
            return None
        url = dashboard_url(
            mode=self.settings.dashboard_address,
            rljob_name=rnd.ref.name,
            namespace=rnd.ref.namespace,
            cluster_status=cluster.get("status"),
        )
        if url is None:
            return None
        jobs = self._jobs_client(url, self._token(rnd.ref))
        submission_id = rnd.submission_id(rnd.facts.attempt)
        try:
            details = jobs.get_job(submission_id)
            if details is not None and details.get("status") in {s.value for s in ACTIVE_JOB_STATES}:
                jobs.stop_job(submission_id)
                return submission_id
        except RayJobsError as error:
            log.warning(
                "%s/%s: could not stop Ray job %s (%s); deleting its cluster ends it anyway",
                rnd.ref.namespace,
                rnd.ref.name,
                submission_id,
                error,
            )
        return None
