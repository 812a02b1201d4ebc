"""The writer: one bump of a canary's ``spec.restartNonce``, applied at most once.

A merge patch with a ``metadata.resourceVersion`` precondition (each answer's meaning:
docs/DESIGN.md's semantics table). One whose outcome is unknown is resent identical: a
PATCH is not idempotent (RFC 9110 §9.2.2), the precondition makes this one so, and a 409
to it means "applied, or overtaken", which a re-read tells by the nonce. Under
--leader-elect every write first awaits ``permit()`` (canaryd.leader's fence).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from canaryd import metrics
from canaryd.backoff import Backoff
from canaryd.config import Settings
from canaryd.kube import MERGE_PATCH, ErrorKind, KubeClient, KubeError, object_path
from canaryd.registry import Canary, Registry

log = structlog.get_logger("canaryd.writer")


def bump_body(resource_version: str, nonce: int) -> str:
    """The merge patch of a bump: the precondition and spec.restartNonce, nothing else."""
    return json.dumps(
        {"metadata": {"resourceVersion": resource_version}, "spec": {"restartNonce": int(nonce)}},
        separators=(",", ":"),
    )


@dataclass(frozen=True, slots=True)
class Written:
    """The bump was applied: the generation it produced, to be judged."""

    generation: int
    sent: float  # when its PATCH was (first) sent: its stages run from it
    answered: float


@dataclass(frozen=True, slots=True)
class NotWritten:
    """No bump this cycle: nothing to judge. ``cause`` is a metric label."""

    cause: str
    reason: str


Outcome = Written | NotWritten | None
"""None: nothing for this record any more (dropped, replaced, no longer a canary, not
the leader, canaryd stopping)."""


@dataclass(frozen=True, slots=True)
class _Attempt:
    """One write as sent: resent only identical while its outcome is unknown."""

    body: str
    nonce: int
    repairing: str | None
    before: int  # the generation before it (its event may come before its answer)
    sent: float


class Writer:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        kube: KubeClient,
        *,
        permit: Callable[[float], Awaitable[float | None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings, self.registry, self.kube = settings, registry, kube
        self._clock = clock
        self._rng = random.Random()
        # Awaited right before every write, for at most ``within`` seconds (else
        # TimeoutError): its client timeout, or None once this replica may write no more.
        self.permit = permit
        self.stopping = False
        self.in_flight = 0  # writes sent and not answered yet
        self._none_in_flight = asyncio.Event()
        self._none_in_flight.set()

    async def finished(self) -> None:
        """Stopping: no write is sent any more; returns once the ones in flight were
        answered or abandoned (each within its own client timeout): the lease may be
        released then."""
        self.stopping = True
        if self.in_flight:
            log.info("finishing_writes", in_flight=self.in_flight)
        await self._none_in_flight.wait()

    async def _patch(self, path: str, attempt: _Attempt, time_limit: float) -> dict[str, Any]:
        self.in_flight += 1
        self._none_in_flight.clear()
        try:
            return await self.kube.request(
                "patch",
                "PATCH",
                path,
                data=attempt.body,
                content_type=MERGE_PATCH,
                time_limit=time_limit,
            )
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._none_in_flight.set()

    def _next_attempt(self, canary: Canary) -> _Attempt:
        repairing = canary.nonce_problem
        nonce = 1 if repairing else canary.nonce + 1
        before = max(canary.generation, canary.last_bumped_generation or 0)
        body = bump_body(canary.resource_version, nonce)
        return _Attempt(body, nonce, repairing, before, self._clock())

    async def bump(self, canary: Canary, due: float) -> Outcome:
        """Write restartNonce + 1 on the tracked copy; at most half a cycle of retries
        from ``due``. One loop: each failure's ErrorKind either ends the bump with its
        outcome or names the next request (a re-read, the same write) and the wait."""
        timeout = self.settings.timeout
        give_up_at = due + timeout / 2
        if not self.registry.owns(canary):
            return None
        if self._clock() > give_up_at:
            # It waited for a slot past its retry window: writes are backed up (slow
            # answers). Skipping keeps the scheduler's lag bounded.
            return NotWritten(
                "skipped", "no bump this cycle: bumps are backed up behind slow writes"
            )
        path = object_path(*canary.key)
        backoff = Backoff(self.settings.backoff_initial, self.settings.backoff_max, rng=self._rng)
        conflicts = 0
        reread = False
        unsure: _Attempt | None = None
        """A write whose outcome is unknown: resent identical, or learnt by a re-read."""
        gone: KubeError | None = None  # a 404 to the write: the re-read tells if transient
        while True:
            try:
                if reread:
                    fresh = await self._reread(canary, path)
                    if fresh is None:
                        return None
                    if gone is not None:
                        return NotWritten(
                            "gone_but_present",
                            f"bump answered {gone}, but the object is still there; retried "
                            "next cycle",
                        )
                    reread = False
                    if unsure is not None:
                        landed, unsure = unsure, None
                        if canary.nonce == landed.nonce:
                            # The write whose answer was lost was applied.
                            return self._written(canary, fresh, landed)
                try:
                    within = max(0.0, give_up_at - self._clock())
                    time_limit: float | None = self.settings.write_timeout
                    if self.permit is not None and not self.stopping:
                        time_limit = await self.permit(within)
                except TimeoutError:
                    return NotWritten(
                        "fenced",
                        "no bump this cycle: the leader's write fence stayed shut (its lease "
                        "renewals leave no time for a write before the renew deadline)",
                    )
                if time_limit is None or self.stopping or not self.registry.owns(canary):
                    return None
                # Made once the fence let it through: its stages run from its sending,
                # not from a wait for the lease (and it carries the freshest copy).
                attempt = unsure or self._next_attempt(canary)
                written = await self._patch(path, attempt, time_limit)
                if not self.registry.owns(canary):
                    return None
                return self._written(canary, written, attempt)
            except KubeError as err:
                if not self.registry.owns(canary):
                    return None  # a late answer about a record no longer tracked
                if gone is not None:
                    # Only the watch drops a canary: no DELETED may follow a transient 404.
                    if err.kind is ErrorKind.GONE:
                        return NotWritten(
                            "gone",
                            f"bump and re-read answered {gone}: paused until the watch "
                            "confirms (bumped again next cycle while the watch still shows it)",
                        )
                    return NotWritten(
                        "gone_unconfirmed", f"bump answered {gone}; re-read failed: {err}"
                    )
                delay = 0.0
                match err.kind:
                    case ErrorKind.CONFLICT:
                        metrics.CONFLICTS.inc()
                        reread = True
                        if unsure is None:  # else applied, or overtaken: the re-read tells
                            conflicts += 1
                            if conflicts > self.settings.max_conflict_retries:
                                return NotWritten(
                                    "conflict_exhausted",
                                    f"{conflicts} conflicts in a row; no bump this cycle",
                                )
                            # Jittered, so two writers that collided do not collide again.
                            delay = self._rng.uniform(0, min(0.05, timeout / 20))
                    case ErrorKind.GONE:
                        gone, reread = err, True  # a CRD being re-registered, or gone?
                    case ErrorKind.FORBIDDEN:
                        return NotWritten(
                            "forbidden", f"canaryd may not write it (retried next cycle): {err}"
                        )
                    case ErrorKind.INVALID:
                        return NotWritten("invalid", f"bump rejected: {err}")
                    case _:
                        if not reread and err.reason != "Credentials":
                            # It may have reached the server: the retry is this very
                            # request (a failed re-read keeps what it was to tell).
                            unsure = attempt
                        delay = backoff.next()
                        if err.retry_after is not None:
                            # Honoured, but never a tight loop (Retry-After: 0).
                            delay = max(err.retry_after, self.settings.backoff_initial)
                        if self._clock() + delay > give_up_at:
                            return NotWritten("failed", f"bump failed: {err}")
                if delay:
                    await asyncio.sleep(delay)
                    if not self.registry.owns(canary):
                        return None

    async def _reread(self, canary: Canary, path: str) -> Mapping[str, Any] | None:
        """The canary re-read (raises KubeError); None when it is not the one tracked."""
        fresh = await self.kube.request("get", "GET", path)
        gone = self.registry.reread(canary, fresh)
        if gone is None:
            return fresh
        metrics.BUMPS.labels("replaced" if gone == "replaced" else "not_canary").inc()
        return None

    def _written(self, canary: Canary, written: Mapping[str, Any], attempt: _Attempt) -> Outcome:
        metadata = written.get("metadata")
        generation = metadata.get("generation") if isinstance(metadata, Mapping) else None
        self.registry.refresh(canary, written)
        if not isinstance(generation, int) or isinstance(generation, bool):
            return NotWritten(
                "no_generation", "the API server answered the bump without a generation"
            )
        if generation <= attempt.before:
            # The server took the nonce as no change: there is no new generation for
            # the operator to reconcile, so there is nothing to judge.
            return NotWritten(
                "no_change",
                f"the bump was answered with generation {generation}, not above {attempt.before}",
            )
        if attempt.repairing:
            log.warning(
                "canary_nonce_repaired",
                canary=str(canary.key),
                problem=attempt.repairing,
                nonce=attempt.nonce,
            )
        return Written(generation, attempt.sent, self._clock())
