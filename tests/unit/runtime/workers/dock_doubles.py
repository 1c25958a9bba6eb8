"""Test doubles of the transfer dock for the worker-state tests (imported by basename: pytest's
prepend import mode puts this folder on sys.path)."""

from __future__ import annotations

import torch
from dock_double_base import PutThenGet  # tests/dock_double_base.py
from tensordict import TensorDict

EOS, PAD = 1, 0


class DigitTokenizer:
    """Test double: ids 3-12 are the digits 0-9, 1 is EOS."""

    eos_token_id, pad_token_id = EOS, PAD

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(str(t - 3) for t in tokens if t >= 3)


def reward_worker_without_files(cfg, rows, dock=None):
    """A RewardWorker with DigitTokenizer standing in for the tokenizer files it would load; `dock`'s batch
    gets each sample's row of `rows` (`with_prompt_rows`)."""
    from rldock.runtime.flow.job_recipe import job_recipe
    from rldock.runtime.rewards import RewardScorer
    from rldock.runtime.workers.reward import RewardWorker

    worker = RewardWorker.__new__(RewardWorker)
    if dock is not None:
        dock.batch = with_prompt_rows(dock.batch, rows)
    worker.cfg, worker.banks, worker.tokenizer = cfg, dock, DigitTokenizer()
    worker.scorer = RewardScorer(cfg.reward)
    worker.follow(job_recipe(cfg))
    return worker


def with_prompt_rows(batch: TensorDict, rows) -> TensorDict:
    """`batch` with each sample's row of `rows`, by its `prompt_index`, in the dock's `prompt_row` column, as the
    driver puts it with the prompt (data/row_column.py)."""
    from rldock.runtime.data.row_column import padded_rows, row_bytes

    encoded = [row_bytes(rows[i]) for i in batch["prompt_index"].tolist()]
    width = max(map(len, encoded))
    column = torch.frombuffer(padded_rows(encoded, width), dtype=torch.uint8).view(len(encoded), width)
    return batch.update({"prompt_row": column})


class OneBatchDock(PutThenGet):
    """Test double of TransferDock: hands the whole batch out once, records what is put."""

    def __init__(self, batch: TensorDict):
        self.batch, self.given, self.waited_s, self.written = batch, False, 0.0, None
        self.drained = False  # never says so: the consumer asks until it hears None

    def bank(self, iteration):  # stands in for DockBanks too: a single bank, itself
        return self

    def get(self, state, columns, **kwargs):
        if self.given:
            return None
        self.given = True
        return torch.arange(len(self.batch)), self.batch.select(*columns)

    def put(self, indices, out, *, policy_version=None):
        self.written = out
