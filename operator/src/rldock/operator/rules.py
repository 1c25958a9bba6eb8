"""The operator's rules in the order they apply, and `classify`, the one place each rule's test is
written: a round gathers its facts (facts.RoundFacts), classifies them once, and derives its status
(status.py) and its actions (actions.py) from the rule that decided.

The rules are tested from the top; the first that holds decides (`first_rule`). The first three
read only what the RLJob says (its spec, its stored status), so a round decides them before it
touches the cluster; the others read what the round saw of the cluster. STARTING holds whenever
no rule above it does.

    rule                when                                  status                       actions
    MANAGED_ELSEWHERE   spec.managedBy names another          none written                 none
                        controller
    FINISHED            the phase is terminal: Succeeded, or  kept as it was               delete the RayCluster
                        Failed for good (not a Failed only                                 (the round's release)
                        the spec caused, which fixing it
                        undoes)
    REFUSED             the spec is invalid, or outside the   Failed (InvalidSpec,         delete the RayCluster
                        admin's policy                        PolicyDenied)                (the round's release)
    SUSPENDED           spec.suspend                          Suspended                    free the cluster (suspend
                                                                                           it; delete it under
                                                                                           Kueue): the pods' hooks
                                                                                           stop the driver
    SUSPENDED_BY_OTHER  an admin (or another controller)      Suspended                    none: theirs to undo, no
                        suspended the RayCluster of a job                                  restart counted
                        Kueue does not schedule
    BLOCKED             a child cannot be had (a name         Pending or Retrying,         none (not reached)
                        conflict, a refused create, a         ClusterReady=False naming
                        refused token)                        the fix
    PREEMPTED           the head pod is being deleted while   Preempted=True (the last     none: its preStop hook
                        the job ran (a drain, a preemption;   iteration reported), as      stops the driver; no
                        RoundFacts.preempted)                 STARTING                     restart counted
    ATTEMPT_REFUSED     the runtime refused its inputs        Failed, not retried          stop a driver still
                                                                                           running, delete the
                                                                                           RayCluster
    ATTEMPT_SUCCEEDED   the Ray job succeeded                 Succeeded                    (as ATTEMPT_REFUSED)
    WORKER_DRAINED      the attempt ended after a worker pod  Preempted=True (the pod),    stop the driver, next
                        was deleted alone while it ran        as STARTING                  attempt: no restart
                        (maxRestarts 0; RoundFacts.drained)                                counted
    ATTEMPT_FAILED      the attempt failed                    Retrying, or Failed at       stop the driver, count a
                        (RoundFacts.attempt_failure)          backoffLimit                 restart; at backoffLimit
                                                                                           as ATTEMPT_REFUSED
    ATTEMPT_RUNNING     the Ray job is pending or running     Running (pending: as         bring the cluster back,
                                                              STARTING)                    leave the driver be
    STARTING            none of the above: the cluster        Pending, Provisioning, or    create the cluster, replace
                        decides (a Kueue job's cluster that   Retrying after a restart     it when the spec moved, then
                        Kueue holds suspended waits for                                    submit the attempt
                        admission here)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum

from rldock.operator.constants import RayJobStatus
from rldock.operator.facts import RoundFacts, Suspension, finished


class Rule(str, Enum):
    """A rule of the table above; the Enum's order is the rules' order."""

    MANAGED_ELSEWHERE = "ManagedElsewhere"
    FINISHED = "Finished"
    REFUSED = "Refused"
    SUSPENDED = "Suspended"
    SUSPENDED_BY_OTHER = "SuspendedByOther"
    BLOCKED = "Blocked"
    PREEMPTED = "Preempted"
    ATTEMPT_REFUSED = "AttemptRefused"
    ATTEMPT_SUCCEEDED = "AttemptSucceeded"
    WORKER_DRAINED = "WorkerDrained"
    ATTEMPT_FAILED = "AttemptFailed"
    ATTEMPT_RUNNING = "AttemptRunning"
    STARTING = "Starting"


RULES: tuple[Rule, ...] = tuple(Rule)


def first_rule(tests: Mapping[Rule, Callable[[], bool]]) -> Rule:
    """The first rule of RULES whose test holds, STARTING when none does. A rule with no test
    here is skipped; tests after the deciding one are not called (a test may read facts that only
    exist when the rules above it do not hold, e.g. a parsed spec)."""
    if Rule.STARTING in tests:
        raise ValueError("STARTING holds when no other rule does: it takes no test")
    for rule in RULES:
        test = tests.get(rule)
        if test is not None and test():
            return rule
    return Rule.STARTING


def classify(f: RoundFacts) -> Rule | None:
    """The rule that decides this round; None when no rule of the spec holds and the round has not
    looked at the cluster yet (`f.looked`): look, then classify the fuller facts."""
    job = f.ray_job
    spec_rules: dict[Rule, Callable[[], bool]] = {
        Rule.MANAGED_ELSEWHERE: lambda: f.managed_elsewhere,
        Rule.FINISHED: lambda: finished(f.previous),
        Rule.REFUSED: lambda: bool(f.problems or f.denied),  # a spec that did not parse comes with problems
    }
    if not f.looked:
        rule = first_rule(spec_rules)
        return None if rule is Rule.STARTING else rule
    return first_rule(
        {
            **spec_rules,
            Rule.SUSPENDED: lambda: f.valid_spec.suspend,  # REFUSED held for a spec that did not parse
            # Kueue suspends the clusters it schedules until it admits them (and again to preempt them):
            # such a job waits for admission (STARTING), and a spec change replaces its cluster meanwhile.
            Rule.SUSPENDED_BY_OTHER: lambda: f.suspension is Suspension.OTHER and not f.kueue,
            Rule.BLOCKED: lambda: f.blocked is not None,
            Rule.PREEMPTED: lambda: f.preempted,  # the head goes: its Ray job can no longer be read
            Rule.ATTEMPT_REFUSED: lambda: (
                job is not None and job.status is RayJobStatus.FAILED and job.failure is not None
            ),
            Rule.ATTEMPT_SUCCEEDED: lambda: job is not None and job.status is RayJobStatus.SUCCEEDED,
            # Its worker's hook had the iteration under way saved: a preemption, as the head's, not a failure.
            Rule.WORKER_DRAINED: lambda: f.attempt_failure is not None and f.drained,
            Rule.ATTEMPT_FAILED: lambda: f.attempt_failure is not None,
            Rule.ATTEMPT_RUNNING: lambda: job is not None and job.active,
        }
    )
