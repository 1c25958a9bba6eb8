"""The `cabinet` environment: a small directory of files the model must look through, one shell command
per turn, before it can answer (docs/results.md#a-stateful-environment-smollm2-135m-instruct-looks-through-files).

Each task is a pure function of its seed (`build_cabinet`): a few files named `<things>_<nn>.txt`
(`lockers_58.txt`), each listing a few colours with a 4-digit code (`blue: 1937`), and the question
"What is the code of the blue locker?". The files' numbers and codes exist only in the environment,
so no answer can be had from the prompt: the model runs `ls` to learn the file names, `cat
lockers_58.txt` to read the right one, and answers `#### 1937`. Nothing is computed, only looked up
and copied, which is what a 135M model can learn to do.

A session builds its task at the reset from the row's `extra_info` (`task_seed`, `num_files`,
`num_lines`), so every response of a GRPO group sees the same files and the row's ground truth is
the task's answer (a row whose ground truth disagrees is a data error). Every turn without `####`
is a command; one with `####` is the answer and ends the episode with reward 1.0 when right, 0.0
when not. A command it does not know gets a message saying what it can run, never an error.

With the option `read_reward` (`--option read_reward=0.2` to `rldock env serve`, or
`agent.environment.options`), the first `cat` of the file that answers the question is rewarded too, a
reward per step for turn-level credit (docs/algorithms/turn-credit.md); by default only the answer is.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rldock.runtime.agent.interfaces import Environment, EnvironmentSession, EpisodeContext, Observation

# (singular, plural): the question names one thing, its file the plural.
THINGS = (
    ("door", "doors"),
    ("locker", "lockers"),
    ("safe", "safes"),
    ("drawer", "drawers"),
    ("gate", "gates"),
    ("vault", "vaults"),
    ("box", "boxes"),
    ("suitcase", "suitcases"),
)
COLOURS = ("red", "blue", "green", "black", "white", "yellow")
NUM_FILES, NUM_LINES = 4, 3  # the defaults of a task's shape
INSTRUCTIONS = (
    "You are in a directory of files. Run one shell command per turn: `ls` lists the files, `cat <file>` "
    "prints one. When you know the answer, reply with `#### <answer>`."
)
ANSWER_MARK = "####"
_ECHO_CHARS = 40  # of a command it does not know, the part said back to the model


@dataclass(frozen=True)
class Task:
    """One task: the files (name -> content), the question, the file that answers it and the answer."""

    files: dict[str, str]
    question: str
    file: str
    answer: str

    @property
    def prompt(self) -> str:
        """The prompt's text: what the model can do, then the question."""
        return f"{INSTRUCTIONS}\n\n{self.question}"

    def listing(self) -> str:
        return "\n".join(sorted(self.files))


def build_cabinet(task_seed: int, *, num_files: int = NUM_FILES, num_lines: int = NUM_LINES) -> Task:
    """The task of `task_seed`: `num_files` files of `num_lines` colour codes each; the question asks for
    one of them. A ValueError names a shape the word lists cannot fill."""
    if not 1 <= num_files <= len(THINGS) or not 1 <= num_lines <= len(COLOURS):
        raise ValueError(
            f"a cabinet has 1 to {len(THINGS)} files of 1 to {len(COLOURS)} lines, got {num_files} files of "
            f"{num_lines} lines"
        )
    rng = np.random.default_rng([task_seed, num_files, num_lines])
    things = rng.choice(len(THINGS), size=num_files, replace=False)
    numbers = rng.choice(np.arange(10, 100), size=num_files, replace=False)
    files: dict[str, str] = {}
    codes: dict[str, dict[str, str]] = {}  # file -> colour -> code
    for thing, number in zip(things.tolist(), numbers.tolist()):
        colours = rng.choice(len(COLOURS), size=num_lines, replace=False)
        values = rng.integers(1000, 10000, size=num_lines)
        name = f"{THINGS[thing][1]}_{number}.txt"
        codes[name] = {COLOURS[c]: str(v) for c, v in zip(colours.tolist(), values.tolist())}
        files[name] = "\n".join(f"{colour}: {code}" for colour, code in codes[name].items())
    asked = int(rng.integers(num_files))
    file = list(files)[asked]
    colour = list(codes[file])[int(rng.integers(num_lines))]
    question = f"What is the code of the {colour} {THINGS[int(things[asked])][0]}?"
    return Task(files=files, question=question, file=file, answer=codes[file][colour])


def task_of(extra_info: Mapping[str, Any]) -> dict[str, int]:
    """`build_cabinet`'s arguments from a row's extra_info (`task_seed`, and `num_files`/`num_lines` where
    the row sets them); a ValueError says what is missing."""
    if not isinstance(extra_info.get("task_seed"), int):
        raise ValueError(
            f"cabinet: the row's extra_info needs an integer `task_seed` (data.extra_info_key; `rldock data "
            f"generate cabinet` writes it), got {dict(extra_info)!r:.200}"
        )
    return {
        "task_seed": extra_info["task_seed"],
        "num_files": int(extra_info.get("num_files", NUM_FILES)),
        "num_lines": int(extra_info.get("num_lines", NUM_LINES)),
    }


def given_answer(text: str) -> str | None:
    """What follows the last `####` in `text` (its first word, without punctuation around it); None when
    the turn has no `####`, "" when nothing follows it."""
    if ANSWER_MARK not in text:
        return None
    words = text.rsplit(ANSWER_MARK, 1)[1].split()
    return words[0].strip(".,;:!?`*'\"") if words else ""


def command_words(text: str) -> list[str]:
    """The command of a turn: its first non-empty line, as a shell would split it (a `$ ` prompt and
    backticks around it dropped)."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    line = line.strip("`").strip()
    if line.startswith("$"):
        line = line[1:].strip()
    try:
        return shlex.split(line)
    except ValueError:  # an unclosed quote: split on white space instead
        return line.split()


def run(task: Task, text: str) -> Observation:
    """The observation of one turn: the answer's reward (and done), or a command's output."""
    answer = given_answer(text)
    if answer is not None:
        return Observation(reward=float(answer == task.answer), done=True)
    words = command_words(text)
    if not words:
        return Observation(message=usage("An empty turn runs nothing."))
    name, arguments = words[0], words[1:]
    if name == "ls":
        return Observation(message=task.listing())
    if name == "cat":
        if not arguments:
            return Observation(message="cat: name a file, e.g. `cat <file>`; `ls` lists them.")
        missing = "cat: {}: No such file; `ls` lists the files."
        return Observation(message="\n".join(task.files.get(a, missing.format(a[:_ECHO_CHARS])) for a in arguments))
    return Observation(message=usage(f"Unknown command `{' '.join(words)[:_ECHO_CHARS]}`."))


def usage(opening: str) -> str:
    return f"{opening} Run `ls` to list the files, `cat <file>` to print one, or answer with `#### <answer>`."


class CabinetSession(EnvironmentSession):
    """One episode: the task rebuilt from its row at the reset, then each turn run against its files;
    `read_reward` for the first turn that prints the file holding the answer."""

    def __init__(self, read_reward: float = 0.0) -> None:
        self.task: Task | None = None
        self.read_reward, self.read = read_reward, False

    async def reset(self, *, seed: int, episode_id: str, context: EpisodeContext) -> Observation:
        # The task comes from the row, not from `seed`: `seed` differs between the responses of a group,
        # which must all see the same files.
        task = build_cabinet(**task_of(context.extra_info))
        if task.answer != context.ground_truth.strip():
            raise ValueError(
                f"cabinet: the row's ground truth {context.ground_truth!r:.40} is not the answer of its task "
                f"{dict(context.extra_info)} ({task.answer}); were the rows made by another version of "
                "`rldock data generate cabinet`?"
            )
        self.task = task
        return Observation()  # the question is in the prompt

    async def step(self, text: str) -> Observation:
        if self.task is None:
            raise RuntimeError("cabinet: step before reset")
        observation = run(self.task, text)
        words = command_words(text)
        if self.read_reward and not self.read and words[:1] == ["cat"] and self.task.file in words[1:]:
            self.read = True
            return Observation(message=observation.message, reward=self.read_reward)
        return observation


class Cabinet(Environment):
    """The cabinet environment: one session per episode, each with its own task's files; the task's shape
    is in each row. `read_reward` (a number, 0 by default): the reward of the first `cat` of the file that
    answers the question."""

    def __init__(self, read_reward: str | float = 0.0) -> None:
        try:
            self.read_reward = float(read_reward)
        except ValueError:
            raise ValueError(f"read_reward must be a number, got {read_reward!r}") from None
        if not 0 <= self.read_reward <= 1:
            raise ValueError(f"read_reward must be within [0, 1], got {self.read_reward:g}")

    def session(self) -> EnvironmentSession:
        return CabinetSession(self.read_reward)
