"""Test doubles for what a control plane without KubeRay, kubelets or Ray lacks (not shipped).

- kuberay.KubeRayDouble (+ kuberay_pods): the KubeRay operator's part: RayCluster -> head Service,
  Pods built as KubeRay builds them, status.
- node_agent.NodeAgentDouble (+ sandbox, pod_env, cluster_dns, service_proxy, storage,
  mountpoints): the kubelets of emulated nodes, running their pods for real as local processes
  in Linux namespaces, with a pod network, cluster DNS and the API server's Service.
- kubelet.KubeletDouble: a cheaper kubelet: bound Pods -> Running with an IP, nothing run.
- ray_jobs.RayJobsDouble: Ray heads' Jobs API (the dashboard), with jobs the test scripts.
- slow_environment.SlowAddition: an environment whose steps take a while, served by `rldock env
  serve` in an RLJob's environment pods (the venv being every pod's image).
- npu_twin: an `npu` torch device that computes on the CPU (a PrivateUse1 C++ extension), for
  running the runtime's Ascend code paths without an NPU (docs/accelerators.md).

None of them knows about RLJobs: they see what KubeRay, a kubelet or a Ray head would see.
"""
