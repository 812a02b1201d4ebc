"""A seeded fault-injection soak of canaryd against the fake API server.

Used by tests/test_soak.py (about 100 cycles in ``make test-slow``) and ``make soak``
(1,000 cycles). Every random choice comes from one ``random.Random(seed)``, so a
run is reproducible up to timing.

Faults, per bump canaryd sends: 5% a 5xx, 2% a 429 with Retry-After, 5% a
concurrent writer that wins the race. Four in five of those set a label and an
annotation by merge patch (8 keys, ever-new values); one in five replaces the
whole object like the operator's own canary bump, first from a copy taken
earlier (refused with 409 as stale), then from a fresh one.

Faults of canaryd's own connection, none of which may cost a verdict: every 7 cycles
the watch connections are reset mid-stream; every 50 the history is compacted with
the reset (the resumed watch meets 410 and relists); every 120 the API server
refuses connections for 3 cycles and comes back; every 90 it answers watches 200
and closes them at once for 0.8 of a cycle; every 11 the open watch connections go
half-open (they stay open and never send another byte, as behind a load balancer
whose API server replica crashed: canaryd must notice and replace them itself). In
the first half, at seeded points, watch delivery is withheld for 2.5 to 4 cycles
(bookmarks still come, as from a stuck watch cache): each stuck period must be
detected within 2.5 cycles and healed within 2.5 cycles of its release. canaryd's own
live memory is traced over the second half, at three points: a leak is growth at every
step, not one reading above another. At every /healthz poll, each tracked canary must be
due or in flight exactly once (``Scheduler.unscheduled``).

Every daemon setting but the cycle is its shipped default.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import os
import random
import resource
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

import canaryd
from canaryd.registry import CanaryState
from canaryd.testing.apiserver import FLINK_DEPLOYMENTS, ApiError, FakeKube, Fault, Request
from tests.harness import Running, create_canary, running_daemon

log = structlog.get_logger("soak")


@dataclass
class SoakConfig:
    cycles: int = 100
    cycle: float = 0.5
    canaries: int = 50
    namespaces: int = 5
    seed: int = 41050
    server_errors: float = 0.05
    throttles: float = 0.02
    concurrent_writes: float = 0.05
    replace_share: float = 0.2
    drop_every: int = 7
    compact_every: int = 50
    outage_every: int = 120
    outage_cycles: int = 3
    empty_watch_every: int = 90
    empty_watch_share: float = 0.8
    half_open_every: int = 11
    stuck_every: int = 25


@dataclass
class SoakReport:
    cycles: int = 0
    seconds: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)
    polls: int = 0
    false_unhealthy_polls: int = 0
    false_unhealthy_verdicts: int = 0
    unscheduled_polls: int = 0
    """Polls at which a tracked canary was neither due nor in flight exactly once."""
    unscheduled: list[str] = field(default_factory=list)
    false_verdicts: list[str] = field(default_factory=list)
    """When (seconds into the run) and which canary, for each false unhealthy verdict."""
    stuck_periods: list[dict[str, float]] = field(default_factory=list)
    min_bumps: int = 0
    max_bumps: int = 0
    labels_expected: int = 0
    labels_missing: int = 0
    traced_kib_mid: float = 0.0
    traced_kib_late: float = 0.0
    traced_kib_end: float = 0.0
    traced_growth: list[str] = field(default_factory=list)
    """The lines whose live allocations grew most from mid-run to the end (to read when
    the memory check fails)."""
    rss_mib_start: float = 0.0
    rss_mib_end: float = 0.0

    def lines(self) -> list[str]:
        detect = [p["detected_in"] for p in self.stuck_periods]
        heal = [p["healed_in"] for p in self.stuck_periods]
        return [
            f"cycles: {self.cycles} of {self.seconds / max(self.cycles, 1):.3f} s "
            f"({self.seconds:.1f} s)",
            "faults injected: " + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())),
            f"/healthz polls: {self.polls}; failed outside a stuck period: "
            f"{self.false_unhealthy_polls}",
            f"unhealthy verdicts outside a stuck period: {self.false_unhealthy_verdicts}",
            f"polls with a canary not scheduled exactly once: {self.unscheduled_polls}",
            *(f"  not scheduled: {v}" for v in self.unscheduled[:5]),
            *(f"  false verdict: {v}" for v in self.false_verdicts),
            f"stuck periods: {len(self.stuck_periods)}; detected in "
            f"{_span(detect)} s; healed in {_span(heal)} s after release",
            *(
                f"  held {p['length']:.2f} s at {p['at']:.1f} s: detected in "
                f"{p['detected_in']:.2f} s, healed in {p['healed_in']:.2f} s"
                for p in self.stuck_periods
            ),
            f"canaryd's bumps per canary: {self.min_bumps} to {self.max_bumps}",
            f"writer's labels and annotations kept: {self.labels_expected - self.labels_missing}"
            f" of {self.labels_expected}",
            f"canaryd's live memory traced from mid-run: {self.traced_kib_mid:.0f} KiB five "
            f"cycles in, {self.traced_kib_late:.0f} KiB half-way, "
            f"{self.traced_kib_end:.0f} KiB at the end",
            *(f"  grew: {line}" for line in self.traced_growth),
            f"process RSS: {self.rss_mib_start:.0f} MiB at start, {self.rss_mib_end:.0f} MiB "
            "at the end (fake API server and test included)",
        ]


def _span(values: list[float]) -> str:
    return f"{min(values):.2f} to {max(values):.2f}" if values else "-"


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Soak:
    def __init__(self, kube: FakeKube, config: SoakConfig) -> None:
        self.kube, self.config = kube, config
        self.rng = random.Random(config.seed)
        self.report = SoakReport()
        self.faults: Counter[str] = Counter()
        self.expected: dict[tuple[str, str], dict[str, dict[str, str]]] = {}
        self.snapshots: dict[tuple[str, str], dict[str, Any]] = {}
        self.windows: list[tuple[float, float]] = []  # (held at, released at)
        self.transitions: list[tuple[float, object, CanaryState]] = []
        self.health: list[tuple[float, int]] = []
        self.writes = 0
        self.replacer_bumps: Counter[tuple[str, str]] = Counter()
        self.clock = time.monotonic
        self.started = 0.0

    # -------------------------------------------------------------- chaos

    def chaos(self, req: Request) -> Fault | None:
        """Asked by the fake for every request no static fault took."""
        if req.verb != "patch" or req.rtype is not FLINK_DEPLOYMENTS or req.name is None:
            return None
        roll = self.rng.random()
        cfg = self.config
        if roll < cfg.server_errors:
            code = self.rng.choice([500, 502, 503, 504])
            self.faults[f"{code}"] += 1
            return Fault(code=code)
        roll -= cfg.server_errors
        if roll < cfg.throttles:
            self.faults["429"] += 1
            return Fault(code=429, retry_after=0)
        roll -= cfg.throttles
        if roll < cfg.concurrent_writes:
            namespace, name = req.namespace or "", req.name
            if self.rng.random() < cfg.replace_share:
                self.faults["stale replace"] += 1
                return Fault(code=0, action=lambda: self.stale_replace(namespace, name))
            self.faults["label writer"] += 1
            return Fault(code=0, action=lambda: self.label_writer(namespace, name))
        return None

    def label_writer(self, namespace: str, name: str) -> None:
        # A bounded set of keys with ever-new values: objects keep their size, and the
        # check at the end is that each key holds the writer's latest value.
        self.writes += 1
        slot = self.writes % 8
        label, value = f"soak-w{slot}", f"v{self.writes}"
        annotation = f"soak.example.com/w{slot}"
        wanted = self.expected.setdefault((namespace, name), {"labels": {}, "annotations": {}})
        wanted["labels"][label] = value
        wanted["annotations"][annotation] = value

        def mutate(obj: dict[str, Any]) -> dict[str, Any]:
            obj["metadata"].setdefault("labels", {})[label] = value
            obj["metadata"].setdefault("annotations", {})[annotation] = value
            return obj

        self.kube.update(FLINK_DEPLOYMENTS, namespace, name, mutate)

    def stale_replace(self, namespace: str, name: str) -> None:
        """The operator's canary bump, by full replace: from an old copy first (409),
        then from a fresh one."""
        old = self.snapshots.get((namespace, name))
        if old is not None:
            try:
                self.kube.update(
                    FLINK_DEPLOYMENTS,
                    namespace,
                    name,
                    lambda _: copy.deepcopy(old),
                    require_rv=True,
                )
            except ApiError as err:
                self.faults[f"stale replace answered {err.code}"] += 1

        def bump(obj: dict[str, Any]) -> dict[str, Any]:
            spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
            nonce = spec.get("restartNonce", 0) if isinstance(spec, dict) else 0
            obj["spec"] = {**(spec or {}), "restartNonce": int(nonce) + 1}
            return obj

        self.kube.update(FLINK_DEPLOYMENTS, namespace, name, bump, require_rv=False)
        self.replacer_bumps[(namespace, name)] += 1

    # --------------------------------------------------------- the run

    async def poll_health(self, run: Running, stop: asyncio.Event) -> None:
        while not stop.is_set():
            status, _ = await run.get("/healthz")
            self.health.append((self.clock(), status))
            assert run.daemon.scheduler is not None
            unscheduled = run.daemon.scheduler.unscheduled()
            if unscheduled:
                self.report.unscheduled_polls += 1
                at = self.clock() - self.started
                self.report.unscheduled.extend(f"{at:.3f} s {key}" for key in unscheduled)
            try:
                async with asyncio.timeout(self.config.cycle / 4):
                    await stop.wait()
            except TimeoutError:
                pass

    async def run(self, kubeconfig: Path) -> SoakReport:
        cfg = self.config
        for n in range(cfg.namespaces):
            self.kube.create_namespace(f"soak-{n}")
        names = [(f"soak-{i % cfg.namespaces}", f"canary-{i:03}") for i in range(cfg.canaries)]
        for namespace, name in names:
            create_canary(self.kube, name, namespace)
        # Bounded and full before the traced half: freed dict key tables are reused by
        # the log, and tracemalloc would count a growing log against their first owner.
        self.kube.keep_requests = 2_000
        self.kube.hooks.append(self.chaos)
        # Stuck periods in the first half; memory is traced over the second half only
        # (everything here shares one event loop, and tracing slows it threefold).
        half = cfg.cycles // 2
        stuck_at = set(range(cfg.stuck_every // 2, half - 6, cfg.stuck_every))
        self.report.rss_mib_start = _rss_mib()
        async with running_daemon(
            self.kube,
            kubeconfig,
            timeout=cfg.cycle,
            kinds=("flinkdeployments",),
        ) as run:
            original = run.registry.set_state

            def recording(canary: Any, state: CanaryState, reason: str, cause: str) -> None:
                if canary.state is not state:
                    self.transitions.append((self.clock(), canary.key, state))
                original(canary, state, reason, cause)

            run.registry.set_state = recording
            for namespace, name in names:
                await run.until_tracked(name, namespace, within=10)
            start_nonces = {k: self.nonce(*k) for k in names}
            stop = asyncio.Event()
            poller = asyncio.create_task(self.poll_health(run, stop))
            started = self.started = self.clock()
            held_until: int | None = None
            outage_until: int | None = None
            loop = asyncio.get_running_loop()

            def quiet(cycle: int) -> bool:
                """No stuck window now or soon: canaryd's own faults are judged apart."""
                return held_until is None and not any(cycle <= at <= cycle + 6 for at in stuck_at)

            mid: tracemalloc.Snapshot | None = None
            late: tracemalloc.Snapshot | None = None
            three_quarters = (half + 9 + cfg.cycles) // 2
            for cycle in range(cfg.cycles):
                if cycle == half:
                    tracemalloc.start()
                elif half + 5 <= cycle < half + 9:
                    # What the first traced cycles allocated is steady state. The least of
                    # four moments: what is in flight at one moment (requests, pooled
                    # connections, answers) is not what canaryd keeps.
                    mid = _least(mid, _canaryd_snapshot())
                    self.report.traced_kib_mid = _kib(mid)
                elif three_quarters <= cycle < three_quarters + 4:
                    late = _least(late, _canaryd_snapshot())
                    self.report.traced_kib_late = _kib(late)
                if held_until is None and cycle in stuck_at:
                    length = self.rng.uniform(2.5, 4.0)
                    self.kube.hold_watch_events()
                    held = self.clock()
                    held_until = cycle + int(length) + 1
                elif held_until is not None and cycle >= held_until:
                    self.kube.release_watch_events()
                    self.windows.append((held, self.clock()))
                    held_until = None
                if outage_until is not None and cycle >= outage_until:
                    await self.kube.accept_connections()
                    self.note("outage over")
                    outage_until = None
                if outage_until is not None:
                    pass  # nothing else happens to a server that is away
                elif cycle and cycle % cfg.outage_every == cfg.outage_every // 2 and quiet(cycle):
                    await self.kube.refuse_connections()
                    outage_until = cycle + cfg.outage_cycles
                    self.faults["API server away (connections refused)"] += 1
                    self.note("outage")
                elif cycle and cycle % cfg.empty_watch_every == 0 and quiet(cycle):
                    empty = self.kube.inject(Fault(verb="watch", empty_watch=True, times=-1))
                    self.kube.close_watches()
                    loop.call_later(
                        cfg.empty_watch_share * cfg.cycle, self.kube.faults.remove, empty
                    )
                    self.faults["watches answered and closed at once"] += 1
                    self.note("empty watches")
                elif cycle and cycle % cfg.compact_every == 0:
                    self.kube.compact()
                    self.kube.abort_watches()
                    self.faults["compaction with a reset (410)"] += 1
                    self.note("compaction with a reset")
                elif cycle and cycle % cfg.half_open_every == 0 and quiet(cycle):
                    self.kube.silence_watches()
                    self.faults["watch connections half-open"] += 1
                    self.note("half-open")
                elif cycle and cycle % cfg.drop_every == 0:
                    self.kube.abort_watches()
                    self.faults["watch connections reset mid-stream"] += 1
                    self.note("reset")
                for key in names:
                    obj = self.kube.get("flinkdeployments", key[0], key[1])
                    if obj is not None and self.rng.random() < 0.2:
                        self.snapshots[key] = obj
                await asyncio.sleep(cfg.cycle)  # the workload's pace, not a synchronisation
            if held_until is not None:
                self.kube.release_watch_events()
                self.windows.append((held, self.clock()))
            if outage_until is not None:
                await self.kube.accept_connections()
            self.kube.hooks.remove(self.chaos)
            await asyncio.sleep(3 * cfg.cycle)  # let the last verdicts land
            end = None
            for _ in range(4):  # the least of four moments, as at mid-run
                end = _least(end, _canaryd_snapshot())
                await asyncio.sleep(cfg.cycle)
            assert end is not None
            self.report.traced_kib_end = _kib(end)
            self.report.traced_growth = [
                str(stat)
                for stat in (end.compare_to(mid, "lineno")[:8] if mid else [])
                if stat.size_diff > 0
            ]
            tracemalloc.stop()
            stop.set()
            await poller
            self.report.seconds = self.clock() - started
            self.report.cycles = cfg.cycles
            # canaryd's own bumps: the nonce's rise less the replacer's bumps
            bumps = [self.nonce(*k) - start_nonces[k] - self.replacer_bumps[k] for k in names]
            self.report.min_bumps, self.report.max_bumps = min(bumps), max(bumps)
        self.report.rss_mib_end = _rss_mib()
        self.report.faults = dict(self.faults)
        self.judge()
        return self.report

    def note(self, what: str) -> None:
        """A line in the log for each fault of canaryd's own connection (diagnosis)."""
        log.info("soak_fault", fault=what, at=round(self.clock() - self.started, 3))

    def nonce(self, namespace: str, name: str) -> int:
        obj = self.kube.get("flinkdeployments", namespace, name) or {}
        spec = obj.get("spec")
        value = spec.get("restartNonce", 0) if isinstance(spec, dict) else 0
        return value if isinstance(value, int) else 0

    def judge(self) -> None:
        cycle = self.config.cycle
        # Health may fail from the hold until 2.5 cycles after the release.
        excused = [(held, released + 2.5 * cycle) for held, released in self.windows]

        def excusable(t: float) -> bool:
            return any(a <= t <= b for a, b in excused)

        self.report.polls = len(self.health)
        self.report.false_unhealthy_polls = sum(
            1 for t, status in self.health if status != 200 and not excusable(t)
        )
        false = [
            f"{t - self.started:.3f} s {key}"
            for t, key, state in self.transitions
            if state is CanaryState.UNHEALTHY and not excusable(t)
        ]
        self.report.false_unhealthy_verdicts = len(false)
        self.report.false_verdicts = false
        for held, released in self.windows:
            failing = [t for t, status in self.health if status != 200 and t >= held]
            first = min(failing) if failing else float("inf")
            healthy_after = [t for t, status in self.health if status == 200 and t >= released]
            recovered = min(healthy_after) if healthy_after else float("inf")
            self.report.stuck_periods.append(
                {
                    "at": held - self.started,
                    "length": released - held,
                    "detected_in": first - held,
                    "healed_in": recovered - released,
                }
            )
        for key, wanted in self.expected.items():
            obj = self.kube.get("flinkdeployments", *key) or {"metadata": {}}
            for part in ("labels", "annotations"):
                have = obj["metadata"].get(part) or {}
                for k, v in wanted[part].items():
                    self.report.labels_expected += 1
                    self.report.labels_missing += have.get(k) != v


PACKAGE_DIR = Path(canaryd.__file__).resolve().parent
"""canaryd's own source files. A glob such as ``*/canaryd/*`` would also match every
file of a clone in a folder named ``canaryd`` (aiohttp in its .venv, these tests)."""


def _least(kept: tracemalloc.Snapshot | None, new: tracemalloc.Snapshot) -> tracemalloc.Snapshot:
    """Of two snapshots, the one in which canaryd held less."""
    return new if kept is None or _kib(new) < _kib(kept) else kept


def _canaryd_snapshot() -> tracemalloc.Snapshot:
    """What canaryd's code allocated and still holds. Garbage in reference cycles (an
    exception, its traceback and the frames it went through) is collected first: the
    collector frees it later anyway, and how much of it is waiting at one moment says
    nothing about growth.

    Kept by the allocating frame's file, compared as a prefix: ``filter_traces`` matches
    each of this process's 300,000 traces with fnmatch, about a second; on the loop
    canaryd shares, every bump due meanwhile would be late (skipped), and the measure
    would count the state that its own stall caused (CI saw it)."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot()
    own, testing = f"{PACKAGE_DIR}{os.sep}", f"{PACKAGE_DIR / 'testing'}{os.sep}"
    kept = [  # a trace: (domain, size, frames with the most recent first, frame count)
        trace
        for trace in snapshot.traces._traces
        if trace[2][0][0].startswith(own) and not trace[2][0][0].startswith(testing)
    ]
    return tracemalloc.Snapshot(kept, snapshot.traceback_limit)


def _kib(snapshot: tracemalloc.Snapshot) -> float:
    """Live memory allocated by canaryd's own code (not the fake's, not the tests')."""
    return sum(stat.size for stat in snapshot.statistics("filename")) / 1024
