"""The environment server: an rldock Environment class served over OpenEnv's protocol (HTTP and a
WebSocket per session), so a stateful environment runs in a process or a pod of its own and the rollout is
its client (agent/service/env_client.py) (`rldock env serve`): the protocol, its sessions and the app
(serve.py) and what a request passes before it reaches a route, the job's token and a body's size
(guard.py)."""
