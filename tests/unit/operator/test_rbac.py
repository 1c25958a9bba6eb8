"""RBAC manifests of least privilege: namespaced Roles, or one ClusterRole for cluster-wide."""

from __future__ import annotations

import kubernetes_validate
import pytest
from rljob_testing import KUBERNETES_VERSION

from rldock.operator.builders.rbac import RULES, build_rbac, service_account_subject

SUBJECT = service_account_subject("rldock-operator", "rldock-system")


def _verbs(manifest: dict) -> dict[tuple[str, str], set[str]]:
    return {
        (group, resource): set(rule["verbs"])
        for rule in manifest["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }


def test_namespaced_watching_gets_a_role_per_namespace():
    manifests = build_rbac(name="rldock-operator", subject=SUBJECT, namespaces=["team-a", "team-b"])
    assert [(m["kind"], m["metadata"].get("namespace")) for m in manifests] == [
        ("Role", "team-a"),
        ("RoleBinding", "team-a"),
        ("Role", "team-b"),
        ("RoleBinding", "team-b"),
    ]
    binding = manifests[1]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "rldock-operator"}
    assert binding["subjects"] == [SUBJECT]


def test_cluster_wide_watching_gets_one_cluster_role():
    manifests = build_rbac(name="rldock-operator", subject=SUBJECT)
    assert [m["kind"] for m in manifests] == ["ClusterRole", "ClusterRoleBinding"]
    assert "namespace" not in manifests[0]["metadata"]


@pytest.mark.parametrize("namespaces", [(), ("team-a",)])
def test_manifests_are_valid_kubernetes_objects(namespaces):
    for manifest in build_rbac(name="rldock-operator", subject=SUBJECT, namespaces=namespaces):
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_least_privilege():
    verbs = _verbs(build_rbac(name="op", subject=SUBJECT)[0])
    assert all("*" not in v for v in verbs.values()) and ("", "*") not in verbs
    # Nothing is read by name that a watch brings anyway, nor read back after the operator wrote it.
    assert verbs[("rldock.io", "rljobs")] == {"list", "watch", "patch", "delete"}
    assert verbs[("rldock.io", "rljobs/status")] == {"patch"}
    assert verbs[("rldock.io", "rljobs/finalizers")] == {"update"}
    # Children are watched so that their changes run the RLJob's round (handlers.py).
    assert verbs[("ray.io", "rayclusters")] == {"get", "list", "watch", "create", "patch", "delete"}
    # Secrets are only created: the Ray token is derived (tokens.py), the environment token drawn at
    # random when its Secret is made, so none is ever read back.
    assert verbs[("", "secrets")] == {"create"}
    # The environments' ServiceAccount: read to see whose it is, made, never patched, bound or deleted.
    assert verbs[("", "serviceaccounts")] == {"get", "create"}
    assert not {resource for _, resource in verbs} & {"rolebindings", "roles", "serviceaccounts/token"}
    assert verbs[("", "configmaps")] == {"get", "create", "patch"}
    # The environments' children (builders/environments.py); an entry that leaves the spec is deleted.
    assert (
        verbs[("networking.k8s.io", "networkpolicies")]
        == verbs[("", "services")]
        == {
            "get",
            "create",
            "patch",
            "delete",
        }
    )
    assert verbs[("apps", "deployments")] == {"get", "list", "watch", "create", "patch", "delete"}
    # Pods are listed by label and watched, never read one by one.
    assert verbs[("", "pods")] == {"list", "watch"} and verbs[("", "events")] == {"create"}
    # The webhook asks whether an RLJob's author may read what it names (access_review.py): the
    # namespaced review only, so a per-namespace Role can grant it; never the cluster-wide one.
    assert verbs[("authorization.k8s.io", "localsubjectaccessreviews")] == {"create"}
    assert ("authorization.k8s.io", "subjectaccessreviews") not in verbs
    assert not {resource for _, resource in verbs} & {"namespaces", "customresourcedefinitions", "nodes"}


def test_manifests_do_not_share_rules_with_the_module():
    manifest = build_rbac(name="op", subject=SUBJECT)[0]
    manifest["rules"][0]["verbs"].append("*")
    assert "*" not in RULES[0]["verbs"]


def test_a_namespace_listed_twice_is_refused():
    with pytest.raises(ValueError, match="twice"):
        build_rbac(name="op", subject=SUBJECT, namespaces=["a", "a"])
