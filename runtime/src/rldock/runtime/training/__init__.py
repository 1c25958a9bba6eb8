"""Training backends: how the actor's model trains across its ranks (DDP, FSDP2, TP x DP), one
module per strategy behind the `TrainingBackend` protocol (backend.py), chosen in strategies.py;
the micro-batch accumulation loop every update step runs (accumulation.py)."""
