"""The ConfigMap holding the job config that the runtime reads at RLDOCK_JOB_CONFIG: `spec.job` with
its `servers.service` names resolved to the environments' URLs (builders/environments.py)."""

from __future__ import annotations

from typing import Any

import yaml

from rldock.config import JobConfig
from rldock.operator import naming
from rldock.operator.api import RLJobSpec
from rldock.operator.builders.common import RLJobRef, child_metadata
from rldock.operator.builders.environments import runtime_job_config
from rldock.operator.constants import JOB_CONFIG_FILE


def render_job_config(job_config: JobConfig) -> str:
    """YAML of the job with every default filled in: the runtime runs exactly what the operator
    validated, even if a later runtime version changes a default."""
    return yaml.safe_dump(job_config.model_dump(mode="json"), sort_keys=False)


def build_config_map(*, job: RLJobRef, spec: RLJobSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(job, naming.config_map_name(job.name)),
        "data": {JOB_CONFIG_FILE: render_job_config(runtime_job_config(job=job, spec=spec))},
    }
