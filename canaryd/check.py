"""``canaryd check``: the pre-flight check. The configuration parsed as the daemon parses
it, the API server reached with the same credentials, and asked with
SelfSubjectAccessReviews (authorization.k8s.io/v1) whether canaryd may do what it will
do: list, watch and patch each wanted kind in each watched namespace (or cluster-wide
when all are watched), list and watch namespaces, and, under ``--leader-elect``, get,
create and update its Lease; with ``--operator-account``, get that service account,
and whether it exists (the admission policy names it: one for an account that does
not exist refuses nothing). Then, all granted, what the daemon will meet: the kinds
served, the watched namespaces there, the canaries it would check (per namespace) and,
with operator-metrics, the operator's metrics answering with their series. One line
per finding; exit 0 when all is well, 2 naming what is missing (a permission, the
operator's account; or on bad configuration, or an API server that cannot be reached
or refuses the credentials), 1 naming why canaryd would be blind (a ``canaryd_blind``
reason each).

Missing permissions are otherwise quiet: a canary canaryd may not patch is ``unknown``,
which does not fail /healthz.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TextIO

from canaryd import logs
from canaryd.access import account_exists, reviews, wanted_permissions
from canaryd.config import (
    ConfigError,
    Settings,
    load_settings,
    nested_keys_why,
    nested_operator_keys,
)
from canaryd.daemon import connect
from canaryd.kube import (
    NAMESPACES_PATH,
    ErrorKind,
    Kind,
    KubeClient,
    KubeError,
    failure_cause,
    kind_of,
)
from canaryd.listwatch import list_all, not_served
from canaryd.opmetrics import OperatorMetrics, ScrapeFailed
from canaryd.registry import is_canary


async def check(settings: Settings, out: TextIO) -> int:
    """Print one line per finding; the exit status: 0 all granted and nothing blind, 2
    something missing, 1 canaryd would be blind (``would_see``)."""
    if settings.operator_config is not None:
        read, nested = nested_operator_keys(settings.operator_config)
        for key in nested:
            print(f"warn {key} is nested in {read}: {nested_keys_why(read)}", file=out)
    wanted = wanted_permissions(settings)
    kube = await connect(settings)
    account = settings.operator_account
    try:
        granted = await reviews(kube, wanted)  # the first failure cancels the others
        for permission, ok in zip(wanted, granted, strict=True):
            print(f"{'ok  ' if ok else 'MISSING'} {permission}", file=out)
        gone = (
            account if account and granted[-1] and not await account_exists(kube, account) else None
        )
        blind = await would_see(settings, kube, out) if all(granted) else []
    except KubeError as failed:
        raise ConfigError(_unanswered(kube.host, failed)) from failed
    finally:
        await kube.close()
    missing = [p for p, ok in zip(wanted, granted, strict=True) if not ok]
    if gone:
        print(
            f"MISSING serviceaccount {gone[1]} in {gone[0]}: the admission policy "
            "judges the operator's writes by this account, and refuses nothing while it "
            "does not exist",
            file=out,
        )
    if missing:
        print(
            f"canaryd check: {len(missing)} of {len(wanted)} permissions missing on "
            f"{kube.host}: {', '.join(map(str, missing))}",
            file=out,
        )
        return 2
    granted_all = f"canaryd check: all {len(wanted)} permissions granted on {kube.host}"
    if gone:
        print(
            f"{granted_all}, but the operator's service account {'/'.join(gone)} does not exist",
            file=out,
        )
        return 2
    if blind:
        print(f"{granted_all}, but canaryd would be blind: {'; '.join(blind)}", file=out)
        return 1
    print(granted_all, file=out)
    return 0


async def would_see(settings: Settings, kube: KubeClient, out: TextIO) -> list[str]:
    """What the daemon would meet, a line each: the wanted kinds served, the watched
    namespaces there, the canaries it would check (per namespace) and, with
    operator-metrics, the operator's metrics answering with their series. Returns what
    would make it blind, each as its canaryd_blind reason with the line."""
    blind: list[str] = []

    def say(reason: str | None, line: str) -> None:
        print(f"{'BLIND' if reason else 'ok  '} {line}", file=out)
        if reason is not None:
            blind.append(f"{reason}: {line}")

    served: list[Kind] = []
    for key in settings.kinds:
        if await not_served(kube, kind_of(key)) is None:
            say(None, f"kind {key} is served")
            served.append(kind_of(key))
        else:
            say("kind_not_served", f"kind {key} is not served (its CRD is not installed)")
    scopes: Sequence[str | None] = [None]
    if settings.namespaces is not None:
        listed, _, _ = await list_all(kube, NAMESPACES_PATH, {}, settings.list_timeout)
        there = {str((item.get("metadata") or {}).get("name")) for item in listed}
        for watched in sorted(settings.namespaces):
            exists = watched in there
            line = f"namespace {watched} {'exists' if exists else 'does not exist'}"
            say(None if exists else "namespace_missing", line)
        scopes = sorted(settings.namespaces & there)
    canaries: list[tuple[Kind, str, str]] = []
    for kind in served:
        for namespace in scopes:
            try:
                items, _, _ = await list_all(
                    kube,
                    kind.collection_path(namespace),
                    {"labelSelector": settings.label},
                    settings.list_timeout,
                )
            except KubeError as err:
                if err.kind is not ErrorKind.FORBIDDEN and err.status != 401:
                    raise
                reason = "unauthorized" if err.status == 401 else "list_forbidden"
                say(reason, f"list {kind.plural} in {namespace or 'all namespaces'}: {err}")
                continue
            for item in items:
                metadata = item.get("metadata") or {}
                if is_canary(item, settings.label):
                    where, name = str(metadata.get("namespace")), str(metadata.get("name"))
                    canaries.append((kind, where, name))
    per_namespace = Counter(namespace for _, namespace, _ in canaries)
    for where in sorted({*per_namespace, *(scope for scope in scopes if scope)}):
        count = per_namespace[where]
        print(f"{'ok  ' if count else 'warn'} {count} canaries in {where}", file=out)
    if not canaries:
        inside = (
            "any namespace"
            if settings.namespaces is None
            else ", ".join(map(str, scopes)) or "the watched namespaces: none exist"
        )
        say("no_canaries", f"no canary labelled {settings.label}=true in {inside}")
    if settings.reconciled_by == "operator-metrics":
        await _operator_series(settings, canaries, say)
    return blind


async def _operator_series(
    settings: Settings,
    canaries: list[tuple[Kind, str, str]],
    say: Callable[[str | None, str], None],
) -> None:
    """The operator's metrics answer, from the operator's reporter, with each canary's
    count of finished reconciles (--reconciled-by operator-metrics)."""
    url = settings.operator_metrics_url
    operator = OperatorMetrics(
        url, connect_timeout=settings.scrape_connect_timeout, read_timeout=settings.timeout
    )
    try:
        scrape = await operator.scrape()
    except ScrapeFailed as err:
        say("operator_metrics_unreachable", f"the operator's metrics: {err}")
        return
    finally:
        await operator.close()
    if not scrape.has_operator_series:
        say("operator_metrics_no_series", f"{url} answered without the operator's metrics")
        return
    missing = [
        f"{kind.plural}/{namespace}/{name}"
        for kind, namespace, name in canaries
        if scrape.count((kind.kind, namespace, name)) is None
    ]
    seen = f"{url} has the series of {len(canaries) - len(missing)} of {len(canaries)} canaries"
    if missing:
        say("operator_metrics_no_series", f"{seen}, not of {', '.join(missing[:10])}")
    else:
        say(None, seen)


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
        settings = load_settings(argv, os.environ, "canaryd check")
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
