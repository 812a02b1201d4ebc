"""The scheduler: per canary, every cycle, judge the previous bump, then write the next.

One task walks a deadline heap (not a task per canary). At a canary's deadline it
judges the previous bump there and then, synchronously — judging never queues
behind writes — and sends the next bump: in the common case at once, on an idle
pooled connection, its answer handled in a callback (no task per bump;
``_bump_now``, at most ``max_concurrent_bumps`` at a time); otherwise, and for
whatever that first try is answered with but success, through a pool of bump
workers: at least ``max_concurrent_bumps``, more when slow writes (an admission
webhook in the path) need them, so that no fixed share of canaries is skipped every
cycle. A canary's first bump is placed at a stable offset within the cycle (a hash
of its identity), so N canaries spread over the cycle instead of firing N writes at
once.

Every write to the registry after an ``await`` first checks that the record is still
the one tracked (``Registry.owns``): an answer that arrives after the canary was
dropped or replaced changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import math
import random
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from functools import partial
from typing import Any

import structlog

from canaryd import judge, logs, metrics
from canaryd.backoff import Backoff
from canaryd.config import Settings
from canaryd.episodes import Episodes
from canaryd.judge import Defer, Healthy, Judgement, NoVerdict, Recheck, Suspect, Unhealthy, Wait
from canaryd.kube import MERGE_PATCH, ErrorKind, KubeClient, KubeError, kind_of, object_path
from canaryd.opmetrics import OperatorMetrics, ResourceKey, Scrape, ScrapeFailed
from canaryd.registry import Canary, CanaryKey, CanaryState, Registry, ScopeKey
from canaryd.sync import ScopeSync

log = structlog.get_logger("canaryd.scheduler")
WRITTEN = metrics.BUMPS.labels("written")
MAX_BUMP_WORKERS = 256
"""The most bumps in flight at once, however slow writes are (each holds a socket)."""
LATENCY_WEIGHT = 0.2
"""Weight of the latest write in the moving average of write latency."""
HEALTHY_VERDICTS = metrics.VERDICTS.labels("healthy")
UNHEALTHY_VERDICTS = metrics.VERDICTS.labels("unhealthy")


def bump_body(resource_version: str, nonce: int) -> str:
    """The merge patch of a bump: the precondition and spec.restartNonce, nothing else.

    Serialised by hand (it is the hot path); the opaque resourceVersion is quoted by the
    stdlib encoder's string function (what ``json.dumps`` of a string calls, without
    its four Python calls around it).
    """
    return (
        f'{{"metadata":{{"resourceVersion":{_json_string(resource_version)}}},'
        f'"spec":{{"restartNonce":{int(nonce)}}}}}'
    )


_json_string: Callable[[str], str] = json.encoder.encode_basestring_ascii


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
        self._ready: deque[tuple[float, Canary, KubeError | None]] = deque()
        """Bumps for the workers, in order: each with the time it fell due, and the error
        that answered its first try when that was sent without a worker (``_bump_now``)."""
        self._idle: deque[asyncio.Future[None]] = deque()
        """One future per idle bump worker: a queued bump wakes exactly one of them."""
        self._deferred: set[Canary] = set()
        """Canaries whose verdict waits for their watch to resume."""
        self._rng = random.Random()
        self._group: asyncio.TaskGroup | None = None
        self._workers = 0
        self.write_latency = 0.0
        """Moving average of an answered bump's PATCH, 2xx or not (seconds)."""
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
        self.write_time_limit: Callable[[], float | None] = lambda: settings.write_timeout
        """Asked right before every write: its client timeout, or None when no write may
        be sent now (the leader elector's ``write_time_limit``)."""
        self._stopping = False
        """Set by ``finish_writes``: canaryd is stopping, no write is sent any more."""
        self._writes_in_flight = 0
        """Bumps sent and not answered yet, by the workers and by ``_bump_now``."""
        self._sent_now = 0
        """Those sent by ``_bump_now`` (without a worker)."""
        self._no_writes_in_flight = asyncio.Event()
        self._no_writes_in_flight.set()
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
        still stands, and if it retakes the lease it goes on with them. Once another
        holder is seen, that holder's verdicts are the ones that count: every canary
        here is ``pending`` with a standby reason, and this replica starts fresh."""
        keep = leader is None and (self._verdicts_kept or self.standby_reason is None)
        self._verdicts_kept = keep
        self.standby_reason = (
            f"standby: {leader} holds the lease" if leader else "standby: waiting for the lease"
        )
        self._heap.clear()
        self._ready.clear()
        self._deferred.clear()
        self._awaiting.clear()
        for canary in self.registry.canaries():
            self.failures.recovered(canary.key)
            self.registry.standing_by(canary, None if keep else self.standby_reason)
        if keep:
            self._age_kept_verdicts()
        else:
            self._stop_aging()

    def _age_kept_verdicts(self) -> None:
        """A kept verdict ages like any other: no bump is written while this replica
        stands by, so an unhealthy verdict turns unknown two cycles after it was
        reached (registry.no_verdict), however long the lease stays away."""
        self._stop_aging()
        if not self._verdicts_kept or self.standby_reason is None:
            return
        unhealthy = False
        for canary in self.registry.canaries():
            if canary.state is CanaryState.UNHEALTHY:
                self._no_bump(canary, f"no bump written: {self.standby_reason}")
                unhealthy = unhealthy or canary.state is CanaryState.UNHEALTHY
        if unhealthy:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to age
                self._aging = asyncio.get_running_loop().call_later(
                    self.settings.timeout / 2, self._age_kept_verdicts
                )

    def _stop_aging(self) -> None:
        if self._aging is not None:
            self._aging.cancel()
            self._aging = None

    def activate(self) -> None:
        """This replica leads: every canary gets its first bump within a cycle, and
        starts fresh unless this replica kept its own verdicts (see ``standby``)."""
        kept, self._verdicts_kept = self._verdicts_kept, False
        self._stop_aging()
        self.standby_reason = None
        for canary in self.registry.canaries():
            if not kept or canary.state is CanaryState.PENDING:
                self.registry.set_state(
                    canary, CanaryState.PENDING, "waiting for the first bump to be judged"
                )
            self.schedule_first(canary)

    async def finish_writes(self) -> None:
        """Stopping: send no more writes and wait for the ones in flight to be answered
        or abandoned. Each ends within its own time limit (the write timeout), so the
        lease can be released after this without a write of this replica still on its
        way."""
        self._stopping = True
        if self._writes_in_flight:
            log.info("finishing_writes", in_flight=self._writes_in_flight)
        await self._no_writes_in_flight.wait()

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
        """How far behind its deadlines the scheduler is: the most overdue heap entry or
        waiting bump (0 when nothing is overdue)."""
        now = self._clock()
        lag = max(0.0, now - self._heap[0][0]) if self._heap else 0.0
        if self._ready:
            lag = max(lag, now - self._ready[0][0])
        return lag

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
                for _ in range(self.settings.max_concurrent_bumps):
                    self._add_worker()
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
                        if self.registry.owns(canary):
                            self._push(self._clock() + self.settings.timeout, canary)
        except asyncio.CancelledError:
            log.info("scheduler_stopped", why="cancelled")
            raise
        finally:
            self._group, self._workers = None, 0
            self._idle.clear()
            if self.operator is not None:
                await self.operator.close()

    def _add_worker(self) -> None:
        assert self._group is not None
        self._workers += 1
        metrics.BUMP_WORKERS.set(self._workers)
        self._group.create_task(self._bump_worker(), name=f"bump worker {self._workers}")

    def _note_latency(self, took: float) -> None:
        """The moving average of answered writes: how long a bump holds a worker. Writes
        that time out are left out: more workers would only add to an overload."""
        self.write_latency += LATENCY_WEIGHT * (took - self.write_latency)

    def workers_wanted(self) -> int:
        """Little's law: bumps per second times seconds per bump, twice over, within
        [max_concurrent_bumps, MAX_BUMP_WORKERS]."""
        rate = len(self.registry) / self.settings.timeout
        wanted = math.ceil(2 * rate * self.write_latency)
        return max(self.settings.max_concurrent_bumps, min(MAX_BUMP_WORKERS, wanted))

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
        self._queue_bump(due, canary)

    def _queue_bump(self, due: float, canary: Canary) -> None:
        """Send the canary's next bump now, or hand it to the workers."""
        if not self._ready and self._bump_now(due, canary):
            return
        self._for_workers(due, canary, None)

    def _for_workers(self, due: float, canary: Canary, failed: KubeError | None) -> None:
        self._ready.append((due, canary, failed))
        while self._idle:
            waiter = self._idle.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break
        if (
            self._group is not None
            and len(self._idle) < len(self._ready)
            and self._workers < self.workers_wanted()
        ):
            self._add_worker()

    async def _bump_worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._ready:
                # Wait to be woken by _queue_bump: one queued bump wakes one worker
                # (an Event would wake every idle worker for each bump).
                waiter: asyncio.Future[None] = loop.create_future()
                self._idle.append(waiter)
                try:
                    await waiter
                finally:
                    if waiter.cancelled():  # this worker stopped: it is idle no more
                        with contextlib.suppress(ValueError):  # skipped by a wake already
                            self._idle.remove(waiter)
            due, canary, failed = self._ready.popleft()
            next_due: float | None
            try:
                next_due = await self.bump_nonce(canary, due, failed=failed)
            except Exception:
                # A bug must not stop the scheduler: say so, count it, try next cycle.
                metrics.ERRORS.labels("scheduler").inc()
                log.exception("cycle_failed_unexpectedly", canary=str(canary.key))
                self._no_bump(canary, "internal error; see logs")
                next_due = self._after_failure(due)
            finally:
                # The worker keeps no failure: with its traceback it would hold the frames
                # it went through (and the answer) while this worker waits.
                failed = None
            if next_due is not None and self.registry.owns(canary):
                self._push(next_due, canary)

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
            case Wait() | Suspect():
                return False
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
                if self.registry.owns(canary):
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
        self._queue_bump(now, canary)

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
                if self.registry.owns(canary):
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
        ttl = 2 * self.settings.timeout - self.settings.judge_slack
        self.registry.no_verdict(canary, reason, self._clock(), ttl)

    def _bump_now(self, due: float, canary: Canary) -> bool:
        """The common case of ``bump_nonce`` without a worker: the PATCH sent now on an idle
        connection, its answer handled in a callback a loop turn after it came
        (``_bump_answered``). False, and nothing sent, for anything else: the workers do
        it (``bump_nonce``), and whatever the first try is answered with but success goes
        to them too."""
        now = self._clock()
        if (
            # The common case is a quick write: slow ones (an admission webhook in the
            # path) queue for the workers, whose pool grows with the write latency and
            # stays bounded (MAX_BUMP_WORKERS), as the connections with it.
            self._sent_now >= self.settings.max_concurrent_bumps
            or now > due + self.settings.timeout / 2
            or self._stopping
            or self.standby_reason is not None
            or not self.registry.owns(canary)
        ):
            return False
        time_limit = self.write_time_limit()
        if time_limit is None:
            return False
        repairing, nonce, before = self._next_write(canary)
        sent = self._clock()
        if not self.kube.start(
            "patch",
            "PATCH",
            object_path(*canary.key),
            partial(self._bump_answered, canary, due, nonce, repairing, before, sent),
            data=bump_body(canary.resource_version, nonce),
            content_type=MERGE_PATCH,
            time_limit=time_limit,
        ):
            return False
        self._sent_now += 1
        self._write_sent()
        return True

    @staticmethod
    def _next_write(canary: Canary) -> tuple[str | None, int, int]:
        """What the next bump repairs (if anything), the nonce it writes, and the
        generation before it: the watch may deliver the write's own event before its
        answer arrives."""
        repairing = canary.nonce_problem
        nonce = 1 if repairing else canary.nonce + 1
        return repairing, nonce, max(canary.generation, canary.last_bumped_generation or 0)

    def _write_sent(self) -> None:
        self._writes_in_flight += 1
        self._no_writes_in_flight.clear()

    def _write_ended(self) -> None:
        self._writes_in_flight -= 1
        if not self._writes_in_flight:
            self._no_writes_in_flight.set()

    def _bump_answered(
        self,
        canary: Canary,
        due: float,
        nonce: int,
        repairing: str | None,
        before: int,
        sent: float,
        outcome: dict[str, Any] | KubeError | None,
    ) -> None:
        """``_bump_now``'s answer: written, or the workers take it from there."""
        self._sent_now -= 1
        self._write_ended()
        try:
            if outcome is None:  # nothing concluded: the workers send it again
                self._for_workers(due, canary, None)
                return
            if isinstance(outcome, KubeError):
                if outcome.status is not None:  # answered; a timeout is overload, not latency
                    self._note_latency(self._clock() - sent)
                if self.registry.owns(canary):
                    self._for_workers(due, canary, outcome)
                return
            self._note_latency(self._clock() - sent)
            if not self.registry.owns(canary) or self.standby_reason is not None:
                return
            next_due = self._written(canary, outcome, nonce, repairing, due, before, sent)
        except Exception:
            # A bug must not lose the canary: say so, count it, try next cycle.
            metrics.ERRORS.labels("scheduler").inc()
            log.exception("cycle_failed_unexpectedly", canary=str(canary.key))
            if not self.registry.owns(canary):
                return
            self._no_bump(canary, "internal error; see logs")
            next_due = self._after_failure(due)
        if self.registry.owns(canary):
            self._push(next_due, canary)

    async def bump_nonce(
        self, canary: Canary, due: float | None = None, *, failed: KubeError | None = None
    ) -> float | None:
        """Write restartNonce + 1 with a resourceVersion precondition.

        Returns when the next cycle is due, or None when the record is no longer the
        one tracked (dropped, or replaced by a new object of the same name). ``failed``:
        the first try was sent without a worker (``_bump_now``) and answered this; it is
        handled as a try of this call's would be.
        """
        timeout = self.settings.timeout
        now = self._clock()
        due = now if due is None else due
        give_up_at = due + timeout / 2
        if not self.registry.owns(canary):
            return None
        if failed is None and now > give_up_at:
            # It waited for a worker past its retry window: writes are backed up (slow
            # answers). Skipping keeps the scheduler's lag bounded.
            self._write_failed(
                canary, "skipped", "no bump this cycle: bumps are backed up behind slow writes"
            )
            return self._after_failure(due)
        backoff: Backoff | None = None  # made on the first transient failure only
        path = object_path(*canary.key)
        conflicts, reread = 0, False
        while True:
            try:
                if failed is not None:
                    err, failed = failed, None
                    raise err
                if reread:
                    fresh = await self.kube.request("get", "GET", path)
                    gone = self.registry.reread(canary, fresh)
                    if gone is not None:
                        metrics.BUMPS.labels(
                            "replaced" if gone == "replaced" else "not_canary"
                        ).inc()
                        return None
                    reread = False
                time_limit = None if self._stopping else self.write_time_limit()
                if self.standby_reason is not None or time_limit is None:
                    return None  # not the leader (or not for long enough), or stopping
                repairing, nonce, before = self._next_write(canary)
                sent = self._clock()
                self._write_sent()
                try:
                    written = await self.kube.request(
                        "patch",
                        "PATCH",
                        path,
                        data=bump_body(canary.resource_version, nonce),
                        content_type=MERGE_PATCH,
                        time_limit=time_limit,
                    )
                except KubeError as err:
                    if err.status is not None:  # answered; a timeout is overload, not latency
                        self._note_latency(self._clock() - sent)
                    raise
                finally:
                    self._write_ended()
                self._note_latency(self._clock() - sent)
            except KubeError as err:
                if not self.registry.owns(canary):
                    return None  # a late answer about a record no longer tracked
                if err.kind is ErrorKind.CONFLICT:
                    metrics.CONFLICTS.inc()
                    conflicts += 1
                    if conflicts > self.settings.max_conflict_retries:
                        self._write_failed(
                            canary,
                            "conflict_exhausted",
                            f"{conflicts} conflicts in a row; no bump this cycle",
                        )
                        return self._after_failure(due)
                    reread = True
                    # Jittered, so two writers that collided do not collide again.
                    await asyncio.sleep(self._rng.uniform(0, min(0.05, timeout / 20)))
                    continue
                if err.kind is ErrorKind.GONE:
                    return await self._answered_gone(canary, path, err, due)
                if err.kind is ErrorKind.FORBIDDEN:
                    self._write_failed(
                        canary, "forbidden", f"canaryd may not write it (retried next cycle): {err}"
                    )
                    return self._after_failure(due)
                if err.kind is ErrorKind.INVALID:
                    self._write_failed(canary, "invalid", f"bump rejected: {err}")
                    return self._after_failure(due)
                if backoff is None:
                    backoff = Backoff(
                        self.settings.backoff_initial, self.settings.backoff_max, rng=self._rng
                    )
                delay = backoff.next()
                if err.retry_after is not None:
                    # Honoured, but never a tight loop (Retry-After: 0).
                    delay = max(err.retry_after, self.settings.backoff_initial)
                if self._clock() + delay > give_up_at:
                    self._write_failed(canary, "failed", f"bump failed: {err}")
                    return self._after_failure(due)
                if logs.debug_enabled():
                    log.debug(
                        "bump_retry",
                        canary=str(canary.key),
                        error=str(err),
                        retry_in=round(delay, 3),
                    )
                await asyncio.sleep(delay)
                if not self.registry.owns(canary):
                    return None
                continue
            if not self.registry.owns(canary) or self.standby_reason is not None:
                return None
            return self._written(canary, written, nonce, repairing, due, before, sent)

    async def _answered_gone(
        self, canary: Canary, path: str, err: KubeError, due: float
    ) -> float | None:
        """A 404 on a bump may be transient (a CRD being re-registered, an API server
        replica briefly not serving it): re-read to tell. Still there, same uid: no
        bump this cycle, retried next. Gone too: paused for a cycle, and only the watch
        drops it (DELETED, its label gone, a relist without it); a write-side "gone" is
        never confirmation enough, since no DELETED may ever follow a transient one."""
        try:
            fresh = await self.kube.request("get", "GET", path)
        except KubeError as reread_err:
            if not self.registry.owns(canary):
                return None
            if reread_err.kind is ErrorKind.GONE:
                self._write_failed(
                    canary,
                    "gone",
                    f"bump and re-read answered {err}: paused until the watch confirms "
                    "(bumped again next cycle while the watch still shows it)",
                )
                return self._after_failure(due)
            self._write_failed(
                canary, "gone_unconfirmed", f"bump answered {err}; re-read failed: {reread_err}"
            )
            return self._after_failure(due)
        gone = self.registry.reread(canary, fresh)
        if gone is not None:
            metrics.BUMPS.labels("replaced" if gone == "replaced" else "not_canary").inc()
            return None
        self._write_failed(
            canary,
            "gone_but_present",
            f"bump answered {err}, but the object is still there; retried next cycle",
        )
        return self._after_failure(due)

    def _written(
        self,
        canary: Canary,
        written: Mapping[str, Any],
        nonce: int,
        repaired: str | None,
        due: float,
        before: int,
        sent: float,
    ) -> float:
        now = self._clock()
        metadata = written.get("metadata") or {}
        generation = (
            metadata.get("generation")
            if (type(metadata) is dict or isinstance(metadata, Mapping))
            else None
        )
        self.registry.refresh(canary, written)
        if repaired:
            log.warning(
                "canary_nonce_repaired", canary=str(canary.key), problem=repaired, nonce=nonce
            )
        if not isinstance(generation, int) or isinstance(generation, bool):
            self._write_failed(
                canary, "no_generation", "the API server answered the bump without a generation"
            )
            return self._after_failure(due)
        if generation <= before:
            # The server took the nonce as no change: there is no new generation for
            # the operator to reconcile, so there is nothing to judge.
            self._write_failed(
                canary,
                "no_change",
                f"the bump was answered with generation {generation}, not above {before}",
            )
            return self._after_failure(due)
        WRITTEN.inc()
        deadline = now + self.settings.timeout
        self.registry.bumped(canary, generation, sent, now, deadline, time.time())
        self.failures.recovered(canary.key)
        if logs.debug_enabled():
            log.debug("bumped", canary=str(canary.key), nonce=nonce, generation=generation)
        return deadline
