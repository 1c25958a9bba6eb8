"""The environments' and the agents' pod sets (spec.environments, spec.agents), one child kind
(builders/pod_sets.py `PodSetKind`): per entry its NetworkPolicy, any Service and its Deployment, the
Deployments at 0 pods until the job is admitted (observe.admitted), scaled to 0 once it finished or
while its spec is refused, and an entry that left the spec deleted with its children."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from rldock.operator import naming
from rldock.operator.api import RLJobSpec
from rldock.operator.builders.agents import config_map_patch
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
from rldock.operator.constants import LABEL_RLJOB
from rldock.operator.facts import PodSetObservation
from rldock.operator.kube import Kube
from rldock.operator.observe import Ownership, ownership, pod_set_observation
from rldock.operator.reconcile.children import Children, PatchOf, never_patched
from rldock.operator.reconcile.round import Outcome, Round
from rldock.operator.settings import OperatorSettings

# How each kind of pod set child is put back when it differs from what was built.
_PATCHES: dict[str, PatchOf] = {
    "NetworkPolicy": network_policy_patch,
    "Service": service_patch,
    "ConfigMap": config_map_patch,
}


class PodSetsSeen(NamedTuple):
    """What the environments' and the agents' Deployments report, each in spec order; None for a section
    the job has and had no entries of."""

    environments: list[PodSetObservation] | None
    agents: list[PodSetObservation] | None


class PodSets:
    """Has every RLJob's pod sets (module docstring) through `children`."""

    def __init__(self, kube: Kube, settings: OperatorSettings, children: Children) -> None:
        self.kube, self.settings, self.children = kube, settings, children
        self._service_accounts_made: set[str] = set()  # uids of RLJobs whose pods' ServiceAccount was had

    def forget(self, uid: str) -> None:
        self._service_accounts_made.discard(uid)

    def ensure(self, rnd: Round, spec: RLJobSpec, out: Outcome, *, admitted: bool) -> PodSetsSeen:
        """Both sections' children: what each section's Deployments report."""
        return PodSetsSeen(
            **{kind.section: self._ensure_kind(rnd, spec, kind, out, admitted=admitted) for kind in POD_SET_KINDS}
        )

    def _ensure_kind(
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
                self.children.ensure_child(rnd, rnd.desired.pod_service_account(), never_patched)
                self._service_accounts_made.add(rnd.ref.uid)
            for shared in rnd.desired.pod_set_shared(kind):
                self.children.ensure_child(rnd, shared, _PATCHES[shared["kind"]])
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
                    deployment, created = self.children.ensure_child(rnd, scaled, deployment_patch)
                else:
                    self.children.ensure_child(rnd, child, _PATCHES[child["kind"]])
            if created:
                message = _created_message(kind, entry, deployment, wanted=asked, settings=self.settings)
                out.event("Normal", kind.created, message + ("" if admitted else ", started once the job is admitted"))
            seen.append(pod_set_observation(entry.name, deployment))
        wanted = {entry.name for entry in entries}
        for deployment in self._deployments(rnd, kind):
            name = deployment["metadata"]["labels"][kind.entry_label]
            if name not in wanted:
                self._delete_entry(rnd, kind, deployment, out, why=f"is no longer in spec.{kind.section}")
            elif deployment["metadata"]["name"] != kind.child_name(rnd.ref.name, name):
                # An older operator's children (`<rljob>-env-<entry>`, before names ended in a hash): their
                # pods would run on beside the new ones, with the old (open) egress.
                self._delete_entry(rnd, kind, deployment, out, why="has children of another name now")
        return seen

    def release(self, rnd: Round) -> PodSetsSeen:
        """Scale every environment and agent of the RLJob to 0 (finished, or its spec refused); what their
        Deployments report, by section; None for a section the job has and had no entries of."""
        released: dict[str, list[PodSetObservation] | None] = {}
        for kind in POD_SET_KINDS:
            if not (rnd.spec is not None and kind.entries(rnd.spec)) and not getattr(rnd.previous, kind.section):
                released[kind.section] = None
                continue
            seen = []
            for deployment in self._deployments(rnd, kind):
                if deployment["spec"].get("replicas"):
                    name = deployment["metadata"]["name"]
                    deployment = self.kube.patch("Deployment", rnd.ref.namespace, name, {"spec": {"replicas": 0}})
                seen.append(pod_set_observation(deployment["metadata"]["labels"][kind.entry_label], deployment))
            if rnd.spec is not None:  # in spec order, as the running job reports them
                order = {entry.name: index for index, entry in enumerate(kind.entries(rnd.spec))}
                seen.sort(key=lambda observed: order.get(observed.name, len(order)))
            released[kind.section] = seen
        return PodSetsSeen(**released)

    def _deployments(self, rnd: Round, kind: PodSetKind) -> list[dict[str, Any]]:
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

    def _delete_entry(
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
