"""The children a round makes before the RayCluster, in the order it makes them (`Children.ordered`: what
the Ray pods and the environments' pods read or are guarded by exists before any of them runs), and the
one way any child is had: created, or put back where it differs, but never adopted from someone else
(`Children.read_owned`, naming.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rldock.operator import naming
from rldock.operator.api import RLJobSpec
from rldock.operator.builders import build_auth_secret, build_network_policy
from rldock.operator.builders.common import put_back
from rldock.operator.builders.secret import build_environment_token_secret
from rldock.operator.constants import EventReason, Reason
from rldock.operator.facts import Blocked
from rldock.operator.kube import CreateRefused, Kube
from rldock.operator.observe import Ownership, ownership
from rldock.operator.reconcile.round import BlockedRound, Outcome, Round, SkipRound
from rldock.operator.settings import OperatorSettings

log = logging.getLogger(__name__)

PatchOf = Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any] | None]


@dataclass(frozen=True)
class Child:
    """One child of the round's ordered list (`Children.ordered`), had by `Children.ensure`."""

    manifest: dict[str, Any]
    # The patch that puts a stored one back (None while it matches); CREATE_ONLY: created once per
    # process and never read back, since the operator's role may only create it (the Secrets).
    patch_of: PatchOf
    created: EventReason  # the Event of its creation, saying `created <kind> <name>` + `message`
    message: str


def _create_only(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any] | None:
    raise AssertionError("a create-only child is never read back")


CREATE_ONLY: PatchOf = _create_only


def never_patched(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> None:
    """A child made once and left as made (the environments' ServiceAccount): the operator holds no
    `patch` on it."""
    return None


class Children:
    """Has the children of every RLJob this process reconciles; remembers which create-only ones it made
    or found (the Secrets, the environments' ServiceAccount), since it may not read those back."""

    def __init__(self, kube: Kube, settings: OperatorSettings, *, draw_token: Callable[[], str]) -> None:
        self.kube, self.settings = kube, settings
        self._draw_token = draw_token
        self.made: set[tuple[str, str]] = set()  # (RLJob uid, name) of create-only children made or found

    def forget(self, uid: str) -> None:
        """Drop what is remembered of an RLJob that stopped running."""
        self.made = {made for made in self.made if made[0] != uid}

    def ordered(self, rnd: Round, spec: RLJobSpec, token: str) -> list[Child]:
        """The children made before the RayCluster, in the order they are made. The Secrets are created
        once and never read back (the operator's role holds only `create` on Secrets): an existing one is
        taken as made, its name hashing the RLJob's uid (naming.py), so no earlier RLJob of the same name
        left it."""
        ref, children = rnd.ref, []
        if (ref.uid, naming.auth_secret_name(ref.name, ref.uid)) not in self.made:
            children.append(
                Child(
                    build_auth_secret(job=ref, token=token),
                    CREATE_ONLY,
                    EventReason.CREATED_AUTH_SECRET,
                    " with the Ray auth token",
                )
            )
        if spec.has_pod_sets and (ref.uid, naming.environment_token_secret_name(ref.name, ref.uid)) not in self.made:
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

    def ensure(self, rnd: Round, child: Child, out: Outcome) -> None:
        """Create `child`, with its Event, or put a stored one back where it differs."""
        kind, name = child.manifest["kind"], child.manifest["metadata"]["name"]
        if child.patch_of is CREATE_ONLY:
            created = create(self.kube, child.manifest) is not None
            self.made.add((rnd.ref.uid, name))
        else:
            _, created = self.ensure_child(rnd, child.manifest, child.patch_of)
        if created:
            out.event("Normal", child.created, f"created {kind} {name}{child.message}")

    def ensure_child(self, rnd: Round, desired: dict[str, Any], patch_of: PatchOf) -> tuple[dict[str, Any], bool]:
        """The child `desired` as stored after creating it, or patching it with `patch_of(existing,
        desired)` when that returns a patch; whether it was created now."""
        kind, name = desired["kind"], desired["metadata"]["name"]
        existing = self.read_owned(rnd, kind, name)
        if existing is None:
            created = create(self.kube, desired)
            if created is None:
                raise SkipRound(f"{kind} {name} appeared meanwhile")
            return created, True
        patch = patch_of(existing, desired)
        if patch:
            log.info("%s/%s: %s %s differs from the spec; put back", rnd.ref.namespace, rnd.ref.name, kind, name)
            existing = self.kube.patch(kind, rnd.ref.namespace, name, patch)
        return existing, False

    def read_owned(self, rnd: Round, kind: str, name: str) -> dict[str, Any] | None:
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


def create(kube: Kube, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
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


def _controller(obj: Mapping[str, Any]) -> str:
    """Who controls `obj`, in words, for a message."""
    refs = obj.get("metadata", {}).get("ownerReferences") or ()
    controller = next((ref for ref in refs if ref.get("controller")), None)
    if controller is None:
        return "no controller (made by hand or orphaned; the operator adopts nothing it did not make)"
    return f"{controller.get('kind', 'an object')} {controller.get('name', '?')} (uid {controller.get('uid', '?')})"
