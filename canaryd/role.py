"""This replica's role and the ageing of its verdicts.

A replica bumps (``active``: single, or the leader under --leader-elect) or stands by (a
follower: no bumps, no new verdicts). A leader that stepped down without seeing another
holder (a lease hiccup) keeps its verdicts: nobody else has checked since. Whatever the
role, an ``unhealthy`` verdict that no bump has re-tested for two cycles turns
``unknown`` (Registry.no_verdict): a verdict nobody can re-test must not restart the
operator forever, whether the bumps fail, the leader's fence holds them back, or this
replica stands by.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from canaryd.config import Settings
from canaryd.events import Events
from canaryd.registry import Canary, CanaryKey, CanaryState, Registry

EVENT_REASONS = {
    CanaryState.UNHEALTHY: "Unhealthy",
    CanaryState.UNKNOWN: "Unknown",
    CanaryState.HEALTHY: "Recovered",
}


class Role:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        failing: Callable[[CanaryKey], bool],
        events: Events,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings, self.registry, self.events = settings, registry, events
        self._failing = failing
        """Whether a canary's writes are failing now: it ages at its next failed write,
        which names the cause (``no_bump``)."""
        self._clock = clock
        self.standby_reason: str | None = None
        """Why this replica does not bump (a follower under --leader-elect); None: it does."""
        self._verdicts_kept = False
        self._aging: asyncio.TimerHandle | None = None

    @property
    def active(self) -> bool:
        return self.standby_reason is None

    def stand_by(self, leader: str | None) -> None:
        """No longer bumping. ``leader``: another holder of the lease, or None when none
        is known (then this replica's verdicts stand, unless it had already dropped
        them); once another holder is seen, its verdicts are the ones that count and
        every canary here is ``pending`` with a standby reason."""
        keep = leader is None and (self._verdicts_kept or self.standby_reason is None)
        self._verdicts_kept = keep
        self.standby_reason = (
            f"standby: {leader} holds the lease" if leader else "standby: waiting for the lease"
        )
        for canary in self.registry.canaries():
            self.registry.standing_by(canary, None if keep else self.standby_reason)
        self.age_verdicts()

    def lead(self) -> None:
        """Bumping again: every canary starts fresh (``pending``) unless this replica
        kept its own verdicts."""
        kept, self._verdicts_kept = self._verdicts_kept, False
        self.standby_reason = None
        for canary in self.registry.canaries():
            if not kept or canary.state is CanaryState.PENDING:
                self.registry.set_state(
                    canary,
                    CanaryState.PENDING,
                    "waiting for the first bump to be judged",
                    "first_bump",
                )

    def verdict_ttl(self) -> float:
        """How long an unhealthy verdict stands without a bump to re-test it: two
        cycles, less the judge's slack. The second cycle's write falls due two cycles
        after the deadline whose judge reached the verdict, and either may run up to
        the slack late (the scheduler's tick, a busy loop): measured from the judge,
        the verdict would otherwise age a cycle late whenever the judge ran late."""
        return 2 * self.settings.timeout - self.settings.judge_slack

    def no_bump(self, canary: Canary, reason: str, cause: str) -> None:
        """Nothing to judge this cycle (``reason``, of class ``cause``): a failed write is
        no verdict either way; an unhealthy verdict older than ``verdict_ttl`` turns
        unknown."""
        before = canary.state
        self.registry.no_verdict(canary, reason, cause, self._clock(), self.verdict_ttl())
        self.told(canary, before)

    def told(self, canary: Canary, before: CanaryState) -> None:
        """A verdict that changed is an Event on the canary (canaryd.events): unhealthy,
        unknown, or recovered (healthy after a told unhealthy or unknown, whatever came
        between: a pending re-check, a stand-by), with its reason and its class."""
        reason = EVENT_REASONS.get(canary.state)
        recovered = reason == "Recovered"
        if reason is None or canary.state is before or (recovered and not canary.warned):
            return
        canary.warned = not recovered
        note = f"{canary.cause}: {canary.reason}"
        self.events.record(canary.key, canary.uid, reason, note)

    def judged_unhealthy(self) -> None:
        """A canary turned unhealthy: its verdict ages from now on."""
        if self._aging is None:
            self.age_verdicts()

    def age_verdicts(self) -> None:
        """Every half cycle while any canary is unhealthy: verdicts no bump re-tested
        (none is waiting to be judged, none failed to be written) for ``verdict_ttl``
        turn unknown."""
        self.stop()
        now, ttl = self._clock(), self.verdict_ttl()
        why = f"no bump written: {self.standby_reason or 'none could be sent'}"
        unhealthy = False
        for canary in self.registry.canaries():
            verdict = canary.verdict
            if canary.state is not CanaryState.UNHEALTHY or verdict is None:
                continue
            if (
                canary.bumped_generation is None
                and not self._failing(canary.key)
                and now - verdict.at >= ttl
            ):
                self.registry.no_verdict(canary, why, "not_written", now, ttl)
                self.told(canary, CanaryState.UNHEALTHY)
            unhealthy = unhealthy or canary.state is CanaryState.UNHEALTHY
        if unhealthy:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to age
                self._aging = asyncio.get_running_loop().call_later(
                    self.settings.timeout / 2, self.age_verdicts
                )

    def stop(self) -> None:
        if self._aging is not None:
            self._aging.cancel()
            self._aging = None
