"""Where each iteration's metrics go besides metrics.jsonl (`tracking`): TensorBoard event files
and Weights & Biases, one scalar per numeric metric per iteration.

`tensorboard --logdir <output>` then shows every metric the trainer logs (nested dicts such as
`timing` become `timing/<stage>`; lists such as the dock's per-warehouse traffic are left to
metrics.jsonl). Each attempt of a run writes its own event file in the same directory, which
TensorBoard reads as one run. A resumed attempt redoes the iterations after the last checkpoint,
whose scalars an earlier attempt may already have written: it opens its writer with
`purge_step` = the first step it writes, so TensorBoard hides the earlier attempt's events from
that step on and no step shows twice.

Weights & Biases logs the same scalars under the same names at step = iteration, into one run per
output directory: the run's id is kept in the output directory, so a resumed attempt continues it.
W&B's steps only grow, so a resumed attempt's redone iterations that the run already holds are not
sent again. Its files go under `<output>/wandb`; WANDB_MODE=offline keeps them there with no
network (`wandb sync <output>/wandb/offline-run-*` uploads them later).
"""

from __future__ import annotations

import math
import netrc
import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from rldock.config import JobConfig, Problem

WANDB_RUN_ID_FILE = "wandb-run-id"  # in the output directory: the run a resumed attempt continues
WANDB_KEYLESS_MODES = ("offline", "disabled", "dryrun")  # WANDB_MODE values that need no API key
WANDB_DEFAULT_HOST = "https://api.wandb.ai"


def wandb_credentials_problems(cfg: JobConfig, environ: Mapping[str, str] = os.environ) -> list[Problem]:
    """`tracking` lists wandb, but W&B would find no API key: WANDB_API_KEY unset and no entry for
    its host (WANDB_BASE_URL's, api.wandb.ai by default) in the netrc file `wandb login` writes
    ($NETRC, else ~/.netrc), unless WANDB_MODE needs none. Without this check `wandb.init` raises
    its UsageError once the models are loaded, a minute or more into the run. `rldock validate` and
    `rldock train` (preflight) and the W&B log itself (WandbLog) call it."""
    if "wandb" not in cfg.tracking:
        return []
    if environ.get("WANDB_MODE", "").lower() in WANDB_KEYLESS_MODES or environ.get("WANDB_API_KEY"):
        return []
    host = urlparse(environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_HOST).hostname or ""
    netrc_file = Path(environ.get("NETRC") or Path(environ.get("HOME", "~")) / ".netrc").expanduser()
    if _netrc_has(netrc_file, host):
        return []
    return [
        Problem(
            "tracking",
            f"lists wandb, but W&B has no API key here: WANDB_API_KEY is unset and {netrc_file} has no entry "
            f"for {host}; export WANDB_API_KEY (in an RLJob: `env` from a Secret), run `wandb login`, set "
            "WANDB_MODE=offline to keep the run under the output directory, or remove wandb from tracking",
        )
    ]


def _netrc_has(path: Path, host: str) -> bool:
    try:
        return netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):  # no file, or one W&B could not read a key from either
        return False


def scalars(record: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for every finite number in `record`, nested dicts joined with "/";
    the step (`iteration`), booleans, strings and lists are skipped."""
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from scalars(value, prefix=f"{tag}/")
        elif (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and tag != "iteration"
            and math.isfinite(value)
        ):
            yield tag, float(value)


class TensorBoardLog:
    """A SummaryWriter over the run's output directory; `close` it when the attempt ends."""

    def __init__(self, output_dir: Path, *, first_step: int):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where used

        self._writer = SummaryWriter(log_dir=str(output_dir), purge_step=first_step)

    def append(self, record: Mapping[str, Any]) -> None:
        """Write a metrics record's scalars at step `record["iteration"]` and flush, so a run that
        is killed keeps what it logged (as metrics.jsonl does)."""
        step = int(record["iteration"])
        for tag, value in scalars(record):
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsLog(Protocol):
    def append(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class WandbLog:
    """A Weights & Biases run over the output directory; `close` it when the attempt ends."""

    def __init__(self, output_dir: Path, cfg: JobConfig):
        problems = wandb_credentials_problems(cfg)
        if problems:
            raise ValueError("; ".join(map(str, problems)))
        import wandb  # heavy: only where used

        id_file = output_dir / WANDB_RUN_ID_FILE
        if not id_file.is_file():
            id_file.write_text(secrets.token_hex(8))
        self._run = wandb.init(
            project=cfg.wandb.project,
            entity=cfg.wandb.entity,
            name=cfg.name,
            id=id_file.read_text().strip(),
            resume="allow",
            dir=str(output_dir),
            config=cfg.model_dump(mode="json"),
        )

    def append(self, record: Mapping[str, Any]) -> None:
        step = int(record["iteration"])
        if step < self._run.step:  # the run already holds it (module docstring)
            return
        self._run.log(dict(scalars(record)), step=step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() can return before W&B's service process has written the run's file (offline, the
        # file sometimes held only its header); teardown waits for the service to exit.
        wandb.teardown()


class Tracking:
    """Every log `tracking` names; each record goes to all of them."""

    def __init__(self, logs: Sequence[MetricsLog]):
        self._logs = list(logs)

    def append(self, record: Mapping[str, Any]) -> None:
        for log in self._logs:
            log.append(record)

    def close(self) -> None:
        for log in self._logs:
            log.close()


def open_tracking(cfg: JobConfig, output_dir: Path, *, first_step: int) -> Tracking:
    """The logs `cfg.tracking` names, opened over `output_dir`; `first_step`: the first iteration
    this attempt writes (TensorBoard's purge step)."""
    logs: list[MetricsLog] = []
    if "tensorboard" in cfg.tracking:
        logs.append(TensorBoardLog(output_dir, first_step=first_step))
    if "wandb" in cfg.tracking:
        logs.append(WandbLog(output_dir, cfg))
    return Tracking(logs)
