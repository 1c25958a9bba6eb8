"""The weight-publish benchmark's two ends without Ray: what the publisher hands out by each object-store path is
what a receiver's buffers end up holding, bit for bit (a bfloat16 checkpoint, which numpy cannot hold as values)."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from rldock_benchmarks.weight_publish import Publisher, Receiver


def test_each_object_store_path_leaves_the_receiver_the_publishers_weights(tmp_path):
    weights = {"a.weight": torch.randn(4, 3), "b.bias": torch.randn(5)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    publisher = Publisher(str(tmp_path), "bfloat16")
    for take, publish in (("take", "publish"), ("take_arrays", "publish_arrays")):
        receiver = Receiver(publisher.shapes())
        getattr(receiver, take)(getattr(publisher, publish)())
        for name, tensor in weights.items():
            assert receiver.buffers[name].dtype == torch.bfloat16
            assert torch.equal(receiver.buffers[name], tensor.to(torch.bfloat16)), (take, name)
    assert publisher.nbytes() == (12 + 5) * 2
