"""``make demo CONTROLPLANE=1``: the demo's scenario on the real control plane of
``make e2e`` instead of the fake (for a newcomer who has built it: ``make controlplane``).
canaryd runs as the ServiceAccount that config/rbac binds."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ssl
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from canaryd.config.parse import parse_duration
from canaryd.testing.demo import SAMPLES, Demo
from tests.controlplane.launcher import ControlPlane, namespace_object


class ControlPlaneDemo(Demo):
    plane: ControlPlane | None = None
    can_inject_faults = False  # a real kube-apiserver neither withholds events nor fails

    @contextlib.asynccontextmanager
    async def cluster(self, tmp: Path, namespaces: list[str]) -> AsyncIterator[Path]:
        self.say("starting etcd, kube-apiserver and kube-controller-manager")
        plane = self.plane = ControlPlane()
        await asyncio.to_thread(plane.start)
        try:
            for namespace in namespaces:
                plane.apply(namespace_object(namespace))
            self.api_url = plane.url
            self.say(
                f"kube-apiserver on {plane.url} (admin kubeconfig {plane.kubeconfig('admin')})"
            )
            yield plane.kubeconfig("canaryd")
        finally:
            await asyncio.to_thread(plane.stop)

    def session(self) -> aiohttp.ClientSession:
        assert self.plane is not None
        context = ssl.create_default_context(cafile=str(self.plane.ca_file))
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context),
            headers={"Authorization": f"Bearer {self.plane.admin_token}"},
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.controlplane.demo")
    parser.add_argument("--timeout", default="5s", help="canary cycle (default 5s)")
    parser.add_argument("--once", action="store_true", help="exit after the scenario")
    args = parser.parse_args(argv)
    demo = ControlPlaneDemo(parse_duration(args.timeout), SAMPLES)
    sys.exit(asyncio.run(demo.run(once=args.once)))


if __name__ == "__main__":
    main()
