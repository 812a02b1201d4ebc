"""The scheduler: per canary, every cycle, judge the previous bump, then write the next
(docs/DEVELOPMENT.md, "How it works"); under operator-metrics it judges at the next read.

The invariant (``unscheduled``): while this replica bumps, every tracked canary has one
``Place``: due (its live heap entry), in flight (a bump task), or waiting for a read.
Every registry write after an ``await`` first checks ``Registry.owns``: a late answer
about a dropped canary changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Literal, NamedTuple

import structlog

from canaryd import judge, metrics
from canaryd.config import Settings
from canaryd.episodes import Episodes
from canaryd.events import Events
from canaryd.judge import Defer, Healthy, Judgement, NoVerdict, Recheck, Suspect, Unhealthy, Wait
from canaryd.kube import KubeClient, kind_of
from canaryd.leader import LeaderElector
from canaryd.logs import wall_time
from canaryd.opmetrics import OperatorMetrics, Read, ResourceKey, Scrape
from canaryd.registry import Added, Canary, CanaryKey, CanaryState, Forgotten, Registry, Resumed
from canaryd.sync import ScopeKey
from canaryd.writer import NotWritten, Outcome, Writer, Written

log = structlog.get_logger("canaryd.scheduler")

EVENT_REASONS = {
    CanaryState.UNHEALTHY: "Unhealthy",
    CanaryState.UNKNOWN: "Unknown",
    CanaryState.HEALTHY: "Recovered",
}


class Place(NamedTuple):
    what: Literal["due", "flying", "waiting"]  # flying: a bump task; waiting: for a read
    due: float  # the deadline it is (or was) due at
    canary: Canary


def phase(canary: Canary) -> float:
    """The canary's stable place in the cycle, as a fraction (its first bump's)."""
    return zlib.crc32(str(canary.key).encode()) / 2**32


def resource(canary: Canary) -> ResourceKey:
    """The canary as the operator's metrics name it."""
    return (kind_of(canary.key.kind).kind, canary.key.namespace, canary.key.name)


def note_reconciled(registry: Registry, scrape: Scrape, instance: int) -> None:
    """The ``reconciled`` stage of bumps reconciled since the last read of the operator's
    metrics (its time an upper bound: the read's answer)."""
    for canary in registry.tracked():
        baseline = canary.reconcile_baseline
        if canary.bumped_generation is None or baseline is None or baseline[0] != instance:
            continue  # no bump pending, or its count is another operator process's
        if judge.reconciled_since_bump(canary, scrape, resource(canary))[1]:
            registry.reconciled_seen(canary, scrape.answered_at)


class Role:
    """This replica's role (``active``: single or the leader; else a follower, with no
    bumps and no new verdicts) and its verdicts: the registry's transitions, counted,
    logged and told as Events (docs/DESIGN.md, the semantics table)."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        events: Events,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings, self.registry, self.events, self._clock = settings, registry, events, clock
        # Failed bumps, logged as episodes (an outage is not a line per canary).
        self.failures = Episodes(
            "bump_failures", "canary", lambda: settings.timeout, "canaries", clock=clock
        )
        self.standby_reason: str | None = None  # why this replica does not bump
        self._verdicts_kept = False

    @property
    def active(self) -> bool:
        return self.standby_reason is None

    def stand_by(self, leader: str | None) -> None:
        """No longer bumping. ``leader``: another holder of the lease, whose verdicts
        count from now on (every canary here ``pending``, with a standby reason), or
        None when none is known (this replica's verdicts stand, if it had kept them)."""
        keep = leader is None and (self._verdicts_kept or self.standby_reason is None)
        self._verdicts_kept = keep
        held = f"{leader} holds the lease" if leader else "waiting for the lease"
        self.standby_reason = f"standby: {held}"
        for canary in self.registry.canaries():
            self.failures.recovered(canary.key)
            self.registry.standing_by(canary, None if keep else self.standby_reason)
        self.age_verdicts()

    def lead(self) -> None:
        """Bumping again: every canary starts fresh (``pending``) unless this replica
        kept its own verdicts."""
        kept, self._verdicts_kept = self._verdicts_kept, False
        self.standby_reason = None
        for canary in self.registry.canaries():
            if not kept or canary.state is CanaryState.PENDING:
                why = "waiting for the first bump to be judged"
                self.registry.set_state(canary, CanaryState.PENDING, why, "first_bump")

    def no_bump(self, canary: Canary, reason: str, cause: str) -> None:
        """Nothing to judge this cycle: a failed write is no verdict either way; an
        unhealthy verdict older than ``Settings.verdict_ttl`` turns unknown."""
        self.verdict(canary, NoVerdict(reason, cause), self._clock(), counted=False)

    def verdict(
        self,
        canary: Canary,
        judgement: Healthy | Unhealthy | NoVerdict,
        now: float,
        *,
        counted: bool = True,
    ) -> None:
        """A verdict (or none either way) into the registry. One that changed is an
        Event: unhealthy, unknown, or recovered (healthy after a told unhealthy or
        unknown, whatever came between: a re-check, a stand-by)."""
        before = canary.state
        match judgement:
            case Healthy():
                label = "healthy"
                self.registry.judged(canary, CanaryState.HEALTHY, judgement.reason, "in_time", now)
            case Unhealthy(reason=why, cause=cause):
                label = "unhealthy"
                # The verdict an operator is paged for: a warning naming the canary when
                # it turns unhealthy; while it stays unhealthy, detail.
                (log.warning if before is not CanaryState.UNHEALTHY else log.debug)(
                    "canary_unhealthy", canary=str(canary.key), reason=why
                )
                self.registry.judged(canary, CanaryState.UNHEALTHY, why, cause, now)
            case NoVerdict(reason=why, counted=label, fresh=True):
                self.registry.judged(canary, CanaryState.PENDING, why, label, now)
            case NoVerdict(reason=why, counted=label):
                self.registry.no_verdict(canary, why, label, now, self.settings.verdict_ttl)
        if counted:
            metrics.VERDICTS.labels(label).inc()
        reason = EVENT_REASONS.get(canary.state)
        recovered = reason == "Recovered"
        if reason is not None and canary.state is not before and (canary.warned or not recovered):
            canary.warned = not recovered
            self.events.record(canary.key, canary.uid, reason, f"{canary.cause}: {canary.reason}")

    def not_yet(self, canary: Canary, judgement: Recheck | Defer) -> float:
        """No verdict yet (counted and logged the first time): a late judge re-checks, or it
        waits for its watch to resume. Returns when the canary is judged again."""
        if isinstance(judgement, Recheck):
            metrics.VERDICTS.labels("rechecked").inc()
            log.debug("verdict_rechecked", canary=str(canary.key), why="the judge ran late")
            self.registry.update(canary, late_recheck=True)
            return judgement.at
        until = judgement.until
        if judgement.first:
            metrics.VERDICTS.labels("deferred").inc()
            log.debug(
                "verdict_deferred",
                canary=str(canary.key),
                generation=canary.bumped_generation,
                why=judgement.why,
            )
            self.registry.update(canary, deferred_until=until)
        return until if judgement.at is None else min(judgement.at, until)

    def age_verdicts(self) -> float:
        """Unhealthy verdicts no bump re-tested (none is waiting to be judged, none failed
        to be written) for ``verdict_ttl`` turn unknown. Returns when the next one may (a
        half cycle from now at the latest: a verdict given meanwhile lasts longer)."""
        now, ttl = self._clock(), self.settings.verdict_ttl
        why = f"no bump written: {self.standby_reason or 'none could be sent'}"
        next_at = now + self.settings.timeout / 2
        for canary in self.registry.canaries():
            verdict = canary.verdict
            if canary.state is not CanaryState.UNHEALTHY or verdict is None:
                continue
            if now - verdict.at < ttl:
                next_at = min(next_at, verdict.at + ttl)
            elif (
                canary.bumped_generation is None
                and self.failures.cause(canary.key) is None  # aged at its next failure
            ):
                self.verdict(canary, NoVerdict(why, "not_written"), now, counted=False)
        return next_at


class Scheduler:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        kube: KubeClient,
        *,
        lease: LeaderElector | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings, self.registry, self.kube, self._clock = settings, registry, kube, clock
        self._lease = lease  # --leader-elect: whose role this follows
        self._places: dict[CanaryKey, Place] = {}  # each canary's (see the invariant)
        self._heap: list[tuple[float, int, Place]] = []  # live while its canary's place
        self._order = itertools.count()
        self._wake = registry.news  # set by the registry's news, and by an earlier deadline
        self._slots = asyncio.Semaphore(settings.max_bumps_in_flight)
        permit = lease.write_permit if lease is not None else None
        self.writer = Writer(settings, registry, kube, permit=permit, clock=clock)
        self._group: asyncio.TaskGroup | None = None
        # Kubernetes Events on canaries whose verdict changed (the daemon runs its task).
        self.events = Events(kube, interval=lambda: settings.timeout, clock=clock)
        self.role = Role(settings, registry, self.events, clock=clock)
        self.operator = OperatorMetrics.of(settings, clock)  # None: --reconciled-by watch
        if lease is not None:
            self.standby(None)  # until this replica holds the lease
        else:
            metrics.LEADER.set(1)  # the only replica: it writes
        metrics.UNSCHEDULED.set_function(lambda: len(self.unscheduled()))

    def standby(self, leader: str | None) -> None:
        """Not the leader: no bumps, no new verdicts. The registry stays warm (the
        watches run), so this replica judges from its first cycle once it leads."""
        self._heap.clear()
        self._places = {k: p for k, p in self._places.items() if p.what == "flying"}
        self.role.stand_by(leader)

    def activate(self) -> None:
        """This replica leads: every canary gets its first bump within a cycle."""
        self.role.lead()
        for canary in self.registry.canaries():
            self.schedule_first(canary)

    async def _follow(self, lease: LeaderElector) -> None:
        """Bump while this replica leads; stand by, saying who leads, otherwise."""
        seen: tuple[bool, str | None] | None = None
        async for leading, leader in lease.roles():
            if leading and not self.role.active:
                self.activate()
            elif not leading and (self.role.active or seen != (leading, leader)):
                self.standby(leader)
            seen = leading, leader

    def unscheduled(self) -> list[CanaryKey]:
        """The canaries that break the invariant (above): empty when all is well, and
        for a follower, which schedules nothing. A canary whose news the loop has not
        taken yet may have no place: it is placed at the loop's next turn."""
        if not self.role.active:
            return []
        new = {news.canary.key for news in self.registry.pending if isinstance(news, Added)}
        placed = self._places.keys() | new
        return [canary.key for canary in self.registry.canaries() if canary.key not in placed]

    def take_news(self) -> None:
        """Act on the registry's news, in order (nothing calls the scheduler back)."""
        resumed: set[ScopeKey] = set()
        for news in self.registry.take_news():
            match news:
                case Added(canary=canary):
                    if self.registry.owns(canary):  # not forgotten since
                        self.schedule_first(canary)
                case Forgotten(key=key):
                    self._forget(key)
                case Resumed(scope=scope):
                    resumed.add(scope)
        if resumed:
            self._scopes_resumed(resumed)

    def schedule_first(self, canary: Canary) -> None:
        if self.role.standby_reason is not None:
            self.registry.standing_by(canary, self.role.standby_reason)
            return
        self.push(self._clock() + phase(canary) * self.settings.timeout, canary)

    def push(self, due: float, canary: Canary) -> None:
        """(Re)schedule a canary; any earlier entry of it in the heap becomes void. A
        follower schedules nothing (activate() schedules every canary); a canary in
        flight is left to its bump task, which schedules it when it ends."""
        if not self.role.active or self.flying(canary):
            return
        place = self._places[canary.key] = Place("due", due, canary)
        heapq.heappush(self._heap, (due, next(self._order), place))
        if self._heap[0][2] is place:
            self._wake.set()

    def lag(self) -> float:
        """How far behind its deadlines the scheduler is (0 when nothing is overdue)."""
        return max(0.0, self._clock() - self._heap[0][0]) if self._heap else 0.0

    async def _next_due(self) -> tuple[float, Canary]:
        while True:
            self.take_news()  # clears the wake-up: the heap is read after it
            if not self._heap:
                await self._wake.wait()
                continue
            due, _, place = self._heap[0]
            canary = place.canary
            if self._places.get(canary.key) is not place or not self.registry.owns(canary):
                heapq.heappop(self._heap)  # superseded by a later push, or dropped
                continue
            delay = due - self._clock()
            if delay <= 0:
                heapq.heappop(self._heap)
                del self._places[canary.key]
                return due, canary
            timer = asyncio.get_running_loop().call_later(
                max(delay, self.settings.scheduler_tick), self._wake.set
            )
            try:
                await self._wake.wait()
            finally:
                timer.cancel()

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                if self.operator is not None:
                    group.create_task(self._judge_reads(self.operator), name="operator metrics")
                if self._lease is not None:
                    group.create_task(self._follow(self._lease), name="leader role")
                group.create_task(self._age_verdicts(), name="verdict aging")
                while True:
                    due, canary = await self._next_due()
                    with self._guard("judge_failed_unexpectedly", canary):
                        self._on_due(due, canary)
        except asyncio.CancelledError:
            log.info("scheduler_stopped", why="cancelled")
            raise
        finally:
            self._group = None

    async def _age_verdicts(self) -> None:
        """While any canary is unhealthy, each verdict when it may age (Role.age_verdicts),
        looking again every half cycle. Each look scans every canary: verdicts given at
        many moments are aged together, a judge's slack apart at the most often."""
        while True:
            next_at = self._clock() + self.settings.timeout / 2
            if not self.registry.healthy:
                with self._guard("judge_failed_unexpectedly"):
                    next_at = self.role.age_verdicts()
            await asyncio.sleep(max(self.settings.judge_slack, next_at - self._clock()))

    def _on_due(self, due: float, canary: Canary) -> None:
        """At the deadline: judge now, then queue the next bump (unless deferred)."""
        if not self.registry.owns(canary) or not self.role.active:
            return  # dropped since it was scheduled, or no longer the leader
        now = self._clock()
        metrics.VERDICT_LATENESS.observe(max(0.0, now - due))
        if self.operator is not None:
            self._places[canary.key] = Place("waiting", due, canary)  # judged at the next read
            return
        sync = self.registry.scopes.covering(canary.key)
        late, answered = now - due > self.settings.judge_slack, self.kube.answered_since
        judgement = judge.by_watch(
            canary, sync, now, self.settings, late=late, api_last_answer=answered
        )
        if isinstance(judgement, Suspect) and sync is not None:
            # canaryd's own connection is the suspect: the verdict waits for a fresh stream.
            metrics.VERDICTS.labels("suspected").inc()
            sync.suspect(now, judgement.why)
            judgement = judge.by_watch(
                canary, sync, now, self.settings, late=late, api_last_answer=answered
            )
        self._act(due, canary, judgement, now)

    async def _judge_reads(self, operator: OperatorMetrics) -> None:
        """operator-metrics: every read judges the canaries that fell due before it."""
        async with contextlib.aclosing(operator.reads(self.settings.scrape_interval)) as reads:
            async for read in reads:
                if read.scrape is not None:
                    with self._guard("operator_judge_failed_unexpectedly"):
                        note_reconciled(self.registry, read.scrape, operator.instance)
                if not self.role.active:
                    continue  # a follower judges nothing; it starts fresh when it leads
                if read.restarted:
                    self._operator_restarted(operator, read.started)
                now = self._clock()
                waiting = [p for p in self._places.values() if p.what == "waiting"]
                for _, due, canary in sorted(waiting, key=lambda place: place.due):
                    unjudged = canary.bumped_generation is None
                    if due > read.started or (read.unanswered and unjudged):
                        continue  # not yet this read's
                    del self._places[canary.key]
                    if self.registry.owns(canary):
                        with self._guard("operator_judge_failed_unexpectedly", canary):
                            self._act(due, canary, self._by_operator(operator, canary, read), now)

    def _by_operator(self, operator: OperatorMetrics, canary: Canary, read: Read) -> Judgement:
        """What ``read`` says of the canary's pending bump (canaryd.judge.by_operator)."""
        last, now = operator.last, self._clock()
        judgement = judge.by_operator(
            canary,
            resource(canary),
            read.scrape,
            read.failed,
            now,
            self.settings,
            instance=operator.instance,
            last_answer_at=last.answered_at if last is not None else None,
            api_away=judge.api_server_away(
                canary, self.registry.scopes.covering(canary.key), self.kube.answered_since, now
            ),
        )
        missing = judgement.missing_series if isinstance(judgement, NoVerdict) else None
        operator.series_missing(str(canary.key), missing)
        return judgement

    def _operator_restarted(self, operator: OperatorMetrics, started: float) -> None:
        """A new operator process answers: every canary is checked afresh (``pending``),
        bumped from ``started`` over half a cycle in phase order (twice the steady rate)."""
        canaries = sorted(self.registry.tracked(), key=phase)
        at = wall_time(operator.instance_since)
        metrics.OPERATOR_RESTARTS.inc()
        log.warning("operator_restarted", at=at, url=operator.url, canaries=len(canaries))
        reason = f"operator restarted at {at}: re-checking"
        step = self.settings.timeout / 2 / max(1, len(canaries))
        for index, canary in enumerate(canaries):
            self.registry.judged(canary, CanaryState.PENDING, reason, "operator_restarted", 0.0)
            canary.realign = True
            self.push(started + index * step, canary)

    @contextlib.contextmanager
    def _guard(self, event: str, canary: Canary | None = None) -> Iterator[None]:
        """A bug must not stop the scheduler nor lose the canary: say so, count it, and
        judge the canary a cycle on (a bump's task: no verdict, then it schedules itself)."""
        try:
            yield
        except Exception:
            metrics.ERRORS.labels("scheduler").inc()
            log.exception(event, canary=None if canary is None else str(canary.key))
            if canary is not None and self.flying(canary):
                self.role.no_bump(canary, "internal error; see logs", "internal_error")
            elif canary is not None and self.registry.owns(canary):
                self.push(self._clock() + self.settings.timeout, canary)

    def start_bump(self, due: float, canary: Canary) -> None:
        """The canary's next bump, a task of its own: in flight until it is due again."""
        if self._group is None or self.flying(canary):
            return
        # Placed once its task exists (it runs at the next await): a create_task that
        # raises (the group shutting down) leaves no place that looks in flight for ever.
        self._group.create_task(self._bump(due, canary), name=f"bump {canary.key}")
        self._places[canary.key] = Place("flying", due, canary)

    def flying(self, canary: Canary) -> bool:
        place = self._places.get(canary.key)
        return place is not None and place.what == "flying" and place.canary is canary

    async def _bump(self, due: float, canary: Canary) -> None:
        next_due: float | None = None
        try:
            with self._guard("cycle_failed_unexpectedly", canary):
                async with self._slots:
                    with metrics.BUMPS_IN_FLIGHT.track_inprogress():
                        outcome = await self.writer.bump(canary, due)
                next_due = self._bumped(canary, due, outcome)
        finally:
            if self.flying(canary):
                del self._places[canary.key]
            if self.registry.owns(canary) and self.role.active and not self.writer.stopping:
                # Due again at its next deadline, or a cycle on: never out of the schedule.
                self.push(next_due if next_due is not None else self._after_failure(due), canary)

    def _bumped(self, canary: Canary, due: float, outcome: Outcome) -> float | None:
        """What came of a bump, into the registry; returns when the canary is next due."""
        if not self.registry.owns(canary) or not self.role.active:
            return None
        if isinstance(outcome, NotWritten):
            metrics.BUMPS.labels(outcome.cause).inc()
            self.role.failures.failed(canary.key, outcome.cause, outcome.reason)
            self.role.no_bump(canary, outcome.reason, outcome.cause)
            return self._after_failure(due)
        if not isinstance(outcome, Written):
            return None
        metrics.BUMPS.labels("written").inc()
        deadline = outcome.answered + self.settings.timeout
        self.registry.bumped(
            canary, outcome.generation, outcome.sent, outcome.answered, deadline, time.time()
        )
        self.role.failures.recovered(canary.key)
        log.debug("bumped", canary=str(canary.key), generation=outcome.generation)
        return deadline

    def _act(self, due: float, canary: Canary, judgement: Judgement, now: float) -> None:
        """Do what a judgement says: a verdict to the role, then the next bump; or not yet:
        rescheduled, or (Wait) judged at the next read of the operator's metrics."""
        match judgement:
            case None | Healthy() | Unhealthy() | NoVerdict():
                if judgement is not None:  # None: the last cycle wrote nothing to judge
                    self.role.verdict(canary, judgement, now)
                if self.operator is not None:
                    # Bumped now (the verdict may have waited: its retry window runs from
                    # now), the last answer's count its baseline; or, once an operator
                    # restart's fresh check is judged, back at its place in the cycle.
                    if judgement is not None and canary.realign:
                        canary.realign = False
                        wait = (phase(canary) * self.settings.timeout - now) % self.settings.timeout
                        if wait > self.settings.scrape_interval:
                            self.push(now + wait, canary)
                            return
                    # (None: no answer yet; a count from another operator process is
                    # not comparable, hence its instance.)
                    last, instance = self.operator.last, self.operator.instance
                    baseline = None if last is None else (instance, last.count(resource(canary)))
                    self.registry.update(canary, reconcile_baseline=baseline)
                    due = now
                self.start_bump(due, canary)
            case Recheck() | Defer():
                self.push(self.role.not_yet(canary, judgement), canary)
            case Suspect():
                # Judged again at the fresh stream's own deadline (never out of the schedule).
                self.push(now + self.settings.judge_slack, canary)
            case Wait():
                self._places[canary.key] = Place("waiting", due, canary)

    def _scopes_resumed(self, scopes: set[ScopeKey]) -> None:
        """Watches resumed: judge what waited for them once the replayed events are in
        (one pass over the canaries for all the scopes resumed at once: a mass reconnect
        after an API server's restart is not a pass per scope)."""
        at = self._clock() + self.settings.resume_grace
        for canary in self.registry.tracked():  # those deferred (a verdict clears it)
            if canary.deferred_until is None or at >= canary.deferred_until:
                continue
            kind, namespace = canary.key.kind, canary.key.namespace
            if (kind, namespace) in scopes or (kind, None) in scopes:
                self.push(at, canary)

    def _forget(self, key: CanaryKey) -> None:
        """A canary is no longer tracked: nothing of it is kept here."""
        self._places.pop(key, None)
        self.role.failures.recovered(key)
        if self.operator is not None:
            self.operator.missing.discard(str(key))

    def _after_failure(self, due: float) -> float:
        """A cycle after ``due`` that wrote nothing (never in the past: not repeated at once)."""
        return max(due + self.settings.timeout, self._clock())
