"""``canaryd check``: the pre-flight check. The configuration parsed as the daemon parses
it, the API server reached with the same credentials, and asked with
SelfSubjectAccessReviews (authorization.k8s.io/v1) whether canaryd may do what it will
do: list, watch and patch each wanted kind in each watched namespace (or cluster-wide
when all are watched), list and watch namespaces, and, under ``--leader-elect``, get,
create and update its Lease; with ``--operator-account``, get that service account,
and whether it exists (the admission policy names it: one for an account that does
not exist refuses nothing). One line per permission; exit 0 when every one is
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
from canaryd.kube import KubeError, failure_cause


async def check(settings: Settings, out: TextIO) -> int:
    """Print one line per finding; the exit status: 0 all granted, 2 something missing."""
    if settings.operator_config is not None:
        read, nested = nested_operator_keys(settings.operator_config)
        for key in nested:
            print(f"warn {key} is nested in {read}: {nested_keys_why(read)}", file=out)
    wanted = wanted_permissions(settings)
    kube = await connect(settings)
    account = settings.operator_account
    try:
        granted = await reviews(kube, wanted)  # the first failure cancels the others
        gone = (
            account if account and granted[-1] and not await account_exists(kube, account) else None
        )
    except KubeError as failed:
        raise ConfigError(_unanswered(kube.host, failed)) from failed
    finally:
        await kube.close()
    missing = [p for p, ok in zip(wanted, granted, strict=True) if not ok]
    for permission, ok in zip(wanted, granted, strict=True):
        print(f"{'ok  ' if ok else 'MISSING'} {permission}", file=out)
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
    if gone:
        print(
            f"canaryd check: all {len(wanted)} permissions granted on {kube.host}, but the "
            f"operator's service account {'/'.join(gone)} does not exist",
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
