"""The rldock release. The operator's default runtime image is tagged with it, and the Helm
chart's appVersion and pyproject.toml's version must equal it (tests/unit/helm/test_chart.py)."""

__version__ = "0.1.0"
