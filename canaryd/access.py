"""Access reviews (SelfSubjectAccessReviews, which any authenticated user may ask about
itself) of what canaryd will do, for ``canaryd check`` (the daemon asks none: the 403 on
its list or its bumps tells it), and whether the operator's service account exists."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import NamedTuple

import structlog

from canaryd import metrics
from canaryd.config import Settings
from canaryd.kube import FLINK_GROUP, KubeClient, KubeError, kind_of

ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
KIND_VERBS = ("list", "watch", "patch")
"""What canaryd does to its canaries: a list and a watch per scope, a merge patch per
bump (the GET after a 409 or 404 is a repair path, not needed to run)."""
LEASE_GROUP = "coordination.k8s.io"
CONCURRENT_REVIEWS = 8
log = structlog.get_logger("canaryd.access")


class Permission(NamedTuple):
    """One thing canaryd will ask the API server to let it do, as a review's
    resourceAttributes. ``namespace`` None: in every namespace (namespaces themselves
    are cluster-scoped)."""

    verb: str
    resource: str
    group: str = ""
    namespace: str | None = None
    name: str | None = None

    def __str__(self) -> str:
        plain = self.group in ("", FLINK_GROUP, LEASE_GROUP)  # their plurals say which
        what = self.resource if plain else f"{self.resource}.{self.group}"
        if self.name is not None:
            what += f"/{self.name}"
        if self.resource == "namespaces":
            return f"{self.verb} {what} (cluster-scoped)"
        return f"{self.verb} {what} in {self.namespace or 'all namespaces'}"


def wanted_permissions(settings: Settings) -> list[Permission]:
    """Every permission canaryd needs with these settings, in the order it uses them;
    the operator's service account last (``canaryd check`` reads its answer there)."""
    scopes: Sequence[str | None] = sorted(settings.namespaces or ()) or [None]
    wanted = [
        Permission(verb, kind.plural, kind.group, namespace)
        for kind in map(kind_of, settings.kinds)
        for namespace in scopes
        for verb in KIND_VERBS
    ]
    # Listed and watched whatever is watched: a namespace that goes drops its canaries.
    wanted += [Permission("list", "namespaces"), Permission("watch", "namespaces")]
    if settings.leader_elect:  # created without a name (RBAC names none yet), then by name
        namespace, lease = settings.lease_namespace, settings.lease_name
        for verb in ("get", "create", "update"):
            name = None if verb == "create" else lease
            wanted.append(Permission(verb, "leases", LEASE_GROUP, namespace, name))
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


async def say_operator_account(kube: KubeClient, account: tuple[str, str]) -> None:
    """The daemon's line at start on whether the operator's account exists."""
    said = log.bind(namespace=account[0], name=account[1])
    try:
        exists = await account_exists(kube, account)
    except KubeError as err:
        metrics.ERRORS.labels("operator_account").inc()
        said.warning("operator_account_unknown", error=str(err))
        return
    if exists:
        said.info("operator_account", exists=True)
    else:
        said.warning(
            "operator_account_missing",
            why="the admission policy refuses the stale writes of this account, which "
            "does not exist: it refuses nothing (--operator-account, the chart's "
            "admissionPolicy.operatorServiceAccount)",
        )


async def reviews(kube: KubeClient, permissions: Sequence[Permission]) -> list[bool]:
    """Does the API server allow each? ``CONCURRENT_REVIEWS`` asked at once; raises the
    first KubeError: an unanswered review is not a refusal."""
    gate = asyncio.Semaphore(CONCURRENT_REVIEWS)

    async def allowed(permission: Permission) -> bool:
        asked = {key: value for key, value in permission._asdict().items() if value is not None}
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": asked},
        }
        async with gate:
            answer = await kube.request("create", "POST", ACCESS_REVIEWS, body=review)
        status = answer.get("status")
        return isinstance(status, dict) and status.get("allowed") is True

    return list(await asyncio.gather(*map(allowed, permissions)))
