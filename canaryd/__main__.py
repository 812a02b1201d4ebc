"""``canaryd`` (``python -m canaryd``): the daemon; ``canaryd check [FLAGS]``: what canaryd
may do and would meet, with its exit codes as docs/OPERATIONS.md says."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import structlog

from canaryd import logs
from canaryd.access import account_exists, reviews, wanted_permissions
from canaryd.config import ConfigError, Settings, load_settings
from canaryd.config.parse import nested_keys_why, read_operator_config
from canaryd.daemon import Daemon
from canaryd.kube import (
    NAMESPACES_PATH,
    ErrorKind,
    Kind,
    KubeClient,
    KubeError,
    connect,
    failure_cause,
    kind_of,
)
from canaryd.leader import lease_timings_problem
from canaryd.listwatch import list_all, not_served
from canaryd.opmetrics import OperatorMetrics, ScrapeFailed
from canaryd.registry import being_deleted, is_canary

try:  # less CPU per request and watch event than asyncio's own loop
    from uvloop import run
except ImportError:
    from asyncio import run  # type: ignore[assignment]

log = structlog.get_logger("canaryd")


def main(argv: Sequence[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    checking = args[:1] == ["check"]
    try:
        prog = "canaryd check" if checking else "canaryd"
        settings = load_settings(args[1:] if checking else args, os.environ, prog)
        if problem := lease_timings_problem(settings):
            raise ConfigError(problem)
        if checking:
            # The check speaks on stdout; the client's own logs only when something is wrong.
            logs.configure(settings.log_format, "error")
            sys.exit(asyncio.run(check(settings, sys.stdout)))
        logs.configure(settings.log_format, settings.log_level)
        if settings.timeout < 1.0:
            log.warning(
                "short_cycle",
                timeout=settings.timeout,
                detail="a cycle below 1 s is for tests; the operator's default is 1 min",
            )
        run(Daemon(settings).run())
    except ConfigError as err:
        sys.stdout.flush()
        print(f"canaryd: {err}", file=sys.stderr)
        sys.exit(2)
    except Exception:  # an ExceptionGroup from the TaskGroup: a bug, logged
        log.exception("canaryd_failed")
        sys.exit(1)
    sys.exit(0)


async def check(settings: Settings, out: TextIO) -> int:
    blind: list[str] = []  # each BLIND line as "reason: line"

    def say(line: str, reason: str | None = None, word: str = "ok") -> None:
        """A finding: its line, its ``canaryd_blind`` reason (a BLIND line), else its word."""
        print(f"{'BLIND' if reason else word:<4} {line}", file=out)
        if reason is not None:
            blind.append(f"{reason}: {line}")

    if settings.operator_config is not None:
        read = read_operator_config(settings.operator_config)
        for key in read.nested:
            say(f"{key} is nested in {read.file}: {nested_keys_why(read.file)}", word="warn")
    wanted, account = wanted_permissions(settings), settings.operator_account
    kube = await connect(settings)
    try:
        granted = await reviews(kube, wanted)
        for permission, ok in zip(wanted, granted, strict=True):
            say(str(permission), word="ok" if ok else "MISSING")
        gone = account and granted[-1] and not await account_exists(kube, account)
        if all(granted):
            await would_see(settings, kube, say)
    except KubeError as err:
        raise ConfigError(unanswered(kube.host, err)) from err
    finally:
        await kube.close()
    missing = [str(p) for p, ok in zip(wanted, granted, strict=True) if not ok]
    summary = f"all {len(wanted)} permissions granted on {kube.host}"
    if gone and account:
        what = f"serviceaccount {account[1]} in {account[0]}: the admission policy judges the"
        why = "operator's writes by this account, and refuses nothing while it does not exist"
        say(f"{what} {why}", word="MISSING")
        summary += f", but the operator's service account {'/'.join(account)} does not exist"
    elif blind:
        summary += f", but canaryd would be blind: {'; '.join(blind)}"
    if missing:
        summary = f"{len(missing)} of {len(wanted)} permissions missing on {kube.host}: "
        summary += ", ".join(missing)
    print(f"canaryd check: {summary}", file=out)
    return 2 if missing or gone else 1 if blind else 0


async def would_see(settings: Settings, kube: KubeClient, say: Callable[..., None]) -> None:
    """What the daemon would meet (docs/OPERATIONS.md lists each line)."""
    served: list[Kind] = []
    for kind in map(kind_of, settings.kinds):
        if await not_served(kube, kind) is None:
            say(f"kind {kind.key} is served")
            served.append(kind)
        else:
            say(f"kind {kind.key} is not served (its CRD is not installed)", "kind_not_served")
    scopes: Sequence[str | None] = [None]
    existing: list[str] = []  # the watched namespaces that exist
    if settings.namespaces is not None:
        listed, _, _ = await list_all(kube, NAMESPACES_PATH, {}, settings.list_timeout)
        there = {names(item)[1] for item in listed}
        for watched in sorted(settings.namespaces):
            if watched in there:
                say(f"namespace {watched} exists")
            else:
                say(f"namespace {watched} does not exist", "namespace_missing")
        scopes = existing = sorted(settings.namespaces & there)
    canaries: list[tuple[str, str, str, str]] = []  # (plural, Kind, namespace, name)
    for kind in served:
        for namespace in scopes:
            path, params = kind.collection_path(namespace), {"labelSelector": settings.label}
            try:
                items, _, _ = await list_all(kube, path, params, settings.list_timeout)
            except KubeError as err:
                if err.kind is not ErrorKind.FORBIDDEN and err.status != 401:
                    raise
                reason = "unauthorized" if err.status == 401 else "list_forbidden"
                say(f"list {kind.plural} in {namespace or 'all namespaces'}: {err}", reason)
                continue
            canaries += [
                (kind.plural, str(item.get("kind") or kind.kind), *names(item))
                for item in items
                if is_canary(item, settings.label) and not being_deleted(item)
            ]
    per_namespace = Counter(namespace for _, _, namespace, _ in canaries)
    for where in sorted({*per_namespace, *existing}):
        count = per_namespace[where]
        say(f"{count} canaries in {where}", word="ok" if count else "warn")
    if not canaries:
        inside = ", ".join(existing) or "the watched namespaces: none exist"
        if settings.namespaces is None:
            inside = "any namespace"
        say(f"no canary labelled {settings.label}=true in {inside}", "no_canaries")
    operator = OperatorMetrics.of(settings, time.monotonic)
    if operator is None:  # not --reconciled-by operator-metrics
        return
    try:
        scrape = await operator.scrape()
    except ScrapeFailed as err:
        say(f"the operator's metrics: {err}", "operator_metrics_unreachable")
        return
    finally:
        await operator.close()
    url = operator.url
    if not scrape.has_operator_series:
        say(f"{url} answered without the operator's metrics", "operator_metrics_no_series")
        return
    missing = [
        f"{plural}/{namespace}/{name}"
        for plural, kind, namespace, name in canaries
        if scrape.count((kind, namespace, name)) is None
    ]
    seen = f"{url} has the series of {len(canaries) - len(missing)} of {len(canaries)} canaries"
    if missing:
        say(f"{seen}, not of {', '.join(missing[:10])}", "operator_metrics_no_series")
    else:
        say(seen)


def names(item: Mapping[str, Any]) -> tuple[str, str]:
    metadata = item.get("metadata") or {}
    return str(metadata.get("namespace")), str(metadata.get("name"))


def unanswered(host: str, err: KubeError) -> str:
    """One line for an API server that did not answer, or refused what it had allowed."""
    cause, said = failure_cause(err), logs.scrub(str(err))
    if cause == "unauthorized":
        return f"the API server at {host} refused the credentials (401): {said}"
    if err.status is not None:
        return f"the API server at {host} answered {err.status}: {said}"
    return f"cannot reach the API server at {host} ({cause}): {said}"


if __name__ == "__main__":
    main()
