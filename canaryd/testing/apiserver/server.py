"""``FakeKube``: the fake kube-apiserver as tests hold it: serving, clients, controls.

The top of the layers (store.py < watch.py < handlers.py < here): it serves
``HttpApi`` on a real socket, writes kubeconfigs for its clients, and gathers the
controls tests use that do not belong to one layer.
"""

from __future__ import annotations

import contextlib
import ssl
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from canaryd.testing.apiserver.faults import Fault, RbacDeny
from canaryd.testing.apiserver.handlers import HttpApi, RequestRecord
from canaryd.testing.apiserver.resources import FLINK_TYPES, ResourceType


class FakeKube(HttpApi):
    """The cluster state and the HTTP API over it."""

    def __init__(
        self,
        *,
        crds: Iterable[ResourceType] = FLINK_TYPES,
        token: str | None = None,
        user: str = "system:serviceaccount:default:canaryd",
        bookmark_interval: float = 60.0,
        default_watch_timeout: float = 1800.0,
        history_limit: int = 100_000,
        auto_finalize_namespaces: bool = True,
    ) -> None:
        super().__init__(
            crds=crds,
            history_limit=history_limit,
            auto_finalize_namespaces=auto_finalize_namespaces,
            bookmark_interval=bookmark_interval,
            default_watch_timeout=default_watch_timeout,
            token=token,
            user=user,
        )
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._listen: tuple[str, int, ssl.SSLContext | None] = ("127.0.0.1", 0, None)

    # ----------------------------------------------------------------- serving

    def app(self) -> web.Application:
        app = web.Application(client_max_size=3 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    @contextlib.asynccontextmanager
    async def running(
        self, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None
    ) -> AsyncIterator[FakeKube]:
        await self.start(host, port, ssl_context)
        try:
            yield self
        finally:
            await self.stop()

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        # handler_cancellation: a client that goes away cancels its request, as it
        # cancels the request's context in kube-apiserver (a delayed write whose client
        # gave up is not applied).
        self._runner = web.AppRunner(
            self.app(), handle_signals=False, shutdown_timeout=1.0, handler_cancellation=True
        )
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
        await self._site.start()
        bound_port = self._runner.addresses[0][1]
        scheme = "https" if ssl_context is not None else "http"
        self.url = f"{scheme}://{host}:{bound_port}"
        self._listen = (host, bound_port, ssl_context)

    async def refuse_connections(self) -> None:
        """The API server goes away: nothing listens on its port (connections are
        refused) and every open connection, watches included, is cut."""
        assert self._runner is not None and self._runner.server is not None
        if self._site is not None:
            await self._site.stop()
            self._site = None
        self.abort_watches()
        for handler in list(self._runner.server.connections):
            handler.force_close()
            if handler.transport is not None:
                handler.transport.abort()
        self._notify()

    async def accept_connections(self) -> None:
        """The API server is back on the same address, with the same state."""
        assert self._runner is not None
        if self._site is None:
            host, port, ssl_context = self._listen
            self._site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
            await self._site.start()
        self._notify()

    async def stop(self) -> None:
        self.close_watches()
        for task in list(self._background):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ----------------------------------------------------------------- clients

    def kubeconfig(
        self, *, context: str = "fake", ca_file: str | None = None, insecure: bool = False
    ) -> dict[str, Any]:
        user: dict[str, Any] = {"token": self.token} if self.token else {}
        cluster: dict[str, Any] = {"server": self.url}
        if ca_file:
            cluster["certificate-authority"] = ca_file
        if insecure:
            cluster["insecure-skip-tls-verify"] = True
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": context, "cluster": cluster}],
            "users": [{"name": context, "user": user}],
            "contexts": [{"name": context, "context": {"cluster": context, "user": context}}],
            "current-context": context,
        }

    def write_kubeconfig(self, path: str | Path, **options: Any) -> Path:
        target = Path(path)
        target.write_text(yaml.safe_dump(self.kubeconfig(**options)))
        return target

    def add_client(self, user: str) -> str:
        """A client of its own: returns its bearer token; its requests carry ``user``
        (in the request log, for faults, in RBAC messages)."""
        token = f"token-{uuid.uuid4().hex}"
        self.clients[token] = user
        return token

    def client_kubeconfig(self, path: str | Path, user: str) -> Path:
        """A kubeconfig for a client of its own (``add_client``)."""
        config = self.kubeconfig()
        config["users"][0]["user"] = {"token": self.add_client(user)}
        target = Path(path)
        target.write_text(yaml.safe_dump(config))
        return target

    # ------------------------------------------------------- controls for tests

    def inject(self, fault: Fault) -> Fault:
        self.faults.append(fault)
        return fault

    def deny(
        self, verb: str | None = None, resource: str | None = None, namespace: str | None = None
    ) -> RbacDeny:
        rule = RbacDeny(verb, resource, namespace)
        self.rbac_denies.append(rule)
        return rule

    def install_crd(self, rtype: ResourceType) -> None:
        """A CRD installed while clients run: discovery and its paths serve it from now."""
        self.types[rtype.plural] = rtype
        self.objects.setdefault(rtype.plural, {})

    def remove_crd(self, plural: str) -> None:
        """The CRD and every object of it go (its paths answer 404)."""
        self.close_watches()
        self.types.pop(plural, None)
        self.objects.pop(plural, None)

    def requests_for(
        self, verb: str | None = None, resource: str | None = None, name: str | None = None
    ) -> list[RequestRecord]:
        return [
            r
            for r in self.requests
            if (verb is None or r.verb == verb)
            and (resource is None or r.resource == resource)
            and (name is None or r.name == name)
        ]
