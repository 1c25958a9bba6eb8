"""The Secrets of an RLJob's tokens: the Ray cluster's auth token (Ray >= 2.52 token authentication)
and, for a job with spec.environments, the environment token.

Ray 2.60 turns token authentication on by default. The operator therefore gives every RLJob its
own random token: this Secret (owned by the RLJob, so it goes with it) is read by every Ray pod
through `RAY_AUTH_TOKEN` (ray_cluster.py) and by the operator, which sends it to the Jobs API as
`Authorization: Bearer <token>`.

The environment token is what the environments' servers ask every client for (`rldock env serve`,
RLDOCK_ENV_TOKEN): the Ray pods' clients and the environments' pods read it from this Secret as
RLDOCK_ENV_TOKEN; the operator draws it at random when it makes the Secret and never reads it back
(it talks to no environment). The tokens are passed in: builders draw no randomness.
"""

from __future__ import annotations

from typing import Any

from rldock.operator import naming
from rldock.operator.builders.common import RLJobRef, child_metadata
from rldock.operator.constants import AUTH_SECRET_KEY, ENVIRONMENT_TOKEN_KEY


def build_auth_secret(*, job: RLJobRef, token: str) -> dict[str, Any]:
    return _token_secret(job, naming.auth_secret_name(job.name, job.uid), AUTH_SECRET_KEY, token, "the Ray auth token")


def build_environment_token_secret(*, job: RLJobRef, token: str) -> dict[str, Any]:
    return _token_secret(
        job,
        naming.environment_token_secret_name(job.name, job.uid),
        ENVIRONMENT_TOKEN_KEY,
        token,
        "the environment token",
    )


def _token_secret(job: RLJobRef, name: str, key: str, token: str, what: str) -> dict[str, Any]:
    if not token:
        raise ValueError(f"{what} must not be empty")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_metadata(job, name),
        "stringData": {key: token},
    }
