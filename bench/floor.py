"""The floor: a bump and nothing else, for ``make bench``'s peer comparison
(bench/peer.py), shown as information.

What any bumper written in Python on this stack pays per bump, with none of canaryd's
logic (no judge, no registry, no metrics, no retries, no scheduling but a counter):
every 25 ms the canaries that fell due get their PATCH (spec.restartNonce + 1 with a
resourceVersion precondition, over aiohttp as canaryd's, a task each, the answer's
JSON decoded), and one watch of every canary (aiohttp, as canaryd's, lines
split from each read and decoded) keeps each canary's resourceVersion. The canaries are
bumped in the order the first list gave them, each once a cycle, on uvloop.

Run: ``python bench/floor.py URL CYCLE [PORT]`` (the fake API server's URL, seconds;
with PORT it also serves bench.py's bare /healthz handler on 127.0.0.1 in the same loop);
it runs until it is stopped. It is a measuring stick, not a prober: a failed bump is dropped.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

import aiohttp
from aiohttp import web

from canaryd.kube import json_object as decode_json

CANARIES = "/apis/flink.apache.org/v1beta1/flinkdeployments"
TICK = 0.025
HEADERS = {"Content-Type": "application/merge-patch+json", "Accept": "application/json"}


async def watch(http: aiohttp.ClientSession, url: str, rv: str, versions: dict[str, str]) -> None:
    params = {"watch": "true", "resourceVersion": rv}
    timeout = aiohttp.ClientTimeout(total=None)
    async with http.get(url + CANARIES, params=params, timeout=timeout) as response:
        partial = b""
        async for chunk in response.content.iter_any():
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            for line in lines:
                if line:
                    metadata = decode_json(line)["object"]["metadata"]
                    versions[metadata["namespace"] + "/" + metadata["name"]] = metadata[
                        "resourceVersion"
                    ]


async def patch(http: aiohttp.ClientSession, url: str, body: bytes, time_limit: float) -> None:
    timeout = aiohttp.ClientTimeout(total=time_limit)
    try:
        async with http.patch(url, data=body, headers=HEADERS, timeout=timeout) as response:
            if response.status < 300:
                decode_json(await response.read())
    except (aiohttp.ClientError, TimeoutError):
        pass  # a measuring stick: a failed bump is dropped


async def bump(url: str, cycle: float, stop: asyncio.Event) -> None:
    http = aiohttp.ClientSession()
    async with http.get(url + CANARIES) as response:
        listed: dict[str, Any] = decode_json(await response.read())
    keys = [f"{i['metadata']['namespace']}/{i['metadata']['name']}" for i in listed["items"]]
    versions = {
        f"{i['metadata']['namespace']}/{i['metadata']['name']}": i["metadata"]["resourceVersion"]
        for i in listed["items"]
    }
    paths = {
        key: "/apis/flink.apache.org/v1beta1/namespaces/{}/flinkdeployments/{}".format(
            *key.split("/")
        )
        for key in keys
    }
    nonces = dict.fromkeys(keys, 0)
    watching = asyncio.ensure_future(
        watch(http, url, listed["metadata"]["resourceVersion"], versions)
    )
    loop = asyncio.get_running_loop()
    every, sent, started = cycle / max(len(keys), 1), 0, loop.time()
    pending: set[asyncio.Task[None]] = set()
    try:
        while not stop.is_set():
            now = loop.time()
            while sent < (now - started) / every:
                key = keys[sent % len(keys)]
                nonces[key] += 1
                body = b'{"metadata":{"resourceVersion":"%s"},"spec":{"restartNonce":%d}}' % (
                    versions[key].encode(),
                    nonces[key],
                )
                task = asyncio.create_task(patch(http, url + paths[key], body, cycle / 2))
                pending.add(task)
                task.add_done_callback(pending.discard)
                sent += 1
            try:
                async with asyncio.timeout(TICK):
                    await stop.wait()
            except TimeoutError:
                pass
    finally:
        watching.cancel()
        for task in pending:
            task.cancel()
        await http.close()


def main() -> None:
    import uvloop

    url, cycle = sys.argv[1], float(sys.argv[2])

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        app = web.Application()
        app.router.add_get("/healthz", ok)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        if len(sys.argv) > 3:
            await web.TCPSite(runner, "127.0.0.1", int(sys.argv[3])).start()
        try:
            await bump(url, cycle, stop)
        finally:
            await runner.cleanup()

    uvloop.run(run())


if __name__ == "__main__":
    main()
