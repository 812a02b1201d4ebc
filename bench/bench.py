"""``make bench``: canaryd as its own process against the fake API server in another.

Prints its tables and writes them to docs/PERFORMANCE.md:

- API requests per canary per cycle by verb in steady state (goal: 1.00 PATCH,
  0 GET, 0 LIST) and per bump with a concurrent writer (goal: <= 3);
- at 1,000 canaries over 1,000 namespaces on a 5 s cycle, and at 10,000 on the shipped
  60 s cycle (the budgets' cycle), CPU normalised to a 60 s cycle: daemon CPU (at 10k
  against bench/floor.py at the same rate on the same fake: goal <= 2.0x), peak RSS
  (goal <= 120 MB at 10k), verdict lateness p99 (goal <= 1 s), start to /readyz 200
  (goal <= 5 s at 10k), and the fake API server's own CPU;
- at 1 canary, peak RSS against the import floor of canaryd's dependencies (a Python
  that imports them and nothing else; goal <= 1.25x);
- /healthz with 10k canaries bumped on the 60 s cycle (167 a second) and 20 concurrent
  clients: p50/p99 latency (goal p99 <= 2x a bare aiohttp handler's, same run) and
  throughput as a ratio to it (goal >= 0.8);
- Lease requests per minute per replica, two replicas with --leader-elect and the
  shipped timings (goal: the leader one request per renew, 60 s / retry period; the
  follower one read per look, at most 60 s / (0.75 x retry period));
- canaryd beside a kopf-based prober doing the same job against the same fake API
  server, 2,000 canaries on a 5 s cycle (bench/peer.py): CPU per bump in steady state
  (information, no goal) and from spawn, bumps/s, peak RSS,
  health endpoint p99, and their ratios; with ``--profile`` a py-spy profile of canaryd
  in that scenario (bench/pyspy.py).

Only 127.0.0.1 is used. Run: ``.venv/bin/python bench/bench.py [--quick] [--profile]``,
or ``--peer-only`` for the comparison alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import peer
from measure import (
    ROOT,
    Proc,
    Results,
    cpu_seconds,
    cpu_times,
    fake_server,
    hammer,
    load_average,
    machine,
    peak_rss_mb,
    percentiles,
    start_canaryd,
)
from peer import Comparison
from promscrape import lateness_p99, metric_delta, requests_by_verb, scrape, stage_rows
from report import write_peer_report, write_report

from canaryd.config import Settings
from canaryd.testing.apiserver import FLINK_DEPLOYMENTS, FakeKube
from canaryd.testing.process import canaryd_argv, free_port


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


IMPORT_FLOOR = """
import sys
from pathlib import Path
import aiohttp.web, kubernetes_asyncio.client, kubernetes_asyncio.config
import prometheus_client, structlog, yaml
for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmHWM:"):
        print(int(line.split()[1]) / 1024)
"""


async def footprint(tmp: Path, results: Results, cycle: float) -> None:
    """Peak RSS at 1 canary after three cycles, against a Python that imports canaryd's
    dependencies (aiohttp, kubernetes-asyncio, prometheus-client, structlog, PyYAML)
    and nothing else: what canaryd adds on top of the libraries it chose."""
    floor = await asyncio.create_subprocess_exec(
        sys.executable, "-c", IMPORT_FLOOR, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await floor.communicate()
    floor_mb = float(out.decode().strip())
    async with fake_server(tmp, 1, 1) as (_, kubeconfig):
        daemon, _ = await start_canaryd(kubeconfig, cycle)
        try:
            await asyncio.sleep(3 * cycle)
            rss = peak_rss_mb(daemon.pid)
        finally:
            await daemon.stop()
    results.add(
        "1 canary: peak RSS, against the import floor of the dependencies",
        f"{rss:.0f} MB (floor {floor_mb:.0f} MB: {rss / floor_mb:.2f}x)",
        "<= 1.25x",
        rss <= 1.25 * floor_mb,
    )


async def scale(
    tmp: Path, results: Results, canaries: int, cycle: float, cycles: int, healthz: bool
) -> None:
    async with fake_server(tmp, canaries, 1000) as (fake, kubeconfig), bare_handler() as bare:
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
            per_canary_ms = per_cycle * 1000 / max(canaries, 1)
            results.add(
                f"{label}: daemon CPU, normalised to a 60 s cycle",
                f"{normalised:.1f}% of a core ({per_canary_ms:.2f}"
                f" ms per canary-cycle, {user_share:.0%} user)",
                "-",
                None,
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
                await healthz_latency(daemon.url, bare, results, label)
        finally:
            await daemon.stop()
        if canaries >= 10_000:
            # The budget (DESIGN: at most 2.0x the floor) is read against the floor at the
            # same rate, on the same fake, in the same run: a floor measured at another
            # rate amortises the loop's wake-ups differently.
            floor_rounds: list[tuple[Rounds, Rounds]] = []

            async def floor_health(url: str) -> None:
                floor_rounds.append(await paced_rounds(url, bare))

            health = floor_health if healthz else None
            floor = await peer.measure_floor(fake, canaries, cycle, cycles, health=health)
            if floor_rounds:
                results.add(
                    f"{label}: /healthz latency of the floor serving the bare handler (the"
                    " same tick's bursts of bumps, none of canaryd's logic), as above",
                    latency_text(*floor_rounds[0]),
                    "-",
                    None,
                )
            ratio = per_canary_ms / max(floor.cpu_per_bump, 1e-9)
            results.add(
                f"{label}: daemon CPU per canary-cycle against the floor at the same rate"
                " (bench/floor.py: a bump and nothing else)",
                f"{per_canary_ms:.3f} ms vs {floor.cpu_per_bump:.3f} ms = {ratio:.2f}x",
                "<= 2.0x",
                ratio <= 2.0,
            )


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


HEALTHZ_ROUNDS = 5
Rounds = list[tuple[float, float]]
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


@contextlib.asynccontextmanager
async def bare_handler() -> AsyncIterator[str]:
    """The bare aiohttp handler in a process of its own; yields its /healthz URL."""
    port = free_port()
    bare = await asyncio.create_subprocess_exec(sys.executable, "-c", BARE, str(port))
    try:
        url = f"http://127.0.0.1:{port}/healthz"
        async with aiohttp.ClientSession() as http, asyncio.timeout(30):
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url) as response:
                        if response.status == 200:
                            break
                await asyncio.sleep(0.05)
        yield url
    finally:
        bare.send_signal(signal.SIGTERM)
        await bare.wait()


async def paced_rounds(url: str, bare_url: str) -> tuple[Rounds, Rounds]:
    """(p50, p99) of each of HEALTHZ_ROUNDS interleaved 3 s rounds of paced clients, on
    ``url`` then on the bare handler: one window's p99 moves 1-4 ms from run to run on a
    2-core machine, either side's, so their medians are compared."""
    rounds: Rounds = []
    bare_rounds: Rounds = []
    for _ in range(HEALTHZ_ROUNDS):
        rounds.append(percentiles((await hammer(url, 20, 3.0, every=0.01))[0]))
        bare_rounds.append(percentiles((await hammer(bare_url, 20, 3.0, every=0.01))[0]))
    return rounds, bare_rounds


def medians(rounds: Rounds) -> tuple[float, float]:
    return statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)


def latency_text(rounds: Rounds, bare_rounds: Rounds) -> str:
    (p50, p99), (bare_p50, bare_p99) = medians(rounds), medians(bare_rounds)
    return (
        f"p50 {p50:.2f} ms, p99 {p99:.2f} ms (bare handler: p50 {bare_p50:.2f}, "
        f"p99 {bare_p99:.2f}; rounds' p99 {', '.join(f'{r[1]:.1f}' for r in rounds)} vs "
        f"{', '.join(f'{r[1]:.1f}' for r in bare_rounds)})"
    )


async def healthz_latency(url: str, bare_url: str, results: Results, label: str) -> None:
    rounds, bare_rounds = await paced_rounds(url + "/healthz", bare_url)
    _, rate = await hammer(url + "/healthz", 20, 3.0)
    _, bare_rate = await hammer(bare_url, 20, 3.0)
    results.add(
        f"{label}: /healthz latency, 20 clients at 100 requests/s each, median of"
        f" {HEALTHZ_ROUNDS} interleaved 3 s rounds",
        latency_text(rounds, bare_rounds),
        "p99 <= 2x the bare handler's",
        medians(rounds)[1] <= 2 * medians(bare_rounds)[1],
    )
    results.add(
        f"{label}: /healthz throughput, 20 clients back to back, vs a bare aiohttp handler",
        f"{rate:.0f}/s vs {bare_rate:.0f}/s = {rate / bare_rate:.2f}",
        ">= 0.8",
        rate / bare_rate >= 0.8,
    )


@dataclass
class Options:
    quick: bool = False
    output: Path | None = None
    leases_only: bool = False
    scale_only: bool = False
    peer_only: bool = False
    profile: bool = False
    peer_canaries: int = 2000
    peer_cycle: float = 5.0
    peer_cycles: int = 4
    peer_rounds: int = 3


async def run_peer(tmp: Path, options: Options) -> Comparison:
    comparison = await peer.compare(
        tmp,
        canaries=options.peer_canaries,
        cycle=options.peer_cycle,
        cycles=options.peer_cycles,
        profile=options.profile,
        rounds=options.peer_rounds,
    )
    print("\n" + comparison.table(), flush=True)
    if comparison.profile is not None or comparison.profile_error:
        print("\n" + comparison.profile_text(), flush=True)
    return comparison


async def main(options: Options) -> int:
    results = Results()
    load = load_average()
    print(f"machine: {machine()}; load average (1/5/15 min) {load}", flush=True)
    with tempfile.TemporaryDirectory(prefix="canaryd-bench-") as name:
        tmp = Path(name)
        if options.peer_only:
            comparison = await run_peer(tmp, options)
            if options.output is not None:
                write_peer_report(options.output, load, comparison)
            return 0 if comparison.met else 1
        if options.scale_only:
            print("10,000 canaries", flush=True)
            await scale(tmp, results, 10_000, cycle=60.0, cycles=2, healthz=True)
            print("\n" + results.table())
            return 0 if all(row[3] != "**no**" for row in results.rows) else 1
        if not options.leases_only:
            print("request economy", flush=True)
            await economy(tmp, results, cycle=1.0, cycles=3 if options.quick else 5)
        print("Lease traffic", flush=True)
        await leases(tmp, results, seconds=30.0)
        if options.leases_only:
            print("\n" + results.table())
            return 0 if all(row[3] != "**no**" for row in results.rows) else 1
        print("1 canary", flush=True)
        await footprint(tmp, results, cycle=1.0)
        print("1,000 canaries", flush=True)
        await scale(tmp, results, 1000, cycle=5.0, cycles=2 if options.quick else 3, healthz=False)
        if not options.quick:
            print("10,000 canaries", flush=True)
            await scale(tmp, results, 10_000, cycle=60.0, cycles=2, healthz=True)
        comparison = await run_peer(tmp, options)
    table = results.table()
    print("\n" + table)
    if options.output is not None:
        write_report(options.output, table, load, comparison)
    met = all(row[3] != "**no**" for row in results.rows) and comparison.met
    return 0 if met else 1


def arguments() -> Options:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="skip the 10,000-canary run")
    parser.add_argument("--output", type=Path, default=None, help="write the report here")
    parser.add_argument(
        "--leases-only", action="store_true", help="only the Lease traffic (about 40 s)"
    )
    parser.add_argument(
        "--scale-only",
        action="store_true",
        help="only the 10,000-canary run, with the /healthz latency and the floor (about 8"
        " minutes)",
    )
    parser.add_argument(
        "--peer-only",
        action="store_true",
        help="only canaryd beside the kopf prober (about 5 minutes); --output writes that "
        "section alone",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile canaryd in the peer scenario with py-spy (a run of its own) and "
        "print its top functions by own time",
    )
    parser.add_argument("--peer-canaries", type=int, default=Options.peer_canaries)
    parser.add_argument("--peer-cycle", type=float, default=Options.peer_cycle, help="seconds")
    parser.add_argument(
        "--peer-cycles", type=int, default=Options.peer_cycles, help="cycles in the window"
    )
    parser.add_argument(
        "--peer-rounds",
        type=int,
        default=Options.peer_rounds,
        help="interleaved rounds of each contender (their medians are compared)",
    )
    return Options(**vars(parser.parse_args()))


if __name__ == "__main__":
    options = arguments()
    try:
        import uvloop  # the client side costs less too; the comparison is in-run anyway
    except ImportError:
        sys.exit(asyncio.run(main(options)))
    sys.exit(uvloop.run(main(options)))
