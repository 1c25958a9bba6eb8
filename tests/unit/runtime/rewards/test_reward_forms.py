"""A user's reward function in verl's form or TRL's batch form, told apart by its signature: the same
decision on the loaded function (the reward worker) and on its source (`rldock validate`), and the
same refusal from both when it fits neither (or is no function). Both forms scored through the
reward worker: tests/unit/runtime/workers/test_reward_worker_forms.py."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

from rldock.config import RewardSpec
from rldock.runtime.cli import main
from rldock.runtime.rewards import RewardError, RewardScorer
from rldock.runtime.rewards.forms import EXPECTED_FORMS, TrlForm, VerlForm, form_of, signature_of

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "grpo-tiny.yaml"

# (source of `f`, the form it has): each decided once on the function and once on its source.
SIGNATURES = [
    ("def f(data_source, solution_str, ground_truth, extra_info): ...", VerlForm),
    ("def f(data_source, solution_str, ground_truth, extra_info=None, **kwargs): ...", VerlForm),
    ("def f(*args): ...", VerlForm),
    ("def f(completions, **kwargs): ...", TrlForm),
    ("def f(prompts, completions, answer, **kwargs): ...", TrlForm),
    ("def f(completions, answer): ...", TrlForm),
    ("def f(*, completions, **kwargs): ...", TrlForm),
    ("def f(**kwargs): ...", TrlForm),
    ("def f(answer, **kwargs): ...", TrlForm),
    ("def f(solution_str): ...", None),
    ("def f(a, b, c, d, e): ...", None),
    ("def f(completions, /, **kwargs): ...", None),
]


@pytest.mark.parametrize("source, form", SIGNATURES)
def test_the_form_is_the_same_from_the_function_and_from_its_source(source, form):
    namespace: dict = {}
    exec(source, namespace)
    (definition,) = ast.parse(source).body
    assert isinstance(definition, ast.FunctionDef)
    assert form_of(inspect.signature(namespace["f"])) is form
    assert form_of(signature_of(definition)) is form


USER_FILE = textwrap.dedent("""
    def verl_digits(data_source, solution_str, ground_truth, extra_info):
        return float(solution_str.strip() == ground_truth)

    def trl_digits(prompts, completions, answer, **kwargs):
        return [float(text.strip() == str(truth)) for text, truth in zip(completions, answer)]

    def wrong(solution_str):
        return 1.0

    compute_score = 3
""")


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return path


def _job(tmp_path: Path, reference: str) -> Path:
    config = tmp_path / "job.yaml"
    config.write_text(
        EXAMPLE.read_text().replace("    - name: digit_match", f"    - {{name: function, function: '{reference}'}}")
    )
    return config


@pytest.mark.parametrize(
    "name, says",
    [
        ("wrong", f"takes (solution_str), which fits neither reward form: {EXPECTED_FORMS}"),
        ("compute_score", "is a int, not a function"),
    ],
)
def test_validate_refuses_what_the_reward_worker_would_refuse_with_the_same_message(
    user_file, tmp_path, capsys, name, says
):
    reference = f"{user_file}:{name}"
    assert main(["validate", str(_job(tmp_path, reference))]) == 2
    expected = f"reward.terms[0].function: {reference} {says}"
    assert expected in capsys.readouterr().err
    # What `rldock train` would have met: the reward worker (and the trainer, before any model work)
    # builds the same term and refuses it with the same message.
    with pytest.raises(RewardError) as raised:
        RewardScorer(RewardSpec(terms=[{"name": "function", "function": reference}]))
    assert str(raised.value) == expected


@pytest.mark.parametrize("name", ["verl_digits", "trl_digits"])
def test_validate_accepts_both_forms(user_file, tmp_path, name):
    assert main(["validate", str(_job(tmp_path, f"{user_file}:{name}"))]) == 0
