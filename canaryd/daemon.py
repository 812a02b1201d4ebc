"""The daemon: wires watcher, scheduler and health server under one TaskGroup (a task
that fails stops them all); docs/CONFIGURATION.md#signals says what each signal does."""

from __future__ import annotations

import asyncio
import platform
import signal
from collections.abc import Awaitable, Callable

import structlog

from canaryd import __version__, metrics
from canaryd.access import say_operator_account
from canaryd.backoff import Backoff
from canaryd.config import ConfigError, Settings, follow_operator_config, say_operator_config
from canaryd.credentials import Credentials, CredentialsError, source
from canaryd.episodes import Episodes
from canaryd.kube import connect
from canaryd.leader import LeaderElector
from canaryd.registry import Registry
from canaryd.scheduler import Scheduler
from canaryd.server import HealthServer
from canaryd.systemd import Notifier
from canaryd.watcher import Watcher

log = structlog.get_logger("canaryd.daemon")


class _Shutdown(Exception):
    """Raised inside the TaskGroup to stop it."""


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.registry = Registry(settings.label)
        self._stop = asyncio.Event()
        self._reload = asyncio.Event()
        self.started = asyncio.Event()
        """Set once every task runs and the health server listens (tests wait on it)."""
        # Built once by run(), before the health server serves their view.
        self.server: HealthServer
        self.watcher: Watcher
        self.scheduler: Scheduler
        self.elector: LeaderElector | None = None
        self.notifier = Notifier()
        self._credentials_problem: str | None = None

    def stop(self) -> None:
        self._stop.set()

    def reload(self) -> None:
        self._reload.set()

    async def run(self) -> None:
        settings = self.settings
        # A kubeconfig missing or bad: exit 2 before anything runs; a plugin's credentials
        # are loaded once the health server and the signal handlers are up (it may hang).
        plugin = source(settings).plugin
        kube = await connect(settings, load=not plugin)
        try:
            if settings.leader_elect:
                self.elector = LeaderElector(settings, kube)
            self.scheduler = scheduler = Scheduler(
                settings, self.registry, kube, lease=self.elector
            )
            self.watcher = Watcher(settings, self.registry, kube)
            self.server = server = HealthServer(settings, self)
        except BaseException:  # a bug in the wiring: its connections closed all the same
            await kube.close()
            raise
        metrics.REGISTRY.register(server)  # its state gauges
        try:
            await server.start()  # a busy port: ConfigError, exit 2
            self._signals(install=True)  # before the credentials: an exec plugin may hang
            async with asyncio.TaskGroup() as group:
                group.create_task(self._until_stopped(), name="shutdown")
                group.create_task(self.notifier.run(self._ready, self.stuck), name="sd-notify")
                if plugin:
                    await self._load_credentials(kube.credentials)
                operator_config = say_operator_config(settings)  # warnings first
                log.info(
                    "canaryd_started",
                    version=__version__,
                    python=platform.python_version(),
                    api_server=kube.host,
                    kinds=list(settings.kinds),
                    namespaces=sorted(settings.namespaces) if settings.namespaces else "all",
                    timeout=settings.timeout,
                    label=settings.label,
                    reconciled_by=settings.reconciled_by,
                    follows_operator_config=settings.dynamic_namespaces,
                    operator_config=operator_config,
                )
                group.create_task(self._supervise("watcher", self.watcher.run))
                group.create_task(self._supervise("scheduler", scheduler.run))
                if settings.operator_account is not None:
                    said = say_operator_account(kube, settings.operator_account)
                    group.create_task(said, name="operator-account")
                group.create_task(self._supervise("events", scheduler.events.run))
                group.create_task(self._supervise("config", self._follow_operator_config))
                group.create_task(self._supervise("credentials", kube.credentials.keep_fresh))
                if self.elector is not None:
                    group.create_task(self._supervise("leader", self.elector.run))
                self.started.set()
        except* _Shutdown:
            pass
        except* ConfigError as errors:  # a busy port, or in the group a bad kubeconfig: exit 2
            raise errors.exceptions[0] from None
        finally:
            self._signals(install=False)  # those not installed are left as they are
            try:
                await server.stop()
            finally:  # cancelled again meanwhile: the rest is let go all the same
                metrics.REGISTRY.unregister(server)
                await kube.close()
        log.info("canaryd_stopped", why="signal")

    async def _load_credentials(self, credentials: Credentials) -> None:
        """Until loaded, every failure (an exec plugin that fails, or hangs past the
        request timeout) is one episode named in /readyz, tried again with backoff."""
        cycle = self.settings.timeout
        failures = Episodes(
            "credential_failures", "credentials", lambda: cycle, "credentials", "credentials_failed"
        )
        backoff = Backoff(self.settings.backoff_initial, self.settings.backoff_max)
        try:
            while True:
                try:
                    await credentials.load(self.settings)
                except CredentialsError as err:
                    self._credentials_problem = str(err)
                    failures.failed("start-up", "credentials", str(err))
                    await asyncio.sleep(backoff.next())
                else:
                    self._credentials_problem = None
                    failures.recovered("start-up")
                    return
        finally:
            failures.stopped("canaryd stopped")

    async def _supervise(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run a long-lived task for as long as the daemon runs: a bug that escapes it is
        logged, counted and followed by a restart with backoff, and never takes the
        health server (or the other tasks) down with it."""
        task = asyncio.current_task()
        if task is not None:
            task.set_name(name)
        loop = asyncio.get_running_loop()
        backoff = Backoff(self.settings.backoff_initial, self.settings.backoff_max)
        while True:
            started = loop.time()
            try:
                await run()
                why = "returned"
            except Exception as err:
                why = type(err).__name__
                log.exception("task_failed", task=name)
            metrics.ERRORS.labels(f"task_{name}").inc()
            if loop.time() - started >= self.settings.backoff_max:
                backoff.reset()  # it ran well for a while: a new failure, not a loop
            delay = backoff.next()
            log.error("task_restarting", task=name, why=why, restart_in=round(delay, 3))
            await asyncio.sleep(delay)

    def role(self) -> tuple[str, str | None]:
        """/healthz's ``role`` and ``leader``."""
        if self.elector is None:
            return "single", None
        return ("leader" if self.elector.leading else "follower"), self.elector.leader

    def blind(self) -> dict[str, str]:
        """Why canaryd checks nothing or cannot judge, by ``canaryd_blind`` reason."""
        if self._credentials_problem is not None:  # at start: nothing can be listed yet
            return {"unauthorized": self._credentials_problem}
        operator = self.scheduler.operator
        return self.watcher.blind() | (operator.blind() if operator is not None else {})

    def coverage(self) -> dict[str, int]:
        return self.watcher.coverage()

    def _ready(self) -> bool:
        return self.watcher.ready

    def not_ready(self) -> list[str] | None:
        """Why /readyz fails, each a phrase (the scopes not listed or not connected, a
        limit too low, the Lease); None when ready."""
        if self._credentials_problem is not None:
            return [self._credentials_problem]
        waiting = self.watcher.not_ready()
        if self.elector is not None and self.elector.problem is not None:
            waiting.append(f"lease {self.elector}: {self.elector.problem}")
        return waiting or None

    def stuck(self) -> str | None:
        """Why the daemon is not making progress, or None when it is (the watchdog)."""
        lag = self.scheduler.lag()
        if lag > self.settings.timeout:
            return f"the scheduler is {lag:.1f}s behind its deadlines"
        return None

    async def _until_stopped(self) -> None:
        await self._stop.wait()
        log.info("shutting_down")
        self.notifier.notify("STOPPING=1")
        # Every bump finished or abandoned before anything stops: a leader releases its
        # lease as it stops, and a follower may take it at once.
        await self.scheduler.writer.finished()
        raise _Shutdown

    def _signals(self, install: bool) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            if install:
                loop.add_signal_handler(sig, self.reload if sig == signal.SIGHUP else self.stop)
            else:
                loop.remove_signal_handler(sig)

    async def _follow_operator_config(self) -> None:
        """The watched namespaces follow the operator config's when it says so."""
        watcher = self.watcher
        follow = follow_operator_config(self.settings, self._reload, watcher.namespaces)
        async for namespaces in follow:
            watcher.set_namespaces(namespaces)
