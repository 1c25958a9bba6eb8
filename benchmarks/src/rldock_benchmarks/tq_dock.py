"""TransferQueue (PyPI `transferqueue`) behind the transfer dock's client API, as a benchmark baseline.

TransferQueue is the open-source peer of the dock: a controller that holds metadata and hands
samples out, and SimpleStorage units that hold the tensors, reached over ZMQ. `TQDock` starts one
controller on the first given node and one storage unit per given node, and offers the subset of
`TransferDock` that the benchmark's stage loop and harness use (get, put, reset, stats, layout,
shutdown), so every stage of grpo_flow.py runs on it unchanged, on the same data and nodes as
the dock's two modes. What differs is TransferQueue's own design, used as it ships:
- storage is chosen per sample by global index modulo the number of units, so every group is
  spread over all nodes and nothing is read where it was stored;
- one sampler serves every task: GRPOGroupNSampler (whole, consecutive groups), so every request
  must be a multiple of the group size; the update is not levelled by tokens (`balance_ranks`
  is ignored: the same number of samples per rank, in index order);
- the controller answers an unready request with an empty batch (polling mode), and the client
  polls every `poll_s`.

Bytes per storage unit are counted inside the storage units by a subclass of TransferQueue's
SimpleStorageUnit (its own metrics count requests, not bytes): tensor bytes of every put and get,
the same quantity the dock's warehouses count. Benchmark code only; the runtime does not use it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict


def unavailable_reason() -> str | None:
    """Why TransferQueue cannot run here (None when it can)."""
    try:
        import transfer_queue  # noqa: F401
    except ImportError as error:  # the package or one of its imports (hydra-core, omegaconf) is absent
        return f"transferqueue is not installed or fails to import: {error}"
    return None


@dataclass(frozen=True)
class TQLayout:
    """Which storage unit holds which sample: TransferQueue routes by global index modulo units."""

    num_samples: int
    group_size: int
    num_warehouses: int

    def capacity(self, unit: int) -> int:
        """Samples of one iteration held by `unit` (indices are consecutive, so the split is even)."""
        return len(range(unit, self.num_samples, self.num_warehouses))


class TQDock:
    """TransferQueue with the dock's client API; build it with `TQDock.create` (the driver)."""

    mode = "transferqueue"

    def __init__(
        self,
        *,
        instance: str,
        conf: Any,
        layout: TQLayout,
        states: Mapping[str, Sequence[str]],
        timeout_s: float,
        poll_s: float,
        controller: Any,
        units: dict[str, Any],
    ) -> None:
        self._instance = instance
        self._conf = conf
        self.layout = layout
        self._states = {state: tuple(cols) for state, cols in states.items()}
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._controller = controller
        self._units = units
        self._iteration = 0
        self._pending: dict[tuple[int, ...], Any] = {}  # indices -> the BatchMeta they came with
        self.waited_s = 0.0
        # The stage loop's early stop (TransferDock.drained): TransferQueue cannot tell that a grant
        # took the last samples, so this stays False and a stage asks once more, as it must anyway
        # with max_batches reached.
        self.drained = False

    @classmethod
    def create(
        cls,
        *,
        states: Mapping[str, Sequence[str]],
        num_samples: int,
        group_size: int,
        node_ids: Sequence[str],
        timeout_s: float = 600,
        poll_s: float = 0.005,
    ) -> TQDock:
        """Start a controller on node_ids[0] and one counting storage unit per node, in node order."""
        import sys

        import ray
        from omegaconf import OmegaConf
        from ray import cloudpickle
        from transfer_queue import GRPOGroupNSampler
        from transfer_queue.controller import TransferQueueController
        from transfer_queue.utils.zmq_utils import process_zmq_server_info

        from rldock.runtime.dock.placement import pinned_to

        # Ray workers cannot import benchmarks/src/rldock_benchmarks/: this module (the storage subclass, the client
        # object handed to the agents) travels by value.
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        conf = OmegaConf.merge(
            OmegaConf.create({}, flags={"allow_objects": True}),
            OmegaConf.load(_package_file("config.yaml")),
        )
        controller = TransferQueueController.options(scheduling_strategy=pinned_to(node_ids[0])).remote(
            sampler=GRPOGroupNSampler(n_samples_per_prompt=group_size), polling_mode=True
        )
        conf.controller.polling_mode = True
        conf.controller.zmq_info = process_zmq_server_info(controller)
        storage = conf.backend.SimpleStorage
        storage.num_data_storage_units = len(node_ids)
        unit_cls = ray.remote(num_cpus=1)(_counting_unit_class())
        config = {**OmegaConf.to_container(storage), "_run_id": uuid.uuid4().hex}
        # The manager routes sample g to the (g mod S)-th unit of this mapping, in insertion order.
        units = {
            f"TransferQueueStorageUnit#{k}": unit_cls.options(scheduling_strategy=pinned_to(node)).remote(config=config)
            for k, node in enumerate(node_ids)
        }
        storage.zmq_info = process_zmq_server_info(units)
        ray.get(controller.store_config.remote(conf))
        layout = TQLayout(num_samples=num_samples, group_size=group_size, num_warehouses=len(node_ids))
        return cls(
            instance=uuid.uuid4().hex,
            conf=conf,
            layout=layout,
            states=states,
            timeout_s=timeout_s,
            poll_s=poll_s,
            controller=controller,
            units=units,
        )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pending": {}, "waited_s": 0.0}

    @property
    def partition(self) -> str:
        return f"iteration-{self._iteration}"

    def put(self, indices: torch.Tensor, batch: TensorDict, *, policy_version: int | None = None) -> None:
        """Write `batch`; without a pending get for `indices` (the driver's prompts) it inserts a
        new partition and checks that TransferQueue gave the groups consecutive indexes.
        `policy_version` is accepted for API parity and not recorded."""
        del policy_version
        client = self._client()
        meta = self._pending.pop(tuple(indices.tolist()), None)
        if meta is not None:
            client.put(data=batch, metadata=meta)
            return
        meta = client.put(data=batch, partition_id=self.partition)
        given = np.asarray(meta.global_indexes)
        if given.size > 1 and not (np.diff(given) == 1).all():
            raise RuntimeError("TransferQueue gave the prompts non-consecutive indexes; GRPO groups would split")

    def put_groups(
        self,
        groups: torch.Tensor,
        batch: TensorDict,
        *,
        samples: TensorDict | None = None,
        policy_version: int | None = None,
    ) -> None:
        """TransferQueue has no per-group write: each group's row is repeated for its N samples and
        put like any other column (so TransferQueue moves the prompt N times)."""
        n = self.layout.group_size
        rows = (groups[:, None] * n + torch.arange(n)).reshape(-1)  # (k*N,)
        expanded = {name: column.repeat_interleave(n, dim=0) for name, column in batch.items()}
        if samples is not None:
            expanded.update(samples.items())
        self.put(rows, TensorDict(expanded, batch_size=[rows.numel()]), policy_version=policy_version)

    def get(
        self,
        state: str,
        columns: Sequence[str],
        *,
        rank: int = 0,
        batch_size: int,
        whole_groups: bool = False,
        balance_ranks: int = 0,
        timeout_s: float | None = None,
    ) -> tuple[torch.Tensor, TensorDict] | None:
        """Poll the controller until it grants `batch_size` samples of `state`, then read `columns`.

        `rank`, `whole_groups` and `balance_ranks` are accepted for API parity: TransferQueue's one
        sampler hands out whole consecutive groups to whoever asks first.
        """
        del rank, whole_groups, balance_ranks
        if batch_size % self.layout.group_size:
            raise ValueError(
                f"TransferQueue's GRPO sampler needs batch_size {batch_size} to be a multiple "
                f"of the group size {self.layout.group_size}"
            )
        client = self._client()
        deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)
        started = time.perf_counter()
        while True:
            meta = client.get_meta(
                data_fields=list(columns),
                batch_size=batch_size,
                partition_id=self.partition,
                mode="fetch",
                task_name=state,
            )
            if meta.size:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"TransferQueue: state {state!r} got no {batch_size} samples in time")
            time.sleep(self._poll_s)
        self.waited_s += time.perf_counter() - started
        data = client.get_data(meta)
        size = meta.size
        dense = {name: _dense(data[name], size) for name in columns}
        indices = torch.as_tensor(meta.global_indexes, dtype=torch.int64)
        self._pending[tuple(indices.tolist())] = meta
        return indices, TensorDict(dense, batch_size=[size])

    def put_and_get(
        self, indices: torch.Tensor, batch: TensorDict, state: str, columns: Sequence[str], **request: Any
    ) -> tuple[torch.Tensor, TensorDict] | None:
        """`put`, then `get` (TransferQueue has no call that does both)."""
        self.put(indices, batch, policy_version=request.pop("policy_version", None))
        return self.get(state, columns, **request)

    def reset(self) -> None:
        """Start a new iteration in a fresh partition; the previous one is cleared."""
        if self._iteration:
            self._client().clear_partition(self.partition)
        self._iteration += 1

    def stats(self) -> dict[str, Any]:
        """Cumulative tensor bytes in and out of each storage unit, in the dock's stats shape."""
        import ray

        return {"warehouses": ray.get([unit.byte_counters.remote() for unit in self._units.values()])}

    def actor_handles(self) -> list:
        """The controller and the storage units (for CPU accounting)."""
        return [self._controller, *self._units.values()]

    def warehouse_nodes(self) -> list[str]:
        import ray

        return ray.get([unit.node_id.remote() for unit in self._units.values()])

    def shutdown(self) -> None:
        import ray

        client = _clients().pop(self._instance, None)
        if client is not None:
            client.close()
        for handle in self.actor_handles():
            ray.kill(handle)

    def _client(self):
        clients = _clients()
        client = clients.get(self._instance)
        if client is None:
            from transfer_queue import TransferQueueClient

            for stale in [key for key in clients if key != self._instance]:  # earlier instances in this process
                clients.pop(stale).close()
            client = TransferQueueClient(
                client_id=f"rldock-bench-{uuid.uuid4().hex[:8]}", controller_info=self._conf.controller.zmq_info
            )
            client.initialize_storage_manager(manager_type="SimpleStorage", config=self._conf.backend.SimpleStorage)
            clients[self._instance] = client
        return client


def _clients() -> dict[str, Any]:
    """This process's TransferQueue clients, one per TQDock instance (each holds ZMQ sockets and a
    loop thread, so it is made once per process). The cache lives on the installed
    transfer_queue module: a global of this module would travel by value with it and be copied."""
    import transfer_queue

    return transfer_queue.__dict__.setdefault("_rldock_bench_clients", {})


def _dense(column: torch.Tensor, size: int) -> torch.Tensor:
    """TransferQueue returns fixed-length columns as jagged nested tensors; the dense (B, ...) view."""
    if not column.is_nested:
        return column
    values = column.values()
    return values.view(size) if values.numel() == size else values.view(size, -1)


def _package_file(name: str):
    from importlib import resources

    return resources.files("transfer_queue") / name


def _nbytes(values: Any) -> int:
    if isinstance(values, torch.Tensor):
        return values.numel() * values.element_size()
    if isinstance(values, np.ndarray):
        return values.nbytes
    if isinstance(values, (list, tuple)):
        return sum(_nbytes(v) for v in values)
    return 0


def _counting_unit_class():
    """TransferQueue's SimpleStorageUnit, counting the tensor bytes of every put and get it serves."""
    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    base = SimpleStorageUnit.__ray_actor_class__  # the class under @ray.remote

    class CountingStorageUnit(base):
        def __init__(self, config: dict[str, Any]) -> None:
            self._bytes_in = 0
            self._bytes_out = 0
            super().__init__(config)

        def _handle_put(self, data_parts):
            self._bytes_in += sum(_nbytes(v) for v in data_parts.body["data"].values())
            return super()._handle_put(data_parts)

        def _handle_get(self, data_parts):
            reply = super()._handle_get(data_parts)
            self._bytes_out += sum(_nbytes(v) for v in reply.body.get("data", {}).values())
            return reply

        def byte_counters(self) -> dict[str, int]:
            return {"bytes_in": self._bytes_in, "bytes_out": self._bytes_out}

        def node_id(self) -> str:
            import ray

            return ray.get_runtime_context().get_node_id()

    return CountingStorageUnit
