"""The health server: /healthz and / (the verdict, upstream-compatible), /livez
(canaryd's own process), /readyz, /metrics.

``/healthz`` without ``?verbose`` or JSON reads one counter of the registry: O(1).

The port is unauthenticated and often reachable from every pod, so no client may hold
more of canaryd than a request needs (``ConnectionGuard``): every request head within
``HEADER_TIMEOUT`` and ``MAX_HEAD_BYTES``, every answer read within
``ANSWER_TIMEOUT``, an idle keep-alive connection closed after ``IDLE_TIMEOUT``,
and at most ``MAX_CONNECTIONS`` open. At the cap a new connection closes the least
recently active one that has no request in progress (sending a head, or idle between
requests) and no answer still being written, so neither slow clients nor many
kept-alive ones can lock a probe out, and no answer is cut short; it is refused only
while every connection is being answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

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

HEADER_TIMEOUT = 5.0
"""Seconds a request head (request line and headers) may take from its first byte (a
new connection: from its accept). A probe or a scrape sends its head at once; one
that trickles it is closed."""
IDLE_TIMEOUT = HEADER_TIMEOUT + 1.0
"""Seconds a kept-alive connection may idle after an answer (aiohttp's keep-alive
timeout, an hour by default): closed as usual, not counted as dropped. Longer than
the header timeout, so that a head that never ends is told as such."""
ANSWER_TIMEOUT = 30.0
"""Seconds after a request head within which the next one must begin: an answer that
is not read (a client that stopped reading) does not hold its connection longer."""
MAX_CONNECTIONS = 256
"""Connections open at once, at most (twice the listen backlog: a whole batch of
accepted connections cannot push out a probe that has not been read yet)."""
MAX_HEAD_BYTES = 16 * 1024
"""Bytes a request head may have: a probe's is a few hundred, a scrape's with a bearer
token a few thousand."""
SWEEP_INTERVAL = 0.25
"""How often the deadlines above are checked while connections are open (seconds)."""


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


class ConnectionGuard:
    """Bounds what clients of the health port can hold: how many connections, how long
    a request head may take and how large it may be, how long an answer may go unread.
    Wraps aiohttp's protocol factory, so every byte is seen before aiohttp buffers it;
    aiohttp's own keep-alive timeout closes idle connections (``IDLE_TIMEOUT``).

    Deadlines are kept in three insertion-ordered maps (by when a head began, when it
    ended, when its answer was written) and swept a few times a second while
    connections are open: no timer per request on the probe's path."""

    def __init__(
        self,
        on_drop: Callable[[str], None],
        *,
        header_timeout: float = HEADER_TIMEOUT,
        answer_timeout: float = ANSWER_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        max_head_bytes: int = MAX_HEAD_BYTES,
        sweep_interval: float = SWEEP_INTERVAL,
    ) -> None:
        self.on_drop = on_drop
        self.header_timeout, self.answer_timeout = header_timeout, answer_timeout
        self.max_connections, self.max_head_bytes = max_connections, max_head_bytes
        self.sweep_interval = sweep_interval
        self.open: dict[object, GuardedConnection] = {}
        """By transport (what a request knows of its connection)."""
        self.in_head: dict[GuardedConnection, float] = {}
        """Connections sending a request head (a new one included), with when it began
        (a new connection: its accept), oldest first."""
        self.headed: dict[GuardedConnection, float] = {}
        """Connections being answered, with when their last head ended, oldest first."""
        self.idle: dict[GuardedConnection, float] = {}
        """Kept-alive connections between requests, with when their last answer was
        written, oldest first."""
        self._sweep: asyncio.TimerHandle | None = None

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: GuardedConnection(self, factory)

    def admit(self, connection: GuardedConnection, transport: object, now: float) -> bool:
        """Room for a new connection: at the cap, the least recently active one without
        a request in progress is closed (a head begun longest ago, or an answer written
        longest ago), never one being answered (``busy``); when all are, the new one is
        refused."""
        if len(self.open) >= self.max_connections:
            free = (
                next(((c, since) for c, since in waiting.items() if not c.busy), None)
                for waiting in (self.in_head, self.idle)
            )
            victim = min((c for c in free if c is not None), key=lambda c: c[1], default=None)
            if victim is None:
                self.on_drop("too_many")
                return False
            victim[0].drop("too_many")
        self.open[transport] = connection
        self.in_head[connection] = now
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.sweep_interval, self.sweep)
        return True

    def head_begins(self, connection: GuardedConnection, now: float) -> None:
        self.headed.pop(connection, None)
        self.idle.pop(connection, None)
        self.in_head[connection] = now

    def head_ended(self, connection: GuardedConnection, now: float) -> None:
        del self.in_head[connection]
        self.headed[connection] = now
        connection.unanswered += 1

    def answered(self, transport: object | None) -> None:
        """A request's handler returned: aiohttp writes its answer to the transport in
        the same step. Its connection is idle once no other request of it waits (still
        ``busy`` while the transport holds answer bytes the kernel has not taken)."""
        connection = self.open.get(transport)
        if connection is None:
            return
        connection.unanswered -= 1
        if not connection.unanswered and self.headed.pop(connection, None) is not None:
            self.idle[connection] = asyncio.get_running_loop().time()

    def closed(self, connection: GuardedConnection) -> None:
        self.open.pop(connection.transport, None)
        self.in_head.pop(connection, None)
        self.headed.pop(connection, None)
        self.idle.pop(connection, None)

    def sweep(self) -> None:
        """Close what is past its deadline: a head begun ``header_timeout`` ago, a head
        ended or an answer written ``answer_timeout`` ago with no next request."""
        self._sweep = None
        now = asyncio.get_running_loop().time()
        for waiting, limit, reason in (
            (self.in_head, self.header_timeout, "header_timeout"),
            (self.headed, self.answer_timeout, "answer_unread"),
            (self.idle, self.answer_timeout, "answer_unread"),
        ):
            while waiting:
                connection, since = next(iter(waiting.items()))
                if now - since < limit:
                    break
                connection.drop(reason)  # leaves ``waiting``
        if self.open:
            self._sweep = asyncio.get_running_loop().call_later(self.sweep_interval, self.sweep)

    def stop(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None


def _refusal(status: bytes, text: bytes) -> bytes:
    return (
        b"HTTP/1.1 %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n%s" % (status, len(text), text)
    )


REFUSALS = {
    "headers_too_large": _refusal(
        b"431 Request Header Fields Too Large", b"request head over %d bytes" % MAX_HEAD_BYTES
    ),
    "chunked_body": _refusal(b"411 Length Required", b"no chunked request bodies here"),
}
"""What a connection closed for its request's form is told first."""
BODY_HEADER = re.compile(rb"\n(content-length|transfer-encoding)[ \t]*:[ \t]*([^\r\n]*)", re.I)
"""A request head's body headers (the request line is never one)."""


class GuardedConnection(asyncio.Protocol):
    """One connection: aiohttp's protocol inside, made only once the connection is
    admitted; bytes are passed on only while the connection keeps to the limits. It
    follows request heads by their blank line, and skips a body by its Content-Length
    (the health port takes no chunked body: 411, closed)."""

    def __init__(self, guard: ConnectionGuard, factory: Callable[[], asyncio.Protocol]) -> None:
        self._guard, self._factory = guard, factory
        self._inner: asyncio.Protocol | None = None
        self.transport: asyncio.BaseTransport | None = None
        self.unanswered = 0
        """Requests whose head ended and whose handler has not returned."""
        self._head = b""
        """The current head's bytes so far, when it came in more than one piece."""
        self._in_head = True
        self._body_left = 0
        self._dropped = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if not self._guard.admit(self, transport, asyncio.get_running_loop().time()):
            self._dropped = True
            transport.abort()  # type: ignore[attr-defined]
            return
        self._inner = self._factory()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._dropped or self._inner is None:
            return
        if not self._follow_heads(data):
            return
        self._inner.data_received(data)

    def _follow_heads(self, data: bytes) -> bool:
        """Track request heads through ``data``; False when the connection was closed."""
        pos, size = 0, len(data)
        while pos < size:
            if self._body_left:
                taken = min(self._body_left, size - pos)
                self._body_left -= taken
                pos += taken
                continue
            if not self._in_head:  # the next request begins
                self._in_head = True
                self._guard.head_begins(self, asyncio.get_running_loop().time())
            known = len(self._head)
            buffer = self._head + data[pos:] if known else (data[pos:] if pos else data)
            ends = [
                (index, len(blank))
                for blank, back in ((b"\r\n\r\n", 3), (b"\n\n", 1))
                if (index := buffer.find(blank, max(0, known - back))) >= 0
            ]
            if not ends:
                if len(buffer) > self._guard.max_head_bytes:
                    self.drop("headers_too_large")
                    return False
                self._head = buffer
                return True
            index, blank = min(ends)
            head = buffer[: index + blank]
            if len(head) > self._guard.max_head_bytes:
                self.drop("headers_too_large")
                return False
            pos += len(head) - known
            self._head, self._in_head = b"", False
            self._guard.head_ended(self, asyncio.get_running_loop().time())
            for name, value in BODY_HEADER.findall(head):
                if name.lower() == b"transfer-encoding":
                    self.drop("chunked_body")
                    return False
                with contextlib.suppress(ValueError):  # aiohttp answers a bad one 400
                    self._body_left = max(0, int(value.strip()))
        return True

    @property
    def busy(self) -> bool:
        """A request of it is being answered (a pipelined one included, while its next
        head comes), or the transport still holds answer bytes (writing paused or not):
        closing it would cut an answer short."""
        return bool(self.unanswered or self.transport.get_write_buffer_size())  # type: ignore[union-attr]

    def eof_received(self) -> bool | None:
        if self._dropped or self._inner is None:
            return None
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard.closed(self)
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def drop(self, reason: str) -> None:
        """Close it now: nothing more is read. A request refused for its form is told
        why (431 for a head too large, as aiohttp answers a header line past its limit;
        411 for a chunked body); the others are aborted."""
        if self._dropped:
            return
        self._dropped = True
        self._guard.closed(self)
        self._guard.on_drop(reason)
        if self.transport is None:
            return
        answer = REFUSALS.get(reason)
        if answer is not None:
            self.transport.write(answer)  # type: ignore[attr-defined]
            self.transport.close()
        else:
            self.transport.abort()  # type: ignore[attr-defined]


class DroppedConnectionLog:
    """Counts connections the guard closed, and tells them in at most one line per
    interval (by reason since the last line): an attack is not a line per connection."""

    def __init__(self, interval: Callable[[], float], clock: Callable[[], float] = time.monotonic):
        self._interval, self._clock = interval, clock
        self._told_at: float | None = None
        self._untold: dict[str, int] = {}

    def __call__(self, reason: str) -> None:
        metrics.HTTP_CONNECTIONS_DROPPED.labels(reason).inc()
        self._untold[reason] = self._untold.get(reason, 0) + 1
        now = self._clock()
        if self._told_at is None or now - self._told_at >= self._interval():
            log.warning(
                "http_connections_dropped",
                by_reason=dict(self._untold),
                next_line_in=round(self._interval(), 3),
            )
            self._told_at, self._untold = now, {}


class RequestErrorLog:
    """aiohttp's server logger for the health port. A malformed request (anyone may
    send one: the port is unauthenticated, on 0.0.0.0 by default) is counted in
    ``canaryd_http_bad_requests_total`` and told in at most one line per interval,
    without aiohttp's traceback. Anything else (a bug in a handler) is logged as
    aiohttp logs it."""

    def __init__(self, interval: Callable[[], float], clock: Callable[[], float] = time.monotonic):
        self._interval, self._clock = interval, clock
        self._log = logging.getLogger("aiohttp.server")
        self._told_at: float | None = None
        self._untold = 0

    def _bad_request(self, args: tuple[Any, ...], exc: object) -> bool:
        if not isinstance(exc, HttpProcessingError):
            return False
        metrics.BAD_HTTP_REQUESTS.inc()
        self._untold += 1
        now = self._clock()
        if self._told_at is None or now - self._told_at >= self._interval():
            log.warning(
                "bad_http_requests",
                count=self._untold,
                error=one_line(f"{type(exc).__name__}: {exc}")[:300],
                remote=str(args[1]) if len(args) > 1 else None,
                next_line_in=round(self._interval(), 3),
            )
            self._told_at, self._untold = now, 0
        return True

    def debug(self, msg: str, *args: Any, **kwargs: Any) -> None:
        if not self._bad_request((msg, *args), kwargs.get("exc_info")):
            self._log.debug(msg, *args, **kwargs)

    def exception(self, msg: str, *args: Any, **kwargs: Any) -> None:
        if not self._bad_request((msg, *args), kwargs.get("exc_info")):
            self._log.exception(msg, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)  # warning, info, error, isEnabledFor, ...


class HealthServer:
    """Binds at ``start()`` (so a busy port fails before anything else runs), then
    serves until cancelled."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        not_ready: Callable[[], list[str] | None],
        role: Callable[[], tuple[str, str | None]],
        stuck: Callable[[], str | None],
        blind: Callable[[], Mapping[str, str]],
    ) -> None:
        self.settings, self.registry = settings, registry
        self.not_ready, self.role, self.stuck, self.blind = not_ready, role, stuck, blind
        self.guard = ConnectionGuard(DroppedConnectionLog(lambda: self.settings.timeout))

        @web.middleware
        async def answered(request: web.Request, handler: Handler) -> web.StreamResponse:
            try:
                return await handler(request)
            finally:
                self.guard.answered(request.transport)

        self.app = web.Application(client_max_size=1024, middlewares=[answered])
        for path, handler in (
            ("/healthz", self.health),
            ("/", self.health),
            ("/livez", self.live),
            ("/readyz", self.ready),
            ("/metrics", self.metrics_page),
        ):
            self.app.router.add_get(path, handler)
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None

    async def health(self, request: web.Request) -> web.Response:
        registry = self.registry
        healthy = registry.healthy
        status = 200 if healthy else 500
        if "application/json" in request.headers.get("Accept", ""):
            role, leader = self.role()
            body = {
                "healthy": healthy,
                "role": role,
                "leader": leader,
                "canaries": [canary_json(c) for c in registry.canaries()],
                "blind": self.blind(),
            }
            return web.Response(
                status=status, text=json.dumps(body), content_type="application/json"
            )
        text = "OK" if healthy else "ERROR"
        if "verbose" in request.query:
            lines = [text]
            for canary in registry.canaries():
                lines.append(
                    f"{canary.state.value} {kind_of(canary.key.kind).kind} "
                    f"{canary.key.namespace}/{canary.key.name}: {canary.reason}"
                )
            lines += [f"blind {reason}: {what}" for reason, what in self.blind().items()]
            text = "\n".join(lines) + "\n"
        return web.Response(status=status, text=text)

    async def live(self, request: web.Request) -> web.Response:
        """/livez: canaryd's own process, never the verdict. The loop answers (this reply),
        and its tasks run and keep up with their deadlines (the systemd watchdog's test).
        What a liveness probe of canaryd's own container reads: restarting canaryd repairs
        canaryd, not what it monitors."""
        why = self.stuck()
        if why is None:
            return web.Response(text="OK")
        return web.Response(status=500, text=f"STUCK: {why}")

    async def ready(self, request: web.Request) -> web.Response:
        """Ready: every scope canaryd can watch is listed and connected. Blind states (a
        403, a namespace or a kind that is missing, no canary, the operator's metrics)
        do not make it unready (nothing there is its to wait for), but the body names
        each, one ``blind REASON: what`` line (canaryd_blind)."""
        waiting = self.not_ready()
        tail = "".join(f"\nblind {reason}: {what}" for reason, what in self.blind().items())
        if not waiting:
            return web.Response(text=f"OK{tail}")
        return web.Response(status=503, text=f"NOT READY: {'; '.join(waiting)}{tail}")

    async def metrics_page(self, request: web.Request) -> web.Response:
        body = generate_latest(metrics.REGISTRY)
        response = web.Response(body=body)
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def start(self) -> None:
        self._runner = web.AppRunner(
            self.app,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=1.0,
            logger=RequestErrorLog(lambda: self.settings.timeout),
            keepalive_timeout=IDLE_TIMEOUT,
        )
        await self._runner.setup()
        assert self._runner.server is not None
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                self.guard.wrap(self._runner.server),
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
            self.guard.stop()
