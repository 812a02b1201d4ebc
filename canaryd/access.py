"""Access reviews: what canaryd will ask the API server to let it do, and whether it may.

SelfSubjectAccessReviews (authorization.k8s.io/v1), which any authenticated user may
ask about itself: ``canaryd check`` asks them all before a start (the daemon asks
none: it learns a forbidden scope from the 403 on its list or its bumps).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from canaryd.config import Settings, lease_namespace
from canaryd.kube import FLINK_GROUP, KubeClient, KubeError, kind_of

ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
KIND_VERBS = ("list", "watch", "patch")
"""What canaryd does to its canaries: a list and a watch per scope, a merge patch per
bump (the GET after a 409 or 404 is a repair path, not needed to run)."""
LEASE_VERBS = ("get", "create", "update")
LEASE_GROUP = "coordination.k8s.io"
CONCURRENT_REVIEWS = 8


@dataclass(frozen=True)
class Permission:
    """One thing canaryd will ask the API server to let it do."""

    verb: str
    resource: str
    group: str = ""
    namespace: str | None = None
    """None: cluster-wide (every namespace, or a cluster-scoped resource)."""
    name: str | None = None
    cluster_scoped: bool = False

    def attributes(self) -> dict[str, str]:
        attributes = {"verb": self.verb, "group": self.group, "resource": self.resource}
        if self.namespace is not None:
            attributes["namespace"] = self.namespace
        if self.name is not None:
            attributes["name"] = self.name
        return attributes

    def __str__(self) -> str:
        known = ("", FLINK_GROUP, LEASE_GROUP)  # their plurals say which they are
        what = self.resource if self.group in known else f"{self.resource}.{self.group}"
        if self.name is not None:
            what = f"{what}/{self.name}"
        if self.cluster_scoped:
            return f"{self.verb} {what} (cluster-scoped)"
        return f"{self.verb} {what} in {self.namespace or 'all namespaces'}"


def wanted_permissions(settings: Settings) -> list[Permission]:
    """Every permission canaryd needs with these settings, in the order it uses them."""
    scopes: tuple[str | None, ...] = (
        (None,) if settings.namespaces is None else tuple(sorted(settings.namespaces))
    )
    wanted = [
        Permission(verb, kind.plural, kind.group, namespace)
        for kind in map(kind_of, settings.kinds)
        for namespace in scopes
        for verb in KIND_VERBS
    ]
    # The watcher always lists and watches Namespaces (a terminating or deleted
    # namespace drops its canaries; a watched one that does not exist is named in
    # /readyz); both variants of config/rbac grant it.
    wanted += [Permission(verb, "namespaces", cluster_scoped=True) for verb in ("list", "watch")]
    if settings.leader_elect:
        namespace = lease_namespace(settings)
        wanted += [
            # create cannot be limited to a name (RBAC: the object has none yet).
            Permission(
                verb,
                "leases",
                LEASE_GROUP,
                namespace,
                None if verb == "create" else settings.lease_name,
            )
            for verb in LEASE_VERBS
        ]
    if settings.operator_account is not None:  # last: check reads its answer there
        namespace, name = settings.operator_account
        wanted.append(Permission("get", "serviceaccounts", "", namespace, name))
    return wanted


async def account_exists(kube: KubeClient, account: tuple[str, str]) -> bool:
    """Does the operator's service account exist? The admission policy judges its
    writes: one named for an account that does not exist refuses nothing. Raises
    KubeError when the API server does not say (refused, unanswered)."""
    namespace, name = account
    try:
        await kube.request("get", "GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")
    except KubeError as err:
        if err.status == 404:
            return False
        raise
    return True


async def reviews(kube: KubeClient, permissions: Sequence[Permission]) -> list[bool]:
    """Does the API server allow each? ``CONCURRENT_REVIEWS`` asked at once. Raises the
    first KubeError (the other reviews cancelled): an unanswered review is not a refusal."""
    gate = asyncio.Semaphore(CONCURRENT_REVIEWS)

    async def one(permission: Permission) -> bool:
        async with gate:
            answer: dict[str, Any] = await kube.request(
                "create",
                "POST",
                ACCESS_REVIEWS,
                body={
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SelfSubjectAccessReview",
                    "spec": {"resourceAttributes": permission.attributes()},
                },
            )
        status = answer.get("status")
        return isinstance(status, dict) and status.get("allowed") is True

    failed: BaseException | None = None
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(p)) for p in permissions]
    except* KubeError as errors:
        failed = errors.exceptions[0]
    if failed is not None:
        raise failed  # as it was raised: its cause names why (refused, tls, ...)
    return [task.result() for task in tasks]
