"""How many log lines an API server outage makes canaryd write (issue #12's figure).

canaryd runs as its own process (JSON logs, the default level) against the fake API
server in this one, with N canaries; once all are healthy the fake refuses
connections for the outage, then accepts them again; the lines canaryd writes from
the outage's start until every canary is healthy again are counted, by event.
Defaults are the issue's run: 300 canaries, a 10 s cycle, a 30 s outage.

Run: ``.venv/bin/python bench/outage_log.py [--canaries 300 --cycle 10 --outage 30]``.
Only 127.0.0.1 is used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import aiohttp

from canaryd.testing.apiserver import FLINK_DEPLOYMENTS, FakeKube
from canaryd.testing.process import canaryd_argv, free_port

LABEL = "flink.apache.org/canary"


async def healthy_count(http: aiohttp.ClientSession, url: str) -> int:
    try:
        async with http.get(url, headers={"Accept": "application/json"}) as response:
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, ValueError):
        return -1
    canaries = body.get("canaries", []) if isinstance(body, dict) else []
    return sum(1 for c in canaries if c.get("state") == "healthy")


async def measure(canaries: int, cycle: float, outage: float, namespaces: int) -> Counter[str]:
    kube = FakeKube()
    lines: list[str] = []
    marks: dict[str, int] = {}
    async with kube.running():
        for n in range(namespaces):
            kube.create_namespace(f"team-{n:03}")
        for i in range(canaries):
            body = {"metadata": {"name": f"canary-{i:04}", "labels": {LABEL: "true"}}}
            kube.create(FLINK_DEPLOYMENTS, f"team-{i % namespaces:03}", body)
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = kube.write_kubeconfig(Path(tmp) / "kubeconfig")
            port = free_port()
            proc = await asyncio.create_subprocess_exec(
                *canaryd_argv(kubeconfig, port, cycle, "--kind", "flinkdeployments"),
                stderr=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL,
            )
            assert proc.stderr is not None
            stderr = proc.stderr

            async def read() -> None:
                while line := await stderr.readline():
                    lines.append(line.decode(errors="replace"))

            reader = asyncio.create_task(read())
            url = f"http://127.0.0.1:{port}/healthz"
            async with aiohttp.ClientSession() as http:

                async def until_all_healthy(within: float) -> None:
                    loop = asyncio.get_running_loop()
                    end = loop.time() + within
                    while await healthy_count(http, url) != canaries:
                        if loop.time() > end:
                            raise SystemExit(f"not all {canaries} canaries healthy in {within}s")
                        await asyncio.sleep(0.2)

                await until_all_healthy(10 * cycle)
                marks["start"] = len(lines)
                await kube.refuse_connections()
                await asyncio.sleep(outage)  # the outage's length is what is measured
                await kube.accept_connections()
                await until_all_healthy(10 * cycle)
                marks["end"] = len(lines)
            proc.terminate()
            await proc.wait()
            reader.cancel()
    events: Counter[str] = Counter()
    for line in lines[marks["start"] : marks["end"]]:
        try:
            events[json.loads(line).get("event", "?")] += 1
        except ValueError:
            events["(not JSON)"] += 1
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--canaries", type=int, default=300)
    parser.add_argument("--cycle", type=float, default=10.0, help="seconds")
    parser.add_argument("--outage", type=float, default=30.0, help="seconds")
    parser.add_argument("--namespaces", type=int, default=3)
    args = parser.parse_args()
    events = asyncio.run(measure(args.canaries, args.cycle, args.outage, args.namespaces))
    print(
        f"{sum(events.values())} log lines: {args.canaries} canaries, {args.cycle:g}s cycle, "
        f"{args.outage:g}s outage, {args.namespaces} namespaces (from the outage until all "
        "are healthy again)"
    )
    for event, count in events.most_common():
        print(f"  {count:6}  {event}")
    sys.exit(0)


if __name__ == "__main__":
    main()
