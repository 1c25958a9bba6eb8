"""The per-episode OpenAI-compatible gateway: a harness of the user's drives the policy through the chat
API, and every token it trains on is the one the engine sampled (docs/agentic.md)."""
