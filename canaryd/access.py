"""Access reviews: whether the API server lets canaryd do what it will do, asked with
SelfSubjectAccessReviews (authorization.k8s.io/v1), which any authenticated user may
ask about itself. ``canaryd check`` (so ``helm test``) asks them all before a start;
``PatchReviews``, the watcher's, asks about patch in each canary scope it watches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import structlog

from canaryd import metrics
from canaryd.backoff import Backoff
from canaryd.config import Settings, lease_namespace
from canaryd.kube import FLINK_GROUP, KubeClient, KubeError, kind_of

log = structlog.get_logger("canaryd.access")
ScopeT = TypeVar("ScopeT", bound=Hashable)

ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
KIND_VERBS = ("list", "watch", "patch")
"""What canaryd does to its canaries: a list and a watch per scope, a merge patch per
bump (the GET after a 409 or 404 is a repair path, not needed to run)."""
LEASE_GROUP = "coordination.k8s.io"
CONCURRENT_REVIEWS = 8


@dataclass(frozen=True)
class Permission:
    """One thing canaryd will ask the API server to let it do. ``namespace`` None: in
    every namespace, or of a ``cluster_scoped`` resource."""

    verb: str
    resource: str
    group: str = ""
    namespace: str | None = None
    name: str | None = None
    cluster_scoped: bool = False

    def attributes(self) -> dict[str, str]:
        asked = {"verb": self.verb, "group": self.group, "resource": self.resource}
        if self.namespace is not None:
            asked["namespace"] = self.namespace
        if self.name is not None:
            asked["name"] = self.name
        return asked

    def __str__(self) -> str:
        plain = self.group in ("", FLINK_GROUP, LEASE_GROUP)  # their plurals say which
        what = self.resource if plain else f"{self.resource}.{self.group}"
        if self.name is not None:
            what += f"/{self.name}"
        if self.cluster_scoped:
            return f"{self.verb} {what} (cluster-scoped)"
        return f"{self.verb} {what} in {self.namespace or 'all namespaces'}"


def wanted_permissions(settings: Settings) -> list[Permission]:
    """Every permission canaryd needs with these settings, in the order it uses them;
    the operator's service account last (``canaryd check`` reads its answer there)."""
    scopes: Sequence[str | None] = [None]
    if settings.namespaces is not None:
        scopes = sorted(settings.namespaces)
    wanted = [
        Permission(verb, kind.plural, kind.group, namespace)
        for kind in map(kind_of, settings.kinds)
        for namespace in scopes
        for verb in KIND_VERBS
    ]
    # Namespaces are listed and watched whatever is watched: one that goes drops its canaries.
    wanted += [Permission(verb, "namespaces", cluster_scoped=True) for verb in ("list", "watch")]
    if settings.leader_elect:
        namespace, lease = lease_namespace(settings), settings.lease_name
        wanted += [
            Permission("get", "leases", LEASE_GROUP, namespace, lease),
            Permission("create", "leases", LEASE_GROUP, namespace),  # RBAC: no name yet
            Permission("update", "leases", LEASE_GROUP, namespace, lease),
        ]
    if settings.operator_account is not None:
        wanted.append(Permission("get", "serviceaccounts", "", *settings.operator_account))
    return wanted


async def account_exists(kube: KubeClient, account: tuple[str, str]) -> bool:
    """Does the operator's service account exist? An admission policy naming one that
    does not refuses nothing. Raises KubeError when the API server does not say."""
    namespace, name = account
    try:
        await kube.request("get", "GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")
    except KubeError as err:
        if err.status == 404:
            return False
        raise
    return True


async def reviews(kube: KubeClient, permissions: Sequence[Permission]) -> list[bool]:
    """Does the API server allow each? ``CONCURRENT_REVIEWS`` asked at once; raises the
    first KubeError: an unanswered review is not a refusal."""
    gate = asyncio.Semaphore(CONCURRENT_REVIEWS)

    async def allowed(permission: Permission) -> bool:
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": permission.attributes()},
        }
        async with gate:
            answer: dict[str, Any] = await kube.request(
                "create", "POST", ACCESS_REVIEWS, body=review
            )
        status = answer.get("status")
        return isinstance(status, dict) and status.get("allowed") is True

    return list(await asyncio.gather(*map(allowed, permissions)))


class PatchReviews(Generic[ScopeT]):
    """Whether canaryd may patch in each canary scope it watches: one review per scope
    new to it (``ask``), its answer kept while it is watched (a deleted namespace, or
    one canaryd does not watch, asks nothing again); a refused scope is asked again on
    its own once every ``forbidden_retry`` (a Role granted later is seen within a
    cycle). Unanswered is not refused: what was known stays, and those reviews are
    asked again after a backoff. ``denied`` holds the scopes refused."""

    def __init__(self, settings: Settings, kube: KubeClient, on_answer: Callable[[], None]):
        self._kube = kube
        self._backoff = (settings.backoff_initial, settings.backoff_max)
        self._recheck = settings.forbidden_retry
        self._on_answer = on_answer
        """Called after each answered round (the watcher's coverage is said again)."""
        self._allowed: dict[ScopeT, bool] = {}
        self._wanted: dict[ScopeT, Permission] = {}
        self._task: asyncio.Task[None] | None = None
        self._new = asyncio.Event()

    @property
    def denied(self) -> frozenset[ScopeT]:
        return frozenset(scope for scope, allowed in self._allowed.items() if not allowed)

    def ask(self, group: asyncio.TaskGroup, wanted: Mapping[ScopeT, Permission]) -> None:
        """These scopes are watched now: forget the others, ask about the new ones."""
        self._wanted = dict(wanted)
        self._allowed = {s: ok for s, ok in self._allowed.items() if s in self._wanted}
        if self._wanted.keys() - self._allowed.keys():
            self._new.set()
        if self._task is None or self._task.done():
            self._task = group.create_task(self._rounds(), name="access reviews")

    async def _rounds(self) -> None:
        backoff = Backoff(*self._backoff)
        while True:
            self._new.clear()
            asking = {s: p for s, p in self._wanted.items() if s not in self._allowed}
            if not asking and self.denied:
                try:  # new scopes come sooner
                    async with asyncio.timeout(self._recheck):
                        await self._new.wait()
                    continue
                except TimeoutError:
                    asking = {scope: self._wanted[scope] for scope in self.denied}
            if not asking:
                return
            try:
                granted = await reviews(self._kube, list(asking.values()))
            except Exception as err:
                # Unanswered, what was known stays; a bug must not stop the watches that
                # share this task group.
                metrics.ERRORS.labels("access_review").inc()
                if isinstance(err, KubeError):
                    log.info("access_review_unanswered", error=str(err), retry="after a backoff")
                else:
                    log.exception("access_review_failed_unexpectedly")
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            for scope, allowed in zip(asking, granted, strict=True):
                if scope in self._wanted:  # not left meanwhile
                    self._allowed[scope] = allowed
            self._on_answer()
