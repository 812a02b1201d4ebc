"""systemd's sd_notify(3) for ``Type=notify`` units (docs/OPERATIONS.md#systemd): READY=1,
WATCHDOG=1 while the daemon's tasks make progress, STOPPING=1, sent to ``NOTIFY_SOCKET`` (a
path or an abstract ``@name``); without it nothing is sent."""

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable, Mapping

import structlog

from canaryd import metrics

log = structlog.get_logger("canaryd.systemd")


class Notifier:
    def __init__(self, env: Mapping[str, str] = os.environ) -> None:
        path = env.get("NOTIFY_SOCKET", "")
        self.address = path if path.startswith("/") else None
        if path.startswith("@"):
            self.address = "\0" + path[1:]  # abstract namespace
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        mine = usec.isdigit() and int(usec) > 0 and pid in ("", str(os.getpid()))
        self.watchdog_interval = int(usec) / 1e6 / 2 if mine else None

    def notify(self, message: str) -> bool:
        if self.address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(message.encode(), self.address)
        except OSError as err:
            metrics.ERRORS.labels("sd_notify").inc()
            log.warning("sd_notify_failed", message=message, error=str(err))
            return False
        return True

    async def run(
        self,
        ready: Callable[[], bool],
        stuck: Callable[[], str | None],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """Send READY=1 when ``ready()``; then WATCHDOG=1 each interval while ``stuck()``
        returns None (else it returns why the daemon is stuck)."""
        if self.address is None:
            return
        sent_ready = False
        while not sent_ready or self.watchdog_interval is not None:
            if not sent_ready and ready():
                sent_ready = self.notify("READY=1")
            if self.watchdog_interval is not None:
                if (why := stuck()) is None:
                    self.notify("WATCHDOG=1")
                else:
                    metrics.ERRORS.labels("watchdog_withheld").inc()
                    log.error("watchdog_withheld", why=why)
            await sleep(self.watchdog_interval or 0.5)
