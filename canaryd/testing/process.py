"""Starting canaryd as a process of its own, for the demo and the benchmarks."""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def canaryd_argv(kubeconfig: Path, port: int, cycle: float, *extra: str) -> list[str]:
    """``python -m canaryd`` on 127.0.0.1 with this kubeconfig, port and cycle (seconds)."""
    return [
        sys.executable,
        "-m",
        "canaryd",
        "--kubeconfig",
        str(kubeconfig),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--timeout",
        f"{cycle}s",
        *extra,
    ]
