"""Tests of the task registry, the addition task and the prompt sampler."""

import pytest

from rldock.config.job import TaskSpec
from rldock.runtime.tasks import AdditionTask, PromptSampler, make_task
from rldock.runtime.tasks.addition import ALPHABET


def test_make_task_builds_addition_with_the_spec_sizes():
    task = make_task(TaskSpec(name="addition", max_operand=9, num_prompts=50), seed=0)
    assert isinstance(task, AdditionTask)
    assert len(task) == 50


def test_unknown_task_name_lists_valid_ones():
    spec = TaskSpec.model_construct(name="subtraction", max_operand=9, num_prompts=5)
    with pytest.raises(ValueError, match=r"task.name 'subtraction'.*\['addition'\]"):
        make_task(spec, seed=0)


def test_addition_examples_are_sums_in_the_operand_range():
    task = AdditionTask(max_operand=12, num_prompts=200, seed=3)
    for ex in task.examples(range(len(task))):
        assert ex.prompt.endswith("=")
        a, b = (int(x) for x in ex.prompt[:-1].split("+"))
        assert 0 <= a <= 12 and 0 <= b <= 12
        assert ex.answer == str(a + b)


def test_addition_example_format():
    assert AdditionTask._example(37, 58).prompt == "37+58="
    assert AdditionTask._example(37, 58).answer == "95"


def test_prompt_set_is_a_function_of_the_seed():
    def prompts(seed):
        task = AdditionTask(max_operand=99, num_prompts=30, seed=seed)
        return [ex.prompt for ex in task.examples(range(30))]

    assert prompts(1) == prompts(1)
    assert prompts(1) != prompts(2)


def test_corpus_covers_every_character_even_for_small_operands():
    corpus = AdditionTask(max_operand=1, num_prompts=3, seed=0).corpus()
    assert set(ALPHABET) <= set("".join(corpus))
    assert "0+1=1" in corpus or "1+0=1" in corpus or "0+0=0" in corpus or "1+1=2" in corpus


def test_sampler_visits_every_prompt_once_per_epoch_and_reshuffles():
    sampler = PromptSampler(10, seed=0)
    first, second = sampler.next_batch(10), sampler.next_batch(10)
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert first != second
    assert sampler.epoch == 1


def test_sampler_batches_wrap_across_epochs():
    sampler = PromptSampler(5, seed=4)
    batches = [sampler.next_batch(3) for _ in range(4)]  # 12 indexes = 2 epochs + 2
    flat = [i for b in batches for i in b]
    assert sorted(flat[:5]) == sorted(flat[5:10]) == list(range(5))


def test_sampler_resume_continues_at_the_same_position():
    uninterrupted = PromptSampler(7, seed=9)
    expected = [uninterrupted.next_batch(4) for _ in range(6)]

    before = PromptSampler(7, seed=9)
    got = [before.next_batch(4) for _ in range(3)]
    state = before.state_dict()
    after = PromptSampler(7, seed=9)
    after.load_state_dict(state)
    got += [after.next_batch(4) for _ in range(3)]
    assert got == expected


@pytest.mark.parametrize("field, value, match", [
    ("num_prompts", 8, "task.num_prompts"),
    ("seed", 1, "seed"),
])
def test_sampler_refuses_state_from_another_setup(field, value, match):
    state = PromptSampler(7, seed=9).state_dict()
    state[field] = value
    with pytest.raises(ValueError, match=match):
        PromptSampler(7, seed=9).load_state_dict(state)


def test_task_indexing_gives_unpackable_examples():
    task = AdditionTask(max_operand=9, num_prompts=4, seed=0)
    prompt, answer = task[2]
    assert (prompt, answer) == tuple(task.examples([2])[0])
    assert task[2].prompt == prompt
