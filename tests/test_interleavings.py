"""Random interleavings of watch events, write answers (2xx, 404, 403, 409, 5xx, late or
not), deletions and recreations, label changes and watch drops, driven against the real
Registry and Scheduler (its bump tasks run; the clock and the heap are stepped by the
test). After every step:

- no unhealthy verdict without a written bump that the watch had not delivered by its
  deadline (and with the watch in sync);
- no tracked canary missing while the object exists and is labelled, once the watch
  has delivered everything;
- never a write for a record that is not the one tracked;
- every tracked canary due or in flight exactly once (``Scheduler.unscheduled``).
"""

from __future__ import annotations

import asyncio
import heapq
import json
import math
import types
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from canaryd import writer as writer_module
from canaryd.config import Settings
from canaryd.kube import ErrorKind, KubeError, classify_answer
from canaryd.registry import CanaryKey, CanaryState, Registry
from canaryd.scheduler import Scheduler
from canaryd.sync import ScopeSync
from canaryd.watcher import Watcher
from canaryd.writer import Writer

LABEL = "flink.apache.org/canary"
CYCLE = 1.0
KIND = "flinkdeployments"
SCOPE = (KIND, None)
NAMES = ("a", "b")


@dataclass
class Pending:
    method: str
    name: str
    body: dict[str, Any] | None
    future: asyncio.Future[dict[str, Any]]


@dataclass
class Cluster:
    """The model: objects by name, the watch's undelivered events, what was written."""

    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    rv: int = 0
    uids: int = 0
    rv_owner: dict[str, str] = field(default_factory=dict)
    """resourceVersion -> uid of the object that had it."""
    written: dict[tuple[str, int], float] = field(default_factory=dict)
    """(uid, generation) of each 2xx bump -> clock time of its answer."""
    delivered: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    """uid -> (clock, generation) of each copy the watch delivered."""

    def next_rv(self, uid: str) -> str:
        self.rv += 1
        self.rv_owner[str(self.rv)] = uid
        return str(self.rv)

    def create(self, name: str) -> None:
        self.uids += 1
        uid = f"uid-{self.uids}"
        obj = {
            "metadata": {
                "name": name,
                "namespace": "ns",
                "uid": uid,
                "generation": 1,
                "resourceVersion": self.next_rv(uid),
                "labels": {LABEL: "true"},
            },
            "spec": {},
        }
        self.objects[name] = obj
        self.events.append(("ADDED", json.loads(json.dumps(obj))))

    def copy(self, name: str) -> dict[str, Any]:
        return json.loads(json.dumps(self.objects[name]))


class StubKube:
    """Answers nothing by itself: every request waits until the test answers it."""

    def __init__(self, cluster: Cluster, registry: Registry) -> None:
        self.cluster, self.registry = cluster, registry
        self.pending: list[Pending] = []
        self.violations: list[str] = []
        self.answered_since = math.inf  # the API server answers (only the watch drops here)

    async def request(self, verb: str, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        return await self._pend(method, path, kwargs)

    def _pend(
        self, method: str, path: str, kwargs: dict[str, Any]
    ) -> asyncio.Future[dict[str, Any]]:
        name = path.rsplit("/", 1)[1]
        body = json.loads(kwargs["data"]) if kwargs.get("data") else None
        if method == "PATCH":
            tracked = self.registry.get(CanaryKey(KIND, "ns", name))
            assert body is not None
            rv = body["metadata"]["resourceVersion"]
            if tracked is None:
                self.violations.append(f"PATCH {name} while no record is tracked")
            elif self.cluster.rv_owner.get(rv) != tracked.uid:
                self.violations.append(f"PATCH {name} with rv {rv} of another uid")
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending.append(Pending(method, name, body, future))
        return future


def error(code: int) -> KubeError:
    return KubeError(classify_answer(code), f"answer {code}", status=code, reason=str(code))


class Run:
    def __init__(self) -> None:
        self.now = 100.0
        self.cluster = Cluster()
        self.settings = Settings(timeout=CYCLE, max_bumps_in_flight=2)
        self.registry = Registry(LABEL)
        self.kube = StubKube(self.cluster, self.registry)
        self.scheduler = Scheduler(
            self.settings,
            self.registry,
            self.kube,  # type: ignore[arg-type]
            clock=lambda: self.now,
        )
        self.watcher = Watcher(
            self.settings,
            self.registry,
            self.kube,  # type: ignore[arg-type]
        )
        self.watcher.settings = self.settings
        self.violations = self.kube.violations
        original = self.registry.set_state

        def checked(canary: Any, state: CanaryState, reason: str, cause: str) -> None:
            if state is CanaryState.UNHEALTHY and reason.startswith("generation "):
                self.check_unhealthy(canary.uid, int(reason.split()[1]))
            original(canary, state, reason, cause)

        self.registry.set_state = checked  # type: ignore[method-assign]

    def check_unhealthy(self, uid: str, generation: int) -> None:
        answered = self.cluster.written.get((uid, generation))
        if answered is None:
            self.violations.append(f"unhealthy on generation {generation} never written")
            return
        deadline = answered + CYCLE
        if self.now < deadline:
            self.violations.append(f"unhealthy on generation {generation} before its deadline")
        seen = [g for t, g in self.cluster.delivered.get(uid, []) if t <= deadline]
        if seen and max(seen) >= generation:
            self.violations.append(f"unhealthy on generation {generation} delivered in time")

    # ---------------------------------------------------------------- steps

    def deliver(self) -> None:
        if not self.cluster.events:
            return
        event, obj = self.cluster.events.pop(0)
        uid = obj["metadata"]["uid"]
        self.cluster.delivered.setdefault(uid, []).append((self.now, obj["metadata"]["generation"]))
        self.watcher._canary_event(self.watcher_kind, event, obj)
        self.scope_delivered()

    def scope(self) -> ScopeSync:
        """The scope's model, made (out of sync since now) when first asked for."""
        found = self.registry.scopes.covering(CanaryKey(KIND, "", ""))
        return found if found is not None else self.registry.scopes.add(SCOPE, self.now)

    def scope_delivered(self) -> None:
        """An event or a bookmark arrived on the scope (as ListWatch tells it)."""
        if self.scope().delivered(self.now):
            self.registry.scope_resumed(SCOPE)

    @property
    def watcher_kind(self) -> Any:
        from canaryd.kube import KINDS

        return KINDS[KIND]

    def tick(self) -> None:
        self.now += CYCLE / 4
        self.scheduler.take_news()  # as Scheduler._next_due does first
        heap, places = self.scheduler._heap, self.scheduler._places
        while heap and heap[0][0] <= self.now:
            due, _, place = heapq.heappop(heap)
            canary = place.canary
            if places.get(canary.key) is place and self.registry.owns(canary):
                del places[canary.key]  # as Scheduler._next_due takes it
                self.scheduler._on_due(due, canary)

    def answer(self, index: int, code: int) -> None:
        if not self.kube.pending:
            return
        request = self.kube.pending.pop(index % len(self.kube.pending))
        obj = self.cluster.objects.get(request.name)
        if request.method == "GET":
            if code >= 500:
                request.future.set_exception(error(code))
            elif obj is None:
                request.future.set_exception(error(404))
            else:
                request.future.set_result(self.cluster.copy(request.name))
            return
        assert request.body is not None
        if code == 200:
            if obj is None:
                code = 404
            elif request.body["metadata"]["resourceVersion"] != obj["metadata"]["resourceVersion"]:
                code = 409  # the precondition, as a real server checks it
            else:
                meta = obj["metadata"]
                obj["spec"]["restartNonce"] = request.body["spec"]["restartNonce"]
                meta["generation"] += 1
                meta["resourceVersion"] = self.cluster.next_rv(meta["uid"])
                self.cluster.written[(meta["uid"], meta["generation"])] = self.now
                self.cluster.events.append(("MODIFIED", self.cluster.copy(request.name)))
                request.future.set_result(self.cluster.copy(request.name))
                return
        request.future.set_exception(error(code))

    def delete(self, name: str) -> None:
        obj = self.cluster.objects.pop(name, None)
        if obj is not None:
            self.cluster.rv += 1
            self.cluster.events.append(("DELETED", obj))

    def relabel(self, name: str, value: str | None) -> None:
        obj = self.cluster.objects.get(name)
        if obj is None:
            return
        labelled = obj["metadata"]["labels"].get(LABEL) == "true"
        if value is None:
            obj["metadata"]["labels"].pop(LABEL, None)
        else:
            obj["metadata"]["labels"][LABEL] = value
        obj["metadata"]["resourceVersion"] = self.cluster.next_rv(obj["metadata"]["uid"])
        now_labelled = value == "true"
        # A label-selector watch: crossing the selector's edge is ADDED or DELETED.
        if labelled and not now_labelled:
            self.cluster.events.append(("DELETED", self.cluster.copy(name)))
        elif now_labelled:
            self.cluster.events.append(
                ("MODIFIED" if labelled else "ADDED", self.cluster.copy(name))
            )

    def check_tracked(self) -> None:
        if self.cluster.events:
            return  # the watch is behind: the registry may not know yet
        for name, obj in self.cluster.objects.items():
            if obj["metadata"]["labels"].get(LABEL) != "true":
                continue
            tracked = self.registry.get(CanaryKey(KIND, "ns", name))
            if tracked is None or tracked.uid != obj["metadata"]["uid"]:
                self.violations.append(f"{name} ({obj['metadata']['uid']}) exists, not tracked")


STEP = st.one_of(
    st.tuples(st.just("tick")),
    st.tuples(st.just("deliver")),
    st.tuples(st.just("deliver")),
    st.tuples(
        st.just("answer"),
        st.integers(0, 3),
        st.sampled_from([200, 200, 200, 404, 403, 409, 503]),
    ),
    st.tuples(st.just("answer"), st.integers(0, 3), st.just(200)),
    st.tuples(st.just("delete"), st.sampled_from(NAMES)),
    st.tuples(st.just("create"), st.sampled_from(NAMES)),
    st.tuples(st.just("label"), st.sampled_from(NAMES), st.sampled_from([None, "false", "true"])),
    st.tuples(st.just("watch_down")),
    st.tuples(st.just("watch_resumed")),
)


async def play(steps: list[tuple[Any, ...]]) -> list[str]:
    """The steps played; the rules they broke."""
    run = Run()
    # Backoff and conflict-jitter sleeps are instant: time is the test's clock.
    fast = types.SimpleNamespace(**{k: getattr(asyncio, k) for k in dir(asyncio) if k[0] != "_"})

    async def instant(delay: float, result: Any = None) -> Any:
        await asyncio.sleep(0)
        return result

    fast.sleep = instant
    writer_module.asyncio = fast  # type: ignore[assignment]
    group = asyncio.TaskGroup()
    await group.__aenter__()
    run.scheduler._group = group
    try:
        for name in NAMES:
            run.cluster.create(name)
        for step in steps:
            match step:
                case ("tick",):
                    run.tick()
                case ("deliver",):
                    run.deliver()
                case ("answer", index, code):
                    run.answer(index, code)
                case ("delete", name):
                    run.delete(name)
                case ("create", name):
                    if name not in run.cluster.objects:
                        run.cluster.create(name)
                case ("label", name, value):
                    run.relabel(name, value)
                case ("watch_down",):
                    run.scope().dropped(run.now)
                case ("watch_resumed",):
                    run.scope_delivered()
            for _ in range(5):
                await asyncio.sleep(0)  # let the bump tasks take their answers
            run.check_tracked()
            run.violations.extend(
                f"{key} not scheduled once" for key in run.scheduler.unscheduled()
            )
            if run.violations:
                break
        return run.violations
    finally:
        writer_module.asyncio = asyncio  # type: ignore[assignment]
        for request in run.kube.pending:
            request.future.cancel()
        await group.__aexit__(None, None, None)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(STEP, min_size=1, max_size=120))
def test_random_interleavings_keep_the_verdict_and_ownership_rules(steps):
    violations = asyncio.run(play(steps))
    assert not violations, violations


def test_the_model_catches_a_scheduler_that_drops_on_404(monkeypatch):
    """The property test can fail: with the old rule (drop on any 404) it does."""

    async def drop(self, canary, path):  # type: ignore[no-untyped-def]
        self.registry.forget(canary.key, "gone", "a 404 to the bump")  # the only re-read here
        return None

    monkeypatch.setattr(Writer, "_reread", drop)
    steps: list[tuple[Any, ...]] = [("deliver",), ("deliver",)]
    steps += [("tick",)] * 4 + [("answer", 0, 404)] + [("tick",)] * 2
    assert any("not tracked" in v for v in asyncio.run(play(steps)))


def test_error_kinds_are_what_the_model_assumes():
    assert classify_answer(404) is ErrorKind.GONE
    assert classify_answer(403) is ErrorKind.FORBIDDEN
    assert classify_answer(409) is ErrorKind.CONFLICT
    assert classify_answer(503) is ErrorKind.TRANSIENT
