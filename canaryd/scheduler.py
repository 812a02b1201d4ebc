"""The scheduler: per canary, every cycle, judge the previous bump, then write the next.

One task walks a deadline heap (not a task per canary); each due canary gets a short
task for its judge-and-bump, at most ``max_concurrent_bumps`` at once. A canary's
first bump is placed at a stable offset within the cycle (a hash of its identity),
so N canaries spread over the cycle instead of firing N writes at once.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import random
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from canaryd import logs, metrics
from canaryd.backoff import Backoff
from canaryd.config import Settings
from canaryd.kube import KINDS, MERGE_PATCH, ErrorKind, KubeClient, KubeError
from canaryd.registry import Canary, CanaryState, Registry

log = structlog.get_logger("canaryd.scheduler")
WRITTEN = metrics.BUMPS.labels("written")
HEALTHY_VERDICTS = metrics.VERDICTS.labels("healthy")
UNHEALTHY_VERDICTS = metrics.VERDICTS.labels("unhealthy")


def bump_body(resource_version: str, nonce: int) -> str:
    """The merge patch of a bump: the precondition and spec.restartNonce, nothing else.

    Serialised by hand (it is the hot path); ``json.dumps`` quotes the opaque
    resourceVersion.
    """
    return (
        f'{{"metadata":{{"resourceVersion":{json.dumps(resource_version)}}},'
        f'"spec":{{"restartNonce":{int(nonce)}}}}}'
    )


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
        self._wake = asyncio.Event()
        self._rng = random.Random()
        registry.on_added = self.schedule_first

    # ------------------------------------------------------------ the heap

    def schedule_first(self, canary: Canary) -> None:
        fraction = zlib.crc32(str(canary.key).encode()) / 2**32
        self._push(self._clock() + fraction * self.settings.timeout, canary)

    def _push(self, due: float, canary: Canary) -> None:
        heapq.heappush(self._heap, (due, next(self._order), canary))
        if self._heap[0][2] is canary:
            self._wake.set()

    def lag(self) -> float:
        """How far behind its heap the scheduler is (0 when nothing is overdue)."""
        if not self._heap:
            return 0.0
        return max(0.0, self._clock() - self._heap[0][0])

    async def _next_due(self) -> tuple[float, Canary]:
        while True:
            if not self._heap:
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = self._heap[0][0] - self._clock()
            if delay <= 0:
                due, _, canary = heapq.heappop(self._heap)
                return due, canary
            self._wake.clear()
            try:
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def run(self) -> None:
        slots = asyncio.Semaphore(self.settings.max_concurrent_bumps)
        try:
            async with asyncio.TaskGroup() as group:
                while True:
                    _, canary = await self._next_due()
                    if not self.registry.owns(canary):
                        continue  # dropped since it was scheduled
                    await slots.acquire()
                    group.create_task(self._cycle(canary, slots))
        except asyncio.CancelledError:
            log.info("scheduler_stopped", why="cancelled")
            raise

    async def _cycle(self, canary: Canary, slots: asyncio.Semaphore) -> None:
        next_due: float | None
        try:
            self.judge_previous_bump(canary)
            next_due = await self.bump_nonce(canary)
        except Exception:
            # A bug must not stop the scheduler: say so, count it, try next cycle.
            metrics.ERRORS.labels("scheduler").inc()
            log.exception("cycle_failed_unexpectedly", canary=str(canary.key))
            next_due = self._unknown(canary, self._clock(), "internal error; see logs")
        finally:
            slots.release()
        if next_due is not None and self.registry.owns(canary):
            self._push(next_due, canary)

    # ------------------------------------------------------------- judging

    def judge_previous_bump(self, canary: Canary) -> None:
        """Healthy if the watch has seen the bumped generation by the deadline."""
        bumped = canary.bumped_generation
        if bumped is None:
            return  # the last cycle wrote nothing: nothing to judge
        deadline = canary.bump_deadline if canary.bump_deadline is not None else self._clock()
        metrics.VERDICT_LATENESS.observe(max(0.0, self._clock() - deadline))
        canary.bumped_generation = None
        if canary.generation >= bumped:
            HEALTHY_VERDICTS.inc()
            self.registry.set_state(
                canary, CanaryState.HEALTHY, f"generation {bumped} observed in time"
            )
        else:
            UNHEALTHY_VERDICTS.inc()
            reason = (
                f"generation {bumped} not observed within "
                f"{self.settings.timeout:g}s (latest observed {canary.generation})"
            )
            log.warning("canary_unhealthy", canary=str(canary.key), reason=reason)
            self.registry.set_state(canary, CanaryState.UNHEALTHY, reason)

    # ------------------------------------------------------------- bumping

    async def bump_nonce(self, canary: Canary) -> float | None:
        """Write restartNonce + 1 with a resourceVersion precondition.

        Returns when the next cycle is due, or None when the canary was dropped.
        """
        timeout = self.settings.timeout
        started = self._clock()
        give_up_at = started + timeout / 2
        backoff: Backoff | None = None  # made on the first transient failure only
        path = KINDS[canary.key.kind].object_path(canary.key.namespace, canary.key.name)
        conflicts, reread = 0, False
        while True:
            if not self.registry.owns(canary):
                return None
            try:
                if reread:
                    fresh = await self.kube.request("get", "GET", path)
                    if not self.registry.reread(canary, fresh):
                        metrics.BUMPS.labels("not_canary").inc()
                        return None
                    reread = False
                repairing = canary.nonce_problem
                nonce = 1 if repairing else canary.nonce + 1
                written = await self.kube.request(
                    "patch",
                    "PATCH",
                    path,
                    data=bump_body(canary.resource_version, nonce),
                    content_type=MERGE_PATCH,
                )
            except KubeError as err:
                if err.kind is ErrorKind.CONFLICT:
                    metrics.CONFLICTS.inc()
                    conflicts += 1
                    if conflicts > self.settings.max_conflict_retries:
                        metrics.BUMPS.labels("conflict_exhausted").inc()
                        return self._unknown(
                            canary, started, f"{conflicts} conflicts in a row; no bump this cycle"
                        )
                    reread = True
                    # Jittered, so two writers that collided do not collide again.
                    await asyncio.sleep(self._rng.uniform(0, min(0.05, timeout / 20)))
                    continue
                if err.kind in (ErrorKind.GONE, ErrorKind.FORBIDDEN):
                    metrics.BUMPS.labels(err.kind.value).inc()
                    self.registry.forget(canary.key, err.kind.value, f"bump answered {err}")
                    return None
                if err.kind is ErrorKind.INVALID:
                    metrics.BUMPS.labels("invalid").inc()
                    log.error("bump_rejected", canary=str(canary.key), error=str(err))
                    return self._unknown(canary, started, f"bump rejected: {err}")
                if backoff is None:
                    initial = min(self.settings.backoff_initial, timeout / 10)
                    backoff = Backoff(
                        initial, max(initial, self.settings.backoff_max), rng=self._rng
                    )
                delay = err.retry_after if err.retry_after is not None else backoff.next()
                if self._clock() + delay > give_up_at:
                    metrics.BUMPS.labels("failed").inc()
                    log.warning("bump_failed", canary=str(canary.key), error=str(err))
                    return self._unknown(canary, started, f"bump failed: {err}")
                log.info(
                    "bump_retry", canary=str(canary.key), error=str(err), retry_in=round(delay, 3)
                )
                await asyncio.sleep(delay)
                continue
            return self._written(canary, written, nonce, repairing)

    def _written(
        self, canary: Canary, written: Mapping[str, Any], nonce: int, repaired: str | None
    ) -> float:
        now = self._clock()
        metadata = written.get("metadata") or {}
        generation = metadata.get("generation") if isinstance(metadata, Mapping) else None
        self.registry.refresh(canary, written)
        WRITTEN.inc()
        if repaired:
            log.warning(
                "canary_nonce_repaired", canary=str(canary.key), problem=repaired, nonce=nonce
            )
        if not isinstance(generation, int) or isinstance(generation, bool):
            self.registry.set_state(
                canary, CanaryState.UNKNOWN, "the API server answered the bump without a generation"
            )
            return now + self.settings.timeout
        deadline = now + self.settings.timeout
        self.registry.record_bump(canary, generation, deadline, time.time())
        if logs.debug_enabled():
            log.debug("bumped", canary=str(canary.key), nonce=nonce, generation=generation)
        return deadline

    def _unknown(self, canary: Canary, started: float, reason: str) -> float:
        canary.bumped_generation = None
        self.registry.set_state(canary, CanaryState.UNKNOWN, reason)
        return started + self.settings.timeout
