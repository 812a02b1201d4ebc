"""Kubernetes Events (events.k8s.io/v1) on a canary whose verdict changed, written as
client-go's recorders write theirs (tools/events, tools/record: a spam filter; a series,
whose note, immutable, stays the first one's) and never in a bump's way: one task writes
them; a failed write is counted, told as an episode, not retried (docs/OPERATIONS.md)."""

import asyncio
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from canaryd import metrics
from canaryd.episodes import Episodes
from canaryd.kube import KubeClient, KubeError, kind_of, segment
from canaryd.logs import wall_time

Clock = Callable[[], float]
BURST, REFILL = 25, 1 / 300
SERIES_FOR = 360.0
REMEMBERED = 4096


@dataclass(slots=True)
class _Seen:
    """One canary's token bucket, and by reason its series: name, count, last written."""

    tokens: float
    at: float
    series: dict[str, tuple[str, int, float]] = field(default_factory=dict)


class Events:
    def __init__(self, kube: KubeClient, *, interval: Clock, clock: Clock = time.monotonic) -> None:
        self.kube = kube
        self._clock = clock
        self.queued: OrderedDict[str, tuple[tuple[str, str, str], str, str]] = OrderedDict()
        """By the canary's uid: the one Event waiting to be written (the canary's kind,
        namespace and name, the reason, the note), oldest first."""
        self._waiting = asyncio.Event()
        self._seen: OrderedDict[str, _Seen] = OrderedDict()
        self.instance = f"canaryd-{socket.gethostname()}"[:128]
        self.failures = Episodes(
            "events_not_written", "canary", interval, "canaries", "event_not_written", clock=clock
        )

    def record(self, key: tuple[str, str, str], uid: str, reason: str, note: str) -> None:
        note = note.encode()[:1024].decode(errors="ignore")  # at most 1 kB (validation)
        if uid in self.queued:  # replaced where it waits
            metrics.VERDICT_EVENTS.labels("dropped").inc()
        self.queued[uid] = (key, reason, note)
        self._waiting.set()

    async def run(self) -> None:
        try:
            while True:
                await self._waiting.wait()
                uid, (key, reason, note) = self.queued.popitem(last=False)
                if not self.queued:
                    self._waiting.clear()
                try:
                    result = await self._write(key, uid, reason, note)
                except KubeError as err:
                    result = "failed"
                    self.failures.failed("/".join(key), err.kind.value, str(err))
                if result in ("created", "updated"):  # written: what failed before is over
                    self.failures.recovered()
                metrics.VERDICT_EVENTS.labels(result).inc()
        finally:
            self.failures.stopped("the Events task stopped")

    async def _write(self, key: tuple[str, str, str], uid: str, reason: str, note: str) -> str:
        now = self._clock()
        seen = self._seen.pop(uid, None) or _Seen(BURST, now)
        self._seen[uid] = seen  # the most recently used last
        if len(self._seen) > REMEMBERED:
            self._seen.popitem(last=False)
        seen.tokens = min(BURST, seen.tokens + (now - seen.at) * REFILL)
        seen.at = now
        if seen.tokens < 1:
            return "spam_filtered"
        seen.tokens -= 1
        kind_key, namespace, canary = key
        stamp = wall_time(time.time(), fraction=True)  # a MicroTime
        path = f"/apis/events.k8s.io/v1/namespaces/{segment(namespace)}/events"
        earlier = seen.series.get(reason)
        if earlier is not None and now - earlier[2] < SERIES_FOR:
            name, count = earlier[0], earlier[1] + 1
            try:
                await self.kube.request(
                    "patch",
                    "PATCH",
                    f"{path}/{segment(name)}",
                    body={"series": {"count": count, "lastObservedTime": stamp}},
                    content_type="application/merge-patch+json",
                )
                seen.series[reason] = (name, count, now)
                return "updated"
            except KubeError as err:
                if err.status != 404:  # gone (Events expire): a new one starts the series
                    raise
        kind = kind_of(kind_key)
        name = f"{canary}.{time.time_ns():x}"
        if len(name) > 253:  # not a valid name: client-go's GenerateEventName, a UUID
            name = str(uuid.uuid4())
        body = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "eventTime": stamp,
            "reportingController": "canaryd",
            "reportingInstance": self.instance,
            "action": "Judged",
            "reason": reason,
            "type": "Normal" if reason == "Recovered" else "Warning",
            "regarding": {
                "apiVersion": f"{kind.group}/{kind.version}",
                "kind": kind.kind,
                "namespace": namespace,
                "name": canary,
                "uid": uid,
            },
            "note": note,
        }
        await self.kube.request("create", "POST", path, body=body)
        seen.series[reason] = (name, 1, now)
        return "created"
