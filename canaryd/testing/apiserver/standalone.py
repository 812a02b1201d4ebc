"""The fake as a process of its own (``python -m canaryd.testing.apiserver``), for the
demo and the benchmarks: seeded canaries, an optional concurrent writer."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import signal
from collections.abc import Callable
from typing import Any

from canaryd.testing.apiserver.faults import Fault
from canaryd.testing.apiserver.resources import FLINK_DEPLOYMENTS, Request
from canaryd.testing.apiserver.server import FakeKube


def seed_canaries(kube: FakeKube, count: int, namespaces: int) -> None:
    """``count`` FlinkDeployment canaries over ``namespaces`` namespaces."""
    if count <= 0:
        return
    names = [f"canary-{n}" for n in range(max(1, namespaces))]
    for name in names:
        if kube.get("namespaces", None, name) is None:
            kube.create_namespace(name)
    for i in range(count):
        body = {"metadata": {"name": f"canary-{i}", "labels": {"flink.apache.org/canary": "true"}}}
        kube.create(FLINK_DEPLOYMENTS, names[i % len(names)], body)


def concurrent_writer(kube: FakeKube, rate: float, seed: int) -> Callable[[Request], Fault | None]:
    """A hook: before ``rate`` of canary PATCHes, another client annotates the object."""
    rng = random.Random(seed)
    counter = itertools.count()

    def hook(req: Request) -> Fault | None:
        if req.verb != "patch" or req.rtype is not FLINK_DEPLOYMENTS or rng.random() >= rate:
            return None
        namespace, name = req.namespace, req.name or ""

        def write() -> None:
            value = str(next(counter))

            def annotate(obj: dict[str, Any]) -> dict[str, Any]:
                obj["metadata"].setdefault("annotations", {})["bench/writer"] = value
                return obj

            kube.update(FLINK_DEPLOYMENTS, namespace, name, annotate)

        return Fault(code=0, action=write)

    return hook


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m canaryd.testing.apiserver",
        description="Run canaryd's fake kube-apiserver on 127.0.0.1 (for demos and benchmarks).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--kubeconfig", required=True, help="where to write a kubeconfig for it")
    parser.add_argument("--token", default=None, help="require this bearer token")
    parser.add_argument(
        "--namespace", action="append", default=[], help="namespace to create at start (repeatable)"
    )
    parser.add_argument("--bookmark-interval", type=float, default=60.0)
    parser.add_argument(
        "--watch-timeout",
        type=float,
        default=1800.0,
        help="watch timeout when a client sends no timeoutSeconds",
    )
    parser.add_argument(
        "--canaries",
        type=int,
        default=0,
        help="create this many FlinkDeployment canaries at start (benchmarks)",
    )
    parser.add_argument(
        "--canary-namespaces",
        type=int,
        default=1,
        help="spread --canaries over this many namespaces (canary-0, canary-1, ...)",
    )
    parser.add_argument(
        "--conflict-rate",
        type=float,
        default=0.0,
        help="share of canary PATCHes that a concurrent writer beats (adds an annotation "
        "first), so they meet a real 409",
    )
    parser.add_argument("--seed", type=int, default=41050)
    parser.add_argument(
        "--keep-requests", type=int, default=10_000, help="bound of the request log"
    )
    args = parser.parse_args(argv)

    async def serve() -> None:
        kube = FakeKube(
            token=args.token,
            bookmark_interval=args.bookmark_interval,
            default_watch_timeout=args.watch_timeout,
        )
        for ns in args.namespace:
            kube.create_namespace(ns)
        seed_canaries(kube, args.canaries, args.canary_namespaces)
        kube.keep_requests = args.keep_requests
        if args.conflict_rate > 0:
            kube.hooks.append(concurrent_writer(kube, args.conflict_rate, args.seed))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with kube.running(args.host, args.port):
            kube.write_kubeconfig(args.kubeconfig)
            print(
                f"fake kube-apiserver listening on {kube.url}; kubeconfig {args.kubeconfig}",
                flush=True,
            )
            await stop.wait()

    asyncio.run(serve())
