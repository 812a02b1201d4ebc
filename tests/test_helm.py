"""The Helm path: the operator's real chart through config/helm/post-render, checked by
a real kube-apiserver.

``make e2e-operator`` runs it: Helm and kustomize built from their Go modules (``make
helm``: tests/helm, pinned in go.mod there), the chart from the operator's own
repository (``make operator`` copies it to .cache/operator/<ref>/helm), the control
plane of ``make e2e``. The chart is rendered with ``helm template --post-renderer``,
with and without its webhook, and every object it renders is sent to the API server
with ``dryRun=All`` and strict field validation (what ``kubectl apply --dry-run=server``
does): the API server defaults, validates and admits each one, and stores nothing.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_packaging import operator_identity

ROOT = Path(__file__).resolve().parent.parent
POST_RENDER = ROOT / "config" / "helm" / "post-render"
SIDECAR_PATCH = ROOT / "config" / "sidecar" / "operator-patch.yaml"
HELM_VALUES = ROOT / "config" / "sidecar" / "helm-values.yaml"
"""The sidecar's values for the chart (the operator's Prometheus reporter), as the
README's install passes them."""
OPERATOR_REF = os.environ.get("FLINK_OPERATOR_REF", "release-1.15.0")
FLINK_VERSION = os.environ.get("FLINK_VERSION", "1.20.0")
RELEASE_NAMESPACE = "flink-operator"
IMAGE = "registry.example.com:5000/team/canaryd:9.9.9"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("CANARYD_E2E") != "operator",
        reason="make e2e-operator runs these (Helm, the operator's chart, the control plane)",
    ),
    pytest.mark.timeout(300),
]


def _pinned(gomod: Path, module: str) -> str:
    for line in gomod.read_text().splitlines():
        if line.startswith(f"require {module} "):
            return line.split()[2]
    raise AssertionError(f"{gomod} does not require {module}")


def _built(kind: str, gomod: Path, module: str) -> Path:
    binary = ROOT / ".cache" / kind / _pinned(gomod, module) / "bin" / kind
    assert binary.is_file(), f"{binary} is missing: run `make helm` (make e2e-operator does)"
    return binary


@pytest.fixture(scope="module")
def helm() -> Path:
    return _built("helm", ROOT / "tests" / "helm" / "go.mod", "helm.sh/helm/v3")


@pytest.fixture(scope="module")
def kustomize() -> Path:
    gomod = ROOT / "tests" / "helm" / "kustomize" / "go.mod"
    return _built("kustomize", gomod, "sigs.k8s.io/kustomize/kustomize/v5")


@pytest.fixture(scope="module")
def chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The operator's chart as `make operator` copies it; before that build, from
    FLINK_OPERATOR_SRC when it is a local git directory (the chart at FLINK_OPERATOR_REF:
    rendering needs no operator build)."""
    path = ROOT / ".cache" / "operator" / f"{OPERATOR_REF}-flink{FLINK_VERSION}" / "helm"
    path /= "flink-kubernetes-operator"
    source = os.environ.get("FLINK_OPERATOR_SRC", "")
    if not (path / "Chart.yaml").is_file() and source and Path(source).is_dir():
        out = tmp_path_factory.mktemp("operator-chart")
        archive = subprocess.run(
            ["git", "-C", source, "archive", OPERATOR_REF, "helm/flink-kubernetes-operator"],
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive, timeout=60, check=True)
        path = out / "helm" / "flink-kubernetes-operator"
    assert (path / "Chart.yaml").is_file(), (
        f"{path} is missing: run `make operator FLINK_OPERATOR_SRC=...` (it copies the chart)"
    )
    return path


@pytest.fixture(scope="module")
def plane(chart: Path) -> Iterator[Any]:
    """The control plane with the chart's own CRDs (they replace the launcher's stand-ins)
    and, for the chart's webhook, cert-manager's two kinds as schemaless stand-ins: the
    dry run checks the chart's objects, not cert-manager's schemas."""
    from tests.controlplane.launcher import ControlPlane, namespace_object

    running = ControlPlane()
    running.start()
    try:
        for path in sorted((chart / "crds").glob("*.yml")):
            for crd in yaml.safe_load_all(path.read_text()):
                if crd:
                    _create_or_replace(running, crd)
        for kind in ("Certificate", "Issuer"):
            _create_or_replace(running, _stand_in_crd("cert-manager.io", "v1", kind))
        running.apply(namespace_object(RELEASE_NAMESPACE))
        yield running
    finally:
        running.stop()


def _create_or_replace(plane: Any, crd: dict[str, Any]) -> None:
    base = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    status, body = plane.request("POST", base, crd)
    if status == 409:
        path = f"{base}/{crd['metadata']['name']}"
        _, current = plane.request("GET", path)
        crd = {**crd, "metadata": {**crd["metadata"], **_rv(current)}}
        status, body = plane.request("PUT", path, crd)
    assert status in (200, 201), f"CRD {crd['metadata']['name']}: {status} {body}"
    name = crd["metadata"]["name"]

    def established() -> bool:
        _, got = plane.request("GET", f"{base}/{name}")
        conditions = (got or {}).get("status", {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    plane._wait(f"CRD {name}", established)


def _rv(obj: dict[str, Any]) -> dict[str, str]:
    return {"resourceVersion": obj["metadata"]["resourceVersion"]}


def _stand_in_crd(group: str, version: str, kind: str) -> dict[str, Any]:
    plural = kind.lower() + "s"
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
            "versions": [
                {
                    "name": version,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


def render(helm: Path, chart: Path, *values: str, env: dict[str, str]) -> list[dict[str, Any]]:
    """``helm template`` of the chart through the post-renderer, as a user runs it."""
    result = subprocess.run(
        [
            str(helm),
            "template",
            "flink-kubernetes-operator",
            str(chart),
            "--namespace",
            RELEASE_NAMESPACE,
            "--post-renderer",
            str(POST_RENDER),
            "--values",
            str(HELM_VALUES),
            *(arg for value in values for arg in ("--set", value)),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "CANARYD_IMAGE": IMAGE, **env},
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


class Discovery:
    """Collection paths by apiVersion and kind, from the API server's discovery."""

    def __init__(self, plane: Any) -> None:
        self.plane = plane
        self._known: dict[tuple[str, str], tuple[str, bool]] = {}

    def path(self, obj: dict[str, Any]) -> str:
        api_version, kind = obj["apiVersion"], obj["kind"]
        if (api_version, kind) not in self._known:
            prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            status, body = self.plane.request("GET", prefix)
            assert status == 200, f"discovery of {api_version}: {status} {body}"
            for resource in body["resources"]:
                if "/" not in resource["name"]:
                    self._known[(api_version, resource["kind"])] = (
                        f"{prefix}/{resource['name']}",
                        resource["namespaced"],
                    )
        collection, namespaced = self._known[(api_version, kind)]
        if not namespaced:
            return collection
        namespace = obj["metadata"].get("namespace", RELEASE_NAMESPACE)
        prefix, plural = collection.rsplit("/", 1)
        return f"{prefix}/namespaces/{namespace}/{plural}"


def dry_run(plane: Any, docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every object created with dryRun=All and strict field validation; returns the API
    server's answers (defaulted, validated, admitted, not stored) by kind/name, and
    fails naming every object it refused."""
    discovery = Discovery(plane)
    answers, refused = {}, []
    for doc in docs:
        path = discovery.path(doc) + "?dryRun=All&fieldValidation=Strict"
        status, body = plane.request("POST", path, doc)
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if status != 201:
            refused.append(f"{name}: {status} {(body or {}).get('message')}")
        answers[name] = body
    assert not refused, "the API server refused:\n" + "\n".join(refused)
    stored = plane.request("GET", f"/apis/apps/v1/namespaces/{RELEASE_NAMESPACE}/deployments")
    assert stored[0] == 200 and stored[1]["items"] == [], "a dry run stored something"
    return answers


def containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def sidecar_container() -> dict[str, Any]:
    patch = yaml.safe_load(SIDECAR_PATCH.read_text())
    (canaryd,) = [
        c for c in patch["spec"]["template"]["spec"]["containers"] if c["name"] == "canaryd"
    ]
    return canaryd


def check_sidecar(deployment: dict[str, Any], chart_containers: set[str]) -> None:
    """config/sidecar as it is in this checkout, on the chart's Deployment."""
    found = containers(deployment)
    assert set(found) == chart_containers | {"canaryd"}, sorted(found)
    canaryd = found["canaryd"]
    assert canaryd["image"] == IMAGE
    wanted = sidecar_container()
    for field, value in wanted.items():
        if field != "image":
            assert _contains(canaryd[field], value), (field, canaryd[field], value)
    (port,) = [p["containerPort"] for p in canaryd["ports"] if p["name"] == "canaryd"]
    operator = found["flink-kubernetes-operator"]
    # The operator's liveness is canaryd's verdict (an exec probe of bash's /dev/tcp:
    # no answer passes), not the chart's httpGet; its startup probe is the chart's.
    assert "httpGet" not in operator["livenessProbe"]
    assert f"/dev/tcp/127.0.0.1/{port}" in operator["livenessProbe"]["exec"]["command"][2]
    assert operator["startupProbe"]["httpGet"]["port"] == "health-port"
    # canaryd reads the operator's config from the volume the operator mounts.
    mounts = {m["name"]: m["mountPath"] for m in operator["volumeMounts"]}
    canaryd_mounts = {m["name"]: m["mountPath"] for m in canaryd["volumeMounts"]}
    config = "flink-operator-config-volume"
    assert canaryd_mounts[config] == mounts[config] == "/opt/flink/conf"
    assert "readinessProbe" not in canaryd


def _contains(got: Any, wanted: Any) -> bool:
    """Everything in ``wanted`` is in ``got`` (the API server adds defaults)."""
    if isinstance(wanted, dict):
        return isinstance(got, dict) and all(
            k in got and _contains(got[k], v) for k, v in wanted.items()
        )
    if isinstance(wanted, list):
        return (
            isinstance(got, list)
            and len(got) == len(wanted)
            and all(_contains(g, w) for g, w in zip(got, wanted, strict=True))
        )
    return bool(got == wanted)


def kustomizers(kustomize: Path) -> list[tuple[str, dict[str, str]]]:
    """How the post-renderer finds kustomize: the pinned build, and kubectl's own
    (``kubectl kustomize``) where kubectl is installed."""
    found = [("kustomize", {"KUSTOMIZE": str(kustomize)})]
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        found.append(("kubectl", {"KUSTOMIZE": kubectl}))
    return found


@pytest.mark.parametrize(
    ("webhook", "chart_containers"),
    [
        (False, {"flink-kubernetes-operator"}),
        (True, {"flink-kubernetes-operator", "flink-webhook"}),
    ],
    ids=["webhook-off", "webhook-on"],
)
def test_the_chart_through_the_post_renderer_passes_a_server_side_dry_run(
    helm, kustomize, chart, plane, webhook, chart_containers
):
    values = [f"webhook.create={str(webhook).lower()}"]
    plain = subprocess.run(
        [
            str(helm),
            "template",
            "flink-kubernetes-operator",
            str(chart),
            "--namespace",
            RELEASE_NAMESPACE,
            "--values",
            str(HELM_VALUES),
            *(a for v in values for a in ("--set", v)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    unchanged = [doc for doc in yaml.safe_load_all(plain) if doc]
    for how, env in kustomizers(kustomize):
        docs = render(helm, chart, *values, env=env)
        # The post-renderer adds the sidecar and config/admission's policy for the
        # operator's service account as the chart renders it, and changes nothing else.
        assert _names(docs) == sorted(_names(unchanged) + ADDED), how
        (policy,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
        (account,) = [
            d
            for d in unchanged
            if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "flink-operator"
        ]
        assert operator_identity(policy) == (
            f"system:serviceaccount:{RELEASE_NAMESPACE}:{account['metadata']['name']}"
        ), how
        docs_without_policy = [d for d in docs if (d["kind"], d["metadata"]["name"]) not in ADDED]
        (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
        check_sidecar(deployment, chart_containers)
        (original,) = [d for d in unchanged if d["kind"] == "Deployment"]
        assert _without_sidecar(deployment) == _without_sidecar(original), how
        for doc, before in zip(_sorted(docs_without_policy), _sorted(unchanged), strict=True):
            if doc["kind"] != "Deployment":
                assert doc == _without_nulls(before), (how, doc["kind"], doc["metadata"]["name"])
        answers = dry_run(plane, docs)
        admitted = answers["Deployment/flink-kubernetes-operator"]
        check_sidecar(admitted, chart_containers)
        webhook_kinds = {"MutatingWebhookConfiguration", "Certificate"}
        assert (webhook_kinds <= {d["kind"] for d in docs}) is webhook, how
        print(f"{how}, webhook {'on' if webhook else 'off'}: {len(docs)} objects admitted")


ADDED = [
    ("ConfigMap", "canaryd-operator-conf-override"),
    ("ValidatingAdmissionPolicy", "canaryd-keep-canary-metadata"),
    ("ValidatingAdmissionPolicyBinding", "canaryd-keep-canary-metadata"),
]
"""What config/sidecar adds beside the chart's objects: the operator's reporter (its
CONF_OVERRIDE_DIR) and config/admission's policy."""


def _names(docs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return sorted((d["kind"], d["metadata"]["name"]) for d in docs)


def _sorted(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(docs, key=lambda d: (d["kind"], d["metadata"]["name"]))


def _without_sidecar(deployment: dict[str, Any]) -> dict[str, Any]:
    """The Deployment less what config/sidecar adds or changes."""
    stripped = copy.deepcopy(deployment)
    pod = stripped["spec"]["template"]["spec"]
    pod["containers"] = [c for c in pod["containers"] if c["name"] != "canaryd"]
    for container in pod["containers"]:
        if container["name"] == "flink-kubernetes-operator":
            container.pop("livenessProbe", None)
            container["env"] = [e for e in container["env"] if e["name"] != "CONF_OVERRIDE_DIR"]
            container["volumeMounts"] = [
                m
                for m in container["volumeMounts"]
                if m["name"] != "canaryd-operator-conf-override"
            ]
    added = {
        v["name"]
        for v in yaml.safe_load(SIDECAR_PATCH.read_text())["spec"]["template"]["spec"].get(
            "volumes", []
        )
    }
    pod["volumes"] = [v for v in pod.get("volumes", []) if v["name"] not in added]
    return _without_nulls(stripped)


def _without_nulls(value: Any) -> Any:
    """kustomize drops keys whose value is null (the chart's ``value:`` of an empty
    JVM_ARGS): the same object to the API server."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def test_a_chart_whose_deployment_has_another_name_is_refused(helm, kustomize, chart):
    """nameOverride renames the operator's Deployment: no patch target matches, and
    kustomize says nothing. The post-renderer says it, and Helm stops."""
    result = subprocess.run(
        [
            str(helm),
            "template",
            "flink-kubernetes-operator",
            str(chart),
            "--namespace",
            RELEASE_NAMESPACE,
            "--set",
            "nameOverride=renamed",
            "--post-renderer",
            str(POST_RENDER),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "KUSTOMIZE": str(kustomize), "CANARYD_IMAGE": IMAGE},
    )
    assert result.returncode != 0
    assert "canaryd was not added" in result.stderr, result.stderr


# ------------------------------------------------------------------- GitOps

OPERATIONS = ROOT / "docs" / "OPERATIONS.md"
REMOTE = re.compile(r"https://github\.com/ORG/canaryd//config/sidecar\?ref=(v[0-9.]+)")


def gitops_kustomization() -> dict[str, Any]:
    """The kustomization docs/OPERATIONS.md gives for GitOps, as written there."""
    text = OPERATIONS.read_text()
    block = text.split("```yaml\n# kustomization.yaml\n", 1)[1].split("```", 1)[0]
    spec: dict[str, Any] = yaml.safe_load(block)
    return spec


def canaryd_remote(tmp_path: Path, ref: str) -> Path:
    """A git repository holding this checkout's config/sidecar and config/admission,
    tagged ``ref``: what kustomize fetches for ``//config/sidecar?ref=``, as it fetches
    canaryd's repository from its host."""
    repo = tmp_path / "canaryd.git"
    for part in ("sidecar", "admission"):
        shutil.copytree(ROOT / "config" / part, repo / "config" / part)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for args in (
        ["init", "-q", "-b", "main"],
        ["add", "-A"],
        ["commit", "-q", "-m", "canaryd"],
        ["tag", ref],
    ):
        subprocess.run(git + args, capture_output=True, timeout=60, check=True)
    return repo


def gitops_render(
    helm: Path, kustomize: Path, chart: Path, tmp_path: Path, values: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """``kustomize build --enable-helm`` of the documented kustomization, as Argo CD runs
    it: the chart from a chart home instead of its repository (no network here), the
    component from a git repository at the documented ref."""
    spec = gitops_kustomization()
    (entry,) = spec["helmCharts"]
    assert (
        entry["repo"]
        == f"https://downloads.apache.org/flink/flink-kubernetes-operator-{entry['version']}/"
    )
    assert f"release-{entry['version']}" == OPERATOR_REF
    (component,) = spec["components"]
    match = REMOTE.fullmatch(component)
    assert match, component
    ref = match.group(1)
    from canaryd import __version__

    assert ref == f"v{__version__}", "the documented ref is this version's tag"
    app = tmp_path / "app"
    shutil.copytree(chart, app / "charts" / entry["name"])
    entry = {k: v for k, v in entry.items() if k not in ("repo", "version")}
    if values is not None:
        entry["valuesInline"] = {**entry["valuesInline"], **values}
    remote = canaryd_remote(tmp_path, ref)
    spec = {
        **spec,
        "helmGlobals": {"chartHome": "charts"},
        "helmCharts": [entry],
        "components": [f"file://{remote}//config/sidecar?ref={ref}"],
    }
    (app / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    result = subprocess.run(
        [str(kustomize), "build", "--enable-helm", "--helm-command", str(helm), str(app)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def flink_conf(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (config,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
    parsed: dict[str, Any] = yaml.safe_load(config["data"]["flink-conf.yaml"]) or {}
    return parsed


def test_the_sidecar_as_a_remote_component_beside_the_chart_rendered_by_kustomize(
    helm, kustomize, chart, plane, tmp_path
):
    """docs/OPERATIONS.md's GitOps kustomization: the operator's own chart through
    kustomize's helmCharts, config/sidecar as a remote component at canaryd's tag. The
    same objects as the post-renderer renders from the same values; the chart's
    ConfigMap as the values make it; the reporter on through the override; a real API
    server admits it all."""
    docs = gitops_render(helm, kustomize, chart, tmp_path / "documented")
    objects = [d for d in docs if d["kind"] != "CustomResourceDefinition"]
    assert len(objects) < len(docs), "includeCRDs: the chart's CRDs come along"
    image = "REGISTRY/canaryd:0.1.0"
    (deployment,) = [d for d in objects if d["kind"] == "Deployment"]
    assert containers(deployment)["canaryd"]["image"] == image
    # What the post-renderer makes of the same chart and the same values.
    post_rendered = render(helm, chart, "webhook.create=false", env={"CANARYD_IMAGE": image})
    assert _sorted([_without_nulls(d) for d in objects]) == _sorted(
        [_without_nulls(d) for d in post_rendered]
    )
    check_sidecar(
        {**deployment, "spec": _with_image(deployment["spec"], IMAGE)},
        {"flink-kubernetes-operator"},
    )
    operator = containers(deployment)["flink-kubernetes-operator"]
    env = {e["name"]: e.get("value") for e in operator["env"]}
    mounts = {m["name"]: m["mountPath"] for m in operator["volumeMounts"]}
    assert mounts["canaryd-operator-conf-override"] == env["CONF_OVERRIDE_DIR"]
    assert {"FLINK_CONF_DIR", "JVM_ARGS"} <= set(env), "the chart's own env is kept"
    (override,) = [d for d in objects if d["metadata"]["name"] == "canaryd-operator-conf-override"]
    assert override["metadata"]["namespace"] == RELEASE_NAMESPACE
    # The chart's ConfigMap is the chart's: nothing of canaryd's in it or instead of it.
    plain = subprocess.run(
        [
            str(helm),
            "template",
            "flink-kubernetes-operator",
            str(chart),
            "--namespace",
            RELEASE_NAMESPACE,
            "--set",
            "webhook.create=false",
            "--set",
            "metrics.port=9249",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    (chart_config,) = [
        d
        for d in yaml.safe_load_all(plain)
        if d and d["kind"] == "ConfigMap" and d["metadata"]["name"] == "flink-operator-config"
    ]
    (config,) = [
        d
        for d in objects
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "flink-operator-config"
    ]
    assert config == _without_nulls(chart_config)
    answers = dry_run(plane, objects)
    check_sidecar(
        {
            **answers["Deployment/flink-kubernetes-operator"],
            "spec": _with_image(answers["Deployment/flink-kubernetes-operator"]["spec"], IMAGE),
        },
        {"flink-kubernetes-operator"},
    )
    print(f"GitOps: {len(objects)} objects and {len(docs) - len(objects)} CRDs admitted")


def test_a_users_own_operator_configuration_is_kept_beside_the_reporter(
    helm, kustomize, chart, tmp_path
):
    """Values to merge: the user's own defaultConfiguration."flink-conf.yaml" stays what
    the user wrote, and the operator's effective configuration (its file, then the
    override directory's keys over it) has both the user's keys and the reporter."""
    own = (
        "kubernetes.operator.reconcile.interval: 30 s\n"
        "kubernetes.operator.reconcile.parallelism: 7\n"
    )
    docs = gitops_render(
        helm, kustomize, chart, tmp_path, values={"defaultConfiguration": {"flink-conf.yaml": own}}
    )
    main = flink_conf(docs, "flink-operator-config")
    assert main["kubernetes.operator.reconcile.interval"] == "30 s"
    assert main["kubernetes.operator.reconcile.parallelism"] == 7
    effective = {**main, **flink_conf(docs, "canaryd-operator-conf-override")}
    assert effective["kubernetes.operator.reconcile.parallelism"] == 7
    assert effective["kubernetes.operator.metrics.reporter.prom.factory.class"].endswith(
        "PrometheusReporterFactory"
    )
    # canaryd reads the chart's file (its mount of the operator's conf): the reporter's
    # port there is canaryd's default, the one the override sets.
    from canaryd.config import load_settings

    conf = tmp_path / "conf"
    conf.mkdir()
    (config,) = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "flink-operator-config"
    ]
    (conf / "flink-conf.yaml").write_text(config["data"]["flink-conf.yaml"])
    settings = load_settings(["--operator-config", str(conf)], {})
    port = effective["kubernetes.operator.metrics.reporter.prom.port"]
    assert settings.operator_metrics_url == f"http://127.0.0.1:{port}/metrics"


def _with_image(spec: dict[str, Any], image: str) -> dict[str, Any]:
    """The pod spec with canaryd's image set to ``image`` (check_sidecar's)."""
    spec = copy.deepcopy(spec)
    for container in spec["template"]["spec"]["containers"]:
        if container["name"] == "canaryd":
            container["image"] = image
    return spec
