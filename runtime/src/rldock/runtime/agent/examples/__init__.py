"""Example environments that ship with rldock, so `rldock env serve`, an in-process job and an RLJob's pods
can all run them by module path (`rldock.runtime.agent.examples.<module>:<Class>`), and the rows of their
tasks (`rldock data generate cabinet`: cabinet_tasks.py)."""
