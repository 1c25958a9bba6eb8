"""rldock: Kubernetes-native RL post-training for LLMs (Ascend NPU, GPU, CPU).

`rldock.config` is the job API, `rldock.runtime` (folder runtime/) runs a job on Ray,
`rldock.operator` (folder operator/) reconciles RLJob resources into KubeRay clusters.
"""

__version__ = "0.1.0"
