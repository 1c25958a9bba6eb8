"""Test doubles for what a control plane without KubeRay, kubelets or Ray lacks (not shipped).

- kuberay.KubeRayDouble: the KubeRay operator's part: RayCluster -> head Service, Pods, status.
- kubelet.KubeletDouble: the kubelets' part: bound Pods -> Running with an IP, deletion confirmed.
- ray_jobs.RayJobsDouble: Ray heads' Jobs API (the dashboard), with jobs the test scripts.

None of them knows about RLJobs: they see what KubeRay, a kubelet or a Ray head would see.
"""
