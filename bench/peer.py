"""canaryd beside a kopf-based prober (bench/kopf_prober.py) doing the same job, in one
run against one fake API server: information, no goal (DESIGN: budgets, not races).

Each runs as a process of its own against the same fake API server process with the
same canaries and cycle, never both at once, in ``rounds`` interleaved rounds (canaryd
then the prober, the prober then canaryd, ...), so that what the shared machine does
meanwhile weighs on both alike; each figure is the median of its rounds (peak RSS the
highest). In each round, for each: spawned; once every canary was bumped once and one
more (warm-up) cycle passed, a window of ``cycles`` cycles measures its process CPU
(/proc/PID/stat) and the bumps written (the rise of the sum of the canaries'
metadata.generation, read with a LIST at both ends: every bump raises a generation by
one and nothing else does); then 20 paced clients measure its health endpoint, and its
peak RSS (VmHWM) is read. Each round ends with bench/floor.py measured the same way: a
bump and nothing else, what any bumper in Python on canaryd's stack pays, so that the
ratio can be read against it. With ``profile``, canaryd runs once more under py-spy (a
run of its own, so the profiler's cost is in no figure).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import peervenv
import pyspy
from measure import (
    ROOT,
    Proc,
    cpu_seconds,
    fake_server,
    hammer,
    load_average,
    peak_rss_mb,
    percentiles,
    start_canaryd,
    wait_ok,
)

from canaryd.testing.process import free_port

PROBER = Path(__file__).resolve().parent / "kopf_prober.py"
FLOOR = Path(__file__).resolve().parent / "floor.py"
CANARIES_PATH = "/apis/flink.apache.org/v1beta1/flinkdeployments"
"""Issue 22: canaryd's steady-state CPU per bump at most this share of the prober's."""

PROFILE_CYCLES = 6
"""The profile's length in cycles (at 500 samples/s)."""

Start = Callable[[], Awaitable[tuple[Proc, str, Path | None]]]
"""Spawns a contender; returns it, its health endpoint's URL once that answers, and the
file its stderr goes to (None: the bench's own stderr)."""


@dataclass
class Figures:
    name: str
    first_round: float = 0.0
    """Seconds from spawn until every canary was bumped at least once."""
    load: str = ""
    """Load average when the window started."""
    window: float = 0.0
    window_cpu: float = 0.0
    window_bumps: int = 0
    fake_cpu: float = 0.0
    """The fake API server's CPU seconds in the window."""
    total_cpu: float = 0.0
    """CPU seconds from spawn to the window's end."""
    total_bumps: int = 0
    rss_mb: float = 0.0
    healthz: tuple[float, float] = (0.0, 0.0)
    """p50, p99 in ms."""
    statuses: Counter[int] = field(default_factory=Counter)

    @property
    def cpu_per_bump(self) -> float:
        return self.window_cpu * 1000 / max(self.window_bumps, 1)

    @property
    def cpu_per_bump_total(self) -> float:
        return self.total_cpu * 1000 / max(self.total_bumps, 1)

    @property
    def bumps_per_second(self) -> float:
        return self.window_bumps / max(self.window, 1e-9)


@dataclass
class Runs:
    """One contender's rounds, summed up: the median round of each figure (the highest
    peak RSS and fake API server share)."""

    name: str
    rounds: list[Figures] = field(default_factory=list)

    def _median(self, figure: Callable[[Figures], float]) -> float:
        return statistics.median(figure(r) for r in self.rounds) if self.rounds else 0.0

    @property
    def cpu_per_bump(self) -> float:
        return self._median(lambda r: r.cpu_per_bump)

    @property
    def cpu_per_bump_total(self) -> float:
        return self._median(lambda r: r.cpu_per_bump_total)

    @property
    def bumps_per_second(self) -> float:
        return self._median(lambda r: r.bumps_per_second)

    @property
    def window_bumps(self) -> int:
        return round(self._median(lambda r: r.window_bumps))

    @property
    def first_round(self) -> float:
        return self._median(lambda r: r.first_round)

    @property
    def rss_mb(self) -> float:
        return max((r.rss_mb for r in self.rounds), default=0.0)

    @property
    def healthz(self) -> tuple[float, float]:
        return self._median(lambda r: r.healthz[0]), self._median(lambda r: r.healthz[1])

    @property
    def fake_share(self) -> float:
        """The fake API server's busiest share of a core in a window."""
        return max((r.fake_cpu / max(r.window, 1e-9) for r in self.rounds), default=0.0)

    @property
    def statuses(self) -> Counter[int]:
        return sum((r.statuses for r in self.rounds), Counter())

    @property
    def load(self) -> str:
        return "; ".join(r.load for r in self.rounds)

    def spread(self) -> str:
        """Each round's CPU per bump, in the order they ran."""
        return ", ".join(f"{r.cpu_per_bump:.3f}" for r in self.rounds)


@dataclass
class Comparison:
    canaries: int
    cycle: float
    cycles: int
    kopf_version: str
    canaryd: Runs
    kopf: Runs
    floor: Runs = field(default_factory=lambda: Runs("floor"))
    """bench/floor.py: a bump and nothing else."""
    profile: pyspy.Profile | None = None
    profile_error: str = ""

    @property
    def ratio(self) -> float:
        return self.canaryd.cpu_per_bump / max(self.kopf.cpu_per_bump, 1e-9)

    @property
    def met(self) -> bool:
        """No goal to miss: the comparison is information (the fake must not be the
        bottleneck, which its own row says)."""
        return True

    def round_ratios(self) -> list[float]:
        """Each round's ratio, canaryd's window against the prober's of the same round."""
        return [
            c.cpu_per_bump / max(k.cpu_per_bump, 1e-9)
            for c, k in zip(self.canaryd.rounds, self.kopf.rounds, strict=False)
        ]

    def table(self) -> str:
        c, k = self.canaryd, self.kopf
        expected = self.canaries / self.cycle
        rounds = len(c.rounds)
        rows = [
            (
                f"CPU per bump, steady state ({self.cycles} cycles after a warm-up cycle; "
                f"median of {rounds} interleaved rounds)",
                f"{c.cpu_per_bump:.3f} ms",
                f"{k.cpu_per_bump:.3f} ms",
                f"{self.ratio:.2f}x",
                "- (information)",
                "",
            ),
            (
                "the rounds' CPU per bump, in the order they ran (and their ratios)",
                c.spread() + " ms",
                k.spread() + " ms",
                ", ".join(f"{r:.2f}x" for r in self.round_ratios()),
                "-",
                "",
            ),
            (
                "the floor: a bump and nothing else (bench/floor.py: the PATCH, its answer "
                "and its watch event in Python on canaryd's stack, none of its logic)",
                f"{self.floor.cpu_per_bump:.3f} ms ({self.floor.spread()})",
                "-",
                f"{self.floor.cpu_per_bump / max(k.cpu_per_bump, 1e-9):.2f}x",
                "-",
                "",
            ),
            (
                "CPU per bump from spawn (start included)",
                f"{c.cpu_per_bump_total:.3f} ms",
                f"{k.cpu_per_bump_total:.3f} ms",
                f"{c.cpu_per_bump_total / max(k.cpu_per_bump_total, 1e-9):.2f}x",
                "-",
                "",
            ),
            (
                "bumps written per second in the window",
                f"{c.bumps_per_second:.0f} ({c.window_bumps} bumps)",
                f"{k.bumps_per_second:.0f} ({k.window_bumps} bumps)",
                f"{c.bumps_per_second / max(k.bumps_per_second, 1e-9):.2f}x",
                f"{expected:.0f} (every canary every cycle)",
                _verdict(min(c.bumps_per_second, k.bumps_per_second) >= 0.98 * expected),
            ),
            (
                "peak RSS (VmHWM, the highest round)",
                f"{c.rss_mb:.0f} MB",
                f"{k.rss_mb:.0f} MB",
                f"{c.rss_mb / max(k.rss_mb, 1e-9):.2f}x",
                "-",
                "",
            ),
            (
                "health endpoint p50 / p99, 20 clients at 100 requests/s each",
                f"{c.healthz[0]:.2f} / {c.healthz[1]:.2f} ms ({_statuses(c.statuses)})",
                f"{k.healthz[0]:.2f} / {k.healthz[1]:.2f} ms ({_statuses(k.statuses)})",
                f"{c.healthz[1] / max(k.healthz[1], 1e-9):.2f}x (p99)",
                "-",
                "",
            ),
            (
                "spawn to every canary bumped once",
                f"{c.first_round:.1f} s",
                f"{k.first_round:.1f} s",
                f"{c.first_round / max(k.first_round, 1e-9):.2f}x",
                "-",
                "",
            ),
            (
                "fake API server CPU in a window (the busiest)",
                f"{c.fake_share:.0%} of a core",
                f"{k.fake_share:.0%} of a core",
                "-",
                "not the bottleneck",
                _verdict(max(c.fake_share, k.fake_share) < 0.9),
            ),
            ("load average (1/5/15 min) at each window's start", c.load, k.load, "-", "-", ""),
        ]
        lines = [
            f"| measure | canaryd | kopf {self.kopf_version} prober | canaryd / kopf "
            "| goal | met |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)

    def profile_text(self) -> str:
        if self.profile is None:
            return self.profile_error
        p = self.profile
        held = p.samples / max(p.rate * p.seconds, 1)
        cpu = f", while its process used {p.cpu_share:.1%} of a core" if p.cpu_share else ""
        return (
            f"canaryd in the same scenario, a run of its own: py-spy {peervenv.PY_SPY_VERSION}, "
            f"{p.rate} samples/s for {p.seconds:g} s, {p.samples} samples with canaryd "
            f"holding the GIL (`--gil`: the loop's wait in epoll is left out, and so is "
            f"libuv's I/O without the GIL), {held:.1%} of the time{cpu}; own = innermost "
            f"frame, total = anywhere on the stack.\n\n{p.top()}"
        )


def _statuses(statuses: Counter[int]) -> str:
    return ", ".join(f"{count} x {code}" for code, count in sorted(statuses.items()))


def _verdict(met: bool) -> str:
    return "yes" if met else "**no**"


async def generations(url: str) -> int:
    """The sum of every canary's metadata.generation (one LIST)."""
    async with aiohttp.ClientSession() as http, http.get(url + CANARIES_PATH) as response:
        response.raise_for_status()
        listed = await response.json()
    return sum(int(item["metadata"].get("generation", 0)) for item in listed["items"])


async def until_first_round(fake: Proc, base: int, canaries: int, within: float) -> None:
    """Until the canaries' generations rose by ``canaries`` (each bumped about once)."""
    deadline = time.monotonic() + within
    while await generations(fake.url) < base + canaries:
        if time.monotonic() > deadline:
            print(f"  not every canary bumped after {within:g} s; measuring anyway", flush=True)
            return
        await asyncio.sleep(1.0)


async def measure(
    name: str, start: Start, fake: Proc, canaries: int, cycle: float, cycles: int
) -> Figures:
    figures = Figures(name)
    base = await generations(fake.url)
    spawned = time.monotonic()
    proc, health, log = await start()
    try:
        await until_first_round(fake, base, canaries, within=10 * cycle)
        figures.first_round = time.monotonic() - spawned
        await asyncio.sleep(cycle)  # the warm-up cycle
        figures.load = load_average()
        gen0, cpu0, fake0, t0 = (
            await generations(fake.url),
            cpu_seconds(proc.pid),
            cpu_seconds(fake.pid),
            time.monotonic(),
        )
        await asyncio.sleep(cycles * cycle)
        cpu1, fake1, t1 = cpu_seconds(proc.pid), cpu_seconds(fake.pid), time.monotonic()
        gen1 = await generations(fake.url)
        figures.window, figures.window_cpu, figures.fake_cpu = t1 - t0, cpu1 - cpu0, fake1 - fake0
        figures.window_bumps, figures.total_bumps = gen1 - gen0, gen1 - base
        figures.total_cpu = cpu1
        latencies, _ = await hammer(health, 20, 5.0, every=0.01, statuses=figures.statuses)
        figures.healthz = percentiles(latencies)
        figures.rss_mb = peak_rss_mb(proc.pid)
    finally:
        if log is not None:
            show_log(name, log)  # what it said while measured, not while stopping
        await proc.stop()
    print(
        f"  {name}: {figures.cpu_per_bump:.3f} CPU-ms per bump in the window "
        f"({figures.window_bumps} bumps, {figures.window_cpu:.2f} CPU-s in {figures.window:.1f} s;"
        f" load {figures.load}), {figures.cpu_per_bump_total:.3f} from spawn, "
        f"RSS {figures.rss_mb:.0f} MB, health p99 {figures.healthz[1]:.2f} ms "
        f"({_statuses(figures.statuses)})",
        flush=True,
    )
    return figures


def show_log(name: str, log: Path, lines: int = 5) -> None:
    said = log.read_text(errors="replace").splitlines()
    if said:
        print(f"  {name} logged {len(said)} lines; the first {min(lines, len(said))}:")
        for line in said[:lines]:
            print(f"    {line}")


def canaryd_start(kubeconfig: Path, cycle: float) -> Start:
    async def start() -> tuple[Proc, str, Path | None]:
        proc, _ = await start_canaryd(kubeconfig, cycle)
        return proc, proc.url + "/healthz", None

    return start


def kopf_start(bin_dir: Path, kubeconfig: Path, cycle: float) -> Start:
    async def start() -> tuple[Proc, str, Path | None]:
        health = f"http://127.0.0.1:{free_port()}/healthz"
        log = kubeconfig.parent / "kopf-prober.log"
        stderr = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            process = await asyncio.create_subprocess_exec(
                str(bin_dir / "kopf"),
                "run",
                "--standalone",
                "--all-namespaces",
                "--quiet",
                "--liveness",
                health,
                str(PROBER),
                env={
                    **os.environ,
                    "KUBECONFIG": str(kubeconfig),
                    "CANARY_PROBER_CYCLE": f"{cycle}",
                },
                cwd=ROOT,
                stderr=stderr,
            )
        finally:
            os.close(stderr)  # the child has its own copy
        proc = Proc(process)
        try:
            await wait_ok(health, within=120, every=0.05)
        except BaseException:
            await proc.stop()
            raise
        return proc, health, log

    return start


async def profile_canaryd(
    bin_dir: Path, kubeconfig: Path, fake: Proc, canaries: int, cycle: float, seconds: float
) -> pyspy.Profile:
    base = await generations(fake.url)
    proc, _ = await start_canaryd(kubeconfig, cycle)
    try:
        await until_first_round(fake, base, canaries, within=10 * cycle)
        await asyncio.sleep(cycle)
        output = kubeconfig.parent / "canaryd.pyspy.txt"
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        profile = await pyspy.record(bin_dir / "py-spy", proc.pid, seconds, output)
        profile.cpu_share = (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0)
        return profile
    finally:
        await proc.stop()


async def measure_floor(
    fake: Proc,
    canaries: int,
    cycle: float,
    cycles: int,
    health: Callable[[str], Awaitable[None]] | None = None,
) -> Figures:
    """bench/floor.py's CPU per bump, measured as the contenders' is (no health requests
    in the window); ``health`` is then given its /healthz URL, before it stops."""
    figures = Figures("floor")
    base = await generations(fake.url)
    spawned = time.monotonic()
    port = [str(free_port())] if health is not None else []
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(FLOOR), fake.url, f"{cycle}", *port, cwd=ROOT
    )
    proc = Proc(process)
    try:
        await until_first_round(fake, base, canaries, within=10 * cycle)
        figures.first_round = time.monotonic() - spawned
        await asyncio.sleep(cycle)
        figures.load = load_average()
        gen0, cpu0, t0 = await generations(fake.url), cpu_seconds(proc.pid), time.monotonic()
        await asyncio.sleep(cycles * cycle)
        cpu1, t1 = cpu_seconds(proc.pid), time.monotonic()
        gen1 = await generations(fake.url)
        figures.window, figures.window_cpu = t1 - t0, cpu1 - cpu0
        figures.window_bumps, figures.total_bumps = gen1 - gen0, gen1 - base
        figures.total_cpu = cpu1
        figures.rss_mb = peak_rss_mb(proc.pid)
        if health is not None:
            await health(f"http://127.0.0.1:{port[0]}/healthz")
    finally:
        await proc.stop()
    print(
        f"  floor: {figures.cpu_per_bump:.3f} CPU-ms per bump in the window "
        f"({figures.window_bumps} bumps, {figures.window_cpu:.2f} CPU-s in {figures.window:.1f} s)",
        flush=True,
    )
    return figures


async def compare(
    tmp: Path,
    canaries: int = 2000,
    cycle: float = 5.0,
    cycles: int = 4,
    namespaces: int = 100,
    profile: bool = False,
    rounds: int = 3,
) -> Comparison:
    """canaryd and the kopf prober, ``rounds`` times each, interleaved (each round starts
    with the one the last round ended with), against one fake API server process."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    bin_dir = peervenv.ensure()
    kopf_version = peervenv.version(bin_dir, "kopf")
    ours, theirs, floor = Runs("canaryd"), Runs("kopf prober"), Runs("floor")
    async with fake_server(tmp, canaries, namespaces) as (fake, kubeconfig):
        contenders = [
            (ours, canaryd_start(kubeconfig, cycle)),
            (theirs, kopf_start(bin_dir, kubeconfig, cycle)),
        ]
        for round_ in range(rounds):
            for runs, start in contenders if round_ % 2 == 0 else contenders[::-1]:
                print(
                    f"round {round_ + 1} of {rounds}: {runs.name} ({canaries:,} canaries, "
                    f"{cycle:g} s cycle{'' if runs is ours else f', kopf {kopf_version}'})",
                    flush=True,
                )
                runs.rounds.append(await measure(runs.name, start, fake, canaries, cycle, cycles))
            print(f"round {round_ + 1} of {rounds}: the floor (bench/floor.py)", flush=True)
            floor.rounds.append(await measure_floor(fake, canaries, cycle, cycles))
        comparison = Comparison(canaries, cycle, cycles, kopf_version, ours, theirs, floor)
        if profile:
            print("canaryd under py-spy", flush=True)
            try:
                comparison.profile = await profile_canaryd(
                    bin_dir, kubeconfig, fake, canaries, cycle, PROFILE_CYCLES * cycle
                )
            except RuntimeError as err:
                comparison.profile_error = f"no profile: {err}"
    return comparison
