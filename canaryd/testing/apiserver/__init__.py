"""A fake kube-apiserver on aiohttp, faithful where canaryd depends on Kubernetes.

Use it in-process from pytest::

    async with FakeKube().running() as kube:
        kube.write_kubeconfig(path)

or as a process for the demo and benchmarks::

    python -m canaryd.testing.apiserver --kubeconfig /tmp/kubeconfig --port 0

Every modelled behaviour cites where kube-apiserver implements it; paths are in
github.com/kubernetes/kubernetes. What it does not model is listed in
``NOT_MODELLED`` below.

Its parts, each importing only those above it in this list (pyproject.toml's import
contracts check it):

- ``resources``: resource types, ``Status`` errors, a request in Kubernetes terms;
- ``strategy``: what a create or update stores (generation, status, owned fields);
- ``store``: objects, the resourceVersion counter, the history, namespace lifecycle;
- ``watch``: watch streams over the store: history, selectors, bookmarks, 410;
- ``faults`` and ``discovery``: injected failures and 403s; the discovery documents;
- ``handlers``: the HTTP API: parsing, authentication, verbs, lists, the request log;
- ``server``: ``FakeKube``: serving on a socket, clients' kubeconfigs, test controls;
- ``standalone``: ``python -m canaryd.testing.apiserver``.
"""

from canaryd.testing.apiserver.faults import Fault, RbacDeny
from canaryd.testing.apiserver.handlers import RequestRecord
from canaryd.testing.apiserver.resources import (
    EVENTS,
    FLINK_DEPLOYMENTS,
    FLINK_GROUP,
    FLINK_SESSION_JOBS,
    FLINK_TYPES,
    FLINK_VERSION,
    LEASES,
    NAMESPACES,
    SERVICE_ACCOUNTS,
    ApiError,
    Request,
    ResourceType,
    conflict,
    not_found,
)
from canaryd.testing.apiserver.server import FakeKube
from canaryd.testing.apiserver.standalone import concurrent_writer, main, seed_canaries
from canaryd.testing.apiserver.store import Change

NOT_MODELLED = (
    "OpenAPI schema validation, defaulting and pruning of custom resources",
    "server-side apply and managedFields",
    "resourceVersionMatch; list pagination is modelled as kube-apiserver's chunking "
    "(limit/continue from one snapshot, 410 once compacted), not its token format",
    "the watch cache's sendInitialEvents / initial-events-end bookmark",
    "admission webhooks, quota, owner references and garbage collection",
    "client certificates and any authentication other than one bearer token",
    "bookmark timing: kube-apiserver's watch cache sends about one a minute; the fake "
    "every bookmark_interval (canaryd's idle watchdog outlasts both)",
    "Events' time to live (kube-apiserver's --event-ttl, 1 h) and their core/v1 view",
    "authorization per request only: an open watch outlives a removed RoleBinding, "
    "as on kube-apiserver (checked by tests/test_e2e.py), and SelfSubjectAccessReviews "
    "answered as those denials decide, but nothing else of RBAC",
)
"""What the fake leaves out, each irrelevant to canaryd; tests/test_conformance.py
compares the rest with a real kube-apiserver in ``make e2e``."""

__all__ = [
    "EVENTS",
    "FLINK_DEPLOYMENTS",
    "FLINK_GROUP",
    "FLINK_SESSION_JOBS",
    "FLINK_TYPES",
    "FLINK_VERSION",
    "LEASES",
    "NAMESPACES",
    "NOT_MODELLED",
    "SERVICE_ACCOUNTS",
    "ApiError",
    "Change",
    "FakeKube",
    "Fault",
    "RbacDeny",
    "Request",
    "RequestRecord",
    "ResourceType",
    "concurrent_writer",
    "conflict",
    "main",
    "not_found",
    "seed_canaries",
]
