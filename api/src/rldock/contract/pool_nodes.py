"""What an RLJob's rollout pool pods (`spec.job.rollout.pool`) and the runtime that starts their engines share.

The operator runs the pool as a KubeRay worker group of its own (builders/ray_cluster.py): one device per pod,
each pod's Ray node labelled `POOL_NODE_LABEL=POOL_NODE_VALUE`, and `POOL_NODES_ENV` set in the job's pods. With
it set, the runtime (rldock.runtime.driver.rollout_pool) starts the pool's engines on those nodes only, sizes the
pool by the devices they hold (the worker group's replicas, which the operator scales when the spec changes), keeps
the trainer's placement group and the dock's warehouses off them. Unset (a local Ray, a cluster of the user's),
`rollout.pool.replicas` engines start wherever Ray has a free device.
"""

from __future__ import annotations

POOL_NODE_LABEL = "rldock.io/rollout-pool"  # a Ray node label (`ray start --labels`)
POOL_NODE_VALUE = "true"
POOL_NODES_ENV = "RLDOCK_POOL_NODES"  # set (to POOL_NODE_VALUE) in the pods of an RLJob with a rollout pool
