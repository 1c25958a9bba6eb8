"""The addition task's preference pairs (DPO's dataset)."""

from rldock.runtime.tasks import AdditionTask
from rldock.runtime.tasks.addition import wrong_answer


class ScriptedRng:
    """Test double for np.random.Generator: `integers` returns the scripted values in order."""

    def __init__(self, *values):
        self.values = list(values)

    def integers(self, high):
        value = self.values.pop(0)
        assert 0 <= value < high
        return value


def test_wrong_answer_replaces_one_digit():
    # position 1 of "95": digits 0-9 without 5 -> [0, 1, 2, 3, 4, 6, ...], index 3 -> "3"
    assert wrong_answer("95", ScriptedRng(1, 3)) == "93"
    # position 0 of "95": leading digit, 1-9 without 9 -> [1, ..., 8], index 0 -> "1"
    assert wrong_answer("95", ScriptedRng(0, 0)) == "15"
    # a single-digit answer may become 0
    assert wrong_answer("7", ScriptedRng(0, 0)) == "0"


def test_pairs_are_correct_versus_wrong_same_length_and_deterministic():
    task = AdditionTask(max_operand=99, num_prompts=300, seed=4)
    pairs = task.preference_pairs(range(300))
    for pair, example in zip(pairs, task.examples(range(300))):
        assert pair.prompt == example.prompt and pair.chosen == example.answer
        assert pair.rejected != pair.chosen and len(pair.rejected) == len(pair.chosen)
        assert pair.rejected.isdigit() and (len(pair.rejected) == 1 or pair.rejected[0] != "0")
    again = AdditionTask(max_operand=99, num_prompts=300, seed=4).preference_pairs([7, 3])
    assert again == [pairs[7], pairs[3]]
    other_seed = AdditionTask(max_operand=99, num_prompts=300, seed=5).preference_pairs(range(300))
    assert [p.rejected for p in other_seed] != [p.rejected for p in pairs]
