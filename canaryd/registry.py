"""The registry: what canaryd knows of each canary (its record, the readings of an
object's copy that every layer above shares), and the aggregate health, kept as states
change (O(1) for a probe). The watcher and the scheduler write it; the scheduler learns
what it must act on from ``take_news``: nothing here calls it (docs/DEVELOPMENT.md)."""

from __future__ import annotations

import asyncio
import enum
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import structlog

from canaryd import metrics
from canaryd.logs import wall_time
from canaryd.sync import ScopeKey, Scopes

INT64_MAX = 2**63 - 1


def is_canary(obj: Mapping[str, Any], label: str) -> bool:
    """The upstream test: the label's value equals ``true``, ignoring case."""
    metadata = obj.get("metadata")
    labels = metadata.get("labels") if isinstance(metadata, Mapping) else None
    value = labels.get(label) if isinstance(labels, Mapping) else None
    return isinstance(value, str) and value.lower() == "true"


def being_deleted(obj: Mapping[str, Any]) -> bool:
    """Its deletionTimestamp is set: a finalizer holds it, canaryd no longer checks it."""
    metadata = obj.get("metadata")
    return isinstance(metadata, Mapping) and bool(metadata.get("deletionTimestamp"))


def one_line(text: str) -> str:
    """A reason as one line (an API error's message may hold newlines)."""
    return " ".join(text.split())


class CanaryState(enum.Enum):
    PENDING = "pending"  # tracked, no bump judged yet
    HEALTHY = "healthy"  # the last bump was observed in time
    UNHEALTHY = "unhealthy"  # the last bump was written but not observed in time
    UNKNOWN = "unknown"  # the last bump could not be written: nothing to judge


class CanaryKey(NamedTuple):
    """A canary's identity. A tuple: hashed in C, several times per bump."""

    kind: str
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind}/{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The last unhealthy verdict: when (monotonic and wall clock) and why."""

    at: float
    wall_time: float
    reason: str


@dataclass(slots=True, eq=False)
class Canary:
    """One tracked canary: identity, the latest copy's few fields, and its health."""

    key: CanaryKey
    uid: str
    resource_version: str
    generation: int  # the latest seen through the watch: what "reconciled" is judged on
    nonce: int  # spec.restartNonce of the latest copy (0: absent or not a valid integer)
    nonce_problem: str | None = None  # why spec.restartNonce is not usable (a bump repairs it)
    state: CanaryState = CanaryState.PENDING
    reason: str = "waiting for the first bump to be judged"
    cause: str = "first_bump"  # the reason's class: a metric label (docs/OPERATIONS.md)
    bumped_generation: int | None = None  # what our last bump produced, until judged
    last_bumped_generation: int | None = None  # the same, judged or not (for display)
    judged_generation: int | None = None  # what the last verdict (the reason) was about
    bump_deadline: float | None = None  # monotonic time at which that bump is judged
    last_bump_at: float | None = None  # wall-clock time of the last successful bump
    deferred_until: float | None = None  # the verdict waits for the watch to resume until
    late_recheck: bool = False  # an unhealthy verdict by a late judge waits for a re-check
    status_observed: int | None = None  # status.observedGeneration as the watch delivered it
    generation_seen_at: float = 0.0  # monotonic time the watch delivered a higher generation
    bump_sent_at: float | None = None  # monotonic time the last bump's PATCH was sent
    bump_answered_at: float | None = None
    """Scheduler-clock time that bump was answered: its scope's stream must deliver
    something after it, or canaryd suspects its own connection (canaryd.sync)."""
    stages: dict[str, float] = field(default_factory=dict)  # that bump's seconds to each stage
    verdict: Verdict | None = None  # the last unhealthy one, while it may stand (no_verdict)
    reconcile_baseline: tuple[int, float | None] | None = None
    """--reconciled-by operator-metrics: (operator instance, its count of finished
    reconciles of this canary or None) read before the pending bump was sent."""
    warned: bool = False  # a Warning Event told, no Recovered since (scheduler.Role)
    realign: bool = False  # checked afresh off its place in the cycle (operator restart)


def read_nonce(obj: Mapping[str, Any]) -> tuple[int, str | None]:
    """spec.restartNonce as the bump base, and what is wrong with it if anything."""
    spec = obj.get("spec")
    if spec is not None and not isinstance(spec, Mapping):
        return 0, f"spec is a {type(spec).__name__}, not an object"
    value = None if spec is None else spec.get("restartNonce")
    if value is None:
        return 0, None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return 0, f"spec.restartNonce is {value!r}, not an integer"
    if value == INT64_MAX:
        return 0, f"spec.restartNonce {value} is the largest 64-bit integer; it cannot grow"
    if not -INT64_MAX - 1 <= value < INT64_MAX:
        return 0, f"spec.restartNonce {value} does not fit in a 64-bit integer"
    return value, None


def _integer(value: Any) -> int | None:
    """An integer field's value (metadata.generation, status.observedGeneration), or None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


log = structlog.get_logger("canaryd.registry")


def _key_of(kind: str, obj: Mapping[str, Any]) -> CanaryKey | None:
    """The canary a copy is of; None (counted, warned) when it names none."""
    metadata = obj.get("metadata")
    if isinstance(metadata, Mapping):
        name, namespace = metadata.get("name"), metadata.get("namespace")
        if isinstance(name, str) and isinstance(namespace, str):
            return CanaryKey(kind, namespace, name)
    metrics.ERRORS.labels("malformed_object").inc()
    named = isinstance(metadata, Mapping)
    log.warning("object_without_name" if named else "object_without_metadata", kind=kind)
    return None


def _stage(canary: Canary, stage: str, seconds: float) -> None:
    """The last written bump reached ``stage``, ``seconds`` after it was sent (once)."""
    if stage not in canary.stages:
        canary.stages[stage] = seconds
        metrics.BUMP_DURATION.labels(canary.key.kind, stage).observe(seconds)


def _stages_reached(canary: Canary) -> None:
    """Record the last bump's stages its copy now shows."""
    bumped, sent = canary.last_bumped_generation, canary.bump_sent_at
    if bumped is None or sent is None:
        return
    if canary.generation >= bumped:
        _stage(canary, "observed", max(0.0, canary.generation_seen_at - sent))
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
    canary's state goes through one of the named transitions below."""

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
        """The pending bump is judged (or will never be): nothing waits for it, and its
        baseline is spent (the next bump reads its own)."""
        if canary.bumped_generation is not None:
            canary.judged_generation = canary.bumped_generation
        canary.bumped_generation = None
        canary.deferred_until = None
        canary.late_recheck = False
        canary.reconcile_baseline = None

    def judged(
        self, canary: Canary, state: CanaryState, reason: str, cause: str, now: float
    ) -> None:
        """A verdict on the pending bump: ``healthy``, or ``unhealthy`` (the one way to
        become unhealthy; the verdict is kept so that it can age, see ``no_verdict``). Or
        ``pending``, a fresh check: what was found so far is about something that no
        longer exists (the operator instance that was checked), so no verdict stands until
        a bump written from now on is judged."""
        if not self.owns(canary):
            return
        self._judged(canary)
        canary.verdict = (
            Verdict(now, time.time(), one_line(reason)) if state is CanaryState.UNHEALTHY else None
        )
        self.set_state(canary, state, reason, cause)

    def update(self, canary: Canary, **fields: object) -> None:
        """Fields that change no state (a verdict that waits, the operator's count read
        before the next bump): set while the record is the tracked one."""
        if self.owns(canary):
            for name, value in fields.items():
                setattr(canary, name, value)
            self._changed()

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

    def reconciled_seen(self, canary: Canary, at: float) -> None:
        """The reconcile signal reached the last bump by ``at`` (monotonic)."""
        if self.owns(canary) and canary.bump_sent_at is not None:
            _stage(canary, "reconciled", max(0.0, at - canary.bump_sent_at))

    def observe(self, kind: str, obj: Mapping[str, Any]) -> CanaryKey | None:
        """A copy from a list or an ADDED/MODIFIED event; returns the canary it is of."""
        key = _key_of(kind, obj)
        if key is None:
            return None
        metadata: Mapping[str, Any] = obj["metadata"]
        uid, generation = str(metadata.get("uid") or ""), _integer(metadata.get("generation")) or 0
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
        if existing is None or existing.uid != uid:
            if existing is not None:
                self.forget(key, "replaced", "a new object of the same name replaced it")
            existing = self._canaries[key] = Canary(key, uid, "", generation, 0)
            self._counts[existing.state] += 1
            log.info("canary_tracked", canary=str(key), generation=generation)
            self._tell(Added(existing))
        elif generation > existing.generation:
            existing.generation_seen_at = time.monotonic()
        status = obj.get("status")
        observed = status.get("observedGeneration") if isinstance(status, Mapping) else None
        existing.generation, existing.status_observed = generation, _integer(observed)
        self.refresh(existing, obj)
        if existing.nonce_problem is not None:
            log.warning(
                "canary_malformed",
                canary=str(key),
                problem=existing.nonce_problem,
                action="the next bump writes a valid nonce",
            )
        _stages_reached(existing)
        self._changed()
        return key

    def _why_not(self, namespace: str, obj: Mapping[str, Any]) -> tuple[str, str] | None:
        """Why a copy is not (or no longer) a canary canaryd tracks: (cause, detail)."""
        if namespace in self.closed:
            return "namespace_closed", "its namespace is being deleted"
        if not is_canary(obj, self.label):
            return "not_canary", f"label {self.label} is no longer true"
        if being_deleted(obj):
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
        _stages_reached(canary)
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
