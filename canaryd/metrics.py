"""Prometheus metrics in canaryd's own registry: the series canaryd writes and what runs
(build, process; the state read at scrape time is the health server's). Each labelled
counter an alert reads is exported at 0 with every label value it takes (increase() cannot
see a series' first step from absent to 1); every swallowed exception counts in ``ERRORS``
by place. docs/CONFIGURATION.md describes every series and label value."""

import platform
from collections.abc import Iterable, Sequence
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from canaryd import __version__

REGISTRY = CollectorRegistry(auto_describe=True)


def _counter(
    name: str, documentation: str, labels: Sequence[str] = (), exported: Iterable[str] = ()
) -> Counter:
    counter = Counter(name, documentation, labels, registry=REGISTRY)
    for value in exported:
        counter.labels(value)
    return counter


_gauge = partial(Gauge, registry=REGISTRY)
_histogram = partial(Histogram, registry=REGISTRY)


API_REQUESTS = _counter(
    "canaryd_api_requests",
    "Kubernetes API requests by verb and HTTP code ('error': no answer).",
    ["verb", "code"],
)
BUMP_RESULTS = (
    "written failed skipped fenced conflict_exhausted forbidden invalid gone gone_unconfirmed "
    "gone_but_present not_canary replaced no_change no_generation"
).split()
BUMPS = _counter(
    "canaryd_bumps",
    "Nonce bumps by result: written, or why none was (docs/CONFIGURATION.md says each).",
    ["result"],
    BUMP_RESULTS,
)
UNSCHEDULED = _gauge(
    "canaryd_canaries_unscheduled",
    "Tracked canaries neither due nor in flight exactly once while this replica bumps: 0, "
    "always (a canary out of the schedule would never be checked again).",
)
BUMPS_IN_FLIGHT = _gauge(
    "canaryd_bumps_in_flight",
    "Bumps being written now (waiting for an answer, a retry or the leader's fence; at most 256).",
)
BUMP_DURATION = _histogram(
    "canaryd_bump_duration_seconds",
    "How long a bump takes to travel from the moment its PATCH is sent, by stage "
    "(docs/CONFIGURATION.md says each).",
    ["kind", "stage"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
CONFLICTS = _counter(
    "canaryd_conflicts_total", "409 Conflicts on bumps (each one re-reads the object)."
)
VERDICT_KINDS = (
    "healthy unhealthy deferred rechecked suspected unreachable operator_unavailable"
).split()
VERDICTS = _counter(
    "canaryd_verdicts",
    "Bumps judged at their deadline, by verdict (docs/CONFIGURATION.md says each).",
    ["verdict"],
    VERDICT_KINDS,
)
VERDICT_LATENESS = _histogram(
    "canaryd_verdict_lateness_seconds",
    "How late after its deadline a bump was judged.",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
DROPPED = _counter(
    "canaryd_canaries_dropped_total",
    "Canaries no longer tracked, by reason.",
    ["reason"],
    (
        "deleted not_canary being_deleted namespace_closed namespace_unwatched relisted "
        "replaced gone forbidden"
    ).split(),
)
WATCH_RESTART_WHYS = "ended dropped idle short expired suspected error forbidden gone".split()
WATCH_RESTARTS = _counter(
    "canaryd_watch_restarts_total",
    "Watch streams re-opened, by resource and why (docs/CONFIGURATION.md says each).",
    ["resource", "why"],
)
RELISTS = _counter(
    "canaryd_relists_total",
    "Full lists, by resource (the first one and every one after 410 Expired).",
    ["resource"],
)
ERROR_PLACES = (
    "credentials malformed_object operator_account request scheduler "
    "sd_notify stale_copy watch watch_decode watch_request watchdog_withheld task_watcher "
    "task_scheduler task_config task_credentials task_leader task_events"
).split()
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
WATCHED_NAMESPACES = _gauge(
    "canaryd_watched_namespaces",
    "Watched namespaces that are not terminating (when all are watched: every namespace "
    "the Namespaces watch knows).",
)
BAD_HTTP_REQUESTS = _counter(
    "canaryd_http_bad_requests_total",
    "Malformed HTTP requests to the health port (answered 400, logged at most once a cycle).",
)
HTTP_CONNECTIONS_DROPPED = _counter(
    "canaryd_http_connections_dropped_total",
    "Connections to the health port closed by canaryd, by reason (docs/CONFIGURATION.md "
    "says each).",
    ["reason"],
    ("headers_too_large", "too_many", "answer_unread"),
)
LEADER = _gauge(
    "canaryd_leader",
    "1 while this replica writes bumps: always without --leader-elect; with it, while "
    "it holds the Lease.",
)
LEADER_TRANSITIONS = _counter(
    "canaryd_leader_transitions",
    "Times this replica saw the Lease pass to a new holder (itself included).",
)
OPERATOR_SCRAPES = _counter(
    "canaryd_operator_scrapes_total",
    "Reads of the operator's metrics (--reconciled-by operator-metrics), by result "
    "(docs/CONFIGURATION.md says each).",
    ["result"],
)
OPERATOR_RESTARTS = _counter(
    "canaryd_operator_restarts",
    "Times the operator's metrics showed a new operator process (its canaries are "
    "then checked afresh).",
)
VERDICT_EVENTS = _counter(
    "canaryd_verdict_events_total",
    "Kubernetes Events on canaries whose verdict changed, by result (docs/CONFIGURATION.md "
    "says each).",
    ["result"],
    ("created", "updated", "spam_filtered", "dropped", "failed"),
)
BLIND_REASONS = (
    "no_canaries list_forbidden unauthorized namespace_missing kind_not_served "
    "patch_forbidden operator_metrics_unreachable operator_metrics_no_series"
).split()


def bump_stages_exported(kind: str) -> None:
    """A kind's stage histograms exist (empty) from the moment it is watched."""
    for stage in ("answered", "observed", "reconciled"):
        BUMP_DURATION.labels(kind, stage)


def watching(resource: str) -> None:
    """A watch of ``resource`` starts: its restart counters are exported at 0."""
    for why in WATCH_RESTART_WHYS:
        WATCH_RESTARTS.labels(resource, why)


def operator_metrics_exported() -> None:
    for result in ("ok", "refused", "unanswered", "bad_answer"):
        OPERATOR_SCRAPES.labels(result)


# What runs (issue 33): the build, and the process_* series (CPU, memory, open files).
BUILD_INFO = _gauge(
    "canaryd_build_info",
    "1, labelled with canaryd's version and the Python it runs on.",
    ["version", "python"],
)
BUILD_INFO.labels(__version__, platform.python_version()).set(1)
ProcessCollector(registry=REGISTRY)
