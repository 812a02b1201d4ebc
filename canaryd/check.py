"""``canaryd check``: the pre-flight check. The configuration parsed as the daemon parses
it, the API server reached with the same credentials, and asked with
SelfSubjectAccessReviews (authorization.k8s.io/v1) whether canaryd may do what it will
do: list, watch and patch each wanted kind in each watched namespace (or cluster-wide
when all are watched), list and watch namespaces, and, under ``--leader-elect``, get,
create and update its Lease. One line per permission; exit 0 when every one is
granted, 2 naming what is missing (or on bad configuration, or an API server that
cannot be reached or refuses the credentials).

Missing permissions are otherwise quiet: a canary canaryd may not patch is ``unknown``,
which does not fail /healthz.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from canaryd import logs
from canaryd.config import (
    ConfigError,
    Settings,
    lease_namespace,
    load_settings,
    nested_keys_why,
    nested_operator_keys,
)
from canaryd.daemon import check_kubeconfig
from canaryd.kube import (
    FLINK_GROUP,
    KubeClient,
    KubeError,
    failure_cause,
    kind_of,
    kubeconfig_path,
    load_configuration,
    server_url_problem,
)

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
    return wanted


async def _client(settings: Settings) -> KubeClient:
    """A client with the daemon's credentials, found as the daemon finds them."""
    in_cluster = settings.kubeconfig is None and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    where = "in-cluster service account" if in_cluster else kubeconfig_path(settings.kubeconfig)
    context = settings.context
    if not in_cluster:
        context = context or check_kubeconfig(where)
    try:
        configuration, reload, _ = await load_configuration(settings.kubeconfig, context)
    except Exception as err:  # any loader failure is a configuration problem
        detail = logs.scrub(str(err)) or type(err).__name__
        raise ConfigError(f"cannot load Kubernetes credentials ({where}): {detail}") from err
    problem = server_url_problem(str(configuration.host or ""))
    if problem is not None:
        raise ConfigError(f"kubeconfig {where}: {problem}")
    logs.register_secret(configuration.api_key.get("BearerToken"))
    return KubeClient(
        configuration,
        request_timeout=settings.request_timeout,
        connect_timeout=settings.connect_timeout,
        reload=reload,
    )


async def review(kube: KubeClient, permission: Permission) -> bool:
    """Does the API server allow it? (a SelfSubjectAccessReview: any authenticated user
    may ask about itself)."""
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


async def check(settings: Settings, out: TextIO) -> int:
    """Print one line per finding; the exit status: 0 all granted, 2 something missing."""
    if settings.operator_config is not None:
        read, nested = nested_operator_keys(settings.operator_config)
        for key in nested:
            print(f"warn {key} is nested in {read}: {nested_keys_why(read)}", file=out)
    wanted = wanted_permissions(settings)
    kube = await _client(settings)
    gate = asyncio.Semaphore(CONCURRENT_REVIEWS)

    async def one(permission: Permission) -> bool:
        async with gate:
            return await review(kube, permission)

    failed: BaseException | None = None
    try:
        async with asyncio.TaskGroup() as group:  # the first failure cancels the others
            tasks = [group.create_task(one(p)) for p in wanted]
    except* KubeError as errors:
        failed = errors.exceptions[0]
    finally:
        await kube.close()
    if isinstance(failed, KubeError):
        raise ConfigError(_unanswered(kube.host, failed)) from failed
    granted = [task.result() for task in tasks]
    missing = [p for p, ok in zip(wanted, granted, strict=True) if not ok]
    for permission, ok in zip(wanted, granted, strict=True):
        print(f"{'ok  ' if ok else 'MISSING'} {permission}", file=out)
    if missing:
        print(
            f"canaryd check: {len(missing)} of {len(wanted)} permissions missing on "
            f"{kube.host}: {', '.join(map(str, missing))}",
            file=out,
        )
        return 2
    print(f"canaryd check: all {len(wanted)} permissions granted on {kube.host}", file=out)
    return 0


def _unanswered(host: str, err: KubeError) -> str:
    """One line for an API server that did not answer an access review."""
    cause = failure_cause(err)
    if cause == "unauthorized":
        return f"the API server at {host} refused the credentials (401): {logs.scrub(str(err))}"
    if err.status is not None:
        return f"the API server at {host} answered an access review with {logs.scrub(str(err))}"
    return f"cannot reach the API server at {host} ({cause}): {logs.scrub(str(err))}"


def main(argv: Sequence[str]) -> None:
    """``canaryd check [FLAGS]``: the daemon's flags and environment."""
    try:
        settings = load_settings(argv, os.environ)
    except ConfigError as err:
        print(f"canaryd: {err}", file=sys.stderr)
        sys.exit(2)
    # The check speaks on stdout; the client's own logs only when something is wrong.
    logs.configure(settings.log_format, "error")
    try:
        status = asyncio.run(check(settings, sys.stdout))
    except ConfigError as err:
        sys.stdout.flush()
        print(f"canaryd: {err}", file=sys.stderr)
        sys.exit(2)
    sys.exit(status)
