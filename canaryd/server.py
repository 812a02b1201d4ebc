"""The health server: its endpoints, and the limits of its unauthenticated port, are
docs/CONFIGURATION.md's "HTTP". It reads the daemon through a ``HealthView``, for its
answers and for the state gauges read at scrape time."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client import Counter as PrometheusCounter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from canaryd import metrics
from canaryd.config import ConfigError, Settings
from canaryd.kube import kind_of
from canaryd.logs import wall_time
from canaryd.registry import Canary, Registry, one_line

log = structlog.get_logger("canaryd.server")

KEEPALIVE_TIMEOUT = 5.0  # seconds for a request head, from the accept or the last answer
MAX_HEAD_BYTES = 16 * 1024  # before an answer, else 431 (aiohttp's limits let a head hold 500 KiB)
ANSWER_TIMEOUT = 30.0  # seconds an answer not taken keeps its connection at the cap
MAX_CONNECTIONS = 256  # twice the listen backlog: accepted ones cannot push out an unread probe
TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n\r\n"


class HealthView(Protocol):
    registry: Registry

    def not_ready(self) -> list[str] | None: ...
    def role(self) -> tuple[str, str | None]: ...
    def stuck(self) -> str | None: ...
    def blind(self) -> Mapping[str, str]: ...
    def coverage(self) -> Mapping[str, int]: ...


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
        "judgedGeneration": canary.judged_generation,
        "pendingGeneration": canary.bumped_generation,
        "bumpSeconds": {stage: round(s, 6) for stage, s in canary.stages.items()},
    }


class Connection(web.RequestHandler):
    """aiohttp's handler of a connection, with the port's limits: 431, cap, bad requests."""

    def __init__(self, cap: ConnectionCap, server: web.Server) -> None:
        loop = asyncio.get_running_loop()
        super().__init__(server, loop=loop, keepalive_timeout=KEEPALIVE_TIMEOUT)
        self.cap, self.received = cap, 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.cap.admit(self)

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self.received <= MAX_HEAD_BYTES:
            super().data_received(data)
        else:  # dropped: its transport reads no more
            self.cap.drop(self, "headers_too_large", TOO_LARGE)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.cap.open.pop(self, None)
        super().connection_lost(exc)

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        self.cap.active(self)  # as its answer starts, not ends (a slow reader may end late)
        return await super().finish_response(request, resp, start_time)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):  # a bug in a handler: as aiohttp logs it
            return super().handle_error(request, status, exc, message)
        kind = type(exc).__name__
        fields = {"error": one_line(f"{kind}: {exc}")[:300], "remote": request.remote}
        self.cap.tell("bad_http_requests", kind, metrics.BAD_HTTP_REQUESTS, **fields)
        answer = web.Response(status=status, text=message)
        answer.force_close()
        return answer


@dataclass(eq=False)
class ConnectionCap:
    """At most ``max_connections`` open, least recently active first; the eviction rule at
    the cap is docs/CONFIGURATION.md's "HTTP". Handlers never wait."""

    interval: Callable[[], float]
    max_connections: int = field(default=MAX_CONNECTIONS, kw_only=True)
    answer_timeout: float = field(default=ANSWER_TIMEOUT, kw_only=True)
    open: dict[Connection, float] = field(default_factory=dict, init=False)
    """Each open connection, with when it was last active, least recently first."""
    _told_at: dict[str, float] = field(default_factory=dict, init=False)
    _untold: dict[str, Counter[str]] = field(default_factory=dict, init=False)

    def admit(self, connection: Connection) -> None:
        now = asyncio.get_running_loop().time()
        if len(self.open) >= self.max_connections:
            stale = now - self.answer_timeout
            idle = (c for c, since in self.open.items() if not self.writing(c) or since < stale)
            victim = next(idle, None)
            if victim is None:
                return self.drop(connection, "too_many")
            self.drop(victim, "answer_unread" if self.writing(victim) else "too_many")
        self.open[connection] = now

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
        dropped = metrics.HTTP_CONNECTIONS_DROPPED.labels(reason)
        self.tell("http_connections_dropped", reason, dropped)
        transport = connection.transport
        if transport is not None and answer and not self.writing(connection):
            transport.write(answer)
            transport.close()
        elif transport is not None:
            transport.abort()

    def tell(self, event: str, kind: str, counter: PrometheusCounter, **fields: object) -> None:
        """Counted, and told in at most one warning an interval per event, by kind since the
        last one: an attack is not a line per connection or per request."""
        counter.inc()
        untold = self._untold.setdefault(event, Counter())
        untold[kind] += 1
        now, interval = time.monotonic(), self.interval()
        if now - self._told_at.get(event, -math.inf) >= interval:
            log.warning(event, by_reason=dict(untold), next_line_in=round(interval, 3), **fields)
            self._told_at[event] = now
            untold.clear()


def _family(name: str, doc: str, label: str, values: Mapping[str, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for value, count in values.items():
        family.add_metric([value], count)
    return family


class HealthServer(Collector):
    """Listens from ``start()`` (a busy port fails before anything else runs) to
    ``stop()``; registered in metrics.REGISTRY, it collects the state gauges."""

    def __init__(self, settings: Settings, view: HealthView) -> None:
        self.settings, self.view = settings, view
        self.cap = ConnectionCap(lambda: settings.timeout)
        self.app = web.Application(client_max_size=1024)
        self.app.router.add_get("/healthz", self.health)
        self.app.router.add_get("/", self.health)
        self.app.router.add_get("/livez", self.live)
        self.app.router.add_get("/readyz", self.ready)
        self.app.router.add_get("/metrics", self.metrics_page)
        self.port: int | None = None
        self._listener: asyncio.Server | None = None
        self._runner = web.AppRunner(self.app, handle_signals=False, shutdown_timeout=1.0)

    def blind_lines(self) -> list[str]:
        return [f"blind {reason}: {what}" for reason, what in self.view.blind().items()]

    async def health(self, request: web.Request) -> web.Response:
        healthy = self.view.registry.healthy
        status = 200 if healthy else 500
        if "application/json" in request.headers.get("Accept", ""):
            role, leader = self.view.role()
            body = {
                "healthy": healthy,
                "role": role,
                "leader": leader,
                "canaries": [canary_json(c) for c in self.view.registry.canaries()],
                "blind": self.view.blind(),
            }
            return web.json_response(body, status=status)
        lines = ["OK" if healthy else "ERROR"]
        if "verbose" not in request.query:
            return web.Response(status=status, text=lines[0])
        for canary in self.view.registry.canaries():
            kind, key = kind_of(canary.key.kind).kind, canary.key
            lines.append(f"{canary.state.value} {kind} {key.namespace}/{key.name}: {canary.reason}")
        return web.Response(status=status, text="\n".join([*lines, *self.blind_lines()]) + "\n")

    async def live(self, request: web.Request) -> web.Response:
        if (why := self.view.stuck()) is None:
            return web.Response(text="OK")
        return web.Response(status=500, text=f"STUCK: {why}")

    async def ready(self, request: web.Request) -> web.Response:
        waiting = self.view.not_ready()
        first = f"NOT READY: {'; '.join(waiting)}" if waiting else "OK"
        text = "\n".join([first, *self.blind_lines()])
        return web.Response(status=503 if waiting else 200, text=text)

    async def metrics_page(self, request: web.Request) -> web.Response:
        body = generate_latest(metrics.REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """A dropped canary has no series: nothing is kept to remove."""
        registry, blind = self.view.registry, self.view.blind()
        yield _family("canaryd_canaries", "Tracked canaries by state.", "state", registry.counts())
        yield GaugeMetricFamily(
            "canaryd_ready",
            "1 when every watch scope is listed and connected (/readyz 200), else 0.",
            value=0 if self.view.not_ready() else 1,
        )
        yield _family(
            "canaryd_watch_scopes",
            "Wanted watch scopes by state (docs/CONFIGURATION.md says each).",
            "state",
            self.view.coverage(),
        )
        yield _family(
            "canaryd_blind",
            "1 while canaryd checks nothing or cannot judge, by reason, else 0 (/readyz and "
            "/healthz?verbose say what).",
            "reason",
            {reason: int(reason in blind) for reason in metrics.BLIND_REASONS},
        )
        # canary_namespace: Prometheus' scrape sets ``namespace``.
        each = GaugeMetricFamily(
            "canaryd_canary_state",
            "1 for each tracked canary, labelled with its state and the class of its reason "
            "(docs/OPERATIONS.md).",
            labels=["kind", "canary_namespace", "name", "state", "reason"],
        )
        for c in registry.tracked():
            each.add_metric([c.key.kind, c.key.namespace, c.key.name, c.state.value, c.cause], 1)
        yield each

    async def start(self) -> None:
        await self._runner.setup()  # no socket and no task: nothing to release if the bind fails
        server, loop = self._runner.server, asyncio.get_running_loop()
        assert server is not None
        host, port = self.settings.host, self.settings.port
        try:
            self._listener = await loop.create_server(
                lambda: Connection(self.cap, server),
                host,
                port,
                backlog=MAX_CONNECTIONS // 2,
                reuse_address=True,
            )
        except OSError as err:  # exit 2, as a bad flag
            raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
        self.port = self._listener.sockets[0].getsockname()[1]
        log.info("health_server_listening", host=host, port=self.port)

    async def stop(self) -> None:
        """Whether or not ``start()`` got to listen (the daemon's ``finally``)."""
        if self._listener is not None:
            log.info("health_server_stopped", why="cancelled")
            self._listener.close()
        await self._runner.cleanup()
