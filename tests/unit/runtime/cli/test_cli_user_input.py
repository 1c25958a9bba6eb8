"""`rldock validate` and `rldock train` on a user's own files: the SmolLM2 example's `~` paths resolve
under a fresh HOME (a tiny model with a real tokenizer standing in for the imported one), and every
input they cannot use is refused in one line naming the field and the fix, never with a traceback."""

from __future__ import annotations

import json
import shutil
import string
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from rldock.runtime.cli import main
from rldock.runtime.models.tiny import build_tiny_model

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "grpo-smollm2-math.yaml"
MODEL = "~/.cache/rldock/models/SmolLM2-135M-Instruct"  # where the example's header imports it
# The header's data command, smaller; the tiny model's character tokenizer makes the rendered prompts
# about 170 tokens, more than the example's max_prompt_length is set for SmolLM2's tokenizer.
GENERATE = "data generate word_problems --operations add,subtract --max-number 9 --num-train 16 --num-val 4"
LONGER_PROMPTS = ["--set", "algorithm.max_prompt_length=256"]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("home")
    model = home / MODEL.removeprefix("~/")
    build_tiny_model(model, texts=[string.printable], seed=0, max_position_embeddings=512)
    output = str(home / ".cache/rldock/data/word-problems-easy")
    assert main([*GENERATE.split(), "--seed", "0", "--output", output]) == 0
    return home


@pytest.fixture
def at_home(home, monkeypatch) -> Path:
    monkeypatch.setenv("HOME", str(home))
    return home


def test_validate_resolves_the_examples_home_paths(at_home, capsys):
    capsys.readouterr()
    assert main(["validate", str(EXAMPLE), *LONGER_PROMPTS, "--print"]) == 0
    out = capsys.readouterr().out
    assert f"path: {at_home}/.cache/rldock/models/SmolLM2-135M-Instruct" in out and "~" not in out
    assert out.splitlines()[-1].endswith("paths checked")


def _model_with(change: Callable[[Path], object]) -> Callable[[Path], list[str]]:
    """The overrides pointing model.path at a copy of the tiny model under HOME, `change` applied."""

    def overrides(home: Path) -> list[str]:
        (home / "broken").mkdir(exist_ok=True)
        folder = Path(tempfile.mkdtemp(dir=home / "broken"))
        shutil.copytree(home / MODEL.removeprefix("~/"), folder, dirs_exist_ok=True)
        change(folder)
        return [f"model.path=~/broken/{folder.name}"]

    return overrides


def _write(name: str, content: bytes) -> Callable[[Path], object]:
    return lambda folder: (folder / name).write_bytes(content)


def _remove(name: str) -> Callable[[Path], object]:
    return lambda folder: (folder / name).unlink()


def _file_at_home(home: Path, name: str, content: bytes) -> str:
    (home / name).write_bytes(content)
    return f"~/{name}"


def _bad_data(home: Path) -> list[str]:
    return [f"data.train_files=[{_file_at_home(home, 'bad.jsonl', b'{oops')}]"]


def _reward_file_with_null_bytes(home: Path) -> list[str]:
    file = _file_at_home(home, "nul.py", b"def score(a, b, c, d):\x00 return 0")
    return [f"reward.terms=[{{name: function, function: '{file}:score'}}]"]


# (case, the --set overrides under a HOME, the problem's field, words of its message)
CASES: list[tuple[str, Callable[[Path], list[str]], str, str]] = [
    ("no-tokenizer-json", _model_with(_remove("tokenizer.json")), "model.path", "has no tokenizer.json"),
    ("tokenizer-json-not-json", _model_with(_write("tokenizer.json", b"{oops")), "model.path", "cannot be loaded"),
    (
        "tokenizer-json-of-another-shape",
        _model_with(_write("tokenizer.json", json.dumps({"model": 3}).encode())),
        "model.path",
        "cannot be loaded",
    ),
    ("config-json-not-json", _model_with(_write("config.json", b"{oops")), "model.path", "is not valid JSON"),
    (
        "unknown-model-type",
        _model_with(_write("config.json", json.dumps({"model_type": "nope"}).encode())),
        "model.path",
        "model_type 'nope'",
    ),
    ("no-weights", _model_with(_remove("model.safetensors")), "model.path", "holds no weights"),
    (
        "unset-variable",
        lambda home: ["data.train_files=[$RLDOCK_NOT_SET/train.jsonl]"],
        "data.train_files[0]",
        "$RLDOCK_NOT_SET is not set",
    ),
    ("data-not-json", _bad_data, "data.train_files[0]", "is not JSON"),
    ("reward-file-with-null-bytes", _reward_file_with_null_bytes, "reward.terms[0].function", "null bytes"),
]


@pytest.mark.parametrize("command", ["validate", "train"])
@pytest.mark.parametrize(("name", "overrides", "field", "words"), CASES, ids=[case[0] for case in CASES])
def test_a_bad_input_is_one_line_naming_the_field(at_home, tmp_path, capsys, command, name, overrides, field, words):
    args = [arg for override in overrides(at_home) for arg in ("--set", override)]
    output = ["--output", str(tmp_path / "run")] if command == "train" else []
    capsys.readouterr()
    assert main([command, str(EXAMPLE), *LONGER_PROMPTS, *args, *output]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"invalid job config {EXAMPLE}:"
    assert [line.split(": ")[0] for line in lines[1:]] == [f"  - {field}"], lines
    assert words in lines[1]
    assert not (tmp_path / "run").exists()  # train refused before it wrote anything


@pytest.mark.parametrize(
    ("config", "words"),
    [(lambda tmp: tmp, "cannot be read: Is a directory"), (lambda tmp: tmp / "bin.yaml", "not UTF-8 text")],
    ids=["a-directory", "not-utf8"],
)
def test_a_config_file_that_cannot_be_read_is_named(tmp_path, capsys, config, words):
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe name: x")
    assert main(["validate", str(config(tmp_path))]) == 2
    assert words in capsys.readouterr().err


def test_the_command_prints_no_traceback(at_home, tmp_path):
    """The installed entry point, as a user runs it: the refusal and nothing else on stderr."""
    (override,) = _model_with(_write("tokenizer.json", b"{oops"))(at_home)
    job = subprocess.run(
        [sys.executable, "-m", "rldock.runtime.cli", "validate", str(EXAMPLE), "--set", override],
        capture_output=True,
        text=True,
        env={"HOME": str(at_home), "PATH": "/usr/bin:/bin"},
        timeout=120,
        check=False,
    )
    assert job.returncode == 2
    assert "Traceback" not in job.stderr
    problems = [line for line in job.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1 and problems[0].startswith("  - model.path: the tokenizer in"), job.stderr
