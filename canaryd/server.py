"""The health server: /healthz and / (the verdict, upstream-compatible), /livez
(canaryd's own process), /readyz, /metrics. It reads the daemon through a
``HealthView``; ``/healthz`` without ``?verbose`` or JSON reads one counter: O(1).

The port is unauthenticated and often reachable from every pod, so no client may hold
more of canaryd than a request needs: aiohttp's own limits bound a request head's time
and lines, ``Connection`` the bytes that may come before a request is handled, and
``ConnectionCap`` how many connections are open.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from canaryd import metrics
from canaryd.config import Settings
from canaryd.kube import kind_of
from canaryd.logs import wall_time
from canaryd.registry import Canary, Registry, one_line

log = structlog.get_logger("canaryd.server")

KEEPALIVE_TIMEOUT = 5.0
"""Seconds a connection may wait for a complete request head, from its accept or its
last answer (aiohttp's keep-alive timeout, an hour by default): a probe or a scrape
sends its head at once; a head trickled slowly is closed like an idle connection.
(aiohttp 3.14.3 and older do not time a first head: there the cap alone bounds it.)"""
MAX_HEAD_BYTES = 16 * 1024
"""Bytes a connection may send from its accept or its last answer until a request is
answered (else 431): a probe's head is a few hundred, a scrape's with a bearer token a
few thousand. aiohttp's own limits, 128 lines of 8 KiB, let one head hold ~500 KiB."""
ANSWER_TIMEOUT = 30.0
"""Seconds after which an answer still not taken no longer keeps its connection from
being closed for a new one at the cap."""
MAX_CONNECTIONS = 256
"""Connections open at once, at most (twice the listen backlog: a whole batch of
accepted connections cannot push out a probe that has not been read yet)."""
TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n\r\n"


class HealthView(Protocol):
    """What the health server reads of the daemon."""

    registry: Registry

    def not_ready(self) -> list[str] | None: ...
    def role(self) -> tuple[str, str | None]: ...
    def stuck(self) -> str | None: ...
    def blind(self) -> Mapping[str, str]: ...


def canary_json(canary: Canary) -> dict[str, object]:
    return {
        "kind": kind_of(canary.key.kind).kind,
        "namespace": canary.key.namespace,
        "name": canary.key.name,
        "state": canary.state.value,
        "reason": canary.reason,
        "bumpedGeneration": canary.last_bumped_generation,
        "observedGeneration": canary.generation,
        "statusObservedGeneration": canary.status_observed,
        "lastBumpAt": None if canary.last_bump_at is None else wall_time(canary.last_bump_at, True),
        # bumpedGeneration is the last bump written, judged or not; these two say
        # which one the reason is about and which one still waits for its deadline.
        "judgedGeneration": canary.judged_generation,
        "pendingGeneration": canary.bumped_generation,
        # The last written bump's time to each stage reached so far, from its PATCH.
        "bumpSeconds": {stage: round(s, 6) for stage, s in canary.stages.items()},
    }


class Tally:
    """Occurrences told in at most one warning per interval, by kind since the last
    line: an attack is not a line per connection or per request."""

    def __init__(self, event: str, interval: Callable[[], float]) -> None:
        self.event, self._interval = event, interval
        self._told_at: float | None = None
        self._untold: Counter[str] = Counter()

    def add(self, kind: str, **fields: object) -> None:
        self._untold[kind] += 1
        now = time.monotonic()
        if self._told_at is None or now - self._told_at >= self._interval():
            by_kind, next_in = dict(self._untold), round(self._interval(), 3)
            log.warning(self.event, by_reason=by_kind, next_line_in=next_in, **fields)
            self._told_at = now
            self._untold.clear()


class Connection(web.RequestHandler):
    """aiohttp's handler of one connection, with the health port's limits: its head in
    ``KEEPALIVE_TIMEOUT``, at most ``MAX_HEAD_BYTES`` before a request is answered
    (counted, not parsed), and counted by the cap."""

    __slots__ = ("cap", "received")

    def __init__(
        self,
        cap: ConnectionCap,
        server: web.Server,
        loop: asyncio.AbstractEventLoop,
        logger: RequestErrorLog,
    ) -> None:
        super().__init__(
            server,
            loop=loop,
            logger=logger,  # type: ignore[arg-type]  # a LoggerAdapter works as one
            access_log=None,  # type: ignore[arg-type]  # none, as aiohttp allows
            keepalive_timeout=KEEPALIVE_TIMEOUT,
        )
        self.cap, self.received = cap, 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.cap.admit(self)

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self.received <= MAX_HEAD_BYTES:
            super().data_received(data)
        elif self.transport is not None and not self.transport.is_closing():
            self.cap.drop(self, "headers_too_large", TOO_LARGE)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.cap.open.pop(self, None)
        super().connection_lost(exc)


class ConnectionCap:
    """At most ``max_connections`` open, kept in the order they were last active
    (accepted, or answered). A new one at the cap closes the first whose answer is all
    handed to the kernel (or not taken for ``answer_timeout``), so neither slow clients
    nor many kept-alive ones lock a probe out and no answer is cut short; it is refused
    when there is none. The handlers never wait: a request is answered in the step its
    handler runs. What the cap closes is counted and told."""

    def __init__(
        self,
        interval: Callable[[], float],
        *,
        max_connections: int = MAX_CONNECTIONS,
        answer_timeout: float = ANSWER_TIMEOUT,
    ) -> None:
        self.max_connections, self.answer_timeout = max_connections, answer_timeout
        self.open: dict[Connection, float] = {}
        """Each open connection, with when it was last active, least recently first."""
        self._tally = Tally("http_connections_dropped", interval)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        finally:  # aiohttp writes the answer to the transport in this same step
            if isinstance(connection := request.protocol, Connection):
                self.active(connection)

    def admit(self, connection: Connection) -> None:
        if len(self.open) >= self.max_connections:
            victim = self._victim()
            if victim is None:
                return self.drop(connection, "too_many")
            self.drop(victim, "answer_unread" if self.writing(victim) else "too_many")
        self.open[connection] = asyncio.get_running_loop().time()

    def _victim(self) -> Connection | None:
        """The least recently active connection not being answered, or whose answer has
        not been taken for ``answer_timeout``."""
        stale = asyncio.get_running_loop().time() - self.answer_timeout
        candidates = (c for c, since in self.open.items() if not self.writing(c) or since < stale)
        return next(candidates, None)

    def active(self, connection: Connection) -> None:
        """It was answered: the most recently active, and its next head counted anew."""
        connection.received = 0
        if self.open.pop(connection, None) is not None:
            self.open[connection] = asyncio.get_running_loop().time()

    @staticmethod
    def writing(connection: Connection) -> bool:
        """The transport still holds answer bytes (closing it would cut them off)."""
        transport = connection.transport
        return transport is not None and bool(transport.get_write_buffer_size())

    def drop(self, connection: Connection, reason: str, answer: bytes = b"") -> None:
        """Close it now: told why (``answer``) when no answer of its own is being written."""
        self.open.pop(connection, None)
        metrics.HTTP_CONNECTIONS_DROPPED.labels(reason).inc()
        self._tally.add(reason)
        if connection.transport is None:
            return
        if answer and not self.writing(connection):
            connection.transport.write(answer)
            connection.transport.close()
        else:
            connection.transport.abort()


class RequestErrorLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger for the health port. A malformed request (anyone may
    send one: the port is unauthenticated) is counted in
    ``canaryd_http_bad_requests_total`` and told in at most one line per interval,
    without aiohttp's traceback; anything else (a bug in a handler) as aiohttp logs it."""

    def __init__(self, interval: Callable[[], float]) -> None:
        super().__init__(logging.getLogger("aiohttp.server"))
        self._tally = Tally("bad_http_requests", interval)

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if not isinstance(exc, HttpProcessingError):
            return super().log(level, msg, *args, **kwargs)
        metrics.BAD_HTTP_REQUESTS.inc()
        error = one_line(f"{type(exc).__name__}: {exc}")[:300]
        self._tally.add(type(exc).__name__, error=error, remote=str(args[0]) if args else None)


class HealthServer:
    """Binds at ``start()`` (so a busy port fails before anything else runs), then
    serves until cancelled."""

    def __init__(self, settings: Settings, view: HealthView) -> None:
        self.settings, self.view = settings, view
        self.cap = ConnectionCap(lambda: settings.timeout)
        self.app = web.Application(client_max_size=1024, middlewares=[self.cap.middleware])
        self.app.add_routes(
            web.get(path, handler)
            for path, handler in (
                ("/healthz", self.health),
                ("/", self.health),
                ("/livez", self.live),
                ("/readyz", self.ready),
                ("/metrics", self.metrics_page),
            )
        )
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None

    async def health(self, request: web.Request) -> web.Response:
        registry = self.view.registry
        healthy = registry.healthy
        status = 200 if healthy else 500
        if "application/json" in request.headers.get("Accept", ""):
            role, leader = self.view.role()
            body = {
                "healthy": healthy,
                "role": role,
                "leader": leader,
                "canaries": [canary_json(c) for c in registry.canaries()],
                "blind": self.view.blind(),
            }
            return web.json_response(body, status=status)
        text = "OK" if healthy else "ERROR"
        if "verbose" in request.query:
            lines = [text]
            for canary in registry.canaries():
                lines.append(
                    f"{canary.state.value} {kind_of(canary.key.kind).kind} "
                    f"{canary.key.namespace}/{canary.key.name}: {canary.reason}"
                )
            lines += [f"blind {reason}: {what}" for reason, what in self.view.blind().items()]
            text = "\n".join(lines) + "\n"
        return web.Response(status=status, text=text)

    async def live(self, request: web.Request) -> web.Response:
        """/livez: canaryd's own process, never the verdict. The loop answers (this reply),
        and its tasks run and keep up with their deadlines (the systemd watchdog's test).
        What a liveness probe of canaryd's own container reads: restarting canaryd repairs
        canaryd, not what it monitors."""
        why = self.view.stuck()
        if why is None:
            return web.Response(text="OK")
        return web.Response(status=500, text=f"STUCK: {why}")

    async def ready(self, request: web.Request) -> web.Response:
        """Ready: every scope canaryd can watch is listed and connected. Blind states (a
        403, a namespace or a kind that is missing, no canary, the operator's metrics)
        do not make it unready (nothing there is its to wait for), but the body names
        each, one ``blind REASON: what`` line (canaryd_blind)."""
        waiting = self.view.not_ready()
        tail = "".join(f"\nblind {reason}: {what}" for reason, what in self.view.blind().items())
        if not waiting:
            return web.Response(text=f"OK{tail}")
        return web.Response(status=503, text=f"NOT READY: {'; '.join(waiting)}{tail}")

    async def metrics_page(self, request: web.Request) -> web.Response:
        body = generate_latest(metrics.REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        server, loop = self._runner.server, asyncio.get_running_loop()
        assert server is not None
        errors = RequestErrorLog(lambda: self.settings.timeout)
        try:
            self._listener = await loop.create_server(
                lambda: Connection(self.cap, server, loop, errors),
                self.settings.host,
                self.settings.port,
                backlog=MAX_CONNECTIONS // 2,
                reuse_address=True,
            )
        except OSError:
            await self._runner.cleanup()
            raise
        self.port = self._listener.sockets[0].getsockname()[1]
        log.info("health_server_listening", host=self.settings.host, port=self.port)

    async def run(self) -> None:
        assert self._runner is not None, "start() first"
        try:
            await asyncio.Event().wait()  # until cancelled at shutdown
        except asyncio.CancelledError:
            log.info("health_server_stopped", why="cancelled")
            raise
        finally:
            if self._listener is not None:
                self._listener.close()
            await self._runner.cleanup()
