"""What an RLJob's agent pods (`spec.agents`) and the runtime that serves their episodes share.

The operator runs each `spec.agents` entry as pods that reach their job's Ray pods on one port,
`GATEWAY_PORT`, and nothing else of them (builders/agents.py, its NetworkPolicy; the Ray pods'
admits them there: builders/network_policy.py). The Ray pods serve the job's OpenAI-compatible
gateway and its episode dispatcher on that port; the agent pods find them by the headless Service
whose host and port the operator writes into `GATEWAY_ENV` (`host:port`).

The pods authenticate with the job's pod token (`rldock.contract.runtime_cli.ENVIRONMENT_TOKEN_ENV`,
the same Secret the environments' servers read), sent as `Authorization: Bearer <token>`.
"""

from __future__ import annotations

GATEWAY_PORT = 8300  # the job's gateway and episode dispatcher on its Ray pods
GATEWAY_ENV = "RLDOCK_GATEWAY"  # `host:port` of the job's gateway Service, in every agent pod
