"""Prometheus metrics, in canaryd's own registry (no process-global default collectors):
the series canaryd writes, each labelled counter an alert reads exported at 0 with every
label value it takes (an alert on increase() cannot see a series' first step from absent
to 1), the state read at scrape time (StateCollector), and what runs (build and process).

Every swallowed exception counts in ``ERRORS`` with the place it happened.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from canaryd import __version__

REGISTRY = CollectorRegistry(auto_describe=True)


def _counter(
    name: str, documentation: str, labels: Sequence[str] = (), exported: Iterable[str] = ()
) -> Counter:
    """A counter in REGISTRY, exported at 0 with each of the label values ``exported``."""
    counter = Counter(name, documentation, labels, registry=REGISTRY)
    for value in exported:
        counter.labels(value)
    return counter


API_REQUESTS = _counter(
    "canaryd_api_requests",
    "Kubernetes API requests by verb and HTTP code ('error': no answer).",
    ["verb", "code"],
)
BUMP_RESULTS = (
    "written",
    "failed",
    "skipped",
    "fenced",
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
BUMPS = _counter(
    "canaryd_bumps",
    "Nonce bumps by result: written, or why none was: failed (transient), skipped, "
    "fenced (held at the leader's write fence past its retry window), "
    "conflict_exhausted, forbidden, invalid, gone, gone_unconfirmed, gone_but_present, "
    "not_canary, replaced (a re-read found a new object of the name), no_change, "
    "no_generation.",
    ["result"],
    BUMP_RESULTS,
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


def bump_stage(kind: str, stage: str, seconds: float) -> None:
    """One bump's time to ``stage``."""
    BUMP_DURATION.labels(kind, stage).observe(seconds)


def bump_stages_exported(kind: str) -> None:
    """A kind's stage histograms exist (empty) from the moment it is watched."""
    for stage in ("answered", "observed", "reconciled"):
        BUMP_DURATION.labels(kind, stage)


CONFLICTS = _counter(
    "canaryd_conflicts_total", "409 Conflicts on bumps (each one re-reads the object)."
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
VERDICTS = _counter(
    "canaryd_verdicts",
    "Bumps judged at their deadline: healthy or unhealthy; or why not yet: deferred (the "
    "watch not in sync), suspected (canaryd's own watch replaced), rechecked (a late "
    "judge), unreachable (no verdict: the API server away).",
    ["verdict"],
    VERDICT_KINDS,
)
VERDICT_LATENESS = Histogram(
    "canaryd_verdict_lateness_seconds",
    "How late after its deadline a bump was judged.",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
DROPPED = _counter(
    "canaryd_canaries_dropped_total",
    "Canaries no longer tracked, by reason.",
    ["reason"],
    (
        "deleted",
        "not_canary",
        "being_deleted",
        "namespace_closed",
        "namespace_unwatched",
        "relisted",
        "replaced",
        "gone",
        "forbidden",
    ),
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
WATCH_RESTARTS = _counter(
    "canaryd_watch_restarts_total",
    "Watch streams re-opened, by resource and why: ended (server timeout), dropped, idle, "
    "short (ended at once), expired (410), suspected (half-open, replaced), error, "
    "forbidden, gone.",
    ["resource", "why"],
)


def watching(resource: str) -> None:
    """A watch of ``resource`` starts: its restart counters are exported at 0."""
    for why in WATCH_RESTART_WHYS:
        WATCH_RESTARTS.labels(resource, why)


RELISTS = _counter(
    "canaryd_relists_total",
    "Full lists, by resource (the first one and every one after 410 Expired).",
    ["resource"],
)
ERROR_PLACES = (
    "credentials",
    "malformed_object",
    "operator_account",
    "request",
    "scheduler",
    "sd_notify",
    "stale_copy",
    "watch",
    "watch_decode",
    "watch_request",
    "watchdog_withheld",
    *(f"task_{t}" for t in ("watcher", "scheduler", "config", "credentials", "leader", "events")),
)
ERRORS = _counter(
    "canaryd_errors_total",
    "Exceptions handled without stopping, by where they happened.",
    ["where"],
    ERROR_PLACES,
)
CONFIG_RELOADS = _counter(
    "canaryd_config_reloads_total",
    "Operator config re-reads, by result (changed, unchanged, failed).",
    ["result"],
    ("changed", "unchanged", "failed"),
)
WATCHED_NAMESPACES = Gauge(
    "canaryd_watched_namespaces",
    "Watched namespaces that are not terminating (when all are watched: every namespace "
    "the Namespaces watch knows).",
    registry=REGISTRY,
)
BAD_HTTP_REQUESTS = _counter(
    "canaryd_http_bad_requests_total",
    "Malformed HTTP requests to the health port (answered 400, logged at most once a cycle).",
)
HTTP_CONNECTIONS_DROPPED = _counter(
    "canaryd_http_connections_dropped_total",
    "Connections to the health port closed by canaryd: header_timeout (a request head "
    "not complete in time), headers_too_large (answered 431), chunked_body (answered "
    "411), too_many (closed to make room for a new one at the cap, or a new one "
    "refused), answer_unread (no next request long after the last: its answer not read).",
    ["reason"],
    ("header_timeout", "headers_too_large", "chunked_body", "too_many", "answer_unread"),
)
LEADER = Gauge(
    "canaryd_leader",
    "1 while this replica writes bumps: always without --leader-elect; with it, while "
    "it holds the Lease.",
    registry=REGISTRY,
)
OPERATOR_SCRAPES = _counter(
    "canaryd_operator_scrapes_total",
    "Reads of the operator's metrics (--reconciled-by operator-metrics) by result: ok, "
    "refused (nothing listens: starting or gone), unanswered (accepted, no answer: "
    "frozen?), bad_answer.",
    ["result"],
)
OPERATOR_RESTARTS = _counter(
    "canaryd_operator_restarts",
    "Times the operator's metrics showed a new operator process (its canaries are "
    "then checked afresh).",
)


def operator_metrics_exported() -> None:
    """--reconciled-by operator-metrics: its read counters are exported at 0."""
    for result in ("ok", "refused", "unanswered", "bad_answer"):
        OPERATOR_SCRAPES.labels(result)


LEADER_TRANSITIONS = _counter(
    "canaryd_leader_transitions",
    "Times this replica saw the Lease pass to a new holder (itself included).",
)


class HasCounts(Protocol):
    def counts(self) -> Mapping[str, int]: ...


def _by_state(name: str, documentation: str, counts: Mapping[str, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["state"])
    for state, count in counts.items():
        family.add_metric([state], count)
    return family


class StateCollector(Collector):
    """Read at scrape time: ``canaryd_canaries{state}`` from the registry's counts,
    ``canaryd_ready`` (1 when /readyz answers 200) from ``not_ready``, and
    ``canaryd_watch_scopes{state}`` from ``scopes``, and ``canaryd_canary_state``: 1 for
    each of the ``canaries`` (``canaryd.registry.Canary``), labelled with its state and
    its reason's class (a dropped canary has no series: nothing is kept to remove;
    ``canary_namespace``, since Prometheus' scrape sets ``namespace``, the target's)."""

    def __init__(
        self,
        source: HasCounts,
        not_ready: Callable[[], Sequence[str] | None] = lambda: None,
        scopes: Callable[[], Mapping[str, int]] = dict,
        canaries: Callable[[], Iterable[Any]] = tuple,
    ) -> None:
        self._source = source
        self._not_ready = not_ready
        self._scopes = scopes
        self._canaries = canaries

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield _by_state("canaryd_canaries", "Tracked canaries by state.", self._source.counts())
        yield GaugeMetricFamily(
            "canaryd_ready",
            "1 when every watch scope is listed and connected (/readyz 200), else 0.",
            value=0 if self._not_ready() else 1,
        )
        yield _by_state(
            "canaryd_watch_scopes",
            "Wanted watch scopes by state: listed, waiting, forbidden (403), "
            "namespace_missing, kind_not_served (404), patch_forbidden (its bumps are answered "
            "403; a scope that cannot exist is counted too).",
            self._scopes(),
        )
        each = GaugeMetricFamily(
            "canaryd_canary_state",
            "1 for each tracked canary, labelled with its state and the class of its reason "
            "(docs/OPERATIONS.md).",
            labels=["kind", "canary_namespace", "name", "state", "reason"],
        )
        for c in self._canaries():
            each.add_metric([c.key.kind, c.key.namespace, c.key.name, c.state.value, c.cause], 1)
        yield each


BLIND_REASONS = (
    "no_canaries",
    "list_forbidden",
    "unauthorized",
    "namespace_missing",
    "kind_not_served",
    "patch_forbidden",
    "operator_metrics_unreachable",
    "operator_metrics_no_series",
)


class BlindCollector(Collector):
    """``canaryd_blind{reason}``, read at scrape time: 1 for each reason why canaryd
    checks nothing or cannot judge now (``blind``: reason -> what), 0 for the others,
    every reason exported from the start."""

    def __init__(self, blind: Callable[[], Mapping[str, str]]) -> None:
        self._blind = blind

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "canaryd_blind",
            "1 while canaryd checks nothing or cannot judge, by reason: no_canaries, "
            "list_forbidden (403), unauthorized (401), namespace_missing, kind_not_served, "
            "patch_forbidden, operator_metrics_unreachable, operator_metrics_no_series "
            "(/readyz and /healthz?verbose say what).",
            labels=["reason"],
        )
        blind = self._blind()
        for reason in BLIND_REASONS:
            family.add_metric([reason], 1 if reason in blind else 0)
        yield family


VERDICT_EVENTS = _counter(
    "canaryd_verdict_events_total",
    "Kubernetes Events on canaries whose verdict changed, by result: created, updated "
    "(a series: the same Event again), spam_filtered (over a canary's token bucket), "
    "dropped (the queue full), failed (the write failed).",
    ["result"],
    ("created", "updated", "spam_filtered", "dropped", "failed"),
)


# What runs (issue 33): the build, and the process collector's process_* series (CPU,
# resident memory, open files, start time), in canaryd's own registry.
BUILD_INFO = Gauge(
    "canaryd_build_info",
    "1, labelled with canaryd's version and the Python it runs on.",
    ["version", "python"],
    registry=REGISTRY,
)
BUILD_INFO.labels(__version__, platform.python_version()).set(1)
ProcessCollector(registry=REGISTRY)
