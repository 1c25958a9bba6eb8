"""`function` terms: the user's function loaded from a file or a module, with clear errors."""

import sys
import textwrap

import pytest

from rldock.config import RewardSpec
from rldock.runtime.rewards import RewardError, RewardScorer
from rldock.runtime.rewards.function import load_function

USER_FILE = textwrap.dedent('''
    def score(data_source, solution_str, ground_truth, extra_info):
        """1 for the answer, plus what it saw as metrics."""
        correct = float(solution_str.strip() == ground_truth)
        return {"score": correct, "length": len(solution_str), "pred": solution_str,
                "bonus": extra_info.get("bonus", 0)}

    def by_source(data_source, solution_str, ground_truth, extra_info):
        return 0.5 if data_source == "easy" else 1

    def wrong_type(data_source, solution_str, ground_truth, extra_info):
        return "1.0"

    def no_score(data_source, solution_str, ground_truth, extra_info):
        return {"accuracy": 1.0}

    def boom(data_source, solution_str, ground_truth, extra_info):
        raise KeyError("answer")

    NOT_CALLABLE = 3
''')


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return path


def _scorer(reference: str, *, on_error: str = "fail") -> RewardScorer:
    return RewardScorer(RewardSpec(terms=[{"name": "function", "function": reference}], on_error=on_error))


def test_function_from_a_file_returning_a_dict_gives_the_score_and_numeric_metrics(user_file):
    scored = _scorer(f"{user_file}:score").score(["42", " 41"], ["42", "42"], ["gsm8k", "gsm8k"], [{"bonus": 2}, {}])
    assert scored.scores.tolist() == [1.0, 0.0]
    # "pred" is a string: not a metric; numeric keys are means over the samples that returned them.
    assert scored.metrics == {
        "reward/function": 0.5,
        "reward/function/length": 2.5,
        "reward/function/bonus": 1.0,
        "reward/errors": 0.0,
    }


def test_function_from_a_module_on_the_python_path(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    monkeypatch.delitem(sys.modules, "my_reward", raising=False)
    scored = _scorer("my_reward:by_source").score(["1", "2"], ["1", "1"], ["easy", "hard"], [{}, {}])
    assert scored.scores.tolist() == [0.5, 1.0]


def test_two_files_with_the_same_name_do_not_collide(tmp_path):
    for folder, value in (("a", 0.25), ("b", 0.75)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "reward.py").write_text(f"def f(*args):\n    return {value}\n")
    first, second = (load_function(str(tmp_path / d / "reward.py") + ":f", "reward.terms[0]") for d in "ab")
    assert (first("", "", "", {}), second("", "", "", {})) == (0.25, 0.75)


def test_a_relative_file_is_found_from_the_working_directory(user_file, monkeypatch):
    monkeypatch.chdir(user_file.parent)
    assert load_function("my_reward.py:by_source", "reward.terms[0]")("easy", "", "", {}) == 0.5


@pytest.mark.parametrize(
    "reference, words",
    [
        ("{dir}/missing.py:score", r"reward.terms\[0\].function: no file .*missing.py"),
        ("{dir}/my_reward.py:nope", r"has no attribute 'nope'; its functions: \[.*'boom'.*'score'"),
        ("{dir}/my_reward.py:NOT_CALLABLE", r"is a int, not a function"),
        ("rldock_no_such_module.rewards:score", r"cannot import module 'rldock_no_such_module.rewards'"),
    ],
)
def test_loading_errors_name_the_term_and_the_reference(user_file, reference, words):
    with pytest.raises(RewardError, match=words):
        _scorer(reference.format(dir=user_file.parent))


def test_a_file_that_fails_to_import_names_the_file(tmp_path):
    (tmp_path / "broken.py").write_text("import rldock_no_such_dependency\n")
    with pytest.raises(RewardError, match=r"importing .*broken.py failed: ModuleNotFoundError"):
        _scorer(f"{tmp_path}/broken.py:score")


@pytest.mark.parametrize(
    "fn, words",
    [
        ("wrong_type", r"reward.terms\[0\] \(function .*my_reward.py:wrong_type\) returned str '1.0'"),
        ("no_score", r"returned a dict whose \"score\" is None"),
    ],
)
def test_a_wrong_return_type_fails_naming_the_function_even_with_on_error_zero(user_file, fn, words):
    with pytest.raises(RewardError, match=words):
        _scorer(f"{user_file}:{fn}", on_error="zero").score(["1"], ["1"], ["s"], [{}])


def test_a_raising_function_fails_naming_the_term_the_data_source_and_the_cause(user_file):
    with pytest.raises(
        RewardError,
        match=r"reward.terms\[0\] \(function .*:boom\) failed on a sample from "
        r"data_source 'gsm8k': KeyError: 'answer'",
    ) as caught:
        _scorer(f"{user_file}:boom").score(["1"], ["1"], ["gsm8k"], [{}])
    assert isinstance(caught.value.__cause__, KeyError)
