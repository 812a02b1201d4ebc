"""The watcher: keeps the registry true to the cluster (docs/DEVELOPMENT.md).

It alone applies what each scope's ``ListWatch`` and the Namespaces watch tell it, and
replaces a stream the judge suspects. No discovery and no access reviews: a
kind not served is learned from its list's confirmed 404, a scope canaryd may not list
from its 403, one it may not patch from its bumps' 403s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import structlog

from canaryd import metrics
from canaryd.config import Settings
from canaryd.kube import KIND_NAMES, KINDS, ErrorKind, Kind, KubeClient, KubeError, kind_of
from canaryd.limits import raise_open_files_limit
from canaryd.listwatch import (
    LISTS_AT_ONCE,
    Change,
    Event,
    Listed,
    ListWatch,
    Refused,
    Scope,
    Sync,
    watch_failures,
)
from canaryd.registry import CanaryKey, Registry, being_deleted, is_canary
from canaryd.sync import ScopeSync

log = structlog.get_logger("canaryd.watcher")

SCOPE_STATES = (
    "listed",
    "waiting",
    "forbidden",
    "namespace_missing",
    "kind_not_served",
    "patch_forbidden",
)
"""A canary scope's states, ``canaryd_watch_scopes`` (docs/CONFIGURATION.md)."""
DROP_READS_AT_ONCE = 8
"""GETs in flight at once that tell a deletion from a label removal: a mass deletion
leaves the request pool's connections to lists and the lease."""


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name"))


@dataclass(slots=True, eq=False)
class _Watch:
    lw: ListWatch
    sync: ScopeSync  # where the scope stands: the watcher writes it, the judge marks it
    task: asyncio.Task[None] = field(init=False)  # lw.run, telling the watcher


async def _tell_drop(
    kube: KubeClient,
    registry: Registry,
    kind: Kind,
    key: CanaryKey,
    label: str,
    reads: asyncio.Semaphore,
) -> None:
    """Tell a canary dropped on a DELETED event as what it was, once a GET says (at
    most ``DROP_READS_AT_ONCE`` at a time)."""
    cause, why = "deleted", "deleted, or its label removed"
    try:
        async with reads:
            found = await kube.request("get", "GET", kind.object_path(key.namespace, key.name))
        if is_canary(found, label):
            # Labelled again by now, or a new object of that name: the watch's next
            # event tracks it; this one was not a label removal.
            why = "the object was deleted or replaced"
        else:
            cause, why = "not_canary", f"label {label} was removed"
    except KubeError as err:
        why = f"deleted, or label {label} removed (could not tell: {err})"
        if err.kind is ErrorKind.GONE:
            why = "the object was deleted"
    except Exception:
        # A bug here must not cancel the watches that share this task group.
        metrics.ERRORS.labels("watch").inc()
        log.exception("drop_classification_failed", canary=str(key))
    finally:
        registry.announce_drop(key, cause, why)  # cancelled too: told as unknown


def _terminating(obj: Mapping[str, Any]) -> bool:
    status = obj.get("status")
    return being_deleted(obj) or (
        isinstance(status, Mapping) and status.get("phase") == "Terminating"
    )


class Watcher:
    """Owns every list/watch task, applies what they tell, and keeps them matched to the
    watched namespaces and to those not closed (being deleted: ``registry.closed``)."""

    def __init__(self, settings: Settings, registry: Registry, kube: KubeClient) -> None:
        self.settings, self.registry, self.kube = settings, registry, kube
        files = self.open_files = raise_open_files_limit()  # every watch holds a socket
        log.info(
            "open_files_limit",
            soft="unlimited" if files.soft is None else files.soft,
            hard="unlimited" if files.hard is None else files.hard,
            raised_from=files.raised_from,
            problem=files.problem,
        )
        self._files_problem: str | None = None
        self.namespaces = settings.namespaces
        self._kinds = [kind_of(key) for key in settings.kinds]  # a Kind's name learned: display
        self._watches: dict[Scope, _Watch] = {}
        self._list_slots = asyncio.Semaphore(LISTS_AT_ONCE)
        self._drop_reads = asyncio.Semaphore(DROP_READS_AT_ONCE)
        self._existing: dict[str, bool] = {}  # each namespace that exists: being deleted?
        self._known = False  # namespaces listed (and may be read): missing ones are known
        self.uncovered: list[str] = []  # what the last not_checked warning said
        self._group: asyncio.TaskGroup | None = None
        self.failures = watch_failures(settings)

    @property
    def kinds(self) -> list[Kind]:
        """The wanted kinds, less those the API server said it does not serve."""
        gone = {s.kind for s, w in self._watches.items() if w.sync.state == "kind_not_served"}
        return [kind for kind in self._kinds if kind not in gone]

    @property
    def ready(self) -> bool:
        """Every scope listed and connected (systemd's READY=1; a low limit is only said)."""
        return self._group is not None and all(w.sync.ready for w in self._watches.values())

    def coverage(self) -> dict[str, int]:
        """Watch scopes by state, each once: one in a missing namespace (its list answers
        an empty 200) is ``namespace_missing`` only."""
        counts = dict.fromkeys(SCOPE_STATES, 0)
        missing = self._missing()
        for scope, state in self._scope_states().items():
            if scope.namespace in missing and state != "kind_not_served":
                state = "namespace_missing"
            counts[state] += 1
        return counts

    def blind(self) -> dict[str, str]:
        """What canaryd cannot check, by ``canaryd_blind`` reason, each with what (for
        /readyz and /healthz?verbose); ``no_canaries`` once every scope has listed."""
        states = self._scope_states()
        found: dict[str, Collection[object]] = {
            "list_forbidden": [scope for scope, state in states.items() if state == "forbidden"],
            "unauthorized": [
                scope
                for scope in self._watches
                if (self.failures.cause(scope) or "").endswith("_unauthorized")
            ],
            "namespace_missing": self._missing(),
            "kind_not_served": [kind.key for kind in self._kinds if kind not in self.kinds],
            "patch_forbidden": [s for s, state in states.items() if state == "patch_forbidden"],
        }
        blind = {
            reason: ", ".join(sorted(map(str, what))[:20]) for reason, what in found.items() if what
        }
        if self.ready and not len(self.registry):
            where = ", ".join(sorted(self.namespaces)) if self.namespaces else "any namespace"
            blind["no_canaries"] = (
                f"no {'/'.join(k.plural for k in self.kinds) or 'kind served'} labelled "
                f"{self.settings.label}=true in {where}"
            )
        return blind

    def _scope_states(self) -> dict[Scope, str]:
        """Each canary scope's state (patch_forbidden: a bump answered 403, none since)."""
        refused = {
            (c.key.kind, c.key.namespace if self.namespaces is not None else None)
            for c in self.registry.tracked()
            if c.cause == "forbidden" and c.bumped_generation is None
        }
        states = {}
        for scope, watch in self._watches.items():
            if scope.kind is None:
                continue
            state = watch.sync.state
            if state in ("listed", "waiting") and (scope.kind.key, scope.namespace) in refused:
                state = "patch_forbidden"
            states[scope] = state
        return states

    def not_ready(self) -> list[str]:
        """Why the watches are not ready, each a phrase (a scope answered 403/404 is
        ready: nothing there is ours)."""
        if self._group is None:
            return ["the watches are not started"]
        waiting = sorted(
            (watch for watch in self._watches.values() if not watch.sync.ready),
            key=lambda watch: str(watch.lw.scope),
        )
        problems = [self._files_problem] if self._files_problem is not None else []
        if waiting:
            names = ", ".join(str(watch.lw.scope) for watch in waiting[:20])
            more = f" and {len(waiting) - 20} more" if len(waiting) > 20 else ""
            why = next((f" ({w.lw.problem})" for w in waiting if w.lw.problem), "")
            problems.append(f"not listed or not connected: {names}{more}{why}")
        return problems

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                self._start(Scope(None, None))
                self._reconcile()
                await self._follow_requests()  # until cancelled at shutdown
        except asyncio.CancelledError:
            log.info("watcher_stopped", why="cancelled")
            raise
        finally:
            self._group = None
            # Not watched until a restart starts them: still failing, not recovered.
            self.failures.stopped("the watches stopped")
            self._watches.clear()

    def _apply(self, watch: _Watch, change: Change) -> None:
        """Apply what a scope's ListWatch tells, as it tells it (a bug raised here is its
        to say, and it starts over from a new list)."""
        scope, sync, now = watch.lw.scope, watch.sync, time.monotonic()
        resumed = False
        match change:
            case Listed(items=items, kind=name):
                was_refused = sync.state not in ("listed", "waiting")
                if scope.kind is None:
                    self._existing = {_name(obj): _terminating(obj) for obj in items}
                    self._known = True
                    self._namespaces(set(self._existing) | self.registry.closed)
                else:
                    if name and scope.kind.key not in KINDS:
                        KIND_NAMES[scope.kind.key] = name  # shown in /healthz and Events
                    self.registry.replace_scope(scope.kind.key, scope.namespace, items)
                resumed = sync.listed_at(now)
                if was_refused:
                    self.check_coverage()
            case Event(type="BOOKMARK"):
                resumed = sync.delivered(now)
            case Event(type=event, obj=obj):
                if scope.kind is None:
                    self._namespace_event(event, obj)
                else:
                    self._canary_event(scope.kind, event, obj)
                resumed = sync.delivered(now)
            case Sync.OPENED:
                sync.opened()
            case Sync.DROPPED:
                sync.dropped(now)
            case Refused(error=err):
                self._refused(watch, err)
        if resumed and scope.kind is not None:
            self.registry.scope_resumed((scope.kind.key, scope.namespace))

    def _namespace_event(self, event: str, obj: Mapping[str, Any]) -> None:
        name = _name(obj)
        if event == "DELETED":
            self._existing.pop(name, None)
            self._forget_namespace(name, "its namespace was deleted")
        else:
            self._existing[name] = _terminating(obj)
        self._namespaces({name})

    def _namespaces(self, told: set[str]) -> None:
        """Follow what was told of these namespaces: one being deleted closes (its canaries
        dropped, copies in it ignored), one back or gone opens. With all watched, the canary
        scopes list again when a copy was ignored meanwhile (a canary recreated with it may
        come first: the streams are not ordered); a watched one's new scopes list anyway."""
        for name in told - self.registry.closed:
            if self._existing.get(name):
                self.registry.closed.add(name)
                self._forget_namespace(name, "its namespace is terminating")
        reopened = {name for name in told & self.registry.closed if not self._existing.get(name)}
        self.registry.closed -= reopened
        if reopened & self.registry.ignored and self.namespaces is None:
            for other in self._watches.values():
                if other.lw.scope.kind is not None:
                    other.lw.start_over()
        self.registry.ignored -= reopened
        self._reconcile()

    def _forget_namespace(self, namespace: str, why: str) -> None:
        self.registry.forget_where(lambda key: key.namespace == namespace, "namespace_closed", why)

    def _missing(self) -> Collection[str]:
        """The watched namespaces that do not exist (none known before a list)."""
        if self.namespaces is None or not self._known:
            return set()
        return self.namespaces - self._existing.keys()

    async def _follow_requests(self) -> None:
        """Replace the streams the judge suspects (``ScopeSync.suspect``); say the coverage
        at least once a cycle (patch_forbidden is learned from the registry)."""
        suspects = self.registry.scopes.suspects
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can return, not raise, when
            # the event is set in the turn the task is cancelled (a shutdown then hangs).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.timeout):
                    await suspects.wait()
            suspects.clear()
            for watch in self._watches.values():
                if watch.sync.suspected is not None:
                    watch.lw.replace(watch.sync.suspected)
                    watch.sync.suspected = None
            self.check_coverage()

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

    def _reconcile(self) -> None:
        """Watch each wanted kind in each watched namespace not closed (all: cluster-wide)."""
        if self._group is None:
            return
        wanted = [None] if self.namespaces is None else self.namespaces - self.registry.closed
        desired = {Scope(kind, namespace) for kind in self._kinds for namespace in wanted}
        for scope in [s for s in self._watches if s.kind is not None and s not in desired]:
            self._watches.pop(scope).task.cancel()
            assert scope.kind is not None
            self.registry.scopes.remove((scope.kind.key, scope.namespace))
            self.failures.recovered(scope)  # no longer watched: no longer failing
        for scope in desired - set(self._watches):
            self._start(scope)
        watched = frozenset(self._existing) if self.namespaces is None else self.namespaces
        metrics.WATCHED_NAMESPACES.set(len(watched - self.registry.closed))
        self._check_open_files()
        self.check_coverage()

    def _start(self, scope: Scope) -> None:
        assert self._group is not None
        if scope.kind is None:
            sync = ScopeSync(time.monotonic())
        else:
            sync = self.registry.scopes.add((scope.kind.key, scope.namespace), time.monotonic())
            metrics.bump_stages_exported(scope.kind.key)
        lw = ListWatch(
            self.kube, self.settings, scope, failures=self.failures, list_slots=self._list_slots
        )
        watch = self._watches[scope] = _Watch(lw, sync)
        watch.task = self._group.create_task(
            lw.run(partial(self._apply, watch)), name=f"watch {scope}"
        )

    def check_coverage(self) -> None:
        """One warning when what canaryd cannot check changes, one line when it can
        check everything again."""
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

    def _check_open_files(self) -> None:
        """Say once (per change) when the open-files limit is too low for the watches."""
        problem = self.open_files.shortfall(len(self._watches))
        if problem != self._files_problem:
            if problem is not None:
                log.warning("open_files_limit_too_low", problem=problem)
            else:
                log.info("open_files_limit_enough", watches=len(self._watches))
            self._files_problem = problem

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
        elif being_deleted(obj) or self._group is None:
            self.registry.forget(key, "deleted", "the object was deleted")
        else:
            # A label-selector watch sends DELETED with the previous copy when the
            # object leaves the selector (its label removed or changed) as when it is
            # deleted: dropped now (never written again), told once a GET says which.
            self.registry.forget(key, "deleted", announce=False)
            told = _tell_drop(self.kube, self.registry, kind, key, label, self._drop_reads)
            self._group.create_task(told, name=f"drop {key}")

    def _refused(self, watch: _Watch, err: KubeError) -> None:
        """403, or a 404 believed: nothing in the scope is ours until a list works."""
        scope, told = watch.lw.scope, watch.lw.scope.kind not in self.kinds
        watch.sync.deny("forbidden" if err.kind is ErrorKind.FORBIDDEN else "kind_not_served")
        if scope.kind is None:
            self._known = False
            log.warning(
                "namespaces_not_watchable",
                error=str(err),
                consequence="a deleted namespace is noticed only through canary watches",
            )
        else:
            kind = scope.kind.key
            if err.kind is ErrorKind.GONE and not told:
                retry = f"every {self.settings.config_check_interval:g}s"
                log.warning("kind_not_served", kind=kind, detail=str(err), retry=retry)
            self.registry.forget_where(
                lambda key: key.kind == kind and scope.namespace in (None, key.namespace),
                err.kind.value,  # forbidden or gone
                f"cannot list {scope}: {err}",
            )
        self.check_coverage()
