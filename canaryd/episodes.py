"""Failures of many subjects told as episodes, so that an outage stays readable.

An API server outage makes every canary's bump fail and every watch retry; logging
each would write a line per canary per cycle (745 lines for a 30 s outage of 300
canaries on a 10 s cycle; over four thousand with 200 watches). An ``Episodes``
log tells it as an operator on call reads it:

- ``<name>_started`` (warning) once per cause when the first subject fails with it,
  naming that subject and the error;
- ``<name>_ongoing`` (warning) at most once per interval (the cycle) while any
  subject fails: how many, by cause, which (the first few), one example error;
- ``<name>_ended`` (info) when the last failing subject recovers or is gone: how
  long it lasted and how many subjects it touched;
- ``<name>_still_failing`` (info) when canaryd stops telling it while subjects still
  fail (it stops, or restarts the task that told it): not an end.

Each subject's own failure is logged at debug (``detail_event``), with its error.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import structlog

SHOWN = 10
"""How many failing subjects a summary names."""


class Episodes:
    def __init__(
        self,
        name: str,
        *,
        subject: str,
        subjects: str,
        detail_event: str,
        interval: Callable[[], float],
        logger_name: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.subject = subject
        """The log field that names a subject (``canary``, ``scope``)."""
        self.subjects = subjects
        """The summary's field that names the failing ones (``canaries``, ``scopes``)."""
        self.detail_event = detail_event
        self._interval = interval
        self._clock = clock
        self._log = structlog.get_logger(logger_name)
        self._failing: dict[Hashable, str] = {}
        """Each failing subject's cause (errors are not kept: one example is)."""
        self._example = ""
        self._announced: set[str] = set()
        self._affected = 0
        """Subjects that started failing in this episode (counted, not kept: an episode
        one subject keeps open must not hold every other that came and went)."""
        self._started_at = self._summarised_at = 0.0

    @property
    def failing(self) -> int:
        return len(self._failing)

    def cause(self, subject: Hashable) -> str | None:
        """Why ``subject`` fails now (None: it does not)."""
        return self._failing.get(subject)

    def failed(self, subject: Hashable, cause: str, error: str) -> None:
        """``subject`` failed (again) with ``cause``; ``error`` says how."""
        now = self._clock()
        self._log.debug(self.detail_event, **{self.subject: str(subject)}, cause=cause, error=error)
        if not self._failing:
            self._started_at = self._summarised_at = now
        if subject not in self._failing:
            self._affected += 1
        self._failing[subject] = cause
        self._example = error
        if cause not in self._announced:
            self._announced.add(cause)
            self._log.warning(
                f"{self.name}_started", cause=cause, **{self.subject: str(subject)}, error=error
            )
        else:
            self._summarise(now)

    def recovered(self, subject: Hashable | None = None) -> None:
        """``subject`` works again, or is no longer tracked; None: every subject (what
        is not retried, such as an Event, ends with the first that works again)."""
        if not self._failing:
            return
        if subject is not None:
            if self._failing.pop(subject, None) is None:
                return
            if self._failing:
                self._summarise(self._clock())
                return
        self._log.info(
            f"{self.name}_ended",
            lasted=round(self._clock() - self._started_at, 3),
            affected=self._affected,
            causes=sorted(self._announced),
        )
        self._end()

    def stopped(self, why: str) -> None:
        """Nothing is tried any more (canaryd stops, or the task that tried restarts):
        an episode still going is told as still failing, never as ended."""
        if self._failing:
            lasted = round(self._clock() - self._started_at, 3)
            self._log.info(
                f"{self.name}_still_failing",
                why=why,
                **self._told(),
                lasted=lasted,
                affected=self._affected,
            )
            self._end()

    def _end(self) -> None:
        self._failing.clear()
        self._announced.clear()
        self._affected = 0

    def _summarise(self, now: float) -> None:
        if now - self._summarised_at < self._interval():
            return
        self._summarised_at = now
        lasting = round(now - self._started_at, 3)
        self._log.warning(
            f"{self.name}_ongoing", **self._told(), example=self._example, lasting=lasting
        )

    def _told(self) -> dict[str, Any]:
        """How many subjects fail, by cause, and which (the first few)."""
        names = sorted(str(subject) for subject in self._failing)
        return {
            "failing": len(names),
            "causes": dict(sorted(Counter(self._failing.values()).items())),
            self.subjects: names[:SHOWN],
            "more": max(0, len(names) - SHOWN),
        }
