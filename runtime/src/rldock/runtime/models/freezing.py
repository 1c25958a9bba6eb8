"""Which policy parameters the actor trains: `training.freeze_embeddings` keeps the vocabulary-sized
matrices fixed.

For a small model the token embeddings are a large share of the weights (SmolLM2-135M: 28M of
135M, tied to the LM head), so freezing them drops a fifth of the gradients and AdamW state and the
backward pass's largest weight-gradient matmul (hidden x vocabulary per token), while the
transformer layers, which carry what RL changes, still train.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)


def freeze_embeddings(model: nn.Module) -> int:
    """Stop gradients to the input embeddings and the LM head (one tensor when tied); returns the
    number of parameters frozen."""
    hf_model: Any = model  # a Hugging Face model: nn.Module's attribute type does not know its methods
    frozen = {
        id(p): p
        for module in (hf_model.get_input_embeddings(), hf_model.get_output_embeddings())
        if module is not None
        for p in module.parameters()
    }
    for param in frozen.values():
        param.requires_grad_(False)
    count = sum(p.numel() for p in frozen.values())
    total = sum(p.numel() for p in model.parameters())
    logger.info("training.freeze_embeddings: %d of %d parameters frozen (embeddings and LM head)", count, total)
    return count


def trainable(params) -> list[nn.Parameter]:
    """The parameters an optimizer should hold: the ones that still take gradients."""
    return [p for p in params if p.requires_grad]
