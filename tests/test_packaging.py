"""The ways canaryd is run: the container image, the Kubernetes manifests, the wheel.

No Docker engine runs here: the Dockerfile is checked as text, and the wheel it
installs is installed into a fresh venv and run, which is what the image does.
Kustomizations are built with `kubectl kustomize` where kubectl exists.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

import pytest
import yaml

from canaryd import __version__
from canaryd.config import Settings, build_parser, load_settings
from tests.kubelet import KUBECTL, docs, kustomize, render

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config"
DEFAULTS = Settings()
KUSTOMIZATIONS = sorted(p.parent for p in CONFIG.rglob("kustomization.yaml"))
BUILDABLE = [
    d
    for d in KUSTOMIZATIONS
    if yaml.safe_load((d / "kustomization.yaml").read_text())["kind"] == "Kustomization"
]


def all_docs(kind: str | None = None) -> list[dict[str, Any]]:
    found = [d for p in sorted(CONFIG.rglob("*.yaml")) for d in docs(p)]
    return [d for d in found if kind is None or d.get("kind") == kind]


def built(directory: Path) -> list[dict[str, Any]]:
    """The kustomization's output: kubectl's when present, else tests/kubelet.py's own
    rendering (which test_the_fallback_rendering_is_kubectls checks against kubectl)."""
    return render(directory)


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    found: dict[str, Any] = next(c for c in containers if c["name"] == name)
    return found


def flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
        if arg == flag:
            return args[i + 1]
    return None


# --------------------------------------------------------------------- YAML


NOT_OBJECTS = {
    CONFIG / "monitoring" / "alerts-test.yaml",  # promtool's unit tests
    CONFIG / "sidecar" / "helm-values.yaml",  # values for the operator's Helm chart
}


def test_every_yaml_file_parses():
    files = sorted(CONFIG.rglob("*.yaml"))
    assert len(files) >= 20
    for path in NOT_OBJECTS:
        assert isinstance(yaml.safe_load(path.read_text()), dict), path
    for path in (f for f in files if f not in NOT_OBJECTS):
        for doc in docs(path):
            assert isinstance(doc, dict) and "kind" in doc, path


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: str(d.relative_to(CONFIG)))
def test_every_kustomization_names_files_that_exist(directory):
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    named = list(spec.get("resources", [])) + list(spec.get("components", []))
    named += [p["path"] for p in spec.get("patches", []) if "path" in p]
    assert named
    for entry in named:
        target = directory / entry
        assert target.is_file() or (target / "kustomization.yaml").is_file(), target


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")
@pytest.mark.parametrize("directory", BUILDABLE, ids=lambda d: str(d.relative_to(CONFIG)))
def test_every_kustomization_builds(directory):
    assert built(directory)


def _normalised(obj: Any) -> Any:
    """Key order, and the order of named list items (a strategic merge's), aside."""
    if isinstance(obj, dict):
        return {key: _normalised(value) for key, value in sorted(obj.items())}
    if isinstance(obj, list):
        items = [_normalised(item) for item in obj]
        if all(isinstance(item, dict) and "name" in item for item in items):
            return sorted(items, key=lambda item: item["name"])
        return items
    return obj


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")
@pytest.mark.parametrize("directory", BUILDABLE, ids=lambda d: str(d.relative_to(CONFIG)))
def test_the_fallback_rendering_is_kubectls(directory):
    """Without kubectl (CI may lack it), tests/kubelet.py renders the kustomizations
    itself; here, where kubectl is, both must give the same objects."""

    def key(obj: dict[str, Any]) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    ours = sorted((_normalised(o) for o in kustomize(directory)), key=key)
    kubectls = sorted((_normalised(o) for o in render(directory)), key=key)
    assert ours == kubectls


def test_rbac_grants_exactly_what_canaryd_uses():
    expected = {
        ("flink.apache.org", "flinkdeployments"): {"get", "list", "watch", "patch"},
        ("flink.apache.org", "flinksessionjobs"): {"get", "list", "watch", "patch"},
        ("", "namespaces"): {"list", "watch"},  # the Namespaces watch; no single get
        ("events.k8s.io", "events"): {"create", "patch"},  # canaryd.events
    }
    for variant in (CONFIG / "rbac", CONFIG / "rbac" / "namespaced"):
        granted: dict[tuple[str, str], set[str]] = {}
        for doc in built(variant):
            if doc["kind"] in ("Role", "ClusterRole"):
                for rule in doc["rules"]:
                    for group in rule["apiGroups"]:
                        for resource in rule["resources"]:
                            granted.setdefault((group, resource), set()).update(rule["verbs"])
        assert granted == expected, variant


def test_role_bindings_bind_the_service_account_they_ship():
    built_docs = built(CONFIG / "standalone")
    account = next(d for d in built_docs if d["kind"] == "ServiceAccount")
    for binding in (d for d in built_docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        assert binding["subjects"] == [
            {
                "kind": "ServiceAccount",
                "name": "canaryd",
                "namespace": account["metadata"].get("namespace", "canaryd"),
            }
        ]


# --------------------------------------------------------------- standalone


def test_standalone_deployment_probes_match_the_daemons_defaults():
    deployment = next(d for d in built(CONFIG / "standalone") if d["kind"] == "Deployment")
    canaryd = container(deployment, "canaryd")
    port = next(p for p in canaryd["ports"] if p["name"] == "http")["containerPort"]
    assert port == DEFAULTS.port
    # Liveness is canaryd's own process: a verdict never restarts the monitor.
    assert canaryd["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert canaryd["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert set(canaryd["resources"]) == {"requests", "limits"}
    security = canaryd["securityContext"]
    assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["seccompProfile"]["type"] == "RuntimeDefault"
    assert {m["mountPath"] for m in canaryd["volumeMounts"]} == {"/tmp"}
    build_parser().parse_args(canaryd.get("args", []))  # every flag exists


@pytest.mark.parametrize("directory", BUILDABLE, ids=lambda d: str(d.relative_to(CONFIG)))
def test_no_service_link_sets_canaryds_port(directory):
    """The kubelet sets CANARYD_PORT=tcp://IP:PORT in every pod of a namespace with a
    Service named canaryd (config/standalone ships one), which canaryd would read as
    its port and exit 2: every canaryd container runs in a pod without service links,
    or is given --port, which wins over the environment."""
    for pod in (
        d["spec"]["template"]["spec"] for d in built(directory) if d["kind"] == "Deployment"
    ):
        for canaryd in (c for c in pod["containers"] if c["name"] == "canaryd"):
            given = flag_value(canaryd.get("args", []), "--port") is not None
            assert pod.get("enableServiceLinks") is False or given, directory


# ------------------------------------------------------------------ sidecar


def test_sidecar_points_the_operator_liveness_at_canaryd():
    deployment = next(d for d in built(CONFIG / "sidecar-example") if d["kind"] == "Deployment")
    operator = container(deployment, "flink-kubernetes-operator")
    canaryd = container(deployment, "canaryd")
    port = int(flag_value(canaryd["args"], "--port") or DEFAULTS.port)
    # canaryd's verdict on /healthz, through bash's /dev/tcp (tests/test_sidecar_probe.py
    # runs it): an answer of 500 fails it, no answer passes.
    assert "httpGet" not in operator["livenessProbe"]
    (script,) = operator["livenessProbe"]["exec"]["command"][2:]
    assert f"/dev/tcp/127.0.0.1/{port}" in script and "GET /healthz " in script
    # The startup probe stays the operator's own: a verdict never restarts a process
    # that is still starting.
    assert operator["startupProbe"]["httpGet"] == {"path": "/", "port": "health-port"}
    # Nothing of canaryd's gates the pod's readiness (the webhook's endpoints), and its
    # liveness is its own process.
    assert "readinessProbe" not in canaryd
    assert canaryd["livenessProbe"]["httpGet"] == {"path": "/livez", "port": port}
    # canaryd's port must not be the operator's own probe port.
    assert port not in {p["containerPort"] for p in operator["ports"]}
    # It reads the operator's ConfigMap where the operator does.
    config_dir = flag_value(canaryd["args"], "--operator-config")
    mount = next(m for m in canaryd["volumeMounts"] if m["mountPath"] == config_dir)
    volume = next(
        v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    assert volume["configMap"]["name"] == "flink-operator-config"
    assert mount.get("readOnly") is True
    assert canaryd["securityContext"]["readOnlyRootFilesystem"] is True
    build_parser().parse_args(canaryd["args"])
    # The verdict that restarts the operator is about the operator's own reconciles.
    assert flag_value(canaryd["args"], "--reconciled-by") == "operator-metrics"


CHART_DEFAULT_OVERRIDES = (
    "# Flink Config Overrides\n"
    "kubernetes.operator.metrics.reporter.slf4j.factory.class: "
    "org.apache.flink.metrics.slf4j.Slf4jReporterFactory\n"
    "kubernetes.operator.metrics.reporter.slf4j.interval: 5 MINUTE\n"
    "\n"
    "kubernetes.operator.reconcile.interval: 15 s\n"
    "kubernetes.operator.observer.progress-check.interval: 5 s\n"
)
"""The operator chart's own ``defaultConfiguration."flink-conf.yaml"`` (release 1.15.0):
what its ConfigMap holds when nobody replaces it."""


def test_the_sidecars_helm_values_merge_and_replace_no_configuration():
    """config/sidecar/helm-values.yaml sets no part of the chart's configuration: a
    values file merged with the user's, nothing of defaultConfiguration replaced."""
    values = yaml.safe_load((CONFIG / "sidecar" / "helm-values.yaml").read_text())
    assert set(values) == {"metrics"}, "values to merge: no defaultConfiguration"
    override = next(d for d in built(CONFIG / "sidecar-example") if d["kind"] == "ConfigMap")
    conf = yaml.safe_load(override["data"]["flink-conf.yaml"])
    assert conf["kubernetes.operator.metrics.reporter.prom.port"] == values["metrics"]["port"]


def test_the_sidecar_turns_on_the_reporter_canaryd_reads_beside_the_charts_config(tmp_path):
    """The component's ConfigMap is the operator's CONF_OVERRIDE_DIR (its keys win over
    the chart's flink-conf.yaml, which stays the user's); canaryd, reading the chart's
    file as the sidecar does, reads the reporter at the port the override sets."""
    objects = built(CONFIG / "sidecar-example")
    deployment = next(d for d in objects if d["kind"] == "Deployment")
    override = next(d for d in objects if d["kind"] == "ConfigMap")
    assert override["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    operator = container(deployment, "flink-kubernetes-operator")
    env = {e["name"]: e.get("value") for e in operator["env"]}
    mounts = {m["name"]: m["mountPath"] for m in operator["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    (name,) = [
        n
        for n, v in volumes.items()
        if v.get("configMap", {}).get("name") == (override["metadata"]["name"])
    ]
    assert mounts[name] == env["CONF_OVERRIDE_DIR"]
    assert "canaryd" not in {m["name"] for m in container(deployment, "canaryd")["volumeMounts"]}
    # The operator's effective configuration: its conf, then the override's keys over it
    # (FlinkConfigManager.loadGlobalConfiguration); the chart's own settings kept.
    effective = {
        **yaml.safe_load(CHART_DEFAULT_OVERRIDES),
        **yaml.safe_load(override["data"]["flink-conf.yaml"]),
    }
    assert effective["kubernetes.operator.reconcile.interval"] == "15 s"
    assert effective["kubernetes.operator.metrics.reporter.prom.factory.class"].endswith(
        "PrometheusReporterFactory"
    )
    (tmp_path / "flink-conf.yaml").write_text(CHART_DEFAULT_OVERRIDES)
    args = container(deployment, "canaryd")["args"]
    config = flag_value(args, "--operator-config")
    assert config == mounts["flink-operator-config-volume"]
    settings = load_settings(
        [a for a in args if not a.startswith("--operator-config")]
        + ["--operator-config", str(tmp_path)],
        {},
    )
    port = effective["kubernetes.operator.metrics.reporter.prom.port"]
    assert settings.operator_metrics_url == f"http://127.0.0.1:{port}/metrics"


def test_the_sidecar_example_is_the_chart_rendered_with_the_sidecars_helm_values():
    """The stand-in Deployment is what the chart renders with helm-values.yaml: the
    reporter's container port (metrics.port), and the chart's flink-conf.yaml item."""
    values = yaml.safe_load((CONFIG / "sidecar" / "helm-values.yaml").read_text())
    deployment = next(d for d in built(CONFIG / "sidecar-example") if d["kind"] == "Deployment")
    operator = container(deployment, "flink-kubernetes-operator")
    ports = {p["name"]: p["containerPort"] for p in operator["ports"]}
    assert ports["metrics"] == values["metrics"]["port"]
    volume = next(
        v
        for v in deployment["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "flink-operator-config-volume"
    )
    keys = {item["key"] for item in volume["configMap"]["items"]}
    assert "flink-conf.yaml" in keys


POST_RENDER = CONFIG / "helm" / "post-render"
KUSTOMIZE = next(iter(sorted((ROOT / ".cache" / "kustomize").glob("*/bin/kustomize"))), None)


def post_render(stdin: str, **env: str) -> subprocess.CompletedProcess[str]:
    """config/helm/post-render as Helm runs it, with kubectl's kustomize where kubectl
    is installed, else the one `make helm` built."""
    tool = KUBECTL or (str(KUSTOMIZE) if KUSTOMIZE else None)
    if tool is None:
        pytest.skip("neither kubectl nor a kustomize built by `make helm`")
    return subprocess.run(
        [str(POST_RENDER)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "KUSTOMIZE": tool, **env},
        check=False,
    )


@pytest.mark.parametrize(
    ("image", "wanted"),
    [
        ("registry.example.com:5000/team/canaryd:0.2.0", None),
        ("registry.example.com:5000/team/canaryd", "registry.example.com:5000/team/canaryd:0.1.0"),
        ("ghcr.io/x/canaryd@sha256:" + "a" * 64, None),
    ],
)
def test_the_helm_post_renderer_adds_the_sidecar_with_the_image_asked(image, wanted):
    """On the stand-in of the chart's Deployment (the real chart: tests/test_helm.py)."""
    stand_in = (CONFIG / "sidecar-example" / "operator-deployment.yaml").read_text()
    result = post_render(stand_in, CANARYD_IMAGE=image)
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert sorted(d["kind"] for d in rendered) == [
        "ConfigMap",  # the operator's reporter (operator-conf-override.yaml)
        "Deployment",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    expected = next(d for d in built(CONFIG / "sidecar-example") if d["kind"] == "Deployment")
    got, want = container(deployment, "canaryd"), container(expected, "canaryd")
    assert got.pop("image") == (wanted or image)
    want.pop("image")
    assert got == want
    assert container(deployment, "flink-kubernetes-operator") == container(
        expected, "flink-kubernetes-operator"
    )


def test_the_helm_post_renderer_refuses_to_render_without_an_image():
    """An image nobody pushed (the sidecar's placeholder) would leave canaryd's
    container waiting beside the operator for ever: no image, nothing rendered."""
    stand_in = (CONFIG / "sidecar-example" / "operator-deployment.yaml").read_text()
    for unset in (post_render(stand_in), post_render(stand_in, CANARYD_IMAGE="")):
        assert unset.returncode == 2, unset.stdout
        assert unset.stdout == ""
        assert unset.stderr.count("\n") == 1 and "CANARYD_IMAGE is not set" in unset.stderr


def operator_identity(policy: dict[str, Any]) -> str:
    """The service account config/admission's policy checks: the matchCondition's
    string literals, concatenated as CEL does."""
    (condition,) = [
        c for c in policy["spec"]["matchConditions"] if c["name"] == "operator-service-account"
    ]
    expression = condition["expression"]
    assert expression.startswith("request.userInfo.username == "), expression
    return "".join(re.findall(r"'([^']*)'", expression))


def test_the_helm_post_renderer_checks_the_service_account_the_chart_renders():
    """The release's namespace and the chart's serviceAccountName, read from the
    rendered Deployment (kustomize replacements in config/sidecar)."""
    stand_in = (CONFIG / "sidecar-example" / "operator-deployment.yaml").read_text()
    assert "namespace: flink-operator\n" in stand_in
    assert "serviceAccountName: flink-operator\n" in stand_in
    other = stand_in.replace("namespace: flink-operator\n", "namespace: team-flink\n").replace(
        "serviceAccountName: flink-operator\n", "serviceAccountName: op-sa\n"
    )
    for chart, wanted in (
        (stand_in, "system:serviceaccount:flink-operator:flink-operator"),
        (other, "system:serviceaccount:team-flink:op-sa"),
    ):
        result = post_render(chart, CANARYD_IMAGE="canaryd:0.1.0")
        assert result.returncode == 0, result.stderr
        (policy,) = [
            d
            for d in yaml.safe_load_all(result.stdout)
            if d and d["kind"] == "ValidatingAdmissionPolicy"
        ]
        assert operator_identity(policy) == wanted


@pytest.mark.parametrize("directory", ["sidecar-example", "standalone", "standalone-ha"], ids=str)
def test_every_topology_ships_the_policy_against_the_operators_stale_replace(directory):
    """config/admission in each: the operator's UPDATEs of the canary kinds' main
    resource (no /status), failurePolicy Ignore, bound with Deny; its default
    service account is the chart's (flink-operator in flink-operator)."""
    objects = {d["kind"]: d for d in built(CONFIG / directory)}
    policy = objects["ValidatingAdmissionPolicy"]
    binding = objects["ValidatingAdmissionPolicyBinding"]
    assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Ignore"
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["operations"] == ["UPDATE"]
    assert sorted(rule["resources"]) == ["flinkdeployments", "flinksessionjobs"]
    assert operator_identity(policy) == "system:serviceaccount:flink-operator:flink-operator"


def test_the_helm_post_renderer_refuses_what_would_install_no_canaryd():
    stand_in = (CONFIG / "sidecar-example" / "operator-deployment.yaml").read_text()
    renamed = post_render(
        stand_in.replace("name: flink-kubernetes-operator\n", "name: x\n", 1),
        CANARYD_IMAGE="canaryd:0.1.0",
    )
    assert renamed.returncode == 2, renamed.stdout
    assert renamed.stderr.count("\n") == 1 and "canaryd was not added" in renamed.stderr
    assert renamed.stdout == ""
    bad = post_render(stand_in, CANARYD_IMAGE="canaryd:1 ; rm -rf /")
    assert bad.returncode == 2 and "is not an image reference" in bad.stderr, bad.stderr
    missing = subprocess.run(
        [str(POST_RENDER)],
        input=stand_in,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/nonexistent", "CANARYD_IMAGE": "canaryd:0.1.0"},
        check=False,
    )
    assert missing.returncode == 2 and "needs kustomize (v5) or kubectl" in missing.stderr


def test_samples_are_canaries_of_both_kinds():
    kinds = {d["kind"]: d for d in all_docs() if d.get("apiVersion") == "flink.apache.org/v1beta1"}
    assert set(kinds) == {"FlinkDeployment", "FlinkSessionJob"}
    for doc in kinds.values():
        assert doc["metadata"]["labels"][DEFAULTS.label] == "true"


# --------------------------------------------------------------- Dockerfile


def dockerfile() -> list[tuple[str, str]]:
    instructions = []
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            instructions.append((word.upper(), rest.strip()))
    return instructions


def test_dockerfile_is_multi_stage_non_root_with_canaryd_as_entrypoint():
    instructions = dockerfile()
    stages = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    assert len(stages) >= 2
    final = instructions[stages[-1] :]
    users = [rest for word, rest in final if word == "USER"]
    assert users, "the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric, so runAsNonRoot can check it
    assert [rest for word, rest in final if word == "ENTRYPOINT"] == ['["canaryd"]']
    assert ("EXPOSE", str(DEFAULTS.port)) in final
    env = " ".join(rest for word, rest in final if word == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env and "HOME=/tmp" in env  # read-only root fs


def test_dockerfile_bakes_in_no_secrets():
    for word, rest in dockerfile():
        upper = rest.upper()
        if word in ("ENV", "ARG"):
            for name in ("TOKEN", "PASSWORD", "SECRET", "KUBECONFIG", "API_KEY"):
                assert name not in upper, (word, rest)
        if word in ("COPY", "ADD"):
            sources = [s for s in shlex.split(rest)[:-1] if not s.startswith("--")]
            for source in sources:
                assert ".kube" not in source, rest
                assert not source.endswith((".pem", ".key", "kubeconfig")), rest
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".git" in ignored and ".venv" in ignored


@pytest.mark.slow
def test_the_wheel_installs_into_a_fresh_venv_and_runs(tmp_path):
    """What the image's build stage does: pip install . into a new venv, run canaryd."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--quiet",
            "-w",
            str(wheels),
            str(ROOT),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (wheel,) = wheels.glob(f"flink_canaryd-{__version__}-*.whl")  # canaryd is PyPI's other one
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # A fresh venv: nothing of the checkout on its path (with PYTHONPATH set, pip would
    # find canaryd there already and install no entry point).
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean,
    )
    assert install.returncode == 0, install.stderr
    result = subprocess.run(
        [str(env_dir / "bin" / "canaryd"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "--operator-config" in result.stdout
    version = subprocess.run(
        [str(env_dir / "bin" / "canaryd"), "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.stdout.strip() == f"canaryd {__version__}"


# ------------------------------------------------------------------- HA variant


def test_the_ha_variant_runs_two_replicas_behind_the_lease_with_exactly_its_rbac():
    ha = CONFIG / "standalone-ha"
    patch = docs(ha / "deployment-patch.yaml")[0]
    assert patch["spec"]["replicas"] == 2
    assert patch["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    spec = patch["spec"]["template"]["spec"]
    term = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    canaryd = container(patch, "canaryd")
    env = {e["name"]: e for e in canaryd["env"]}
    assert env["CANARYD_IDENTITY"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["CANARYD_LEASE_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.namespace"
    )
    # What canaryd makes of those args and that environment in a pod.
    settings = load_settings(
        canaryd["args"],
        {"CANARYD_IDENTITY": "canaryd-7d9f-x2", "CANARYD_LEASE_NAMESPACE": "canaryd"},
    )
    assert settings.leader_elect and settings.identity == "canaryd-7d9f-x2"
    assert settings.lease_namespace == "canaryd" and settings.timeout == 60.0

    pdb = docs(ha / "poddisruptionbudget.yaml")[0]
    assert pdb["spec"]["minAvailable"] == 1
    pod_labels = docs(CONFIG / "standalone" / "deployment.yaml")[0]["spec"]["template"]["metadata"][
        "labels"
    ]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    role = docs(ha / "lease-role.yaml")[0]
    assert role["kind"] == "Role"  # the lease namespace only, never cluster-wide
    # get and update on canaryd's own Lease only; create cannot name its object in RBAC
    # (a create is authorized before the object has a name), so it is not limited.
    assert role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [settings.lease_name],
            "verbs": ["get", "update"],
        },
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["create"],
        },
    ]
    binding = docs(ha / "lease-rolebinding.yaml")[0]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "canaryd", "namespace": "canaryd"}
    ]
    kustomization = yaml.safe_load((ha / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == "canaryd" and "../standalone" in kustomization["resources"]


def test_the_rbac_example_for_another_kind_grants_what_a_flink_kind_gets():
    role, binding = docs(CONFIG / "rbac" / "examples" / "another-kind.yaml")
    flink = docs(CONFIG / "rbac" / "clusterrole.yaml")[0]["rules"][0]
    assert set(role["rules"][0]["verbs"]) == set(flink["verbs"])
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
