"""The bench's measuring tools: processes and their CPU and memory from /proc, the fake
API server and canaryd as processes of their own, paced and back-to-back HTTP clients,
and the results table. Only 127.0.0.1 is used."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from canaryd.testing.process import canaryd_argv, free_port

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


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
    try:
        await wait_ok(proc.url + "/readyz", within=120)
    except BaseException:
        await proc.stop()  # never left running behind a failed benchmark
        raise
    return proc, time.monotonic() - started


async def wait_ok(url: str, within: float, every: float = 0.02) -> None:
    """Poll ``url`` until it answers 200."""
    async with aiohttp.ClientSession() as http, asyncio.timeout(within):
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url) as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(every)


async def hammer(
    url: str,
    clients: int,
    seconds: float,
    every: float | None = None,
    statuses: Counter[int] | None = None,
) -> tuple[list[float], float]:
    """``clients`` concurrent clients for ``seconds``: each sends a request every ``every``
    seconds (paced, for latency) or back to back (None, for throughput). ``statuses``
    counts the answers' status codes."""
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
                if statuses is not None:
                    statuses[response.status] += 1
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


def load_average() -> str:
    return "{:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg())


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
