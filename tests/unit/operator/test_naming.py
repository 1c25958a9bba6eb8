"""Child names: valid where used, deterministic, unique, and the RLJob's own name when possible."""

from __future__ import annotations

import re

import pytest

from rldock.operator import naming

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

NAMES = ["grpo", "grpo-qwen2-7b", "7b-run", "a.b.c", "x" * 40, "y" * 63, "grpo-" + "z" * 200, "a" * 253, "0"]


@pytest.mark.parametrize("name", NAMES)
def test_names_are_valid_where_they_are_used(name):
    cluster = naming.ray_cluster_name(name)
    assert DNS_1035.match(cluster) and len(cluster) <= naming.RAY_CLUSTER_NAME_MAX
    # KubeRay's derived names stay DNS labels.
    for derived in (naming.head_service_name(name), f"{cluster}-workers-worker-abcde"):
        assert DNS_1123.match(derived) and len(derived) <= 63, derived
    config_map = naming.config_map_name(name)
    assert DNS_1123.match(config_map) and len(config_map) <= 63
    label = naming.label_value(name)
    assert LABEL_VALUE.match(label) and len(label) <= 63
    assert naming.ray_cluster_name(name) == cluster, "deterministic: a restarted operator finds it again"


@pytest.mark.parametrize(
    "name, cluster, config_map",
    [
        ("grpo", "grpo", "grpo-config"),
        ("grpo-qwen2-7b", "grpo-qwen2-7b", "grpo-qwen2-7b-config"),
    ],
)
def test_short_names_are_kept(name, cluster, config_map):
    assert naming.ray_cluster_name(name) == cluster
    assert naming.config_map_name(name) == config_map
    assert naming.label_value(name) == name


def test_shortened_names_stay_distinct():
    long_a, long_b = "experiment-" + "a" * 60, "experiment-" + "a" * 59 + "b"
    assert naming.ray_cluster_name(long_a) != naming.ray_cluster_name(long_b)
    assert naming.label_value(long_a) != naming.label_value(long_b)
    assert naming.ray_cluster_name("7b") != naming.ray_cluster_name("r-7b")


def test_a_shortened_label_value_carries_64_bits_of_the_name_s_hash():
    """A selector matches by the label alone: two long names that share their first 46 characters
    must differ in a hash no one can search a collision of (32 bits could be, offline)."""
    import hashlib

    name = "experiment-" + "a" * 100
    label = naming.label_value(name)
    prefix, _, digest = label.rpartition("-")
    assert digest == hashlib.sha256(name.encode()).hexdigest()[:16] and len(label) <= 63
    assert prefix == name[: 63 - 16 - 1]


def test_ray_job_ids_and_dashboard():
    first = naming.ray_job_submission_id("grpo", "0f5c2a6e-1111", attempt=0)
    assert first == "rldock-grpo-0f5c2a6e-0"
    assert naming.ray_job_submission_id("grpo", "0f5c2a6e-1111", attempt=1) != first
    assert naming.ray_job_submission_id("grpo", "99999999-1111", attempt=0) != first
    with pytest.raises(ValueError):
        naming.ray_job_submission_id("grpo", "u", attempt=-1)
    assert naming.dashboard_url("grpo", "team-a") == "http://grpo-head-svc.team-a.svc:8265"


@pytest.mark.parametrize("secret_name", [naming.auth_secret_name, naming.environment_token_secret_name])
@pytest.mark.parametrize("name", NAMES)
def test_a_re_created_rljob_s_secrets_are_not_the_old_one_s(secret_name, name):
    """The operator only creates Secrets and takes one that exists as made: an RLJob deleted and
    created again under its name must not meet the old one's Secret before it is collected."""
    old, new = secret_name(name, "0f5c2a6e-1111"), secret_name(name, "9e8d7c6b-2222")
    assert old != new
    for secret in (old, new):
        assert DNS_1123.match(secret) and len(secret) <= 63, secret
    assert secret_name(name, "0f5c2a6e-1111") == old, "deterministic: a restarted operator finds it again"
