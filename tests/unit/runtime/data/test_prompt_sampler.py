"""The prompt sampler: seeded epochs, wrapping batches and exact resume."""

import pytest

from rldock.runtime.data import PromptSampler


def test_sampler_visits_every_prompt_once_per_epoch_and_reshuffles():
    sampler = PromptSampler(10, seed=0)
    first, second = sampler.next_batch(10), sampler.next_batch(10)
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert first != second
    assert sampler.epoch == 1


def test_sampler_batches_wrap_across_epochs():
    sampler = PromptSampler(5, seed=4)
    flat = [i for _ in range(4) for i in sampler.next_batch(3)]  # 12 indexes = 2 epochs + 2
    assert sorted(flat[:5]) == sorted(flat[5:10]) == list(range(5))


def test_sampler_resume_continues_at_the_same_position():
    uninterrupted = PromptSampler(7, seed=9)
    expected = [uninterrupted.next_batch(4) for _ in range(6)]
    before = PromptSampler(7, seed=9)
    got = [before.next_batch(4) for _ in range(3)]
    after = PromptSampler(7, seed=9)
    after.load_state_dict(before.state_dict())
    got += [after.next_batch(4) for _ in range(3)]
    assert got == expected


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("num_prompts", 8, r"prompt set of 8 prompts.*algorithm.max_prompt_length"),
        ("seed", 1, r"data.shuffle_seed"),
    ],
)
def test_sampler_refuses_state_from_another_setup(field, value, match):
    state = PromptSampler(7, seed=9).state_dict()
    state[field] = value
    with pytest.raises(ValueError, match=match):
        PromptSampler(7, seed=9).load_state_dict(state)
