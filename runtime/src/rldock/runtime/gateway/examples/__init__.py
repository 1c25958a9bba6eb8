"""Harnesses written with agent frameworks, unchanged but for their endpoint: what a user's agent looks like
when it trains through the gateway (docs/agentic.md#bring-your-own-agent)."""
