"""Discovery: which of the wanted kinds the API server serves, kept current.

The first discovery is retried while no wanted kind's group answers at all (one
episode, its cause in /readyz). Kinds whose group failed are asked again with backoff
while the others are watched. Every check interval the served kinds are looked at
again; a kind that seems gone is dropped only when a second look confirms it. The
watcher hears of every change through one callback, ``on_change``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from canaryd import metrics
from canaryd.backoff import Backoff
from canaryd.config import Settings
from canaryd.episodes import Episodes
from canaryd.kube import (
    KIND_NAMES,
    KINDS,
    ErrorKind,
    Kind,
    KubeClient,
    KubeError,
    failure_cause,
    kind_of,
)

log = structlog.get_logger("canaryd.discovery")


@dataclass
class Discovery:
    """What discovery found for the wanted kinds."""

    kinds: list[Kind]
    """The wanted kinds that are served, in the order wanted."""
    failed: dict[str, str]
    """Wanted kinds whose group could not be read (an error other than a 404 that /apis
    confirms), with the error: not known to be served or not, so retried; the other
    kinds go on."""
    unanswered: KubeError | None = None
    """The first error when no wanted kind's group answered at all (the API server is
    away, or refuses the credentials), for naming its cause (refused, tls...)."""


async def discover_kinds(
    kube: KubeClient, wanted: tuple[str, ...], *, quiet: bool = False
) -> Discovery:
    """The wanted kinds whose CRD is installed; a missing one is skipped with a warning
    (at debug level when ``quiet``, for the periodic re-discovery). Each group version is
    read on its own: one that fails (a 503 from an aggregated API, a 403, a 404 that
    /apis does not confirm) leaves its kinds in ``failed`` and does not hold up the
    others."""
    served: dict[tuple[str, str], dict[str, Mapping[str, Any]]] = {}
    errors: dict[tuple[str, str], KubeError] = {}
    for group_version in dict.fromkeys((k.group, k.version) for k in map(kind_of, wanted)):
        group, version = group_version
        try:
            found = await kube.request("get", "GET", f"/apis/{group}/{version}")
            served[group_version] = {
                str(r.get("name")): r for r in found.get("resources") or [] if isinstance(r, dict)
            }
        except KubeError as err:
            errors[group_version] = err
    if gone := [gv for gv, err in errors.items() if err.kind is ErrorKind.GONE]:
        # NOT_SERVED is a Go gateway's page too: not served only if /apis, which
        # kube-apiserver always answers with an APIGroupList, lacks the group version.
        # Else (/apis failed too: an outage) the 404s stay failures, retried and told.
        try:
            listed = await kube.request("get", "GET", "/apis")
        except KubeError:
            listed = {}
        if listed.get("kind") == "APIGroupList":
            offered = {
                v.get("groupVersion")
                for g in listed.get("groups") or []
                if isinstance(g, dict)
                for v in g.get("versions") or []
                if isinstance(v, dict)
            }
            for group, version in gone:
                if f"{group}/{version}" not in offered:
                    served[(group, version)] = {}
                    del errors[(group, version)]
    kinds = []
    failed = {}
    for key in wanted:
        kind = kind_of(key)
        if (kind.group, kind.version) in errors:
            failed[key] = str(errors[(kind.group, kind.version)])
            continue
        resource = served[(kind.group, kind.version)].get(kind.plural)
        if resource is not None and resource.get("namespaced") is True:
            name = resource.get("kind")
            if key not in KINDS and isinstance(name, str) and name:
                KIND_NAMES[key] = name
                kind = kind_of(key)
            kinds.append(kind)
            continue
        detail = (
            f"{kind.plural}.{kind.group} is cluster-scoped; only namespaced kinds can be canaries"
            if resource is not None
            else f"{kind.plural}.{kind.group} is not served in {kind.group}/{kind.version}; "
            "its canaries are not checked"
        )
        (log.debug if quiet else log.warning)(
            "crd_missing", kind=key, group=f"{kind.group}/{kind.version}", detail=detail
        )
    return Discovery(kinds, failed, None if served else next(iter(errors.values()), None))


class KindDiscovery:
    """The served kinds (``kinds``), why the last look failed (``problem``), the wanted
    kinds whose group could not be read (``failed``, retried, named in /readyz)."""

    def __init__(
        self, settings: Settings, kube: KubeClient, on_change: Callable[[list[Kind]], None]
    ) -> None:
        self.settings, self.kube, self._on_change = settings, kube, on_change
        self.kinds: list[Kind] = []
        self.discovered = asyncio.Event()
        self.problem: str | None = None
        """Why the last discovery failed ("refused: ..."), None when it worked."""
        self.failed: dict[str, str] = {}
        """Wanted kinds whose discovery failed (not a confirmed 404), with the error."""
        self.failures = Episodes(
            "discovery_failures",
            subject="api_server",
            subjects="api_servers",
            detail_event="discovery_failed",
            interval=lambda: settings.timeout,
            logger_name="canaryd.discovery",
        )

    def not_served(self) -> list[str]:
        """Wanted kinds the API server said it does not serve."""
        if not self.discovered.is_set():
            return []
        served = {kind.key for kind in self.kinds}
        return [key for key in self.settings.kinds if key not in served and key not in self.failed]

    async def follow(self) -> None:
        """Until cancelled: retry the kinds whose group failed, and look again every
        check interval."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._retry_failed(), name="discovery retry")
            await self._look_again()

    def _change(self, kinds: list[Kind]) -> None:
        kinds.sort(key=lambda k: self.settings.kinds.index(k.key))
        log.info("kinds_changed", was=[k.key for k in self.kinds], now=[k.key for k in kinds])
        for kind in kinds:
            self.failed.pop(kind.key, None)
        self.kinds = kinds
        self._on_change(kinds)

    async def first(self) -> None:
        """The first discovery, retried while no wanted kind's group could be read at all
        (the API server is away, or refuses the credentials): one episode, its cause in
        the first line and in /readyz, not a warning per retry. Once one group could be
        read, the kinds whose groups failed are left to ``_retry_failed`` and
        the others are watched."""
        backoff = Backoff(self.settings.backoff_initial, self.settings.backoff_max)
        while True:
            try:
                found = await discover_kinds(self.kube, self.settings.kinds)
            except Exception:
                # A bug must not stop the daemon: say so, count it, try again.
                delay = backoff.next()
                metrics.ERRORS.labels("discovery").inc()
                log.exception("discovery_failed_unexpectedly", retry_in=round(delay, 3))
                await asyncio.sleep(delay)
                continue
            if found.unanswered is None:
                break
            delay = backoff.next()
            self._failed(found.unanswered, f"retry in {delay:.3f}s")
            await asyncio.sleep(delay)
        self._works()
        self.failed = found.failed
        if found.failed:
            log.warning(
                "discovery_failed",
                kinds=sorted(found.failed),
                error=next(iter(found.failed.values())),
                watching=[k.key for k in found.kinds],
            )
        log.info("discovered", kinds=[k.key for k in found.kinds])
        self.kinds = found.kinds
        self.discovered.set()

    async def _retry_failed(self) -> None:
        """Kinds whose group failed the first discovery are asked again, with backoff,
        until their group answers: served, they get their watches; a confirmed 404,
        they are not served (and the periodic re-discovery looks again, as for any kind)."""
        backoff = Backoff(self.settings.backoff_initial, self.settings.backoff_max)
        while self.failed:
            await asyncio.sleep(backoff.next())
            wanted = tuple(self.failed)
            try:
                found = await discover_kinds(self.kube, wanted)
            except Exception:
                # A bug must not stop the retries: say so, count it, try again.
                metrics.ERRORS.labels("discovery").inc()
                log.exception("discovery_failed_unexpectedly", kinds=list(wanted))
                continue
            for key in wanted:
                if key not in found.failed:
                    self.failed.pop(key, None)
                elif found.failed[key] != self.failed.get(key):
                    log.warning("discovery_failed", kinds=[key], error=found.failed[key])
                    self.failed[key] = found.failed[key]
            new = [k for k in found.kinds if k.key not in {have.key for have in self.kinds}]
            if new or len(found.failed) < len(wanted):
                log.info("discovered", kinds=[k.key for k in found.kinds], retried=list(wanted))
            if new:
                self._change([*self.kinds, *new])

    def _failed(self, err: KubeError, then: str) -> None:
        cause = failure_cause(err)
        self.problem = f"{cause}: {err}"
        self.failures.failed(self.kube.host, cause, f"{err} ({then})")

    def _works(self) -> None:
        self.problem = None
        self.failures.recovered(self.kube.host)

    async def _look_again(self) -> None:
        """Every check interval, look again at which Flink CRDs are served: a CRD installed
        after canaryd started gets its watches; a removed one loses them — once a second
        look, a backoff later, confirms it: one API server replica that briefly answers
        404 for the group must not drop every canary until the next interval."""
        while True:
            await asyncio.sleep(self.settings.config_check_interval)
            try:
                found = await discover_kinds(self.kube, self.settings.kinds, quiet=True)
                # A group that failed to answer this time keeps the kinds it had.
                kinds = [*found.kinds, *(k for k in self.kinds if k.key in found.failed)]
                lost = {k.key for k in self.kinds} - {k.key for k in kinds}
                if lost:
                    await asyncio.sleep(self.settings.backoff_max)
                    again = await discover_kinds(self.kube, self.settings.kinds, quiet=True)
                    confirmed = {k.key for k in again.kinds} | set(again.failed)
                    kinds += [k for k in self.kinds if k.key in lost and k.key in confirmed]
                kinds.sort(key=lambda k: self.settings.kinds.index(k.key))
                if kinds != self.kinds:
                    self._change(kinds)
                if found.unanswered is not None:
                    kept = ", ".join(k.key for k in self.kinds)
                    self._failed(found.unanswered, f"keeping {kept}")
                else:
                    self._works()
            except Exception:
                metrics.ERRORS.labels("discovery").inc()
                keeping = [k.key for k in self.kinds]
                log.exception("rediscovery_failed_unexpectedly", keeping=keeping)
