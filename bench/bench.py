"""``make bench``: canaryd as its own process against the fake API server in another.

Prints one table and writes it to docs/PERFORMANCE.md:

- API requests per canary per cycle by verb in steady state (goal: 1.00 PATCH,
  0 GET, 0 LIST) and per bump with a concurrent writer (goal: <= 3);
- at 1,000 and 10,000 canaries over 1,000 namespaces, on a shortened cycle with
  CPU normalised to a 60 s cycle: daemon CPU (goal <= 5% of a core at 10k), peak
  RSS (goal <= 120 MB at 10k), verdict lateness p99 (goal <= 1 s), start to
  /readyz 200 (goal <= 5 s at 10k), and the fake API server's own CPU;
- /healthz with 10k canaries and 20 concurrent clients: p50/p99 latency (goal
  p99 <= 2 ms) and throughput as a ratio to a bare aiohttp handler (goal >= 0.8);
- Lease requests per minute per replica, two replicas with --leader-elect and the
  shipped timings (goal: the leader one request per renew, 60 s / retry period; the
  follower one read per look, at most 60 s / (0.75 x retry period)).

Only 127.0.0.1 is used. Run: ``.venv/bin/python bench/bench.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from canaryd.config import Settings
from canaryd.testing.apiserver import FLINK_DEPLOYMENTS, FakeKube
from canaryd.testing.process import canaryd_argv, free_port

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
METRIC_RE = re.compile(r"^(\w+)(?:\{([^}]*)\})? ([0-9.e+-]+|NaN|\+Inf)$")


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Proc:
    process: asyncio.subprocess.Process
    url: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(10):
                    await self.process.wait()
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


@contextlib.asynccontextmanager
async def fake_server(
    tmp: Path, canaries: int, namespaces: int, conflict_rate: float = 0.0
) -> AsyncIterator[tuple[Proc, Path]]:
    kubeconfig = tmp / f"kubeconfig-{canaries}-{conflict_rate}"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "canaryd.testing.apiserver",
        "--kubeconfig",
        str(kubeconfig),
        "--canaries",
        str(canaries),
        "--canary-namespaces",
        str(namespaces),
        "--conflict-rate",
        str(conflict_rate),
        "--bookmark-interval",
        "60",
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    proc = Proc(process)
    try:
        assert process.stdout is not None
        async with asyncio.timeout(300):
            line = (await process.stdout.readline()).decode()
        proc.url = line.split("listening on ", 1)[1].split(";", 1)[0]
        yield proc, kubeconfig
    finally:
        await proc.stop()


async def start_canaryd(kubeconfig: Path, cycle: float) -> tuple[Proc, float]:
    """Start canaryd; returns it and the seconds from spawn to /readyz 200."""
    port = free_port()
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        *canaryd_argv(
            kubeconfig, port, cycle, "--log-level", "warning", "--kind", "flinkdeployments"
        ),
        cwd=ROOT,
    )
    proc = Proc(process, f"http://127.0.0.1:{port}")
    async with aiohttp.ClientSession() as http:
        async with asyncio.timeout(120):
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(proc.url + "/readyz") as response:
                        if response.status == 200:
                            return proc, time.monotonic() - started
                await asyncio.sleep(0.02)


async def scrape(url: str) -> dict[tuple[str, str], float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as response:
        text = await response.text()
    values: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        match = METRIC_RE.match(line)
        if match:
            values[(match.group(1), match.group(2) or "")] = float(match.group(3))
    return values


def requests_by_verb(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[str, float]:
    verbs: dict[str, float] = {}
    for (name, labels), value in after.items():
        if name == "canaryd_api_requests_total":
            verb = re.search(r'verb="([^"]+)"', labels)
            if verb:
                delta = value - before.get((name, labels), 0.0)
                verbs[verb.group(1)] = verbs.get(verb.group(1), 0.0) + delta
    return verbs


def metric_delta(
    before: dict[tuple[str, str], float],
    after: dict[tuple[str, str], float],
    name: str,
    labels: str = "",
) -> float:
    return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)


def lateness_p99(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> tuple[float, float]:
    """(p99 upper bound, count) of verdict lateness in the window, from the histogram."""
    name = "canaryd_verdict_lateness_seconds_bucket"
    buckets = sorted(
        (
            float(labels.split('"')[1]) if "+Inf" not in labels else float("inf"),
            value - before.get((n, labels), 0.0),
        )
        for (n, labels), value in after.items()
        if n == name
    )
    total = buckets[-1][1] if buckets else 0.0
    for bound, cumulative in buckets:
        if total and cumulative >= 0.99 * total:
            return bound, total
    return float("nan"), total


def stage_quantiles(
    before: dict[tuple[str, str], float],
    after: dict[tuple[str, str], float],
    stage: str,
    quantiles: tuple[float, ...] = (0.5, 0.99),
) -> tuple[list[float], float]:
    """Quantiles of a bump stage in the window, from canaryd_bump_duration_seconds
    (every kind), as Prometheus' histogram_quantile estimates them: linear within the
    bucket that holds the rank. Returns (quantiles in seconds, bumps)."""
    name = "canaryd_bump_duration_seconds_bucket"
    cumulative: dict[float, float] = {}
    for (n, labels), value in after.items():
        if n != name or f'stage="{stage}"' not in labels:
            continue
        bound = re.search(r'le="([^"]+)"', labels)
        assert bound is not None, labels
        le = float(bound.group(1))  # "+Inf" parses as inf
        cumulative[le] = cumulative.get(le, 0.0) + value - before.get((n, labels), 0.0)
    buckets = sorted(cumulative.items())
    total = buckets[-1][1] if buckets else 0.0
    found = []
    for q in quantiles:
        rank, lower, below = q * total, 0.0, 0.0
        estimate = float("nan")
        for bound, count in buckets:
            if total and count >= rank:
                if bound == float("inf"):
                    estimate = lower  # beyond the last finite bound: that bound
                else:
                    share = (rank - below) / (count - below) if count > below else 1.0
                    estimate = lower + (bound - lower) * share
                break
            lower, below = bound, count
        found.append(estimate)
    return found, total


def stage_rows(
    results: Results,
    label: str,
    before: dict[tuple[str, str], float],
    after: dict[tuple[str, str], float],
) -> None:
    """The bump stages' p50/p99 in the window (watch mode: answered and observed)."""
    for stage in ("answered", "observed", "reconciled"):
        (p50, p99), bumps = stage_quantiles(before, after, stage)
        if not bumps:
            results.add(
                f"{label}: bump stage {stage}, p50 / p99",
                "no samples (watch mode measures answered and observed)",
                "-",
                None,
            )
            continue
        results.add(
            f"{label}: bump stage {stage}, p50 / p99",
            f"{p50 * 1000:.1f} ms / {p99 * 1000:.1f} ms ({bumps:.0f} bumps)",
            "p99 <= 1 s (the SLO)" if stage == "observed" else "-",
            p99 <= 1.0 if stage == "observed" else None,
        )


@dataclass
class Results:
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)

    def add(self, measure: str, value: str, goal: str, met: bool | None) -> None:
        verdict = "" if met is None else ("yes" if met else "**no**")
        self.rows.append((measure, value, goal, verdict))
        print(f"  {measure}: {value} (goal {goal}) {verdict}", flush=True)

    def table(self) -> str:
        lines = ["| measure | value | goal | met |", "| --- | --- | --- | --- |"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in self.rows]
        return "\n".join(lines)


async def window(
    kubeconfig: Path, cycle: float, cycles: int
) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
    """canaryd's metrics before and after ``cycles`` steady cycles."""
    daemon, _ = await start_canaryd(kubeconfig, cycle)
    try:
        await asyncio.sleep(2.5 * cycle)  # first bumps, first verdicts
        before = await scrape(daemon.url)
        await asyncio.sleep(cycles * cycle)
        return before, await scrape(daemon.url)
    finally:
        await daemon.stop()


async def economy(tmp: Path, results: Results, cycle: float, cycles: int) -> None:
    canaries = 100
    async with fake_server(tmp, canaries, 10) as (_, kubeconfig):
        before, after = await window(kubeconfig, cycle, cycles)
    verbs = requests_by_verb(before, after)
    per = {v: verbs.get(v, 0.0) / canaries / cycles for v in ("patch", "get", "list")}
    results.add(
        "steady state: PATCH per canary per cycle",
        f"{per['patch']:.2f}",
        "1.00",
        abs(per["patch"] - 1.0) <= 0.02,
    )
    results.add(
        "steady state: GET / LIST per canary per cycle",
        f"{per['get']:.2f} / {per['list']:.2f}",
        "0 / 0",
        per["get"] == 0 and per["list"] == 0,
    )
    async with fake_server(tmp, canaries, 10, conflict_rate=0.5) as (_, kubeconfig):
        before, after = await window(kubeconfig, cycle, cycles)
    verbs = requests_by_verb(before, after)
    written = metric_delta(before, after, "canaryd_bumps_total", 'result="written"')
    requests = verbs.get("patch", 0.0) + verbs.get("get", 0.0)
    results.add(
        "requests per bump, half the bumps racing a concurrent writer",
        f"{requests / max(written, 1):.2f}",
        "<= 3",
        requests / max(written, 1) <= 3,
    )


async def scale(
    tmp: Path, results: Results, canaries: int, cycle: float, cycles: int, healthz: bool
) -> None:
    async with fake_server(tmp, canaries, 1000) as (fake, kubeconfig):
        daemon, ready_in = await start_canaryd(kubeconfig, cycle)
        try:
            label = f"{canaries:,} canaries"
            await asyncio.sleep(1.5 * cycle)  # every canary bumped once and judged once
            before = await scrape(daemon.url)
            (user0, sys0), fake0 = cpu_times(daemon.pid), cpu_seconds(fake.pid)
            t0 = time.monotonic()
            await asyncio.sleep(cycles * cycle)
            (user1, sys1), fake1 = cpu_times(daemon.pid), cpu_seconds(fake.pid)
            t1 = time.monotonic()
            cpu0, cpu1 = user0 + sys0, user1 + sys1
            user_share = (user1 - user0) / max(cpu1 - cpu0, 1e-9)
            after = await scrape(daemon.url)
            per_cycle = (cpu1 - cpu0) / ((t1 - t0) / cycle)
            normalised = per_cycle / 60 * 100
            written = metric_delta(before, after, "canaryd_bumps_total", 'result="written"')
            p99, verdicts = lateness_p99(before, after)
            goal_cpu = "<= 5%" if canaries >= 10_000 else "-"
            results.add(
                f"{label}: daemon CPU, normalised to a 60 s cycle",
                f"{normalised:.1f}% of a core ({per_cycle * 1000 / max(canaries, 1):.2f}"
                f" ms per canary-cycle, {user_share:.0%} user)",
                goal_cpu,
                normalised <= 5 if canaries >= 10_000 else None,
            )
            results.add(
                f"{label}: bumps written in the window",
                f"{written:.0f} of {canaries * (t1 - t0) / cycle:.0f} expected",
                "-",
                None,
            )
            results.add(
                f"{label}: peak RSS",
                f"{peak_rss_mb(daemon.pid):.0f} MB",
                "<= 120 MB" if canaries >= 10_000 else "-",
                peak_rss_mb(daemon.pid) <= 120 if canaries >= 10_000 else None,
            )
            results.add(
                f"{label}: verdict lateness p99",
                f"<= {p99:g} s ({verdicts:.0f} verdicts)",
                "<= 1 s",
                p99 <= 1,
            )
            stage_rows(results, label, before, after)
            results.add(
                f"{label}: start to /readyz 200",
                f"{ready_in:.2f} s",
                "<= 5 s" if canaries >= 10_000 else "-",
                ready_in <= 5 if canaries >= 10_000 else None,
            )
            fake_pct = (fake1 - fake0) / (t1 - t0) * 100
            results.add(
                f"{label}: fake API server CPU at the {cycle:g} s cycle",
                f"{fake_pct:.0f}% of a core (daemon: {(cpu1 - cpu0) / (t1 - t0) * 100:.0f}%)",
                "not the bottleneck",
                fake_pct < 90,
            )
            if healthz:
                await healthz_latency(daemon.url, results, label)
        finally:
            await daemon.stop()


async def leases(tmp: Path, results: Results, seconds: float) -> None:
    """Two replicas behind a Lease (shipped timings), the fake API server in this
    process: its request log says who sent which Lease request."""
    kube = FakeKube()
    retry = Settings().retry_period
    async with kube.running():
        kube.create_namespace("default")
        labels = {"flink.apache.org/canary": "true"}
        kube.create(FLINK_DEPLOYMENTS, "default", {"metadata": {"name": "c", "labels": labels}})
        replicas: dict[str, Proc] = {}
        try:
            for name in ("a", "b"):
                kubeconfig = kube.client_kubeconfig(tmp / f"lease-{name}.kubeconfig", name)
                port = free_port()
                process = await asyncio.create_subprocess_exec(
                    *canaryd_argv(
                        kubeconfig,
                        port,
                        10.0,
                        "--log-level",
                        "warning",
                        "--kind",
                        "flinkdeployments",
                        "--leader-elect",
                        "--identity",
                        name,
                        "--lease-namespace",
                        "default",
                    ),
                    cwd=ROOT,
                )
                replicas[name] = Proc(process, f"http://127.0.0.1:{port}")

            def held() -> bool:
                lease = kube.get("leases", "default", "canaryd") or {}
                return bool(lease.get("spec", {}).get("holderIdentity"))

            await kube.wait_for(held, within=60, what="a replica to take the Lease")
            await asyncio.sleep(3 * retry)  # both past their first rounds
            start, t0 = len(kube.requests), time.monotonic()
            await asyncio.sleep(seconds)
            window = [r for r in kube.requests[start:] if r.resource == "leases"]
            minutes = (time.monotonic() - t0) / 60
            leader = (kube.get("leases", "default", "canaryd") or {})["spec"]["holderIdentity"]
        finally:
            for proc in replicas.values():
                await proc.stop()
    for name in sorted(replicas, key=lambda n: n != leader):
        mine = [r for r in window if r.user == name]
        by_verb = {v: sum(r.verb == v for r in mine) / minutes for v in ("get", "update")}
        rate = len(mine) / minutes
        role = "leader" if name == leader else "follower"
        goal = 60 / retry if role == "leader" else 60 / (0.75 * retry)
        results.add(
            f"Lease requests per minute, the {role} (two replicas, retry period {retry:g} s)",
            f"{rate:.1f} (GET {by_verb['get']:.1f}, PUT {by_verb['update']:.1f})",
            f"<= {goal:.0f}",
            rate <= goal + 1,
        )


async def hammer(
    url: str, clients: int, seconds: float, every: float | None = None
) -> tuple[list[float], float]:
    """``clients`` concurrent clients for ``seconds``: each sends a request every ``every``
    seconds (paced, for latency) or back to back (None, for throughput)."""
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as http:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds

        async def client(offset: float) -> None:
            await asyncio.sleep(offset)
            next_at = loop.time()
            while loop.time() < end:
                start = time.perf_counter()
                async with http.get(url) as response:
                    await response.read()
                latencies.append(time.perf_counter() - start)
                if every is not None:
                    next_at += every
                    await asyncio.sleep(max(0.0, next_at - loop.time()))

        started = time.perf_counter()
        spread = every or 0.0
        await asyncio.gather(*(client(spread * i / clients) for i in range(clients)))
        elapsed = time.perf_counter() - started
    return latencies, len(latencies) / elapsed


def percentiles(latencies: list[float]) -> tuple[float, float]:
    ordered = sorted(latencies)
    return statistics.median(ordered) * 1000, ordered[int(len(ordered) * 0.99)] * 1000


BARE = """
import asyncio
import sys
from aiohttp import web
try:
    import uvloop  # the same loop as canaryd, or the comparison is not like for like
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
except ImportError:
    pass
async def ok(request):
    return web.Response(text="OK")
app = web.Application()
app.router.add_get("/healthz", ok)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


async def healthz_latency(url: str, results: Results, label: str) -> None:
    port = free_port()
    bare = await asyncio.create_subprocess_exec(sys.executable, "-c", BARE, str(port))
    try:
        async with aiohttp.ClientSession() as http, asyncio.timeout(30):
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"http://127.0.0.1:{port}/healthz") as response:
                        if response.status == 200:
                            break
                await asyncio.sleep(0.05)
        bare_url = f"http://127.0.0.1:{port}/healthz"
        latencies, _ = await hammer(url + "/healthz", 20, 5.0, every=0.01)
        bare_latencies, _ = await hammer(bare_url, 20, 5.0, every=0.01)
        _, rate = await hammer(url + "/healthz", 20, 3.0)
        _, bare_rate = await hammer(bare_url, 20, 3.0)
    finally:
        bare.send_signal(signal.SIGTERM)
        await bare.wait()
    p50, p99 = percentiles(latencies)
    bare_p50, bare_p99 = percentiles(bare_latencies)
    results.add(
        f"{label}: /healthz latency, 20 clients at 100 requests/s each",
        f"p50 {p50:.2f} ms, p99 {p99:.2f} ms (bare handler: p50 {bare_p50:.2f}, "
        f"p99 {bare_p99:.2f})",
        "p99 <= 2 ms",
        p99 <= 2,
    )
    results.add(
        f"{label}: /healthz throughput, 20 clients back to back, vs a bare aiohttp handler",
        f"{rate:.0f}/s vs {bare_rate:.0f}/s = {rate / bare_rate:.2f}",
        ">= 0.8",
        rate / bare_rate >= 0.8,
    )


def machine() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return (
        f"{os.cpu_count()} cores ({model}), Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}"
    )


async def main(quick: bool, output: Path | None, leases_only: bool = False) -> int:
    results = Results()
    load = "{:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg())
    print(f"machine: {machine()}; load average (1/5/15 min) {load}", flush=True)
    with tempfile.TemporaryDirectory(prefix="canaryd-bench-") as name:
        tmp = Path(name)
        if not leases_only:
            print("request economy", flush=True)
            await economy(tmp, results, cycle=1.0, cycles=3 if quick else 5)
        print("Lease traffic", flush=True)
        await leases(tmp, results, seconds=30.0)
        if leases_only:
            print("\n" + results.table())
            return 0 if all(row[3] != "**no**" for row in results.rows) else 1
        print("1,000 canaries", flush=True)
        await scale(tmp, results, 1000, cycle=5.0, cycles=2 if quick else 3, healthz=False)
        if not quick:
            print("10,000 canaries", flush=True)
            await scale(tmp, results, 10_000, cycle=30.0, cycles=2, healthz=True)
    table = results.table()
    print("\n" + table)
    if output is not None:
        write_report(output, table, load)
    return 0 if all(row[3] != "**no**" for row in results.rows) else 1


def write_report(output: Path, table: str, load: str) -> None:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    output.write_text(
        PERFORMANCE.format(
            when=when, machine=machine(), load=load, table=table, history=HISTORY.strip()
        )
    )


PERFORMANCE = """# Performance

The latest `make bench` table (bench/bench.py): canaryd as its own process
against the fake API server in another process, over 127.0.0.1.

Run {when} on {machine}.
Load average (1/5/15 min) when it started: {load} (the cores are shared with other
work: CPU shares and latencies move with it).

{table}

The bump stages are canaryd's own SLI (`canaryd_bump_duration_seconds{{stage}}`,
README "Alerts"): from a bump's PATCH to its answer (`answered`) and to the watch
event that carries its generation (`observed`), over the window's bumps, estimated
from the histogram's buckets as Prometheus' `histogram_quantile` does (linear within
a bucket). Against the fake API server on the same two cores they measure canaryd
and the fake together, not a real API server; `make e2e` measures them on a real
control plane.

CPU "normalised to a 60 s cycle" is the daemon's CPU per cycle on the shortened
cycle (the same bumps, watch events and verdicts per cycle) divided by 60 s.
The /healthz latency is measured with paced clients (each sends a request every
10 ms), so it shows the server's response time while canaryd works, not queueing
in the benchmark's own client; throughput is measured back to back and compared
with a bare aiohttp handler on the same event loop, in the same run.

{history}

## Reading the /healthz rows

Both servers answer faster than one Python benchmark client can ask: back to
back, the client saturates near 20,000 requests/s for either of them, so the
throughput ratio says "not slower than a bare handler" rather than measuring
the servers' ceilings (a native load generator would). The paced latency row
is the more telling one: canaryd's p99 is about twice the bare handler's while
it is also bumping 333 canaries a second, and well inside the 2 ms goal.
"""


HISTORY = """
## What changed, with figures

The first run (2026-12-01, same machine) missed the CPU goal: 0.36 ms of daemon CPU
per canary-cycle at 10,000 canaries, 6.1% of a core on a 60 s cycle (1,000
canaries: 0.41 ms). A sampling profile (py-spy) put most of it in aiohttp's
request machinery; on its own, a PATCH cost 0.13 ms of client CPU through aiohttp
and 0.044 ms as raw HTTP/1.1 over asyncio streams (both on uvloop).

| change | 10,000 canaries, ms per canary-cycle (% of a core at 60 s) |
| --- | --- |
| before | 0.36 (6.1%) |
| uvloop, no Backoff/Random per bump, metric children looked up once, hand-serialised bump body | 0.38 (6.4%): within noise; the cost was not there |
| canaryd/http1.py for request/response calls, header lines encoded once | 0.26 (4.3%) |

Other goals were met from the first run: 1.00 PATCH and no GET or LIST per canary
per cycle, 2.9 requests per bump when half the bumps race a concurrent writer,
peak RSS 96-100 MB, verdict lateness p99 <= 5 ms, /readyz in under 0.6 s at
10,000 canaries. The first /healthz latency figure (p99 2.18 ms) came from a
saturating closed loop, which measures queueing in the benchmark's own client
(latency = clients / throughput); the benchmark now paces its latency clients.

Lease traffic with two replicas (2026-12-02): the leader renewed with a GET and a PUT,
60 requests a minute; with client-go's optimistic update (a PUT from the Lease it last
wrote; a 409 or an error falls back to a GET and a PUT) it is 30, one per renew. The
follower reads once per look, 34 a minute (its looks are jittered to 75-100 % of the
retry period).

The bump stages were added to the table on 2026-12-02 (issue 18): at 10,000
canaries, `answered` p50 2.5 ms / p99 5.6 ms and `observed` p50 2.5 ms / p99 7.8 ms.
That run missed two goals on a machine shared with other builds and tests (load
average 1.2, a Go build running when it started): daemon CPU 5.6% of a core (0.34 ms
per canary-cycle; 4.4% and 0.26 ms on 2026-12-01) and /healthz p99 2.28 ms (the bare
handler's p99 was 6.23 ms in the same run: the machine's contention). A run earlier
that day at load average 3.2 gave 6.3%, /healthz p99 51.7 ms (bare handler 31.8 ms)
and stages p99 35.6 ms (`answered`) and 46.2 ms (`observed`). Whether the CPU figure
is a regression or the load was not investigated: it needs a quiet machine.
"""


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="skip the 10,000-canary run")
    parser.add_argument("--output", type=Path, default=None, help="write the table here")
    parser.add_argument(
        "--leases-only", action="store_true", help="only the Lease traffic (about 40 s)"
    )
    arguments = parser.parse_args()
    try:
        import uvloop  # the client side costs less too; the comparison is in-run anyway
    except ImportError:
        sys.exit(asyncio.run(main(arguments.quick, arguments.output, arguments.leases_only)))
    sys.exit(uvloop.run(main(arguments.quick, arguments.output, arguments.leases_only)))
