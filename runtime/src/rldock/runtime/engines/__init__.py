"""Engines: the vLLM rollout engine, torch policy logprobs, and the data-parallel group helpers.

Submodules are imported explicitly (`from rldock.runtime.engines.vllm_rollout import ...`) so that
importing the package never pulls in vLLM or Ray.
"""
