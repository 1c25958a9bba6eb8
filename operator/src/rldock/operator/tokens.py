"""Each RLJob's Ray auth token, derived from the operator's key instead of stored and read back.

The Ray cluster of an RLJob runs with token authentication (builders/secret.py): every Ray process
reads the token from a Secret the operator creates, and the operator sends it to the Jobs API. If
the operator drew a random token and read it back from that Secret each round, its role would need
`get` on every Secret it may reach (cluster-wide: all of them). Deriving the token instead,
HMAC-SHA256(key, namespace/name/uid), gives the same token to every replica and every restart of
the operator, so it only ever creates the Secret, and `create` is all its role holds on Secrets.

The uid makes a re-created RLJob of the same name a new token. The key is the chart's Secret
(RLDOCK_TOKEN_KEY); changing it changes every token, so RLJobs running then lose their Jobs API
until they are restarted (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac

from rldock.operator.builders.common import RLJobRef


def job_token(key: bytes, job: RLJobRef) -> str:
    """The Ray auth token of `job`: 64 hex characters (256 bits, as Ray's own generator)."""
    if not key:
        raise ValueError("the token key must not be empty")
    message = f"{job.namespace}/{job.name}/{job.uid}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()
