"""Operator settings: flags over environment over defaults, and refused values."""

from __future__ import annotations

import os

import pytest

from rldock.operator.leader import LeaseTimings
from rldock.operator.policy import AdminPolicy
from rldock.operator.settings import DashboardAddress, OperatorSettings, load_settings

KEY = {"RLDOCK_TOKEN_KEY": "k" * 32}


def test_defaults_watch_every_namespace():
    settings = load_settings([], KEY)
    assert settings == OperatorSettings(token_key=b"k" * 32)
    assert settings.clusterwide and settings.poll_interval == 5.0
    assert settings.dashboard_address is DashboardAddress.SERVICE_DNS


def test_environment_then_flags():
    env = {
        **KEY,
        "RLDOCK_NAMESPACES": "team-a, team-b,team-a",
        "RLDOCK_POLL_INTERVAL": "2",
        "RLDOCK_LOG_LEVEL": "debug",
        "RLDOCK_DASHBOARD_ADDRESS": "service-ip",
        "RLDOCK_LIVENESS": "http://0.0.0.0:8080/healthz",
    }
    settings = load_settings([], env)
    assert settings.namespaces == ("team-a", "team-b") and not settings.clusterwide
    assert (settings.poll_interval, settings.log_level) == (2.0, "DEBUG")
    assert settings.dashboard_address is DashboardAddress.SERVICE_IP
    assert settings.liveness_endpoint == "http://0.0.0.0:8080/healthz"
    flagged = load_settings(["-n", "team-c", "--poll-interval", "1", "--dashboard-address", "pod-ip"], env)
    assert flagged.namespaces == ("team-c",) and flagged.poll_interval == 1.0
    assert flagged.dashboard_address is DashboardAddress.POD_IP


@pytest.mark.parametrize(
    "argv, env",
    [
        (["--poll-interval", "30"], {}),  # status would lag more than 10 s
        (["--poll-interval", "0"], {}),
        ([], {"RLDOCK_POLL_INTERVAL": "soon"}),
        (["--log-level", "chatty"], {}),
        (["--dashboard-address", "dns"], {}),
        (["--ray-timeout", "-1"], {}),
        (["--leader-election"], {}),  # no namespace for the Lease
        (["--leader-election", "--lease-namespace", "ns", "--lease-duration", "5"], {}),  # <= renew deadline
        (["--health-port", "70000"], {}),
        ([], {"RLDOCK_HEALTH_PORT": "http"}),
    ],
)
def test_bad_values_are_refused(argv, env, capsys):
    with pytest.raises(SystemExit):
        load_settings(argv, {**KEY, **env})
    assert "error" in capsys.readouterr().err


def test_the_token_key_is_required_and_long_enough(capsys):
    with pytest.raises(SystemExit):
        load_settings([], {})
    assert "RLDOCK_TOKEN_KEY is not set" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_settings([], {"RLDOCK_TOKEN_KEY": "short"})
    assert "at least 32 bytes" in capsys.readouterr().err


def test_policy_network_policy_and_the_operators_pods_from_the_environment(capsys):
    env = {
        **KEY,
        "RLDOCK_POLICY": '{"hostPathPrefixes": ["/mnt/shared"], "podDefaults": {"imagePullSecrets": ["r"],'
        ' "labels": {"team": "ml"}, "priorityClassName": "research"}}',
        "RLDOCK_NETWORK_POLICY": "false",
        "POD_NAMESPACE": "rldock-system",
        "RLDOCK_OPERATOR_POD_LABELS": "app.kubernetes.io/name=rldock,app.kubernetes.io/instance=rl",
    }
    settings = load_settings([], env)
    assert settings.policy == AdminPolicy(
        host_path_prefixes=["/mnt/shared"],
        pod_defaults={"image_pull_secrets": ["r"], "labels": {"team": "ml"}, "priority_class_name": "research"},
    )
    assert settings.pod_defaults.image_pull_secrets == ("r",) and settings.pod_defaults.labels == {"team": "ml"}
    assert settings.pod_defaults.priority_class_name == "research"
    assert not settings.network_policy and settings.operator_namespace == "rldock-system"
    assert settings.operator_pod_labels == (("app.kubernetes.io/name", "rldock"), ("app.kubernetes.io/instance", "rl"))
    assert load_settings(["--network-policy"], env).network_policy
    for bad, message in (
        ('{"hostPathPrefixes": ["mnt"]}', "policy.hostPathPrefixes[0]"),
        ('{"hostPaths": []}', "policy.hostPaths"),
        ("[", "policy: not JSON"),
        # The operator stops at start on a prefix that would match wrongly, naming value and setting.
        (
            '{"imagePrefixes": ["https://registry.example.com"]}',
            "policy.imagePrefixes[0]: 'https://registry.example.com'",
        ),
        ('{"imagePrefixes": ["registry.example.com/ml", ""]}', "policy.imagePrefixes[1]: '' is empty"),
        ('{"nfsServers": ["nfs.example.com"]}', "policy.nfsServers"),
    ):
        with pytest.raises(SystemExit):
            load_settings([], {**env, "RLDOCK_POLICY": bad})
        assert message in capsys.readouterr().err


def test_leader_election_is_off_unless_asked_and_then_takes_the_pod_from_the_downward_api():
    assert not load_settings([], KEY).leader_election and load_settings([], KEY).health_port is None
    env = {
        **KEY,
        "RLDOCK_LEADER_ELECTION": "true",
        "RLDOCK_LEASE_NAME": "rl-operator",
        "POD_NAME": "rl-operator-7f9c-x2",
        "POD_NAMESPACE": "rldock-system",
        "RLDOCK_HEALTH_PORT": "8080",
    }
    settings = load_settings([], env)
    assert settings.leader_election and settings.lease_name == "rl-operator"
    assert (settings.lease_namespace, settings.identity) == ("rldock-system", "rl-operator-7f9c-x2")
    assert settings.lease == LeaseTimings(lease_duration=15, renew_deadline=10, retry_period=2)
    assert settings.health_port == 8080
    flagged = load_settings(
        [
            "--no-leader-election",
            "--identity",
            "me",
            "--lease-namespace",
            "other",
            "--lease-duration",
            "30",
            "--renew-deadline",
            "20",
            "--retry-period",
            "4",
        ],
        env,
    )
    assert not flagged.leader_election and (flagged.identity, flagged.lease_namespace) == ("me", "other")
    assert flagged.lease == LeaseTimings(lease_duration=30, renew_deadline=20, retry_period=4)


def test_outside_a_pod_the_identity_is_the_host_and_process():
    settings = load_settings(["--leader-election", "--lease-namespace", "ns"], KEY)
    assert settings.identity and settings.identity.endswith(f"-{os.getpid()}")
