"""Names of everything the operator creates for an RLJob, derived from the RLJob alone.

All "find my children" naming lives here so that a restarted operator computes the same names and
finds the objects it created before (no duplicates), and so that every name is valid where it is
used: a name that is too long or has the wrong characters is shortened deterministically and made
unique with a hash of the original.

Names of different RLJobs in one namespace must never meet, or one job's child would stand where
another's is expected (KubeRay takes an existing head Service of its name as its own). Every name
of one kind, per RLJob `J` (its RayCluster `C`, normally `J` itself):

    kind            rldock                                  KubeRay
    ConfigMap       J-config, J-agent-runner-<16 hex>
    Secret          J-ray-auth-<16 hex>, J-env-token-<16 hex>
    NetworkPolicy   J-ray, J-env-<entry>-<16 hex>, J-agent-<entry>-<16 hex>
    Service         J-env-<entry>-<16 hex>, J-gateway-<16 hex>  C-head-svc (and C-serve-svc, C-headless-worker-svc)
    Deployment      J-env-<entry>-<16 hex>, J-agent-<entry>-<16 hex>
    ServiceAccount  J-env-<16 hex>

Names with a fixed ending cannot equal one another across jobs unless their endings do. A name
whose first part is free (`<rljob>-env-<entry>`: job `math` with entry `v2-head-svc` against job
`math-env-v2`'s `math-env-v2-head-svc`) is therefore closed by 16 hex digits of a hash of the RLJob
and entry names (`unforgeable`): no fixed ending above ends in 16 hex digits, and a shortened name
(`<prefix>-<8 hex>`) has a `-` where this has a digit. Two such names meet only on a 64-bit hash
collision. The Secrets' hash also covers the RLJob's uid: the operator may only create Secrets and
takes one that exists as its own, so a re-created RLJob of the same name must not meet the old
one's Secrets while the garbage collector has yet to delete them. And whatever the names, the
reconciler never takes over an object some other RLJob (or nobody) controls: it reports it
(reconcile/children.py, `Children.read_owned`).

Label values have no such check behind them: a selector matches by the label alone. The RLJob's name
is its `rldock.io/rljob` label where it fits (63 characters); a longer one is shortened to its prefix
and 64 bits of its hash (`label_value`), not the 32 bits a name gets, so that no one can search
offline for a name whose label selects another job's pods.
"""

from __future__ import annotations

import hashlib
import re

from rldock.operator.constants import DASHBOARD_PORT, WORKER_GROUP

DNS_LABEL_MAX = 63
LABEL_VALUE_MAX = 63
# KubeRay derives Service and pod names from the RayCluster name, e.g. `<cluster>-head-svc` and
# `<cluster>-workers-worker-abcde`, which must stay DNS labels (<= 63): keep 22 characters spare.
RAY_CLUSTER_NAME_MAX = DNS_LABEL_MAX - len(f"-{WORKER_GROUP}-worker-abcde") - 1
_HASH_LEN = 8
UNFORGEABLE_HASH_LEN = 16

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _digest(text: str, length: int = _HASH_LEN) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def _shorten(
    name: str, *, max_len: int, valid: re.Pattern[str], must_start_with_letter: bool, hash_len: int = _HASH_LEN
) -> str:
    """`name` itself when valid, else a sanitised prefix plus `hash_len` hex digits of a hash of the
    original name."""
    if len(name) <= max_len and valid.match(name):
        return name
    base = re.sub(r"[^a-z0-9-]+", "-", name.lower())
    if must_start_with_letter and not base[:1].isalpha():
        base = "r-" + base
    base = base[: max_len - hash_len - 1].strip("-")
    return f"{base}-{_digest(name, hash_len)}" if base else f"r{_digest(name, hash_len)}"


def dns_label(name: str, *, max_len: int = DNS_LABEL_MAX) -> str:
    """A DNS-1123 label (lowercase alphanumerics and '-', at most `max_len`)."""
    return _shorten(name, max_len=max_len, valid=_DNS_LABEL, must_start_with_letter=False)


def label_value(name: str) -> str:
    """A valid label value identifying `name` (RLJob names may be up to 253 characters): the name, or
    a longer one's prefix and 64 bits of its hash. Selectors match by it alone (the job's
    NetworkPolicy admits the pods that carry it, a Service sends to them), and no ownership check
    stands behind a selector as one does behind a child's name: two long names whose prefixes agree
    must not meet, and 32 bits of hash were a collision anyone could search for offline."""
    if len(name) <= LABEL_VALUE_MAX and _LABEL_VALUE.match(name):
        return name
    return _shorten(
        name, max_len=LABEL_VALUE_MAX, valid=_LABEL_VALUE, must_start_with_letter=False, hash_len=UNFORGEABLE_HASH_LEN
    )


def ray_cluster_name(rljob_name: str) -> str:
    """The RayCluster: the RLJob's own name when it fits, so `kubectl get raycluster NAME` works.

    It must start with a letter because KubeRay turns it into Service names (DNS-1035 labels).
    """
    return _shorten(rljob_name, max_len=RAY_CLUSTER_NAME_MAX, valid=_DNS_1035_LABEL, must_start_with_letter=True)


def config_map_name(rljob_name: str) -> str:
    """The ConfigMap that holds the job config the runtime reads."""
    return dns_label(f"{rljob_name}-config")


def auth_secret_name(rljob_name: str, uid: str) -> str:
    """The Secret holding the Ray cluster's auth token (Ray token authentication),
    `<rljob>-ray-auth-<16 hex>`. The uid is in the hash because the operator only creates Secrets
    and takes one that exists as made: an RLJob deleted and re-created under its name would
    otherwise take the old one's Secret, with the old token, until the collector deletes it."""
    return unforgeable(f"{rljob_name}-ray-auth", rljob_name, uid, "ray-auth")


def head_service_name(rljob_name: str) -> str:
    """The head Service KubeRay creates for the RayCluster."""
    return f"{ray_cluster_name(rljob_name)}-head-svc"


def dashboard_url(rljob_name: str, namespace: str) -> str:
    """Where the operator reaches the Ray Jobs API of this RLJob's cluster."""
    return f"http://{head_service_name(rljob_name)}.{namespace}.svc:{DASHBOARD_PORT}"


def ray_job_submission_id(rljob_name: str, uid: str, *, attempt: int) -> str:
    """The Ray job id of one attempt (0 for the first run, k after k restarts).

    Deterministic, so an operator restarted mid-submission finds the job it already submitted
    (the Jobs API refuses a duplicate id) instead of starting a second one; the uid keeps a new
    RLJob with a reused name from matching an old job.
    """
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    return f"rldock-{dns_label(rljob_name, max_len=40)}-{uid[:_HASH_LEN]}-{attempt}"


def network_policy_name(rljob_name: str) -> str:
    """The NetworkPolicy that admits connections to the RLJob's Ray pods."""
    return dns_label(f"{rljob_name}-ray")


def unforgeable(stem: str, *parts: str) -> str:
    """`<stem>-<16 hex>`, a DNS-1035 label: the stem shortened to fit, then 64 bits of a hash of
    `parts` (joined by `/`, which no name holds). No other child's name ends so (module docstring)."""
    suffix = hashlib.sha256("/".join(parts).encode()).hexdigest()[:UNFORGEABLE_HASH_LEN]
    prefix = _shorten(
        stem, max_len=DNS_LABEL_MAX - UNFORGEABLE_HASH_LEN - 1, valid=_DNS_1035_LABEL, must_start_with_letter=True
    )
    return f"{prefix}-{suffix}"


def environment_name(rljob_name: str, environment: str) -> str:
    """The Deployment, the Service and the NetworkPolicy of one `spec.environments` entry, all three
    `<rljob>-env-<environment>-<16 hex>`: a DNS-1035 label, as a Service name must be, and the host
    name the runtime's client resolves (builders/environments.py)."""
    return unforgeable(f"{rljob_name}-env-{environment}", rljob_name, "env", environment)


def environment_service_account_name(rljob_name: str) -> str:
    """The ServiceAccount the environments' pods run as: their own, without token or bindings."""
    return unforgeable(f"{rljob_name}-env", rljob_name, "env-service-account")


def environment_token_secret_name(rljob_name: str, uid: str) -> str:
    """The Secret holding the job's environment token (builders/secret.py), one per RLJob object
    (the uid: see auth_secret_name)."""
    return unforgeable(f"{rljob_name}-env-token", rljob_name, uid, "env-token")


def agent_name(rljob_name: str, agent: str) -> str:
    """The Deployment and the NetworkPolicy of one `spec.agents` entry, `<rljob>-agent-<agent>-<16 hex>`
    (builders/agents.py)."""
    return unforgeable(f"{rljob_name}-agent-{agent}", rljob_name, "agent", agent)


def gateway_service_name(rljob_name: str) -> str:
    """The headless Service through which the agent pods find the job's Ray pods' gateway port."""
    return unforgeable(f"{rljob_name}-gateway", rljob_name, "gateway")


def agent_runner_config_map_name(rljob_name: str) -> str:
    """The ConfigMap holding the runner every agent pod runs (rldock.contract.agent_runner)."""
    return unforgeable(f"{rljob_name}-agent-runner", rljob_name, "agent-runner")
