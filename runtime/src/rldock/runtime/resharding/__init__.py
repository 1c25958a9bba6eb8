"""Allgather-swap resharding (MindSpeed RL paper, section on resharding): moving the actor from its
training layout (TP x DP) to its generation layout (TP x DP) so that, during generation, no
training tensor stays on the device and the engine's KV cache gets that memory.

The training mesh every process group of a training group's ranks comes from (`parallel_mesh`), and
one module per step, composed by `flow`:
- `layout`: training and generation TP x DP, the Qwen2 weight-name -> shard-dim map (data);
- `parallelize`: a tensor-parallel plan applied from outside to a plain HF Qwen2 model (DTensor);
- `gather`: step 1, bucketed allgather of the TP shards into one contiguous buffer per dtype;
- `shard`: step 2, each generation rank's slice of the gathered weights, loaded in place;
- `swap`: step 3, params / grads / optimizer state device <-> host keeping tensor identity;
- `ledger`: device-resident bytes by category at every stage boundary;
- `flow`: the four steps and the swap back, in `naive` or `allgather_swap` mode.

Submodules are imported explicitly; importing the package pulls in nothing heavy.
"""
