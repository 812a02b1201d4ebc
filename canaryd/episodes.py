"""Failures of many subjects told as episodes, so that an outage is not a line per subject
per cycle: ``<name>_started`` once per cause, ``_ongoing`` at most once an interval,
``_ended``, or ``_still_failing`` when canaryd stops telling one (docs/CONFIGURATION.md#logs);
each subject's own failure at debug (``detail_event``)."""

import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import structlog

SHOWN = 10  # failing subjects a summary names

log = structlog.get_logger("canaryd.episodes")


class Episodes:
    def __init__(
        self,
        name: str,
        subject: str,
        interval: Callable[[], float],
        subjects: str | None = None,
        detail_event: str | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``subject`` names the log field of one (``scope``), ``subjects`` the summary's
        list (default: ``subject`` + s), ``detail_event`` each failure's debug line."""
        self.name = name
        self.subject = subject
        self.subjects = subjects or f"{subject}s"
        self.detail_event = detail_event or name.replace("_failures", "_failed")
        self._interval = interval
        self._clock = clock
        self._failing: dict[Hashable, str] = {}
        """Each failing subject's cause (errors are not kept: one example is)."""
        self._example = ""
        self._announced: set[str] = set()
        self._affected = 0
        """Subjects that started failing in this episode (counted, not kept: an episode
        one subject keeps open must not hold every other that came and went)."""
        self._started_at = self._summarised_at = 0.0

    def cause(self, subject: Hashable) -> str | None:
        return self._failing.get(subject)

    def failed(self, subject: Hashable, cause: str, error: str) -> None:
        now = self._clock()
        named = {self.subject: str(subject)}
        log.debug(self.detail_event, **named, cause=cause, error=error)
        if not self._failing:
            self._started_at = self._summarised_at = now
        if subject not in self._failing:
            self._affected += 1
        self._failing[subject] = cause
        self._example = error
        if cause not in self._announced:
            self._announced.add(cause)
            log.warning(f"{self.name}_started", cause=cause, **named, error=error)
        else:
            self._summarise(now)

    def recovered(self, subject: Hashable | None = None) -> None:
        """``subject`` works again, or is no longer tracked; None: every subject (what
        is not retried, such as an Event, ends with the first that works again)."""
        if subject is not None:
            if self._failing.pop(subject, None) is None:
                return
            if self._failing:
                self._summarise(self._clock())
                return
        elif not self._failing:
            return
        log.info(f"{self.name}_ended", causes=sorted(self._announced), **self._end())

    def stopped(self, why: str) -> None:
        """Nothing is tried any more: an episode still going is told as still failing, not ended."""
        if self._failing:  # told before its end clears it
            log.info(f"{self.name}_still_failing", why=why, **self._told(), **self._end())

    def _end(self) -> dict[str, Any]:
        ended = {"lasted": round(self._clock() - self._started_at, 3), "affected": self._affected}
        self._failing.clear()
        self._announced.clear()
        self._affected = 0
        return ended

    def _summarise(self, now: float) -> None:
        if now - self._summarised_at < self._interval():
            return
        self._summarised_at = now
        lasting = round(now - self._started_at, 3)
        log.warning(f"{self.name}_ongoing", **self._told(), example=self._example, lasting=lasting)

    def _told(self) -> dict[str, Any]:
        names = sorted(str(subject) for subject in self._failing)
        return {
            "failing": len(names),
            "causes": dict(sorted(Counter(self._failing.values()).items())),
            self.subjects: names[:SHOWN],
            "more": max(0, len(names) - SHOWN),
        }
