"""rldock operator: reconciles RLJob resources into KubeRay clusters (kopf)."""
