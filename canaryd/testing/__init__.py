"""Test support shipped with canaryd: a fake kube-apiserver for tests, the demo and benchmarks.

Nothing in the daemon imports this package.
"""
