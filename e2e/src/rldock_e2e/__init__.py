"""End-to-end test harness: a real local Kubernetes control plane and its test doubles (not shipped)."""
