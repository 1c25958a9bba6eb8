"""The cabinet environment: each session holds its own task's files, rebuilt from the row's task seed;
commands answer what a shell would, anything else gets a message naming the commands, and only a
right `####` answer is rewarded."""

import asyncio

import pytest

from rldock.config.agent import AgentSpec
from rldock.runtime.agent.builders import build_environment
from rldock.runtime.agent.examples.cabinet import (
    COLOURS,
    THINGS,
    Cabinet,
    CabinetSession,
    build_cabinet,
    command_words,
    given_answer,
)
from rldock.runtime.agent.interfaces import EpisodeContext, Observation

REFERENCE = "rldock.runtime.agent.examples.cabinet:Cabinet"


def context(task_seed: int, *, ground_truth: str | None = None, **shape) -> EpisodeContext:
    answer = build_cabinet(task_seed, **shape).answer if ground_truth is None else ground_truth
    return EpisodeContext(ground_truth=answer, data_source="cabinet", extra_info={"task_seed": task_seed, **shape})


def opened(task_seed: int, *, seed: int = 0, environment: Cabinet | None = None, **shape) -> CabinetSession:
    session = (environment or Cabinet()).session()
    assert isinstance(session, CabinetSession)
    observation = asyncio.run(session.reset(seed=seed, episode_id=f"e{seed}", context=context(task_seed, **shape)))
    assert observation == Observation()  # the question is in the prompt: nothing to say at the start
    return session


def step(session: CabinetSession, text: str) -> Observation:
    return asyncio.run(session.step(text))


def test_the_job_config_loads_it_by_module_path():
    environment = build_environment(AgentSpec(environment={"name": REFERENCE}))
    assert isinstance(environment, Cabinet)


def test_a_demonstrated_episode_lists_reads_and_is_rewarded_for_the_right_code():
    task = build_cabinet(7)
    session = opened(7)
    listing = step(session, "ls")
    assert listing == Observation(message="\n".join(sorted(task.files)))
    assert task.file in listing.message.splitlines()
    contents = step(session, f"cat {task.file}")
    assert contents.message == task.files[task.file] and f": {task.answer}" in contents.message
    assert not contents.done and contents.reward is None
    assert step(session, f"#### {task.answer}") == Observation(reward=1.0, done=True)


@pytest.mark.parametrize(
    "text, reward",
    [
        ("#### {answer}", 1.0),
        ("The code is {answer}.\n#### {answer}.", 1.0),
        ("####{answer}", 1.0),
        ("#### 0000", 0.0),
        ("#### {answer}9", 0.0),
        ("####", 0.0),
        ("#### 1 #### {answer}", 1.0),  # the last answer counts
    ],
)
def test_any_answer_ends_the_episode_and_only_the_right_code_is_rewarded(text, reward):
    task = build_cabinet(3)
    assert step(opened(3), text.format(answer=task.answer)) == Observation(reward=reward, done=True)


def test_sessions_keep_their_own_files_apart():
    first, second = build_cabinet(1), build_cabinet(2)
    assert first.files != second.files
    one, two = opened(1), opened(2)
    # interleaved, as the rollout runs episodes
    assert step(one, "ls").message == first.listing()
    assert step(two, "ls").message == second.listing()
    assert step(two, f"cat {first.file}").message.startswith("cat: ") or first.file in second.files
    assert step(one, f"cat {first.file}").message == first.files[first.file]
    assert step(two, f"#### {first.answer}").reward == float(first.answer == second.answer)
    assert step(one, f"#### {first.answer}").reward == 1.0


def test_the_task_comes_from_the_row_not_the_reset_seed():
    # Every response of a GRPO group resets with another seed and must see the same files.
    a, b = opened(11, seed=1), opened(11, seed=2)
    assert step(a, "ls") == step(b, "ls")
    file = build_cabinet(11).file
    assert step(a, f"cat {file}") == step(b, f"cat {file}")


def test_a_task_is_a_pure_function_of_its_seed_and_shape():
    assert build_cabinet(5) == build_cabinet(5)
    assert build_cabinet(5) != build_cabinet(6)
    assert build_cabinet(5, num_files=3, num_lines=2) == build_cabinet(5, num_files=3, num_lines=2)
    tasks = [build_cabinet(seed) for seed in range(200)]
    assert len({task.question for task in tasks}) > 40 and len({task.answer for task in tasks}) > 150


@pytest.mark.parametrize("num_files, num_lines", [(1, 1), (4, 3), (len(THINGS), len(COLOURS))])
def test_the_question_asks_for_one_line_of_one_file(num_files, num_lines):
    for seed in range(50):
        task = build_cabinet(seed, num_files=num_files, num_lines=num_lines)
        assert len(task.files) == num_files
        assert all(len(content.splitlines()) == num_lines for content in task.files.values())
        colour, thing = task.question.removeprefix("What is the code of the ").removesuffix("?").split(" ", 1)
        assert f"{colour}: {task.answer}" in task.files[task.file].splitlines()
        assert task.file.startswith(dict(THINGS)[thing] + "_")
        # the answer and the file's number are only in the files
        assert task.answer not in task.prompt and task.file not in task.prompt


@pytest.mark.parametrize(
    "text, says",
    [
        ("", "An empty turn runs nothing. Run `ls`"),
        ("   \n  ", "An empty turn runs nothing."),
        ("rm -rf /", "Unknown command `rm -rf /`. Run `ls` to list the files, `cat <file>`"),
        ("cat", "cat: name a file"),
        ("cat nothing.txt", "cat: nothing.txt: No such file; `ls` lists the files."),
        ("cat 'unclosed", "cat: 'unclosed: No such file"),
        ("I think the answer is the blue one", "Unknown command `I think the answer is the blue one`"),
        ("x" * 500, "Unknown command `" + "x" * 40 + "`."),
        ('<tool_call>{"name": "ls"}</tool_call>', "Unknown command"),
    ],
)
def test_anything_else_gets_a_message_naming_the_commands_never_an_error(text, says):
    observation = step(opened(4), text)
    assert says in observation.message
    assert not observation.done and observation.reward is None
    assert len(observation.message) < 200


@pytest.mark.parametrize("text", ["$ ls", "`ls`", "ls -l", "  ls\nthen cat", "ls\n"])
def test_a_command_is_the_first_line_as_a_shell_splits_it(text):
    assert step(opened(4), text).message == build_cabinet(4).listing()


def test_cat_prints_every_file_named():
    task = build_cabinet(9)
    names = sorted(task.files)[:2]
    assert step(opened(9), f'cat {names[0]} "{names[1]}"').message == "\n".join(task.files[n] for n in names)


def test_answer_and_command_parsing():
    assert given_answer("no mark") is None and given_answer("#### ") == ""
    assert given_answer("#### **1234**,") == "1234"
    assert command_words("$ cat  a.txt") == ["cat", "a.txt"] and command_words("") == []


def test_a_row_without_a_task_seed_or_with_another_answer_is_a_data_error():
    session = Cabinet().session()
    without = EpisodeContext(ground_truth="1", data_source="cabinet", extra_info={})
    with pytest.raises(ValueError, match="extra_info needs an integer `task_seed`"):
        asyncio.run(session.reset(seed=0, episode_id="e", context=without))
    with pytest.raises(ValueError, match="ground truth '0' is not the answer of its task"):
        asyncio.run(session.reset(seed=0, episode_id="e", context=context(3, ground_truth="0")))


def test_a_shape_the_word_lists_cannot_fill_is_refused():
    with pytest.raises(ValueError, match="1 to 8 files of 1 to 6 lines, got 9 files"):
        build_cabinet(0, num_files=9)
    with pytest.raises(ValueError, match="got 4 files of 0 lines"):
        build_cabinet(0, num_lines=0)


def test_a_step_before_the_reset_is_a_bug():
    with pytest.raises(RuntimeError, match="step before reset"):
        step(CabinetSession(), "ls")


def test_with_read_reward_the_first_cat_of_the_right_file_is_rewarded_once():
    task = build_cabinet(7)
    other = next(name for name in task.files if name != task.file)
    environment = build_environment(AgentSpec(environment={"name": REFERENCE, "options": {"read_reward": "0.25"}}))
    assert isinstance(environment, Cabinet)
    session = opened(7, environment=environment)
    assert step(session, "ls").reward is None
    assert step(session, f"cat {other}").reward is None  # the wrong file earns nothing
    read = step(session, f"cat {task.file}")
    assert read.reward == 0.25 and read.message == task.files[task.file] and not read.done
    assert step(session, f"cat {task.file}").reward is None  # once per episode
    assert step(session, f"#### {task.answer}") == Observation(reward=1.0, done=True)


@pytest.mark.parametrize("value", ["x", "2", "-0.5"])
def test_a_read_reward_that_is_no_reward_in_0_1_is_refused(value):
    with pytest.raises(ValueError, match="read_reward"):
        Cabinet(read_reward=value)
