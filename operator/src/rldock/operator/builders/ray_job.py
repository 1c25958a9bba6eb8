"""What the operator submits to the cluster's Ray Jobs API: the runtime's command line.

The driver runs on the Ray head (as every Jobs API driver does) and always passes `--resume`, so
the first attempt starts fresh (no checkpoint yet) and every later one (a retry, an unsuspend, a
re-created cluster) continues from the last checkpoint in the same output directory. That
directory belongs to one RLJob object (its uid), so a new RLJob that reuses a name starts fresh.
"""

from __future__ import annotations

import posixpath
import shlex
from typing import Any

from rldock.contract.runtime_cli import train_argv
from rldock.operator import naming
from rldock.operator.api import RLJobSpec
from rldock.operator.builders.common import RLJobRef
from rldock.operator.constants import GROUP, JOB_CONFIG_PATH, LABEL_RLJOB


def output_dir(*, job: RLJobRef, spec: RLJobSpec) -> str:
    """Metrics and checkpoints of this RLJob on the checkpoint volume:
    `<mountPath>/<namespace>/<name>/<uid>`.

    Keyed by the object's uid as well as its name: retries, suspend and unsuspend of one RLJob keep
    its uid and resume, while a deleted and re-created RLJob of the same name (maybe another model
    or algorithm) is a new object and must not pick up the old run's checkpoints. The name stays in
    the path so that a person finds a job's runs with `ls <mountPath>/<namespace>/<name>/`.
    """
    return posixpath.join(spec.checkpoint.mount_path, job.namespace, job.name, job.uid)


def build_entrypoint(*, job: RLJobRef, spec: RLJobSpec) -> str:
    """The shell command line of the Ray job (the Jobs API takes one string).

    `--max-restarts` is spec.maxRestarts: the runtime's own restarts within the attempt, which keep
    the dock of the iteration in flight (a restart of the attempt starts from the checkpoint only).
    With 0 a dead worker fails the attempt and the operator retries it (counted in
    status.restartCount against spec.backoffLimit).
    """
    return shlex.join(
        train_argv(
            config=JOB_CONFIG_PATH,
            output=output_dir(job=job, spec=spec),
            resume=True,
            progress_lines=True,
            max_restarts=spec.max_restarts,
        )
    )


def build_job_submission(*, job: RLJobRef, spec: RLJobSpec, attempt: int) -> dict[str, Any]:
    """Body of `POST /api/jobs/` on the head's dashboard for one attempt (0, then 1 per restart)."""
    return {
        "entrypoint": build_entrypoint(job=job, spec=spec),
        "submission_id": naming.ray_job_submission_id(job.name, job.uid, attempt=attempt),
        "metadata": {LABEL_RLJOB: job.name, f"{GROUP}/namespace": job.namespace, f"{GROUP}/attempt": str(attempt)},
    }
