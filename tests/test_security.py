"""Security: TLS verification stays on unless the kubeconfig turns it off, and no
token or private key reaches the logs, at any level, tracebacks included."""

from __future__ import annotations

import asyncio
import base64
import ssl
from pathlib import Path

import pytest
import trustme
import yaml

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
