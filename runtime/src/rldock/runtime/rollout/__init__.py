"""Rollout modes: how an actor rank's engine turns the dock's prompts into responses, one module per
mode behind the `RolloutMode` protocol (protocol.py), chosen once from the config in modes.py: whole
groups in one engine batch (plain.py), groups written as they finish (streamed.py), multi-turn
episodes with tools (agent.py), generations cut at a weight update and completed after it
(partial.py)."""
