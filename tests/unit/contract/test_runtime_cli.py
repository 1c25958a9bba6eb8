"""The command line the operator submits is one the runtime's parser accepts, flag for flag."""

import pytest

from rldock.contract.runtime_cli import JOB_CONFIG_ENV, train_argv
from rldock.runtime.cli import build_parser


@pytest.mark.parametrize("resume, progress_lines, max_restarts", [(True, True, 0), (False, False, 3)])
def test_runtime_parses_the_submitted_command(resume, progress_lines, max_restarts):
    argv = train_argv(
        config="/etc/rldock/job.yaml",
        output="/ckpt/ns/job",
        resume=resume,
        progress_lines=progress_lines,
        max_restarts=max_restarts,
    )
    assert argv[0] == "rldock"
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.config, args.output) == ("train", "/etc/rldock/job.yaml", "/ckpt/ns/job")
    assert (args.resume, args.no_progress, args.max_restarts) == (resume, progress_lines, max_restarts)


def test_config_path_defaults_to_the_pods_environment(monkeypatch):
    monkeypatch.setenv(JOB_CONFIG_ENV, "/etc/rldock/job.yaml")
    assert build_parser().parse_args(["validate"]).config == "/etc/rldock/job.yaml"
    assert build_parser().parse_args(["train", "--output", "o"]).config == "/etc/rldock/job.yaml"


def test_config_path_is_required_outside_a_pod(monkeypatch):
    monkeypatch.delenv(JOB_CONFIG_ENV, raising=False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["validate"])
