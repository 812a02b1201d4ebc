"""--reconciled-by operator-metrics: the operator's own reconcile counts, for the scheduler.

The operator's metrics (canaryd.opmetrics) are read every scrape interval, never per
canary: ``reads`` yields each read, and one of its silence each interval it stays
unanswered (a frozen JVM holds a read that long). The scheduler keeps the canaries past
their deadline until the next read (``judge.Wait``) and asks here what it says of each
(``judge``), when each is bumped next (``bump_at``) and, after a new operator process,
how to check them all afresh (``restart``). Nothing here schedules.
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import structlog

from canaryd import judge, metrics
from canaryd.config import Settings
from canaryd.episodes import Episodes
from canaryd.judge import Judgement, NoVerdict
from canaryd.kube import kind_of
from canaryd.logs import wall_time
from canaryd.opmetrics import OperatorMetrics, ResourceKey, Scrape, ScrapeFailed
from canaryd.registry import Canary, CanaryKey, Registry

log = structlog.get_logger("canaryd.opjudge")


def phase(canary: Canary) -> float:
    """The canary's stable place in the cycle, as a fraction (its first bump's)."""
    return zlib.crc32(str(canary.key).encode()) / 2**32


@dataclass(frozen=True, slots=True)
class Read:
    started: float
    scrape: Scrape | None
    failed: ScrapeFailed | None
    # Still unanswered after an interval: it judges only the canaries with a bump to
    # judge (the others wait for it: it is their baseline).
    unanswered: bool = False
    restarted: bool = False  # a new operator process answered it


class OperatorJudge:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        api_last_answer: Callable[[], float],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings, self.registry = settings, registry
        self._api_last_answer = api_last_answer
        self._clock = clock
        self.operator = OperatorMetrics(
            settings.operator_metrics_url,
            connect_timeout=settings.scrape_connect_timeout,
            read_timeout=settings.timeout,
            clock=clock,
        )
        metrics.operator_metrics_exported()
        self._instance_judged = 0  # the OperatorMetrics.instance the verdicts are about
        self._missing_series: set[CanaryKey] = set()  # warned once each
        # Bumped off their place in the cycle for a fresh check (an operator restart):
        # once that bump is judged, the next goes back to its place (``bump_at``).
        self._realign: set[CanaryKey] = set()
        self._epoch = clock()  # where the cycle's places are counted from
        self.problem: str | None = None
        """Why the operator's metrics cannot judge canaries right now (``blind``)."""
        self._unusable_since: float | None = None  # every read since failed, or no series
        self.failures = Episodes(
            "operator_metrics_failures", "url", lambda: settings.timeout, clock=clock
        )

    def forget(self, key: CanaryKey) -> None:
        self._missing_series.discard(key)
        self._realign.discard(key)

    async def reads(self) -> AsyncGenerator[Read, None]:
        """Read every scrape interval, forever (close it: contextlib.aclosing)."""
        try:
            while True:
                started = self._clock()
                scrape: Scrape | None = None
                failed: ScrapeFailed | None = None
                read = asyncio.ensure_future(self.operator.scrape())
                try:
                    while not read.done():
                        await asyncio.wait({read}, timeout=self.settings.scrape_interval)
                        if not read.done():
                            # Those that waited a cycle need not wait for this read to time
                            # out (a frozen JVM holds it a cycle).
                            silent = ScrapeFailed(
                                "unanswered",
                                f"{self.operator.url} has not answered a read sent "
                                f"{self._clock() - started:.1f}s ago",
                            )
                            yield Read(started, None, silent, unanswered=True)
                    scrape = read.result()
                except ScrapeFailed as err:
                    failed = err
                finally:
                    read.cancel()  # the reader is stopping (once done, a no-op)
                try:
                    noted = self._note(started, scrape, failed)
                except Exception:
                    # A bug must not stop the reads: say so, count it, go on.
                    metrics.ERRORS.labels("scheduler").inc()
                    log.exception("operator_judge_failed_unexpectedly")
                    noted = Read(started, scrape, failed)
                yield noted
                pause = started + self.settings.scrape_interval - self._clock()
                await asyncio.sleep(max(0.0, pause))
        finally:
            await self.operator.close()  # its session

    def _note(self, started: float, scrape: Scrape | None, failed: ScrapeFailed | None) -> Read:
        """What a read tells before any canary is judged on it."""
        url, restarted = self.operator.url, False
        metrics.OPERATOR_SCRAPES.labels("ok" if failed is None else failed.cause).inc()
        if failed is not None:
            self.problem = str(failed)  # blind() names it; the log tells an episode
            self.failures.failed(url, failed.cause, str(failed))
        else:
            assert scrape is not None
            self.problem = None
            self.failures.recovered(url)
            if not scrape.has_operator_series:
                self.problem = (
                    f"{url} answered without the operator's metrics (is Flink's "
                    "Prometheus reporter configured on this port?)"
                )
            restarted = self.operator.instance != self._instance_judged
            self._instance_judged = self.operator.instance
            # The ``reconciled`` stage of bumps reconciled since the last read (its time
            # an upper bound: the read's answer).
            for canary in self.registry.tracked():
                sent, baseline = canary.bump_sent_at, canary.reconcile_baseline
                if (
                    sent is not None
                    and canary.bumped_generation is not None
                    and baseline is not None
                    and baseline[0] == self._instance_judged
                    and "reconciled" not in canary.stages
                    and judge.reconciled_since_bump(canary, scrape, self._resource(canary))[1]
                ):
                    self.registry.reconciled_seen(canary, max(0.0, scrape.answered_at - sent))
        if self.problem is None:
            self._unusable_since = None
        elif self._unusable_since is None:
            self._unusable_since = started
        return Read(started, scrape, failed, restarted=restarted)

    def blind(self) -> dict[str, str]:
        """Why canaryd cannot judge by the operator's metrics, by ``canaryd_blind`` reason:
        no usable answer for a whole cycle (a start-up's grace: the reporter listens some
        seconds after the operator starts), or an answer without a canary's series."""
        blind: dict[str, str] = {}
        since = self._unusable_since
        if self.problem is not None and since is not None:
            if self._clock() - since < self.settings.timeout:
                return blind  # within the start-up grace
            answered = self.failures.cause(self.operator.url) is None  # the last read
            reason = "no_series" if answered else "unreachable"
            blind[f"operator_metrics_{reason}"] = self.problem
        if self._missing_series:
            missing = ", ".join(sorted(str(key) for key in self._missing_series)[:20])
            blind.setdefault("operator_metrics_no_series", f"no series for {missing}")
        return blind

    def judge(self, canary: Canary, read: Read, now: float) -> Judgement:
        """What ``read`` says of the canary's pending bump (canaryd.judge.by_operator)."""
        last, resource = self.operator.last, self._resource(canary)
        judgement = judge.by_operator(
            canary,
            resource,
            read.scrape,
            read.failed,
            now,
            self.settings,
            instance=self._instance_judged,
            last_answer_at=last.answered_at if last is not None else None,
            api_away=judge.api_server_away(
                canary, self.registry.scopes.covering(canary.key), self._api_last_answer(), now
            ),
        )
        missing = judgement.missing_series if isinstance(judgement, NoVerdict) else None
        if missing is None:
            self._missing_series.discard(canary.key)  # warned again if it goes missing again
        elif canary.key not in self._missing_series:
            self._missing_series.add(canary.key)
            log.warning(
                "operator_series_missing",
                canary=str(canary.key),
                series=missing,
                url=self.settings.operator_metrics_url,
                hint="the operator does not watch its namespace, or has not "
                "reconciled it since it started",
            )
        return judgement

    def bump_at(self, canary: Canary, judged: bool, now: float) -> float | None:
        """When a canary whose verdict is in is bumped next: back at its place in the
        cycle once an operator restart's fresh check is ``judged`` (bumps stay spread),
        else None: now, from the last answer's count as its baseline."""
        if judged and canary.key in self._realign:
            self._realign.discard(canary.key)
            timeout = self.settings.timeout
            offset = self._epoch + phase(canary) * timeout
            place = offset + math.ceil(max(0.0, now - offset) / timeout) * timeout
            if place - now > self.settings.scrape_interval:
                return place
        last = self.operator.last
        count = None if last is None else last.count(self._resource(canary))
        self.registry.baseline(canary, None if last is None else (self.operator.instance, count))
        return None

    def restart(self, started: float) -> list[tuple[float, Canary]]:
        """A new operator process answers: every canary is checked afresh (``pending``),
        bumped from ``started`` on over half a cycle in their order in the cycle (twice
        the steady rate, not N writes at once). Returns when each is due."""
        at = wall_time(self.operator.instance_since)
        metrics.OPERATOR_RESTARTS.inc()
        log.warning("operator_restarted", at=at, url=self.operator.url, canaries=len(self.registry))
        reason = f"operator restarted at {at}: re-checking"
        canaries = sorted(self.registry.tracked(), key=phase)
        step = self.settings.timeout / 2 / max(1, len(canaries))
        for canary in canaries:
            self.registry.fresh_check(canary, reason, "operator_restarted")
            self._realign.add(canary.key)
        return [(started + index * step, canary) for index, canary in enumerate(canaries)]

    def _resource(self, canary: Canary) -> ResourceKey:
        return (kind_of(canary.key.kind).kind, canary.key.namespace, canary.key.name)
