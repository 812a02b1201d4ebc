"""The open-files limit: raised at start as Go programs do (os: rlimit.go, since Go 1.19),
and checked against the watch sockets wanted: a service's soft limit of 1024 runs out near
500 watched namespaces (docs/OPERATIONS.md#systemd)."""

import resource  # Unix: canaryd runs on Linux (and macOS for development)
from dataclasses import dataclass

RESERVED = 512
"""Descriptors besides the watches: the request pool (at most 320 connections),
health-port clients, the event loop, logs and the interpreter's own files."""


@dataclass(frozen=True)
class OpenFiles:
    """The limits in force (None: none, or unreadable), the soft one before it was raised, or
    why it could not be."""

    soft: int | None
    hard: int | None
    raised_from: int | None = None
    problem: str | None = None

    def shortfall(self, watches: int) -> str | None:
        needed = watches + RESERVED
        if self.soft is None or needed <= self.soft:
            return None
        return (
            f"open files limit {self.soft} is below the {needed} that {watches} watches "
            "need (raise LimitNOFILE or the container runtime's nofile ulimit)"
        )


def raise_open_files_limit() -> OpenFiles:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns what is in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An infinite soft NOFILE limit is refused (fs.nr_open caps it): ask for a large one.
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft in (hard, target):
        return OpenFiles(_limit(soft), _limit(hard))
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as err:
        return OpenFiles(_limit(soft), _limit(hard), problem=str(err))
    return OpenFiles(_limit(target), _limit(hard), raised_from=_limit(soft))


def _limit(value: int) -> int | None:
    return None if value == resource.RLIM_INFINITY else value
