"""Run canaryd in-process against the fake API server, with short cycles.

Waits are bounded and event-driven: a predicate is re-checked whenever the fake
serves a request or the registry changes, and fails with a message saying what
it waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import config as k8s_config

from canaryd import logs, metrics
from canaryd.config import Settings, load_settings
from canaryd.daemon import Daemon
from canaryd.kube import KubeClient, connect
from canaryd.metrics import BLIND_REASONS
from canaryd.registry import Canary, CanaryKey, CanaryState
from canaryd.testing.apiserver import FLINK_DEPLOYMENTS, FLINK_SESSION_JOBS, FakeKube, Fault

LABEL = "flink.apache.org/canary"

# The shipped defaults with a short cycle, nothing else: every other timing is the
# daemon's own, derived from the cycle exactly as it is for users (Settings' properties).
CYCLE = 0.3
TEST_SETTINGS = Settings(host="127.0.0.1", port=0, timeout=CYCLE)


def canary_body(name: str = "canary", value: str = "true", **extra: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": {LABEL: value}}
    metadata.update(extra.pop("metadata", {}))
    return {"metadata": metadata, **extra}


async def until_poked(
    predicate: Callable[[], bool],
    what: str,
    within: float,
    *listeners: list[Callable[[], None]],
    prefix: str = "",
) -> None:
    """Wait until ``predicate()`` holds, re-checked whenever something calls one of the
    ``listeners`` lists' entries (no polling); an AssertionError naming ``what`` after
    ``within`` seconds."""
    poke = asyncio.Event()
    for hooks in listeners:
        hooks.append(poke.set)
    try:
        async with asyncio.timeout(within):
            while not predicate():
                poke.clear()
                await poke.wait()
    except TimeoutError:
        raise AssertionError(f"{prefix}still waiting after {within:g}s for {what}") from None
    finally:
        for hooks in listeners:
            hooks.remove(poke.set)


@dataclass
class Running:
    kube: FakeKube
    daemon: Daemon
    http: aiohttp.ClientSession
    url: str

    @property
    def registry(self) -> Any:
        return self.daemon.registry

    def canary(
        self, name: str = "canary", namespace: str = "default", kind: str = "flinkdeployments"
    ) -> Canary | None:
        found: Canary | None = self.daemon.registry.get(CanaryKey(kind, namespace, name))
        return found

    async def until(self, predicate: Callable[[], bool], what: str, within: float = 5.0) -> None:
        """Wait until ``predicate()`` holds, re-checked at every change of the fake or
        the registry."""
        await until_poked(predicate, what, within, self.kube.listeners, self.registry.listeners)

    def tracked(
        self, name: str = "canary", namespace: str = "default", kind: str = "flinkdeployments"
    ) -> Canary:
        found = self.canary(name, namespace, kind)
        assert found is not None, f"{kind}/{namespace}/{name} is not tracked"
        return found

    async def until_tracked(
        self,
        name: str = "canary",
        namespace: str = "default",
        kind: str = "flinkdeployments",
        within: float = 5.0,
    ) -> Canary:
        await self.until(
            lambda: self.canary(name, namespace, kind) is not None,
            f"{kind}/{namespace}/{name} to be tracked",
            within,
        )
        return self.tracked(name, namespace, kind)

    async def until_state(
        self,
        state: CanaryState,
        name: str = "canary",
        namespace: str = "default",
        kind: str = "flinkdeployments",
        within: float = 5.0,
    ) -> Canary:
        def check() -> bool:
            found = self.canary(name, namespace, kind)
            return found is not None and found.state is state

        await self.until(check, f"{kind}/{namespace}/{name} to be {state.value}", within)
        return self.tracked(name, namespace, kind)

    async def until_gone(
        self,
        name: str = "canary",
        namespace: str = "default",
        kind: str = "flinkdeployments",
        within: float = 5.0,
    ) -> None:
        await self.until(
            lambda: self.canary(name, namespace, kind) is None,
            f"{kind}/{namespace}/{name} to be dropped",
            within,
        )

    async def until_bumps(self, count: int, name: str = "canary", within: float = 5.0) -> None:
        await self.until(
            lambda: len(self.bumps(name)) >= count, f"{count} successful bumps of {name}", within
        )

    def bumps(self, name: str = "canary") -> list[Any]:
        return [r for r in self.kube.requests_for("patch", name=name) if r.status == 200]

    async def get(self, path: str, **headers: str) -> tuple[int, str]:
        async with self.http.get(self.url + path, headers=headers) as response:
            return response.status, await response.text()


@contextlib.asynccontextmanager
async def running_daemon(
    kube: FakeKube, kubeconfig: Path, **overrides: Any
) -> AsyncIterator[Running]:
    settings = replace(TEST_SETTINGS, kubeconfig=str(kubeconfig), **overrides)
    daemon = Daemon(settings)
    task = asyncio.create_task(daemon.run(), name="canaryd under test")
    started = asyncio.ensure_future(daemon.started.wait())
    await asyncio.wait({task, started}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        started.cancel()
        task.result()  # raises what made the daemon stop
    assert started.done(), "canaryd did not start within 10s"
    assert daemon.server is not None and daemon.server.port is not None
    async with aiohttp.ClientSession() as http:
        try:
            yield Running(kube, daemon, http, f"http://127.0.0.1:{daemon.server.port}")
        finally:
            daemon.stop()
            async with asyncio.timeout(5):
                await task


def event_body(namespace: str = "default", **fields: Any) -> dict[str, Any]:
    """An events.k8s.io/v1 Event as canaryd.events writes one, on the canary ``canary``."""
    body = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": "canary.1"},
        "eventTime": "2026-12-07T03:00:00.000000Z",
        "reportingController": "canaryd",
        "reportingInstance": "canaryd-host",
        "action": "Judged",
        "reason": "Unhealthy",
        "type": "Warning",
        "regarding": {"kind": "FlinkDeployment", "namespace": namespace, "name": "canary"},
        "note": "not_observed: generation 2 not observed",
    }
    return {**body, **fields}


def create_canary(
    kube: FakeKube,
    name: str = "canary",
    namespace: str = "default",
    kind: str = "flinkdeployments",
    **body: Any,
) -> dict[str, Any]:
    rtype = FLINK_DEPLOYMENTS if kind == "flinkdeployments" else FLINK_SESSION_JOBS
    return kube.create(rtype, namespace, canary_body(name, **body))


OUTAGES = (
    "refused",
    "503 no healthy upstream",
    "429",
    "404 404 page not found\n",
    "404 <html>404</html>",
)
"""How an API server that went away answers: not at all, a gateway's own page with
none behind it (Envoy's 503; Go's 404, Traefik's default router, the very bytes
kube-apiserver answers for a kind not installed; an HTML 404), or every request shed
(API Priority and Fairness)."""


@contextlib.asynccontextmanager
async def api_server_away(kube: FakeKube, how: str) -> AsyncIterator[None]:
    """The API server is away for the block, as ``how`` (one of OUTAGES) says; its open
    watches are cut."""
    if how == "refused":
        await kube.refuse_connections()
    else:
        page = how.partition(" ")[2] or None
        kube.unavailable = Fault(code=int(how[:3]), page=page, retry_after=1)
        kube.abort_watches()
    try:
        yield
    finally:
        kube.unavailable = None
        await kube.accept_connections()


def counter(metric: Any, *labels: str) -> float:
    """A Prometheus counter's (or gauge's) current value, by its labels."""
    value: float = (metric.labels(*labels) if labels else metric)._value.get()
    return value


def write_dynamic_config(path: Path, namespaces: str) -> None:
    """An operator flink-conf.yaml with these watched namespaces and dynamic namespaces on."""
    path.write_text(
        f"kubernetes.operator.watched.namespaces: {namespaces}\n"
        "kubernetes.operator.dynamic.namespaces.enabled: true\n"
    )


def following(path: Path, *namespaces: str) -> dict[str, object]:
    """Daemon settings as load_settings makes them for that file: namespaces followed."""
    return {
        "operator_config": path,
        "namespaces": frozenset(namespaces),
        "from_file": frozenset({"namespaces"}),
        "dynamic_namespaces": True,
    }


@contextlib.contextmanager
def json_logs(level: str = "debug") -> Iterator[None]:
    """canaryd's own log configuration (JSON), on the test's captured stderr."""
    logs.configure("json", level)
    try:
        yield
    finally:
        logs.configure("console", "info")  # what tests/conftest.py sets


def json_lines(text: str) -> list[dict[str, Any]]:
    """canaryd's JSON log records in captured output (other lines ignored)."""
    records = []
    for line in text.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    return records


async def read_until(
    proc: asyncio.subprocess.Process, text: str, lines: list[str], within: float = 20
) -> None:
    """Read a canaryd process's stderr into ``lines`` until a line holds ``text``."""
    assert proc.stderr is not None
    async with asyncio.timeout(within):
        while True:
            line = (await proc.stderr.readline()).decode()
            assert line, f"canaryd ended before logging {text!r}: {''.join(lines)[-2000:]}"
            lines.append(line)
            if text in line:
                return


@contextlib.contextmanager
def black_hole() -> Iterator[str]:
    """An address on 127.0.0.1 that never completes a TCP handshake: a listening socket
    that accepts nothing, with its accept queue full, so further SYNs are dropped (a
    black-holed API server address, for real)."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    try:
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        yield f"http://127.0.0.1:{port}"
    finally:
        for filler in fillers:
            filler.close()
        server.close()


class HalfOpenProxy:
    """A TCP forwarder on 127.0.0.1 in front of a server. ``freeze()`` makes every
    connection open at that moment half-open: it stays open and forwards nothing more,
    either way, with no FIN or RST (a crashed replica behind a load balancer), while
    connections made later work."""

    def __init__(self, target: str) -> None:
        host, port = target.split("://", 1)[-1].split("/")[0].rsplit(":", 1)
        self._target = (host, int(port))
        self._live: set[asyncio.Event] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.url = ""

    def freeze(self) -> None:
        for frozen in self._live:
            frozen.set()
        self._live = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        frozen = asyncio.Event()
        self._live.add(frozen)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                if not frozen.is_set():  # frozen: dropped, as by a dead peer
                    dst.write(data)
                    await dst.drain()
            if not frozen.is_set():
                dst.close()

        try:
            with contextlib.suppress(OSError):
                async with asyncio.TaskGroup() as group:
                    group.create_task(pipe(reader, up_writer))
                    group.create_task(pipe(up_reader, writer))
        finally:
            writer.close()
            up_writer.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[HalfOpenProxy]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            yield self
        finally:
            server.close()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()


def blind_now() -> set[str]:
    """The reasons canaryd_blind is 1 for, read as a scrape reads them."""
    value = metrics.REGISTRY.get_sample_value
    return {r for r in BLIND_REASONS if value("canaryd_blind", {"reason": r}) == 1}


def blind_gauge(scraped: str) -> dict[str, float]:
    """canaryd_blind by reason, from a /metrics page."""
    prefix = 'canaryd_blind{reason="'
    return {
        line[len(prefix) :].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in scraped.splitlines()
        if line.startswith(prefix)
    }


async def blind_everywhere(run: Running, *reasons: str) -> str:
    """Each of ``reasons`` (and no other) in canaryd_blind at 1, every other at 0, a
    ``blind REASON:`` line each in /readyz's body and /healthz?verbose; /healthz
    itself 200 (a verdict about the operator, not about canaryd). /readyz's body."""
    await run.until(lambda: blind_now() == set(reasons), f"canaryd_blind 1 for {reasons} only")
    _, scraped = await run.get("/metrics")
    gauge = blind_gauge(scraped)
    assert set(gauge) == set(BLIND_REASONS), gauge  # every reason exported
    assert {reason for reason, value in gauge.items() if value == 1} == set(reasons), gauge
    _, ready = await run.get("/readyz")
    _, verbose = await run.get("/healthz?verbose")
    for reason in reasons:
        assert f"\nblind {reason}: " in ready, ready
        assert f"\nblind {reason}: " in verbose, verbose
    assert (await run.get("/healthz"))[0] == 200
    return ready


async def start_records(
    kube: FakeKube, kubeconfig: Path, conf: Path, capsys: Any
) -> list[dict[str, Any]]:
    """canaryd's JSON log records of a start with ``--operator-config conf`` (its
    namespaces as the file says), until its watcher runs."""
    settings = load_settings(["--operator-config", str(conf)], {})
    with json_logs("info"):
        async with running_daemon(
            kube, kubeconfig, operator_config=conf, namespaces=settings.namespaces
        ) as run:
            await run.until(lambda: run.daemon.watcher is not None, "the watcher")
    return json_lines(capsys.readouterr().err)


async def counting_client(
    kube: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[KubeClient, list[None]]:
    """A KubeClient of the fake's kubeconfig, and a list that grows by one per reload."""
    config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    client = await connect(Settings(kubeconfig=str(config)))
    reloads: list[None] = []
    real = k8s_config.load_kube_config

    async def counted(*args: Any, **kwargs: Any) -> Any:
        reloads.append(None)
        return await real(*args, **kwargs)

    monkeypatch.setattr(k8s_config, "load_kube_config", counted)
    return client, reloads
