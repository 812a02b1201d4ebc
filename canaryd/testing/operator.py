"""A stand-in for the Flink Kubernetes Operator, as much of it as canaryd can see.

It watches canaries through an API server (the fake's or a real one), "reconciles"
each new generation it sees (JOSDK reconciles on generation changes), and serves
its per-resource JOSDK counters in the format of Flink's Prometheus reporter, the
format recorded from the real operator in ``tests/fixtures/operator-metrics.txt``.
It also answers the operator's own health probe (``/``, 200 once its first list is
done). Faults, as the real one meets them:

- ``wedge()``: its informers stall (a half-open connection of its own): events stop,
  nothing is reconciled, its metrics still answer;
- ``freeze()``: a frozen JVM (SIGSTOP, a GC pause that never ends): connections are
  accepted, nothing is answered (a subprocess can also simply be sent SIGSTOP);
- a restart is a new ``FakeOperator``: its counters start at zero.

Test infrastructure only: the product never imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from canaryd.opmetrics import reporter_label

LABEL = "flink.apache.org/canary"
KINDS = {"flinkdeployments": "FlinkDeployment", "flinksessionjobs": "FlinkSessionJob"}
PREFIX = "flink_k8soperator_namespace_resource_JOSDK_"
COUNTERS = (
    "Reconciliation_Count",
    "Reconciliation_finished_Count",
    "Resource_Event_Count",
    "Resource_Event_ADDED_Count",
    "Resource_Event_UPDATED_Count",
)


class FakeOperator:
    def __init__(
        self,
        server: str,
        token: str | None = None,
        *,
        namespaces: Iterable[str] | None = None,
        kinds: Iterable[str] = tuple(KINDS),
        label: str = LABEL,
        operator_namespace: str = "default",
        host: str = "localhost",
    ) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self.namespaces = sorted(namespaces) if namespaces else None
        self.kinds = tuple(kinds)
        self.label = label
        self.labels_tail = (
            f'name="flink_kubernetes_operator",host="{reporter_label(host)}",'
            f'namespace="{reporter_label(operator_namespace)}",'
        )
        self.started = time.monotonic()
        self.requests = 0
        """Requests to the API server (the real one's KubeClient_HttpRequest_Count)."""
        self.counters: Counter[tuple[str, str, str, str]] = Counter()
        """(counter, Kind, namespace, name) -> value."""
        self.generations: dict[tuple[str, str, str], int] = {}
        """The last generation reconciled per resource."""
        self.answer_delay = 0.0
        """Seconds each metrics answer takes (a slow, working operator)."""
        self.broken_answers = 0
        """The next this many metrics answers are cut off halfway (a broken answer)."""
        self.wedged = False
        self._flowing = asyncio.Event()
        self._flowing.set()
        self.frozen = False
        self.listed = asyncio.Event()
        self.reconciled = asyncio.Event()
        """Set at every reconcile (tests clear it and wait)."""
        self._tasks: list[asyncio.Task[None]] = []
        self._runners: list[web.AppRunner] = []
        self._session: aiohttp.ClientSession | None = None
        self._hangs: set[asyncio.Future[None]] = set()
        self._held: list[socket.socket] = []
        self.metrics_url = ""
        self.probe_url = ""

    # ------------------------------------------------------------------ faults

    def wedge(self) -> None:
        """Its informers stall: nothing more is reconciled; its metrics still answer."""
        self.wedged = True
        self._flowing.clear()

    def unwedge(self) -> None:
        self.wedged = False
        self._flowing.set()

    def freeze(self) -> None:
        """Connections are accepted and nothing is answered, as by a stopped JVM."""
        self.frozen = True

    async def stop_accepting(self) -> None:
        """A frozen JVM after a few reads: its listen backlog is full, so connections to
        the metrics port are neither refused nor accepted (they time out)."""
        self.frozen = True
        metrics = self._runners[0]
        port = metrics.addresses[0][1]
        await metrics.cleanup()
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", port))
        held.listen(0)
        self._held.append(held)
        for _ in range(3):  # fill the accept queue: further SYNs are dropped
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            self._held.append(filler)

    def thaw(self) -> None:
        self.frozen = False
        for hang in list(self._hangs):
            if not hang.done():
                hang.set_result(None)

    def reconciles(
        self, name: str, namespace: str = "default", kind: str = "FlinkDeployment"
    ) -> int:
        return int(self.counters[("Reconciliation_finished_Count", kind, namespace, name)])

    # ----------------------------------------------------------------- serving

    def render(self) -> str:
        """The Prometheus reporter's text: per counter a HELP and TYPE line (gauges, as
        Flink exports its counters), a sample per resource, labels with a trailing
        comma as the reporter's simpleclient writes them."""
        lines: list[str] = []
        process = (
            ("KubeClient_HttpRequest_Count", float(self.requests)),
            # The JVM's CPU time in ns: it grows from the process's start.
            ("Status_JVM_CPU_Time", round((time.monotonic() - self.started) * 1e8) * 1.0),
            ("Status_JVM_Threads_Count", 40.0),
        )
        for metric, value in process:
            name = f"flink_k8soperator_{metric}"
            lines.append(f"# HELP {name} {metric.rsplit('_', 1)[-1]} (scope: k8soperator_{metric})")
            lines.append(f"# TYPE {name} gauge")
            lines.append(f"{name}{{{self.labels_tail}}} {value}")
        for counter in COUNTERS:
            name = PREFIX + counter
            scope = name.removeprefix("flink_").removesuffix("_Count")
            lines.append(f"# HELP {name} Count (scope: {scope})")
            lines.append(f"# TYPE {name} gauge")
            for (which, kind, namespace, resource), value in sorted(self.counters.items()):
                if which == counter:
                    # The reporter filters label values by default: team-a is team_a.
                    lines.append(
                        f'{name}{{resourcename="{reporter_label(resource)}",resourcetype="{kind}",'
                        f'resourcens="{reporter_label(namespace)}",{self.labels_tail}}} '
                        f"{float(value)}"
                    )
        return "\n".join(lines) + "\n"

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        if self.frozen:
            hang = asyncio.get_running_loop().create_future()
            self._hangs.add(hang)
            try:
                await hang
            finally:
                self._hangs.discard(hang)
        if self.answer_delay:
            await asyncio.sleep(self.answer_delay)
        body = self.render().encode()
        if self.broken_answers > 0:
            self.broken_answers -= 1
            # A declared length that is never sent in full: the connection ends early.
            broken = web.StreamResponse(headers={"Content-Length": str(len(body))})
            await broken.prepare(request)
            await broken.write(body[: len(body) // 2])
            if request.transport is not None:
                request.transport.close()
            return broken
        return web.Response(body=body, content_type="text/plain")

    async def _probe(self, request: web.Request) -> web.Response:
        if self.frozen:
            await asyncio.Event().wait()
        if not self.listed.is_set():
            return web.Response(status=500, text="ERROR")
        return web.Response(text="OK")

    async def _serve(self, handler: Any, host: str, port: int) -> str:
        app = web.Application()
        app.router.add_get("/{tail:.*}", handler)
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        self._runners.append(runner)
        return f"http://{host}:{runner.addresses[0][1]}"

    async def start(
        self, host: str = "127.0.0.1", metrics_port: int = 0, probe_port: int | None = None
    ) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._session = aiohttp.ClientSession(headers=headers)
        self.metrics_url = await self._serve(self._metrics, host, metrics_port) + "/metrics"
        if probe_port is not None:
            self.probe_url = await self._serve(self._probe, host, probe_port) + "/"
        scopes: list[str | None] = [*self.namespaces] if self.namespaces else [None]
        for plural in self.kinds:
            for namespace in scopes:
                self._tasks.append(asyncio.create_task(self._informer(plural, namespace)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.thaw()
        for runner in self._runners:
            await runner.cleanup()
        for held in self._held:
            held.close()
        if self._session is not None:
            await self._session.close()

    # --------------------------------------------------------------- informers

    def _path(self, plural: str, namespace: str | None) -> str:
        base = "/apis/flink.apache.org/v1beta1"
        return f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"

    async def _informer(self, plural: str, namespace: str | None) -> None:
        assert self._session is not None
        url = self.server + self._path(plural, namespace)
        params = {"labelSelector": self.label}
        while True:
            try:
                self.requests += 1
                async with self._session.get(url, params=params) as answer:
                    listed = await answer.json()
                if not isinstance(listed, dict) or "items" not in listed:
                    await asyncio.sleep(0.2)
                    continue
                for item in listed["items"]:
                    self._event("ADDED", plural, item)
                self.listed.set()
                rv = listed["metadata"]["resourceVersion"]
                while True:
                    rv = await self._watch(url, rv, plural)
                    if rv is None:
                        break  # 410: list again
            except (aiohttp.ClientError, OSError, ValueError, KeyError):
                await asyncio.sleep(0.2)

    async def _watch(self, url: str, rv: str, plural: str) -> str | None:
        assert self._session is not None
        params = {
            "labelSelector": self.label,
            "watch": "true",
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "60",
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        self.requests += 1
        async with self._session.get(url, params=params, timeout=timeout) as stream:
            async for line in stream.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    return None
                rv = obj.get("metadata", {}).get("resourceVersion", rv)
                await self._flowing.wait()  # a stalled informer: nothing arrives any more
                self._event(str(event.get("type")), plural, obj)
        return rv

    def _event(self, kind_of_event: str, plural: str, obj: dict[str, Any]) -> None:
        if self.wedged or kind_of_event not in ("ADDED", "MODIFIED"):
            return
        metadata = obj.get("metadata") or {}
        key = (KINDS.get(plural, plural), str(metadata.get("namespace")), str(metadata.get("name")))
        self.counters[("Resource_Event_Count", *key)] += 1
        added = kind_of_event == "ADDED" and key not in self.generations
        self.counters[(f"Resource_Event_{'ADDED' if added else 'UPDATED'}_Count", *key)] += 1
        generation = int(metadata.get("generation") or 0)
        if generation <= self.generations.get(key, 0):
            return  # JOSDK reconciles on generation changes only
        self.generations[key] = generation
        self.counters[("Reconciliation_Count", *key)] += 1
        self.counters[("Reconciliation_finished_Count", *key)] += 1
        self.reconciled.set()


# ------------------------------------------------------------------- as a process


def _server_and_token(kubeconfig: Path) -> tuple[str, str | None]:
    config = yaml.safe_load(kubeconfig.read_text())
    server = str(config["clusters"][0]["cluster"]["server"])
    token = config["users"][0]["user"].get("token")
    return server, token


async def _main(args: argparse.Namespace) -> None:
    server, token = _server_and_token(Path(args.kubeconfig))
    operator = FakeOperator(server, token, namespaces=args.namespace or None)
    await operator.start(args.host, args.metrics_port, args.probe_port)
    print(json.dumps({"metrics": operator.metrics_url, "probe": operator.probe_url}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, operator.wedge)
    try:
        await stop.wait()
    finally:
        await operator.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A stand-in Flink Kubernetes Operator.")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", action="append")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--probe-port", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    asyncio.run(_main(args))
    print(f"stopped after {time.monotonic() - started:.1f}s", flush=True)


if __name__ == "__main__":
    main()
