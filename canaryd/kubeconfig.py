"""``python -m canaryd.kubeconfig`` (``make kubeconfig``): a least-privilege kubeconfig
for a canaryd that runs outside the cluster (systemd, a bastion host).

With an admin's kubeconfig it applies this repository's RBAC manifests (``config/rbac``:
a ServiceAccount and the ClusterRole that grants exactly what canaryd uses, or
``config/rbac/namespaced``) by server-side apply, asks the TokenRequest API for a token
of that ServiceAccount, and writes a kubeconfig (mode 0600) that holds the cluster's
address and CA and that token, nothing of the admin's. It then checks, with the new
token, that canaryd's first request is allowed. It never prints a token.

    python -m canaryd.kubeconfig --output /etc/canaryd/kubeconfig
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from canaryd import logs
from canaryd.config import ConfigError, parse_duration
from canaryd.credentials import Credentials, kubeconfig_path, load_configuration
from canaryd.kube import ErrorKind, KubeClient, KubeError, segment

FIELD_MANAGER = "canaryd-kubeconfig"
BASE_NAME = "canaryd"
"""The manifests' own name prefix (config/rbac), replaced by --name."""
MIN_DURATION = 600.0
"""The TokenRequest API's shortest token (10 min)."""

# Where each kind of config/rbac lives: (API prefix, plural, namespaced).
PATHS = {
    "Namespace": ("/api/v1", "namespaces", False),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
}


def object_path(obj: dict[str, Any], namespace: str) -> str:
    prefix, plural, namespaced = PATHS[obj["kind"]]
    where = f"/namespaces/{segment(namespace)}" if namespaced else ""
    return f"{prefix}{where}/{plural}/{segment(obj['metadata']['name'])}"


def read_manifests(directory: Path) -> list[dict[str, Any]]:
    """The objects a kustomization lists, in its order (only the kinds of config/rbac)."""
    kustomization = directory / "kustomization.yaml"
    try:
        spec = yaml.safe_load(kustomization.read_text(encoding="utf-8"))
        objects = [
            obj
            for resource in spec["resources"]
            for obj in yaml.safe_load_all((directory / resource).read_text(encoding="utf-8"))
            if obj
        ]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as err:
        raise ConfigError(
            f"cannot read the RBAC manifests in {directory} ({type(err).__name__}: {err}): "
            "run this from canaryd's repository, or pass --rbac config/rbac"
        ) from err
    for obj in objects:
        if not isinstance(obj, dict) or obj.get("kind") not in PATHS:
            kind = obj.get("kind") if isinstance(obj, dict) else type(obj).__name__
            raise ConfigError(f"{directory}: unsupported kind {kind!r} in the RBAC manifests")
    return objects


def _renamed(name: str, new: str) -> str:
    return new + name[len(BASE_NAME) :] if name.startswith(BASE_NAME) else name


def prepared(objects: list[dict[str, Any]], namespace: str, name: str) -> list[dict[str, Any]]:
    """The manifests for this ServiceAccount: namespaced objects and the bindings'
    ServiceAccount subjects in ``namespace`` (kustomize's ``namespace:``), names
    starting ``canaryd`` starting ``name`` instead (its ``nameSuffix``, at the front)."""
    result = []
    for original in objects:
        obj = json.loads(json.dumps(original))
        obj["metadata"]["name"] = _renamed(obj["metadata"]["name"], name)
        if PATHS[obj["kind"]][2]:
            obj["metadata"]["namespace"] = namespace
        if "roleRef" in obj:
            obj["roleRef"]["name"] = _renamed(obj["roleRef"]["name"], name)
        for subject in obj.get("subjects") or []:
            if subject.get("kind") == "ServiceAccount":
                subject["name"] = _renamed(subject["name"], name)
                subject["namespace"] = namespace
        result.append(obj)
    return result


def service_account(objects: list[dict[str, Any]]) -> str:
    names = [o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"]
    if len(names) != 1:
        raise ConfigError(f"the RBAC manifests hold {len(names)} ServiceAccounts, not one")
    return str(names[0])


def kubeconfig_for(configuration: Any, token: str, name: str) -> dict[str, Any]:
    """A kubeconfig with the admin's cluster (address, CA, TLS server name, proxy) and
    the ServiceAccount's token; the CA is embedded, so the file stands alone (systemd
    hands it over with LoadCredential=)."""
    cluster: dict[str, Any] = {"server": str(configuration.host).rstrip("/")}
    if configuration.ssl_ca_cert:
        ca = Path(configuration.ssl_ca_cert).read_bytes()
        cluster["certificate-authority-data"] = base64.b64encode(ca).decode("ascii")
    if not configuration.verify_ssl:
        cluster["insecure-skip-tls-verify"] = True
    if configuration.tls_server_name:
        cluster["tls-server-name"] = configuration.tls_server_name
    if configuration.proxy:
        cluster["proxy-url"] = configuration.proxy
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": cluster}],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }


def write_private(path: Path, text: str) -> None:
    """Written whole or not at all, readable by its owner only from the first byte."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


async def apply(kube: KubeClient, obj: dict[str, Any], namespace: str) -> None:
    """Server-side apply: creates the object, or makes it what the manifest says."""
    try:
        await kube.request(
            "apply",
            "PATCH",
            object_path(obj, namespace),
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            body=obj,
            content_type="application/apply-patch+yaml",
        )
    except KubeError as err:
        name = f"{obj['kind']} {obj['metadata']['name']}"
        raise KubeError(err.kind, f"applying {name}: {err}") from err


async def allowed(kube: KubeClient, attributes: dict[str, str]) -> bool:
    review = await kube.request(
        "create",
        "POST",
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
        body={
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attributes},
        },
    )
    return bool((review.get("status") or {}).get("allowed"))


def prepare(args: argparse.Namespace) -> list[dict[str, Any]]:
    """What can be checked before any request: bad input exits 2 with one line."""
    duration = parse_duration(args.duration)
    if duration < MIN_DURATION:
        raise ConfigError(f"duration {args.duration!r} is below the API's 10 min minimum")
    args.seconds = int(duration)
    where = kubeconfig_path(args.kubeconfig)
    if not Path(where).is_file():
        raise ConfigError(f"no kubeconfig at {where}: pass --kubeconfig (an admin's)")
    return prepared(read_manifests(Path(args.rbac)), args.namespace, args.name)


async def run(args: argparse.Namespace, objects: list[dict[str, Any]]) -> str:
    """Does the work; returns the summary line."""
    account = service_account(objects)
    where = kubeconfig_path(args.kubeconfig)
    try:
        configuration, _, _ = await load_configuration(args.kubeconfig, args.context)
    except Exception as err:  # any loader failure is a configuration problem
        detail = logs.scrub(str(err)) or type(err).__name__
        raise ConfigError(f"cannot load Kubernetes credentials ({where}): {detail}") from err
    logs.register_secret(configuration.api_key.get("BearerToken"))
    admin = KubeClient(Credentials(configuration))
    try:
        await apply(
            admin,
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": args.namespace}},
            "",
        )
        for obj in objects:
            await apply(admin, obj, args.namespace)
            print(f"applied {obj['kind']} {obj['metadata']['name']}", flush=True)
        answer = await admin.request(
            "create",
            "POST",
            f"/api/v1/namespaces/{segment(args.namespace)}/serviceaccounts/{segment(account)}/token",
            body={
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": args.seconds},
            },
        )
    finally:
        await admin.close()
    status = answer.get("status") or {}
    token, expires = status.get("token"), status.get("expirationTimestamp")
    if not isinstance(token, str) or not token:
        raise KubeError(ErrorKind.TRANSIENT, "the TokenRequest answer holds no token")
    logs.register_secret(token)
    output = Path(args.output)
    try:
        text = yaml.safe_dump(kubeconfig_for(configuration, token, args.name))
    except OSError as err:
        raise ConfigError(f"cannot read the cluster's CA ({where}): {err}") from err
    namespaced = any(obj["kind"] == "Role" for obj in objects)
    with tempfile.TemporaryDirectory(prefix="canaryd-kubeconfig-") as scratch:
        trial = Path(scratch) / "kubeconfig"  # checked before it is written where asked
        write_private(trial, text)
        await check(trial, args.namespace if namespaced else None)
    try:
        write_private(output, text)
    except OSError as err:
        raise ConfigError(f"cannot write {output}: {err.strerror or err}") from err
    watch = f"; it may watch only {args.namespace}: set WATCH_NAMESPACES" if namespaced else ""
    return (
        f"wrote {output} (mode 0600): ServiceAccount {args.namespace}/{account}, token valid "
        f"until {expires} (renew it before then and restart canaryd){watch}"
    )


async def check(path: Path, namespace: str | None) -> None:
    """With the new kubeconfig: canaryd's first list is allowed (a new binding takes a
    moment to reach every API server), and reading secrets is not."""
    configuration, _, _ = await load_configuration(str(path), None)
    kube = KubeClient(Credentials(configuration))
    wanted = {"group": "flink.apache.org", "resource": "flinkdeployments", "verb": "list"}
    where = "in every namespace"
    if namespace is not None:
        wanted["namespace"], where = namespace, f"in {namespace}"
    try:
        deadline = time.monotonic() + 30
        while not await allowed(kube, wanted):
            if time.monotonic() > deadline:
                raise KubeError(
                    ErrorKind.FORBIDDEN,
                    f"after 30 s the new token still may not list flinkdeployments {where}",
                )
            await asyncio.sleep(0.5)
        if await allowed(kube, {"resource": "secrets", "verb": "list"}):
            raise ConfigError(
                "its ServiceAccount may list secrets, more than the RBAC manifests grant "
                "(another binding gives it more): no kubeconfig written"
            )
    finally:
        await kube.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m canaryd.kubeconfig",
        description="Write a least-privilege kubeconfig for canaryd: a ServiceAccount with "
        "config/rbac's roles (applied with your admin kubeconfig) and a token of it.",
    )
    parser.add_argument("--output", required=True, help="where to write it (mode 0600)")
    parser.add_argument(
        "--kubeconfig",
        default=None,
        help="an admin's kubeconfig (default: KUBECONFIG, else ~/.kube/config)",
    )
    parser.add_argument("--context", default=None, help="its context (default: current)")
    parser.add_argument(
        "--rbac",
        default="config/rbac",
        help="the RBAC manifests: config/rbac (all namespaces) or config/rbac/namespaced "
        "(then set WATCH_NAMESPACES to --namespace) (default: config/rbac)",
    )
    parser.add_argument(
        "--namespace", default="canaryd", help="the ServiceAccount's namespace (default: canaryd)"
    )
    parser.add_argument(
        "--name",
        default=BASE_NAME,
        help="the ServiceAccount's (and its roles') name (default: canaryd)",
    )
    parser.add_argument(
        "--duration", default="365 d", help="how long the token is valid (default: 365 d)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.kubeconfig is None and os.environ.get("KUBECONFIG"):
        args.kubeconfig = os.environ["KUBECONFIG"]
    logs.configure("console", "warning")
    try:
        objects = prepare(args)
        print(asyncio.run(run(args, objects)))
    except ConfigError as err:
        print(f"canaryd kubeconfig: {err}", file=sys.stderr)
        sys.exit(2)
    except KubeError as err:
        print(f"canaryd kubeconfig: {logs.scrub(str(err))}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
