"""What pipeline parallelism (training.pipeline_parallel_size, training/pipeline.py) changes in a rank's
bytes and time, as arithmetic on the model shape and the schedule:

- the split: stage s of p holds L // p decoder layers, one more on each of the first L % p stages; the
  first also holds the token embedding, the last the final norm and the LM head (a tied model's last
  stage a copy of the embedding as its head, so under PP a tied model holds its matrix twice);
- 1F1B (PipeDream-flush): stage s holds the activations of at most min(p - s, m) of the update's m
  micro-batches at once, so stage 0 holds the most;
- the bubble: the share of an update step a stage idles, (p - 1) / (m + p - 1); 0 at p = 1.

At p = 1 the one stage holds every layer, the embedding and the head (the planner's figures
without PP).
"""

from __future__ import annotations

from rldock.contract.layout import stage_layer_counts
from rldock.runtime.planning.shapes import ModelShape

__all__ = ["micro_batches_held", "pipeline_bubble", "stage_layer_counts", "stage_layers", "stage_vocab_params"]


def stage_layers(num_layers: int, *, stage: int, stages: int) -> range:
    """The decoder layers (indices) stage `stage` of `stages` holds: stage_layer_counts' run of them in order."""
    counts = stage_layer_counts(num_layers, stages)
    first = sum(counts[:stage])
    return range(first, first + counts[stage])


def stage_vocab_params(shape: ModelShape, *, stage: int, stages: int) -> int:
    """The vocabulary matrices' parameters stage `stage` holds: at one stage the embedding and the LM
    head unless tied (`embedding_params`); under PP the embedding on the first stage and the head on the
    last, each V x h whether tied or not (a tied model's last stage holds a copy)."""
    if stages == 1:
        return shape.embedding_params
    return shape.vocab_size * shape.hidden_size * ((stage == 0) + (stage == stages - 1))


def micro_batches_held(*, stage: int, stages: int, micro_batches: int) -> int:
    """The micro-batches whose activations stage `stage` holds at once under 1F1B: min(p - s, m)."""
    return min(stages - stage, micro_batches)


def pipeline_bubble(*, stages: int, micro_batches: int) -> float:
    """The idle share of an update step under 1F1B: (p - 1) / (m + p - 1); 0 at one stage."""
    if stages == 1:
        return 0.0
    return (stages - 1) / (micro_batches + stages - 1)
