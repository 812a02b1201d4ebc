"""The health server: /healthz, /livez, / (upstream-compatible), /readyz, /metrics.

``/healthz`` without ``?verbose`` or JSON reads one counter of the registry: O(1).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import UTC, datetime

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from canaryd import metrics
from canaryd.config import Settings
from canaryd.kube import KINDS
from canaryd.registry import Canary, Registry

log = structlog.get_logger("canaryd.server")

REGISTRY = web.AppKey("registry", Registry)
NOT_READY: web.AppKey[Callable[[], list[str] | None]] = web.AppKey("not_ready")


def _iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def canary_json(canary: Canary) -> dict[str, object]:
    return {
        "kind": KINDS[canary.key.kind].kind,
        "namespace": canary.key.namespace,
        "name": canary.key.name,
        "state": canary.state.value,
        "reason": canary.reason,
        "bumpedGeneration": canary.last_bumped_generation,
        "observedGeneration": canary.generation,
        "lastBumpAt": _iso(canary.last_bump_at),
        # bumpedGeneration is the last bump written, judged or not; these two say
        # which one the reason is about and which one still waits for its deadline.
        "judgedGeneration": canary.judged_generation,
        "pendingGeneration": canary.bumped_generation,
    }


async def health(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    healthy = registry.healthy
    status = 200 if healthy else 500
    if "application/json" in request.headers.get("Accept", ""):
        body = {"healthy": healthy, "canaries": [canary_json(c) for c in registry.canaries()]}
        return web.Response(status=status, text=json.dumps(body), content_type="application/json")
    text = "OK" if healthy else "ERROR"
    if "verbose" in request.query:
        lines = [text]
        for canary in registry.canaries():
            lines.append(
                f"{canary.state.value} {KINDS[canary.key.kind].kind} "
                f"{canary.key.namespace}/{canary.key.name}: {canary.reason}"
            )
        text = "\n".join(lines) + "\n"
    return web.Response(status=status, text=text)


async def ready(request: web.Request) -> web.Response:
    waiting = request.app[NOT_READY]()
    if not waiting:
        return web.Response(text="OK")
    more = f" and {len(waiting) - 20} more" if len(waiting) > 20 else ""
    shown = ", ".join(waiting[:20]) + more
    return web.Response(status=503, text=f"NOT READY: not listed or not connected: {shown}")


async def metrics_page(request: web.Request) -> web.Response:
    response = web.Response(body=generate_latest(metrics.REGISTRY))
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


def build_app(registry: Registry, not_ready: Callable[[], list[str] | None]) -> web.Application:
    app = web.Application(client_max_size=1024)
    app[REGISTRY] = registry
    app[NOT_READY] = not_ready
    for path in ("/healthz", "/livez", "/"):
        app.router.add_get(path, health)
    app.router.add_get("/readyz", ready)
    app.router.add_get("/metrics", metrics_page)
    return app


class HealthServer:
    """Binds at ``start()`` (so a busy port fails before anything else runs), then
    serves until cancelled."""

    def __init__(
        self, settings: Settings, registry: Registry, not_ready: Callable[[], list[str] | None]
    ) -> None:
        self.settings = settings
        self.app = build_app(registry, not_ready)
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        self._runner = web.AppRunner(
            self.app, handle_signals=False, access_log=None, shutdown_timeout=1.0
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
