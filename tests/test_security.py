"""Security: TLS verification stays on unless the kubeconfig turns it off, and no
token or private key reaches the logs, at any level, tracebacks included."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
import yaml
from kubernetes_asyncio import config as k8s_config

from canaryd import logs
from canaryd.registry import CanaryState, Registry
from canaryd.testing.apiserver import FakeKube, Fault
from tests.harness import create_canary, json_logs, running_daemon

TOKEN = "s3cr3t-bearer-token-abcdef123456"


class Handshakes:
    """Counts TLS handshakes the server saw (its SNI callback runs on each)."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.count = 0
        self.changed = asyncio.Event()
        context.sni_callback = self._seen

    def _seen(self, *_: object) -> None:
        self.count += 1
        self.changed.set()

    async def until(self, count: int) -> None:
        async with asyncio.timeout(10):
            while self.count < count:
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def server_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    return context


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


async def test_tls_is_verified_against_the_kubeconfig_ca(server_context, ca_file, tmp_path):
    kube = FakeKube(token=TOKEN)
    async with kube.running(ssl_context=server_context):
        assert kube.url.startswith("https://")
        kube.create_namespace("default")
        create_canary(kube)
        config = kube.write_kubeconfig(tmp_path / "kubeconfig", ca_file=ca_file)
        async with running_daemon(kube, config) as run:
            await run.until_state(CanaryState.HEALTHY)


async def test_tls_verification_stays_on_without_the_ca(server_context, tmp_path):
    handshakes = Handshakes(server_context)
    kube = FakeKube(token=TOKEN)
    async with kube.running(ssl_context=server_context):
        kube.create_namespace("default")
        create_canary(kube)
        config = kube.write_kubeconfig(tmp_path / "kubeconfig")  # no CA: untrusted
        async with running_daemon(kube, config) as run:
            await handshakes.until(3)  # it tried, failed verification, and retried
            assert kube.requests == []  # no request ever got through
            assert run.canary() is None
            assert (await run.get("/readyz"))[0] == 503
            assert await run.get("/healthz") == (200, "OK")  # nothing tracked: healthy


async def test_insecure_skip_tls_verify_turns_verification_off(server_context, tmp_path):
    kube = FakeKube(token=TOKEN)
    async with kube.running(ssl_context=server_context):
        kube.create_namespace("default")
        create_canary(kube)
        config = kube.write_kubeconfig(tmp_path / "kubeconfig", insecure=True)
        async with running_daemon(kube, config) as run:
            await run.until_state(CanaryState.HEALTHY)


async def test_no_token_or_private_key_in_logs_at_any_level_tracebacks_included(
    ca, server_context, tmp_path, capsys, monkeypatch
):
    server_context.verify_mode = ssl.CERT_REQUIRED  # client certificates too
    ca.configure_trust(server_context)
    client = ca.issue_cert("canaryd")
    key_pem = client.private_key_pem.bytes().decode()
    key_body = next(line for line in key_pem.splitlines()[1:] if len(line) > 40)
    kube = FakeKube(token=TOKEN)
    async with kube.running(ssl_context=server_context):
        kube.create_namespace("default")
        create_canary(kube)
        ca_file = tmp_path / "ca.pem"
        ca.cert_pem.write_to_path(str(ca_file))
        config = kube.kubeconfig(ca_file=str(ca_file))
        config["users"][0]["user"].update(
            {
                "client-certificate-data": base64.b64encode(
                    client.cert_chain_pems[0].bytes()
                ).decode(),
                "client-key-data": base64.b64encode(client.private_key_pem.bytes()).decode(),
            }
        )
        path = tmp_path / "kubeconfig"
        path.write_text(yaml.safe_dump(config))

        # Failures whose texts carry the secrets: a server message, and a traceback.
        kube.inject(
            Fault(verb="patch", code=500, message=f"Authorization: Bearer {TOKEN}\n{key_pem}")
        )
        raised: list[bool] = []
        original = Registry.observe

        def exploding(self, kind, obj):  # type: ignore[no-untyped-def]
            if not raised:
                raised.append(True)
                raise RuntimeError(f"boom with token={TOKEN} and key {key_pem}")
            return original(self, kind, obj)

        monkeypatch.setattr(Registry, "observe", exploding)
        with json_logs():
            async with running_daemon(kube, path) as run:
                await run.until(lambda: bool(raised), "the planted exception")
                await run.until_state(CanaryState.HEALTHY)
                await run.until_bumps(2)
    output = capsys.readouterr()
    text = output.out + output.err
    assert "watch_failed_unexpectedly" in text and "Traceback" in text
    assert "[REDACTED]" in text
    assert TOKEN not in text
    assert key_body not in text
    assert "BEGIN RSA PRIVATE KEY" not in text and "BEGIN PRIVATE KEY" not in text


def test_rotated_secrets_are_masked_and_the_set_stays_bounded():
    for i in range(100):
        logs.register_secret(f"Bearer rotated-token-{i:04}")
    assert logs.scrub("x rotated-token-0099 y") == "x [REDACTED] y"
    assert logs.scrub("Authorization: Bearer anything-at-all") == "Authorization: Bearer [REDACTED]"
    assert len(logs._secrets) <= 2 * logs.MAX_SECRETS


# ------------------------------------------------- the health port and slow clients


def _proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


async def _metric(http: aiohttp.ClientSession, url: str, sample: str) -> float:
    async with http.get(f"{url}/metrics") as response:
        for line in (await response.text()).splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
    raise AssertionError(f"no {sample} in /metrics")


@pytest.mark.slow
async def test_a_request_head_that_never_ends_or_grows_too_large_is_closed(kube, kubeconfig):
    """A slow client (a request head trickled, never finished) is closed
    KEEPALIVE_TIMEOUT after its accept, never answered; on a kept-alive connection,
    after its last answer (aiohttp's default holds it for an hour). A header line over
    aiohttp's 8 KiB is answered 400 (a bad request); more than MAX_HEAD_BYTES before a
    request is handled, 431, and the connection closed (a head of 128 lines of 8 KiB
    each held about 500 KiB a connection in aiohttp)."""
    from canaryd import metrics
    from canaryd.server import KEEPALIVE_TIMEOUT, MAX_HEAD_BYTES
    from tests.harness import counter

    async with running_daemon(kube, kubeconfig) as run:
        port = run.daemon.server.port
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        opened = loop.time()
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: canaryd\r\nX-Slow: ")
        async with asyncio.timeout(KEEPALIVE_TIMEOUT + 2):
            assert await reader.read() == b""  # closed by canaryd, never answered
        assert loop.time() - opened >= KEEPALIVE_TIMEOUT - 0.5, loop.time() - opened
        writer.close()

        # Keep-alive: two requests answered on one connection, then a third head that
        # never ends.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(2):
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: canaryd\r\n\r\n")
            async with asyncio.timeout(2):
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
                assert await reader.readexactly(2) == b"OK"
        answered = loop.time()
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: canaryd\r\nX-Slow: ")
        async with asyncio.timeout(KEEPALIVE_TIMEOUT + 2):
            assert await reader.read() == b""
        assert loop.time() - answered <= KEEPALIVE_TIMEOUT + 1
        writer.close()

        bad = counter(metrics.BAD_HTTP_REQUESTS)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 9000)
        async with asyncio.timeout(2):
            answer = await reader.read()  # told, then closed
        assert answer.split(b"\r\n")[0].endswith(b" 400 Bad Request"), answer[:100]
        assert counter(metrics.BAD_HTTP_REQUESTS) == bad + 1
        writer.close()

        too_large = counter(metrics.HTTP_CONNECTIONS_DROPPED, "headers_too_large")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        lines = MAX_HEAD_BYTES // 6000 + 1
        writer.write(b"GET / HTTP/1.1\r\n" + b"X-Big: %s\r\n" % (b"a" * 6000) * lines)
        async with asyncio.timeout(2):
            answer = await reader.read()
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
        assert counter(metrics.HTTP_CONNECTIONS_DROPPED, "headers_too_large") == too_large + 1
        writer.close()

        # A body is skipped by its Content-Length (not taken for the next head); a
        # chunked one is answered as any POST.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b"x" * (MAX_HEAD_BYTES // 2)
        writer.write(
            b"POST /healthz HTTP/1.1\r\nHost: canaryd\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
            + b"GET /healthz HTTP/1.1\r\nHost: canaryd\r\n\r\n"
        )
        async with asyncio.timeout(2):
            assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 405")
            await reader.readuntil(b"\r\n\r\n")
            assert (await reader.readuntil(b"OK")).count(b"HTTP/1.1 200 OK") == 1
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nHost: c\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n")
        async with asyncio.timeout(2):
            assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 405 ")
        writer.close()
        assert await run.get("/healthz") == (200, "OK")


class _Transport:
    def __init__(self) -> None:
        self.aborted = False
        self.unsent = 0
        """Answer bytes the kernel has not taken yet (a slow reader's)."""

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return self.unsent


class _Connection:
    """What the cap knows of aiohttp's handler of a connection: its transport."""

    def __init__(self) -> None:
        self.transport = _Transport()


async def test_at_the_cap_the_least_recently_active_not_being_answered_makes_room():
    """Which connection the cap closes for a new one at MAX_CONNECTIONS: of those not
    being answered (a new one that has not sent its head, or one kept alive between
    requests), the least recently active: accepted or answered longest ago; never one
    being answered (its answer still held by the transport, unless not taken for the
    answer timeout): when all are, the new one is refused."""
    from canaryd import metrics
    from canaryd.server import ConnectionCap
    from tests.harness import counter

    def dropped() -> dict[str, float]:
        return {
            reason: counter(metrics.HTTP_CONNECTIONS_DROPPED, reason)
            for reason in ("too_many", "answer_unread")
        }

    def connect(cap: ConnectionCap, unsent: int = 0) -> Any:
        connection = _Connection()
        cap.admit(connection)  # type: ignore[arg-type]
        connection.transport.unsent = unsent  # an answer being written
        return connection

    before = dropped()
    cap = ConnectionCap(lambda: 1.0, max_connections=2)
    answering = connect(cap, unsent=1000)
    slow = connect(cap)  # accepted, its head not complete
    new = connect(cap)
    assert slow.transport.aborted and not (answering.transport.aborted or new.transport.aborted)
    new.transport.unsent = 1000
    refused = connect(cap)  # both being answered
    assert refused.transport.aborted and len(cap.open) == 2
    assert dropped()["too_many"] == before["too_many"] + 2

    # Kept-alive clients between requests: the one answered longest ago makes room,
    # not the new connection that has not sent its head yet, nor one being answered.
    kept = ConnectionCap(lambda: 1.0, max_connections=3)
    first, second = connect(kept), connect(kept)
    kept.active(first)
    kept.active(second)
    first.transport.unsent = 100_000  # its answer still being written: not cut short
    busy = connect(kept, unsent=1000)
    probe = connect(kept)  # the cap: the second answered goes
    assert second.transport.aborted
    assert not (first.transport.aborted or busy.transport.aborted or probe.transport.aborted)
    first.transport.unsent = 0  # all handed to the kernel: the one answered longest ago goes
    another = connect(kept)
    assert first.transport.aborted
    assert not (probe.transport.aborted or busy.transport.aborted or another.transport.aborted)
    assert dropped()["too_many"] == before["too_many"] + 4

    # An answer not taken for the answer timeout no longer keeps its connection.
    unread = ConnectionCap(lambda: 1.0, max_connections=2, answer_timeout=-1.0)  # past
    answered, served = connect(unread, unsent=100_000), connect(unread, unsent=1000)
    connect(unread)
    assert answered.transport.aborted and not served.transport.aborted
    assert dropped() == {
        "too_many": before["too_many"] + 4,
        "answer_unread": before["answer_unread"] + 1,
    }


KEPT_ALIVE_CLIENTS = 300
CADENCE = 0.8
"""Each kept-alive client asks /healthz this often (seconds): real time."""


async def _ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    """One GET /healthz on a kept-alive connection: its status, the answer read whole."""
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: canaryd\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )
    await reader.readexactly(length)
    return int(head.split(b" ", 2)[1])


async def test_a_probe_gets_in_past_300_kept_alive_clients_at_the_cap(kube, kubeconfig):
    """300 well-behaved clients keep their connections alive and ask /healthz every
    0.8 s: more than MAX_CONNECTIONS (256), none of them idle for a whole second. A
    fresh connection (a kubelet's probe) is answered at least 9 times of 10, each
    within a second: at the cap a kept-alive connection idle between requests (the one
    answered longest ago) is closed for it. It got 0 of 10: only connections idle for a
    second or more were closed to make room, and the probe was refused. About 5 s of
    real time (the clients' cadence)."""
    from canaryd.server import MAX_CONNECTIONS

    async with running_daemon(kube, kubeconfig) as run:
        port = run.daemon.server.port
        stop = asyncio.Event()
        answers: dict[int, int] = {}
        steady = asyncio.Event()
        """Set once MAX_CONNECTIONS clients were answered twice: kept alive, at the cap."""

        async def client(number: int) -> None:
            while not stop.is_set():
                writer = None
                try:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    while not stop.is_set():
                        async with asyncio.timeout(5):
                            await _ask(reader, writer)
                        answers[number] = answers.get(number, 0) + 1
                        if sum(count >= 2 for count in answers.values()) >= MAX_CONNECTIONS:
                            steady.set()
                        with contextlib.suppress(TimeoutError):  # the cadence
                            await asyncio.wait_for(stop.wait(), CADENCE)
                except (OSError, asyncio.IncompleteReadError, TimeoutError):
                    with contextlib.suppress(TimeoutError):  # again at the next tick
                        await asyncio.wait_for(stop.wait(), CADENCE)
                finally:
                    if writer is not None:
                        writer.close()

        clients = [asyncio.create_task(client(n)) for n in range(KEPT_ALIVE_CLIENTS)]
        try:
            async with asyncio.timeout(30):
                await steady.wait()
            assert len(run.daemon.server.cap.open) == MAX_CONNECTIONS
            got: list[str] = []
            for _ in range(10):
                try:
                    async with asyncio.timeout(1):
                        reader, writer = await asyncio.open_connection("127.0.0.1", port)
                        try:
                            got.append(str(await _ask(reader, writer)))
                        finally:
                            writer.close()
                except (OSError, asyncio.IncompleteReadError, TimeoutError) as err:
                    got.append(type(err).__name__)
            print(f"a fresh probe connection at the cap: {got.count('200')} answers of 10")
            assert got.count("200") >= 9, got
        finally:
            stop.set()
            await asyncio.gather(*clients)


SLOW_READER_CANARIES = 300
"""Enough for a /healthz JSON answer (about 100 KB) that small socket buffers cannot
take at once, not enough to pause writing (aiohttp's high-water mark is 64 KiB)."""


async def test_at_the_cap_an_answer_still_being_written_is_not_cut_short(kube, kubeconfig):
    """A slow reader (a scraper over a slow network: small socket buffers here) asks a
    large answer and reads none of it yet; then MAX_CONNECTIONS more connections come.
    The slow reader's connection, idle since its answer longest ago, is not closed to
    make room while canaryd still holds bytes of its answer: a newer idle one is, and
    the slow reader gets the whole answer. Once all of it is handed to the kernel, it
    is the one that makes room. Before: it was closed with its answer cut short (the
    cap took it as idle when the handler returned, before the answer was written)."""
    from canaryd import metrics
    from canaryd.config import Settings
    from canaryd.server import MAX_CONNECTIONS
    from tests.harness import counter

    for number in range(SLOW_READER_CANARIES):
        create_canary(kube, name=f"canary-{number}")
    # The shipped cycle: no verdict is waited for, and 300 canaries bumped every 0.3 s
    # would keep the loop too busy for 256 kept-alive connections within KEEPALIVE_TIMEOUT.
    async with running_daemon(kube, kubeconfig, timeout=Settings.timeout) as run:
        await run.until(lambda: len(run.registry) == SLOW_READER_CANARIES, "the canaries", 30)
        server, loop = run.daemon.server, asyncio.get_running_loop()
        assert server._listener is not None  # accepted sockets inherit its buffer size
        server._listener.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.setblocking(False)
        await loop.sock_connect(slow, ("127.0.0.1", server.port))
        await loop.sock_sendall(
            slow, b"GET /healthz HTTP/1.1\r\nHost: c\r\nAccept: application/json\r\n\r\n"
        )
        got = await loop.sock_recv(slow, 4096)  # the answer's start: the handler returned
        head = got.split(b"\r\n\r\n", 1)[0].lower()
        length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        (slow_connection,) = server.cap.open
        unsent = slow_connection.transport.get_write_buffer_size()
        assert unsent > 0, "the answer went whole to the kernel: the test needs smaller buffers"

        dropped = counter(metrics.HTTP_CONNECTIONS_DROPPED, "too_many")
        others = []
        for _ in range(MAX_CONNECTIONS):  # the last one finds the cap reached
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            async with asyncio.timeout(5):
                assert await _ask(reader, writer) == 200
            others.append((reader, writer))
        assert counter(metrics.HTTP_CONNECTIONS_DROPPED, "too_many") == dropped + 1
        assert slow_connection in server.cap.open, f"closed, {unsent} bytes unsent"
        async with asyncio.timeout(5):
            assert await others[0][0].read() == b""  # the oldest other made room
        async with asyncio.timeout(10):
            while len(got) - len(got.split(b"\r\n\r\n", 1)[0]) - 4 < length:
                chunk = await loop.sock_recv(slow, 65536)
                assert chunk, f"cut short: {len(got)} bytes read, {unsent} were unsent"
                got += chunk
        assert not server.cap.writing(slow_connection)  # all handed to the kernel: its turn
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        others.append((reader, writer))
        async with asyncio.timeout(5):
            assert await loop.sock_recv(slow, 4096) == b""
        assert counter(metrics.HTTP_CONNECTIONS_DROPPED, "too_many") == dropped + 2
        slow.close()
        for _, writer in others:
            writer.close()


SLOW_CONNECTIONS = 10_000
SLOW_HEAD = b"GET /healthz HTTP/1.1\r\nHost: canaryd\r\n" + b"".join(
    b"X-Slow-%d: %s\r\n" % (i, b"s" * 1000) for i in range(8)
)  # about 8 KiB of headers, and never the blank line that ends them
GROWTH_BOUND_MIB = 24


@pytest.mark.slow
async def test_memory_stays_flat_under_10000_slow_connections_and_healthz_answers(kube, kubeconfig):
    """10,000 connections whose headers never finish (about 8 KiB each): canaryd keeps
    at most MAX_CONNECTIONS, the oldest still without a request making room for a new
    one, so its peak memory grows by a few MiB (it was about 190 KiB a connection: 1,500
    of them took it past its 192 MiB limit), and /healthz answers a normal client while
    the slow ones are held. The test holds 10,000 sockets itself: its soft open-files
    limit is raised to the hard one (as canaryd does for its own), and the count is
    scaled to what that allows when the hard limit is lower (said in the output)."""
    import resource

    from canaryd.server import KEEPALIVE_TIMEOUT, MAX_CONNECTIONS
    from canaryd.testing.process import canaryd_argv, free_port

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    raised = hard if hard != resource.RLIM_INFINITY else max(soft, SLOW_CONNECTIONS + 1024)
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    count = min(SLOW_CONNECTIONS, raised - 512)  # room for the fake, its watches, the test
    if count < SLOW_CONNECTIONS:
        print(f"open-files hard limit {hard}: {count} slow connections, not {SLOW_CONNECTIONS}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = await asyncio.create_subprocess_exec(
        *canaryd_argv(kubeconfig, port, 1.0, "--log-level", "error"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    sockets: list[socket.socket] = []
    loop = asyncio.get_running_loop()
    try:
        async with aiohttp.ClientSession() as http:

            async def answers(path: str) -> int:
                async with http.get(url + path) as response:
                    await response.read()
                    return response.status

            async def until(predicate: Any, what: str, within: float) -> None:
                """canaryd is another process: poll it, bounded."""
                try:
                    async with asyncio.timeout(within):
                        while True:
                            with contextlib.suppress(aiohttp.ClientError):
                                if await predicate():
                                    return
                            await asyncio.sleep(0.05)
                except TimeoutError:
                    raise AssertionError(f"still waiting after {within}s for {what}") from None

            async def ready() -> bool:
                return await answers("/readyz") == 200

            await until(ready, "/readyz 200", 30)
            for _ in range(20):  # warm: every handler has run and allocated what it keeps
                assert await answers("/healthz") == 200
                assert await answers("/metrics") == 200
            baseline = _proc_kib(proc.pid, "VmHWM")
            descriptors = len(os.listdir(f"/proc/{proc.pid}/fd"))
            limit = asyncio.Semaphore(200)

            async def slow_client() -> None:
                sock = socket.socket()
                sock.setblocking(False)
                sockets.append(sock)
                async with limit:
                    with contextlib.suppress(OSError):  # reset: canaryd made room
                        await loop.sock_connect(sock, ("127.0.0.1", port))
                        await loop.sock_sendall(sock, SLOW_HEAD)

            for batch in range(0, count, 1000):
                await asyncio.gather(*(slow_client() for _ in range(min(1000, count - batch))))
                grown = (_proc_kib(proc.pid, "VmHWM") - baseline) / 1024
                assert grown < GROWTH_BOUND_MIB, f"{grown:.0f} MiB more after {batch + 1000}"

            async def made_room() -> bool:
                dropped = 'canaryd_http_connections_dropped_total{reason="too_many"}'
                return await _metric(http, url, dropped) >= count - MAX_CONNECTIONS

            await until(made_room, "canaryd to accept every slow connection", 30)
            start = loop.time()
            assert await answers("/healthz") == 200  # while the newest slow ones are held
            answered_in = loop.time() - start
            grown = (_proc_kib(proc.pid, "VmHWM") - baseline) / 1024
            print(
                f"{count} slow connections: peak RSS {baseline / 1024:.0f} -> "
                f"{baseline / 1024 + grown:.0f} MiB (+{grown:.1f}); /healthz answered in "
                f"{answered_in * 1000:.1f} ms"
            )
            assert grown < GROWTH_BOUND_MIB

            # The ones still held are closed by the keep-alive timeout.
            async def timed_out() -> bool:
                return len(os.listdir(f"/proc/{proc.pid}/fd")) <= descriptors + 8

            await until(timed_out, "the held ones to time out", KEEPALIVE_TIMEOUT + 5)
    finally:
        for sock in sockets:
            sock.close()
        if proc.returncode is None:
            proc.terminate()
            async with asyncio.timeout(20):
                await proc.wait()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ------------------------------------------------------ rotated credentials


def _client_kubeconfig(
    kube: FakeKube, tmp_path: Path, ca: trustme.CA, common_name: str
) -> tuple[Path, Path, Path]:
    """A kubeconfig whose user is a client certificate in files (as a cert-manager or
    kubelet-style rotation leaves them), issued for ``common_name``."""
    ca_file, cert, key = tmp_path / "ca.pem", tmp_path / "client.crt", tmp_path / "client.key"
    ca.cert_pem.write_to_path(str(ca_file))
    _issue(ca, common_name, cert, key)
    config = kube.kubeconfig(ca_file=str(ca_file))
    config["users"][0]["user"] = {"client-certificate": str(cert), "client-key": str(key)}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path, cert, key


def _issue(ca: trustme.CA, common_name: str, cert: Path, key: Path) -> None:
    leaf = ca.issue_cert(common_name, common_name=common_name)
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))


async def test_a_rotated_client_certificate_is_used_by_the_next_request(
    ca, server_context, tmp_path
):
    """The certificate files are replaced and the old certificate stops being accepted
    (expired: kube-apiserver answers 401 on connections made with it, pooled ones
    too). The next refused request reloads the credentials, and its retry, like every
    request after it, goes over a connection that presents the new certificate."""
    server_context.verify_mode = ssl.CERT_REQUIRED
    ca.configure_trust(server_context)
    kube = FakeKube()
    async with kube.running(ssl_context=server_context):
        kube.create_namespace("default")
        create_canary(kube)
        path, cert, key = _client_kubeconfig(kube, tmp_path, ca, "canaryd-old")
        async with running_daemon(kube, path, timeout=1.0) as run:
            await run.until_bumps(2)
            _issue(ca, "canaryd-new", cert, key)
            kube.refused_certificates.add("canaryd-old")
            refused = len([r for r in kube.requests if r.status == 401])
            before = len(run.bumps())
            await run.until_bumps(before + 2, within=5.0)
            await run.until_state(CanaryState.HEALTHY)
            # One refusal at most per connection made with the old certificate.
            assert len([r for r in kube.requests if r.status == 401]) - refused <= 2


async def test_a_lasting_401_runs_no_credential_reload_per_refused_request(
    kube, tmp_path, monkeypatch
):
    """Valid credentials refused for a while (an authentication webhook down): the
    reloads back off (1 s, doubling) instead of one kubeconfig read or exec-plugin run
    per refused request."""
    reloads: list[float] = []
    real = k8s_config.load_kube_config

    async def counted(*args: Any, **kwargs: Any) -> Any:
        reloads.append(asyncio.get_running_loop().time())
        return await real(*args, **kwargs)

    monkeypatch.setattr(k8s_config, "load_kube_config", counted)
    names = [f"c{n}" for n in range(10)]
    for name in names:
        create_canary(kube, name)
    config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    async with running_daemon(kube, config, timeout=0.5, kinds=("flinkdeployments",)) as run:
        await run.until(lambda: len(run.registry) == len(names), "every canary tracked")
        start = len(reloads)
        fault = kube.inject(Fault(verb="patch", code=401, times=-1))
        await run.until(lambda: fault.hits >= 60, "sixty refused bumps", within=10.0)
        refused_for = asyncio.get_running_loop().time() - reloads[start] if reloads[start:] else 0
        # 1 s, 2 s, 4 s... apart: a handful, not one per refused request.
        assert 1 <= len(reloads) - start <= 3 + refused_for, (len(reloads) - start, fault.hits)


def noting_reloads(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """An event set each time a kubeconfig is loaded (cleared by the test to wait for
    the next)."""
    reloaded = asyncio.Event()
    real = k8s_config.load_kube_config

    async def noted(*args: Any, **kwargs: Any) -> Any:
        loaded = await real(*args, **kwargs)
        reloaded.set()
        return loaded

    monkeypatch.setattr(k8s_config, "load_kube_config", noted)
    return reloaded


async def rotate_ca(
    server_context: ssl.SSLContext, trust: Callable[[trustme.CA], object], reloaded: asyncio.Event
) -> None:
    """The API server's CA rotated, and ``trust`` puts the new one in the kubeconfig;
    returns once the changed kubeconfig was read again (``reloaded``, noting_reloads)."""
    rotated = trustme.CA()
    rotated.issue_cert("127.0.0.1", "localhost").configure_cert(server_context)
    reloaded.clear()
    trust(rotated)
    try:
        async with asyncio.timeout(10):
            await reloaded.wait()
    except TimeoutError:
        raise AssertionError("the changed kubeconfig was not read again") from None


async def test_requests_refused_at_once_advance_the_reload_backoff_one_step(
    kube, tmp_path, monkeypatch
):
    """Issue 42: 20 requests refused by one 401 make one reload, and their retries,
    refused too, one step of its backoff: the next reload may come 1 s later (before:
    a step per refused retry, 30 s)."""
    from canaryd.kube import KubeError
    from tests.harness import counting_client

    client, reloads = await counting_client(kube, tmp_path, monkeypatch)
    kube.inject(Fault(verb="get", code=401, times=-1))
    try:
        answers = await asyncio.gather(
            *(client.request("get", "GET", "/api/v1/namespaces/default") for _ in range(20)),
            return_exceptions=True,
        )
        assert all(isinstance(a, KubeError) and a.status == 401 for a in answers), answers
        assert len(kube.requests_for("get")) == 40  # each sent again once, reloaded
        assert len(reloads) == 1
        assert client.credentials._not_before - time.monotonic() <= 1.2  # 1 s, ±20 % jitter
    finally:
        await client.close()


async def test_a_401_says_also_after_reloading_only_when_no_newer_credentials_came(
    kube, tmp_path, monkeypatch
):
    """Review: every 401 on credentials that came from a reload (an exec plugin's
    renewal) said "also after reloading the credentials", even when the reload it made
    then loaded new ones (a watch is tried again with them). The note is for credentials
    refused with none newer to try."""
    from tests.harness import counting_client

    client, reloads = await counting_client(kube, tmp_path, monkeypatch)
    credentials = client.credentials
    try:
        assert await credentials.reload(0)  # version 1, as a renewal leaves it
        credentials._not_before = 0.0  # its backoff step is over
        assert await credentials.answered(401, 1) == ""  # reloaded: version 2 to try
        assert len(reloads) == 2
        # Within the step that reload started: no newer credentials, refused again.
        assert await credentials.answered(401, 2) == " (also after reloading the credentials)"
        assert len(reloads) == 2
    finally:
        await client.close()


async def test_in_a_pod_a_401_reads_the_projected_token_again(
    ca, server_context, tmp_path, monkeypatch
):
    """In a pod, a request refused 401 reads the service account's projected token again
    (the kubelet rotated it) and is sent again with it, as with a kubeconfig (before:
    the file was read again at most every minute and the request failed)."""
    from kubernetes_asyncio.config import incluster_config

    from canaryd.config import Settings
    from canaryd.kube import connect

    token, ca_file = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("the-token-before-the-rotation")
    ca.cert_pem.write_to_path(str(ca_file))
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca_file))
    kube = FakeKube(token=TOKEN)
    async with kube.running(ssl_context=server_context):
        kube.create_namespace("default")
        host, port = kube.url.removeprefix("https://").rsplit(":", 1)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
        client = await connect(Settings())
        try:
            token.write_text(TOKEN)  # the kubelet's rotation
            await client.request("get", "GET", "/api/v1/namespaces/default")
            assert [r.status for r in kube.requests_for("get")] == [401, 200]
        finally:
            await client.close()


async def test_a_ca_embedded_in_the_kubeconfig_is_read_again_when_the_file_changes(
    ca, server_context, tmp_path, monkeypatch
):
    """Issue 42: the API server's CA is rotated and the kubeconfig's
    certificate-authority-data with it: the file's change makes a new TLS context, as a
    rotated CA file does, and the next connection trusts the new CA (before: only CA
    files were watched; the embedded data was read at start only)."""
    from canaryd.config import Settings
    from canaryd.credentials import Credentials
    from canaryd.kube import connect

    handshakes = Handshakes(server_context)
    reloaded = noting_reloads(monkeypatch)
    # The look for rotated files: every minute, here at once.
    monkeypatch.setattr(Credentials, "LOOK", 0.01)
    kube = FakeKube(token=TOKEN)
    path = tmp_path / "kubeconfig"

    def trust(authority: trustme.CA) -> None:
        config = kube.kubeconfig()
        data = base64.b64encode(authority.cert_pem.bytes()).decode()
        config["clusters"][0]["cluster"]["certificate-authority-data"] = data
        path.write_text(yaml.safe_dump(config))

    async with kube.running(ssl_context=server_context):
        kube.create_namespace("default")
        trust(ca)
        client = await connect(Settings(kubeconfig=str(path)))
        reloaded.clear()
        refresher = asyncio.create_task(client.credentials.keep_fresh())
        try:
            await client.request("get", "GET", "/api/v1/namespaces/default")
            await rotate_ca(server_context, trust, reloaded)
            seen = handshakes.count
            await client.request("get", "GET", "/api/v1/namespaces/default")
            assert handshakes.count > seen  # a new connection, which trusts the new CA
        finally:
            refresher.cancel()
            await client.close()


async def test_with_an_exec_plugin_a_rotated_ca_is_read_within_a_look_not_at_the_token_renewal(
    ca, server_context, tmp_path, monkeypatch
):
    """An exec plugin whose token lasts an hour (GKE, EKS helpers): a CA rotated in the
    kubeconfig is read again at the next look for changed files (every minute), not at
    the token's renewal at 80 % of its lifetime, 48 minutes on (before: keep_fresh slept
    until then, and every connection failed TLS verification meanwhile); the plugin is
    not run at every look."""
    from canaryd.config import Settings
    from canaryd.credentials import Credentials
    from canaryd.kube import connect
    from tests.test_daemon import exec_kubeconfig, plugin_runs

    reloaded = noting_reloads(monkeypatch)
    monkeypatch.setattr(Credentials, "LOOK", 0.05)  # every minute, here at once
    kube = FakeKube(token=TOKEN)

    def trust(authority: trustme.CA) -> Path:
        path = exec_kubeconfig(kube, tmp_path, TOKEN, lifetime=3600)
        config = yaml.safe_load(path.read_text())
        data = base64.b64encode(authority.cert_pem.bytes()).decode()
        config["clusters"][0]["cluster"]["certificate-authority-data"] = data
        path.with_suffix(".new").write_text(yaml.safe_dump(config))
        os.replace(path.with_suffix(".new"), path)
        return path

    async with kube.running(ssl_context=server_context):
        kube.create_namespace("default")
        client = await connect(Settings(kubeconfig=str(trust(ca))))
        refresher = asyncio.create_task(client.credentials.keep_fresh())
        try:
            await client.request("get", "GET", "/api/v1/namespaces/default")
            assert plugin_runs(tmp_path) == 1
            await rotate_ca(server_context, trust, reloaded)
            await client.request("get", "GET", "/api/v1/namespaces/default")  # trusted
            assert plugin_runs(tmp_path) == 2  # one run for the change, none per look
        finally:
            refresher.cancel()
            await client.close()


async def test_a_retry_after_a_slow_credential_reload_is_not_sent_past_the_deadline(
    kube, tmp_path, monkeypatch
):
    """One deadline covers the whole call: a 401 whose reload (an exec plugin) takes
    longer than the call's time limit ends the call; the retry is not sent late (a
    leader's write past its fence)."""
    from canaryd.config import Settings
    from canaryd.kube import ErrorKind, KubeError, connect

    config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    client = await connect(Settings(kubeconfig=str(config)))
    real = k8s_config.load_kube_config

    async def slow_reload(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.5)
        return await real(*args, **kwargs)

    monkeypatch.setattr(k8s_config, "load_kube_config", slow_reload)
    kube.inject(Fault(verb="get", code=401, times=1))
    try:
        with pytest.raises(KubeError) as caught:
            await client.request("get", "GET", "/api/v1/namespaces/default", time_limit=0.3)
        assert caught.value.kind is ErrorKind.TRANSIENT
        assert "reloading the credentials" in str(caught.value)
        assert len(kube.requests_for("get")) == 1, "the retry was sent past the deadline"
    finally:
        await client.close()


async def test_a_reload_of_a_kubeconfig_edited_to_a_bad_server_keeps_the_credentials(
    kube, tmp_path
):
    """The cluster server is checked at every load, not only the first: a kubeconfig
    edited to an unusable server is a failed reload, the credentials in use kept (before:
    taken, and every request failed as a connection error until the file was mended)."""
    from canaryd.config import Settings
    from canaryd.kube import connect

    path = kube.write_kubeconfig(tmp_path / "kubeconfig")
    client = await connect(Settings(kubeconfig=str(path)))
    try:
        host = client.host
        config = yaml.safe_load(path.read_text())
        config["clusters"][0]["cluster"]["server"] = "ftp://example.invalid"
        path.write_text(yaml.safe_dump(config))
        assert not await client.credentials.reload(client.credentials.version)
        assert client.host == host
    finally:
        await client.close()
