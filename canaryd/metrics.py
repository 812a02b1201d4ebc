"""Prometheus metrics, in canaryd's own registry (no process-global default collectors).

Every swallowed exception counts in ``ERRORS`` with the place it happened.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

REGISTRY = CollectorRegistry(auto_describe=True)


API_REQUESTS = Counter(
    "canaryd_api_requests",
    "Kubernetes API requests by verb and HTTP code ('error': no answer).",
    ["verb", "code"],
    registry=REGISTRY,
)
BUMPS = Counter(
    "canaryd_bumps",
    "Nonce bumps by result: written, or why none was: failed (transient), skipped, "
    "conflict_exhausted, forbidden, invalid, gone, gone_unconfirmed, gone_but_present, "
    "not_canary, replaced (a re-read found a new object of the name), no_change, "
    "no_generation.",
    ["result"],
    registry=REGISTRY,
)
UNSCHEDULED = Gauge(
    "canaryd_canaries_unscheduled",
    "Tracked canaries that are neither due nor in flight exactly once while this replica "
    "bumps: 0, always (a canary out of the schedule would never be checked again).",
    registry=REGISTRY,
)
BUMPS_IN_FLIGHT = Gauge(
    "canaryd_bumps_in_flight",
    "Bumps being written now (waiting for an answer, a retry or the leader's fence; at most 256).",
    registry=REGISTRY,
)
BUMP_STAGES = ("answered", "observed", "reconciled")
BUMP_DURATION = Histogram(
    "canaryd_bump_duration_seconds",
    "How long a bump takes to travel, on the monotonic clock from the moment its PATCH "
    "is sent, by stage: answered (the write's answer), observed (the watch event with "
    "its generation: on a real server it can come before the answer), reconciled "
    "(status.observedGeneration reached it).",
    ["kind", "stage"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
    registry=REGISTRY,
)


@functools.lru_cache(maxsize=64)
def _stage(kind: str, stage: str) -> Any:
    return BUMP_DURATION.labels(kind, stage)


def bump_stage(kind: str, stage: str, seconds: float) -> None:
    """One bump's time to ``stage`` (the labelled child looked up once: two or three
    per bump)."""
    _stage(kind, stage).observe(seconds)


def bump_stages_exported(kind: str) -> None:
    """A kind's stage histograms exist (empty) from the moment it is watched."""
    for stage in BUMP_STAGES:
        BUMP_DURATION.labels(kind, stage)


CONFLICTS = Counter(
    "canaryd_conflicts_total",
    "409 Conflicts on bumps (each one re-reads the object).",
    registry=REGISTRY,
)
VERDICTS = Counter(
    "canaryd_verdicts",
    "Bumps judged at their deadline: healthy or unhealthy; or why not yet: deferred (the "
    "watch not in sync), suspected (canaryd's own watch replaced), rechecked (a late "
    "judge), unreachable (no verdict: the API server away).",
    ["verdict"],
    registry=REGISTRY,
)
VERDICT_LATENESS = Histogram(
    "canaryd_verdict_lateness_seconds",
    "How late after its deadline a bump was judged.",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
DROPPED = Counter(
    "canaryd_canaries_dropped_total",
    "Canaries no longer tracked, by reason.",
    ["reason"],
    registry=REGISTRY,
)
WATCH_RESTARTS = Counter(
    "canaryd_watch_restarts_total",
    "Watch streams re-opened, by resource and why: ended (server timeout), dropped, idle, "
    "short (ended at once), expired (410), suspected (half-open, replaced), error, "
    "forbidden, gone.",
    ["resource", "why"],
    registry=REGISTRY,
)
RELISTS = Counter(
    "canaryd_relists_total",
    "Full lists, by resource (the first one and every one after 410 Expired).",
    ["resource"],
    registry=REGISTRY,
)
ERRORS = Counter(
    "canaryd_errors_total",
    "Exceptions handled without stopping, by where they happened.",
    ["where"],
    registry=REGISTRY,
)
CONFIG_RELOADS = Counter(
    "canaryd_config_reloads_total",
    "Operator config re-reads, by result (changed, unchanged, failed).",
    ["result"],
    registry=REGISTRY,
)
WATCHED_NAMESPACES = Gauge(
    "canaryd_watched_namespaces",
    "Watched namespaces that are not terminating (when all are watched: every namespace "
    "the Namespaces watch knows).",
    registry=REGISTRY,
)
BAD_HTTP_REQUESTS = Counter(
    "canaryd_http_bad_requests_total",
    "Malformed HTTP requests to the health port (answered 400, logged at most once a cycle).",
    registry=REGISTRY,
)
HTTP_CONNECTIONS_DROPPED = Counter(
    "canaryd_http_connections_dropped_total",
    "Connections to the health port closed by canaryd: header_timeout (a request head "
    "not complete in time), headers_too_large (answered 431), chunked_body (answered "
    "411), too_many (closed to make room for a new one at the cap, or a new one "
    "refused), answer_unread (no next request long after the last: its answer not read).",
    ["reason"],
    registry=REGISTRY,
)
LEADER = Gauge(
    "canaryd_leader",
    "1 while this replica writes bumps: always without --leader-elect; with it, while "
    "it holds the Lease.",
    registry=REGISTRY,
)
OPERATOR_SCRAPES = Counter(
    "canaryd_operator_scrapes_total",
    "Reads of the operator's metrics (--reconciled-by operator-metrics) by result: ok, "
    "refused (nothing listens: starting or gone), unanswered (accepted, no answer: "
    "frozen?), bad_answer.",
    ["result"],
    registry=REGISTRY,
)
OPERATOR_RESTARTS = Counter(
    "canaryd_operator_restarts",
    "Times the operator's metrics showed a new operator process (its canaries are "
    "then checked afresh).",
    registry=REGISTRY,
)
OPERATOR_SCRAPE_RESULTS = ("ok", "refused", "unanswered", "bad_answer")


def operator_metrics_exported() -> None:
    """--reconciled-by operator-metrics: its read counters are exported at 0."""
    for result in OPERATOR_SCRAPE_RESULTS:
        OPERATOR_SCRAPES.labels(result)


LEADER_TRANSITIONS = Counter(
    "canaryd_leader_transitions",
    "Times this replica saw the Lease pass to a new holder (itself included).",
    registry=REGISTRY,
)


# Every label value the code uses, so that each labelled counter is exported at 0 from
# the start: an alert on increase() cannot see a series' first step from absent to 1.
BUMP_RESULTS = (
    "written",
    "failed",
    "skipped",
    "conflict_exhausted",
    "forbidden",
    "invalid",
    "gone",
    "gone_unconfirmed",
    "gone_but_present",
    "not_canary",
    "replaced",
    "no_change",
    "no_generation",
)
VERDICT_KINDS = (
    "healthy",
    "unhealthy",
    "deferred",
    "rechecked",
    "suspected",
    "unreachable",
    "operator_unavailable",
)
DROP_REASONS = (
    "deleted",
    "not_canary",
    "being_deleted",
    "namespace_closed",
    "namespace_unwatched",
    "relisted",
    "replaced",
    "gone",
    "forbidden",
)
ERROR_PLACES = (
    "access_review",
    "credentials",
    "discovery",
    "malformed_object",
    "request",
    "scheduler",
    "sd_notify",
    "stale_copy",
    "watch",
    "watch_decode",
    "watch_request",
    "watchdog_withheld",
    *(f"task_{task}" for task in ("watcher", "scheduler", "config", "credentials", "leader")),
)
WATCH_RESTART_WHYS = (
    "ended",
    "dropped",
    "idle",
    "short",
    "expired",
    "suspected",
    "error",
    "forbidden",
    "gone",
)
CONFIG_RELOAD_RESULTS = ("changed", "unchanged", "failed")
HTTP_DROP_REASONS = (
    "header_timeout",
    "headers_too_large",
    "chunked_body",
    "too_many",
    "answer_unread",
)

for _values, _counter in (
    (BUMP_RESULTS, BUMPS),
    (VERDICT_KINDS, VERDICTS),
    (DROP_REASONS, DROPPED),
    (ERROR_PLACES, ERRORS),
    (CONFIG_RELOAD_RESULTS, CONFIG_RELOADS),
    (HTTP_DROP_REASONS, HTTP_CONNECTIONS_DROPPED),
):
    for _value in _values:
        _counter.labels(_value)


def watching(resource: str) -> None:
    """A watch of ``resource`` starts: its restart counters are exported at 0."""
    for why in WATCH_RESTART_WHYS:
        WATCH_RESTARTS.labels(resource, why)


class HasCounts(Protocol):
    def counts(self) -> Mapping[str, int]: ...


class StateCollector(Collector):
    """Read at scrape time: ``canaryd_canaries{state}`` from the registry's counts, and
    ``canaryd_ready`` (1 when /readyz answers 200) from ``not_ready``."""

    def __init__(
        self,
        source: HasCounts,
        not_ready: Callable[[], Sequence[str] | None] = lambda: None,
        scopes: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        self._source = source
        self._not_ready = not_ready
        self._scopes = scopes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "canaryd_canaries", "Tracked canaries by state.", labels=["state"]
        )
        for state, count in self._source.counts().items():
            family.add_metric([state], count)
        yield family
        yield GaugeMetricFamily(
            "canaryd_ready",
            "1 when every watch scope is listed and connected (/readyz 200), else 0.",
            value=0 if self._not_ready() else 1,
        )
        scopes = GaugeMetricFamily(
            "canaryd_watch_scopes",
            "Wanted watch scopes by state: listed, waiting, forbidden (403), gone (404), "
            "namespace_missing, kind_not_served, patch_forbidden (an access review refused "
            "patch there; a scope that cannot exist is counted too).",
            labels=["state"],
        )
        for state, count in self._scopes().items():
            scopes.add_metric([state], count)
        yield scopes


def _build_and_process() -> Gauge:
    """What runs (issue 33): ``canaryd_build_info{version,python}`` 1, and the process
    collector's ``process_*`` series (CPU, resident memory, open files, start time), in
    canaryd's own registry. Imported here to keep this addition in one place."""
    import platform

    from prometheus_client import ProcessCollector

    from canaryd import __version__

    info = Gauge(
        "canaryd_build_info",
        "1, labelled with canaryd's version and the Python it runs on.",
        ["version", "python"],
        registry=REGISTRY,
    )
    info.labels(__version__, platform.python_version()).set(1)
    ProcessCollector(registry=REGISTRY)
    return info


BUILD_INFO = _build_and_process()
