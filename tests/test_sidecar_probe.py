"""The operator container's liveness in config/sidecar: canaryd's verdict, never its
absence. The exec probe as shipped (bash's /dev/tcp, rendered from
config/sidecar-example), run with bash against servers on 127.0.0.1 that answer as
canaryd's /healthz can, and against nothing: it fails on a 500 answer only. Its port is
pointed at the test's server; nothing else of it changes."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from canaryd.testing.process import canaryd_argv, free_port
from tests.kubelet import CONFIG, render

BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="bash is the probe's interpreter")


def operator_probe() -> dict[str, Any]:
    (deployment,) = [d for d in render(CONFIG / "sidecar-example") if d["kind"] == "Deployment"]
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    probe: dict[str, Any] = containers["flink-kubernetes-operator"]["livenessProbe"]
    return probe


def canaryd_port() -> int:
    (deployment,) = [d for d in render(CONFIG / "sidecar-example") if d["kind"] == "Deployment"]
    (canaryd,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "canaryd"
    ]
    (port,) = [int(a.split("=", 1)[1]) for a in canaryd["args"] if a.startswith("--port=")]
    return port


def script(port: int) -> str:
    """The probe's bash script, addressed to ``port`` instead of canaryd's."""
    command = operator_probe()["exec"]["command"]
    assert command[:2] == ["bash", "-c"], command
    shipped = f"/dev/tcp/127.0.0.1/{canaryd_port()}"
    assert command[2].count(shipped) == 1, command[2]
    return str(command[2]).replace(shipped, f"/dev/tcp/127.0.0.1/{port}")


async def probe(port: int) -> tuple[int, float]:
    """The probe's exit status and how long it took (the kubelet kills it, as a
    failure, at timeoutSeconds)."""
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(BASH or "bash", "-c", script(port))
    status = await asyncio.wait_for(process.wait(), timeout=30)
    return status, time.monotonic() - started


@contextlib.asynccontextmanager
async def answering(status_line: str | None) -> AsyncIterator[int]:
    """A server on 127.0.0.1 that reads a request and answers ``status_line`` (None:
    accepts and never answers, as a wedged canaryd whose kernel still accepts)."""
    held: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if status_line is None:
            held.append(writer)
            return
        body = b"ERROR" if " 500" in status_line else b"OK"
        writer.write(
            f"{status_line}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


def test_the_probe_replaces_the_http_probe_and_keeps_its_budget():
    probe = operator_probe()
    assert "httpGet" not in probe
    assert (probe["periodSeconds"], probe["failureThreshold"]) == (10, 3)
    # The script bounds itself (`timeout 2`) inside the kubelet's timeout, which would
    # count as a failure.
    (bound,) = re.findall(r"\btimeout (\d+) bash\b", probe["exec"]["command"][2])
    assert int(bound) < probe["timeoutSeconds"]


@pytest.mark.parametrize(
    ("status_line", "passes"),
    [
        ("HTTP/1.1 200 OK", True),
        ("HTTP/1.1 500 Internal Server Error", False),
        ("HTTP/1.1 500", False),  # no reason phrase: the code alone decides
        ("HTTP/1.0 500 ERROR", False),
        ("HTTP/1.1 503 Service Unavailable", True),
        ("HTTP/1.1 404 Not Found", True),
    ],
)
async def test_the_probe_fails_only_on_a_500_answer(status_line, passes):
    async with answering(status_line) as port:
        status, _ = await probe(port)
    assert (status == 0) is passes, (status_line, status)


async def test_nothing_listening_passes():
    """canaryd's image not pulled, exit 2 on a bad configuration, a crash loop:
    connection refused."""
    status, took = await probe(free_port())
    assert status == 0
    assert took < 2


async def test_a_canaryd_that_accepts_and_never_answers_passes_within_the_timeout():
    """A wedged canaryd (SIGSTOP: the kernel still accepts): the script gives up after
    its own bound, before the kubelet's timeoutSeconds would count a failure."""
    async with answering(None) as port:
        status, took = await probe(port)
    assert status == 0
    assert took < operator_probe()["timeoutSeconds"]


async def test_canaryds_own_healthz_passes(tmp_path, kube, kubeconfig):
    """Against canaryd itself (its HTTP server, not a stand-in), with no canary: 200."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(*canaryd_argv(kubeconfig, port, 1.0))
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            assert time.monotonic() < deadline, "canaryd did not listen within 30 s"
            assert process.returncode is None, "canaryd exited"
            await asyncio.sleep(0.05)  # bounded poll: the kernel has no event for it
        assert (await probe(port))[0] == 0
    finally:
        process.terminate()
        await process.wait()
