"""RBAC of least privilege for the operator: namespaced Roles for given namespaces, a ClusterRole
only for cluster-wide watching. The Helm chart renders the same rules (one source).

Each rule is there for one thing the operator does (operator/src/rldock/operator/reconcile/,
operator/src/rldock/operator/handlers.py):

- rljobs: kopf lists and watches them, patches its finalizer and annotation-based progress onto
  them; `delete` is for ttlSecondsAfterFinished. `rljobs/status`: the status subresource, patched.
  Nothing reads one RLJob by name (kopf's watch brings every change), so there is no `get`.
  `rljobs/finalizers: update`: children carry `blockOwnerDeletion`, which clusters with the
  OwnerReferencesPermissionEnforcement admission plugin only allow to who may update the owner's
  finalizers.
- rayclusters: read by name, created, patched (suspend) and deleted (replacement,
  release after the job ends); listed and watched so that a change of an RLJob's cluster (KubeRay's
  status, a deletion, Kueue's admission) runs its round at once (handlers.py), instead of every
  RLJob polling its cluster.
- configmaps: the job config, read by name, created, patched.
- secrets: `create` only, for each RLJob's Ray auth token and, with spec.environments, its
  environment token. The operator derives the first from its own key (tokens.py), draws the second
  at random, and never reads a Secret back, so its role cannot read the cluster's Secrets.
- serviceaccounts: the environments' own ServiceAccount of each RLJob (builders/environments.py),
  read by name (whose it is) and created; never patched, bound or given a token.
- networkpolicies: each RLJob's NetworkPolicy (builders/network_policy.py) and one per environment
  (builders/environments.py), read by name, created, patched back when edited; an environment's is
  deleted when its entry leaves spec.environments.
- deployments and services: the pods and the headless Service of each spec.environments entry
  (builders/environments.py), read by name, created, patched (a changed entry, suspend and resume,
  scaled to 0 when the job ends) and deleted when the entry leaves the spec. Deployments are also
  listed by label (the RLJob's environments, to find entries that left it) and watched, so that
  their ready replicas reach the RLJob's status at once; kopf filters the label
  `rldock.io/environment` itself, as for pods.
- pods: listed by label (KubeRay's `ray.io/cluster`) for scheduling messages, lost workers and
  whether a gang's head is bound (an admitted job's environments start then), never read by name,
  and watched for the same reason as rayclusters (a head that came up, a pod the scheduler cannot
  place, a lost worker). Kopf (1.45) watches a resource whole and filters labels itself, so it
  lists and watches every pod of the watched namespaces and keeps those labelled `ray.io/cluster`.
- events: the operator's own Kubernetes Events on RLJobs.
- localsubjectaccessreviews: `create` only, for the admission webhook's question whether the user
  who sends an RLJob may `get` each Secret, ConfigMap and PersistentVolumeClaim it names
  (access_review.py). The namespaced form of SubjectAccessReview, so a per-namespace Role can grant
  it and the operator can ask only about the namespaces it serves; it reveals a user's rights to
  the operator and grants nothing.

Kopf runs standalone (no peering objects) and watches RLJobs, RayClusters, pods and Deployments, so
it needs nothing else; API discovery is open to every authenticated user.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rldock.operator.constants import GROUP, PLURAL

RBAC_API_VERSION = "rbac.authorization.k8s.io/v1"

RULES: tuple[dict[str, Any], ...] = (
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["list", "watch", "patch", "delete"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["patch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/finalizers"], "verbs": ["update"]},
    {
        "apiGroups": ["ray.io"],
        "resources": ["rayclusters"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["get", "create"]},
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "create", "patch", "delete"],
    },
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "create", "patch", "delete"]},
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["authorization.k8s.io"], "resources": ["localsubjectaccessreviews"], "verbs": ["create"]},
)


def service_account_subject(name: str, namespace: str) -> dict[str, str]:
    return {"kind": "ServiceAccount", "name": name, "namespace": namespace}


def build_rbac(*, name: str, subject: Mapping[str, str], namespaces: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Role + RoleBinding in each of `namespaces`, or ClusterRole + ClusterRoleBinding when empty.

    `name` names the (Cluster)Role and its binding; `subject` is who runs the operator, usually
    `service_account_subject(...)` of its Deployment.
    """
    rules = [
        dict(rule, apiGroups=list(rule["apiGroups"]), resources=list(rule["resources"]), verbs=list(rule["verbs"]))
        for rule in RULES
    ]
    if not namespaces:
        return [
            {"apiVersion": RBAC_API_VERSION, "kind": "ClusterRole", "metadata": {"name": name}, "rules": rules},
            {
                "apiVersion": RBAC_API_VERSION,
                "kind": "ClusterRoleBinding",
                "metadata": {"name": name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                "subjects": [dict(subject)],
            },
        ]
    if len(set(namespaces)) != len(namespaces):
        raise ValueError(f"namespaces listed twice: {list(namespaces)}")
    manifests: list[dict[str, Any]] = []
    for namespace in namespaces:
        metadata = {"name": name, "namespace": namespace}
        manifests += [
            {"apiVersion": RBAC_API_VERSION, "kind": "Role", "metadata": dict(metadata), "rules": rules},
            {
                "apiVersion": RBAC_API_VERSION,
                "kind": "RoleBinding",
                "metadata": dict(metadata),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                "subjects": [dict(subject)],
            },
        ]
    return manifests
