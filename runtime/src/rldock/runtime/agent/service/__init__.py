"""Environments as services: an episode is a session of an environment server that speaks OpenEnv's
protocol (HTTP and a WebSocket per session), so a stateful environment runs in a process or a pod of its
own and rldock is its client (env_client.py; local.py starts local servers, env_probe.py asks them the
preflight's questions). The server, `rldock env serve`, is a runtime package of its own (env_server/):
auth.py and json_wire.py are here because both sides use them."""
