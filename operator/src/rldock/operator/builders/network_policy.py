"""The NetworkPolicy of one RLJob: its Ray pods accept connections only from each other and, on
the Jobs API port, from the operator.

A Ray cluster listens on many ports: the GCS (6379), the dashboard and Jobs API (8265), the client
server (10001), and each raylet's, object manager's and worker's own ports, most of them chosen at
random. Without a policy every pod of the cluster, in any namespace, can reach them; the job's
token guards only the Jobs API. So the policy selects every pod of the RLJob (KubeRay copies the
templates' `rldock.io/rljob` label onto them) and admits:

- any port from a pod of the same RLJob (Ray's own traffic, whatever ports it picks);
- the dashboard port from the operator's pods, when the operator knows where they are (its
  namespace and pod labels, which the chart passes); an operator outside the cluster gets no rule;
- with spec.agents, the gateway port (`rldock.contract.agent_pods.GATEWAY_PORT`) from the job's agent
  pods, and no other port (builders/agents.py).

Egress stays open: jobs reach model stores, reward services and each other's Ray ports through
the rules above. The namespace is matched by `kubernetes.io/metadata.name`, a label the API
server sets on every namespace from Kubernetes 1.21 (on 1.20 an admin sets it on the operator's
namespace: docs/security.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rldock.contract.agent_pods import GATEWAY_PORT
from rldock.operator import naming
from rldock.operator.builders.common import RLJobRef, child_metadata
from rldock.operator.builders.pod_sets import AGENTS
from rldock.operator.constants import DASHBOARD_PORT, LABEL_NAMESPACE_NAME, LABEL_RLJOB


def build_network_policy(
    *,
    job: RLJobRef,
    operator_namespace: str | None,
    operator_pod_labels: Mapping[str, str],
    agents: bool = False,
) -> dict[str, Any]:
    """`agents`: the job has spec.agents, whose pods reach the gateway port."""
    job_pods = {"matchLabels": {LABEL_RLJOB: naming.label_value(job.name)}}
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": job_pods}]}]
    if agents:
        ingress.append(
            {"from": [{"podSelector": AGENTS.job_pods(job)}], "ports": [{"protocol": "TCP", "port": GATEWAY_PORT}]}
        )
    if operator_namespace and operator_pod_labels:
        ingress.append(
            {
                "from": [
                    {
                        "namespaceSelector": {"matchLabels": {LABEL_NAMESPACE_NAME: operator_namespace}},
                        "podSelector": {"matchLabels": dict(operator_pod_labels)},
                    }
                ],
                "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(job, naming.network_policy_name(job.name)),
        "spec": {"podSelector": job_pods, "policyTypes": ["Ingress"], "ingress": ingress},
    }
