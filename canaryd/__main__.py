"""``canaryd`` and ``python -m canaryd``: the daemon, exit 0 on SIGTERM/SIGINT;
``canaryd check [FLAGS]``: the pre-flight check (canaryd.check) with the same flags,
its exit status its own. Both exit 2 on bad configuration, naming it in one line."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

import structlog

from canaryd import logs
from canaryd.check import check
from canaryd.config import ConfigError, load_settings
from canaryd.daemon import Daemon
from canaryd.leader import lease_timings_problem

log = structlog.get_logger("canaryd")


def run(main: Coroutine[Any, Any, None]) -> None:
    """On uvloop where it is installed (less CPU per request and watch event), else on
    asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def main(argv: Sequence[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    checking = args[:1] == ["check"]
    try:
        if checking:
            settings = load_settings(args[1:], os.environ, "canaryd check")
        else:
            settings = load_settings(args, os.environ)
        if problem := lease_timings_problem(settings):
            raise ConfigError(problem)
        if checking:
            # The check speaks on stdout; the client's own logs only when something is wrong.
            logs.configure(settings.log_format, "error")
            sys.exit(asyncio.run(check(settings, sys.stdout)))
        logs.configure(settings.log_format, settings.log_level)
        if settings.timeout < 1.0:
            log.warning(
                "short_cycle",
                timeout=settings.timeout,
                detail="a cycle below 1 s is for tests; the operator's default is 1 min",
            )
        run(Daemon(settings).run())
    except ConfigError as err:
        sys.stdout.flush()
        print(f"canaryd: {err}", file=sys.stderr)
        sys.exit(2)
    except Exception:  # an ExceptionGroup from the TaskGroup: a bug, logged
        log.exception("canaryd_failed")
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
