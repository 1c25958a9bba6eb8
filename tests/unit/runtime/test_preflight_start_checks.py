"""What used to pass `rldock validate` and then stop `rldock train` minutes later is refused by
validate, naming the field and the fix; each test then shows train's own code meeting the same
check (the same function, called where train would have failed) with the same message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rldock.config import parse_job_config
from rldock.runtime.cli import main
from rldock.runtime.data import Columns, PromptDataset, load_rows
from rldock.runtime.data.dataset import PromptsTooLong
from rldock.runtime.data.rendering import chat_template_problem
from rldock.runtime.driver.tracking import WandbLog
from rldock.runtime.models.loading import load_tokenizer
from rldock.runtime.models.tiny import build_tiny_model
from rldock.runtime.workers import cluster
from rldock.runtime.workers.ray_devices import device_request, local_device_problems

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo-tiny.yaml"


def _write_job(tmp_path: Path, job: dict) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def _demo(**changes) -> dict:
    job = yaml.safe_load(EXAMPLE.read_text())
    job.update(changes)
    return job


def _refusals(capsys, config: str, tmp_path: Path) -> tuple[str, str]:
    """The messages of `validate` and of `train` (both must refuse, before anything starts)."""
    assert main(["validate", config]) == 2
    validate = capsys.readouterr().err
    assert main(["train", config, "--output", str(tmp_path / "out")]) == 2
    train = capsys.readouterr().err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    return validate, train


@pytest.fixture
def no_wandb_key(monkeypatch, tmp_path):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    return tmp_path / "netrc"


def test_wandb_without_an_api_key_is_refused_by_validate_and_by_the_wandb_log(no_wandb_key, tmp_path, capsys):
    config = _write_job(tmp_path, _demo(tracking=["wandb"]))
    validate, train = _refusals(capsys, config, tmp_path)
    expected = (
        f"tracking: lists wandb, but W&B has no API key here: WANDB_API_KEY is unset and {no_wandb_key} has no "
        "entry for api.wandb.ai; export WANDB_API_KEY"
    )
    assert expected in validate and expected in train
    # The trainer's own W&B log meets the same check before wandb.init (which raised its UsageError
    # after the models were loaded).
    with pytest.raises(ValueError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")):
        WandbLog(tmp_path, parse_job_config(_demo(tracking=["wandb"])))


@pytest.mark.parametrize(
    "env, netrc",
    [
        ({"WANDB_API_KEY": "k" * 40}, ""),
        ({"WANDB_MODE": "offline"}, ""),
        ({"WANDB_MODE": "disabled"}, ""),
        ({}, "machine api.wandb.ai login user password " + "k" * 40 + "\n"),
        ({"WANDB_BASE_URL": "https://wandb.example.com"}, "machine wandb.example.com login u password p\n"),
    ],
)
def test_wandb_finds_its_key_where_wandb_does(no_wandb_key, monkeypatch, tmp_path, capsys, env, netrc):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    no_wandb_key.write_text(netrc)
    assert main(["validate", _write_job(tmp_path, _demo(tracking=["wandb"]))]) == 0


def _rows_file(tmp_path: Path, prompt) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": prompt, "answer": "2"}) + "\n" for _ in range(3)))
    return str(path)


def test_chat_messages_with_chat_template_none_are_refused_by_validate_as_by_the_loader(tmp_path, capsys):
    messages = [{"role": "user", "content": "1+1="}]
    train_file = _rows_file(tmp_path, messages)
    config = _write_job(tmp_path, _demo(data={"train_files": [train_file], "chat_template": "none"}))
    validate, train = _refusals(capsys, config, tmp_path)
    problem = chat_template_problem(messages, "none")
    assert problem is not None and "data.chat_template is none" in problem and "data.prompt_key" in problem
    assert f"data.chat_template: data.prompt_key 'prompt' holds chat messages in {train_file}" in validate
    assert problem in validate and problem in train
    # Where train met it: building the prompt set from the loaded rows.
    rows = load_rows([train_file], Columns(prompt="prompt", answer="answer"))
    with pytest.raises(ValueError, match="row 0: a prompt of chat messages needs a chat template"):
        PromptDataset(rows, tokenizer=None, spec=parse_job_config(_demo()).data, max_prompt_length=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), texts=["0123456789+="], seed=0)


def test_every_prompt_too_long_is_refused_by_validate_with_the_prompt_sets_own_message(model_dir, tmp_path, capsys):
    train_file = _rows_file(tmp_path, "12345+67890=")  # BOS + 12 characters: 13 tokens
    job = _demo(data={"train_files": [train_file], "chat_template": "none"}, model={"path": str(model_dir)})
    validate, train = _refusals(capsys, _write_job(tmp_path, job), tmp_path)
    expected = (
        f"algorithm.max_prompt_length: all 3 prompts of ['{train_file}'] are longer than "
        "algorithm.max_prompt_length=8 tokens after the chat template (the shortest has 13)"
    )
    assert expected in validate and expected in train
    # The trainer's prompt set, built after the models are loaded, refuses it with the same words.
    rows = load_rows([train_file], Columns(prompt="prompt", answer="answer"))
    with pytest.raises(PromptsTooLong) as raised:
        PromptDataset(rows, tokenizer=load_tokenizer(model_dir), spec=parse_job_config(job).data, max_prompt_length=8)
    assert f"algorithm.max_prompt_length: {raised.value}" in validate
    # One prompt that fits is enough: the longer ones are dropped and counted at start.
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(Path(train_file).read_text() + json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    job["data"]["train_files"] = [str(mixed)]
    assert main(["validate", _write_job(tmp_path, job)]) == 0


def test_held_out_files_with_evaluation_off_are_refused_by_validate_and_train(tmp_path, capsys):
    data = {"train_files": [_rows_file(tmp_path, "1+1=")], "val_files": [_rows_file(tmp_path, "1+1=")]}
    validate, train = _refusals(capsys, _write_job(tmp_path, _demo(data={**data, "chat_template": "none"})), tmp_path)
    expected = "evaluation.interval: data.val_files lists 1 held-out file(s), but evaluation.interval is 0"
    assert expected in validate and expected in train


@pytest.fixture
def no_gpu(monkeypatch):
    import torch

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_gpus_asked_of_a_local_ray_on_a_machine_without_any_are_refused_by_validate_and_connect(
    no_gpu, tmp_path, capsys
):
    job = _demo(resources={"accelerator_resource": "GPU", "devices_per_node": 8})
    validate, train = _refusals(capsys, _write_job(tmp_path, job), tmp_path)
    expected = (
        "resources.accelerator_resource: GPU asks for NVIDIA GPUs, and this machine shows none "
        "(torch.cuda.is_available() is false); on a machine without GPUs set resources.accelerator_resource to NPU"
    )
    assert expected in validate and expected in train
    # Where train met it: starting the local Ray (which asserted "GPU cannot be a custom resource").
    with pytest.raises(ValueError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")):
        cluster.connect(parse_job_config(job))


def test_a_gpu_count_a_local_ray_cannot_have_names_devices_per_node(monkeypatch):
    import torch

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    job = _demo(resources={"accelerator_resource": "GPU", "devices_per_node": 8})
    job["training"]["data_parallel_size"] = 2
    (problem,) = local_device_problems(parse_job_config(job))
    assert problem.path == "resources.devices_per_node" and "this machine shows 2" in problem.message
    job["resources"]["devices_per_node"] = 2
    assert local_device_problems(parse_job_config(job)) == []
    # On an existing Ray its nodes hold the devices: nothing is checked here.
    job["resources"]["devices_per_node"] = 8
    assert local_device_problems(parse_job_config(job), environ={"RAY_ADDRESS": "ray://head:10001"}) == []


def test_the_demos_npu_setting_needs_no_gpu(no_gpu):
    assert local_device_problems(parse_job_config(_demo())) == []


@pytest.mark.parametrize(
    "accelerator, amount, options",
    [
        ("GPU", 0.5, {"num_gpus": 0.5}),  # Ray's built-in: never a custom resource
        ("NPU", 0.5, {"resources": {"NPU": 0.5}}),  # the default, as before
        ("NPU", 8, {"resources": {"NPU": 8}}),
    ],
)
def test_gpus_are_requested_as_num_gpus_and_other_accelerators_as_custom_resources(accelerator, amount, options):
    assert device_request(accelerator, amount) == options
