"""Shared fixtures: a fake API server on 127.0.0.1 and a kubernetes-asyncio client for it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from kubernetes_asyncio import client, config

from canaryd import logs
from canaryd.testing.apiserver import FakeKube

TOKEN = "fake-token-1234567890"

# canaryd's own log setup, at info: what tests capture is what users see.
logs.configure("console", "info")


@pytest.fixture(autouse=True)
def console_logs() -> Iterator[None]:
    """The log setup above for every test: a test that runs ``canaryd.__main__.main``
    in-process leaves canaryd's own (JSON, or ``error`` for ``canaryd check``) behind."""
    yield
    logs.configure("console", "info")


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    fake = FakeKube(token=TOKEN, bookmark_interval=0.1)
    async with fake.running():
        fake.create_namespace("default")
        yield fake


@pytest.fixture
def kubeconfig(kube: FakeKube, tmp_path: Path) -> Path:
    return kube.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
async def api(kubeconfig: Path) -> AsyncIterator[client.ApiClient]:
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    async with client.ApiClient(configuration) as api_client:
        yield api_client


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The restarts per topology and scenario that tests/test_kubelet.py saw."""
    from tests.kubelet import RESTARTS, restarts_table

    if RESTARTS:
        terminalreporter.write_sep("-", "kubelet: restarts per topology and scenario")
        terminalreporter.write_line(restarts_table())
