"""``canaryd`` and ``python -m canaryd``: exit 0 on SIGTERM/SIGINT, 2 on bad configuration.

``canaryd check [FLAGS]``: the pre-flight check (canaryd.check) instead of the daemon."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

import structlog

from canaryd import check, logs
from canaryd.config import ConfigError, load_settings
from canaryd.daemon import Daemon
from canaryd.leader import lease_timings_problem


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
    if args[:1] == ["check"]:
        check.main(args[1:])
        return
    try:
        settings = load_settings(args, os.environ)
        if problem := lease_timings_problem(settings):
            raise ConfigError(problem)
    except ConfigError as err:
        print(f"canaryd: {err}", file=sys.stderr)
        sys.exit(2)
    logs.configure(settings.log_format, settings.log_level)
    if settings.timeout < 1.0:
        structlog.get_logger("canaryd").warning(
            "short_cycle",
            timeout=settings.timeout,
            detail="a cycle below 1 s is for tests; the operator's default is 1 min",
        )
    try:
        run(Daemon(settings).run())
    except ConfigError as err:
        print(f"canaryd: {err}", file=sys.stderr)
        sys.exit(2)
    except Exception:  # noqa: BLE001 - an ExceptionGroup from the TaskGroup: a bug; logged
        structlog.get_logger("canaryd").exception("canaryd_failed")
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
