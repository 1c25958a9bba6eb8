"""What a round sees of its cluster: the RayCluster's pods (summarized: the head, the workers, which are
lost or being deleted) and, on a running head, the attempt's Ray job through the Jobs API with its
driver's last progress record (its log parsed from where the last round stopped, progress_cursor.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from rldock.operator import naming
from rldock.operator.api import RLJobSpec
from rldock.operator.builders import output_dir
from rldock.operator.constants import LABEL_RAY_CLUSTER, Phase, RayJobStatus, Reason
from rldock.operator.facts import Blocked, RayJobObservation, Suspension, suspension
from rldock.operator.kube import Kube
from rldock.operator.observe import (
    Progress,
    attempt_workers,
    dashboard_url,
    job_observation,
    lost_workers,
    owned_by,
    progress_of,
    summarize_pods,
)
from rldock.operator.progress_cursor import ProgressCursor
from rldock.operator.rayjobs import RayJobsError, TokenRefused
from rldock.operator.reconcile.children import Children
from rldock.operator.reconcile.round import BlockedRound, JobsClientFactory, Round, Seen, SkipRound
from rldock.operator.settings import OperatorSettings


class Observer:
    """Observes every RLJob's cluster; keeps how far each running job's driver log was parsed."""

    def __init__(
        self, kube: Kube, settings: OperatorSettings, children: Children, *, jobs_client: JobsClientFactory
    ) -> None:
        self.kube, self.settings, self.children = kube, settings, children
        self._jobs_client = jobs_client
        self.logs = ProgressCursor()  # how far each running job's driver log was parsed

    def observe(self, rnd: Round, spec: RLJobSpec, cluster: Mapping[str, Any] | None, token: str) -> Seen:
        """The pods of `cluster` (None: not made yet) and, on a running head, its Jobs API's view of the attempt."""
        attempt = rnd.facts.attempt
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
                    record = self.logs.last_record(rnd.ref, submission_id, log_text)
                    progress = progress_of(record, output_dir=output_dir(job=rnd.ref, spec=spec))
                if details is None and attempt > 0:
                    previous_id = rnd.submission_id(attempt - 1)
                    previous_attempt = _observation(previous_id, jobs.get_job(previous_id))
            except TokenRefused as error:
                secret = naming.auth_secret_name(rnd.ref.name, rnd.ref.uid)
                self.children.made.discard((rnd.ref.uid, secret))  # made again once someone deletes it
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
        terminating: tuple[str, ...] = ()
        if job is not None and job.status is RayJobStatus.RUNNING:
            lost = lost_workers(
                summary, num_workers=spec.job.resources.num_nodes, attempt_workers=attempt_workers(details)
            )
            terminating = tuple(w.name for w in summary.workers if w.terminating)
        return Seen(
            summary=summary,
            job=job,
            progress=progress,
            lost=tuple(lost),
            workers_terminating=terminating,
            previous_attempt=previous_attempt,
            jobs=jobs,
        )


def _observation(submission_id: str, details: Mapping[str, Any] | None) -> RayJobObservation | None:
    if details is None:
        return None
    return RayJobObservation(
        submission_id=submission_id, status=RayJobStatus(details["status"]), message=str(details.get("message") or "")
    )
