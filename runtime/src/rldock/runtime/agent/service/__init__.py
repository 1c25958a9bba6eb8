"""Environments as services: an episode is a session of an environment server that speaks OpenEnv's
protocol (HTTP and a WebSocket per session), so a stateful environment runs in a process or a pod of its
own and rldock is its client. `env_server.py` serves an rldock Environment class over that protocol
(`rldock env serve`)."""
