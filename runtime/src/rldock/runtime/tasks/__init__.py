"""Verifiable tasks by name: `make_task(spec, seed)` builds the generated prompt set."""

from __future__ import annotations

from typing import Callable

from rldock.config.job import TaskSpec
from rldock.runtime.tasks.addition import AdditionTask
from rldock.runtime.registry import Registry
from rldock.runtime.tasks.base import Example, PreferencePair, PromptSampler, Task

TaskFactory = Callable[[TaskSpec, int], Task]

TASKS: Registry[TaskFactory] = Registry("task", field="task.name")


@TASKS.register("addition")
def _addition(spec: TaskSpec, seed: int) -> Task:
    return AdditionTask(max_operand=spec.max_operand, num_prompts=spec.num_prompts, seed=seed)


def make_task(spec: TaskSpec, seed: int) -> Task:
    """The task named by `spec.name`, its prompt set generated from `seed`."""
    return TASKS.get(spec.name)(spec, seed)


__all__ = ["TASKS", "AdditionTask", "Example", "PreferencePair", "PromptSampler", "Task", "make_task"]
