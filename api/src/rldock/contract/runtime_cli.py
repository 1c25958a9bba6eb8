"""The runtime's command line as the operator submits it through the Ray Jobs API.

The runtime's parser (rldock.runtime.cli) declares these flags and the operator's job builder
(rldock.operator.builders.ray_job) writes them, both from the names here, and a test parses the
operator's command with the runtime's parser.

`JOB_CONFIG_ENV` is set in every pod of an RLJob to the mounted job config: `rldock validate` and
`rldock train` read it when no config path is given, so `kubectl exec <head> -- rldock validate`
checks the config the job runs.

`ENVIRONMENT_TOKEN_ENV` holds the job's environment token on both sides: `rldock env serve` asks
every client for it, rldock's client sends it (rldock.runtime.agent.service.auth); in an RLJob the
operator sets it in the Ray pods and the environments' pods from one Secret.
"""

from __future__ import annotations

PROGRAM = "rldock"
TRAIN = "train"
PREEMPT = "preempt"  # the Ray pods' preStop hook (docs/operator.md): `preempt_argv`
TIMEOUT = "--timeout"
NOTICE = "--notice"
FOLLOW = "--follow"
NO_DRAIN = "--no-drain"  # with --follow: a pod deleted alone asks for no checkpoint (a rollout pool's pod)
PREEMPT_NOTICE_FILE = "preempting.json"  # in the job's output folder, shared by every pod of the job
# Beside it: a worker pod being deleted alone asks the driver for a checkpoint there, in a file named after it.
DRAIN_REQUESTS_DIR = "drain-requests"
VALIDATE = "validate"
OUTPUT = "--output"
RESUME = "--resume"
NO_PROGRESS = "--no-progress"
MAX_RESTARTS = "--max-restarts"
JOB_CONFIG_ENV = "RLDOCK_JOB_CONFIG"
ENVIRONMENT_TOKEN_ENV = "RLDOCK_ENV_TOKEN"


def train_argv(*, config: str, output: str, resume: bool, progress_lines: bool, max_restarts: int) -> list[str]:
    """`rldock train CONFIG --output OUTPUT [...]` as an argument vector.

    `progress_lines`: one machine-readable progress line per iteration (what the operator parses)
    instead of a progress bar.
    """
    argv = [PROGRAM, TRAIN, config, OUTPUT, output]
    if resume:
        argv.append(RESUME)
    if progress_lines:
        argv.append(NO_PROGRESS)
    return [*argv, MAX_RESTARTS, str(max_restarts)]


def preempt_argv(*, timeout_s: int, notice: str, follow: bool, drain: bool = True) -> list[str]:
    """`rldock preempt --timeout S --notice PATH [--follow [--no-drain]]`: the head pod's preStop hook stops its
    drivers (posting the notice at PATH while they stop); a worker pod's (`follow`) keeps the pod's Ray node up
    while a notice says the head's driver is stopping (rldock.runtime.driver.preemption), and, deleted alone,
    asks the driver for a checkpoint first, unless `drain` is False (a rollout pool's pod: losing it costs its
    engine, not the attempt)."""
    follows = [FOLLOW, *([] if drain else [NO_DRAIN])] if follow else []
    return [PROGRAM, PREEMPT, TIMEOUT, str(timeout_s), NOTICE, notice, *follows]
