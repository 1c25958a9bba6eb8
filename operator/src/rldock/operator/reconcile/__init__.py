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

from rldock.operator.reconcile.reconciler import Reconciler
from rldock.operator.reconcile.round import Outcome, managed_elsewhere

__all__ = ["Outcome", "Reconciler", "managed_elsewhere"]
