"""The operator's own metrics: the reconcile signal of ``--reconciled-by operator-metrics``
(docs/CONFIGURATION.md). Regular expressions find the few series needed by their name's
suffix (a reporter scope format of the user's own keeps working); prometheus_client's
parser reads only label sets not seen before (whole answers through it take seconds).
"""

from __future__ import annotations

import asyncio
import errno
import re
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import aiohttp
import structlog
from prometheus_client.parser import text_string_to_metric_families

from canaryd import metrics
from canaryd.config import Settings
from canaryd.episodes import Episodes

log = structlog.get_logger("canaryd.opmetrics")

RECONCILED_SUFFIX = "_JOSDK_Reconciliation_finished_Count"
MAX_ANSWER = 256 * 1024 * 1024  # bytes read at most (in chunks: it bounds time, not memory)
MAX_LINE = 1024 * 1024  # the longest line kept: a longer one is no Prometheus sample
CHUNK = 256 * 1024
MAX_KEYS = 200_000  # label sets one answer keeps parsed for the next (one per resource)

# A literal the regex engine finds fast: the lines canaryd does not need cost a scan of
# their bytes, not a Python loop each.
_RECONCILED = re.compile(re.escape(RECONCILED_SUFFIX).encode() + rb"\{([^}\n]*)\}[ \t]+([^ \t\n]+)")
# Series that only grow within one operator process: the Kubernetes client's request
# count and the JVM's CPU time (and, per resource, the counter above). One that went
# down belongs to a new process. (Flink's gauges named ..._Count, such as
# Status_JVM_Threads_Count, go up and down: they are not among these.)
_PROCESS = re.compile(
    rb"(_KubeClient_HttpRequest_Count|_Status_JVM_CPU_Time)(\{[^}\n]*\})?[ \t]+([^ \t\n]+)"
)
# A process start time, when a reporter exports one (Flink's Prometheus reporter does not).
_START = re.compile(rb"(?m)^process_start_time_seconds(?:\{[^}\n]*\})?[ \t]+([^ \t\n]+)")

ResourceKey = tuple[str, str, str]  # (Kind, namespace, name): ``FlinkDeployment``
_NOT_IN_LABELS = re.compile(r"[^a-zA-Z0-9:_]")
# A process start time outside 2000-2100 (milliseconds, infinities) is not one.
EARLIEST_START, LATEST_START = 946_684_800.0, 4_102_444_800.0


def reporter_label(value: str) -> str:
    """A label value as Flink's Prometheus reporter writes it by default
    (AbstractPrometheusReporter.replaceInvalidChars): ``team-a`` is ``team_a``."""
    return _NOT_IN_LABELS.sub("_", value)


def _number(raw: bytes) -> float | None:
    try:
        value = float(raw)
    except ValueError:
        return None
    return None if value != value else value  # NaN: no value


class Scrape:
    """What one answer of the operator's metrics endpoint says, read chunk by chunk
    (``feed``, then ``end``); a malformed line of interest is skipped. ``keys``: the label
    sets the last answer parsed (the same every read), so few are parsed again."""

    def __init__(self, keys: dict[bytes, ResourceKey | None] | None = None) -> None:
        self.answered_at = 0.0  # monotonic: a reconcile counted in it finished before
        self.reconciled: dict[ResourceKey, float] = {}  # finished reconciles
        self.process: dict[bytes, float] = {}  # _PROCESS's series, by name and labels
        self.start_time: float | None = None  # Unix seconds, when the reporter exports it
        self.size = 0  # bytes read
        self._rest = b""
        self._known: dict[bytes, ResourceKey | None] = {} if keys is None else keys
        # This answer's label sets, parsed: where the next read starts (those of resources
        # gone, or of an operator pod replaced, are not kept).
        self.keys: dict[bytes, ResourceKey | None] = {}

    def count(self, key: ResourceKey) -> float | None:
        """A resource's finished reconciles: its series with the label values as they
        are, or as the reporter filters them by default."""
        found = self.reconciled.get(key)
        if found is None:
            kind, namespace, name = map(reporter_label, key)
            found = self.reconciled.get((kind, namespace, name))
        return found

    @property
    def has_operator_series(self) -> bool:
        return bool(self.process or self.reconciled)

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        data = self._rest + chunk
        cut = data.rfind(b"\n") + 1  # the whole lines (none: 0)
        self._rest = data[cut:] if len(data) - cut <= MAX_LINE else b""
        self._scan(data[:cut])

    def end(self, answered_at: float) -> Scrape:
        if self._rest:
            self._scan(self._rest + b"\n")
            self._rest = b""
        self._known = {}  # the last answer's label sets are not held past this one
        self.answered_at = answered_at
        return self

    def _key(self, labels: bytes) -> ResourceKey | None:
        if labels in self.keys:
            return self.keys[labels]
        if labels in self._known:
            key = self._known[labels]
        else:
            sample = f"x{{{labels.decode('utf-8', 'replace')}}} 0\n"
            try:
                (family,) = text_string_to_metric_families(sample)
                found = family.samples[0].labels
                key = (found["resourcetype"], found["resourcens"], found["resourcename"])
            except (ValueError, KeyError, IndexError):  # malformed, or not a resource's
                key = None
        if len(self.keys) < MAX_KEYS:
            self.keys[labels] = key
        return key

    def _scan(self, block: bytes) -> None:
        reconciled = self.reconciled
        for match in _RECONCILED.finditer(block):
            value = _number(match.group(2))
            key = self._key(match.group(1))
            if value is not None and key is not None:
                reconciled[key] = reconciled.get(key, 0.0) + value
        for match in _PROCESS.finditer(block):
            value = _number(match.group(3))
            if value is not None:
                self.process[match.group(1) + (match.group(2) or b"")] = value
        for match in _START.finditer(block):
            if (value := _number(match.group(1))) is not None:
                self.start_time = value if EARLIEST_START < value < LATEST_START else None


def parse(text: str | bytes, answered_at: float = 0.0) -> Scrape:
    """A whole exposition at once (tests, the e2e suite)."""
    scrape = Scrape()
    scrape.feed(text.encode() if isinstance(text, str) else text)
    return scrape.end(answered_at)


class ScrapeFailed(Exception):
    """The endpoint gave no usable answer. ``cause``: ``refused`` (nothing listens),
    ``unanswered`` (no whole answer in time: a frozen JVM still accepts into its listen
    backlog), or ``bad_answer`` (anything else); canaryd.judge.by_operator says what each
    means for a verdict."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause


@dataclass(frozen=True, slots=True)
class Read:
    started: float
    scrape: Scrape | None
    failed: ScrapeFailed | None
    # Still unanswered after an interval: it judges only the canaries with a bump to
    # judge (the others wait for it: it is their baseline).
    unanswered: bool = False
    restarted: bool = False  # a new operator process answered it (since ``instance_since``)


class OperatorMetrics:
    """Reads the operator's metrics endpoint every scrape interval, never per canary
    (``reads``: the scheduler judges the canaries waiting for a read on each), tells
    restarts apart, and says when it cannot judge (``blind``)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.connect_timeout = connect_timeout  # a frozen process's full backlog fails here
        self.read_timeout = read_timeout  # one answer once connected: the cycle
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self.last: Scrape | None = None  # the last usable answer
        # The operator process judged now, one more at each restart seen (a bump's
        # baseline from another is not comparable), and the wall-clock time it is known
        # from (its start time when exported, else when canaryd saw it).
        self.instance = 0
        self.instance_since = time.time()
        self._refused_since_answer = False
        # Why the operator's metrics cannot judge canaries right now (``blind``): its
        # canaryd_blind reason, what, and since when every read failed or had no series.
        self.problem: tuple[str, str, float] | None = None
        self.failures = Episodes(
            "operator_metrics_failures", "url", lambda: read_timeout, clock=clock
        )
        self.missing: set[str] = set()  # canaries whose series an answer lacked (warned)
        metrics.operator_metrics_exported()

    async def reads(self, interval: float) -> AsyncGenerator[Read, None]:
        """Read every ``interval``, forever (close it: contextlib.aclosing)."""
        try:
            while True:
                started, instance = self._clock(), self.instance
                read = asyncio.ensure_future(self.scrape())
                try:
                    while not (await asyncio.wait({read}, timeout=interval))[0]:
                        # Those that waited a cycle need not wait for this read to time
                        # out (a frozen JVM holds it a cycle).
                        ago = self._clock() - started
                        silent = f"{self.url} has not answered a read sent {ago:.1f}s ago"
                        yield Read(started, None, ScrapeFailed("unanswered", silent), True)
                finally:
                    read.cancel()  # the reader is stopping (once done, a no-op)
                try:
                    done = Read(started, read.result(), None, restarted=self.instance != instance)
                except ScrapeFailed as err:
                    done = Read(started, None, err)
                try:
                    self._note(done)
                except Exception:
                    # A bug must not stop the reads: say so, count it, go on.
                    metrics.ERRORS.labels("scheduler").inc()
                    log.exception("operator_judge_failed_unexpectedly")
                yield done
                await asyncio.sleep(max(0.0, started + interval - self._clock()))
        finally:
            await self.close()  # its session

    def _note(self, read: Read) -> None:
        """What a read tells before any canary is judged on it: ``blind``, an episode."""
        failed, problem = read.failed, None
        metrics.OPERATOR_SCRAPES.labels("ok" if failed is None else failed.cause).inc()
        if failed is not None:
            self.failures.failed(self.url, failed.cause, str(failed))
            problem = "unreachable", str(failed)
        else:
            self.failures.recovered(self.url)
            if read.scrape is not None and not read.scrape.has_operator_series:
                what = "(is Flink's Prometheus reporter configured on this port?)"
                problem = "no_series", f"{self.url} answered without the operator's metrics {what}"
        if problem is None:
            self.problem = None
        else:
            self.problem = (*problem, self.problem[2] if self.problem else read.started)

    def blind(self) -> dict[str, str]:
        """Why canaryd cannot judge by the operator's metrics, by ``canaryd_blind`` reason:
        no usable answer for a whole cycle (a start-up's grace: the reporter listens some
        seconds after the operator starts), or an answer without a canary's series."""
        blind: dict[str, str] = {}
        if self.problem is not None:
            reason, problem, since = self.problem
            if self._clock() - since >= self.read_timeout:  # past the start-up grace
                blind[f"operator_metrics_{reason}"] = problem
        if self.missing:
            missing = ", ".join(sorted(self.missing)[:20])
            blind.setdefault("operator_metrics_no_series", f"no series for {missing}")
        return blind

    def series_missing(self, canary: str, series: str | None) -> None:
        """Whether the last read lacked a canary's ``series``: warned once, and again if
        they go missing again."""
        if series is None:
            self.missing.discard(canary)
        elif canary not in self.missing:
            self.missing.add(canary)
            log.warning(
                "operator_series_missing",
                canary=canary,
                series=series,
                url=self.url,
                hint="the operator does not watch its namespace, or has not "
                "reconciled it since it started",
            )

    @classmethod
    def of(cls, settings: Settings, clock: Callable[[], float]) -> OperatorMetrics | None:
        """The reader of --reconciled-by operator-metrics (an answer may take a cycle)."""
        if settings.reconciled_by != "operator-metrics":
            return None
        return cls(
            settings.operator_metrics_url,
            connect_timeout=settings.scrape_connect_timeout,
            read_timeout=settings.timeout,
            clock=clock,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def scrape(self) -> Scrape:
        """One scrape, or ScrapeFailed; a restart seen changes ``instance``."""
        if self._session is None:
            # A new connection per scrape (force_close): a kept-alive connection to a
            # process that was killed fails in ways that say nothing of the new one.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=4),
                timeout=aiohttp.ClientTimeout(
                    total=self.connect_timeout + self.read_timeout,
                    connect=self.connect_timeout,
                    sock_read=self.read_timeout,
                ),
                trust_env=False,
            )
        scrape = Scrape(self.last.keys if self.last is not None else None)
        answered = False
        try:
            async with self._session.get(self.url, allow_redirects=False) as response:
                answered = True
                if response.status != 200:
                    raise ScrapeFailed("bad_answer", f"{self.url} answered HTTP {response.status}")
                async for chunk in response.content.iter_chunked(CHUNK):
                    scrape.feed(chunk)
                    if scrape.size > MAX_ANSWER:
                        raise ScrapeFailed(
                            "bad_answer", f"{self.url} answered more than {MAX_ANSWER} bytes"
                        )
        except aiohttp.ClientConnectorError as err:
            if err.os_error.errno in (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH):
                self._refused_since_answer = True
                raise ScrapeFailed("refused", f"{self.url} refused the connection") from None
            raise ScrapeFailed("bad_answer", f"cannot connect to {self.url}: {err}") from None
        except aiohttp.ConnectionTimeoutError:
            raise ScrapeFailed(
                "unanswered",
                f"{self.url}: no connection within {self.connect_timeout:g}s (the port is "
                "held but nothing accepts: a frozen process, or a network that drops)",
            ) from None
        except (TimeoutError, aiohttp.ServerTimeoutError):
            what = "did not finish its answer" if answered else "answered nothing"
            raise ScrapeFailed(
                "unanswered",
                f"{self.url} accepted the connection but {what} within {self.read_timeout:g}s",
            ) from None
        except aiohttp.ClientError as err:
            raise ScrapeFailed(
                "bad_answer", f"{self.url}: {type(err).__name__} {err}".strip()
            ) from None
        restarted = self.restart_seen(scrape.end(self._clock()))
        if restarted is not None:
            self.instance, self.instance_since = self.instance + 1, restarted
        self.last, self._refused_since_answer = scrape, False
        return scrape

    def restart_seen(self, scrape: Scrape) -> float | None:
        """When the operator process answering now started, if it is not the last
        answer's (else None): a new start time; counters that went down; or refused
        connections since the last answer (a fresh check is never wrong, only slower)."""
        last = self.last
        if last is None:
            return None
        if scrape.start_time is not None and last.start_time is not None:
            return scrape.start_time if scrape.start_time != last.start_time else None
        went_down = any(n < last.process.get(k, 0.0) for k, n in scrape.process.items()) or any(
            n < last.reconciled.get(k, 0.0) for k, n in scrape.reconciled.items()
        )
        return time.time() if self._refused_since_answer or went_down else None
