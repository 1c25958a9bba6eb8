"""Test doubles of the transfer dock for the worker-state tests (imported by basename: pytest's
prepend import mode puts this folder on sys.path)."""

from __future__ import annotations

import torch
from tensordict import TensorDict


class OneBatchDock:
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
