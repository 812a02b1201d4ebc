"""The process's open-files limit: raised at start, and checked against what is wanted.

Every watch scope holds a socket for as long as it runs. The soft ``RLIMIT_NOFILE``
is 1024 for a systemd service and in many container runtimes: at about 500 watched
namespaces (two kinds each) new sockets fail with EMFILE and scopes go blind. Go
programs raise the soft limit to the hard one at start (os: ``rlimit.go``, since Go
1.19); canaryd does the same, logs the limit, and says in ``/readyz`` when the limit is
still too low for the scopes it wants.
"""

from __future__ import annotations

import resource  # Unix: canaryd runs on Linux (and macOS for development)
from dataclasses import dataclass

RESERVED = 512
"""Descriptors canaryd needs besides its watches: the request pool (at most 320
connections: 256 bumps in flight when writes are slow, 64 for lists, access reviews
and the lease), health-port clients, the event loop, logs and the interpreter's own
files."""


@dataclass(frozen=True)
class OpenFiles:
    soft: int | None
    """The soft limit now in force; None: no limit (or none that can be read)."""
    hard: int | None
    raised_from: int | None = None
    """The soft limit before canaryd raised it; None: it was not raised."""
    problem: str | None = None
    """Why it could not be raised, when it could not."""

    def shortfall(self, watches: int) -> str | None:
        """Why the limit is too low for this many watch sockets, or None."""
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
    infinity = resource.RLIM_INFINITY
    # An unlimited hard limit is not a soft limit the kernel accepts for NOFILE
    # (fs.nr_open caps it): ask for a large finite one instead.
    target = hard if hard != infinity else max(soft, 1 << 20)
    if soft in (hard, target):
        return OpenFiles(_limit(soft), _limit(hard))
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as err:
        return OpenFiles(_limit(soft), _limit(hard), problem=str(err))
    return OpenFiles(_limit(target), _limit(hard), raised_from=_limit(soft))


def _limit(value: int) -> int | None:
    return None if value == resource.RLIM_INFINITY else value
