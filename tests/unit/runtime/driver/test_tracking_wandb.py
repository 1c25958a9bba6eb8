"""`tracking: [tensorboard, wandb]`: one record reaches both logs; the W&B run works offline with no
network, under the output directory, and its history is read back from the offline run's file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rldock.config import parse_job_config
from rldock.runtime.driver.tracking import WANDB_RUN_ID_FILE, open_tracking

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
BLOCK = 32768  # the W&B transaction log's block size (LevelDB's log format)
FULL, LAST = 1, 4  # record kinds that end a record


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of an offline run's `run-<id>.wandb`: a LevelDB-style log after a 7-byte
    header, each chunk with a 7-byte header (checksum 4, length 2, kind 1), chunks never crossing
    a 32 KiB block (a tail under 7 bytes is padding), each record a protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, rows = 7, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


def _config(tracking: list[str]):
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data.update(tracking=tracking, wandb={"project": "rldock-test"})
    return parse_job_config(data)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _records(steps):
    return [{"iteration": i, "reward_mean": i / 10, "timing": {"update": 0.5 * i}, "flag": True} for i in steps]


def test_both_logs_get_every_iteration_and_wandb_runs_offline(tmp_path, offline):
    tracking = open_tracking(_config(["tensorboard", "wandb"]), tmp_path, first_step=1)
    for record in _records([1, 2, 3]):
        tracking.append(record)
    tracking.close()
    assert list(tmp_path.glob("events.out.tfevents.*"))
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    assert [(row["_step"], row["reward_mean"], row["timing/update"]) for row in history] == [
        (1, 0.1, 0.5),
        (2, 0.2, 1.0),
        (3, 0.3, 1.5),
    ]
    assert not any("flag" in row for row in history)


def test_a_resumed_attempt_writes_into_the_same_run(tmp_path, offline):
    cfg = _config(["wandb"])
    first = open_tracking(cfg, tmp_path, first_step=1)
    for record in _records([1, 2]):
        first.append(record)
    first.close()
    again = open_tracking(cfg, tmp_path, first_step=2)  # resumed from the checkpoint after iteration 1
    for record in _records([2, 3]):
        again.append(record)
    again.close()
    run_id = (tmp_path / WANDB_RUN_ID_FILE).read_text()
    runs = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"), key=lambda path: path.parent.name)
    assert runs and all(path.name == f"run-{run_id}.wandb" for path in runs)  # one run id: synced as one run
    steps = [row["_step"] for path in runs for row in wandb_history(path)]
    # Offline, the redone iteration 2 is written again; the run, once synced, keeps the first.
    assert steps == [1, 2, 2, 3]


def test_tensorboard_alone_starts_no_wandb_run(tmp_path):
    open_tracking(_config(["tensorboard"]), tmp_path, first_step=1).close()
    assert not (tmp_path / "wandb").exists() and not (tmp_path / WANDB_RUN_ID_FILE).exists()


def test_tracking_names_are_checked():
    with pytest.raises(ValueError, match="tracking"):
        _config(["mlflow"])
