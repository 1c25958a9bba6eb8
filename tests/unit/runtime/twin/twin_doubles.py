"""Test doubles for the twin iteration tests (imported by basename): a dock that keeps columns in
host memory as the real one does, and an engine that only receives weights."""

from __future__ import annotations

import torch
from tensordict import TensorDict

_DOCKS: dict[int, ColumnDock] = {}  # every ColumnDock of this process, by id


class ColumnDock:
    """Test double of TransferDock for one rank: each state gets the whole batch once per call of
    its stage; what a stage puts is copied to host, as the real dock's wire does. A pickled copy
    (a device worker's seat gets one) is this dock again, as a real client's copies reach the same
    warehouses."""

    def __init__(self, batch: TensorDict, states: dict[str, tuple[str, ...]]):
        self.batch, self.states, self.waited_s, self.drained = batch, states, 0.0, False
        self._given: set[str] = set()
        _DOCKS[id(self)] = self

    def __reduce__(self):
        return _registered, (id(self),)

    def bank(self, iteration: int) -> ColumnDock:  # stands in for DockBanks too: one bank, these columns
        return self

    def start_stage(self, state: str) -> None:
        self._given.discard(state)

    def get(self, state, columns, **kwargs):
        if state in self._given:
            return None
        self._given.add(state)
        present = set(self.batch.keys())
        missing = [c for c in columns if c not in present]
        assert not missing, f"{state} reads {missing} before any stage wrote them"
        return torch.arange(len(self.batch)), self.batch.select(*columns).clone()

    def put(self, indices, out, *, policy_version=None):
        for key, value in out.items():
            self.batch[key] = value.detach().to("cpu")


def _registered(key: int) -> ColumnDock:
    return _DOCKS[key]


class WeightSinkEngine:
    """Test double of VllmRolloutEngine's weight intake: records the devices of what it got."""

    def __init__(self):
        self.devices: set[torch.device] = set()

    def update_weights(self, named_tensors) -> None:
        for _, tensor in named_tensors:
            self.devices.add(tensor.device)
