"""The scheduler: per canary, every cycle, judge the previous bump, then write the next.

One task walks a deadline heap (not a task per canary). At a canary's deadline it
judges the previous bump there and then, synchronously — judging never queues
behind writes — and starts the next bump: a task of its own (canaryd.writer does the
write), at most ``max_bumps_in_flight`` of them writing at once. A canary's first bump
is placed at a stable offset within the cycle (a hash of its identity), so N canaries
spread over the cycle instead of firing N writes at once.

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
import contextlib
import heapq
import itertools
import math
import random
import time
import zlib
from collections.abc import Callable
from datetime import UTC, datetime

import structlog

from canaryd import judge, logs, metrics
from canaryd.config import Settings
from canaryd.episodes import Episodes
from canaryd.judge import Defer, Healthy, Judgement, NoVerdict, Recheck, Suspect, Unhealthy, Wait
from canaryd.kube import KubeClient, kind_of
from canaryd.opmetrics import OperatorMetrics, ResourceKey, Scrape, ScrapeFailed
from canaryd.registry import Canary, CanaryKey, CanaryState, Registry, ScopeKey
from canaryd.sync import ScopeSync
from canaryd.writer import NotWritten, Outcome, Writer, Written

log = structlog.get_logger("canaryd.scheduler")
WRITTEN = metrics.BUMPS.labels("written")
HEALTHY_VERDICTS = metrics.VERDICTS.labels("healthy")
UNHEALTHY_VERDICTS = metrics.VERDICTS.labels("unhealthy")


def wall_time(timestamp: float) -> str:
    """A Unix time as RFC 3339 in UTC; a value that is no date is shown as it is."""
    try:
        return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (ValueError, OverflowError, OSError):
        return repr(timestamp)


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
        self._wake = asyncio.Event()
        self._in_flight: dict[CanaryKey, Canary] = {}
        """Canaries whose bump task runs (waiting for a slot, the fence, or an answer):
        the record it writes for (a new object of the same name is another)."""
        self._slots = asyncio.Semaphore(settings.max_bumps_in_flight)
        self.writer = Writer(settings, registry, kube, clock=clock)
        self._deferred: set[Canary] = set()
        """Canaries whose verdict waits for their watch to resume."""
        self._rng = random.Random()
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
        self._verdicts_kept = False
        """A replica that stepped down without seeing another holder keeps its verdicts."""
        self._aging: asyncio.TimerHandle | None = None
        self.standby_reason: str | None = None
        """Why this replica does not bump (a follower under --leader-elect); None: it does."""
        self.operator: OperatorMetrics | None = None
        """--reconciled-by operator-metrics: the operator's metrics endpoint."""
        self._awaiting: list[tuple[float, Canary]] = []
        """Canaries past their deadline, waiting for the next read of the operator's
        metrics (operator-metrics): one read judges every canary due before it."""
        self._instance_judged = 0
        """The operator instance (opmetrics.Instance.number) the verdicts are about."""
        self._missing_series: set[CanaryKey] = set()
        """Canaries whose counter the operator's metrics lack (warned once each)."""
        self._realign: set[CanaryKey] = set()
        """Canaries bumped off their place in the cycle for a fresh check (an operator
        restart): once that bump is judged, the next one goes back to its place."""
        self._epoch = clock()
        """Where the cycle's places are counted from (``_place``)."""
        self.operator_problem: str | None = None
        """Why the operator's metrics cannot judge canaries right now (/readyz says it)."""
        self.operator_failures = Episodes(
            "operator_metrics_failures",
            subject="url",
            subjects="urls",
            detail_event="operator_metrics_failed",
            interval=lambda: settings.timeout,
            logger_name="canaryd.scheduler",
            clock=clock,
        )
        """Failed reads of the operator's metrics, logged as an episode."""
        if settings.reconciled_by == "operator-metrics":
            self.operator = OperatorMetrics(
                settings.operator_metrics_url,
                connect_timeout=settings.scrape_connect_timeout,
                read_timeout=settings.timeout,
                clock=clock,
            )
            metrics.operator_metrics_exported()
        registry.observer = self

    # ------------------------------------------------------- leader election

    @property
    def active(self) -> bool:
        return self.standby_reason is None

    def standby(self, leader: str | None) -> None:
        """Not the leader: no bumps and no new verdicts from here on. The registry stays
        warm (the watches run), so this replica judges from its first cycle once it
        leads.

        ``leader`` is another holder of the lease, or None when none is known. A leader
        that stepped down without seeing another holder (a lease hiccup) keeps its
        verdicts and its /healthz: nobody else has checked since, so what it found
        still stands (ageing as any verdict no bump re-tests, ``age_verdicts``), and if
        it retakes the lease it goes on with them. Once another holder is seen, that
        holder's verdicts are the ones that count: every canary here is ``pending``
        with a standby reason, and this replica starts fresh."""
        keep = leader is None and (self._verdicts_kept or self.standby_reason is None)
        self._verdicts_kept = keep
        self.standby_reason = (
            f"standby: {leader} holds the lease" if leader else "standby: waiting for the lease"
        )
        self._heap.clear()
        self._due_seq.clear()
        self._deferred.clear()
        self._awaiting.clear()
        for canary in self.registry.canaries():
            self.failures.recovered(canary.key)
            self.registry.standing_by(canary, None if keep else self.standby_reason)
        self.age_verdicts()

    def age_verdicts(self) -> None:
        """An ``unhealthy`` verdict that no bump has re-tested for two cycles turns
        ``unknown`` (registry.no_verdict), whether or not a bump was attempted meanwhile
        (the leader's fence held it, this replica stands by, writes fail): a verdict
        nobody can re-test must not restart the operator forever. Runs every half cycle
        while any canary is unhealthy."""
        self._stop_aging()
        now = self._clock()
        ttl = self._verdict_ttl()
        unhealthy = False
        for canary in self.registry.canaries():
            verdict = canary.verdict
            if canary.state is not CanaryState.UNHEALTHY or verdict is None:
                continue
            # One whose writes fail ages at its next failed write, which names the cause.
            failing = self.failures.cause(canary.key) is not None
            if canary.bumped_generation is None and not failing and now - verdict.at >= ttl:
                why = self.standby_reason or "none could be sent"
                self.registry.no_verdict(canary, f"no bump written: {why}", now, ttl)
            unhealthy = unhealthy or canary.state is CanaryState.UNHEALTHY
        if unhealthy:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to age
                self._aging = asyncio.get_running_loop().call_later(
                    self.settings.timeout / 2, self.age_verdicts
                )

    def _stop_aging(self) -> None:
        if self._aging is not None:
            self._aging.cancel()
            self._aging = None

    def activate(self) -> None:
        """This replica leads: every canary gets its first bump within a cycle, and
        starts fresh unless this replica kept its own verdicts (see ``standby``)."""
        kept, self._verdicts_kept = self._verdicts_kept, False
        self.standby_reason = None
        for canary in self.registry.canaries():
            if not kept or canary.state is CanaryState.PENDING:
                self.registry.set_state(
                    canary, CanaryState.PENDING, "waiting for the first bump to be judged"
                )
            if not self._flying(canary):  # one in flight schedules itself
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
        (and for a follower, which schedules nothing)."""
        if self.standby_reason is not None:
            return []
        awaiting: dict[CanaryKey, int] = {}
        for _, canary in self._awaiting:
            awaiting[canary.key] = awaiting.get(canary.key, 0) + 1
        return [
            canary.key
            for canary in self.registry.canaries()
            if (canary.key in self._due_seq) + self._flying(canary) + awaiting.get(canary.key, 0)
            != 1
        ]

    # ------------------------------------------------------------ the heap

    def canary_added(self, canary: Canary) -> None:
        self.schedule_first(canary)

    def schedule_first(self, canary: Canary) -> None:
        if self.standby_reason is not None:
            self.registry.set_state(canary, CanaryState.PENDING, self.standby_reason)
            return
        fraction = zlib.crc32(str(canary.key).encode()) / 2**32
        self._push(self._clock() + fraction * self.settings.timeout, canary)

    def _push(self, due: float, canary: Canary) -> None:
        """(Re)schedule a canary; any earlier entry of it in the heap becomes void."""
        if self.standby_reason is not None:
            return  # a follower schedules nothing; activate() schedules every canary
        seq = next(self._order)
        self._due_seq[canary.key] = seq
        heapq.heappush(self._heap, (due, seq, canary))
        if self._heap[0][1] == seq:
            self._wake.set()

    def lag(self) -> float:
        """How far behind its deadlines the scheduler is: the most overdue heap entry
        (0 when nothing is overdue)."""
        now = self._clock()
        return max(0.0, now - self._heap[0][0]) if self._heap else 0.0

    async def _next_due(self) -> tuple[float, Canary]:
        while True:
            if not self._heap:
                self._wake.clear()
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
            self._wake.clear()
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
                    group.create_task(self._read_operator(), name="operator metrics")
                while True:
                    due, canary = await self._next_due()
                    try:
                        self._on_due(due, canary)
                    except Exception:
                        # A bug must not stop the scheduler: say so, count it, go on.
                        metrics.ERRORS.labels("scheduler").inc()
                        log.exception("judge_failed_unexpectedly", canary=str(canary.key))
                        if self.registry.owns(canary) and not self._flying(canary):
                            self._push(self._clock() + self.settings.timeout, canary)
        except asyncio.CancelledError:
            log.info("scheduler_stopped", why="cancelled")
            raise
        finally:
            self._group = None
            self._stop_aging()
            if self.operator is not None:
                await self.operator.close()

    def _on_due(self, due: float, canary: Canary) -> None:
        """At the deadline: judge now, then queue the next bump (unless deferred)."""
        if not self.registry.owns(canary) or self.standby_reason is not None:
            return  # dropped since it was scheduled, or no longer the leader
        lateness = max(0.0, self._clock() - due)
        metrics.VERDICT_LATENESS.observe(lateness)
        if self.operator is not None:
            self._awaiting.append((due, canary))  # judged at the next read of its metrics
            return
        if not self.judge_previous_bump(canary, late=lateness > self.settings.judge_slack):
            return  # the verdict waits for the watch; it was rescheduled
        self._start_bump(due, canary)

    def _start_bump(self, due: float, canary: Canary) -> None:
        """The canary's next bump, in a task of its own: in flight until it has its
        next deadline."""
        if self._group is None or self._flying(canary):
            return
        self._in_flight[canary.key] = canary
        self._group.create_task(self._bump(due, canary), name=f"bump {canary.key}")

    def _flying(self, canary: Canary) -> bool:
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
            self._no_bump(canary, "internal error; see logs")
            next_due = self._after_failure(due)
        finally:
            if self._flying(canary):
                del self._in_flight[canary.key]
            if (
                self.registry.owns(canary)
                and self.standby_reason is None
                and not self.writer.stopping
            ):
                # Due again: at its next deadline, or (nothing came of it while this
                # replica still bumps) a cycle on, never out of the schedule.
                self._push(next_due if next_due is not None else self._after_failure(due), canary)

    def _bumped(self, canary: Canary, due: float, outcome: Outcome) -> float | None:
        """What came of a bump, into the registry; returns when the canary is next due."""
        if not self.registry.owns(canary) or self.standby_reason is not None:
            return None
        if isinstance(outcome, NotWritten):
            self._write_failed(canary, outcome.cause, outcome.reason)
            return self._after_failure(due)
        if not isinstance(outcome, Written):
            return None
        WRITTEN.inc()
        deadline = outcome.answered + self.settings.timeout
        self.registry.bumped(
            canary, outcome.generation, outcome.sent, outcome.answered, deadline, time.time()
        )
        self.failures.recovered(canary.key)
        if logs.debug_enabled():
            log.debug("bumped", canary=str(canary.key), generation=outcome.generation)
        return deadline

    # ------------------------------------------------------------- judging

    def judge_previous_bump(self, canary: Canary, *, late: bool = False) -> bool:
        """Judge the pending bump on the watch (canaryd.judge.by_watch) and act on it.
        Returns False when the verdict waits (deferred, re-checked: rescheduled)."""
        now = self._clock()
        sync = self.registry.covering(canary.key)
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
        return self._apply(canary, judgement, now)

    def _last_answer(self, sync: ScopeSync | None) -> float:
        """When the API server last answered, read only when a watch is out of sync."""
        return self.kube.last_answer if sync is not None and not sync.in_sync else math.inf

    def _apply(self, canary: Canary, judgement: Judgement, now: float) -> bool:
        """Do what a judgement says: count it, log it, make the registry's transition,
        reschedule what waits. Returns False when the verdict waits.

        The cases read the judgement's fields as attributes: on Python 3.11 a positional
        capture (``case Healthy(reason)``) costs twice as much, and in a match of several
        such cases its line kept a few blocks more as it ran (tests/test_soak.py)."""
        match judgement:
            case None:
                return True  # the last cycle wrote nothing: nothing to judge
            case Healthy():
                HEALTHY_VERDICTS.inc()
                self._deferred.discard(canary)
                self.registry.judged(canary, CanaryState.HEALTHY, judgement.reason, now)
            case Unhealthy():
                reason = judgement.reason
                UNHEALTHY_VERDICTS.inc()
                self._deferred.discard(canary)
                # The verdict an operator is paged for: a warning naming the canary when
                # it turns unhealthy; while it stays unhealthy, detail.
                (log.warning if canary.state is not CanaryState.UNHEALTHY else log.debug)(
                    "canary_unhealthy", canary=str(canary.key), reason=reason
                )
                self.registry.judged(canary, CanaryState.UNHEALTHY, reason, now)
                if self._aging is None:
                    self.age_verdicts()
            case NoVerdict():
                reason, missing = judgement.reason, judgement.missing_series
                metrics.VERDICTS.labels(judgement.counted).inc()
                self._deferred.discard(canary)
                if missing is not None and canary.key not in self._missing_series:
                    self._missing_series.add(canary.key)
                    log.warning(
                        "operator_series_missing",
                        canary=str(canary.key),
                        series=missing,
                        url=self.settings.operator_metrics_url,
                        hint="the operator does not watch its namespace, or has not "
                        "reconciled it since it started",
                    )
                if judgement.fresh:
                    self.registry.fresh_check(canary, reason)
                else:
                    self._no_bump(canary, reason)
            case Recheck():
                metrics.VERDICTS.labels("rechecked").inc()
                log.debug("verdict_rechecked", canary=str(canary.key), why="the judge ran late")
                self.registry.rechecking(canary)
                self._push(judgement.at, canary)
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
                self._push(until, canary)
                return False
            case Suspect():
                # The fresh stream's verdict comes from its own deadline: judged again
                # then (never out of the schedule).
                self._push(now + self.settings.judge_slack, canary)
                return False
            case Wait():
                return False  # operator-metrics: judged again at the next read
        return True

    def scope_resumed(self, scope: ScopeKey) -> None:
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
                self._push(at, canary)

    # ------------------------------------------------- operator metrics

    async def _read_operator(self) -> None:
        """Read the operator's metrics every scrape interval (never per canary): judge
        every canary whose deadline passed before the read started, note the bumps the
        operator reconciled since, and see a restarted operator."""
        operator = self.operator
        assert operator is not None
        try:
            while True:
                started = self._clock()
                scrape: Scrape | None = None
                failed: ScrapeFailed | None = None
                read = asyncio.ensure_future(operator.scrape())
                try:
                    while not read.done():
                        await asyncio.wait({read}, timeout=self.settings.scrape_interval)
                        if not read.done():
                            self._still_unanswered(started)
                    scrape = read.result()
                except ScrapeFailed as err:
                    failed = err
                finally:
                    if not read.done():
                        read.cancel()
                try:
                    self._operator_read(started, scrape, failed)
                except Exception:
                    # A bug must not stop the reads: say so, count it, go on.
                    metrics.ERRORS.labels("scheduler").inc()
                    log.exception("operator_judge_failed_unexpectedly")
                pause = started + self.settings.scrape_interval - self._clock()
                await asyncio.sleep(max(0.0, pause))
        except asyncio.CancelledError:
            log.info("operator_metrics_reader_stopped", why="cancelled")
            raise

    def _operator_read(
        self, started: float, scrape: Scrape | None, failed: ScrapeFailed | None
    ) -> None:
        operator = self.operator
        assert operator is not None
        if failed is not None:
            metrics.OPERATOR_SCRAPES.labels(failed.cause).inc()
            self.failures_of_operator(failed)
        else:
            assert scrape is not None
            metrics.OPERATOR_SCRAPES.labels("ok").inc()
            self.operator_problem = None
            self.operator_failures.recovered(operator.url)
            if not scrape.has_operator_series:
                self.operator_problem = (
                    f"{operator.url} answered without the operator's metrics (is Flink's "
                    "Prometheus reporter configured on this port?)"
                )
            if operator.instance.number != self._instance_judged:
                if self.standby_reason is None:
                    self._operator_restarted(started)
                else:  # a follower judges nothing; it starts fresh when it leads
                    self._instance_judged = operator.instance.number
            self._note_reconciles(scrape)
        if self.standby_reason is not None:
            return
        now = self._clock()
        due_now = [(due, c) for due, c in self._awaiting if due <= started]
        self._awaiting = [(due, c) for due, c in self._awaiting if due > started]
        for due, canary in due_now:
            try:
                self._judge_and_bump(due, canary, scrape, failed, now)
            except Exception:
                # A bug must not lose the canary: say so, count it, try it next cycle.
                metrics.ERRORS.labels("scheduler").inc()
                log.exception("operator_judge_failed_unexpectedly", canary=str(canary.key))
                if self.registry.owns(canary) and not self._flying(canary):
                    self._push(now + self.settings.timeout, canary)

    def _judge_and_bump(
        self,
        due: float,
        canary: Canary,
        scrape: Scrape | None,
        failed: ScrapeFailed | None,
        now: float,
    ) -> None:
        if not self.registry.owns(canary):
            return
        judged = canary.bumped_generation is not None
        assert self.operator is not None
        last = self.operator.last
        judgement = judge.by_operator(
            canary,
            self._resource(canary),
            scrape,
            failed,
            now,
            self.settings,
            instance=self._instance_judged,
            last_answer_at=last.answered_at if last is not None else None,
            api_away=judge.api_server_away(
                canary, self.registry.covering(canary.key), self.kube.last_answer, now
            ),
        )
        if not (isinstance(judgement, NoVerdict) and judgement.missing_series is not None):
            self._missing_series.discard(canary.key)  # warned again if it goes missing again
        if not self._apply(canary, judgement, now):
            self._awaiting.append((due, canary))
            return
        if judged and canary.key in self._realign:
            # Its fresh check is judged: the next bump goes back to its place in the
            # cycle, so that bumps stay spread (DESIGN: never N writes at once).
            self._realign.discard(canary.key)
            place = self._place(canary, now)
            if place - now > self.settings.scrape_interval:
                self._push(place, canary)
                return
        self.registry.baseline(canary, self._baseline(canary))
        # The bump's own retry window runs from now: the verdict may have waited.
        self._start_bump(now, canary)

    def _phase(self, canary: Canary) -> float:
        """The canary's stable place in the cycle, as a fraction (its first bump's)."""
        return zlib.crc32(str(canary.key).encode()) / 2**32

    def _place(self, canary: Canary, now: float) -> float:
        """The first time from ``now`` at the canary's place in the cycle."""
        timeout = self.settings.timeout
        offset = self._epoch + self._phase(canary) * timeout
        return offset + math.ceil(max(0.0, now - offset) / timeout) * timeout

    def _still_unanswered(self, started: float) -> None:
        """A read has not been answered for a read interval: the verdicts that have
        waited a whole cycle for an answer need not wait for this one to time out (a
        frozen JVM holds a read for the whole cycle)."""
        assert self.operator is not None
        now = self._clock()
        silent = ScrapeFailed(
            "unanswered",
            f"{self.operator.url} has not answered a read sent {now - started:.1f}s ago",
        )
        waiting = [(due, c) for due, c in self._awaiting if due <= started]
        if self.standby_reason is not None or not waiting:
            return
        self._awaiting = [(due, c) for due, c in self._awaiting if due > started]
        for due, canary in waiting:
            if canary.bumped_generation is None:
                self._awaiting.append((due, canary))  # nothing to judge: the read's baseline
                continue
            try:
                self._judge_and_bump(due, canary, None, silent, now)
            except Exception:
                metrics.ERRORS.labels("scheduler").inc()
                log.exception("operator_judge_failed_unexpectedly", canary=str(canary.key))
                if self.registry.owns(canary) and not self._flying(canary):
                    self._push(now + self.settings.timeout, canary)

    def failures_of_operator(self, failed: ScrapeFailed) -> None:
        """A read failed: an episode in the log, the cause in /readyz."""
        assert self.operator is not None
        self.operator_problem = str(failed)
        self.operator_failures.failed(self.operator.url, failed.cause, str(failed))

    def _operator_restarted(self, started: float) -> None:
        """A new operator process answers: verdicts were about the one that is gone. Every
        canary is checked afresh: ``pending``, and a bump from now on, the first at once
        and the rest over half a cycle in their order in the cycle (twice the steady
        rate, not N writes at once); each goes back to its place once that is judged."""
        assert self.operator is not None
        instance = self.operator.instance
        self._instance_judged = instance.number
        at = wall_time(instance.since)
        metrics.OPERATOR_RESTARTS.inc()
        log.warning("operator_restarted", at=at, url=self.operator.url, canaries=len(self.registry))
        reason = f"operator restarted at {at}: re-checking"
        self._awaiting = []
        canaries = sorted(self.registry.tracked(), key=self._phase)
        step = self.settings.timeout / 2 / max(1, len(canaries))
        for index, canary in enumerate(canaries):
            self.registry.fresh_check(canary, reason)
            self._realign.add(canary.key)
            if not self._flying(canary):  # one in flight schedules itself
                self._push(started + index * step, canary)

    def canary_forgotten(self, key: CanaryKey) -> None:
        """A canary is no longer tracked: nothing of it is kept here."""
        self._due_seq.pop(key, None)
        self.failures.recovered(key)
        self._missing_series.discard(key)
        self._realign.discard(key)

    def _resource(self, canary: Canary) -> ResourceKey:
        return (kind_of(canary.key.kind).kind, canary.key.namespace, canary.key.name)

    def _baseline(self, canary: Canary) -> tuple[int, float | None] | None:
        """The operator instance and the canary's count of finished reconciles in the
        last answer read (before the bump about to be sent), if one was ever read."""
        assert self.operator is not None
        last = self.operator.last
        if last is None:
            return None
        return self.operator.instance.number, last.count(self._resource(canary))

    def _note_reconciles(self, scrape: Scrape) -> None:
        """The ``reconciled`` stage of bumps the operator reconciled since the last read
        (its time is an upper bound: the read's answer)."""
        number = self._instance_judged
        for canary in self.registry.tracked():
            sent = canary.bump_sent_at
            baseline = canary.reconcile_baseline
            if (
                sent is None
                or canary.bumped_generation is None
                or baseline is None
                or baseline[0] != number
                or "reconciled" in canary.stages
            ):
                continue
            if judge.reconciled_since_bump(canary, scrape, self._resource(canary))[1]:
                self.registry.reconciled_seen(canary, max(0.0, scrape.answered_at - sent))

    # ------------------------------------------------------------- bumping

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
        self._no_bump(canary, reason)

    def _no_bump(self, canary: Canary, reason: str) -> None:
        """Nothing to judge this cycle; an unhealthy verdict stands for two cycles: it
        ages at the second cycle's failed write. That write falls due two cycles after
        the deadline whose judge reached the verdict, and either may run up to the
        judge's slack late (the scheduler's tick, a busy loop): measured from the judge,
        two cycles less the slack, or the verdict would age a cycle later whenever
        the judge ran later than the write."""
        self.registry.no_verdict(canary, reason, self._clock(), self._verdict_ttl())

    def _verdict_ttl(self) -> float:
        return 2 * self.settings.timeout - self.settings.judge_slack
