"""A data file missing in the pods fails the RLJob at once as PathNotFound naming the field, as a
missing model does: the runtime's preflight prints the failure line, the operator reads it from the
failed Ray job's log and does not retry up to backoffLimit."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import yaml
from rljob_testing import round_facts, spec_dict, status_of

from rldock.operator.api import RLJobSpec, RLJobStatus
from rldock.operator.observe import job_observation
from rldock.runtime.cli import main

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo-tiny.yaml"
JOB_ID = "rldock-grpo-0f5c2a6e-0"


def test_a_missing_train_file_fails_the_rljob_at_once_naming_spec_job_data_train_files(tmp_path, capsys):
    job = yaml.safe_load(EXAMPLE.read_text())
    job["model"]["path"] = str(tmp_path / "model")  # built by the runtime: only the data is missing
    job["data"] = {"train_files": ["/data/gsm8k/train.parquet"], "prompt_key": "question", "chat_template": "none"}
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    # What the operator's Ray job runs in the head pod.
    assert main(["train", str(config), "--output", str(tmp_path / "out"), "--no-progress"]) == 2
    log = capsys.readouterr().out

    observed = job_observation(JOB_ID, {"status": "FAILED", "message": ""}, previous=RLJobStatus(), log_text=log)
    status = status_of(
        round_facts(
            name="grpo",
            spec=RLJobSpec.model_validate(spec_dict()),
            ray_cluster={"state": "ready"},
            ray_job=observed,
            previous={"phase": "Running", "rayJobId": JOB_ID},
            now=datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc),
        )
    )
    failed = {c["type"]: c for c in status["conditions"]}["Failed"]
    assert status["phase"] == "Failed" and status["restartCount"] == 0
    assert (failed["status"], failed["reason"]) == ("True", "PathNotFound")
    assert "spec.job.data.train_files[0]: /data/gsm8k/train.parquet does not exist" in failed["message"]
    assert "not retried" in failed["message"]
