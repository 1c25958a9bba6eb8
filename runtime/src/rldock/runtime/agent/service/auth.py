"""The per-job token an environment server asks of its clients (docs/security.md): every route but
`/health` wants `Authorization: Bearer <token>`.

One variable on both sides, RLDOCK_ENV_TOKEN: `rldock env serve` reads it (or `--token-file`, a mounted
Secret's file) and rldock's client sends it. `rldock train` makes one for the servers it starts itself
(`servers.command`) unless the variable is set, and its Ray workers inherit it (cluster.connect); an
RLJob's pods get it from a Secret.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from rldock.contract.runtime_cli import ENVIRONMENT_TOKEN_ENV

TOKEN_ENV = ENVIRONMENT_TOKEN_ENV
# Below this a token is refused as too easy to guess (a generated one is 43 characters).
MIN_TOKEN_CHARS = 16


class TokenError(ValueError):
    """A token that cannot be used; the message names where it came from."""


def checked(token: str, where: str) -> str:
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS or not token.isprintable() or any(c.isspace() for c in token):
        raise TokenError(
            f"{where}: a token of at least {MIN_TOKEN_CHARS} printable characters without spaces is needed "
            f"(`python -c 'import secrets; print(secrets.token_urlsafe(32))'` makes one)"
        )
    return token


def server_token(token_file: str | None) -> str | None:
    """The token `rldock env serve` asks for: `--token-file`'s content, else RLDOCK_ENV_TOKEN, else None."""
    if token_file is not None:
        try:
            return checked(Path(token_file).read_text(), "--token-file")
        except OSError as error:
            raise TokenError(f"--token-file: cannot read {token_file}: {error}") from error
    given = os.environ.get(TOKEN_ENV)
    return None if given is None else checked(given, TOKEN_ENV)


def client_headers() -> dict[str, str]:
    """The headers rldock's client sends every server: the token of RLDOCK_ENV_TOKEN, if set."""
    token = os.environ.get(TOKEN_ENV)
    return {} if not token else {"Authorization": f"Bearer {token.strip()}"}


def job_token() -> str:
    """The job's token for the servers `rldock train` starts: RLDOCK_ENV_TOKEN where set, else a new one,
    set in this process's environment so its clients (and the Ray workers started after) send it."""
    token = os.environ.get(TOKEN_ENV)
    if token is None:
        token = os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)
    return checked(token, TOKEN_ENV)


def authorized(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token` (compared in constant time)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), token.encode())
