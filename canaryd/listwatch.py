"""One scope's list/watch loop, as a stream of changes it does not apply itself.

kubernetes-asyncio's ``Watch`` does not list, resume from the last resourceVersion,
relist on 410 or back off. ``ListWatch`` does, and tells what it learns (lists, events,
where the scope stands) to the function it runs with, as client-go's reflector feeds a
store it does not own (kube-rs: ``watcher()``). The watcher applies them to the registry.
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import structlog

from canaryd import metrics
from canaryd.backoff import Backoff
from canaryd.config import Settings
from canaryd.episodes import Episodes
from canaryd.kube import (
    NAMESPACES_PATH,
    ErrorKind,
    Kind,
    KubeClient,
    KubeError,
    classify_answer,
    failure_cause,
)

log = structlog.get_logger("canaryd.watcher")

LIST_PAGE = 500
"""Objects per list page (client-go's pager default)."""
LISTS_AT_ONCE = 16
"""Lists in flight at once across all scopes: 600 namespaces starting together do not
list 1,200 at once (the health server, the bumps and the open watches keep their turns)."""


def watch_failures(settings: Settings) -> Episodes:
    """Failed lists and watches of every scope, told as episodes (per scope at debug)."""
    return Episodes("watch_failures", "scope", lambda: settings.timeout)


@dataclass(frozen=True)
class Scope:
    """What one list/watch covers. ``kind`` None: the Namespaces watch."""

    kind: Kind | None
    namespace: str | None

    def __str__(self) -> str:
        return f"{self.resource}@{self.namespace}" if self.namespace else self.resource

    @property
    def resource(self) -> str:
        return self.kind.plural if self.kind else "namespaces"

    @property
    def path(self) -> str:
        return self.kind.collection_path(self.namespace) if self.kind else NAMESPACES_PATH


class Sync(enum.Enum):
    """A change of where the scope stands (canaryd.sync's transitions)."""

    OPENED = "opened"  # a watch was answered 200
    DROPPED = "dropped"  # the list or the stream failed or ended: the registry may be behind


@dataclass(frozen=True, slots=True)
class Listed:
    """A full list: the scope's objects replace what was known of it."""

    items: list[Mapping[str, Any]]
    kind: str  # the Kind the list answer names (FlinkDeployment of FlinkDeploymentList)


@dataclass(frozen=True, slots=True)
class Event:
    type: str  # ADDED, MODIFIED, DELETED or BOOKMARK (its object only a resourceVersion)
    obj: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Refused:
    error: KubeError  # 403, or a 404 believed: nothing in the scope is ours for now


Change = Listed | Event | Refused | Sync


def _rv(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata")
    value = metadata.get("resourceVersion") if isinstance(metadata, Mapping) else None
    return str(value) if value else ""


async def list_all(
    kube: KubeClient, path: str, params: Mapping[str, str], time_limit: float
) -> tuple[list[Mapping[str, Any]], str, str]:
    """One consistent list, in pages of ``LIST_PAGE`` as client-go's pager (an expired
    continue token falls back to one whole list, FullListIfExpired). Returns the items,
    the list's resourceVersion and the Kind its answer names."""
    items: list[Mapping[str, Any]] = []
    page_params, rv = {**params, "limit": str(LIST_PAGE)}, ""
    while True:
        try:
            listed = await kube.request(
                "list", "GET", path, params=page_params, time_limit=time_limit
            )
        except KubeError as err:
            if err.kind is not ErrorKind.EXPIRED or "continue" not in page_params:
                raise
            items, page_params, rv = [], dict(params), ""  # one whole list, no limit
            continue
        kind, page = str(listed.get("kind") or ""), listed.get("items")
        if not kind.endswith("List") or not isinstance(page, list | None):
            # No list (a gateway's 200 ``{}``): nothing is known to be gone.
            raise KubeError(ErrorKind.TRANSIENT, f"the answer is no list (kind {kind!r})")
        items.extend(item for item in page or () if isinstance(item, Mapping))
        rv = rv or _rv(listed)  # every page is of the first page's snapshot
        metadata = listed.get("metadata")
        token = metadata.get("continue") if isinstance(metadata, Mapping) else None
        if "limit" not in page_params or not isinstance(token, str) or not token:
            return items, rv, kind.removesuffix("List")
        page_params = {**page_params, "continue": token}


def _mappings(value: Any) -> list[Mapping[str, Any]] | None:
    """A list's mappings (Go writes an empty list as null); None: no list."""
    value = value or []
    if not isinstance(value, list):
        return None
    return [item for item in value if isinstance(item, Mapping)]


async def not_served(kube: KubeClient, kind: Kind) -> str | None:
    """Why the API server does not serve ``kind`` as a canary kind, when it says so
    (its group version's APIResourceList lacks it or has it cluster-scoped, or /apis
    lacks the group version); None when it does not say (it serves it, a gateway's
    ``404 page not found`` for every path, a malformed list). Raises a group version's
    other KubeError."""
    where, group_version = f"{kind.plural}.{kind.group}", f"{kind.group}/{kind.version}"
    try:
        found = await kube.request("get", "GET", f"/apis/{group_version}")
    except KubeError as err:
        if err.kind is not ErrorKind.GONE:
            raise
        try:
            listed = await kube.request("get", "GET", "/apis")
        except KubeError:
            return None
        groups = _mappings(listed.get("groups")) if listed.get("kind") == "APIGroupList" else None
        offered = {
            version.get("groupVersion")
            for group in groups or ()
            for version in _mappings(group.get("versions")) or ()
        }
        if groups is None or group_version in offered:
            return None
        return f"{where} is not served: no {group_version} in /apis"
    resources = _mappings(found.get("resources"))
    if found.get("kind") != "APIResourceList" or resources is None:
        return None
    resource = next((r for r in resources if r.get("name") == kind.plural), None)
    if resource is None:
        return f"{where} is not served in {group_version}"
    if resource.get("namespaced") is not True:
        return f"{where} is cluster-scoped; only namespaced kinds can be canaries"
    return None


class ListWatch:
    """The list → watch → bookmark → 410-relist loop of one scope. As client-go's
    reflector (docs/DESIGN.md): a stream that ends or drops once established resumes at
    once; only failures in a row back off."""

    def __init__(
        self,
        kube: KubeClient,
        settings: Settings,
        scope: Scope,
        *,
        failures: Episodes | None = None,
        list_slots: asyncio.Semaphore | None = None,
    ) -> None:
        self.kube, self.settings, self.scope = kube, settings, scope
        self.list_slots = list_slots or asyncio.Semaphore(LISTS_AT_ONCE)  # shared by all
        self.failures = failures or watch_failures(settings)  # an outage is one episode
        self.params = {"labelSelector": settings.label} if scope.kind else {}
        metrics.watching(scope.resource)
        self._backoff = Backoff(settings.backoff_initial, settings.backoff_max)
        self._loop = asyncio.get_running_loop()
        self._tell: Callable[[Change], None] = lambda change: None
        self._stream: asyncio.Timeout | None = None  # rescheduled to now: the stream ends
        self._opened_at: float | None = None  # answered 200 at (a connect alone: not open)
        self.problem: str | None = None  # why the last list or watch failed, until one works
        self._start_over = False

    async def run(self, tell: Callable[[Change], None]) -> None:
        """List, then watch, telling ``tell`` each change, until cancelled. Each step
        returns the resourceVersion to watch from (None: list first), having waited out
        its backoff; a bug here or in ``tell`` must not stop it: said, counted, a new list."""
        self._tell, rv = tell, None
        log.info("watch_started", scope=str(self.scope))
        try:
            while True:
                try:
                    rv = await (self._list() if rv is None else self._watch(rv))
                except Exception:
                    metrics.ERRORS.labels("watch").inc()
                    log.exception("watch_failed_unexpectedly", scope=str(self.scope))
                    self._start_over = True
                    try:
                        tell(Sync.DROPPED)
                    except Exception:  # the same bug, met again telling the drop
                        metrics.ERRORS.labels("watch").inc()
                        log.exception("watch_failed_unexpectedly", scope=str(self.scope))
                if self._start_over:
                    self._start_over, rv = False, None
                    await asyncio.sleep(self._backoff.next())
        except asyncio.CancelledError:
            log.info("watch_stopped", scope=str(self.scope), why="cancelled")
            raise

    def replace(self, why: str) -> None:
        """The judge suspects this stream (half-open): end it now and resume at once."""
        if self._stream is not None and not self._stream.expired():
            log.info("watch_replaced", scope=str(self.scope), why=why)
            metrics.WATCH_RESTARTS.labels(self.scope.resource, "suspected").inc()
            self._stream.reschedule(self._loop.time())

    def start_over(self) -> None:
        """End the stream, back off, list again: what this loop told was ignored (a
        namespace closed meanwhile)."""
        self._start_over = True
        if self._stream is not None and not self._stream.expired():
            self._stream.reschedule(self._loop.time())

    async def _list(self) -> str | None:
        """One list: the scope's state replaced, then a watch from its resourceVersion."""
        try:
            async with self.list_slots:
                items, rv, kind = await list_all(
                    self.kube, self.scope.path, self.params, self.settings.list_timeout
                )
        except KubeError as err:
            self._tell(Sync.DROPPED)
            return await self._failed(await self._confirmed(err), "list", None)
        metrics.RELISTS.labels(self.scope.resource).inc()
        self._tell(Listed(items, kind))  # first: a list that cannot be applied is no recovery
        self.problem = None
        self.failures.recovered(self.scope)
        self._backoff.reset()
        return rv

    def _opened(self) -> None:
        self._opened_at = self._loop.time()
        self.problem = None
        try:
            self._tell(Sync.OPENED)
        except Exception:  # raised inside the client's request: said here, as in run()
            metrics.ERRORS.labels("watch").inc()
            log.exception("watch_failed_unexpectedly", scope=str(self.scope))
            self.start_over()
            return
        if self.failures.cause(self.scope) != "ended_at_once":
            # Answered 200: what failed (no connection, an error status) works again. A
            # watch that ended at once with no event recovers only when one arrives.
            self.failures.recovered(self.scope)

    async def _watch(self, rv: str) -> str | None:
        """One watch stream; returns where to resume (None: a new list)."""
        timeout = int(self.settings.watch_timeout * random.uniform(1.0, 2.0)) or 1
        params = {
            **self.params,
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout),
        }
        opened, events, failure = self._loop.time(), 0, None
        self._opened_at = None
        try:
            stream = self.kube.watch(
                self.scope.path,
                params,
                idle_timeout=self.settings.watch_idle_timeout,
                on_connected=self._opened,
            )
            # aclosing: a bug in ``tell`` leaves the stream at once, its connection closed.
            async with asyncio.timeout(None) as self._stream, aclosing(stream):
                async for event in stream:
                    delivered = self._deliver(event)
                    if delivered is None:
                        continue  # not an event
                    rv, events = delivered or rv, events + 1
                    if events == 1:
                        # The stream delivers: failures in a row are over.
                        self._backoff.reset()
                        self.failures.recovered(self.scope)
        except TimeoutError:
            if self._stream is None or not self._stream.expired():
                raise
            # Replaced (replace): the scope is out of sync until the new stream delivers.
            self._tell(Sync.DROPPED)
            return rv
        except KubeError as err:
            failure = err
        finally:
            self._stream = None  # ended: replace() must not touch it while a 404 is confirmed
        self._tell(Sync.DROPPED)
        if failure is not None:
            return await self._dropped(failure, rv, events)
        if not self._established(events):
            # client-go: a watch that ends within a second with no event failed (a proxy
            # or load balancer that answers and closes); reopening at once is a busy loop.
            metrics.WATCH_RESTARTS.labels(self.scope.resource, "short").inc()
            delay = self._backoff.next()
            self.failures.failed(
                self.scope,
                "ended_at_once",
                f"the watch ended after {self._loop.time() - opened:.3f}s with no event "
                f"(retry in {delay:.3f}s)",
            )
            await asyncio.sleep(delay)
        else:
            metrics.WATCH_RESTARTS.labels(self.scope.resource, "ended").inc()
            log.debug("watch_ended", scope=str(self.scope), resource_version=rv)
        return rv

    def _deliver(self, event: Mapping[str, Any]) -> str | None:
        """Tell one watch event; returns its object's resourceVersion (None: no object)."""
        kind, obj = event.get("type"), event.get("object")
        if not isinstance(obj, Mapping):
            metrics.ERRORS.labels("watch_decode").inc()
            log.warning("watch_event_without_object", scope=str(self.scope), type=str(kind))
            return None
        if kind == "ERROR":
            code = obj.get("code")
            code = code if isinstance(code, int) else 500
            raise KubeError(
                classify_answer(code, obj),
                str(obj.get("message") or "watch error"),
                status=code,
                reason=str(obj.get("reason") or ""),
            )
        if kind in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            self._tell(Event(kind, obj))
        else:
            metrics.ERRORS.labels("watch_decode").inc()
            log.warning("watch_event_unknown_type", scope=str(self.scope), type=str(kind))
        return _rv(obj)

    async def _dropped(self, err: KubeError, rv: str, events: int) -> str | None:
        """Where a stream that failed resumes: a new list after a 410, at once after a
        drop of an established stream, else after a backoff (``_failed``)."""
        if err.kind is ErrorKind.EXPIRED:
            # The resourceVersion was compacted: only a new list can resume.
            metrics.WATCH_RESTARTS.labels(self.scope.resource, "expired").inc()
            log.debug("watch_expired", scope=str(self.scope), resource_version=rv)
            return None
        if (
            self._established(events)
            and err.kind is ErrorKind.TRANSIENT
            and err.reason != "LineTooLong"  # the same line waits at the same rv
        ):
            # It worked, then dropped (a reset, an idle stream): resume at once.
            why = "idle" if err.reason == "Idle" else "dropped"
            metrics.WATCH_RESTARTS.labels(self.scope.resource, why).inc()
            # Counted; a resume that fails is the failure worth a line.
            log.debug("watch_dropped", scope=str(self.scope), error=str(err), resume="now")
            return rv
        return await self._failed(await self._confirmed(err), "watch", rv)

    def _established(self, events: int) -> bool:
        """The stream worked: it delivered, or it stayed open ``short_watch`` after the
        server answered (time spent connecting does not count)."""
        return events > 0 or (
            self._opened_at is not None
            and self._loop.time() - self._opened_at >= self.settings.short_watch
        )

    async def _confirmed(self, err: KubeError) -> KubeError:
        """A 404 stands as a kube-apiserver ``Status`` (its reason set), or once
        ``not_served`` confirms it; else it is transient (a gateway's 404 page)."""
        if err.kind is not ErrorKind.GONE or err.reason:
            return err
        try:
            why = await not_served(self.kube, self.scope.kind) if self.scope.kind else None
        except KubeError:
            why = None  # no answer confirms nothing
        if why is not None:
            return KubeError(ErrorKind.GONE, why, status=err.status)
        note = f"{err.args[0]} (the API server does not confirm it)"
        return KubeError(ErrorKind.TRANSIENT, note, status=err.status, reason=err.reason)

    async def _failed(self, err: KubeError, during: str, rv: str | None) -> str | None:
        """Log a failed list or watch, count it, and back off before resuming from ``rv``
        (after a denial, a list once a cycle for a 403, every config check interval for a
        404)."""
        if err.kind in (ErrorKind.FORBIDDEN, ErrorKind.GONE):
            metrics.WATCH_RESTARTS.labels(self.scope.resource, err.kind.value).inc()
            retry = self.settings.forbidden_retry
            if err.kind is ErrorKind.GONE:
                retry = self.settings.config_check_interval
            self.failures.failed(
                self.scope, f"{during}_{err.kind.value}", f"{err} (retry in {retry:g}s)"
            )
            try:
                self._tell(Refused(err))
            finally:  # a bug applying the refusal lists no sooner than the refusal's pace
                await asyncio.sleep(retry)
            return None
        why = "idle" if err.reason == "Idle" else "error"
        metrics.WATCH_RESTARTS.labels(self.scope.resource, why).inc()
        delay = self._backoff.next()
        if err.retry_after is not None:
            delay = max(err.retry_after, self.settings.backoff_initial)
        delay = min(delay, self.settings.backoff_max)
        self.problem = f"{failure_cause(err)}: {err}"
        cause = "unauthorized" if err.status == 401 else "error"  # canaryd_blind's reason
        self.failures.failed(self.scope, f"{during}_{cause}", f"{err} (retry in {delay:.3f}s)")
        await asyncio.sleep(delay)
        return rv
