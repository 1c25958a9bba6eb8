"""What one generation of an RLJob's spec asks for, worked out once: the parsed spec, its problems,
what the admin's policy refuses of it, and the children the builders make of it.

A round reads the world anew every time (reconcile/), but not the spec's consequences: the API
server counts every change of an RLJob's spec in its `metadata.generation` (the CRD has a status
subresource), and the parse, the policy and the builders are pure functions of the spec, the
RLJob's identity and the operator's settings, which stay the same while the process runs. So a
round of a generation already seen takes them from here; a resync round of an unchanged RLJob
parses nothing and renders no YAML (the job config's YAML, rendered twice a round, and the spec's
validation were most of such a round's CPU; docs/operator.md, "Cost").

One generation is kept per RLJob uid (a re-created RLJob of the same name has another uid), and an
RLJob is forgotten when it is deleted. A body without a generation (none from the API server) is
worked out every time. The values are shared between rounds: callers never change them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rldock.config import Problem
from rldock.operator.api import Agent, Environment, RLJobSpec
from rldock.operator.builders import (
    RLJobRef,
    build_agent,
    build_agent_runner_config_map,
    build_config_map,
    build_environment,
    build_gateway_service,
    build_pod_service_account,
    build_ray_cluster,
)
from rldock.operator.builders.pod_sets import AGENTS, ENVIRONMENTS, PodSetEntry, PodSetKind
from rldock.operator.policy import policy_problems
from rldock.operator.settings import OperatorSettings
from rldock.operator.validation import parse_spec


@dataclass
class Desired:
    """One generation of one RLJob's spec: parsed, checked, and its children built on first use."""

    ref: RLJobRef
    settings: OperatorSettings
    spec: RLJobSpec | None
    problems: list[Problem]
    denied: list[Problem]  # what the admin's policy refuses of a valid spec
    _built: dict[str, Any] = field(default_factory=dict, repr=False)

    def _valid_spec(self) -> RLJobSpec:
        assert self.spec is not None, "children are built only of a spec that parsed"
        return self.spec

    def config_map(self) -> dict[str, Any]:
        if "config_map" not in self._built:
            self._built["config_map"] = build_config_map(job=self.ref, spec=self._valid_spec())
        return self._built["config_map"]

    def ray_cluster(self) -> dict[str, Any]:
        if "ray_cluster" not in self._built:
            self._built["ray_cluster"] = build_ray_cluster(
                job=self.ref, spec=self._valid_spec(), defaults=self.settings.pod_defaults
            )
        return self._built["ray_cluster"]

    def pod_service_account(self) -> dict[str, Any]:
        """The ServiceAccount of the environments' and agents' pods."""
        if "service_account" not in self._built:
            self._built["service_account"] = build_pod_service_account(job=self.ref)
        return self._built["service_account"]

    def pod_set_shared(self, kind: PodSetKind) -> tuple[dict[str, Any], ...]:
        """The children all entries of `kind` share (beside the ServiceAccount), in creation order: the
        agents' runner ConfigMap and gateway Service; none for environments."""
        if kind is not AGENTS:
            return ()
        key = "agents/shared"
        if key not in self._built:
            self._built[key] = (build_agent_runner_config_map(job=self.ref), build_gateway_service(job=self.ref))
        return self._built[key]

    def pod_set(self, kind: PodSetKind, entry: PodSetEntry) -> tuple[dict[str, Any], ...]:
        """The children of one entry of `kind`, in creation order (the NetworkPolicy first, the Deployment
        last: the pods are never up before the policy that guards them)."""
        key = f"{kind.section}/{entry.name}"
        if key not in self._built:
            spec, defaults = self._valid_spec(), self.settings.pod_defaults
            policy = self.settings.policy
            if kind is ENVIRONMENTS:
                assert isinstance(entry, Environment)
                egress = [rule.manifest() for rule in policy.environments.egress]
                built: tuple[dict[str, Any], ...] = tuple(
                    build_environment(job=self.ref, spec=spec, environment=entry, defaults=defaults, egress=egress)
                )
            else:
                assert isinstance(entry, Agent)
                egress = [rule.manifest() for rule in policy.agents.egress]
                built = tuple(build_agent(job=self.ref, spec=spec, agent=entry, defaults=defaults, egress=egress))
            self._built[key] = built
        return self._built[key]


def desired_of(body: Mapping[str, Any], settings: OperatorSettings) -> Desired:
    """The RLJob `body`'s spec parsed and checked against the admin's policy (pure)."""
    spec, problems = parse_spec(body.get("spec") or {})
    denied = (
        []
        if spec is None or problems
        else policy_problems(spec, settings.policy, default_image=settings.pod_defaults.image)
    )
    return Desired(ref=RLJobRef.from_body(body), settings=settings, spec=spec, problems=problems, denied=denied)


class DesiredCache:
    """The Desired of each RLJob's latest generation seen, by uid. Used from the rounds' threads:
    each RLJob's rounds run one at a time, and a dict's get and set are atomic, so two RLJobs'
    rounds at once at worst work one out twice."""

    def __init__(self, settings: OperatorSettings) -> None:
        self._settings = settings
        self._entries: dict[str, tuple[int, Desired]] = {}
        self.worked_out = 0  # how many times a spec was parsed and checked (the tests count them)

    def __len__(self) -> int:
        return len(self._entries)

    def of(self, body: Mapping[str, Any]) -> Desired:
        uid, generation = body["metadata"]["uid"], body["metadata"].get("generation")
        entry = self._entries.get(uid)
        if entry is not None and generation is not None and entry[0] == generation:
            return entry[1]
        desired = desired_of(body, self._settings)
        self.worked_out += 1
        if generation is not None:
            self._entries[uid] = (generation, desired)
        return desired

    def forget(self, uid: str) -> None:
        self._entries.pop(uid, None)
