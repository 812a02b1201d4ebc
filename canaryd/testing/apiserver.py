"""A fake kube-apiserver on aiohttp, faithful where canaryd depends on Kubernetes.

Use it in-process from pytest::

    async with FakeKube().running() as kube:
        kube.write_kubeconfig(path)

or as a process for the demo and benchmarks::

    python -m canaryd.testing.apiserver --kubeconfig /tmp/kubeconfig --port 0

Every modelled behaviour cites where kube-apiserver implements it; paths are in
github.com/kubernetes/kubernetes. What it does not model is listed in
``NOT_MODELLED`` below.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import itertools
import json
import random
import signal
import ssl
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from canaryd.testing.patches import PatchError, PatchTestFailed, json_patch, merge_patch
from canaryd.testing.selectors import SelectorError, parse_field_selector, parse_label_selector

NOT_MODELLED = (
    "OpenAPI schema validation, defaulting and pruning of custom resources",
    "server-side apply and managedFields",
    "resourceVersionMatch; list pagination is modelled as kube-apiserver's chunking "
    "(limit/continue from one snapshot, 410 once compacted), not its token format",
    "the watch cache's sendInitialEvents / initial-events-end bookmark",
    "admission webhooks, quota, owner references and garbage collection",
    "client certificates and any authentication other than one bearer token",
    "bookmark timing: kube-apiserver's watch cache sends about one a minute; the fake "
    "every bookmark_interval (canaryd's idle watchdog outlasts both)",
    "authorization per request only: an open watch outlives a removed RoleBinding, "
    "as on kube-apiserver (checked by tests/test_e2e.py), but nothing else of RBAC",
)
"""What the fake leaves out, each irrelevant to canaryd; tests/test_conformance.py
compares the rest with a real kube-apiserver in ``make e2e``."""

FLINK_GROUP = "flink.apache.org"
FLINK_VERSION = "v1beta1"


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    custom: bool
    status_subresource: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        """``flinkdeployments.flink.apache.org``: how kube-apiserver names it in messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


NAMESPACES = ResourceType("", "v1", "namespaces", "Namespace", False, False, False)
FLINK_DEPLOYMENTS = ResourceType(
    FLINK_GROUP, FLINK_VERSION, "flinkdeployments", "FlinkDeployment", True, True, True
)
FLINK_SESSION_JOBS = ResourceType(
    FLINK_GROUP, FLINK_VERSION, "flinksessionjobs", "FlinkSessionJob", True, True, True
)
FLINK_TYPES = (FLINK_DEPLOYMENTS, FLINK_SESSION_JOBS)
# A built-in type: no generation, no status (pkg/registry/coordination/lease/strategy.go:
# AllowUnconditionalUpdate false, AllowCreateOnUpdate true).
LEASES = ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True, False, False)


class ApiError(Exception):
    """Becomes a ``Status`` response, the shape of every kube-apiserver error
    (staging/src/k8s.io/apimachinery/pkg/api/errors/errors.go)."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = details
        self.headers = headers or {}

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def _details(rtype: ResourceType, name: str | None) -> dict[str, Any]:
    details: dict[str, Any] = {"group": rtype.group, "kind": rtype.plural}
    if name:
        details["name"] = name
    return details


def not_found(rtype: ResourceType, name: str) -> ApiError:
    return ApiError(
        404,
        "NotFound",
        f'{rtype.group_resource} "{name}" not found',
        details=_details(rtype, name),
    )


def conflict(rtype: ResourceType, name: str) -> ApiError:
    # errors.NewConflict with storage.ErrCodeResourceVersionConflicts' message
    # (staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go).
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rtype.group_resource} "{name}": the object has '
        "been modified; please apply your changes to the latest version and try again",
        details=_details(rtype, name),
    )


# Reasons of the statuses fault injection can return (errors.go, reasonForCode).
_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


@dataclass
class Request:
    """What a request means in Kubernetes terms, parsed once from its path."""

    verb: str
    rtype: ResourceType | None
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None
    user: str = ""
    """Who sent it (by its bearer token); empty when the fake takes any."""
    created: bool = False
    """The request created an object (a POST, or a PUT that creates: 201)."""


@dataclass
class RequestRecord:
    """One entry of the request log that tests count and inspect."""

    method: str
    path: str
    query: dict[str, str]
    verb: str
    resource: str | None
    namespace: str | None
    name: str | None
    subresource: str | None
    content_type: str | None
    body: Any
    status: int = 0
    at: float = 0.0
    """Loop time when the request arrived."""
    user: str = ""


@dataclass
class Fault:
    """Makes the next ``times`` matching requests fail (``times=-1``: until removed).

    ``code`` answers with that Status code (``retry_after`` adds the header);
    ``drop`` closes the connection without an answer; ``latency`` delays the
    request, then it fails with ``code`` or, with ``code=0``, is served normally;
    ``empty_watch`` answers a watch 200 and ends the stream at once, with no event
    (a proxy or load balancer in front of the API server that does so);
    ``delay_answer`` serves the request, then holds its answer that long (the write's
    watch event reaches watchers first, as it often does on a real server).
    ``action`` runs first: a concurrent writer that wins the race against this request
    (e.g. ``lambda: kube.update(...)``), so a stale precondition gets a real 409.
    """

    verb: str | None = None
    resource: str | None = None
    namespace: str | None = None
    name: str | None = None
    user: str | None = None
    """Only this client's requests (its user, by bearer token: ``FakeKube.add_client``)."""
    code: int = 500
    times: int = 1
    retry_after: int | None = None
    drop: bool = False
    empty_watch: bool = False
    delay_answer: float = 0.0
    latency: float = 0.0
    message: str = "fault injected by the fake API server"
    action: Callable[[], object] | None = None
    hits: int = 0

    def matches(self, req: Request) -> bool:
        return (
            self.times != 0
            and (self.verb is None or self.verb == req.verb)
            and (
                self.resource is None
                or (req.rtype is not None and req.rtype.plural == self.resource)
            )
            and (self.namespace is None or self.namespace == req.namespace)
            and (self.name is None or self.name == req.name)
            and (self.user is None or self.user == req.user)
        )


@dataclass
class RbacDeny:
    """A missing permission: requests matching every set field get 403 Forbidden."""

    verb: str | None = None
    resource: str | None = None
    namespace: str | None = None

    def matches(self, req: Request) -> bool:
        return (
            (self.verb is None or self.verb == req.verb)
            and (
                self.resource is None
                or (req.rtype is not None and req.rtype.plural == self.resource)
            )
            and (self.namespace is None or self.namespace == req.namespace)
        )


@dataclass
class Change:
    """One committed write, as the watch history keeps it."""

    rv: int
    rtype: ResourceType
    type: str  # ADDED, MODIFIED, DELETED
    old: dict[str, Any] | None
    new: dict[str, Any]


@dataclass(eq=False)
class _Watcher:
    rtype: ResourceType
    namespace: str | None
    transport: asyncio.BaseTransport | None = None
    queue: asyncio.Queue[Change | bytes | None] = field(default_factory=asyncio.Queue)
    silent: bool = False
    """Half-open: the stream stays open and sends nothing more (silence_watches)."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels if isinstance(labels, dict) else {}


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON, as the server compares them: Python's ``True == 1 == 1.0`` is not
    (the stored bytes and apiequality.Semantic.DeepEqual on decoded JSON tell them
    apart)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _without_metadata(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "apiVersion", "kind")}


class FakeKube:
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
        self.types: dict[str, ResourceType] = {NAMESPACES.plural: NAMESPACES, LEASES.plural: LEASES}
        self.types.update({t.plural: t for t in crds})
        self.token = token
        self.user = user
        self.clients: dict[str, str] = {}
        """More bearer tokens and their users (several canaryd processes told apart)."""
        self.bookmark_interval = bookmark_interval
        self.default_watch_timeout = default_watch_timeout
        self.history_limit = history_limit
        self.auto_finalize_namespaces = auto_finalize_namespaces
        self.objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {
            plural: {} for plural in self.types
        }
        self.rv = 0
        self.history: deque[Change] = deque()
        self.compacted_rv = 0
        self.faults: list[Fault] = []
        self.hooks: list[Callable[[Request], Fault | None]] = []
        """Asked, in order, for a fault when no entry of ``faults`` matches (seeded chaos)."""
        self.pretty_errors = False
        """Indent Status bodies, as some proxies and older servers do."""
        self.rbac_denies: list[RbacDeny] = []
        self.requests: list[RequestRecord] = []
        self.keep_requests: int | None = None
        """Bound the request log to about this many entries (the oldest half goes)."""
        self.watchers: set[_Watcher] = set()
        self._held: list[Change] | None = None
        """Changes not yet dispatched to watches while delivery is held."""
        self._dispatched_rv = 0
        """The resourceVersion up to which changes went to the watches."""
        self._continues: dict[str, tuple[int, list[dict[str, Any]]]] = {}
        """Paginated lists in progress: continue token -> (snapshot rv, items left)."""
        self._watch_generation = 0
        self._background: set[asyncio.Task[None]] = set()
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._listen: tuple[str, int, ssl.SSLContext | None] = ("127.0.0.1", 0, None)
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        self.listeners: list[Callable[[], None]] = []
        """Called after every request, write, and watch start or end."""

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
        self._runner = web.AppRunner(self.app(), handle_signals=False, shutdown_timeout=1.0)
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

    async def wait_for(
        self, predicate: Callable[[], bool], *, within: float = 5.0, what: str = ""
    ) -> None:
        """Wait until ``predicate()`` holds; it is re-checked after every request, write
        and watch start or end. Fails with a clear message after ``within`` seconds."""
        if predicate():
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (predicate, future)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(within):
                await future
        except TimeoutError:
            raise AssertionError(
                f"fake API server: still waiting after {within}s for {what or predicate}"
            ) from None
        finally:
            self._waiters.remove(entry)

    def _notify(self) -> None:
        for listener in list(self.listeners):
            listener()
        for predicate, future in self._waiters:
            if not future.done() and predicate():
                future.set_result(None)

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

    def hold_watch_events(self) -> None:
        """A stuck delivery path, as when kube-apiserver's watch cache is no longer fed by
        etcd: changes reach no watch, open or new, until released; bookmarks keep coming
        at the last dispatched resourceVersion, as the cacher's dispatch loop sends them
        (staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go, dispatchEvents)."""
        if self._held is None:
            self._held = []

    def release_watch_events(self) -> None:
        held, self._held = self._held or [], None
        for change in held:
            self._send_to_watches(change)

    def silence_watches(self) -> None:
        """Half-open connections: every open watch stream stays open and never sends
        another byte (a crashed replica behind a load balancer, a lost conntrack entry);
        watches opened after this work."""
        for watcher in self.watchers:
            watcher.silent = True

    def close_watches(self) -> None:
        """End every open watch stream, as an API server restart does."""
        for watcher in list(self.watchers):
            watcher.queue.put_nowait(None)

    def inject_watch_line(self, raw: bytes) -> None:
        """Send these bytes as-is on every open watch stream (malformed input)."""
        for watcher in list(self.watchers):
            watcher.queue.put_nowait(raw)

    def abort_watches(self) -> None:
        """Cut every watch connection at once (a crashed API server or a broken link)."""
        for watcher in list(self.watchers):
            if watcher.transport is not None:
                watcher.transport.close()

    def compact(self) -> None:
        """Forget the history: a watch from an older resourceVersion gets 410 Expired, and
        so does a list continued from an older snapshot."""
        self.compacted_rv = self.rv
        self.history.clear()
        self._continues.clear()

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

    # ------------------------------------------- direct state access (no HTTP)

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        body = {"metadata": {"name": name, "labels": labels or {}}}
        return self.create(NAMESPACES, None, body)

    def get(self, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        obj = self.objects[plural].get((namespace or "", name))
        return copy.deepcopy(obj) if obj is not None else None

    def create(
        self, rtype: ResourceType, namespace: str | None, body: dict[str, Any]
    ) -> dict[str, Any]:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict) or not meta.get("name"):
            raise ApiError(
                422, "Invalid", f"{rtype.kind} is invalid: metadata.name: Required value"
            )
        name = meta["name"]
        if rtype.namespaced:
            namespace = namespace or meta.get("namespace") or "default"
            if meta.get("namespace") not in (None, namespace):
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does "
                    "not match the namespace sent on the request",
                )
            self._check_namespace_accepts(namespace)
        key = (namespace or "", name)
        if key in self.objects[rtype.plural]:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{rtype.group_resource} "{name}" already exists',
                details=_details(rtype, name),
            )
        obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now())
        for server_owned in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(server_owned, None)
        if rtype.namespaced:
            meta["namespace"] = namespace
        if rtype.custom:
            # customResourceStrategy.PrepareForCreate: generation starts at 1 and, with
            # the status subresource, status is dropped
            # (staging/src/k8s.io/apiextensions-apiserver/pkg/registry/customresource/strategy.go).
            meta["generation"] = 1
            if rtype.status_subresource:
                obj.pop("status", None)
        if rtype is NAMESPACES:
            # pkg/registry/core/namespace/strategy.go PrepareForCreate: phase Active,
            # the "kubernetes" finalizer that the namespace controller removes.
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
        self._commit(rtype, key, "ADDED", None, obj)
        return copy.deepcopy(obj)

    def update(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        mutate: Callable[[dict[str, Any]], dict[str, Any]],
        *,
        status_only: bool = False,
        require_rv: bool = False,
    ) -> dict[str, Any]:
        """Apply ``mutate`` to a copy of the stored object with the update strategy's rules."""
        key = (namespace or "", name)
        current = self.objects[rtype.plural].get(key)
        if current is None:
            raise not_found(rtype, name)
        proposed = mutate(copy.deepcopy(current))
        if not isinstance(proposed, dict):
            raise ApiError(400, "BadRequest", "the body must be a JSON object")
        meta = proposed.get("metadata")
        if not isinstance(meta, dict):
            meta = proposed["metadata"] = {}
        sent_rv = meta.get("resourceVersion")
        if require_rv and not sent_rv:
            # Custom resources do not allow unconditional updates
            # (customResourceStrategy.AllowUnconditionalUpdate returns false).
            raise ApiError(
                422,
                "Invalid",
                f'{rtype.kind}.{rtype.group} "{name}" is invalid: '
                "metadata.resourceVersion: Invalid value: 0x0: must be specified "
                "for an update",
            )
        # A sent resourceVersion is a precondition: GuaranteedUpdate refuses a stale one
        # (staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go, Update).
        if sent_rv and str(sent_rv) != current["metadata"]["resourceVersion"]:
            raise conflict(rtype, name)
        new = self._prepare_update(rtype, current, proposed, status_only)
        if _same_json(new, current):
            # A no-op write stores nothing, keeps the resourceVersion and emits no
            # event (staging/src/k8s.io/apiserver/pkg/storage/etcd3/store.go,
            # GuaranteedUpdate: "if !origState.stale && bytes.Equal(data, origState.data)").
            return copy.deepcopy(current)
        finalizing = new["metadata"].get("deletionTimestamp") and not new["metadata"].get(
            "finalizers"
        )
        if finalizing:
            # Once deletionTimestamp is set, removing the last finalizer deletes the
            # object (store.go, Update → deleteWithoutFinalizers / shouldDeleteDuringUpdate).
            self._commit(rtype, key, "DELETED", current, new)
        else:
            self._commit(rtype, key, "MODIFIED", current, new)
        return copy.deepcopy(new)

    def _prepare_update(
        self,
        rtype: ResourceType,
        current: dict[str, Any],
        proposed: dict[str, Any],
        status_only: bool,
    ) -> dict[str, Any]:
        old_meta = current["metadata"]
        if status_only:
            # statusStrategy.PrepareForUpdate: a /status write changes only status
            # (customresource/status_strategy.go); generation never moves.
            new = copy.deepcopy(current)
            if "status" in proposed:
                new["status"] = proposed["status"]
            else:
                new.pop("status", None)
        else:
            new = proposed
            new["apiVersion"], new["kind"] = rtype.api_version, rtype.kind
            if rtype.status_subresource:
                # With the status subresource the main endpoint cannot set status
                # (customresource/strategy.go, PrepareForUpdate).
                if "status" in current:
                    new["status"] = copy.deepcopy(current["status"])
                else:
                    new.pop("status", None)
        meta = new["metadata"]
        # Fields the server owns (ObjectMetaUpdateValidation keeps them immutable).
        for owned in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ):
            if owned in old_meta:
                meta[owned] = old_meta[owned]
            else:
                meta.pop(owned, None)
        if old_meta.get("deletionTimestamp") and not status_only:
            # Finalizers can only be removed once deletion started, never added back
            # (ValidateObjectMetaUpdate: "no new finalizers can be added if the object
            # is being deleted").
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if added:
                raise ApiError(
                    422,
                    "Invalid",
                    f'{rtype.kind} "{meta["name"]}" is invalid: '
                    "metadata.finalizers: Forbidden: no new finalizers can be "
                    f"added if the object is being deleted, found new finalizers "
                    f"{sorted(added)}",
                )
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if rtype.custom:
            # Any change outside metadata bumps generation (strategy.go, PrepareForUpdate:
            # copyNonMetadata + apiequality.Semantic.DeepEqual); metadata-only writes never do.
            meta["generation"] = old_meta.get("generation", 1)
            if not status_only and not _same_json(
                _without_metadata(new), _without_metadata(current)
            ):
                meta["generation"] += 1
        return new

    def delete(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        preconditions: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        key = (namespace or "", name)
        current = self.objects[rtype.plural].get(key)
        if current is None:
            raise not_found(rtype, name)
        meta = current["metadata"]
        if preconditions:
            for field_name in ("uid", "resourceVersion"):
                expected = preconditions.get(field_name)
                if expected and expected != meta.get(field_name):
                    raise ApiError(
                        409,
                        "Conflict",
                        f"Precondition failed: {field_name}: {expected}, "
                        f"ObjectMeta.{field_name[0].upper() + field_name[1:]}: "
                        f"{meta.get(field_name)}",
                        details=_details(rtype, name),
                    )
        if rtype is NAMESPACES:
            return self._delete_namespace(current)
        if meta.get("finalizers"):
            # Graceful deletion with finalizers: set deletionTimestamp, keep the object
            # (store.go, Delete → updateForGracefulDeletionAndFinalizers).
            if meta.get("deletionTimestamp"):
                return copy.deepcopy(current)
            new = copy.deepcopy(current)
            new["metadata"].update(deletionTimestamp=_now(), deletionGracePeriodSeconds=0)
            self._commit(rtype, key, "MODIFIED", current, new)
            return copy.deepcopy(new)
        self._commit(rtype, key, "DELETED", current, copy.deepcopy(current))
        return copy.deepcopy(current)

    def _delete_namespace(self, current: dict[str, Any]) -> dict[str, Any]:
        # A namespace goes Terminating first; the namespace controller deletes its
        # content and then removes the "kubernetes" finalizer
        # (pkg/registry/core/namespace/storage/storage.go, Delete;
        # pkg/controller/namespace/deletion/namespaced_resources_deleter.go).
        name = current["metadata"]["name"]
        if current["metadata"].get("deletionTimestamp"):
            return copy.deepcopy(current)
        new = copy.deepcopy(current)
        new["metadata"].update(deletionTimestamp=_now(), deletionGracePeriodSeconds=0)
        new["status"] = {"phase": "Terminating"}
        self._commit(NAMESPACES, ("", name), "MODIFIED", current, new)
        if self.auto_finalize_namespaces:
            task = asyncio.get_running_loop().create_task(self._finalize_soon(name))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return copy.deepcopy(new)

    async def _finalize_soon(self, name: str) -> None:
        await asyncio.sleep(0)  # let the Terminating event reach the watches first
        self.finalize_namespace(name)

    def finalize_namespace(self, name: str) -> None:
        """Run the namespace controller once: delete the content of a terminating namespace."""
        ns = self.objects["namespaces"].get(("", name))
        if ns is None or not ns["metadata"].get("deletionTimestamp"):
            return
        for rtype in self.types.values():
            if not rtype.namespaced:
                continue
            for obj_ns, obj_name in sorted(self.objects[rtype.plural]):
                if obj_ns == name:
                    self.delete(rtype, obj_ns, obj_name)
        self._maybe_finish_namespace(NAMESPACES, ns)  # already empty: nothing deleted above

    def _maybe_finish_namespace(self, rtype: ResourceType, obj: dict[str, Any]) -> None:
        """Delete a terminating namespace once nothing is left in it."""
        if rtype is NAMESPACES:
            name = obj["metadata"]["name"]
        elif rtype.namespaced:
            name = obj["metadata"]["namespace"]
        else:
            return
        ns = self.objects["namespaces"].get(("", name))
        if ns is None or not ns["metadata"].get("deletionTimestamp"):
            return
        if any(
            key[0] == name
            for t in self.types.values()
            if t.namespaced
            for key in self.objects[t.plural]
        ):
            return
        final = copy.deepcopy(ns)
        final["spec"] = {"finalizers": []}
        self._commit(NAMESPACES, ("", name), "DELETED", ns, final)

    def _check_namespace_accepts(self, namespace: str) -> None:
        # NamespaceLifecycle admission (plugin/pkg/admission/namespace/lifecycle/admission.go).
        ns = self.objects["namespaces"].get(("", namespace))
        if ns is None:
            raise ApiError(
                404,
                "NotFound",
                f'namespaces "{namespace}" not found',
                details={"name": namespace, "kind": "namespaces"},
            )
        if ns["metadata"].get("deletionTimestamp"):
            raise ApiError(
                403,
                "Forbidden",
                f"unable to create new content in namespace {namespace} because it is "
                "being terminated",
                details={
                    "name": namespace,
                    "kind": "namespaces",
                    "causes": [
                        {
                            "reason": "NamespaceTerminating",
                            "message": f"namespace {namespace} is being terminated",
                            "field": "metadata.namespace",
                        }
                    ],
                },
            )

    def _commit(
        self,
        rtype: ResourceType,
        key: tuple[str, str],
        event: str,
        old: dict[str, Any] | None,
        new: dict[str, Any],
    ) -> None:
        # One global, increasing resourceVersion, set by every write, sent as a string
        # (etcd's revision; staging/src/k8s.io/apiserver/pkg/storage/etcd3/store.go).
        self.rv += 1
        new["metadata"]["resourceVersion"] = str(self.rv)
        if event == "DELETED":
            self.objects[rtype.plural].pop(key, None)
        else:
            self.objects[rtype.plural][key] = new
        change = Change(
            self.rv, rtype, event, copy.deepcopy(old) if old else None, copy.deepcopy(new)
        )
        self.history.append(change)
        while len(self.history) > self.history_limit:
            self.compacted_rv = self.history.popleft().rv
        if self._held is not None:
            self._held.append(change)
        else:
            self._send_to_watches(change)
        if event == "DELETED" and rtype.namespaced:
            self._maybe_finish_namespace(rtype, new)
        self._notify()

    def _send_to_watches(self, change: Change) -> None:
        self._dispatched_rv = change.rv
        for watcher in self.watchers:
            if watcher.rtype is change.rtype:
                watcher.queue.put_nowait(change)

    # -------------------------------------------------------------------- HTTP

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        record = RequestRecord(
            method=request.method,
            path=request.path,
            query=dict(request.query),
            verb="",
            resource=None,
            namespace=None,
            name=None,
            subresource=None,
            content_type=request.headers.get("Content-Type"),
            body=None,
            at=asyncio.get_running_loop().time(),
        )
        self.requests.append(record)
        if self.keep_requests is not None and len(self.requests) > self.keep_requests:
            del self.requests[: len(self.requests) // 2]
        try:
            raw = await request.read()
            if raw:
                try:
                    record.body = json.loads(raw)
                except ValueError:
                    record.body = raw.decode("utf-8", "replace")
            response = await self._dispatch(request, record, raw)
        except ApiError as err:
            response = web.json_response(
                err.status(),
                status=err.code,
                headers=err.headers,
                dumps=(lambda o: json.dumps(o, indent=2)) if self.pretty_errors else json.dumps,
            )
        record.status = response.status
        self._notify()
        return response

    async def _dispatch(
        self, request: web.Request, record: RequestRecord, raw: bytes
    ) -> web.StreamResponse:
        discovery = self._discovery(request.path)
        if discovery is not None:
            record.verb = "get"
            # Authenticated like every other path: kube-apiserver's WithAuthentication
            # filter (staging/src/k8s.io/apiserver/pkg/endpoints/filters/authentication.go)
            # answers 401 to a token it cannot authenticate before any handler runs.
            record.user = self._authenticate(request)
            # Fault(verb="discovery"): a discovery answer that fails (one API server
            # replica briefly not serving a group answers 404).
            probe = Request(verb="discovery", rtype=None)
            fault = next(
                (f for f in self.faults if f.verb == "discovery" and f.matches(probe)), None
            )
            if fault is not None:
                fault.hits += 1
                if fault.times > 0:
                    fault.times -= 1
                if fault.code:
                    raise ApiError(fault.code, _REASONS.get(fault.code, "Unknown"), fault.message)
            return web.json_response(discovery)
        req = self._parse(request)
        record.verb, record.namespace, record.name = req.verb, req.namespace, req.name
        record.subresource = req.subresource
        record.resource = req.rtype.plural if req.rtype else None
        req.user = record.user = self._authenticate(request)
        fault = next((f for f in self.faults if f.matches(req)), None)
        for hook in self.hooks:
            if fault is not None:
                break
            fault = hook(req)
        if fault is not None:
            fault.hits += 1
            if fault.times > 0:
                fault.times -= 1
            if fault.action is not None:
                fault.action()
            if fault.latency:
                await asyncio.sleep(fault.latency)
            if fault.drop:
                assert request.transport is not None
                request.transport.close()
                raise ApiError(500, "InternalError", "connection dropped")
            if fault.empty_watch and req.verb == "watch":
                empty = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
                empty.enable_chunked_encoding()
                await empty.prepare(request)
                await empty.write_eof()
                return empty
            if fault.code:
                headers = (
                    {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
                )
                raise ApiError(
                    fault.code, _REASONS.get(fault.code, "Unknown"), fault.message, headers=headers
                )
        self._authorize(req)
        assert req.rtype is not None
        if req.verb == "watch":
            return await self._watch(request, req)
        result = self._serve(request, req, raw)
        if fault is not None and fault.delay_answer:
            await asyncio.sleep(fault.delay_answer)
        created = req.verb == "create" or req.created
        return web.json_response(result, status=201 if created else 200)

    def _authenticate(self, request: web.Request) -> str:
        """The request's user (the configured one when the fake takes any token)."""
        header = request.headers.get("Authorization", "")
        token = header.removeprefix("Bearer ") if header.startswith("Bearer ") else None
        if token is not None and token in self.clients:
            return self.clients[token]
        if self.token is not None and token != self.token:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return self.user

    def _authorize(self, req: Request) -> None:
        # The RBAC authorizer's denial message
        # (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/errors.go,
        # forbiddenMessage).
        if not any(rule.matches(req) for rule in self.rbac_denies):
            return
        assert req.rtype is not None
        resource = req.rtype.group_resource
        if req.name:
            resource = f'{resource} "{req.name}"'
        scope = f'in the namespace "{req.namespace}"' if req.namespace else "at the cluster scope"
        raise ApiError(
            403,
            "Forbidden",
            f'{resource} is forbidden: User "{req.user or self.user}" cannot {req.verb} resource '
            f'"{req.rtype.plural}" in API group "{req.rtype.group}" {scope}',
            details=_details(req.rtype, req.name),
        )

    def _discovery(self, path: str) -> dict[str, Any] | None:
        path = path.rstrip("/") or "/"
        if path == "/version":
            # The fields of version.Info (staging/src/k8s.io/apimachinery/pkg/version/types.go).
            return {
                "major": "1",
                "minor": "34",
                "gitVersion": "v1.34.0-fake",
                "gitCommit": "0000000000000000000000000000000000000000",
                "gitTreeState": "clean",
                "buildDate": "2026-01-01T00:00:00Z",
                "goVersion": "go1.24.0",
                "compiler": "gc",
                "platform": "linux/amd64",
            }
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        custom = [t for t in self.types.values() if t.custom]
        groups = sorted({t.group for t in custom})
        if path == "/apis":
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [self._group(g) for g in groups],
            }
        for group in groups:
            if path == f"/apis/{group}":
                return {"kind": "APIGroup", "apiVersion": "v1", **self._group(group)}
        if path == "/api/v1":
            return self._resource_list("v1", [NAMESPACES])
        for group in groups:
            version = next(t.version for t in custom if t.group == group)
            if path == f"/apis/{group}/{version}":
                return self._resource_list(
                    f"{group}/{version}", [t for t in custom if t.group == group]
                )
        return None

    def _group(self, group: str) -> dict[str, Any]:
        version = next(t.version for t in self.types.values() if t.group == group)
        gv = {"groupVersion": f"{group}/{version}", "version": version}
        return {"name": group, "versions": [gv], "preferredVersion": gv}

    @staticmethod
    def _resource_list(group_version: str, types: list[ResourceType]) -> dict[str, Any]:
        verbs = ["delete", "deletecollection", "get", "list", "patch", "create", "update", "watch"]
        resources: list[dict[str, Any]] = []
        for t in types:
            resources.append(
                {
                    "name": t.plural,
                    "singularName": t.kind.lower(),
                    "namespaced": t.namespaced,
                    "kind": t.kind,
                    "verbs": verbs,
                }
            )
            if t.status_subresource:
                resources.append(
                    {
                        "name": f"{t.plural}/status",
                        "singularName": "",
                        "namespaced": t.namespaced,
                        "kind": t.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": group_version,
            "resources": resources,
        }

    def _parse(self, request: web.Request) -> Request:
        parts = [p for p in request.path.split("/") if p]
        rest: list[str]
        if parts[:2] == ["api", "v1"]:
            group, rest = "", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
            if not any(t.group == group and t.version == version for t in self.types.values()):
                raise self._path_not_found()
        else:
            raise self._path_not_found()
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not rest:
            raise self._path_not_found()
        rtype = self.types.get(rest[0])
        if rtype is None or rtype.group != group or len(rest) > 3:
            raise self._path_not_found()
        if namespace is not None and not rtype.namespaced:
            raise self._path_not_found()
        name = rest[1] if len(rest) > 1 else None
        subresource = rest[2] if len(rest) > 2 else None
        if subresource is not None and not (subresource == "status" and rtype.status_subresource):
            raise self._path_not_found()
        watching = request.query.get("watch", "").lower() in ("true", "1")
        method = request.method
        verb = {
            ("GET", False): "list" if name is None else "get",
            ("POST", False): "create",
            ("PUT", False): "update",
            ("PATCH", False): "patch",
            ("DELETE", False): "delete",
        }.get((method, False))
        if method == "GET" and watching and name is None:
            verb = "watch"
        if (
            verb is None
            or (verb == "create" and name is not None)
            or (verb in ("update", "patch", "delete") and name is None)
        ):
            raise ApiError(
                405,
                "MethodNotAllowed",
                "the server does not allow this method on the requested resource",
            )
        return Request(verb, rtype, namespace, name, subresource)

    @staticmethod
    def _path_not_found() -> ApiError:
        return ApiError(404, "NotFound", "the server could not find the requested resource")

    def _serve(self, request: web.Request, req: Request, raw: bytes) -> dict[str, Any]:
        rtype = req.rtype
        assert rtype is not None
        if req.verb == "list":
            return self._list(req, request.query)
        if req.verb == "get":
            assert req.name is not None
            obj = self.get(rtype.plural, req.namespace, req.name)
            if obj is None:
                raise not_found(rtype, req.name)
            return obj
        body = self._json_body(raw) if req.verb != "delete" or raw else None
        if req.verb == "create":
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the body of the request must be an object")
            return self.create(rtype, req.namespace, body)
        assert req.name is not None
        status_only = req.subresource == "status"
        if req.verb == "update":
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the body of the request must be an object")
            if (body.get("metadata") or {}).get("name") not in (None, req.name):
                raise ApiError(
                    400, "BadRequest", "the name of the object does not match the name on the URL"
                )
            if rtype is LEASES and self.get(rtype.plural, req.namespace, req.name) is None:
                # leaseStrategy.AllowCreateOnUpdate: a PUT of a missing Lease creates it.
                req.created = True
                return self.create(rtype, req.namespace, body)
            return self.update(
                rtype,
                req.namespace,
                req.name,
                lambda _old: body,
                status_only=status_only,
                # Neither custom resources nor Leases allow unconditional updates.
                require_rv=rtype.custom or rtype is LEASES,
            )
        if req.verb == "patch":
            apply = self._patcher(rtype, request.headers.get("Content-Type", ""), body)
            return self.update(rtype, req.namespace, req.name, apply, status_only=status_only)
        preconditions = body.get("preconditions") if isinstance(body, dict) else None
        return self.delete(rtype, req.namespace, req.name, preconditions)

    @staticmethod
    def _json_body(raw: bytes) -> Any:
        try:
            return json.loads(raw)
        except ValueError as err:
            raise ApiError(400, "BadRequest", f"error decoding request body: {err}") from err

    @staticmethod
    def _patcher(
        rtype: ResourceType, content_type: str, body: Any
    ) -> Callable[[dict[str, Any]], dict[str, Any]]:
        media = content_type.split(";", 1)[0].strip().lower()
        # Patch type comes from Content-Type
        # (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go, PatchResource);
        # custom resources do not support strategic merge
        # (apiextensions-apiserver/pkg/apiserver/customresource_handler.go: supportedTypes).
        supported = [
            "application/json-patch+json",
            "application/merge-patch+json",
            "application/apply-patch+yaml",
        ]
        if not rtype.custom:
            supported.append("application/strategic-merge-patch+json")
        if media not in supported or media == "application/apply-patch+yaml":
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted "
                f"media types include: {', '.join(supported)}",
            )

        def apply(current: dict[str, Any]) -> dict[str, Any]:
            # The patch is applied to the current object; its resourceVersion, if the
            # patch carries one, then acts as a precondition (patch.go: patcher.applyPatch
            # then GuaranteedUpdate). A patch without one never conflicts.
            current["metadata"].pop("resourceVersion", None)
            try:
                if media == "application/json-patch+json":
                    patched = json_patch(current, body)
                elif media == "application/merge-patch+json" or not isinstance(body, dict):
                    patched = merge_patch(current, body)
                else:
                    # Strategic merge on built-in types: a merge patch is a fair model
                    # for the fields canaryd and its tests touch (labels, annotations).
                    patched = merge_patch(current, body)
            except PatchError as err:
                raise ApiError(400, "BadRequest", str(err)) from err
            except PatchTestFailed as err:
                raise ApiError(422, "Invalid", str(err)) from err
            if not isinstance(patched, dict):
                raise ApiError(400, "BadRequest", "the patch must produce an object")
            return patched

        return apply

    def _selectors(self, query: Any) -> tuple[Callable[[dict[str, Any]], bool], ...]:
        try:
            labels = parse_label_selector(query.get("labelSelector"))
            fields = parse_field_selector(query.get("fieldSelector"))
        except SelectorError as err:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {err}") from err

        def matches(obj: dict[str, Any]) -> bool:
            return labels(_labels(obj)) and fields(obj.get("metadata") or {})

        return (matches,)

    def _list(self, req: Request, query: Any) -> dict[str, Any]:
        rtype = req.rtype
        assert rtype is not None
        (matches,) = self._selectors(query)
        try:
            limit = int(query.get("limit") or 0)
        except ValueError as err:
            raise ApiError(400, "BadRequest", f"invalid limit: {query.get('limit')}") from err
        token = query.get("continue")
        if token:
            # A continued list reads the first page's snapshot (etcd's revision); once
            # compacted it is 410 Expired (storage/etcd3/store.go, GetList).
            found = self._continues.pop(token, None)
            if found is None:
                raise ApiError(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent "
                    "list result. You can start a new list without the continue parameter.",
                )
            rv, items = found
        else:
            rv = self.rv
            items = [
                copy.deepcopy(obj)
                for (ns, _), obj in sorted(self.objects[rtype.plural].items())
                if (req.namespace is None or ns == req.namespace) and matches(obj)
            ]
        metadata: dict[str, Any] = {"resourceVersion": str(rv)}
        if limit > 0 and len(items) > limit:
            items, rest = items[:limit], items[limit:]
            token = f"{rv}-{len(self._continues)}-{id(rest):x}"
            self._continues[token] = (rv, rest)
            metadata["continue"] = token
            metadata["remainingItemCount"] = len(rest)
        return {
            "apiVersion": rtype.api_version,
            "kind": f"{rtype.kind}List",
            "metadata": metadata,
            "items": items,
        }

    async def _watch(self, request: web.Request, req: Request) -> web.StreamResponse:
        rtype = req.rtype
        assert rtype is not None
        (matches,) = self._selectors(request.query)
        raw_rv = request.query.get("resourceVersion", "")
        try:
            since = int(raw_rv) if raw_rv not in ("", "0") else None
        except ValueError as err:
            raise ApiError(400, "BadRequest", f"invalid resource version: {raw_rv}") from err
        timeout = float(request.query.get("timeoutSeconds") or self.default_watch_timeout)
        bookmarks = request.query.get("allowWatchBookmarks", "").lower() in ("true", "1")

        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        def in_scope(obj: dict[str, Any]) -> bool:
            return req.namespace is None or obj["metadata"].get("namespace") == req.namespace

        watcher: _Watcher | None = None

        async def send(event: str, obj: dict[str, Any]) -> None:
            if watcher is not None and watcher.silent:
                return
            line = json.dumps({"type": event, "object": obj}, separators=(",", ":"))
            await response.write(line.encode() + b"\n")

        backlog: list[Change] = []
        if since is not None and since < self.compacted_rv:
            # A watch from a compacted resourceVersion is a 200 stream with one ERROR
            # event (staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go, Watch →
            # errors.NewResourceExpired / NewGone, code 410, reason Expired).
            await send(
                "ERROR",
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "message": f"too old resource version: {since} ({self.compacted_rv + 1})",
                    "reason": "Expired",
                    "code": 410,
                },
            )
            await response.write_eof()
            return response
        watcher = _Watcher(rtype, req.namespace, request.transport)
        initial: list[dict[str, Any]] = []
        if since is None:
            # resourceVersion unset or "0": start with a synthetic ADDED for every
            # current object ("Get State and Start at Most Recent", API concepts doc).
            initial = [
                copy.deepcopy(o)
                for _, o in sorted(self.objects[rtype.plural].items())
                if in_scope(o) and matches(o)
            ]
        else:
            backlog = [
                c for c in self.history if c.rtype is rtype and since < c.rv <= self._dispatched_rv
            ]
        self.watchers.add(watcher)  # no await since the snapshot: nothing is missed
        self._notify()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        next_bookmark = loop.time() + self.bookmark_interval
        try:
            for obj in initial:
                await send("ADDED", obj)
            for change in backlog:
                await self._send_change(send, change, in_scope, matches)
            while True:
                now = loop.time()
                # Server-side timeoutSeconds ends the stream (endpoints/handlers/watch.go).
                if now >= deadline:
                    break
                item: Change | bytes | None
                if not watcher.queue.empty():
                    item = watcher.queue.get_nowait()
                else:
                    due = min(deadline, next_bookmark) if bookmarks else deadline
                    try:
                        item = await asyncio.wait_for(watcher.queue.get(), max(due - now, 0))
                    except TimeoutError:
                        # A change can be queued in the very turn the wait times out
                        # (asyncio.wait_for on 3.11 then still raises): a bookmark now
                        # would carry a resourceVersion past that unsent change, and a
                        # client resuming from it would never see the change. A real
                        # cacher bookmarks only what it has sent: the change goes first.
                        if not watcher.queue.empty():
                            continue
                        if bookmarks and loop.time() >= next_bookmark:
                            # Bookmarks only with allowWatchBookmarks; the object carries
                            # only kind, apiVersion and metadata.resourceVersion
                            # (cacher/cache_watcher.go, the bookmark event).
                            bookmark = {
                                "kind": rtype.kind,
                                "apiVersion": rtype.api_version,
                                "metadata": {
                                    "resourceVersion": str(max(since or 0, self._dispatched_rv))
                                },
                            }
                            await send("BOOKMARK", bookmark)
                            next_bookmark = loop.time() + self.bookmark_interval
                        continue
                if item is None:
                    break
                if isinstance(item, bytes):
                    if not watcher.silent:
                        await response.write(item)
                    continue
                if since is not None and item.rv <= since:
                    continue  # released after a hold: this watch started past it
                await self._send_change(send, item, in_scope, matches)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away; nothing to tell it
        finally:
            self.watchers.discard(watcher)
            self._notify()
        return response

    @staticmethod
    async def _send_change(
        send: Callable[[str, dict[str, Any]], Any],
        change: Change,
        in_scope: Callable[[dict[str, Any]], bool],
        matches: Callable[[dict[str, Any]], bool],
    ) -> None:
        if not in_scope(change.new):
            return
        # A selector watch turns a change across the selector's edge into ADDED or
        # DELETED (cacher/cache_watcher.go, convertToWatchEvent).
        now_matches = matches(change.new)
        was_matching = change.old is not None and matches(change.old)
        if change.type == "ADDED":
            event = "ADDED" if now_matches else None
        elif change.type == "DELETED":
            event = "DELETED" if was_matching or now_matches else None
        elif now_matches and was_matching:
            event = "MODIFIED"
        elif now_matches:
            event = "ADDED"
        elif was_matching:
            # The previous copy, with the change's resourceVersion: a client cannot tell
            # from the event whether the object was deleted or left the selector
            # (cacher/cache_watcher.go, convertToWatchEvent).
            assert change.old is not None
            old = copy.deepcopy(change.old)
            old["metadata"]["resourceVersion"] = str(change.rv)
            await send("DELETED", old)
            return
        else:
            event = None
        if event is not None:
            await send(event, change.new)


# ---------------------------------------------------------------- standalone


def seed_canaries(kube: FakeKube, count: int, namespaces: int) -> None:
    """``count`` FlinkDeployment canaries over ``namespaces`` namespaces."""
    if count <= 0:
        return
    names = [f"canary-{n}" for n in range(max(1, namespaces))]
    for name in names:
        if kube.get("namespaces", None, name) is None:
            kube.create_namespace(name)
    for i in range(count):
        body = {"metadata": {"name": f"canary-{i}", "labels": {"flink.apache.org/canary": "true"}}}
        kube.create(FLINK_DEPLOYMENTS, names[i % len(names)], body)


def concurrent_writer(kube: FakeKube, rate: float, seed: int) -> Callable[[Request], Fault | None]:
    """A hook: before ``rate`` of canary PATCHes, another client annotates the object."""
    rng = random.Random(seed)
    counter = itertools.count()

    def hook(req: Request) -> Fault | None:
        if req.verb != "patch" or req.rtype is not FLINK_DEPLOYMENTS or rng.random() >= rate:
            return None
        namespace, name = req.namespace, req.name or ""

        def write() -> None:
            value = str(next(counter))

            def annotate(obj: dict[str, Any]) -> dict[str, Any]:
                obj["metadata"].setdefault("annotations", {})["bench/writer"] = value
                return obj

            kube.update(FLINK_DEPLOYMENTS, namespace, name, annotate)

        return Fault(code=0, action=write)

    return hook


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m canaryd.testing.apiserver",
        description="Run canaryd's fake kube-apiserver on 127.0.0.1 (for demos and benchmarks).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--kubeconfig", required=True, help="where to write a kubeconfig for it")
    parser.add_argument("--token", default=None, help="require this bearer token")
    parser.add_argument(
        "--namespace", action="append", default=[], help="namespace to create at start (repeatable)"
    )
    parser.add_argument("--bookmark-interval", type=float, default=60.0)
    parser.add_argument(
        "--watch-timeout",
        type=float,
        default=1800.0,
        help="watch timeout when a client sends no timeoutSeconds",
    )
    parser.add_argument(
        "--canaries",
        type=int,
        default=0,
        help="create this many FlinkDeployment canaries at start (benchmarks)",
    )
    parser.add_argument(
        "--canary-namespaces",
        type=int,
        default=1,
        help="spread --canaries over this many namespaces (canary-0, canary-1, ...)",
    )
    parser.add_argument(
        "--conflict-rate",
        type=float,
        default=0.0,
        help="share of canary PATCHes that a concurrent writer beats (adds an annotation "
        "first), so they meet a real 409",
    )
    parser.add_argument("--seed", type=int, default=41050)
    parser.add_argument(
        "--keep-requests", type=int, default=10_000, help="bound of the request log"
    )
    args = parser.parse_args(argv)

    async def serve() -> None:
        kube = FakeKube(
            token=args.token,
            bookmark_interval=args.bookmark_interval,
            default_watch_timeout=args.watch_timeout,
        )
        for ns in args.namespace:
            kube.create_namespace(ns)
        seed_canaries(kube, args.canaries, args.canary_namespaces)
        kube.keep_requests = args.keep_requests
        if args.conflict_rate > 0:
            kube.hooks.append(concurrent_writer(kube, args.conflict_rate, args.seed))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with kube.running(args.host, args.port):
            kube.write_kubeconfig(args.kubeconfig)
            print(
                f"fake kube-apiserver listening on {kube.url}; kubeconfig {args.kubeconfig}",
                flush=True,
            )
            await stop.wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
