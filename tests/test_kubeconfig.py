"""`make kubeconfig` (canaryd/kubeconfig.py) without a cluster: what it would apply, and
bad input as one line with status 2. On a real API server: tests/test_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from canaryd import logs
from canaryd.kubeconfig import main, prepared, read_manifests

ROOT = Path(__file__).resolve().parent.parent
RBAC = ROOT / "config" / "rbac"


@pytest.fixture(autouse=True)
def _restore_logs():
    """main() configures logging for a command line (warnings only): put back what
    tests/conftest.py sets, or later tests lose their info lines."""
    yield
    logs.configure("console", "info")


def test_the_cluster_wide_manifests_bind_the_service_account_where_it_is_made():
    objects = prepared(read_manifests(RBAC), "ops", "canaryd-host1")
    by_kind = {o["kind"]: o for o in objects}
    assert set(by_kind) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    assert by_kind["ServiceAccount"]["metadata"] == {
        "name": "canaryd-host1",
        "namespace": "ops",
        "labels": {"app.kubernetes.io/name": "canaryd"},
    }
    binding = by_kind["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == by_kind["ClusterRole"]["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "canaryd-host1", "namespace": "ops"}
    ]
    assert "namespace" not in by_kind["ClusterRole"]["metadata"]
    assert read_manifests(RBAC)[0]["metadata"]["name"] == "canaryd"  # the files untouched


def test_the_namespaced_manifests_stay_in_their_namespace():
    objects = prepared(read_manifests(RBAC / "namespaced"), "team-a", "canaryd")
    roles = [o for o in objects if o["kind"] in ("Role", "RoleBinding", "ServiceAccount")]
    assert {o["metadata"]["namespace"] for o in roles} == {"team-a"}
    for binding in (o for o in objects if "subjects" in o):
        assert binding["subjects"][0]["namespace"] == "team-a"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--kubeconfig", "/nonexistent/admin"], "no kubeconfig at /nonexistent/admin"),
        (["--duration", "5 min"], "below the API's 10 min minimum"),
        (["--duration", "soon"], "soon"),
        (["--rbac", "/nonexistent"], "cannot read the RBAC manifests in /nonexistent"),
    ],
)
def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, monkeypatch, args, says):
    admin = tmp_path / "admin"
    admin.write_text("apiVersion: v1\nkind: Config\n")
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["--output", str(tmp_path / "out"), "--kubeconfig", str(admin), *args])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exited.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("canaryd kubeconfig: ") and says in lines[0], lines
    assert not (tmp_path / "out").exists()
