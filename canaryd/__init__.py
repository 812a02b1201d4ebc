"""canaryd: the Flink Kubernetes Operator's canary health check, as a daemon of its own."""

__version__ = "0.1.0"
