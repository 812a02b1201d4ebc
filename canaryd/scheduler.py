"""The scheduler: per canary, every cycle, judge the previous bump, then write the next.

One task walks a deadline heap (not a task per canary). At a canary's deadline it
judges the previous bump there and then, synchronously — judging never queues
behind writes — and starts the next bump: a task of its own (canaryd.writer does the
write), at most ``max_bumps_in_flight`` of them writing at once. A canary's first bump
is placed at a stable offset within the cycle (a hash of its identity), so N canaries
spread over the cycle instead of firing N writes at once. The watch judges by default;
--reconciled-by operator-metrics hands deadlines to canaryd.opjudge, and the replica's
role (leading, standing by) and the ageing of its verdicts are canaryd.role's.

The invariant (``unscheduled``): while this replica bumps, every tracked canary is
either due (one live heap entry) or in flight (a bump task, or a judge waiting for the
operator's metrics), exactly once. Nothing takes a canary out of the schedule but the
watch (it drops the canary) and stepping down (``activate`` schedules them all again).

Every write to the registry after an ``await`` first checks that the record is still
the one tracked (``Registry.owns``): an answer that arrives after the canary was
dropped or replaced changes nothing.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable

import structlog

from canaryd import judge, metrics
from canaryd.config import Settings
from canaryd.episodes import Episodes
from canaryd.events import Events
from canaryd.judge import Defer, Healthy, Judgement, NoVerdict, Recheck, Suspect, Unhealthy, Wait
from canaryd.kube import KubeClient
from canaryd.opjudge import OperatorJudge, phase
from canaryd.registry import Added, Canary, CanaryKey, CanaryState, Forgotten, Registry, Resumed
from canaryd.role import Role
from canaryd.sync import ScopeKey, ScopeSync
from canaryd.writer import NotWritten, Outcome, Writer, Written

log = structlog.get_logger("canaryd.scheduler")


class Scheduler:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        kube: KubeClient,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings, self.registry, self.kube = settings, registry, kube
        self._clock = clock
        self._heap: list[tuple[float, int, Canary]] = []
        self._order = itertools.count()
        self._due_seq: dict[CanaryKey, int] = {}
        """Each canary's one live heap entry (an earlier one of it is void)."""
        self._wake = registry.news
        """The loop's one wake-up: the registry sets it when news waits (``take_news``),
        ``push`` when a deadline comes earlier than the one waited for."""
        self._in_flight: dict[CanaryKey, Canary] = {}
        """Canaries whose bump task runs (waiting for a slot, the fence, or an answer):
        the record it writes for (a new object of the same name is another)."""
        self._slots = asyncio.Semaphore(settings.max_bumps_in_flight)
        self.writer = Writer(settings, registry, kube, clock=clock)
        self._deferred: set[Canary] = set()
        """Canaries whose verdict waits for their watch to resume."""
        self._group: asyncio.TaskGroup | None = None
        self.failures = Episodes(
            "bump_failures",
            subject="canary",
            subjects="canaries",
            detail_event="bump_failed",
            interval=lambda: settings.timeout,
            logger_name="canaryd.scheduler",
            clock=clock,
        )
        """Failed bumps, logged as episodes (an outage is not a line per canary)."""
        self.events = Events(kube, interval=lambda: settings.timeout, clock=clock)
        """Kubernetes Events on canaries whose verdict changed (the daemon runs its task)."""
        self.role = Role(
            settings,
            registry,
            lambda key: self.failures.cause(key) is not None,
            self.events,
            clock=clock,
        )
        self.operator: OperatorJudge | None = None
        """--reconciled-by operator-metrics: bumps judged on the operator's metrics."""
        if settings.reconciled_by == "operator-metrics":
            self.operator = OperatorJudge(
                settings, registry, self, lambda: kube.answered_since, clock=clock
            )

    @property
    def active(self) -> bool:
        return self.role.active

    def standby(self, leader: str | None) -> None:
        """Not the leader: no bumps and no new verdicts from here on (canaryd.role). The
        registry stays warm (the watches run), so this replica judges from its first
        cycle once it leads."""
        self._heap.clear()
        self._due_seq.clear()
        self._deferred.clear()
        if self.operator is not None:
            self.operator.awaiting.clear()
        for canary in self.registry.canaries():
            self.failures.recovered(canary.key)
        self.role.stand_by(leader)

    def activate(self) -> None:
        """This replica leads: every canary gets its first bump within a cycle."""
        self.role.lead()
        for canary in self.registry.canaries():
            if not self.flying(canary):  # one in flight schedules itself
                self.schedule_first(canary)

    async def finish_writes(self) -> None:
        """Stopping: send no more writes and wait for the ones in flight to be answered
        or abandoned. Each ends within its own time limit (the write timeout), so the
        lease can be released after this without a write of this replica still on its
        way."""
        if self.writer.in_flight:
            log.info("finishing_writes", in_flight=self.writer.in_flight)
        await self.writer.finished()

    def unscheduled(self) -> list[CanaryKey]:
        """The canaries that break the invariant: while this replica bumps, each one
        tracked is due exactly once or in flight exactly once. Empty when all is well
        (and for a follower, which schedules nothing). A canary whose news the loop has
        not taken yet may be neither: it is scheduled at the loop's next turn."""
        if not self.active:
            return []
        awaiting: dict[CanaryKey, int] = {}
        for _, canary in self.operator.awaiting if self.operator is not None else ():
            awaiting[canary.key] = awaiting.get(canary.key, 0) + 1
        added = {news.canary.key for news in self.registry.pending if isinstance(news, Added)}

        def times(canary: Canary) -> int:
            due, flying = canary.key in self._due_seq, self.flying(canary)
            return due + flying + awaiting.get(canary.key, 0)

        return [
            canary.key
            for canary in self.registry.canaries()
            if times(canary) != 1 and not (times(canary) == 0 and canary.key in added)
        ]

    def take_news(self) -> None:
        """Act on what the registry tells, in order: a canary added is scheduled, one
        forgotten leaves nothing here, a resumed scope's deferred verdicts are judged.
        The loop reads it; nothing calls the scheduler back."""
        for news in self.registry.take_news():
            match news:
                case Added(canary=canary):
                    if self.registry.owns(canary):  # not forgotten since
                        self.schedule_first(canary)
                case Forgotten(key=key):
                    self._forget(key)
                case Resumed(scope=scope):
                    self._scope_resumed(scope)

    def schedule_first(self, canary: Canary) -> None:
        if self.role.standby_reason is not None:
            self.registry.set_state(
                canary, CanaryState.PENDING, self.role.standby_reason, "standby"
            )
            return
        self.push(self._clock() + phase(canary) * self.settings.timeout, canary)

    def push(self, due: float, canary: Canary) -> None:
        """(Re)schedule a canary; any earlier entry of it in the heap becomes void."""
        if not self.active:
            return  # a follower schedules nothing; activate() schedules every canary
        seq = next(self._order)
        self._due_seq[canary.key] = seq
        heapq.heappush(self._heap, (due, seq, canary))
        if self._heap[0][1] == seq:
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
            due, seq, canary = self._heap[0]
            if seq != self._due_seq.get(canary.key) or not self.registry.owns(canary):
                heapq.heappop(self._heap)  # superseded by a later _push, or dropped
                continue
            delay = due - self._clock()
            if delay <= 0:
                heapq.heappop(self._heap)
                del self._due_seq[canary.key]
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
                    group.create_task(self.operator.run(), name="operator metrics")
                while True:
                    due, canary = await self._next_due()
                    try:
                        self._on_due(due, canary)
                    except Exception:
                        # A bug must not stop the scheduler: say so, count it, go on.
                        metrics.ERRORS.labels("scheduler").inc()
                        log.exception("judge_failed_unexpectedly", canary=str(canary.key))
                        if self.registry.owns(canary) and not self.flying(canary):
                            self.push(self._clock() + self.settings.timeout, canary)
        except asyncio.CancelledError:
            log.info("scheduler_stopped", why="cancelled")
            raise
        finally:
            self._group = None
            self.role.stop()
            if self.operator is not None:
                await self.operator.close()

    def _on_due(self, due: float, canary: Canary) -> None:
        """At the deadline: judge now, then queue the next bump (unless deferred)."""
        if not self.registry.owns(canary) or not self.active:
            return  # dropped since it was scheduled, or no longer the leader
        lateness = max(0.0, self._clock() - due)
        metrics.VERDICT_LATENESS.observe(lateness)
        if self.operator is not None:
            self.operator.due(due, canary)  # judged at the next read of its metrics
            return
        if not self.judge_previous_bump(canary, late=lateness > self.settings.judge_slack):
            return  # the verdict waits for the watch; it was rescheduled
        self.start_bump(due, canary)

    def start_bump(self, due: float, canary: Canary) -> None:
        """The canary's next bump, in a task of its own: in flight until it has its
        next deadline."""
        if self._group is None or self.flying(canary):
            return
        self._in_flight[canary.key] = canary
        self._group.create_task(self._bump(due, canary), name=f"bump {canary.key}")

    def flying(self, canary: Canary) -> bool:
        return self._in_flight.get(canary.key) is canary

    async def _bump(self, due: float, canary: Canary) -> None:
        next_due: float | None = None
        try:
            async with self._slots:
                metrics.BUMPS_IN_FLIGHT.inc()
                try:
                    outcome = await self.writer.bump(canary, due)
                finally:
                    metrics.BUMPS_IN_FLIGHT.dec()
            next_due = self._bumped(canary, due, outcome)
        except Exception:
            # A bug must not lose the canary: say so, count it, try next cycle.
            metrics.ERRORS.labels("scheduler").inc()
            log.exception("cycle_failed_unexpectedly", canary=str(canary.key))
            self._no_bump(canary, "internal error; see logs", "internal_error")
            next_due = self._after_failure(due)
        finally:
            if self.flying(canary):
                del self._in_flight[canary.key]
            if self.registry.owns(canary) and self.active and not self.writer.stopping:
                # Due again: at its next deadline, or (nothing came of it while this
                # replica still bumps) a cycle on, never out of the schedule.
                self.push(next_due if next_due is not None else self._after_failure(due), canary)

    def _bumped(self, canary: Canary, due: float, outcome: Outcome) -> float | None:
        """What came of a bump, into the registry; returns when the canary is next due."""
        if not self.registry.owns(canary) or not self.active:
            return None
        if isinstance(outcome, NotWritten):
            self._write_failed(canary, outcome.cause, outcome.reason)
            return self._after_failure(due)
        if not isinstance(outcome, Written):
            return None
        metrics.BUMPS.labels("written").inc()
        deadline = outcome.answered + self.settings.timeout
        self.registry.bumped(
            canary, outcome.generation, outcome.sent, outcome.answered, deadline, time.time()
        )
        self.failures.recovered(canary.key)
        log.debug("bumped", canary=str(canary.key), generation=outcome.generation)
        return deadline

    def judge_previous_bump(self, canary: Canary, *, late: bool = False) -> bool:
        """Judge the pending bump on the watch (canaryd.judge.by_watch) and act on it.
        Returns False when the verdict waits (deferred, re-checked: rescheduled)."""
        now = self._clock()
        sync = self.registry.scopes.covering(canary.key)
        judgement = judge.by_watch(
            canary, sync, now, self.settings, late=late, api_last_answer=self._last_answer(sync)
        )
        if isinstance(judgement, Suspect) and sync is not None:
            # canaryd's own connection is the suspect: a fresh stream tells, from the
            # last resourceVersion; the verdict waits for it as for any resume.
            metrics.VERDICTS.labels("suspected").inc()
            sync.suspect(now, judgement.why)
            judgement = judge.by_watch(
                canary, sync, now, self.settings, late=late, api_last_answer=self._last_answer(sync)
            )
        return self.apply(canary, judgement, now)

    def _last_answer(self, sync: ScopeSync | None) -> float:
        """The send time of the latest request the API server answered, read only when
        a watch is out of sync."""
        return self.kube.answered_since if sync is not None and not sync.in_sync else math.inf

    def apply(self, canary: Canary, judgement: Judgement, now: float) -> bool:
        """Do what a judgement says: count it, log it, make the registry's transition,
        reschedule what waits. Returns False when the verdict waits."""
        match judgement:
            case None:
                return True  # the last cycle wrote nothing: nothing to judge
            case Healthy():
                metrics.VERDICTS.labels("healthy").inc()
                self._deferred.discard(canary)
                before = canary.state
                self.registry.judged(canary, CanaryState.HEALTHY, judgement.reason, "in_time", now)
                self.role.told(canary, before)
            case Unhealthy():
                reason = judgement.reason
                metrics.VERDICTS.labels("unhealthy").inc()
                self._deferred.discard(canary)
                # The verdict an operator is paged for: a warning naming the canary when
                # it turns unhealthy; while it stays unhealthy, detail.
                (log.warning if canary.state is not CanaryState.UNHEALTHY else log.debug)(
                    "canary_unhealthy", canary=str(canary.key), reason=reason
                )
                before = canary.state
                self.registry.judged(canary, CanaryState.UNHEALTHY, reason, judgement.cause, now)
                self.role.told(canary, before)
                self.role.judged_unhealthy()
            case NoVerdict():
                metrics.VERDICTS.labels(judgement.counted).inc()
                self._deferred.discard(canary)
                if judgement.fresh:
                    self.registry.fresh_check(canary, judgement.reason, judgement.counted)
                else:
                    self._no_bump(canary, judgement.reason, judgement.counted)
            case Recheck():
                metrics.VERDICTS.labels("rechecked").inc()
                log.debug("verdict_rechecked", canary=str(canary.key), why="the judge ran late")
                self.registry.rechecking(canary)
                self.push(judgement.at, canary)
                return False
            case Defer():
                until = judgement.until
                if judgement.first:
                    metrics.VERDICTS.labels("deferred").inc()
                    log.debug(
                        "verdict_deferred",
                        canary=str(canary.key),
                        generation=canary.bumped_generation,
                        why=judgement.why,
                    )
                    self.registry.deferred(canary, until)
                    self._deferred.add(canary)
                self.push(until if judgement.at is None else min(judgement.at, until), canary)
                return False
            case Suspect():
                # The fresh stream's verdict comes from its own deadline: judged again
                # then (never out of the schedule).
                self.push(now + self.settings.judge_slack, canary)
                return False
            case Wait():
                return False  # operator-metrics: judged again at the next read
        return True

    def _scope_resumed(self, scope: ScopeKey) -> None:
        """A watch resumed: judge what waited for it once the replayed events are in."""
        kind, namespace = scope
        at = self._clock() + self.settings.resume_grace
        for canary in list(self._deferred):
            if not self.registry.owns(canary):
                self._deferred.discard(canary)
                continue
            if canary.key.kind != kind or namespace not in (None, canary.key.namespace):
                continue
            if canary.deferred_until is not None and at < canary.deferred_until:
                self.push(at, canary)

    def _forget(self, key: CanaryKey) -> None:
        """A canary is no longer tracked: nothing of it is kept here."""
        self._due_seq.pop(key, None)
        self.failures.recovered(key)
        if self.operator is not None:
            self.operator.forget(key)

    def _after_failure(self, due: float) -> float:
        """The next cycle after a cycle that wrote nothing: one timeout after it fell due
        (never in the past: a late cycle is not repeated at once)."""
        return max(due + self.settings.timeout, self._clock())

    def _write_failed(self, canary: Canary, cause: str, reason: str) -> None:
        """A cycle without a bump to judge: counted, and told in the failure episode
        (per canary at debug)."""
        if not self.registry.owns(canary):
            return
        metrics.BUMPS.labels(cause).inc()
        self.failures.failed(canary.key, cause, reason)
        self._no_bump(canary, reason, cause)

    def _no_bump(self, canary: Canary, reason: str, cause: str) -> None:
        self.role.no_bump(canary, reason, cause)
