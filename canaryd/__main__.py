"""``canaryd`` and ``python -m canaryd``: the daemon, exit 0 on SIGTERM/SIGINT;
``canaryd check [FLAGS]``: the pre-flight check (canaryd.check) with the same flags,
its exit status its own. Both exit 2 on bad configuration, naming it in one line."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence

import structlog

from canaryd import logs
from canaryd.check import check
from canaryd.config import ConfigError, load_settings
from canaryd.daemon import Daemon
from canaryd.leader import lease_timings_problem

try:  # less CPU per request and watch event than asyncio's own loop
    from uvloop import run
except ImportError:
    from asyncio import run  # type: ignore[assignment]

log = structlog.get_logger("canaryd")


def main(argv: Sequence[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    checking = args[:1] == ["check"]
    try:
        prog = "canaryd check" if checking else "canaryd"
        settings = load_settings(args[1:] if checking else args, os.environ, prog)
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
