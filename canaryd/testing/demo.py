"""``make demo``: canaryd against a local fake cluster with sample canaries.

Starts the fake API server, applies ``config/samples/`` in two namespaces, runs
canaryd as its own process with a short cycle, and prints ``/healthz?verbose``
whenever it changes while it plays the bug report's (FLINK-41050) scenarios: a user adds a label and
an annotation (kept), a canary label is removed (dropped, never re-added), a
canary is deleted (dropped); health stays 200 throughout. Then the two failures
the check exists to tell apart: the watch delivery stuck for two cycles (the
canaries go ``unhealthy``, ``/healthz`` 500, then they recover) and a write outage
(``unknown``: no verdict either way, ``/healthz`` stays 200). Ctrl-C stops it all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from canaryd.config.parse import parse_duration
from canaryd.testing.apiserver import FakeKube, Fault
from canaryd.testing.process import canaryd_argv, free_port

SAMPLES = Path(__file__).resolve().parents[2] / "config" / "samples"
PLURALS = {"FlinkDeployment": "flinkdeployments", "FlinkSessionJob": "flinksessionjobs"}
MERGE = {"Content-Type": "application/merge-patch+json"}


class Demo:
    can_inject_faults = True
    """The fake API server can withhold watch events and fail writes; a real one can't."""

    def __init__(self, timeout: float, samples: Path) -> None:
        self.timeout = timeout
        self.samples = samples
        self.kube = FakeKube(bookmark_interval=5.0)
        self.api_url = ""
        """The API server's URL, once the cluster runs."""
        self.started = 0.0
        self.last_health = ""
        self.failures = 0
        """/healthz answers other than 200 where none was expected."""
        self.expecting_failure = False
        self.expected_failures = 0
        self.failure_seen = asyncio.Event()
        """Set when /healthz failed while a failure was expected."""
        self.poll_interval = min(0.5, timeout / 5)
        """Poll /healthz several times a cycle, so a verdict that lasts a cycle is seen."""
        self.polls_started = 0
        self.last_health_poll = 0
        self.marked = 0
        """Which poll `last_health` is the answer to (polls are numbered as they start)."""

    def say(self, text: str) -> None:
        elapsed = asyncio.get_running_loop().time() - self.started
        print(f"[{elapsed:6.1f}s] {text}", flush=True)

    def path(self, plural: str, namespace: str, name: str = "") -> str:
        base = f"{self.api_url}/apis/flink.apache.org/v1beta1/namespaces/{namespace}/{plural}"
        return f"{base}/{name}" if name else base

    @contextlib.asynccontextmanager
    async def cluster(self, tmp: Path, namespaces: list[str]) -> AsyncIterator[Path]:
        """Run the cluster with these namespaces; yields canaryd's kubeconfig. Here the
        fake API server; tests/controlplane/demo.py plays the same on a real one."""
        async with self.kube.running():
            for namespace in namespaces:
                self.kube.create_namespace(namespace)
            self.api_url = self.kube.url
            kubeconfig = self.kube.write_kubeconfig(tmp / "kubeconfig")
            self.say(f"fake API server on {self.kube.url} (kubeconfig {kubeconfig})")
            yield kubeconfig

    def session(self) -> aiohttp.ClientSession:
        """The demo's own client of the API server (the fake needs no credentials)."""
        return aiohttp.ClientSession()

    async def apply_samples(self, http: aiohttp.ClientSession, namespaces: list[str]) -> None:
        files = sorted(p for p in self.samples.glob("*.yaml") if p.name != "kustomization.yaml")
        for file in files:
            for doc in yaml.safe_load_all(file.read_text()):
                if not isinstance(doc, dict) or doc.get("kind") not in PLURALS:
                    continue
                for namespace in namespaces:
                    url = self.path(PLURALS[doc["kind"]], namespace)
                    async with http.post(url, json=doc) as response:
                        response.raise_for_status()
            self.say(
                f"applied {file.relative_to(self.samples.parents[1])} in {', '.join(namespaces)}"
            )

    async def show_health(self, http: aiohttp.ClientSession, url: str) -> None:
        """Print /healthz?verbose each time it changes."""
        while True:
            self.polls_started += 1
            poll = self.polls_started
            try:
                async with http.get(url) as response:
                    text = f"{response.status} " + (await response.text()).strip()
            except aiohttp.ClientError:
                text = "(canaryd not answering yet)"
            if not text.startswith("200") and "not answering" not in text:
                if self.expecting_failure:
                    self.expected_failures += 1
                    self.failure_seen.set()
                else:
                    self.failures += 1
            # Print when states change, not when only generation numbers move.
            if re.sub(r"\d+", "N", text) != re.sub(r"\d+", "N", self.last_health):
                body = "\n".join(f"           {line}" for line in text.splitlines())
                self.say(f"GET /healthz?verbose ->\n{body}")
            self.last_health = text
            self.last_health_poll = poll
            await asyncio.sleep(self.poll_interval)

    def mark(self) -> None:
        """From now on, only answers to polls that start later count as current."""
        self.marked = self.polls_started

    async def until(self, check: Callable[[], Awaitable[bool]], within: float) -> bool:
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        while loop.time() < end:
            if await check():
                return True
            await asyncio.sleep(self.poll_interval)
        return False

    async def scenario(self, http: aiohttp.ClientSession) -> None:
        cycle = self.timeout
        fd = "flinkdeployments"

        async def get(namespace: str, name: str = "canary") -> dict[str, Any]:
            async with http.get(self.path(fd, namespace, name)) as response:
                result: dict[str, Any] = await response.json()
                return result

        async def healthy_everywhere() -> bool:
            """/healthz says every canary is healthy, in an answer to a poll that started
            after the last call to `self.mark()` (so no answer from before a change counts)."""
            if self.last_health_poll <= self.marked:
                return False
            status, *canaries = self.last_health.splitlines() or [""]
            return status.startswith("200") and all(
                line.startswith("healthy ") for line in canaries
            )

        async def answering() -> bool:
            return self.last_health_poll > 0 and "not answering" not in self.last_health

        # Starting takes a few seconds on a loaded machine; judging then takes two cycles.
        if not (
            await self.until(answering, 60) and await self.until(healthy_everywhere, 6 * cycle)
        ):
            self.failures += 1
            self.say("  canaryd did not judge every canary healthy  <- NOT EXPECTED")
            return
        self.say(
            "step 1: a user adds a label and an annotation to default/canary "
            "(kubectl label/annotate)"
        )
        patch: dict[str, Any] = {
            "metadata": {"labels": {"repro": "409"}, "annotations": {"repro/note": "keep-me"}}
        }
        async with http.patch(
            self.path(fd, "default", "canary"), data=json.dumps(patch), headers=MERGE
        ) as response:
            response.raise_for_status()
        before = (await get("default")).get("spec", {}).get("restartNonce", 0)

        async def two_more_bumps() -> bool:
            nonce = (await get("default")).get("spec", {}).get("restartNonce", 0)
            return isinstance(nonce, int) and nonce >= before + 2

        if not await self.until(two_more_bumps, 4 * cycle):
            self.failures += 1
            self.say("  canaryd did not bump default/canary twice in four cycles  <- NOT EXPECTED")
        obj = await get("default")
        self.say(
            f"  after two more bumps: restartNonce={obj.get('spec', {}).get('restartNonce')}, "
            f"labels={obj['metadata']['labels']}, "
            f"annotations={obj['metadata'].get('annotations')}  <- kept"
        )

        self.say("step 2: remove the canary label from team-a/canary")
        patch = {"metadata": {"labels": {"flink.apache.org/canary": None}}}
        async with http.patch(
            self.path(fd, "team-a", "canary"), data=json.dumps(patch), headers=MERGE
        ) as response:
            response.raise_for_status()
        nonce = (await get("team-a")).get("spec", {}).get("restartNonce")
        await asyncio.sleep(2 * cycle)
        obj = await get("team-a")
        self.say(
            f"  two cycles later: restartNonce still {obj.get('spec', {}).get('restartNonce')} "
            f"(was {nonce}), labels={obj['metadata'].get('labels')}  <- not re-added"
        )

        self.say("step 3: delete default/canary")
        async with http.delete(self.path(fd, "default", "canary")) as response:
            response.raise_for_status()
        await asyncio.sleep(2 * cycle)
        verdict = (
            "stayed 200 throughout" if not self.failures else (f"failed {self.failures} times")
        )
        self.say(f"  steps 1-3 done: /healthz {verdict}")
        if not self.can_inject_faults:
            self.say("  (steps 4 and 5 need the fake API server: run `make demo` for them)")
            return
        await self.stuck_delivery(healthy_everywhere)
        await self.write_outage(healthy_everywhere)
        verdict = "as expected" if not self.failures else f"failed {self.failures} times"
        self.say(f"  scenario done: /healthz {verdict}")

    async def stuck_delivery(self, healthy_everywhere: Callable[[], Awaitable[bool]]) -> None:
        cycle = self.timeout
        self.say(
            "step 4: the fake API server withholds watch events for two cycles "
            "(bumps are written, but the watch no longer delivers them)"
        )
        self.expecting_failure = True
        self.failure_seen.clear()
        self.kube.hold_watch_events()
        # Two cycles at least, and on until /healthz has failed: the verdict on a bump the
        # watch never delivered comes one cycle after the bump, wherever the cycle stood
        # when the hold began, and the poller needs to see it once (bounded: six cycles).
        await asyncio.sleep(2 * cycle)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.failure_seen.wait(), 4 * cycle)
        self.kube.release_watch_events()
        self.mark()
        self.say("  the fake delivers watch events again")
        # A verdict from the stuck cycle may still be shown until the next one replaces it,
        # so failures stay expected until /healthz is healthy again.
        recovered = await self.until(healthy_everywhere, 4 * cycle)
        self.expecting_failure = False
        if self.expected_failures:
            self.say("  /healthz 500 while the delivery was stuck: the check caught it")
        else:
            self.failures += 1
            self.say("  /healthz never failed while the delivery was stuck  <- NOT EXPECTED")
        if recovered:
            self.say("  recovered: /healthz 200, every canary healthy")
        else:
            self.failures += 1
            self.say("  did not recover within four cycles  <- NOT EXPECTED")

    async def write_outage(self, healthy_everywhere: Callable[[], Awaitable[bool]]) -> None:
        cycle = self.timeout
        self.say(
            "step 5: the fake API server answers 503 to every write for two cycles "
            "(a write outage: no bump, so no verdict)"
        )
        before = self.failures
        outage = self.kube.inject(Fault(verb="patch", code=503, times=-1))
        await asyncio.sleep(2 * cycle)
        self.kube.faults.remove(outage)
        self.mark()
        self.say("  the fake accepts writes again")
        if self.failures == before:
            self.say("  /healthz stayed 200 during the write outage: a failed write is no verdict")
        if await self.until(healthy_everywhere, 4 * cycle):
            self.say("  recovered: every canary healthy")
        else:
            self.failures += 1
            self.say("  did not recover within four cycles  <- NOT EXPECTED")

    async def play(self, http: aiohttp.ClientSession, *, once: bool) -> None:
        """The scenario; without --once, then say how to stop (canaryd keeps checking)."""
        await self.scenario(http)
        if not once:
            self.say("the scenario is done; canaryd keeps checking: press Ctrl-C to stop")

    async def run(self, *, once: bool) -> int:
        self.started = asyncio.get_running_loop().time()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        with tempfile.TemporaryDirectory(prefix="canaryd-demo-") as tmp:
            async with (
                self.cluster(Path(tmp), ["default", "team-a"]) as kubeconfig,
                self.session() as http,
            ):
                await self.apply_samples(http, ["default", "team-a"])
                port = free_port()
                proc = await asyncio.create_subprocess_exec(
                    *canaryd_argv(
                        kubeconfig,
                        port,
                        self.timeout,
                        "--log-format",
                        "console",
                        "--log-level",
                        "warning",
                    ),
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    # Ctrl-C signals the terminal's whole process group: canaryd is
                    # stopped by the demo alone, once (a second signal after its own
                    # handlers are gone would kill it).
                    start_new_session=True,
                )
                url = f"http://127.0.0.1:{port}/healthz?verbose"
                self.say(f"canaryd started (cycle {self.timeout:g}s): curl '{url}'")
                plain = aiohttp.ClientSession()  # canaryd's port: no credentials
                watcher = asyncio.create_task(self.show_health(plain, url))
                scenario = asyncio.create_task(self.play(http, once=once))
                stopper = asyncio.create_task(stop.wait())
                # With --once the scenario's end stops the demo; otherwise Ctrl-C.
                waited = {scenario, stopper} if once else {stopper}
                await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
                for task in (watcher, scenario, stopper):
                    task.cancel()
                if scenario.done() and not scenario.cancelled() and scenario.exception():
                    self.failures += 1
                    error = scenario.exception()
                    self.say(f"  the scenario stopped: {error!r}  <- NOT EXPECTED")
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                code = await proc.wait()
                await plain.close()
                self.say(f"canaryd exited with {code}")
        # Stopped before it ever answered, canaryd may not handle SIGTERM yet.
        early = code == -signal.SIGTERM and "not answering" in (self.last_health or "not answering")
        return 0 if (code == 0 or early) and not self.failures else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m canaryd.testing.demo",
        description=__doc__.splitlines()[0] if __doc__ else "",
    )
    parser.add_argument("--timeout", default="3s", help="canary cycle (default 3s)")
    parser.add_argument(
        "--once", action="store_true", help="exit after the scenario instead of waiting for Ctrl-C"
    )
    parser.add_argument("--samples", type=Path, default=SAMPLES)
    args = parser.parse_args(argv)
    demo = Demo(parse_duration(args.timeout), args.samples)
    try:
        sys.exit(asyncio.run(demo.run(once=args.once)))
    except KeyboardInterrupt:  # Ctrl-C before the demo's own handler: stopped as asked
        sys.exit(0)


if __name__ == "__main__":
    main()
