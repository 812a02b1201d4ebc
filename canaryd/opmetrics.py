"""The operator's own metrics: the reconcile signal of ``--reconciled-by operator-metrics``.

The Flink Kubernetes Operator counts, per resource, the reconciles JOSDK finished
(``OperatorJosdkMetrics``: ``<scope>.resource.<name>.JOSDK.Reconciliation.finished.Count``)
and exports them through its metric reporter. With Flink's Prometheus reporter
each is a line such as::

    flink_k8soperator_namespace_resource_JOSDK_Reconciliation_finished_Count{
        resourcename="canary",resourcetype="FlinkDeployment",resourcens="default",...} 3.0

A bump counts as reconciled by the operator when the canary's counter rose after the
bump was written: canaryd reads it before the bump (the baseline) and again after
the deadline. A new operator process starts its counters at zero, so a counter that
went down, a new process start time, or an endpoint that answers again after it
refused, is a restarted operator: its verdicts are checked afresh.

Only the lines canaryd needs are parsed (a scrape of an operator with thousands of
resources is tens of thousands of lines); the metric names are matched by their
suffix, so a reporter scope format of the user's own keeps working.
"""

from __future__ import annotations

import errno
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import aiohttp

RECONCILED_SUFFIX = "_JOSDK_Reconciliation_finished_Count"
"""The per-resource counter of reconciles JOSDK finished (the operator's
``OperatorJosdkMetrics.finishedReconciliation``)."""
START_TIME_NAMES = ("process_start_time_seconds",)
"""Series that give the operator process's start time, when a reporter exports one
(Flink's Prometheus reporter does not: its registry holds Flink's metrics only)."""


def _grows_within_a_process(name: str) -> bool:
    """Series that only grow within one operator process: every JOSDK counter, the
    Kubernetes client's request count and the JVM's CPU time. One that went down
    belongs to a new process. (Flink's gauges named ``..._Count`` such as
    ``Status_JVM_Threads_Count`` go up and down: they are not among these.)"""
    return (
        ("_JOSDK_" in name and name.endswith("_Count"))
        or name.endswith("_KubeClient_HttpRequest_Count")
        or name.endswith("_Status_JVM_CPU_Time")
    )


RESOURCE_LABELS = ("resourcetype", "resourcens", "resourcename")

_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}

ResourceKey = tuple[str, str, str]
"""(Kind, namespace, name) as the operator names a resource: ``FlinkDeployment``."""
_NOT_IN_LABELS = re.compile(r"[^a-zA-Z0-9:_]")


def reporter_label(value: str) -> str:
    """A label value as Flink's Prometheus reporter writes it by default
    (AbstractPrometheusReporter.replaceInvalidChars, ``filterLabelValueCharacters``):
    every character outside ``[a-zA-Z0-9:_]`` becomes ``_``, so namespace ``team-a``
    is ``team_a`` and name ``my.canary`` is ``my_canary``."""
    return _NOT_IN_LABELS.sub("_", value)


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return re.sub(r"\\[\\\"n]", lambda m: _ESCAPES[m.group(0)], value)


@dataclass(frozen=True, slots=True)
class Scrape:
    """What one answer of the operator's metrics endpoint says."""

    sent_at: float
    """Monotonic time the request was sent: a reconcile counted in it finished before
    the answer, and one that finished before ``sent_at`` is in it."""
    answered_at: float
    reconciled: Mapping[ResourceKey, float]
    """Finished reconciles per resource."""
    growing: Mapping[str, float]
    """Every series that only grows within one operator process, by its line's name and
    labels (``_grows_within_a_process``)."""
    start_time: float | None
    """The operator process's start time (Unix seconds), when the reporter exports it."""
    series: int
    """How many samples the answer held (0: an empty or unrelated endpoint)."""

    def count(self, key: ResourceKey) -> float | None:
        """A resource's finished reconciles: its series with the label values as they
        are, or as the reporter filters them by default."""
        found = self.reconciled.get(key)
        if found is None:
            found = self.reconciled.get(
                (reporter_label(key[0]), reporter_label(key[1]), reporter_label(key[2]))
            )
        return found

    @property
    def has_operator_series(self) -> bool:
        """Does the answer come from the operator's reporter at all?"""
        return bool(self.growing)


def parse(text: str, sent_at: float = 0.0, answered_at: float = 0.0) -> Scrape:
    """The lines of a Prometheus text exposition that canaryd reads; the rest is skipped
    unparsed. A malformed line of interest is skipped too (``series`` still counts it)."""
    reconciled: dict[ResourceKey, float] = {}
    growing: dict[str, float] = {}
    start_time: float | None = None
    series = 0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        series += 1
        brace = line.find("{")
        space = line.find(" ")
        end = brace if brace != -1 and (space == -1 or brace < space) else space
        if end <= 0:
            continue
        name = line[:end]
        wanted = name.endswith(RECONCILED_SUFFIX)
        grows = _grows_within_a_process(name)
        starts = name in START_TIME_NAMES
        if not (wanted or grows or starts):
            continue
        if brace == end:
            close = line.rfind("}")
            if close == -1:
                continue
            labels_text, rest = line[brace + 1 : close], line[close + 1 :]
        else:
            labels_text, rest = "", line[end:]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if value != value:  # NaN: no value
            continue
        if starts:
            start_time = value
            continue
        if grows:
            growing[line[: len(line) - len(rest)]] = value
        if wanted:
            labels = {k: _unescape(v) for k, v in _LABEL.findall(labels_text)}
            if all(label in labels for label in RESOURCE_LABELS):
                key = (labels["resourcetype"], labels["resourcens"], labels["resourcename"])
                reconciled[key] = reconciled.get(key, 0.0) + value
    return Scrape(sent_at, answered_at, reconciled, growing, start_time, series)


class ScrapeFailed(Exception):
    """The endpoint gave no usable answer. ``cause`` is a short fixed word:

    - ``refused``: nothing listens (the operator is starting, or gone), the address
      cannot be reached, or the connection was cut without an answer (the process
      went away mid-read): no verdict, canaries are ``pending``;
    - ``unanswered``: the port is held but nothing answers: a connection accepted and
      no answer (a frozen JVM still accepts into its listen backlog), or, once that
      backlog is full, a connect that times out: counts against the operator once it
      lasts a whole cycle;
    - ``bad_answer``: an answer that is not the metrics (an HTTP error, not text).
    """

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause


def _refused(err: BaseException) -> bool:
    os_error = getattr(err, "os_error", None)
    return isinstance(os_error, OSError) and os_error.errno in (
        errno.ECONNREFUSED,
        errno.ENETUNREACH,
        errno.EHOSTUNREACH,
        errno.EADDRNOTAVAIL,
    )


@dataclass(slots=True)
class Instance:
    """The operator process canaryd currently judges, as far as its metrics tell."""

    number: int = 0
    """Grows by one each time a restart is seen; a bump's baseline from another
    instance is not comparable."""
    since: float = field(default_factory=time.time)
    """Wall-clock time from which this instance is known (its start time when exported,
    else when canaryd saw it)."""


class OperatorMetrics:
    """Scrapes the operator's metrics endpoint and tells restarts apart.

    Only the scheduler calls it (once per scrape interval, never per canary)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.timeout = timeout
        """How long a scrape may take, connection included."""
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self.last: Scrape | None = None
        """The last usable answer."""
        self.instance = Instance()
        self.failing_since: float | None = None
        """Monotonic time since which scrapes fail (None: the last one answered)."""
        self.failure: ScrapeFailed | None = None
        """The last failure, while scrapes fail."""
        self._refused_since_answer = False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            # A new connection per scrape (force_close): a kept-alive connection to a
            # process that was killed fails in ways that say nothing of the new one.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=4),
                timeout=aiohttp.ClientTimeout(
                    total=self.timeout, connect=self.timeout / 2, sock_read=self.timeout
                ),
                trust_env=False,
            )
        return self._session

    async def _fetch(self) -> tuple[float, str]:
        sent = self._clock()
        try:
            async with self._client().get(self.url, allow_redirects=False) as response:
                if response.status != 200:
                    raise ScrapeFailed("bad_answer", f"{self.url} answered HTTP {response.status}")
                body = await response.read()
        except ScrapeFailed:
            raise
        except aiohttp.ClientConnectorError as err:
            if _refused(err):
                raise ScrapeFailed("refused", f"{self.url} refused the connection") from None
            raise ScrapeFailed("refused", f"cannot connect to {self.url}: {err}") from None
        except aiohttp.ConnectionTimeoutError:
            # Not refused: something holds the port and accepts nothing. A frozen JVM's
            # listen backlog fills after a few reads, and then its SYNs go unanswered.
            raise ScrapeFailed(
                "unanswered",
                f"{self.url}: no connection within {self.timeout / 2:g}s (the port is "
                "held but nothing accepts: a frozen process, or a network that drops)",
            ) from None
        except (TimeoutError, aiohttp.ServerTimeoutError):
            raise ScrapeFailed(
                "unanswered",
                f"{self.url} accepted the connection but answered nothing within {self.timeout:g}s",
            ) from None
        except aiohttp.ClientError as err:
            # Reset or closed without an answer: the process went away mid-request.
            raise ScrapeFailed(
                "refused", f"{self.url}: {type(err).__name__} {err}".strip()
            ) from None
        try:
            return sent, body.decode("utf-8")
        except UnicodeDecodeError:
            raise ScrapeFailed("bad_answer", f"{self.url} answered with non-UTF-8 bytes") from None

    async def scrape(self) -> Scrape:
        """One scrape. Raises ``ScrapeFailed``; on success notes a restart, if any
        (``instance`` changes)."""
        try:
            sent, text = await self._fetch()
        except ScrapeFailed as failed:
            if self.failing_since is None:
                self.failing_since = self._clock()
            self.failure = failed
            if failed.cause == "refused":
                self._refused_since_answer = True
            raise
        scrape = parse(text, sent, self._clock())
        restarted = self.restart_seen(scrape)
        if restarted is not None:
            self.instance = Instance(self.instance.number + 1, restarted)
        self.last, self.failing_since, self.failure = scrape, None, None
        self._refused_since_answer = False
        return scrape

    def restart_seen(self, scrape: Scrape) -> float | None:
        """When the operator process answering now started, if it is not the one the
        last answer came from (else None): a new start time; counters that went down;
        or an endpoint that refused connections since the last answer (the process
        went away; a fresh check is never wrong, only a cycle slower)."""
        last = self.last
        if last is None:
            return None
        if scrape.start_time is not None and last.start_time is not None:
            if scrape.start_time != last.start_time:
                return scrape.start_time
            return None
        now = time.time()
        if self._refused_since_answer:
            return now
        for key, value in scrape.growing.items():
            if value < last.growing.get(key, 0.0):
                return now
        return None
