"""The watcher: raw list/watch streams that keep the registry true to the cluster.

One ``ListWatch`` per scope (a canary kind in one namespace, or cluster-wide when all
namespaces are watched, and one on Namespaces) runs the loop kubernetes-asyncio's
``Watch`` does not: list, watch from the list's resourceVersion with bookmarks,
resume from the last event's resourceVersion when a stream ends, relist on 410
Expired (and drop what the new list lacks), back off on errors. ``Watcher`` keeps
one per wanted scope.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from canaryd import metrics
from canaryd.backoff import Backoff
from canaryd.config import Settings
from canaryd.discovery import KindDiscovery, discover_kinds
from canaryd.episodes import Episodes
from canaryd.kube import (
    NAMESPACES_PATH,
    ErrorKind,
    Kind,
    KubeClient,
    KubeError,
    classify_answer,
)
from canaryd.limits import OpenFiles
from canaryd.registry import CanaryKey, Registry, is_canary
from canaryd.sync import ScopeSync

log = structlog.get_logger("canaryd.watcher")


def watch_failures(settings: Settings) -> Episodes:
    """Failed lists and watches of every scope, told as episodes (per scope at debug)."""
    return Episodes(
        "watch_failures",
        subject="scope",
        subjects="scopes",
        detail_event="watch_failed",
        interval=lambda: settings.timeout,
        logger_name="canaryd.watcher",
    )


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


SCOPE_STATES = (
    "listed",
    "waiting",
    "forbidden",
    "gone",
    "namespace_missing",
    "kind_not_served",
    "patch_forbidden",
)
LIST_PAGE = 500
"""Objects per list page (client-go's pager default)."""


class State(enum.Enum):
    LISTING = "listing"  # no usable resourceVersion: list everything, replace the scope's
    WATCHING = "watching"  # stream changes from a known resourceVersion
    BACKING_OFF = "backing_off"  # wait ``delay``, then go on to ``then``


@dataclass(frozen=True, slots=True)
class Next:
    """A ListWatch's next state, and what it needs."""

    state: State
    rv: str = ""
    delay: float = 0.0
    then: State = State.LISTING


def backing_off(delay: float, then: State, rv: str = "") -> Next:
    return Next(State.BACKING_OFF, rv, delay, then)


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name"))


def _rv(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata")
    value = metadata.get("resourceVersion") if isinstance(metadata, Mapping) else None
    return str(value) if value else ""


LISTS_AT_ONCE = 16
"""Lists in flight at once across all scopes (each one page of at most ``LIST_PAGE``):
600 namespaces starting together list a few dozen at a time, not 1,200 at once (the
health server, the bumps and the watches already open keep their turns of the loop)."""
DROP_READS_AT_ONCE = 8
"""GETs in flight at once that tell a dropped canary's deletion from a label removal:
a mass deletion takes no more of the request pool's connections beyond the bumps'
(kube.RESERVED_CONNECTIONS), which lists and the lease need."""


async def list_all(
    kube: KubeClient, path: str, params: Mapping[str, str], time_limit: float
) -> tuple[list[Mapping[str, Any]], str]:
    """One consistent list, in pages of ``LIST_PAGE`` (client-go's pager): no answer
    grows with the number of canaries past a few hundred objects. A continue token
    that expired (410: the snapshot was compacted) falls back to one whole list, as
    client-go's pager does (FullListIfExpired)."""
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
        page = listed.get("items")
        if page is None:
            page = []
        if not isinstance(page, list):
            raise KubeError(ErrorKind.TRANSIENT, "list items is not an array")
        items.extend(item for item in page if isinstance(item, Mapping))
        rv = rv or _rv(listed)  # every page is of the first page's snapshot
        metadata = listed.get("metadata")
        token = metadata.get("continue") if isinstance(metadata, Mapping) else None
        if "limit" not in page_params or not isinstance(token, str) or not token:
            return items, rv
        page_params = {**page_params, "continue": token}


class ListWatch:
    """The list → watch → bookmark → 410-relist loop of one scope.

    Backoff follows client-go's reflector: a stream that ends or drops after it was
    established (it delivered an event, or it lasted ``short_watch``) resumes from its
    last resourceVersion at once; only failures in a row back off, jittered and capped
    at a quarter of the cycle. A 410 relists at once.
    """

    def __init__(
        self,
        kube: KubeClient,
        settings: Settings,
        scope: Scope,
        *,
        selector: str | None,
        on_list: Callable[[list[Mapping[str, Any]]], None],
        on_event: Callable[[str, Mapping[str, Any]], None],
        on_denied: Callable[[KubeError], None],
        sync: ScopeSync | None = None,
        on_resumed: Callable[[], None] = lambda: None,
        failures: Episodes | None = None,
        list_slots: asyncio.Semaphore | None = None,
    ) -> None:
        self.kube, self.settings, self.scope = kube, settings, scope
        self.list_slots = list_slots or asyncio.Semaphore(LISTS_AT_ONCE)  # shared by all
        self.failures = failures or watch_failures(settings)
        """Where failures are told: an outage is an episode, not a line per retry."""
        self.params = {"labelSelector": selector} if selector else {}
        self.on_list, self.on_event, self.on_denied = on_list, on_event, on_denied
        self.on_resumed = on_resumed
        """Called when the scope is in sync again (a list, or a resumed stream delivers)."""
        self.sync = sync if sync is not None else ScopeSync(time.monotonic())
        """Where this scope stands; this loop is its only writer (canaryd.sync)."""
        metrics.watching(scope.resource)
        self._backoff = Backoff(settings.backoff_initial, settings.backoff_max)
        self._loop = asyncio.get_running_loop()
        self._stream: asyncio.Timeout | None = None
        """The open stream's cancel scope: rescheduled to now, it replaces the stream."""
        self._opened_at: float | None = None
        """Loop time the open stream was answered 200; None before (a connect counts
        as nothing: a connect timeout is a failure, not an established stream)."""

    async def run(self) -> None:
        """The state machine: listing -> watching (resumed from each stream's last
        resourceVersion) -> backing off after failures in a row -> watching, or listing
        again after a 410 or a denial. Each transition is the ``Next`` a step returns."""
        step = Next(State.LISTING)
        log.info("watch_started", scope=str(self.scope))
        try:
            while True:
                try:
                    match step.state:
                        case State.LISTING:
                            step = await self._list()
                        case State.WATCHING:
                            step = await self._watch(step.rv)
                        case State.BACKING_OFF:
                            await asyncio.sleep(step.delay)
                            step = Next(step.then, step.rv)
                except Exception:
                    # A bug must not stop the daemon: say so, count it, start over.
                    self._down()
                    metrics.ERRORS.labels("watch").inc()
                    log.exception("watch_failed_unexpectedly", scope=str(self.scope))
                    step = backing_off(self._backoff.next(), State.LISTING)
        except asyncio.CancelledError:
            log.info("watch_stopped", scope=str(self.scope), why="cancelled")
            raise

    def _down(self) -> None:
        self.sync.dropped(time.monotonic())  # the scheduler's clock

    def replace(self, why: str) -> None:
        """The judge suspects this stream (half-open): end it now and resume at once."""
        if self._stream is not None and not self._stream.expired():
            log.info("watch_replaced", scope=str(self.scope), why=why)
            metrics.WATCH_RESTARTS.labels(self.scope.resource, "suspected").inc()
            self._stream.reschedule(self._loop.time())

    async def _list(self) -> Next:
        """One list: the scope's state replaced, then a watch from its resourceVersion."""
        try:
            async with self.list_slots:
                items, rv = await list_all(
                    self.kube, self.scope.path, self.params, self.settings.list_timeout
                )
        except KubeError as err:
            self._down()
            return self._failed(await self._confirmed(err), "list", State.LISTING)
        metrics.RELISTS.labels(self.scope.resource).inc()
        self.on_list(items)
        self.failures.recovered(self.scope)
        if self.sync.listed_at(time.monotonic()):
            self.on_resumed()
        self._backoff.reset()
        return Next(State.WATCHING, rv)

    def _opened(self) -> None:
        self._opened_at = self._loop.time()
        self.sync.opened()
        if self.failures.cause(self.scope) != "ended_at_once":
            # Answered 200: what failed (no connection, an error status) works again. A
            # watch that ended at once with no event recovers only when one arrives.
            self.failures.recovered(self.scope)

    async def _watch(self, rv: str) -> Next:
        """One watch stream; returns what to do next and where to resume."""
        timeout = int(self.settings.watch_timeout * random.uniform(1.0, 2.0)) or 1
        params = {
            **self.params,
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout),
        }
        opened, events = self._loop.time(), 0
        self._opened_at = None
        try:
            async with asyncio.timeout(None) as self._stream:
                async for event in self.kube.watch(
                    self.scope.path,
                    params,
                    idle_timeout=self.settings.watch_idle_timeout,
                    on_connected=self._opened,
                ):
                    kind, obj = event.get("type"), event.get("object")
                    if not isinstance(obj, Mapping):
                        metrics.ERRORS.labels("watch_decode").inc()
                        log.warning(
                            "watch_event_without_object", scope=str(self.scope), type=str(kind)
                        )
                        continue
                    if kind == "ERROR":
                        raise self._error_event(obj)
                    rv = _rv(obj) or rv
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        self.on_event(kind, obj)
                    elif kind != "BOOKMARK":
                        metrics.ERRORS.labels("watch_decode").inc()
                        log.warning(
                            "watch_event_unknown_type", scope=str(self.scope), type=str(kind)
                        )
                    events += 1
                    if events == 1:
                        # The stream delivers: failures in a row are over.
                        self._backoff.reset()
                        self.failures.recovered(self.scope)
                    if self.sync.delivered(time.monotonic()):
                        self.on_resumed()
        except TimeoutError:
            if self._stream is None or not self._stream.expired():
                raise
            # Replaced (replace): the scope is out of sync until the new stream delivers.
            self._down()
            return Next(State.WATCHING, rv)
        except KubeError as err:
            self._down()
            if err.kind is ErrorKind.EXPIRED:
                # The resourceVersion was compacted: only a new list can resume.
                metrics.WATCH_RESTARTS.labels(self.scope.resource, "expired").inc()
                log.debug("watch_expired", scope=str(self.scope), resource_version=rv)
                return Next(State.LISTING)
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
                return Next(State.WATCHING, rv)
            return self._failed(await self._confirmed(err), "watch", State.WATCHING, rv)
        finally:
            self._stream = None
        self._down()
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
            return backing_off(delay, State.WATCHING, rv)
        metrics.WATCH_RESTARTS.labels(self.scope.resource, "ended").inc()
        log.debug("watch_ended", scope=str(self.scope), resource_version=rv)
        return Next(State.WATCHING, rv)

    def _established(self, events: int) -> bool:
        """The stream worked: it delivered, or it stayed open ``short_watch`` after the
        server answered (time spent connecting does not count)."""
        return events > 0 or (
            self._opened_at is not None
            and self._loop.time() - self._opened_at >= self.settings.short_watch
        )

    @staticmethod
    def _error_event(status: Mapping[str, Any]) -> KubeError:
        code = status.get("code")
        code = code if isinstance(code, int) else 500
        return KubeError(
            classify_answer(code, status),
            str(status.get("message") or "watch error"),
            status=code,
            reason=str(status.get("reason") or ""),
        )

    async def _confirmed(self, err: KubeError) -> KubeError:
        """A 404 stands only when discovery confirms the kind is not served: the list of a
        kind whose CRD is gone answers NOT_SERVED, and so does a Go gateway with no API
        server behind it (then the 404 is transient: canaries kept, no verdict)."""
        if err.kind is not ErrorKind.GONE:
            return err
        if self.scope.kind is not None:
            found = await discover_kinds(self.kube, (self.scope.kind.key,), quiet=True)
            if not found.kinds and not found.failed:
                return err
        note = f"{err.args[0]} (discovery does not confirm it)"
        return KubeError(ErrorKind.TRANSIENT, note, status=err.status, reason=err.reason)

    def _failed(self, err: KubeError, during: str, then: State, rv: str = "") -> Next:
        """Log a failed list or watch, count it, and back off before ``then`` (before a
        list after a denial)."""
        if err.kind in (ErrorKind.FORBIDDEN, ErrorKind.GONE):
            metrics.WATCH_RESTARTS.labels(self.scope.resource, err.kind.value).inc()
            self.failures.failed(
                self.scope,
                f"{during}_{err.kind.value}",
                f"{err} (retry in {self.settings.forbidden_retry:g}s)",
            )
            self.sync.refused(err.kind.value)
            self.on_denied(err)
            return backing_off(self.settings.forbidden_retry, State.LISTING)
        why = "idle" if err.reason == "Idle" else "error"
        metrics.WATCH_RESTARTS.labels(self.scope.resource, why).inc()
        delay = self._backoff.next()
        if err.retry_after is not None:
            delay = max(err.retry_after, self.settings.backoff_initial)
        delay = min(delay, self.settings.backoff_max)
        cause = "unauthorized" if err.status == 401 else "error"  # canaryd_blind's reason
        self.failures.failed(self.scope, f"{during}_{cause}", f"{err} (retry in {delay:.3f}s)")
        return backing_off(delay, then, rv)


class Watcher:
    """Owns every list/watch task and keeps them matched to the watched namespaces."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        kube: KubeClient,
        open_files: OpenFiles | None = None,
    ) -> None:
        self.settings, self.registry, self.kube = settings, registry, kube
        self.open_files = open_files or OpenFiles(None, None)
        """The open-files limit in force: every watch holds a socket."""
        self._files_problem: str | None = None
        self.namespaces = settings.namespaces
        self._watches: dict[Scope, tuple[ListWatch, asyncio.Task[None]]] = {}
        self._list_slots = asyncio.Semaphore(LISTS_AT_ONCE)
        self._drop_reads = asyncio.Semaphore(DROP_READS_AT_ONCE)
        self._seen_namespaces: set[str] = set()
        """Every namespace the Namespaces watch knows: the gauge when all are watched."""
        self._namespaces_known = False
        """The Namespaces watch has listed (and may be read): missing ones are known."""
        self.uncovered: list[str] = []
        """What the last not_checked warning said (empty: everything is checked)."""
        self._group: asyncio.TaskGroup | None = None
        self.failures = watch_failures(settings)
        self.discovery = KindDiscovery(settings, kube, self._follow_kinds)

    @property
    def kinds(self) -> list[Kind]:
        """The kinds watched: those discovery found served."""
        return self.discovery.kinds

    @property
    def ready(self) -> bool:
        """Every scope listed and connected (what systemd's READY=1 waits for). A limit
        that is too low is said in /readyz, but must not keep a unit from starting."""
        return self.discovery.discovered.is_set() and all(
            lw.sync.ready for lw, _ in self._watches.values()
        )

    def coverage(self) -> dict[str, int]:
        """Watch scopes by state, wanted ones that cannot exist included: ``listed``
        (in sync or resuming), ``waiting`` (not listed or not connected), ``forbidden``
        (403), ``gone`` (404), ``namespace_missing`` (a watched namespace the
        Namespaces watch does not know), ``kind_not_served`` (a wanted --kind whose
        CRD is not served), ``patch_forbidden`` (watched, but its bumps are answered
        403: its canaries cannot be bumped). A canaryd that
        checks nothing must be able to say so. Each wanted scope counts once: one in a
        missing namespace (whose list answers an empty 200) is ``namespace_missing`` only."""
        counts = dict.fromkeys(SCOPE_STATES, 0)
        missing = self._namespaces_missing()
        for scope, state in self._scope_states().items():
            if scope.namespace not in missing:
                counts[state] += 1
        per_kind = 1 if self.namespaces is None else len(self.namespaces)
        counts["kind_not_served"] = per_kind * len(self.discovery.not_served())
        counts["waiting"] += per_kind * len(self.discovery.failed)
        counts["namespace_missing"] = len(self.kinds) * len(missing)
        return counts

    def blind(self) -> dict[str, str]:
        """What canaryd cannot check, by ``canaryd_blind`` reason, each with what (for
        /readyz and /healthz?verbose): scopes answered 403 or 404, not patchable, or
        refused the credentials (401), watched namespaces that do not exist, wanted
        kinds not served, and no canary at all once every scope has listed."""
        states = self._scope_states()

        def scopes(wanted: str) -> list[str]:
            return sorted(str(scope) for scope, state in states.items() if state == wanted)

        unauthorized = sorted(
            str(scope)
            for scope in self._watches
            if (self.failures.cause(scope) or "").endswith("_unauthorized")
        )
        if self.discovery.failures.cause(self.kube.host) == "unauthorized":
            unauthorized.insert(0, "discovery")
        gone = [f"{scope} (404)" for scope in scopes("gone")]
        found = {
            "list_forbidden": scopes("forbidden"),
            "unauthorized": unauthorized,
            "namespace_missing": sorted(self._namespaces_missing()),
            "kind_not_served": self.discovery.not_served() + gone,
            "patch_forbidden": scopes("patch_forbidden"),
        }
        blind = {reason: ", ".join(what[:20]) for reason, what in found.items() if what}
        if self.ready and not len(self.registry):
            where = ", ".join(sorted(self.namespaces)) if self.namespaces else "any namespace"
            blind["no_canaries"] = (
                f"no {'/'.join(k.plural for k in self.kinds) or 'kind served'} labelled "
                f"{self.settings.label}=true in {where}"
            )
        return blind

    def _scope_states(self) -> dict[Scope, str]:
        """Each canary scope's state: forbidden or gone (its list or watch was denied),
        patch_forbidden (a canary's last bump there was answered 403 and none written
        since), listed or waiting."""
        refused = {
            (c.key.kind, c.key.namespace if self.namespaces is not None else None)
            for c in self.registry.tracked()
            if c.cause == "forbidden" and c.bumped_generation is None
        }
        states = {}
        for scope, (lw, _) in self._watches.items():
            if scope.kind is None:
                continue
            if lw.sync.denied is not None:
                states[scope] = lw.sync.denied  # ErrorKind.FORBIDDEN or GONE's value
            elif (scope.kind.key, scope.namespace) in refused:
                states[scope] = "patch_forbidden"
            else:
                states[scope] = "listed" if lw.sync.ready else "waiting"
        return states

    def _namespaces_missing(self) -> set[str]:
        if self.namespaces is None or not self._namespaces_known:
            return set()
        return set(self.namespaces) - self._seen_namespaces

    def not_ready(self) -> list[str]:
        """Why the watches are not ready, each a phrase: an open-files limit too low for
        them, and the scopes whose initial list is not done or whose watch is not
        connected (a scope answered 403/404 counts as done: nothing there is ours)."""
        waiting = sorted(
            str(scope) for scope, (lw, _) in self._watches.items() if not lw.sync.ready
        )
        problems = [self._files_problem] if self._files_problem is not None else []
        problems += [
            f"discovery of {key} failed (retrying): {error}"
            for key, error in sorted(self.discovery.failed.items())
        ]
        if waiting:
            more = f" and {len(waiting) - 20} more" if len(waiting) > 20 else ""
            problems.append(f"not listed or not connected: {', '.join(waiting[:20])}{more}")
        return problems

    async def run(self) -> None:
        try:
            await self.discovery.first()
            async with asyncio.TaskGroup() as group:
                self._group = group
                self._start(Scope(None, None))
                self._reconcile()
                group.create_task(self._follow_requests(), name="watch requests")
                await self.discovery.follow()  # until cancelled at shutdown
        except asyncio.CancelledError:
            log.info("watcher_stopped", why="cancelled")
            raise
        finally:
            self._group = None
            # Not watched until a restart starts them: still failing, not recovered.
            self.failures.stopped("the watches stopped")
            self.discovery.failures.stopped("the watches stopped")
            self._watches.clear()

    def _follow_kinds(self, kinds: list[Kind]) -> None:
        """Discovery changed the served kinds: a kind no longer served loses its canaries."""
        removed = {scope.kind.key for scope in self._watches if scope.kind is not None}
        removed -= {k.key for k in kinds}
        self.registry.forget_where(
            lambda key: key.kind in removed, "gone", "its CRD is no longer served"
        )
        self._reconcile()

    # ----------------------------------------------------------- namespaces

    def set_namespaces(self, namespaces: frozenset[str] | None) -> None:
        """Follow a new watched set: removed namespaces lose their canaries at once."""
        if namespaces == self.namespaces:
            return
        if namespaces is not None:
            self.registry.forget_where(
                lambda key: key.namespace not in namespaces,
                "namespace_unwatched",
                "its namespace is no longer watched",
            )
        log.info("watched_namespaces", namespaces=sorted(namespaces) if namespaces else "all")
        self.namespaces = namespaces
        self._reconcile()

    def _desired(self) -> set[Scope]:
        if self.namespaces is None:
            return {Scope(kind, None) for kind in self.kinds}
        return {
            Scope(kind, ns)
            for kind in self.kinds
            for ns in self.namespaces
            if ns not in self.registry.closed_namespaces
        }

    def _reconcile(self) -> None:
        if self._group is None:
            return
        desired = self._desired()
        for scope in [s for s in self._watches if s.kind is not None and s not in desired]:
            _, task = self._watches.pop(scope)
            task.cancel()
            assert scope.kind is not None
            self.registry.scopes.remove((scope.kind.key, scope.namespace))
            self.failures.recovered(scope)  # no longer watched: no longer failing
        for scope in desired - set(self._watches):
            self._start(scope)
        self._count_namespaces()
        self._check_open_files()
        self.check_coverage()

    def check_coverage(self) -> None:
        """One warning when what canaryd cannot check changes, one line when it can
        check everything again (a 403 scope is also its own watch failure episode)."""
        phrases = [
            f"{reason}: {what}"
            for reason, what in self.blind().items()
            if reason not in ("no_canaries", "unauthorized")  # told by the episodes
        ]
        if phrases != self.uncovered:
            if phrases:
                log.warning("not_checked", what=phrases)
            elif self.uncovered:
                log.info("all_checked", was=self.uncovered)
            self.uncovered = phrases

    async def _follow_requests(self) -> None:
        """Replace the streams the judge suspects (``ScopeSync.suspect`` marks the scope:
        a request to the watcher, which owns the ListWatches), and say the coverage
        again at least once a cycle (a scope whose bumps are answered 403 is learned
        from the registry, not from a watch event)."""
        suspects = self.registry.scopes.suspects
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.timeout):
                    await suspects.wait()
            suspects.clear()
            for lw, _ in self._watches.values():
                if lw.sync.suspected is not None:
                    lw.replace(lw.sync.suspected)
                    lw.sync.suspected = None
            self.check_coverage()

    def _check_open_files(self) -> None:
        """Say once (per change) when the open-files limit is too low for the watches."""
        problem = self.open_files.shortfall(len(self._watches))
        if problem != self._files_problem:
            if problem is not None:
                log.warning("open_files_limit_too_low", problem=problem)
            else:
                log.info("open_files_limit_enough", watches=len(self._watches))
            self._files_problem = problem

    def _count_namespaces(self) -> None:
        watched = self._seen_namespaces if self.namespaces is None else self.namespaces
        metrics.WATCHED_NAMESPACES.set(len(watched - self.registry.closed_namespaces))

    def _start(self, scope: Scope) -> None:
        assert self._group is not None
        if scope.kind is None:
            lw = ListWatch(
                self.kube,
                self.settings,
                scope,
                selector=None,
                on_list=self._namespaces_listed,
                on_event=self._namespace_event,
                on_denied=self._namespaces_denied,
                failures=self.failures,
                list_slots=self._list_slots,
            )
        else:
            kind = scope.kind
            key = (kind.key, scope.namespace)
            sync = self.registry.scopes.add(key, time.monotonic())
            metrics.bump_stages_exported(kind.key)
            lw = ListWatch(
                self.kube,
                self.settings,
                scope,
                selector=self.settings.label,
                on_list=lambda items: self.registry.replace_scope(kind.key, scope.namespace, items),
                on_event=lambda event, obj: self._canary_event(kind, event, obj),
                on_denied=lambda err: self._scope_denied(scope, err),
                sync=sync,
                on_resumed=lambda: self.registry.scope_resumed(key),
                failures=self.failures,
                list_slots=self._list_slots,
            )
        task = self._group.create_task(lw.run(), name=f"watch {scope}")
        self._watches[scope] = (lw, task)

    def _canary_event(self, kind: Kind, event: str, obj: Mapping[str, Any]) -> None:
        if event != "DELETED":
            self.registry.observe(kind.key, obj)
            return
        metadata = obj.get("metadata")
        if not isinstance(metadata, Mapping):
            return
        key = CanaryKey(kind.key, str(metadata.get("namespace")), str(metadata.get("name")))
        tracked = self.registry.get(key)
        if tracked is None or tracked.uid != str(metadata.get("uid") or ""):
            return
        label = self.settings.label
        if not is_canary(obj, label):
            self.registry.forget(key, "not_canary", f"label {label} was removed")
        elif metadata.get("deletionTimestamp") or self._group is None:
            self.registry.forget(key, "deleted", "the object was deleted")
        else:
            # A label-selector watch sends DELETED with the previous copy when the
            # object leaves the selector (its label removed or changed) as when it is
            # deleted: dropped now (never written again), told once a GET says which.
            self.registry.forget(key, "deleted", announce=False)
            self._group.create_task(self._tell_drop(kind, key), name=f"drop {key}")

    async def _tell_drop(self, kind: Kind, key: CanaryKey) -> None:
        try:
            async with self._drop_reads:
                await self._classify_drop(kind, key)
        except Exception:
            # A bug here must not cancel the watches that share this task group.
            metrics.ERRORS.labels("watch").inc()
            log.exception("drop_classification_failed", canary=str(key))
            self.registry.announce_drop(key, "deleted", "deleted, or its label removed")

    async def _classify_drop(self, kind: Kind, key: CanaryKey) -> None:
        label = self.settings.label
        try:
            found = await self.kube.request("get", "GET", kind.object_path(key.namespace, key.name))
        except KubeError as err:
            if err.kind is ErrorKind.GONE:
                self.registry.announce_drop(key, "deleted", "the object was deleted")
            else:
                self.registry.announce_drop(
                    key, "deleted", f"deleted, or label {label} removed (could not tell: {err})"
                )
            return
        except asyncio.CancelledError:
            self.registry.announce_drop(key, "deleted", "deleted, or its label removed")
            raise
        if is_canary(found, label):
            # Labelled again by now, or a new object of that name: the watch's next
            # event tracks it; this one was not a label removal.
            self.registry.announce_drop(key, "deleted", "the object was deleted or replaced")
        else:
            self.registry.announce_drop(key, "not_canary", f"label {label} was removed")

    def _scope_denied(self, scope: Scope, err: KubeError) -> None:
        assert scope.kind is not None
        kind = scope.kind.key
        cause = "forbidden" if err.kind is ErrorKind.FORBIDDEN else "gone"
        self.registry.forget_where(
            lambda key: key.kind == kind and scope.namespace in (None, key.namespace),
            cause,
            f"cannot list {scope}: {err}",
        )
        self.check_coverage()

    @staticmethod
    def _terminating(obj: Mapping[str, Any]) -> bool:
        metadata = obj.get("metadata") or {}
        status = obj.get("status") or {}
        return bool(metadata.get("deletionTimestamp")) or (
            isinstance(status, Mapping) and status.get("phase") == "Terminating"
        )

    def _namespaces_listed(self, items: list[Mapping[str, Any]]) -> None:
        self._seen_namespaces = {_name(obj) for obj in items}
        self._namespaces_known = True
        self.check_coverage()
        self._count_namespaces()
        closed = {_name(obj) for obj in items if self._terminating(obj)}
        for name in closed:
            self._close_namespace(name)
        reopened = [
            name
            for name in self.registry.closed_namespaces - closed
            if self.registry.reopen_namespace(name)
        ]
        if reopened:
            self._reconcile()

    def _namespace_event(self, event: str, obj: Mapping[str, Any]) -> None:
        name = _name(obj)
        if event == "DELETED":
            self._seen_namespaces.discard(name)
        else:
            self._seen_namespaces.add(name)
        self._count_namespaces()
        self.check_coverage()
        if event == "DELETED":
            self.registry.forget_namespace(name, "namespace_closed", "its namespace was deleted")
            self.registry.reopen_namespace(name)  # a namespace of that name may come
            self._reconcile()
        elif self._terminating(obj):
            self._close_namespace(name)
        elif self.registry.reopen_namespace(name):
            self._reconcile()

    def _close_namespace(self, name: str) -> None:
        if name not in self.registry.closed_namespaces:
            self.registry.close_namespace(name, "its namespace is terminating")
            self._reconcile()

    def _namespaces_denied(self, err: KubeError) -> None:
        self._namespaces_known = False
        log.warning(
            "namespaces_not_watchable",
            error=str(err),
            consequence="a deleted namespace is noticed only through canary watches",
        )
