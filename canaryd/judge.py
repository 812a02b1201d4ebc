"""The judge: what a canary's pending bump amounts to, as a value (docs/DEVELOPMENT.md).

Two pure functions, one per reconcile signal (``by_watch``, ``by_operator``), change
nothing; the scheduler acts on what they return: a verdict (``Unhealthy``: only a bump
written and not reconciled in time), ``NoVerdict``, not yet (``Defer``: the watch is
behind; ``Recheck``: the judge ran late; ``Suspect``: canaryd's own connection may be
dead; ``Wait``: the operator's answer has not come), or None: no bump to judge.
"""

from __future__ import annotations

from dataclasses import dataclass

from canaryd.config import Settings
from canaryd.opmetrics import RECONCILED_SUFFIX, ResourceKey, Scrape, ScrapeFailed, reporter_label
from canaryd.registry import Canary
from canaryd.sync import ScopeKey, ScopeSync


@dataclass(frozen=True, slots=True)
class Healthy:
    reason: str


@dataclass(frozen=True, slots=True)
class Unhealthy:
    reason: str
    cause: str  # its class, a metric label (not_observed, not_reconciled, ...)


@dataclass(frozen=True, slots=True)
class NoVerdict:
    reason: str
    counted: str  # the canaryd_verdicts_total label
    fresh: bool = False
    """Start the canary afresh (``pending``, no verdict kept): it was about something
    that is gone (an operator process)."""
    missing_series: str | None = None  # the operator's metrics lack it (warned once)


@dataclass(frozen=True, slots=True)
class Defer:
    until: float  # judged by then whatever the watch does (a cycle past the deadline)
    why: str
    first: bool  # the first deferral of this bump (counted and logged once)
    at: float | None = None  # when to judge again, if sooner (the watch resumed)


@dataclass(frozen=True, slots=True)
class Recheck:
    at: float


@dataclass(frozen=True, slots=True)
class Suspect:
    why: str


@dataclass(frozen=True, slots=True)
class Wait:
    """The operator's answer has not come (less than a cycle past the deadline)."""


Judgement = Healthy | Unhealthy | NoVerdict | Defer | Recheck | Suspect | Wait | None


def scope_name(scope: ScopeKey) -> str:
    kind, namespace = scope
    return f"{kind}@{namespace}" if namespace else kind


def api_server_away(
    canary: Canary, sync: ScopeSync | None, answered_since: float, now: float
) -> str | None:
    """Why nothing could have been reconciled through the API server, if so: it answered
    no request sent since the canary's watch fell out of sync, or stopped answering since
    (``answered_since``: KubeClient.answered_since)."""
    since = sync.unsynced_since if sync is not None else None
    if since is None or answered_since >= since:
        return None
    scope = scope_name((canary.key.kind, canary.key.namespace))
    return (
        f"the API server is not answering: no request sent since the watch of {scope} "
        f"fell out of sync {now - since:.1f}s ago was answered, or the latest one was not"
    )


def by_watch(
    canary: Canary,
    sync: ScopeSync | None,
    now: float,
    settings: Settings,
    *,
    late: bool,
    api_last_answer: float,
) -> Judgement:
    """Healthy if the watch saw the bumped generation (``observed-generation``: status.
    observedGeneration reached it) by the deadline, else unhealthy, unless canaryd's own
    delay may be why: its watch is not in sync or suspected (the verdict waits for it, a
    cycle at most), or this judge runs ``late`` (events may sit unread in its sockets:
    re-checked once, ``judge_slack`` later)."""
    bumped = canary.bumped_generation
    if bumped is None:
        return None
    by_status = settings.reconciled_by == "observed-generation"
    reached = (canary.status_observed or 0) if by_status else canary.generation
    if reached >= bumped:
        return Healthy(
            f"status.observedGeneration {reached} reached generation {bumped} in time"
            if by_status
            else f"generation {bumped} observed in time"
        )
    scope = scope_name((canary.key.kind, canary.key.namespace))
    answered = canary.bump_answered_at
    until = canary.deferred_until
    if until is None:  # its first deferral: judged a cycle past the deadline at the latest
        until = (canary.bump_deadline or now) + settings.timeout
    if (
        canary.deferred_until is None
        and sync is not None
        and sync.in_sync
        and answered is not None
        and answered < sync.resynced_at
        and now < sync.resynced_at + settings.resume_grace
    ):
        # The watch resumed after this bump was answered and may still be replaying what
        # it missed (over several reads): judged ``resume_grace`` after the resume.
        return Defer(
            until,
            f"the watch of {scope} resumed {now - sync.resynced_at:.2f}s ago",
            True,
            at=sync.resynced_at + settings.resume_grace,
        )
    if sync is None or sync.in_sync:
        if late and not canary.late_recheck:
            return Recheck(now + settings.judge_slack)
        if (
            sync is not None
            and answered is not None
            and canary.generation < bumped  # its own event not seen (any mode)
            and sync.silent_since(answered + settings.judge_slack)
        ):
            # Nothing on the scope since the bump was answered (or since a resumed
            # stream's first event), though the bump must deliver one: canaryd's own
            # connection may be half-open; a fresh stream tells. What came within the
            # judge's slack of the answer may be older events still in the pipe.
            since = "a bump" if answered >= sync.resynced_at else "the watch resumed"
            silent = now - max(sync.last_delivery, answered)
            return Suspect(f"nothing delivered in the {silent:.1f}s since {since}")
    if sync is not None and sync.unsynced_since is not None:
        if now < until:
            why = f"the watch of {scope} is not in sync: {sync.behind_because}"
            return Defer(until, why, canary.deferred_until is None)
        away = api_server_away(canary, sync, api_last_answer, now)
        if away is not None:
            # Nobody (the operator neither) can reconcile through an API server that is
            # away: that is no verdict on the canary.
            return NoVerdict(f"no verdict on generation {bumped}: {away}", "unreachable")
        return Unhealthy(
            f"generation {bumped} not observed: the watch of {scope} has not resumed "
            f"{now - sync.unsynced_since:.1f}s after {sync.behind_because} (one cycle past "
            "the deadline)",
            "watch_not_resumed",
        )
    return Unhealthy(
        f"status.observedGeneration did not reach generation {bumped} within "
        f"{settings.timeout:g}s (it is {canary.status_observed})"
        if by_status
        else f"generation {bumped} not observed within {settings.timeout:g}s (latest "
        f"observed {canary.generation})",
        "not_reconciled" if by_status else "not_observed",
    )


def reconciled_since_bump(
    canary: Canary, scrape: Scrape, resource: ResourceKey
) -> tuple[float | None, bool]:
    """The canary's count of finished reconciles now, and whether it rose above its
    bump's baseline."""
    value = scrape.count(resource)
    baseline = canary.reconcile_baseline
    if value is None or baseline is None:
        return value, False
    return value, value > (baseline[1] or 0.0)


def by_operator(
    canary: Canary,
    resource: ResourceKey,
    scrape: Scrape | None,
    failed: ScrapeFailed | None,
    now: float,
    settings: Settings,
    *,
    instance: int,
    last_answer_at: float | None,
    api_away: str | None,
) -> Judgement:
    """Reconciled when the operator's own count of finished reconciles of the canary
    rose after the bump was written (its baseline was read before it). What a failed
    read means: refused, the operator is starting or gone (no verdict, none kept);
    unanswered, nothing (``Wait``) until a whole cycle past the deadline, then a
    missed reconcile (a frozen JVM); anything else, no verdict."""
    bumped = canary.bumped_generation
    if bumped is None:
        return None
    if failed is not None:
        if failed.cause == "unanswered":
            if now < (canary.bump_deadline or now) + settings.timeout:
                return Wait()
            silent = (
                f"nothing since an answer {now - last_answer_at:.1f}s ago"
                if last_answer_at is not None
                else "nothing since canaryd started"
            )
            return Unhealthy(
                f"generation {bumped} not known reconciled: {failed}; the operator's metrics "
                f"have answered {silent}, a cycle past the deadline (a frozen operator?)",
                "operator_unanswered",
            )
        if failed.cause == "refused":
            # Nothing listens: the operator is starting, or gone (the kubelet sees that
            # itself). No verdict, and none kept: it was about that process.
            return NoVerdict(
                f"no verdict on generation {bumped}: {failed} (starting or gone)",
                "operator_unavailable",
                fresh=True,
            )
        return NoVerdict(f"no verdict on generation {bumped}: {failed}", "operator_unavailable")
    assert scrape is not None
    baseline = canary.reconcile_baseline
    if baseline is None:
        return NoVerdict(
            f"no verdict on generation {bumped}: the operator's metrics had not answered "
            "before it was written",
            "operator_unavailable",
            fresh=True,
        )
    if baseline[0] != instance:  # about an operator that is gone (normally seen sooner)
        return NoVerdict("operator restarted: re-checking", "operator_unavailable", fresh=True)
    value, rose = reconciled_since_bump(canary, scrape, resource)
    if value is None:
        kind, namespace, name = map(reporter_label, resource)
        series = (
            f'*{RECONCILED_SUFFIX}{{resourcetype="{kind}",resourcens="{namespace}",'
            f'resourcename="{name}"}}'
        )
        return NoVerdict(
            f"no verdict on generation {bumped}: the operator's metrics have no {series}",
            "operator_unavailable",
            missing_series=series if scrape.has_operator_series else None,
        )
    if rose:
        return Healthy(
            f"the operator reconciled generation {bumped} in time (finished reconciles "
            f"{baseline[1] or 0:g} -> {value:g})"
        )
    if api_away is not None:
        # The operator reconciles through the API server: with it away, nobody could.
        return NoVerdict(f"no verdict on generation {bumped}: {api_away}", "unreachable")
    return Unhealthy(
        f"the operator finished no reconcile within {settings.timeout:g}s of generation "
        f"{bumped} (finished reconciles stayed at {value:g})",
        "not_reconciled",
    )
