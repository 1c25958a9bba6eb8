"""One reconcile round of one RLJob: ordered small steps, run by the RLJob's daemon (handlers.py)
whenever it or one of its children changes, and at the poll interval while its Ray job runs.

A round gathers one record of its facts (facts.py), classifies it once (rules.classify) and derives
its status (status.py) and actions (actions.py) from the rule that decided. The rules of the spec
are decided before the round touches the cluster:

    MANAGED_ELSEWHERE (spec.managedBy)  leave it alone: no status, no children
    FINISHED (Succeeded/Failed)         release the RayCluster; delete the RLJob after its TTL
    REFUSED (invalid spec, or outside   release the RayCluster; status Failed naming the fields
    the admin's policy)                 (reason InvalidSpec or PolicyDenied)
    any other                           ensure the Secrets, ConfigMap, NetworkPolicy -> read the
                                        RayCluster -> observe pods and the Ray job -> ensure the
                                        environments (spec.environments) -> classify the facts ->
                                        the status (status.py) and actions (actions.py) -> act

The environments' Deployments run while the job is admitted (observe.admitted): 0 pods until its
RayCluster exists unsuspended (Kueue admitted it) and, under a Volcano gang, its head is bound to a
node; scaled to 0 while it is suspended, once it finished and while its spec is refused; an entry
that left the spec is deleted with its Service and NetworkPolicy.

Every round starts from what the cluster says (status, children, Jobs API), never from memory, so
a restarted operator carries on where the last one stopped: children are found by name and owner,
the Ray job by its deterministic submission id. Only the spec's consequences (its parse, the
policy's verdict, the children built from it) are kept between rounds, per spec generation
(desired.py). A lookup that fails ends the round without a
decision (SkipRound); the next round, one poll interval later, tries again.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, NamedTuple

from rldock.config import Problem
from rldock.operator import naming
from rldock.operator.actions import (
    Action,
    CountRestart,
    CreateCluster,
    DeleteCluster,
    StopJob,
    SubmitJob,
    SuspendCluster,
    next_actions,
)
from rldock.operator.api import RLJobSpec, RLJobStatus
from rldock.operator.builders import (
    RLJobRef,
    build_auth_secret,
    build_job_submission,
    build_network_policy,
    device_resource,
    output_dir,
)
from rldock.operator.builders.agents import config_map_patch
from rldock.operator.builders.common import put_back
from rldock.operator.builders.pod_sets import (
    ENVIRONMENTS,
    POD_SET_KINDS,
    PodSetEntry,
    PodSetKind,
    deployment_patch,
    network_policy_patch,
    service_patch,
    with_replicas,
)
from rldock.operator.builders.secret import build_environment_token_secret
from rldock.operator.constants import (
    ANNOTATION_SPEC_HASH,
    ANNOTATION_SUSPENDED_BY,
    JOB_METADATA_WORKER_PODS,
    LABEL_RAY_CLUSTER,
    LABEL_RLJOB,
    MANAGED_BY_RLDOCK,
    EventReason,
    Phase,
    RayJobStatus,
    Reason,
)
from rldock.operator.desired import Desired, DesiredCache
from rldock.operator.facts import (
    ACTIVE_JOB_STATES,
    Blocked,
    PodSetObservation,
    RayJobObservation,
    RoundFacts,
    Suspension,
    scheduling_labels,
    suspension,
)
from rldock.operator.kube import CreateRefused, Kube, StatusRejected
from rldock.operator.metrics import Metrics
from rldock.operator.observe import (
    Ownership,
    PodSummary,
    Progress,
    admitted,
    attempt_workers,
    dashboard_url,
    job_observation,
    lost_workers,
    owned_by,
    ownership,
    pod_set_observation,
    progress_of,
    ready_to_submit,
    ready_worker_names,
    summarize_pods,
)
from rldock.operator.progress_cursor import ProgressCursor
from rldock.operator.rayjobs import RayJobsClient, RayJobsError, TokenRefused
from rldock.operator.rules import Rule, classify
from rldock.operator.settings import OperatorSettings
from rldock.operator.status import (
    Event,
    compute_status,
    parse_status,
    rejected_status,
    seconds_until_expiry,
    status_events,
    status_patch,
)
from rldock.operator.tokens import job_token

log = logging.getLogger(__name__)

JobsClientFactory = Callable[[str, str | None], RayJobsClient]


class PodSetsSeen(NamedTuple):
    """What the environments' and the agents' Deployments report, each in spec order; None for a section
    the job has and had no entries of."""

    environments: list[PodSetObservation] | None
    agents: list[PodSetObservation] | None


class SkipRound(Exception):
    """Something could not be read (or is going away): decide nothing this round."""


class BlockedRound(Exception):
    """A child cannot be had until a person acts: say so in the status (status.Blocked)."""

    def __init__(self, blocked: Blocked) -> None:
        super().__init__(blocked.message)
        self.blocked = blocked


PatchOf = Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any] | None]


@dataclass(frozen=True)
class Child:
    """One child of the round's ordered list (Reconciler._children), ensured by `_ensure`."""

    manifest: dict[str, Any]
    # The patch that puts a stored one back (None while it matches); CREATE_ONLY: created once per
    # process and never read back, since the operator's role may only create it (the Secrets).
    patch_of: PatchOf
    created: EventReason  # the Event of its creation, saying `created <kind> <name>` + `message`
    message: str


def _create_only(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any] | None:
    raise AssertionError("a create-only child is never read back")


CREATE_ONLY: PatchOf = _create_only


@dataclass
class Outcome:
    """What a round wants written: the full new status (None: leave it) and Events to post."""

    status: dict[str, Any] | None = None
    events: list[Event] = field(default_factory=list)

    def event(self, type_: str, reason: EventReason, message: str) -> None:
        self.events.append(Event(type_, reason, message))


@dataclass(frozen=True)
class Round:
    ref: RLJobRef
    desired: Desired  # the spec's generation worked out (desired.py): parsed, checked, its children
    raw_status: dict[str, Any]
    facts: RoundFacts  # what the RLJob says; the round adds what it reads of the cluster

    @property
    def spec(self) -> RLJobSpec | None:
        return self.facts.spec

    @property
    def problems(self) -> list[Problem]:
        return self.desired.problems

    @property
    def previous(self) -> RLJobStatus:
        return self.facts.previous

    @property
    def now(self) -> datetime:
        return self.facts.now

    @property
    def cluster_name(self) -> str:
        return naming.ray_cluster_name(self.ref.name)

    def submission_id(self, attempt: int) -> str:
        return naming.ray_job_submission_id(self.ref.name, self.ref.uid, attempt=attempt)


@dataclass(frozen=True)
class Seen:
    """What observing the cluster's pods and its Jobs API found."""

    summary: PodSummary = PodSummary()
    job: RayJobObservation | None = None
    progress: Progress = Progress()
    lost: tuple[str, ...] = ()
    previous_attempt: RayJobObservation | None = None
    jobs: RayJobsClient | None = None  # set when the head is up


def begin_round(body: Mapping[str, Any], now: datetime, desired: Desired) -> Round:
    raw_status = dict(body.get("status") or {})
    facts = RoundFacts(
        name=desired.ref.name,
        now=now,
        spec=desired.spec,
        problems=desired.problems,
        denied=desired.denied,
        previous=parse_status(raw_status),
        generation=body["metadata"].get("generation"),
    )
    return Round(ref=desired.ref, desired=desired, raw_status=raw_status, facts=facts)


def managed_elsewhere(body: Mapping[str, Any]) -> bool:
    """spec.managedBy names another controller (Kueue's convention, e.g. MultiKueue's dispatcher)."""
    manager = (body.get("spec") or {}).get("managedBy")
    return manager is not None and manager != MANAGED_BY_RLDOCK


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
        self._logs = ProgressCursor()  # how far each running job's driver log was parsed
        self._made: set[tuple[str, str]] = set()  # (RLJob uid, name) of create-only children made or found
        self._service_accounts_made: set[str] = set()  # uids of RLJobs whose environments' ServiceAccount ...
        self._draw_token = draw_token
        self.desired = DesiredCache(settings)  # each RLJob's spec generation worked out once

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
        pod_sets = self._release_pod_sets(rnd)
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
        self._logs.forget(ref)
        self._made = {made for made in self._made if made[0] != ref.uid}
        self._service_accounts_made.discard(ref.uid)

    def _run(self, rnd: Round, out: Outcome) -> None:
        try:
            self._advance(rnd, out)
        except BlockedRound as why:
            log.warning("%s/%s: %s", rnd.ref.namespace, rnd.ref.name, why)
            facts = replace(rnd.facts, looked=True, blocked=why.blocked)
            out.status = compute_status(facts, _looked_rule(facts))

    def _advance(self, rnd: Round, out: Outcome) -> None:
        spec = rnd.spec
        assert spec is not None, "a spec without problems parsed"
        token = self._token(rnd.ref)
        for child in self._children(rnd, spec, token):
            self._ensure(rnd, child, out)
        desired = rnd.desired.ray_cluster()
        cluster = self._read_owned(rnd, "RayCluster", rnd.cluster_name)
        seen = self._observe(rnd, spec, cluster, token)
        # The environments' and agents' pods only while the job is admitted: none while it waits in a queue.
        pod_sets = self._ensure_pod_sets(rnd, spec, out, admitted=admitted(spec, cluster, seen.summary))
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
            unschedulable=seen.summary.unschedulable,
            lost_pods=seen.lost,
            head_terminating=seen.summary.head_terminating,
            environments=pod_sets.environments,
            agents=pod_sets.agents,
        )
        rule = _looked_rule(facts)
        status = compute_status(facts, rule)
        for action in next_actions(facts, rule):
            self._apply(action, rnd, spec, desired=desired, cluster=cluster, seen=seen, status=status, out=out)
        if Phase(status["phase"]).is_terminal:
            # As the cluster is released; the next round (woken by the Deployments' change) reports it.
            self._release_pod_sets(rnd)
        out.status = status

    # --- children ----------------------------------------------------------------------------
    def _read_owned(self, rnd: Round, kind: str, name: str) -> dict[str, Any] | None:
        """The child `name` when this RLJob controls it; BlockedRound when anyone else or nobody
        does (an object of that name made by hand, by another RLJob, or by one of the same name still
        going away): it is reported, never adopted, since taking it over would hand this job's
        traffic, pods or token to whoever made it (naming.py); SkipRound while it is being deleted."""
        obj = self.kube.get(kind, rnd.ref.namespace, name)
        if obj is None:
            return None
        if obj["metadata"].get("deletionTimestamp"):
            raise SkipRound(f"{kind} {name} is being deleted; waiting for it to go")
        if ownership(obj, uid=rnd.ref.uid, rljob_name=rnd.ref.name) is not Ownership.OURS:
            raise BlockedRound(
                Blocked(
                    Reason.NAME_CONFLICT,
                    (
                        f"{kind} {name} already exists and belongs to {_controller(obj)}, not to this RLJob; "
                        "it is left alone and not adopted. If it belonged to a deleted RLJob of the same name it "
                        f"goes away with it; otherwise delete or rename that {kind}, or give this RLJob another name"
                    ),
                )
            )
        return obj

    def _children(self, rnd: Round, spec: RLJobSpec, token: str) -> list[Child]:
        """The children made before the RayCluster, in the order they are made: what the Ray pods (and
        the environments' pods) read or are guarded by exists before any of them runs. The Secrets
        are created once and never read back (the operator's role holds only `create` on Secrets): an
        existing one is taken as made, its name hashing the RLJob's uid (naming.py), so no earlier
        RLJob of the same name left it."""
        ref, children = rnd.ref, []
        if (ref.uid, naming.auth_secret_name(ref.name, ref.uid)) not in self._made:
            children.append(
                Child(
                    build_auth_secret(job=ref, token=token),
                    CREATE_ONLY,
                    EventReason.CREATED_AUTH_SECRET,
                    " with the Ray auth token",
                )
            )
        if spec.has_pod_sets and (ref.uid, naming.environment_token_secret_name(ref.name, ref.uid)) not in self._made:
            # The token both sides' pods read: a random one, drawn when the Secret is made.
            children.append(
                Child(
                    build_environment_token_secret(job=rnd.ref, token=self._draw_token()),
                    CREATE_ONLY,
                    EventReason.CREATED_ENVIRONMENT_TOKEN,
                    " with the token the environments' servers ask for",
                )
            )
        # spec.job changed: the running attempt keeps the config it started with; the next attempt
        # (retry, unsuspend) reads the patched one.
        children.append(
            Child(rnd.desired.config_map(), put_back("data"), EventReason.CREATED_CONFIG_MAP, " with the job config")
        )
        if self.settings.network_policy:
            children.append(
                Child(
                    build_network_policy(
                        job=rnd.ref,
                        operator_namespace=self.settings.operator_namespace,
                        operator_pod_labels=dict(self.settings.operator_pod_labels),
                        agents=bool(spec.agents),
                    ),
                    put_back("spec"),
                    EventReason.CREATED_NETWORK_POLICY,
                    ": the Ray pods accept connections only from the job's own pods and, on the Jobs API port, "
                    "from the operator",
                )
            )
        return children

    def _ensure(self, rnd: Round, child: Child, out: Outcome) -> None:
        """Create `child`, with its Event, or put a stored one back where it differs."""
        kind, name = child.manifest["kind"], child.manifest["metadata"]["name"]
        if child.patch_of is CREATE_ONLY:
            created = _create(self.kube, child.manifest) is not None
            self._made.add((rnd.ref.uid, name))
        else:
            _, created = self._ensure_child(rnd, child.manifest, child.patch_of)
        if created:
            out.event("Normal", child.created, f"created {kind} {name}{child.message}")

    def _token(self, ref: RLJobRef) -> str:
        if self.settings.token_key is None:
            raise ValueError("the operator has no token key (RLDOCK_TOKEN_KEY, settings.token_key)")
        return job_token(self.settings.token_key, ref)

    def _ensure_pod_sets(self, rnd: Round, spec: RLJobSpec, out: Outcome, *, admitted: bool) -> PodSetsSeen:
        """The environments' and the agents' children (the one child reconciler of both pod sets): what
        each section's Deployments report."""
        return PodSetsSeen(
            **{kind.section: self._ensure_pod_set(rnd, spec, kind, out, admitted=admitted) for kind in POD_SET_KINDS}
        )

    def _ensure_pod_set(
        self, rnd: Round, spec: RLJobSpec, kind: PodSetKind, out: Outcome, *, admitted: bool
    ) -> list[PodSetObservation] | None:
        """Each entry of spec.<kind.section>'s children (builders/environments.py, builders/agents.py):
        the ServiceAccount and the kind's shared children first, then per entry its NetworkPolicy, any
        Service and its Deployment, created, or patched where they differ from the spec; the Deployments
        at 0 pods until the job is `admitted`; entries that left the spec deleted. What their Deployments
        report, in spec order; None for a job that has and had no entries of the kind."""
        entries = kind.entries(spec)
        if not entries and not getattr(rnd.previous, kind.section):
            return None
        if entries:
            if rnd.ref.uid not in self._service_accounts_made:
                # Made and found once per process, as the Secrets: never patched, so never read again.
                self._ensure_child(rnd, rnd.desired.pod_service_account(), _never_patched)
                self._service_accounts_made.add(rnd.ref.uid)
            for shared in rnd.desired.pod_set_shared(kind):
                self._ensure_child(rnd, shared, _PATCHES[shared["kind"]])
        seen = []
        for entry in entries:
            deployment: dict[str, Any] = {}
            created, asked = False, 0
            for child in rnd.desired.pod_set(kind, entry):
                if child["kind"] == "NetworkPolicy" and not self.settings.network_policy:
                    continue
                if child["kind"] == "Deployment":
                    asked = child["spec"]["replicas"]
                    scaled = child if admitted else with_replicas(child, 0)
                    deployment, created = self._ensure_child(rnd, scaled, deployment_patch)
                else:
                    self._ensure_child(rnd, child, _PATCHES[child["kind"]])
            if created:
                message = _created_message(kind, entry, deployment, wanted=asked, settings=self.settings)
                out.event("Normal", kind.created, message + ("" if admitted else ", started once the job is admitted"))
            seen.append(pod_set_observation(entry.name, deployment))
        wanted = {entry.name for entry in entries}
        for deployment in self._pod_set_deployments(rnd, kind):
            name = deployment["metadata"]["labels"][kind.entry_label]
            if name not in wanted:
                self._delete_pod_set_entry(rnd, kind, deployment, out, why=f"is no longer in spec.{kind.section}")
            elif deployment["metadata"]["name"] != kind.child_name(rnd.ref.name, name):
                # An older operator's children (`<rljob>-env-<entry>`, before names ended in a hash): their
                # pods would run on beside the new ones, with the old (open) egress.
                self._delete_pod_set_entry(rnd, kind, deployment, out, why="has children of another name now")
        return seen

    def _ensure_child(
        self,
        rnd: Round,
        desired: dict[str, Any],
        patch_of: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any] | None],
    ) -> tuple[dict[str, Any], bool]:
        """The child `desired` as stored after creating it, or patching it with `patch_of(existing,
        desired)` when that returns a patch; whether it was created now."""
        kind, name = desired["kind"], desired["metadata"]["name"]
        existing = self._read_owned(rnd, kind, name)
        if existing is None:
            created = _create(self.kube, desired)
            if created is None:
                raise SkipRound(f"{kind} {name} appeared meanwhile")
            return created, True
        patch = patch_of(existing, desired)
        if patch:
            log.info("%s/%s: %s %s differs from the spec; put back", rnd.ref.namespace, rnd.ref.name, kind, name)
            existing = self.kube.patch(kind, rnd.ref.namespace, name, patch)
        return existing, False

    def _pod_set_deployments(self, rnd: Round, kind: PodSetKind) -> list[dict[str, Any]]:
        """The Deployments of `kind` this RLJob controls, not being deleted, by name."""
        listed = self.kube.list_deployments(rnd.ref.namespace, {LABEL_RLJOB: naming.label_value(rnd.ref.name)})
        return sorted(
            (
                deployment
                for deployment in listed
                if kind.entry_label in (deployment["metadata"].get("labels") or {})
                and ownership(deployment, uid=rnd.ref.uid, rljob_name=rnd.ref.name) is Ownership.OURS
                and not deployment["metadata"].get("deletionTimestamp")
            ),
            key=lambda deployment: deployment["metadata"]["name"],
        )

    def _release_pod_sets(self, rnd: Round) -> PodSetsSeen:
        """Scale every environment and agent of the RLJob to 0 (finished, or its spec refused); what their
        Deployments report, by section; None for a section the job has and had no entries of."""
        released: dict[str, list[PodSetObservation] | None] = {}
        for kind in POD_SET_KINDS:
            if not (rnd.spec is not None and kind.entries(rnd.spec)) and not getattr(rnd.previous, kind.section):
                released[kind.section] = None
                continue
            seen = []
            for deployment in self._pod_set_deployments(rnd, kind):
                if deployment["spec"].get("replicas"):
                    name = deployment["metadata"]["name"]
                    deployment = self.kube.patch("Deployment", rnd.ref.namespace, name, {"spec": {"replicas": 0}})
                seen.append(pod_set_observation(deployment["metadata"]["labels"][kind.entry_label], deployment))
            if rnd.spec is not None:  # in spec order, as the running job reports them
                order = {entry.name: index for index, entry in enumerate(kind.entries(rnd.spec))}
                seen.sort(key=lambda observed: order.get(observed.name, len(order)))
            released[kind.section] = seen
        return PodSetsSeen(**released)

    def _delete_pod_set_entry(
        self, rnd: Round, kind: PodSetKind, deployment: Mapping[str, Any], out: Outcome, *, why: str
    ) -> None:
        """The children of an entry that left the spec (or of an older name): its Deployment last, since
        that is what the next round finds them by."""
        name, entry = deployment["metadata"]["name"], deployment["metadata"]["labels"][kind.entry_label]
        for child_kind in ("NetworkPolicy", "Service"):
            child = self.kube.get(child_kind, rnd.ref.namespace, name)
            if child is not None and ownership(child, uid=rnd.ref.uid, rljob_name=rnd.ref.name) is Ownership.OURS:
                self.kube.delete(child_kind, rnd.ref.namespace, name, uid=child["metadata"]["uid"])
        if self.kube.delete("Deployment", rnd.ref.namespace, name, uid=deployment["metadata"]["uid"]):
            children = "Deployment, Service and NetworkPolicy" if kind is ENVIRONMENTS else "Deployment, NetworkPolicy"
            out.event("Normal", kind.deleted, f"deleted {children} {name}: {kind.role} {entry!r} {why}")

    def _release(self, rnd: Round, out: Outcome, *, why: str) -> None:
        """Delete the RayCluster (the job on its head goes with it); idempotent."""
        cluster = self.kube.get("RayCluster", rnd.ref.namespace, rnd.cluster_name)
        if cluster is None or ownership(cluster, uid=rnd.ref.uid, rljob_name=rnd.ref.name) is not Ownership.OURS:
            return
        if cluster["metadata"].get("deletionTimestamp"):
            return
        if self.kube.delete("RayCluster", rnd.ref.namespace, rnd.cluster_name, uid=cluster["metadata"]["uid"]):
            out.event("Normal", EventReason.RELEASED_RAY_CLUSTER, f"deleted RayCluster {rnd.cluster_name}: {why}")

    # --- observing ---------------------------------------------------------------------------
    def _observe(self, rnd: Round, spec: RLJobSpec, cluster: Mapping[str, Any] | None, token: str) -> Seen:
        attempt = rnd.previous.restart_count
        submission_id = rnd.submission_id(attempt)
        if cluster is None:
            return Seen(job=job_observation(submission_id, None, previous=rnd.previous))
        listed = self.kube.list_pods(rnd.ref.namespace, {LABEL_RAY_CLUSTER: rnd.cluster_name})
        uid = cluster["metadata"]["uid"]
        summary = replace(
            summarize_pods([pod for pod in listed if owned_by(pod, uid)]),
            earlier_head_terminating=summarize_pods([p for p in listed if not owned_by(p, uid)]).head_terminating,
        )
        url = dashboard_url(
            mode=self.settings.dashboard_address,
            rljob_name=rnd.ref.name,
            namespace=rnd.ref.namespace,
            cluster_status=cluster.get("status"),
        )
        details, progress, previous_attempt, jobs, log_text = None, Progress(), None, None, ""
        if suspension(cluster) is not Suspension.NONE:
            # Suspended (by the RLJob or by Kueue or an admin): the Ray job stopped with the cluster,
            # which is no failure of the attempt; it is submitted again on the resumed cluster.
            return Seen(summary=summary)
        if summary.head_running and url is not None:
            jobs = self._jobs_client(url, token)
            try:
                details = jobs.get_job(submission_id)
                if details is not None and details.get("status") != RayJobStatus.PENDING.value:
                    log_text = jobs.get_logs(submission_id)
                    record = self._logs.last_record(rnd.ref, submission_id, log_text)
                    progress = progress_of(record, output_dir=output_dir(job=rnd.ref, spec=spec))
                if details is None and attempt > 0:
                    previous_id = rnd.submission_id(attempt - 1)
                    previous_attempt = _observation(previous_id, jobs.get_job(previous_id))
            except TokenRefused as error:
                secret = naming.auth_secret_name(rnd.ref.name, rnd.ref.uid)
                self._made.discard((rnd.ref.uid, secret))  # made again once someone deletes it
                raise BlockedRound(
                    Blocked(
                        Reason.TOKEN_REFUSED,
                        (
                            f"the Ray head refused the token the operator derives for this RLJob ({error}): Secret "
                            f"{secret} holds another one (it existed before the RLJob, or was made under an earlier "
                            f"token key). Delete Secret {secret}, then suspend and resume the RLJob"
                        ),
                    )
                ) from None
            except RayJobsError as error:
                raise SkipRound(str(error)) from None
        head_lost = details is None and rnd.previous.phase is Phase.RUNNING and rnd.previous.ray_job_id == submission_id
        if (
            head_lost
            and suspension(self.kube.get("RayCluster", rnd.ref.namespace, rnd.cluster_name)) is not Suspension.NONE
        ):
            # The head went because the cluster was suspended after this round read it (Kueue
            # preempting it): read again, so that the suspend is not taken for a lost head.
            raise SkipRound(f"RayCluster {rnd.cluster_name} was suspended during the round")
        try:
            # Only a failed job's log is searched for the failure line (a few rounds at most).
            job = job_observation(
                submission_id,
                details,
                previous=rnd.previous,
                log_text=log_text if (details or {}).get("status") == RayJobStatus.FAILED.value else "",
            )
        except ValueError as error:  # a job state this operator does not know
            raise SkipRound(f"Ray job {submission_id}: {error}") from None
        lost: list[str] = []
        if job is not None and job.status is RayJobStatus.RUNNING:
            lost = lost_workers(
                summary, num_workers=spec.job.resources.num_nodes, attempt_workers=attempt_workers(details)
            )
        return Seen(
            summary=summary, job=job, progress=progress, lost=tuple(lost), previous_attempt=previous_attempt, jobs=jobs
        )

    # --- acting ------------------------------------------------------------------------------
    def _apply(
        self,
        action: Action,
        rnd: Round,
        spec: RLJobSpec,
        *,
        desired: Mapping[str, Any],
        cluster: Mapping[str, Any] | None,
        seen: Seen,
        status: dict[str, Any],
        out: Outcome,
    ) -> None:
        ns, name = rnd.ref.namespace, rnd.cluster_name
        if isinstance(action, CreateCluster):
            if _create(self.kube, desired) is not None:
                resources = spec.job.resources
                devices = device_resource(spec, self.settings.pod_defaults)
                each = f"{resources.devices_per_node} {devices} each" if devices else "no device (resources.device cpu)"
                out.event(
                    "Normal",
                    EventReason.CREATED_RAY_CLUSTER,
                    f"created RayCluster {name}: a head and {resources.num_nodes} worker(s) with {each}",
                )
        elif isinstance(action, DeleteCluster):
            assert cluster is not None
            if self.kube.delete("RayCluster", ns, name, uid=cluster["metadata"]["uid"]):
                reason = EventReason.REPLACED_RAY_CLUSTER if action.replace else EventReason.RELEASED_RAY_CLUSTER
                out.event("Normal", reason, f"deleted RayCluster {name}: {action.why}")
        elif isinstance(action, SuspendCluster):
            # The annotation marks the suspend as this operator's, the only kind it undoes (actions.py).
            self.kube.patch(
                "RayCluster",
                ns,
                name,
                {
                    "metadata": {
                        "annotations": {ANNOTATION_SUSPENDED_BY: MANAGED_BY_RLDOCK if action.suspend else None}
                    },
                    "spec": {"suspend": action.suspend},
                },
            )
        elif isinstance(action, CountRestart):
            status["restartCount"] = rnd.previous.restart_count + 1
        elif isinstance(action, (SubmitJob, StopJob)):
            assert seen.jobs is not None, "jobs are only submitted or stopped on a running head"
            self._apply_job(action, rnd, spec, seen, status, out)
        else:  # pragma: no cover - next_actions() returns only the types above
            raise TypeError(f"unknown action {action!r}")

    def _apply_job(
        self, action: SubmitJob | StopJob, rnd: Round, spec: RLJobSpec, seen: Seen, status: dict[str, Any], out: Outcome
    ) -> None:
        jobs = seen.jobs
        assert jobs is not None
        try:
            if isinstance(action, SubmitJob):
                request = build_job_submission(job=rnd.ref, spec=spec, attempt=action.attempt)
                request["metadata"][JOB_METADATA_WORKER_PODS] = ",".join(ready_worker_names(seen.summary))
                # The SubmittedRayJob Event comes from status_events when rayJobId changes, so a
                # request that timed out but took effect is still announced once the job is seen.
                status["rayJobId"] = jobs.submit_job(request)
            elif jobs.stop_job(action.submission_id):
                out.event(
                    "Normal", EventReason.STOPPED_RAY_JOB, f"stopped Ray job {action.submission_id}: {action.why}"
                )
        except RayJobsError as error:  # the next round sees the job's state and decides again
            log.warning("%s/%s: %s failed: %s", rnd.ref.namespace, rnd.ref.name, action, error)

    # --- writing the status --------------------------------------------------------------------
    def write_status(self, body: Mapping[str, Any], new: Mapping[str, Any]) -> list[Event]:
        """Patch the status subresource to `new`; the Events the write itself calls for.

        The operator writes the status itself rather than through kopf's patch: a status the API
        server refuses (too large, or not matching an older CRD) would otherwise fail after every
        round, and the RLJob would show nothing. A refused status is replaced by a short one whose
        SpecValid condition says why, so the RLJob shows the problem instead of hanging.
        """
        ref = RLJobRef.from_body(body)
        old = dict(body.get("status") or {})
        try:
            self.kube.patch_rljob_status(ref.namespace, ref.name, status_patch(old, new))
            return []
        except StatusRejected as error:
            message = f"the API server refused the RLJob's status ({error}); shorten the spec's values"
            log.warning("%s/%s: %s", ref.namespace, ref.name, message)
        fallback = rejected_status(
            previous=old, message=message, generation=body["metadata"].get("generation"), now=self._clock()
        )
        try:
            self.kube.patch_rljob_status(ref.namespace, ref.name, status_patch(old, fallback))
        except StatusRejected as error:  # e.g. an older CRD without these reasons: nothing to write
            log.error(
                "%s/%s: the short status was refused too (%s); install the CRD of this operator's release",
                ref.namespace,
                ref.name,
                error,
            )
            return []
        return status_events(old, fallback)

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
        submission_id = rnd.submission_id(rnd.previous.restart_count)
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


def _looked_rule(facts: RoundFacts) -> Rule:
    """The rule of facts that include the cluster's (classify decides on them)."""
    rule = classify(facts)
    assert rule is not None, "facts that were looked at decide"
    return rule


def _create(kube: Kube, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """Kube.create, with a refusal (quota, RBAC, invalid) turned into a blocked round."""
    try:
        return kube.create(manifest)
    except CreateRefused as refused:
        raise BlockedRound(
            Blocked(
                Reason.CREATE_REFUSED,
                (
                    f"the API server refused to create {refused.kind} {refused.name} (HTTP {refused.status}): "
                    f"{refused.message}"
                ),
            )
        ) from None


def _never_patched(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> None:
    """A child made once and left as made (the environments' ServiceAccount): the operator holds no
    `patch` on it."""
    return None


# How each kind of pod set child is put back when it differs from what was built.
_PATCHES: dict[str, Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any] | None]] = {
    "NetworkPolicy": network_policy_patch,
    "Service": service_patch,
    "ConfigMap": config_map_patch,
}


def _created_message(
    kind: PodSetKind, entry: PodSetEntry, deployment: Mapping[str, Any], *, wanted: int, settings: OperatorSettings
) -> str:
    """The Event of an entry whose Deployment was just created (`wanted` pods once the job is admitted)."""
    made = "Deployment and Service" if kind is ENVIRONMENTS else "Deployment"
    port = getattr(entry, "port", None)
    return (
        f"created {made} {deployment['metadata']['name']}"
        + (" and its NetworkPolicy" if settings.network_policy else "")
        + f" for {kind.role} {entry.name!r}: {wanted} pod(s) of "
        + deployment["spec"]["template"]["spec"]["containers"][0]["image"]
        + (f" on port {port}" if port is not None else "")
    )


def _controller(obj: Mapping[str, Any]) -> str:
    """Who controls `obj`, in words, for a message."""
    refs = obj.get("metadata", {}).get("ownerReferences") or ()
    controller = next((ref for ref in refs if ref.get("controller")), None)
    if controller is None:
        return "no controller (made by hand or orphaned; the operator adopts nothing it did not make)"
    return f"{controller.get('kind', 'an object')} {controller.get('name', '?')} (uid {controller.get('uid', '?')})"


def _observation(submission_id: str, details: Mapping[str, Any] | None) -> RayJobObservation | None:
    if details is None:
        return None
    return RayJobObservation(
        submission_id=submission_id, status=RayJobStatus(details["status"]), message=str(details.get("message") or "")
    )
