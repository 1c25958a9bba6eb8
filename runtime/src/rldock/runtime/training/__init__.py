"""Training backends: how a trained model (the actor's policy, PPO's value model) trains across its
ranks (DDP, FSDP2, TP x DP), one module per strategy behind the `TrainingBackend` protocol
(backend.py), chosen in strategies.py; the micro-batch accumulation loop and the update stage's
loop over mini-batches every update runs (accumulation.py); the whole model's weight sum whatever
the layout (checksum.py)."""
