"""The health server: /healthz and / (the verdict, upstream-compatible), /livez
(canaryd's own process), /readyz, /metrics.

``/healthz`` without ``?verbose`` or JSON reads one counter of the registry: O(1).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from canaryd import metrics
from canaryd.config import Settings
from canaryd.kube import kind_of
from canaryd.registry import Canary, Registry, one_line

log = structlog.get_logger("canaryd.server")

REGISTRY = web.AppKey("registry", Registry)
NOT_READY: web.AppKey[Callable[[], list[str] | None]] = web.AppKey("not_ready")
ROLE: web.AppKey[Callable[[], tuple[str, str | None]]] = web.AppKey("role")
STUCK: web.AppKey[Callable[[], str | None]] = web.AppKey("stuck")
NOT_COVERED: web.AppKey[Callable[[], list[str]]] = web.AppKey("not_covered")


def single() -> tuple[str, str | None]:
    return "single", None


def never_stuck() -> str | None:
    return None


def _iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


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
        "lastBumpAt": _iso(canary.last_bump_at),
        # bumpedGeneration is the last bump written, judged or not; these two say
        # which one the reason is about and which one still waits for its deadline.
        "judgedGeneration": canary.judged_generation,
        "pendingGeneration": canary.bumped_generation,
        # The last written bump's time to each stage reached so far, from its PATCH.
        "bumpSeconds": {stage: round(s, 6) for stage, s in canary.stages.items()},
    }


async def health(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    healthy = registry.healthy
    status = 200 if healthy else 500
    if "application/json" in request.headers.get("Accept", ""):
        role, leader = request.app[ROLE]()
        body = {
            "healthy": healthy,
            "role": role,
            "leader": leader,
            "canaries": [canary_json(c) for c in registry.canaries()],
        }
        return web.Response(status=status, text=json.dumps(body), content_type="application/json")
    text = "OK" if healthy else "ERROR"
    if "verbose" in request.query:
        lines = [text]
        for canary in registry.canaries():
            lines.append(
                f"{canary.state.value} {kind_of(canary.key.kind).kind} "
                f"{canary.key.namespace}/{canary.key.name}: {canary.reason}"
            )
        text = "\n".join(lines) + "\n"
    return web.Response(status=status, text=text)


async def live(request: web.Request) -> web.Response:
    """/livez: canaryd's own process, never the verdict. The loop answers (this reply),
    and its tasks run and keep up with their deadlines (the systemd watchdog's test).
    What a liveness probe of canaryd's own container reads: restarting canaryd repairs
    canaryd, not what it monitors."""
    why = request.app[STUCK]()
    if why is None:
        return web.Response(text="OK")
    return web.Response(status=500, text=f"STUCK: {why}")


async def ready(request: web.Request) -> web.Response:
    """Ready: every scope canaryd can watch is listed and connected. What it cannot
    check at all (a 403, a namespace or a kind that is missing) does not make it
    unready — nothing there is its to wait for — but the body names it."""
    waiting = request.app[NOT_READY]()
    uncovered = request.app[NOT_COVERED]()
    tail = f"\nnot checked: {'; '.join(uncovered)}" if uncovered else ""
    if not waiting:
        return web.Response(text=f"OK{tail}")
    return web.Response(status=503, text=f"NOT READY: {'; '.join(waiting)}{tail}")


async def metrics_page(request: web.Request) -> web.Response:
    response = web.Response(body=generate_latest(metrics.REGISTRY))
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


def build_app(
    registry: Registry,
    not_ready: Callable[[], list[str] | None],
    role: Callable[[], tuple[str, str | None]] = single,
    stuck: Callable[[], str | None] = never_stuck,
    not_covered: Callable[[], list[str]] = list,
) -> web.Application:
    app = web.Application(client_max_size=1024)
    app[REGISTRY] = registry
    app[NOT_READY] = not_ready
    app[ROLE] = role
    app[STUCK] = stuck
    app[NOT_COVERED] = not_covered
    for path in ("/healthz", "/"):
        app.router.add_get(path, health)
    app.router.add_get("/livez", live)
    app.router.add_get("/readyz", ready)
    app.router.add_get("/metrics", metrics_page)
    return app


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
        role: Callable[[], tuple[str, str | None]] = single,
        stuck: Callable[[], str | None] = never_stuck,
        not_covered: Callable[[], list[str]] = list,
    ) -> None:
        self.settings = settings
        self.app = build_app(registry, not_ready, role, stuck, not_covered)
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        self._runner = web.AppRunner(
            self.app,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=1.0,
            logger=RequestErrorLog(lambda: self.settings.timeout),
        )
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.settings.host, self.settings.port).start()
        except OSError:
            await self._runner.cleanup()
            raise
        self.port = self._runner.addresses[0][1]
        log.info("health_server_listening", host=self.settings.host, port=self.port)

    async def run(self) -> None:
        assert self._runner is not None, "start() first"
        try:
            await asyncio.Event().wait()  # until cancelled at shutdown
        except asyncio.CancelledError:
            log.info("health_server_stopped", why="cancelled")
            raise
        finally:
            await self._runner.cleanup()
