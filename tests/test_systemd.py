"""sd_notify over a real unix datagram socket, and the unit file itself."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from canaryd.registry import CanaryState
from canaryd.systemd import Notifier
from tests.harness import create_canary, running_daemon

UNIT = Path(__file__).resolve().parents[1] / "config" / "systemd" / "canaryd.service"


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, tmp_path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        name = str(tmp_path / "notify.sock")
        sock.bind(name)
    else:
        name = f"@canaryd-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name[1:])
    sock.setblocking(False)
    try:
        yield sock, name
    finally:
        sock.close()


async def receive(sock: socket.socket, until: str, seen: list[str]) -> None:
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(5):
        while True:
            message = (await loop.sock_recv(sock, 4096)).decode()
            seen.append(message)
            if message == until:
                return


def test_notifier_reads_its_environment():
    assert Notifier({}).address is None
    assert Notifier({"NOTIFY_SOCKET": "@x"}).address == "\0x"
    assert Notifier({"NOTIFY_SOCKET": "/run/x.sock"}).address == "/run/x.sock"
    assert Notifier({"NOTIFY_SOCKET": "relative"}).address is None
    assert Notifier({"WATCHDOG_USEC": "30000000"}).watchdog_interval == 15.0
    other_pid = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert Notifier(other_pid).watchdog_interval is None
    assert Notifier({"WATCHDOG_USEC": "soon"}).watchdog_interval is None
    assert not Notifier({}).notify("READY=1")  # no socket: nothing sent, no error


async def test_ready_watchdog_and_stopping(kube, kubeconfig, notify_socket, monkeypatch):
    sock, name = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", name)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    create_canary(kube)
    seen: list[str] = []
    async with running_daemon(kube, kubeconfig) as run:
        await receive(sock, "READY=1", seen)
        assert run.daemon.watcher is not None and run.daemon.watcher.ready
        for _ in range(3):
            await receive(sock, "WATCHDOG=1", seen)
        await run.until_state(CanaryState.HEALTHY)
    await receive(sock, "STOPPING=1", seen)
    assert seen.index("READY=1") < seen.index("STOPPING=1")
    assert seen.count("READY=1") == 1


class Steps:
    """A sleep the test releases one tick at a time."""

    def __init__(self) -> None:
        self.sleeping: asyncio.Queue[asyncio.Future[None]] = asyncio.Queue()

    async def sleep(self, _seconds: float) -> None:
        future = asyncio.get_running_loop().create_future()
        self.sleeping.put_nowait(future)
        await future

    async def next_tick(self) -> asyncio.Future[None]:
        """Wait until the notifier finished a tick and sleeps; returns its wake-up."""
        async with asyncio.timeout(5):
            return await self.sleeping.get()


def drain(sock: socket.socket) -> list[str]:
    messages = []
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except BlockingIOError:
            return messages


async def test_watchdog_is_withheld_while_the_daemon_is_stuck(notify_socket):
    sock, name = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "20000000"})
    why: list[str | None] = [None]
    steps = Steps()
    task = asyncio.create_task(notifier.run(lambda: True, lambda: why[0], steps.sleep))
    try:
        wake = await steps.next_tick()
        assert drain(sock) == ["READY=1", "WATCHDOG=1"]
        why[0] = "the scheduler is 99.0s behind its deadlines"
        for _ in range(3):
            wake.set_result(None)
            wake = await steps.next_tick()
            assert drain(sock) == []
        why[0] = None
        wake.set_result(None)
        await steps.next_tick()
        assert drain(sock) == ["WATCHDOG=1"]
    finally:
        task.cancel()


def test_scheduler_lag_is_what_makes_the_daemon_stuck():
    from canaryd.config import Settings
    from canaryd.registry import Canary, CanaryKey, Registry
    from canaryd.scheduler import Scheduler

    now = [100.0]
    registry = Registry("flink.apache.org/canary")
    scheduler = Scheduler(
        Settings(timeout=10),
        registry,
        kube=None,  # type: ignore[arg-type]
        clock=lambda: now[0],
    )
    assert scheduler.lag() == 0.0
    scheduler.push(95.0, Canary(CanaryKey("flinkdeployments", "ns", "c"), "u", "1", 1, 0))
    assert scheduler.lag() == 5.0
    now[0] = 120.0
    assert scheduler.lag() == 25.0


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_unit_file_verifies(tmp_path):
    canaryd = str(Path(sys.executable).parent / "canaryd")
    unit = tmp_path / "canaryd.service"
    unit.write_text(UNIT.read_text().replace("/opt/canaryd/bin/canaryd", canaryd))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    complaints = [
        line for line in (result.stdout + result.stderr).splitlines() if "canaryd.service" in line
    ]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr


def test_unit_file_has_what_the_daemon_relies_on():
    text = UNIT.read_text()
    directives = {}
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            directives.setdefault(key.strip(), []).append(value.strip())
    assert directives["Type"] == ["notify"]
    assert directives["WatchdogSec"] and directives["Restart"] == ["on-failure"]
    assert directives["EnvironmentFile"][0].lstrip("-") == "/etc/canaryd/canaryd.env"
    assert directives["DynamicUser"] == ["yes"] and directives["NoNewPrivileges"] == ["yes"]
    assert directives["ProtectSystem"] == ["strict"]
    assert "ExecReload" in directives  # SIGHUP re-reads the operator config
    # ~500 watched namespaces exhaust a soft limit of 1024 (a socket per kind and
    # namespace); setrlimit is in @resources, so a filtered call must fail, not kill.
    assert int(directives["LimitNOFILE"][0].split(":")[0]) >= 65536
    assert directives["SystemCallErrorNumber"] == ["EPERM"]


def test_the_install_lines_install_this_project_with_a_least_privilege_kubeconfig():
    """PyPI's "canaryd" is an unrelated project: the unit's install lines (and the
    README's and docs/OPERATIONS.md's) install this one from its source, hand over a
    kubeconfig made by config/systemd/kubeconfig.sh rather than an admin's, and install the
    Documentation= file."""
    sections = []
    for doc, end in (("README.md", "\n## "), ("docs/OPERATIONS.md", "\n#### ")):
        text = (UNIT.parents[2] / doc).read_text()
        section = text[text.index("### systemd") :]
        sections.append(section[: section.index(end)])
    for text in (UNIT.read_text(), *sections):
        assert "pip install canaryd" not in text
        assert "pip install ." in text
        assert "~/.kube/config /etc/canaryd" not in text
        assert "config/systemd/kubeconfig.sh /etc/canaryd/kubeconfig" in text
    documentation = next(
        line.split("=", 1)[1]
        for line in UNIT.read_text().splitlines()
        if line.startswith("Documentation=")
    )
    assert documentation.startswith("file:"), documentation
    assert f"README.md {documentation.removeprefix('file:')}" in UNIT.read_text()


def test_the_unit_does_not_restart_a_bad_config_and_outlasts_the_slowest_stop():
    """Exit 2 is a bad configuration: a restart cannot fix it. A stop finishes the bumps
    in flight (each within its write timeout) and then releases the lease (within one
    more), so systemd must wait longer than twice the write timeout before it kills."""
    from canaryd.config import load_settings
    from canaryd.config.parse import parse_duration

    directives: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            directives.setdefault(key.strip(), []).append(value.strip())
    assert "2" in " ".join(directives["RestartPreventExitStatus"]).split()
    environ = {}
    for line in (UNIT.parent / "canaryd.env").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            environ[key.strip()] = value.strip()
    worst = max(
        load_settings([], environ).write_timeout,
        load_settings([], {**environ, "CANARYD_LEADER_ELECT": "true"}).write_timeout,
    )
    (stop,) = directives["TimeoutStopSec"]
    assert parse_duration(stop) > 2 * worst, (stop, worst)
