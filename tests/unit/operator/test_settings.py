"""Operator settings: flags over environment over defaults, and refused values."""

from __future__ import annotations

import pytest

from rldock.operator.settings import DashboardAddress, OperatorSettings, load_settings


def test_defaults_watch_every_namespace():
    settings = load_settings([], {})
    assert settings == OperatorSettings()
    assert settings.clusterwide and settings.poll_interval == 5.0
    assert settings.dashboard_address is DashboardAddress.SERVICE_DNS


def test_environment_then_flags():
    env = {"RLDOCK_NAMESPACES": "team-a, team-b,team-a", "RLDOCK_POLL_INTERVAL": "2",
           "RLDOCK_LOG_LEVEL": "debug", "RLDOCK_DASHBOARD_ADDRESS": "service-ip",
           "RLDOCK_LIVENESS": "http://0.0.0.0:8080/healthz"}
    settings = load_settings([], env)
    assert settings.namespaces == ("team-a", "team-b") and not settings.clusterwide
    assert (settings.poll_interval, settings.log_level) == (2.0, "DEBUG")
    assert settings.dashboard_address is DashboardAddress.SERVICE_IP
    assert settings.liveness_endpoint == "http://0.0.0.0:8080/healthz"
    flagged = load_settings(["-n", "team-c", "--poll-interval", "1", "--dashboard-address", "pod-ip"], env)
    assert flagged.namespaces == ("team-c",) and flagged.poll_interval == 1.0
    assert flagged.dashboard_address is DashboardAddress.POD_IP


@pytest.mark.parametrize("argv, env", [
    (["--poll-interval", "30"], {}),  # status would lag more than 10 s
    (["--poll-interval", "0"], {}),
    ([], {"RLDOCK_POLL_INTERVAL": "soon"}),
    (["--log-level", "chatty"], {}),
    (["--dashboard-address", "dns"], {}),
    (["--ray-timeout", "-1"], {}),
])
def test_bad_values_are_refused(argv, env, capsys):
    with pytest.raises(SystemExit):
        load_settings(argv, env)
    assert "error" in capsys.readouterr().err
