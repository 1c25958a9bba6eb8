"""Credentials of a throwaway control plane: service-account key pair, token file, kubeconfig.

Serving certificates are not here: kube-apiserver writes a self-signed pair into --cert-dir, and
clients skip verification (the kubeconfig says insecure-skip-tls-verify).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

ADMIN_USER = "admin"
# A real user with no RBAC bindings: what a tenant sees before an admin grants it a Role.
DEVELOPER_USER = "developer"
# A second one, for tests where the developer runs the operator and someone else writes RLJobs.
TENANT_USER = "tenant"


@dataclass(frozen=True)
class TokenUser:
    name: str
    token: str
    groups: tuple[str, ...] = ()


def default_users() -> dict[str, TokenUser]:
    """The admin (system:masters) and two non-admin users, with fresh random tokens."""
    return {
        ADMIN_USER: TokenUser(ADMIN_USER, secrets.token_hex(16), ("system:masters",)),
        DEVELOPER_USER: TokenUser(DEVELOPER_USER, secrets.token_hex(16)),
        TENANT_USER: TokenUser(TENANT_USER, secrets.token_hex(16)),
    }


def write_token_file(path: Path, users: dict[str, TokenUser]) -> Path:
    """kube-apiserver --token-auth-file format: token,user,uid,"group1,group2"."""
    # No fourth column without groups: an empty one would read as a group named "".
    lines = [f"{u.token},{u.name},{u.name}" + (f',"{",".join(u.groups)}"' if u.groups else "") for u in users.values()]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return path


def write_service_account_keys(directory: Path) -> tuple[Path, Path]:
    """An RSA pair for signing service-account tokens; returns (private key, public key)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = directory / "sa.key"
    public = directory / "sa.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
    )
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private, public


def kubeconfig(
    server: str, users: dict[str, TokenUser], *, current: str = ADMIN_USER, cluster_name: str = "rldock-e2e"
) -> dict:
    """A kubeconfig with one context per user (named after the user), `current` selected."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster_name, "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": u.name, "user": {"token": u.token}} for u in users.values()],
        "contexts": [{"name": u.name, "context": {"cluster": cluster_name, "user": u.name}} for u in users.values()],
        "current-context": current,
        "preferences": {},
    }


def write_kubeconfig(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
