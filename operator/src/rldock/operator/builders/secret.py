"""The Secret with the Ray cluster's auth token (Ray >= 2.52 token authentication).

Ray 2.60 turns token authentication on by default. The operator therefore gives every RLJob its
own random token: this Secret (owned by the RLJob, so it goes with it) is read by every Ray pod
through `RAY_AUTH_TOKEN` (ray_cluster.py) and by the operator, which sends it to the Jobs API as
`Authorization: Bearer <token>`. The token is passed in: builders draw no randomness.
"""

from __future__ import annotations

from typing import Any

from rldock.operator import naming
from rldock.operator.builders.common import RLJobRef, child_metadata
from rldock.operator.constants import AUTH_SECRET_KEY


def build_auth_secret(*, job: RLJobRef, token: str) -> dict[str, Any]:
    if not token:
        raise ValueError("the Ray auth token must not be empty")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_metadata(job, naming.auth_secret_name(job.name)),
        "stringData": {AUTH_SECRET_KEY: token},
    }
