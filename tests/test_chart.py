"""charts/canaryd: canaryd's own Helm chart, checked with the Helm that `make helm`
builds from its Go module (`make test` builds it when it is missing).

`helm lint --strict` for the default, HA, namespaced and monitoring values; `helm
template` rendered and compared with the kustomize manifests of config/ (kubectl's
kustomize, or tests/kubelet.py's where kubectl is absent): the same probes,
securityContext, args, env, resources and volumes in the Deployment, the same RBAC rules
bound to the release's service account, the same admission policy (its names derived
from the release, its operator service account a value), the same Lease Role and
PodDisruptionBudget with high availability, and the same monitoring objects.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kubelet import docs, render
from tests.test_packaging import operator_identity

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "canaryd"
CONFIG = ROOT / "config"
RELEASE, NAMESPACE = "canaryd", "canaryd"
MEASURED_RSS_MB = 111
"""The highest resident set of canaryd measured in a pod (MB): 87 MB at 1,000 canaries
and 108 MB at 10,000 in docs/PERFORMANCE.md, up to 111 MB in a pod for issue 33."""

ACCOUNT = "flink-operator/flink-operator"
"""The operator's service account as the README gives it (the operator's chart in the
namespace flink-operator, its account's default name), and config/standalone's."""
VALUES = {
    "default": [],
    "ha": ["highAvailability.enabled=true"],
    "namespaced": [f"watchNamespaces={{{NAMESPACE}}}"],
    "monitoring": ["serviceMonitor.enabled=true", "prometheusRule.enabled=true"],
}


def _pinned(gomod: Path, module: str) -> str:
    for line in gomod.read_text().splitlines():
        if line.startswith(f"require {module} "):
            return line.split()[2]
    raise AssertionError(f"{gomod} does not require {module}")


def helm_binary() -> Path:
    version = _pinned(ROOT / "tests" / "helm" / "go.mod", "helm.sh/helm/v3")
    binary = ROOT / ".cache" / "helm" / version / "bin" / "helm"
    assert binary.is_file(), f"{binary} is missing: run `make helm` (`make test` does)"
    return binary


@pytest.fixture(scope="module")
def helm() -> Path:
    return helm_binary()


def helm_run(
    helm: Path, *args: str, values: Sequence[str] = (), account: str | None = ACCOUNT
) -> subprocess.CompletedProcess[str]:
    """helm with ``args``, the operator's account given as the README gives it (None:
    not given), then ``values`` (``--set`` each)."""
    given = [f"admissionPolicy.operatorServiceAccount={account}"] if account else []
    return subprocess.run(
        [str(helm), *args] + [arg for value in (*given, *values) for arg in ("--set", value)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def template(helm: Path, *values: str, release: str = RELEASE, namespace: str = NAMESPACE):
    result = helm_run(
        helm, "template", release, str(CHART), "--namespace", namespace, values=values
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in found])
    return found[0]


def canaryd_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "canaryd"
    ]
    return container


def normalised(value: Any) -> Any:
    """YAML as the API server reads it: ports by name or number, strings as strings."""
    return yaml.safe_load(yaml.safe_dump(value))


@pytest.mark.parametrize("name", sorted(VALUES))
def test_helm_lint_passes(helm, name):
    result = helm_run(helm, "lint", "--strict", str(CHART), values=VALUES[name])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_every_value_is_documented():
    """values.yaml says what each of its top-level values does: a comment above each."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        if re.match(r"[a-zA-Z]\w*:", line):
            above = [a for a in lines[:i] if a.strip()][-1:] or [""]
            if not above[0].startswith("#"):
                undocumented.append(line.split(":")[0])
    assert not undocumented, undocumented


@pytest.mark.parametrize(
    ("values", "directory"),
    [([], "standalone"), (["highAvailability.enabled=true"], "standalone-ha")],
    ids=["default", "ha"],
)
def test_the_deployment_is_the_kustomize_manifests(helm, values, directory):
    chart = template(helm, *values)
    kustomized = render(CONFIG / directory)
    ours, theirs = one(chart, "Deployment"), one(kustomized, "Deployment")
    mine, wanted = canaryd_container(ours), canaryd_container(theirs)
    assert mine["image"] == wanted["image"] == "canaryd:0.1.0"
    for field in (
        "args",
        "ports",
        "livenessProbe",
        "readinessProbe",
        "resources",
        "securityContext",
        "volumeMounts",
    ):
        assert normalised(mine[field]) == normalised(wanted[field]), field
    lease_env = [e for e in mine["env"] if e["name"] == "CANARYD_LEASE_NAME"]
    by_name = sorted([e for e in mine["env"] if e["name"] != "CANARYD_LEASE_NAME"], key=str)
    assert by_name == sorted(wanted["env"], key=str)
    pod, their_pod = ours["spec"]["template"]["spec"], theirs["spec"]["template"]["spec"]
    for field in (
        "securityContext",
        "enableServiceLinks",
        "automountServiceAccountToken",
        "volumes",
        "terminationGracePeriodSeconds",
    ):
        assert pod.get(field) == their_pod.get(field), field
    assert ours["spec"]["replicas"] == theirs["spec"]["replicas"]
    assert ours["spec"]["strategy"] == theirs["spec"]["strategy"]
    selector = ours["spec"]["selector"]["matchLabels"]
    assert theirs["spec"]["selector"]["matchLabels"].items() <= selector.items()
    assert selector.items() <= ours["spec"]["template"]["metadata"]["labels"].items()
    account = one(chart, "ServiceAccount")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    if directory == "standalone-ha":
        (term,) = pod["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        (their_term,) = their_pod["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["weight"] == their_term["weight"]
        assert (
            term["podAffinityTerm"]["topologyKey"] == their_term["podAffinityTerm"]["topologyKey"]
        )
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == selector
        (lease,) = lease_env
        role = one(chart, "Role", f"{RELEASE}-leader-election")
        their_role = one(kustomized, "Role", "canaryd-leader-election")
        assert normalised(role["rules"]) == normalised(their_role["rules"])
        (named,) = [r for r in role["rules"] if "resourceNames" in r]
        assert named["resourceNames"] == [lease["value"]]
        budget, their_budget = (
            one(chart, "PodDisruptionBudget"),
            one(kustomized, "PodDisruptionBudget"),
        )
        assert budget["spec"]["minAvailable"] == their_budget["spec"]["minAvailable"]
        assert budget["spec"]["selector"]["matchLabels"] == selector
        binding = one(chart, "RoleBinding", role["metadata"]["name"])
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
        ]
    else:
        assert not lease_env and "affinity" not in pod
        assert not [o for o in chart if o["kind"] == "PodDisruptionBudget"]
        assert [o["metadata"]["name"] for o in chart if o["kind"] == "Role"] == [OPERATOR_ROLE]
    service, their_service = one(chart, "Service"), one(kustomized, "Service")
    assert service["spec"]["ports"] == their_service["spec"]["ports"]
    assert service["spec"]["selector"] == selector
    # Scraped when not Ready too: what the alerts read is said most then.
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert their_service["spec"]["publishNotReadyAddresses"] is True


def test_the_cluster_wide_rbac_is_config_rbac(helm):
    chart = template(helm)
    rbac = render(CONFIG / "rbac")
    role = one(chart, "ClusterRole")
    assert role["rules"] == one(rbac, "ClusterRole")["rules"]
    binding = one(chart, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    account = one(chart, "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    env = {e["name"] for e in canaryd_container(one(chart, "Deployment"))["env"]}
    assert "WATCH_NAMESPACES" not in env
    roles = [o for o in chart if o["kind"] in ("Role", "RoleBinding")]
    assert {o["metadata"]["name"] for o in roles} == {OPERATOR_ROLE}, "the account's only"


def test_the_namespaced_rbac_is_config_rbac_namespaced_in_each_watched_namespace(helm):
    chart = template(helm, "watchNamespaces={team-a,team-b}")
    rbac = render(CONFIG / "rbac" / "namespaced")
    account = one(chart, "ServiceAccount")["metadata"]["name"]
    subject = {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    roles = [o for o in chart if o["kind"] == "Role" and o["metadata"]["name"] != OPERATOR_ROLE]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert role["rules"] == one(rbac, "Role")["rules"]
        (binding,) = [
            o
            for o in chart
            if o["kind"] == "RoleBinding"
            and o["metadata"]["name"] == role["metadata"]["name"]
            and o["metadata"]["namespace"] == role["metadata"]["namespace"]
        ]
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"] == [subject]
    reader = one(chart, "ClusterRole")
    assert reader["rules"] == one(rbac, "ClusterRole")["rules"]
    assert one(chart, "ClusterRoleBinding")["subjects"] == [subject]
    env = canaryd_container(one(chart, "Deployment"))["env"]
    assert {"name": "WATCH_NAMESPACES", "value": "team-a,team-b"} in env
    without = template(helm, "watchNamespaces={team-a}", "rbac.namespaceReader=false")
    assert not [o for o in without if o["kind"].startswith("Cluster")]


OPERATOR_ROLE = f"{RELEASE}-{NAMESPACE}-operator-account"
"""The chart's Role that lets canaryd get the operator's service account."""


def the_account(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    """Where the operator's service account is given: what the policy names, what
    canaryd is told (CANARYD_OPERATOR_ACCOUNT), what its Role lets it get."""
    env = canaryd_container(one(objects, "Deployment"))["env"]
    rule = one(objects, "Role", role)["rules"]
    binding = one(objects, "RoleBinding", role)
    return {
        "policy": operator_identity(one(objects, "ValidatingAdmissionPolicy")),
        "canaryd": [e["value"] for e in env if e["name"] == "CANARYD_OPERATOR_ACCOUNT"],
        "role": [one(objects, "Role", role)["metadata"]["namespace"], rule],
        "binding": [binding["metadata"]["namespace"], binding["subjects"]],
    }


def wanted_account(namespace: str, name: str) -> dict[str, Any]:
    return {
        "policy": f"system:serviceaccount:{namespace}:{name}",
        "canaryd": [f"{namespace}/{name}"],
        "role": [
            namespace,
            [
                {
                    "apiGroups": [""],
                    "resources": ["serviceaccounts"],
                    "resourceNames": [name],
                    "verbs": ["get"],
                }
            ],
        ],
        "binding": [
            namespace,
            [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}],
        ],
    }


def test_the_chart_requires_the_operators_service_account(helm):
    """No default could be right (the release namespace is canaryd's own, not the
    operator's): without the account, or with one that is not NAMESPACE/NAME, nothing
    is rendered and the message says what to give."""
    for account in (None, "flink-operator", "Flink/op"):
        failed = helm_run(helm, "template", RELEASE, str(CHART), account=account)
        assert failed.returncode != 0 and failed.stdout == "", (account, failed.stdout)
        assert (
            "admissionPolicy.operatorServiceAccount: give the Flink operator's service account "
            "as NAMESPACE/NAME (its chart in the namespace flink-operator: --set "
            "admissionPolicy.operatorServiceAccount=flink-operator/flink-operator), or "
            "admissionPolicy.enabled=false"
        ) in failed.stderr, (account, failed.stderr)
    off = ["admissionPolicy.enabled=false"]
    without = helm_run(helm, "template", RELEASE, str(CHART), account=None, values=off)
    assert without.returncode == 0, without.stderr
    objects = [o for o in yaml.safe_load_all(without.stdout) if o]
    assert not [o for o in objects if o["kind"].startswith("ValidatingAdmissionPolicy")]
    assert not [o for o in objects if o["kind"] in ("Role", "RoleBinding")]
    env = canaryd_container(one(objects, "Deployment"))["env"]
    assert "CANARYD_OPERATOR_ACCOUNT" not in {e["name"] for e in env}


def test_the_admission_policy_is_config_admission_for_the_account_given(helm, tmp_path):
    """The chart and config/standalone render the same policy and binding, and give
    the operator's account the same way: canaryd's CANARYD_OPERATOR_ACCOUNT, from
    which the policy and the Role that lets canaryd get it are written."""
    kustomized = render(CONFIG / "standalone")
    chart = template(helm)
    policy = one(chart, "ValidatingAdmissionPolicy")
    assert policy["spec"] == one(kustomized, "ValidatingAdmissionPolicy")["spec"]
    binding = one(chart, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    their_binding = one(kustomized, "ValidatingAdmissionPolicyBinding")
    assert {**binding["spec"], "policyName": None} == {**their_binding["spec"], "policyName": None}
    wanted = wanted_account("flink-operator", "flink-operator")
    assert the_account(chart, OPERATOR_ROLE) == wanted
    assert the_account(kustomized, "canaryd-operator-account") == wanted
    # Another account, given each path's way: the chart's value; in kustomize, the
    # Deployment's CANARYD_OPERATOR_ACCOUNT in config/standalone (its replacements
    # run there: an overlay's patch of it would come after them).
    other = wanted_account("flink-system", "op")
    given = template(helm, "admissionPolicy.operatorServiceAccount=flink-system/op")
    assert the_account(given, OPERATOR_ROLE) == other
    copy = tmp_path / "config"
    for part in ("standalone", "rbac", "admission"):
        shutil.copytree(CONFIG / part, copy / part)
    deployment = copy / "standalone" / "deployment.yaml"
    text = deployment.read_text()
    assert text.count("value: flink-operator/flink-operator\n") == 1
    deployment.write_text(text.replace("flink-operator/flink-operator", "flink-system/op"))
    assert the_account(render(copy / "standalone"), "canaryd-operator-account") == other
    # Two releases (another name, or the same name in another namespace) do not collide.
    names = {
        one(template(helm, release=r, namespace=n), kind)["metadata"]["name"]
        for r, n in ((RELEASE, NAMESPACE), ("second", NAMESPACE), (RELEASE, "elsewhere"))
        for kind in ("ValidatingAdmissionPolicy",)
    }
    assert len(names) == 3, names


def test_cluster_scoped_names_differ_between_releases(helm):
    def names(release: str, namespace: str) -> set[str]:
        return {
            o["metadata"]["name"]
            for o in template(helm, release=release, namespace=namespace)
            if "namespace" not in o["metadata"] and o["kind"].startswith(("Cluster", "Validating"))
        }

    first, second, third = names("a", "x"), names("b", "x"), names("a", "y")
    assert first and not first & second and not first & third


def test_the_monitoring_objects_are_config_monitoring(helm):
    assert not [o for o in template(helm) if o["kind"] in ("ServiceMonitor", "PrometheusRule")], (
        "off by default: they need Prometheus Operator's CRDs"
    )
    chart = template(helm, *VALUES["monitoring"])
    monitor, theirs = (
        one(chart, "ServiceMonitor"),
        docs(CONFIG / "monitoring" / "servicemonitor.yaml")[0],
    )
    assert monitor["spec"]["endpoints"] == theirs["spec"]["endpoints"]
    service = one(chart, "Service")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert {p["name"] for p in service["spec"]["ports"]} >= {
        monitor["spec"]["endpoints"][0]["port"]
    }
    rule = one(chart, "PrometheusRule")
    their_rule = docs(CONFIG / "monitoring" / "prometheusrule.yaml")[0]
    assert rule["spec"] == their_rule["spec"]
    # The runbook's default address is config/monitoring's (runbook.yaml).
    runbook = docs(CONFIG / "monitoring" / "runbook.yaml")[0]["data"]["baseURL"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["prometheusRule"]["runbookBaseURL"] == runbook
    based = one(
        template(
            helm,
            *VALUES["monitoring"],
            "prometheusRule.runbookBaseURL=https://git.example/canaryd/blob/v0.1.0/",
        ),
        "PrometheusRule",
    )
    urls = [
        r["annotations"]["runbook_url"]
        for g in based["spec"]["groups"]
        for r in g["rules"]
        if "alert" in r
    ]
    assert urls and all(
        u.startswith("https://git.example/canaryd/blob/v0.1.0/docs/OPERATIONS.md#") for u in urls
    ), urls


def test_helm_test_runs_canaryd_check_as_the_daemon_runs(helm):
    for values in ([], ["highAvailability.enabled=true"], ["watchNamespaces={team-a}"]):
        chart = template(helm, *values)
        pod = one(chart, "Pod")
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        deployment = one(chart, "Deployment")
        daemon = canaryd_container(deployment)
        (check,) = pod["spec"]["containers"]
        assert check["image"] == daemon["image"]
        assert check["args"] == ["check", *daemon["args"]]
        assert check["env"] == daemon["env"]
        assert (
            pod["spec"]["serviceAccountName"]
            == (deployment["spec"]["template"]["spec"]["serviceAccountName"])
        )
        assert pod["spec"]["restartPolicy"] == "Never"


def test_the_chart_passes_canaryds_flags_it_would_accept(helm):
    """The args and env the chart renders are a configuration canaryd accepts."""
    from canaryd.config import load_settings

    chart = template(
        helm,
        "highAvailability.enabled=true",
        "watchNamespaces={team-a,team-b}",
        "timeout=30 s",
        "port=9000",
        "logLevel=warn",
        "reconciledBy=observed-generation",
        "kinds={flinkdeployments}",
    )
    container = canaryd_container(one(chart, "Deployment"))
    environ = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    environ["CANARYD_IDENTITY"] = "canaryd-0"
    settings = load_settings(container["args"], environ)
    assert settings.leader_elect and settings.timeout == 30.0 and settings.port == 9000
    assert settings.lease_name == "canaryd" and settings.log_level == "warning"
    assert sorted(settings.namespaces or []) == ["team-a", "team-b"]
    assert settings.reconciled_by == "observed-generation"
    assert container["ports"] == [{"name": "http", "containerPort": 9000}]


def canaryd_containers_shipped(helm: Path) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for directory in ("standalone", "standalone-ha", "sidecar-example"):
        for obj in render(CONFIG / directory):
            if obj["kind"] == "Deployment":
                found += [
                    (f"config/{directory}", c)
                    for c in obj["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "canaryd"
                ]
    patch = yaml.safe_load((CONFIG / "sidecar" / "operator-patch.yaml").read_text())
    found.append(("config/sidecar", canaryd_container(patch)))
    for name, values in VALUES.items():
        found.append(
            (f"chart {name}", canaryd_container(one(template(helm, *values), "Deployment")))
        )
    return found


def _mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "M": 1e6 / 2**20, "G": 1e9 / 2**20}
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", quantity).groups()  # type: ignore[union-attr]
    return float(number) * units.get(unit, 1 / 2**20)


def test_every_shipped_canaryd_requests_the_memory_it_was_measured_to_use(helm):
    """The request covers the highest resident set measured; the limit leaves room."""
    measured_mib = MEASURED_RSS_MB * 1e6 / 2**20
    for where, container in canaryd_containers_shipped(helm):
        resources = container["resources"]
        request = _mebibytes(resources["requests"]["memory"])
        limit = _mebibytes(resources["limits"]["memory"])
        assert request >= measured_mib, (where, resources)
        assert limit >= 1.5 * measured_mib, (where, resources)
        assert resources["requests"]["cpu"] and resources["limits"]["cpu"], where


def test_the_release_objects_are_namespaced_by_helm(helm):
    """No object names a namespace of its own but the RBAC of watched namespaces and of
    the operator's account (in its namespace): helm installs the rest into the release
    namespace."""
    for obj in template(helm, "highAvailability.enabled=true"):
        if obj["metadata"]["name"] == OPERATOR_ROLE:
            assert obj["metadata"]["namespace"] == "flink-operator", obj["metadata"]
            continue
        assert "namespace" not in obj["metadata"], (obj["kind"], obj["metadata"])
