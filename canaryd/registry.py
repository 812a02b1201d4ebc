"""The registry: what canaryd knows of each canary, and the aggregate health.

Only the watcher (what the API server says) and the scheduler (the results of its own
writes) change it; the health server reads it. The scheduler learns what it must act on
from ``take_news``: nothing here calls it. Counts by state are kept as states change, so
``healthy`` is O(1) however many canaries there are.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from canaryd import metrics
from canaryd.canary import (
    INT64_MAX,
    Canary,
    CanaryKey,
    CanaryState,
    Verdict,
    generation_of,
    is_canary,
    one_line,
    read_nonce,
    status_observed_generation,
)
from canaryd.logs import wall_time
from canaryd.sync import ScopeKey, Scopes

__all__ = [
    "INT64_MAX",
    "Added",
    "Canary",
    "CanaryKey",
    "CanaryState",
    "Forgotten",
    "News",
    "Registry",
    "Resumed",
    "is_canary",
    "one_line",
    "read_nonce",
]

log = structlog.get_logger("canaryd.registry")


def _key_of(kind: str, obj: Mapping[str, Any]) -> CanaryKey | None:
    """The canary a copy is of; None (counted, warned) when it names none."""
    metadata = obj.get("metadata")
    if not isinstance(metadata, Mapping):
        metrics.ERRORS.labels("malformed_object").inc()
        log.warning("object_without_metadata", kind=kind)
        return None
    name, namespace = metadata.get("name"), metadata.get("namespace")
    if not isinstance(name, str) or not isinstance(namespace, str):
        metrics.ERRORS.labels("malformed_object").inc()
        log.warning("object_without_name", kind=kind)
        return None
    return CanaryKey(kind, namespace, name)


def _stage(canary: Canary, stage: str, seconds: float) -> None:
    """The last written bump reached ``stage``, ``seconds`` after it was sent (once)."""
    if stage not in canary.stages:
        canary.stages[stage] = seconds
        metrics.bump_stage(canary.key.kind, stage, seconds)


def _stages_reached(canary: Canary, observed_at: float) -> None:
    """Record the last bump's stages its copy now shows."""
    bumped, sent = canary.last_bumped_generation, canary.bump_sent_at
    if bumped is None or sent is None:
        return
    if canary.generation >= bumped:
        _stage(canary, "observed", max(0.0, observed_at - sent))
    if (canary.status_observed or 0) >= bumped:
        _stage(canary, "reconciled", max(0.0, time.monotonic() - sent))


@dataclass(frozen=True, slots=True)
class Added:
    canary: Canary  # started being tracked: its first bump is to be scheduled


@dataclass(frozen=True, slots=True)
class Forgotten:
    key: CanaryKey  # no longer tracked: nothing of it is to be kept


@dataclass(frozen=True, slots=True)
class Resumed:
    scope: ScopeKey  # in sync again: what waited for it can be judged


News = Added | Forgotten | Resumed


class Registry:
    """What canaryd knows of each canary, and the only writer of it: every change of a
    canary's state goes through one of the transitions below (observed, bumped,
    deferred, rechecking, judged, no_verdict, fresh_check, standing_by, forgotten)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._canaries: dict[CanaryKey, Canary] = {}
        self._counts: Counter[CanaryState] = Counter()
        self.closed: set[str] = set()  # being deleted (the watcher keeps it): not tracked
        self.ignored: set[str] = set()  # closed ones a copy was ignored in: relisted at open
        self.scopes = Scopes()  # where each canary watch scope stands: the watcher writes it
        self.pending: list[News] = []  # not taken yet (take_news), oldest first
        self.news = asyncio.Event()  # set while news waits: the scheduler's loop waits for it
        self.listeners: list[Callable[[], None]] = []  # called after every change

    def __len__(self) -> int:
        return len(self._canaries)

    def get(self, key: CanaryKey) -> Canary | None:
        return self._canaries.get(key)

    def owns(self, canary: Canary) -> bool:
        """Is this record still the tracked one (not dropped, not replaced)?"""
        return self._canaries.get(canary.key) is canary

    @property
    def healthy(self) -> bool:
        return self._counts[CanaryState.UNHEALTHY] == 0

    def counts(self) -> dict[str, int]:
        return {state.value: self._counts[state] for state in CanaryState}

    def tracked(self) -> list[Canary]:
        """Every tracked canary, in no particular order (cheaper than ``canaries``)."""
        return list(self._canaries.values())

    def canaries(self) -> list[Canary]:
        return [
            self._canaries[key]
            for key in sorted(self._canaries, key=lambda k: (k.namespace, k.kind, k.name))
        ]

    def take_news(self) -> list[News]:
        """What changed in what is tracked since the last call, in order."""
        news, self.pending = self.pending, []
        self.news.clear()
        return news

    def _tell(self, news: News) -> None:
        self.pending.append(news)
        self.news.set()

    def scope_resumed(self, scope: ScopeKey) -> None:
        """The watcher: this scope's stream delivers again after a time out of sync."""
        self._tell(Resumed(scope))

    def _changed(self) -> None:
        for listener in self.listeners:
            listener()

    def set_state(self, canary: Canary, state: CanaryState, reason: str, cause: str) -> None:
        if not self.owns(canary):
            return
        reason = one_line(reason)
        if canary.state is not state:
            self._counts[canary.state] -= 1
            self._counts[state] += 1
            # Verdicts an operator acts on are info; the rest (pending, unknown while the
            # API server is away: every canary at once) are detail.
            verdict = CanaryState.UNHEALTHY in (state, canary.state)
            (log.info if verdict else log.debug)(
                "canary_state",
                canary=str(canary.key),
                state=state.value,
                previous=canary.state.value,
                reason=reason,
                cause=cause,
            )
        canary.state, canary.reason, canary.cause = state, reason, cause
        self._changed()

    def _judged(self, canary: Canary) -> None:
        """The pending bump is judged (or will never be): nothing waits for it."""
        if canary.bumped_generation is not None:
            canary.judged_generation = canary.bumped_generation
        canary.bumped_generation = None
        canary.deferred_until = None
        canary.late_recheck = False

    def judged(
        self, canary: Canary, state: CanaryState, reason: str, cause: str, now: float
    ) -> None:
        """A verdict on the pending bump: ``healthy``, or ``unhealthy`` (the one way to
        become unhealthy; the verdict is kept so that it can age, see ``no_verdict``)."""
        if not self.owns(canary):
            return
        assert state in (CanaryState.HEALTHY, CanaryState.UNHEALTHY), state
        self._judged(canary)
        canary.verdict = (
            Verdict(now, time.time(), one_line(reason)) if state is CanaryState.UNHEALTHY else None
        )
        self.set_state(canary, state, reason, cause)

    def deferred(self, canary: Canary, until: float) -> None:
        """The verdict on the pending bump waits for its watch to resume, until ``until``
        at the latest."""
        if self.owns(canary):
            canary.deferred_until = until
            self._changed()

    def rechecking(self, canary: Canary) -> None:
        """The judge ran late (canaryd stalled): the pending bump is judged once more."""
        if self.owns(canary):
            canary.late_recheck = True

    def standing_by(self, canary: Canary, reason: str | None) -> None:
        """This replica stopped writing (a follower): no bump waits for a verdict; with a
        ``reason``, the canary is ``pending`` (another replica's verdicts count), without
        one its verdict is kept (a lease hiccup: nobody else checked since)."""
        if not self.owns(canary):
            return
        canary.bumped_generation = None  # not judged: no verdict of this replica's on it
        self._judged(canary)
        if reason is not None:
            self.set_state(canary, CanaryState.PENDING, reason, "standby")

    def no_verdict(
        self, canary: Canary, reason: str, cause: str, now: float, verdict_ttl: float
    ) -> None:
        """No bump to judge this cycle (not written, or what would judge it not read): no
        verdict either way, so ``unknown`` replaces only ``pending`` or ``healthy``. But an
        ``unhealthy`` verdict no bump has re-tested for ``verdict_ttl`` (bumps failing for
        good) turns ``unknown``: it must not restart the operator forever."""
        if not self.owns(canary):
            return
        self._judged(canary)
        canary.reconcile_baseline = None
        verdict = canary.verdict
        if canary.state is not CanaryState.UNHEALTHY or verdict is None:
            self.set_state(canary, CanaryState.UNKNOWN, reason, cause)
        elif now - verdict.at < verdict_ttl:
            why = f"{verdict.reason}; since then: {reason}"
            self.set_state(canary, CanaryState.UNHEALTHY, why, canary.cause)
        else:
            at = wall_time(verdict.wall_time)
            self.set_state(
                canary,
                CanaryState.UNKNOWN,
                f"unhealthy at {at} ({verdict.reason}); no bump written since: {reason}",
                "verdict_expired",
            )

    def fresh_check(self, canary: Canary, reason: str, cause: str) -> None:
        """What was found so far is about something that no longer exists (the operator
        instance that was checked): no bump waits for a verdict, no verdict stands, and
        the canary is ``pending`` until a bump written from now on is judged."""
        if not self.owns(canary):
            return
        self._judged(canary)
        canary.reconcile_baseline = None
        canary.verdict = None
        self.set_state(canary, CanaryState.PENDING, reason, cause)

    def baseline(self, canary: Canary, baseline: tuple[int, float | None] | None) -> None:
        """The operator's reconcile count read before the next bump (operator-metrics)."""
        if self.owns(canary):
            canary.reconcile_baseline = baseline

    def reconciled_seen(self, canary: Canary, seconds: float) -> None:
        """The reconcile signal reached the last bump, ``seconds`` after it was sent."""
        if self.owns(canary):
            _stage(canary, "reconciled", seconds)

    def observe(self, kind: str, obj: Mapping[str, Any]) -> CanaryKey | None:
        """A copy from a list or an ADDED/MODIFIED event; returns the canary it is of."""
        key = _key_of(kind, obj)
        if key is None:
            return None
        metadata: Mapping[str, Any] = obj["metadata"]
        uid, generation = str(metadata.get("uid") or ""), generation_of(metadata)
        existing = self._canaries.get(key)
        if existing is not None and existing.uid == uid and generation < existing.generation:
            # An older copy of the same object (a relist racing a bump, a replaying
            # proxy): generation never goes backwards within one uid.
            metrics.ERRORS.labels("stale_copy").inc()
            log.debug("stale_copy_ignored", canary=str(key), generation=generation)
            return key
        why_not = self._why_not(key.namespace, obj)
        if why_not is not None:
            if why_not[0] == "namespace_closed":
                self.ignored.add(key.namespace)
            self.forget(key, *why_not)
            return key
        nonce, problem = read_nonce(obj)
        if problem is not None:
            log.warning(
                "canary_malformed",
                canary=str(key),
                problem=problem,
                action="the next bump writes a valid nonce",
            )
        if existing is not None and existing.uid != uid:
            self.forget(key, "replaced", "a new object of the same name replaced it")
            existing = None
        rv, observed = str(metadata.get("resourceVersion") or ""), status_observed_generation(obj)
        if existing is None:
            canary = Canary(key, uid, rv, generation, nonce, problem, status_observed=observed)
            self._canaries[key] = canary
            self._counts[canary.state] += 1
            log.info("canary_tracked", canary=str(key), generation=generation)
            self._tell(Added(canary))
        else:
            if generation > existing.generation:
                existing.generation_seen_at = time.monotonic()
            existing.generation, existing.status_observed = generation, observed
            self.refresh(existing, obj)
            if existing.bump_sent_at is not None:
                _stages_reached(existing, existing.generation_seen_at)
        self._changed()
        return key

    def _why_not(self, namespace: str, obj: Mapping[str, Any]) -> tuple[str, str] | None:
        """Why a copy is not (or no longer) a canary canaryd tracks: (cause, detail)."""
        if namespace in self.closed:
            return "namespace_closed", "its namespace is being deleted"
        if not is_canary(obj, self.label):
            return "not_canary", f"label {self.label} is no longer true"
        if (obj.get("metadata") or {}).get("deletionTimestamp"):
            return "being_deleted", "deletionTimestamp is set"
        return None

    def reread(self, canary: Canary, obj: Mapping[str, Any]) -> str | None:
        """A fresh copy the scheduler read (after a 409 or a 404). None: still the canary
        it owns, refreshed; else the drop's cause. A new object of the same name that is
        a canary is tracked at once (no watch event may ever announce it)."""
        if not self.owns(canary):
            return "replaced"
        metadata = obj.get("metadata")
        uid = str(metadata.get("uid") or "") if isinstance(metadata, Mapping) else ""
        if uid != canary.uid:
            self.forget(canary.key, "replaced", "a new object of the same name replaced it")
            self.observe(canary.key.kind, obj)
            return "replaced"
        why_not = self._why_not(canary.key.namespace, obj)
        if why_not is not None:
            self.forget(canary.key, *why_not)
            return why_not[0]
        self.refresh(canary, obj)
        return None

    def refresh(self, canary: Canary, obj: Mapping[str, Any]) -> None:
        """A copy the scheduler read or wrote: resourceVersion and nonce, never generation
        (the generation observed comes only from the watch, the path canaryd checks)."""
        metadata = obj.get("metadata") or {}
        canary.resource_version = str(metadata.get("resourceVersion") or "")
        canary.nonce, canary.nonce_problem = read_nonce(obj)

    def bumped(
        self,
        canary: Canary,
        generation: int,
        sent_at: float,
        answered_at: float,
        deadline: float,
        wall_time: float,
    ) -> None:
        """Our bump, sent at ``sent_at``, was answered at ``answered_at`` and produced
        ``generation``; judge it at ``deadline``. Its scope's stream owes the change
        (canaryd.sync). Its stages are measured from ``sent_at``."""
        if not self.owns(canary):
            return
        canary.bump_sent_at = sent_at
        canary.stages = {}
        _stage(canary, "answered", max(0.0, answered_at - sent_at))
        canary.bump_answered_at = answered_at
        canary.deferred_until = None
        canary.bumped_generation = generation
        canary.last_bumped_generation = generation
        canary.bump_deadline = deadline
        canary.last_bump_at = wall_time
        # The watch can deliver the bump's event before its answer arrives.
        _stages_reached(canary, canary.generation_seen_at)
        self._changed()

    def forget(
        self, key: CanaryKey, cause: str, detail: str = "", *, announce: bool = True
    ) -> None:
        """Stop tracking a canary. ``cause`` is a short fixed word (a metric label),
        ``detail`` says why in the log. ``announce=False``: dropped now, told later
        (``announce_drop``) once the cause is known."""
        canary = self._canaries.pop(key, None)
        if canary is None:
            return
        self._counts[canary.state] -= 1
        if announce:
            self.announce_drop(key, cause, detail)
        self._tell(Forgotten(key))
        self._changed()

    def announce_drop(self, key: CanaryKey, cause: str, detail: str = "") -> None:
        """Log and count a drop (listeners hear of it: a told drop is news too)."""
        metrics.DROPPED.labels(cause).inc()
        log.info("canary_dropped", canary=str(key), cause=cause, reason=detail or cause)
        self._changed()

    def forget_where(
        self, predicate: Callable[[CanaryKey], bool], cause: str, detail: str = ""
    ) -> None:
        for key in [key for key in self._canaries if predicate(key)]:
            self.forget(key, cause, detail)

    def replace_scope(
        self, kind: str, namespace: str | None, objects: Iterable[Mapping[str, Any]]
    ) -> None:
        """A full list of one watch scope: observe each, drop what the list lacks."""
        seen = {self.observe(kind, obj) for obj in objects}
        self.forget_where(
            lambda key: (
                key.kind == kind
                and (namespace is None or key.namespace == namespace)
                and key not in seen
            ),
            "relisted",
            "missing from a new list",
        )
