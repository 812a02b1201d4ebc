"""The release: one version everywhere, the workflow of a v* tag (actionlint, built by
`make helm` from its Go module), and what `make dist` put in dist/.

The dist/ tests read the artifacts themselves (the OCI archive's index, manifests, config
and layers; the chart; the SBOM; the packages; the sums): `make dist` runs them after
building (CANARYD_DIST=1), so CI's `.ci/run` does; `make test` runs the rest.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import zipfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from canaryd import __version__
from tests.test_chart import _pinned, helm_binary, helm_run

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "dist"
WORKFLOW = ROOT / ".github" / "workflows" / "release.yaml"
ORG = os.environ.get("ORG", "ORG")
IMAGE = f"ghcr.io/{ORG.lower()}/canaryd"
SOURCE = f"https://github.com/{ORG}/canaryd"
DEPENDENCIES = {"aiohttp", "kubernetes-asyncio", "structlog", "prometheus-client", "pyyaml"}


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ------------------------------------------------------------ one version


def test_the_chart_and_the_package_carry_one_version():
    chart = yaml.safe_load((ROOT / "charts" / "canaryd" / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == __version__
    assert chart["home"] == "https://github.com/ORG/canaryd" == chart["sources"][0]
    values = yaml.safe_load((ROOT / "charts" / "canaryd" / "values.yaml").read_text())
    runbook = f"https://github.com/ORG/canaryd/blob/v{__version__}"
    assert values["prometheusRule"]["runbookBaseURL"] == runbook  # runbook.yaml's: test_chart
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'name = "flink-canaryd"' in pyproject and 'dynamic = ["version"]' in pyproject
    assert 'version = {attr = "canaryd.__version__"}' in pyproject


def test_the_released_chart_links_the_runbook_at_its_release(tmp_path):
    """What make dist writes into the chart it packages (release/stamp-chart.sh, applied
    here to a copy): the owner in its home, its image and its alerts' runbook_url, which
    read the docs at the release's tag (they kept github.com/ORG/... at v0.1.0)."""
    chart = tmp_path / "canaryd"
    shutil.copytree(ROOT / "charts" / "canaryd", chart)
    stamp = [str(ROOT / "release" / "stamp-chart.sh"), str(chart), "Acme", __version__]
    subprocess.run(["bash", *stamp, "ghcr.io/acme/canaryd"], check=True, timeout=30)
    assert yaml.safe_load((chart / "Chart.yaml").read_text())["home"] == (
        "https://github.com/Acme/canaryd"
    )
    result = helm_run(
        helm_binary(), "template", "canaryd", str(chart), values=["prometheusRule.enabled=true"]
    )
    assert result.returncode == 0, result.stderr
    objects = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    (image,) = {
        c["image"]
        for o in objects
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert image.startswith("ghcr.io/acme/canaryd:")
    urls = [
        r["annotations"]["runbook_url"]
        for o in objects
        if o["kind"] == "PrometheusRule"
        for g in o["spec"]["groups"]
        for r in g["rules"]
        if "alert" in r
    ]
    base = f"https://github.com/Acme/canaryd/blob/v{__version__}/docs/OPERATIONS.md#"
    assert urls and all(u.startswith(base) for u in urls), urls


# ------------------------------------------------------------ the workflow


def actionlint(path: Path) -> subprocess.CompletedProcess[str]:
    version = _pinned(
        ROOT / "tests" / "helm" / "actionlint" / "go.mod", "github.com/rhysd/actionlint"
    )
    binary = ROOT / ".cache" / "actionlint" / version / "bin" / "actionlint"
    assert binary.is_file(), f"{binary} is missing: run `make helm` (`make test` does)"
    # shellcheck and pyflakes off: the same verdict whether or not they are installed.
    argv = [str(binary), "-no-color", "-shellcheck=", "-pyflakes=", str(path)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_the_release_workflow_passes_actionlint(tmp_path):
    result = actionlint(WORKFLOW)
    assert result.returncode == 0, result.stdout + result.stderr
    # ...and actionlint does see a broken one: an output of a step that does not exist.
    broken = tmp_path / "release.yaml"
    broken.write_text(
        WORKFLOW.read_text().replace("steps.version.outputs.org", "steps.v.outputs.org")
    )
    result = actionlint(broken)
    assert result.returncode == 1 and 'property "v" is not defined' in result.stdout, result.stdout


def _workflow() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(WORKFLOW.read_text())
    return loaded


def _step(job: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(
        s for s in _workflow()["jobs"][job]["steps"] if s.get("name", "").startswith(name)
    )
    return found


def test_the_workflow_tests_then_publishes_what_make_dist_built():
    flow = _workflow()
    assert flow[True] == {"push": {"tags": ["v*"]}}  # YAML 1.1: `on` is True
    release = flow["jobs"]["release"]
    assert release["env"]["PLATFORMS"] == "linux/amd64 linux/arm64"
    runs = [s.get("run", "") for s in release["steps"]]
    ci = next(i for i, r in enumerate(runs) if ".ci/run" in r)
    pushes = [i for i, r in enumerate(runs) if "cosign sign" in r]
    assert len(pushes) == 2 and min(pushes) > ci
    assert "oci-archive:dist/canaryd-$VERSION.oci.tar" in runs[pushes[0]]
    assert 'push "dist/canaryd-$VERSION.tgz"' in runs[pushes[1]]
    ci_run = (ROOT / ".ci" / "run").read_text().splitlines()
    made = [line for line in ci_run if line.startswith("make ")]
    assert made == ["make test", "make test-slow", "make e2e", "make dist", "make e2e-node"]
    pypi = flow["jobs"]["pypi"]
    assert pypi["permissions"] == {"id-token": "write"}
    assert pypi["steps"][-1]["uses"].startswith("pypa/gh-action-pypi-publish@")


def _version_step(tmp_path: Path, changelog: str, tag: str) -> subprocess.CompletedProcess[str]:
    """The workflow's first step of its own, run in bash on a copy of the tree's files."""
    (tmp_path / "canaryd").mkdir(exist_ok=True)
    (tmp_path / "canaryd" / "__init__.py").write_text(
        (ROOT / "canaryd" / "__init__.py").read_text()
    )
    (tmp_path / "CHANGELOG.md").write_text(changelog)
    env = {
        "PATH": os.environ["PATH"],
        "GITHUB_REF_NAME": tag,
        "GITHUB_REPOSITORY_OWNER": "Some-Owner",
        "GITHUB_OUTPUT": str(tmp_path / "output"),
        "RUNNER_TEMP": str(tmp_path),
    }
    script = _step("release", "The tag, the package's version")["run"]
    return subprocess.run(
        ["bash", "-eo", "pipefail", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )


def test_the_release_notes_are_the_versions_changelog_section(tmp_path):
    changelog = (ROOT / "CHANGELOG.md").read_text()
    heading = f"## [{__version__}] - (the tag's date)"
    assert heading in changelog, f"CHANGELOG.md: no {heading!r}"
    # As in the repository: the date is left for the tag, so no release yet.
    undated = _version_step(tmp_path, changelog, f"v{__version__}")
    assert undated.returncode == 1 and "no dated section" in undated.stdout, undated.stdout
    dated = changelog.replace(heading, f"## [{__version__}] - 2027-01-15")
    wrong_tag = _version_step(tmp_path, dated, "v9.9.9")
    assert wrong_tag.returncode == 1 and f"says {__version__}" in wrong_tag.stdout
    result = _version_step(tmp_path, dated, f"v{__version__}")
    assert result.returncode == 0, result.stdout + result.stderr
    section = dated.split(f"## [{__version__}] - 2027-01-15\n", 1)[1].split("\n## [", 1)[0]
    assert (tmp_path / "notes.md").read_text() == section and "### Added" in section
    outputs = (tmp_path / "output").read_text().split()
    assert outputs == [f"version={__version__}", "org=some-owner"]


# ------------------------------------------------------------ dist/

dist = pytest.mark.skipif(
    os.environ.get("CANARYD_DIST") != "1", reason="make dist runs these on what it built"
)


def _epoch() -> int:
    return int(os.environ.get("SOURCE_DATE_EPOCH") or _git("log", "-1", "--format=%ct"))


class Archive:
    """An OCI image layout in a tar (dist/canaryd-V.oci.tar), read as JSON blobs."""

    def __init__(self, tar: tarfile.TarFile) -> None:
        self.tar = tar

    def json(self, name: str) -> Any:
        member = self.tar.extractfile(name)
        assert member is not None, name
        return json.load(member)

    def blob(self, descriptor: dict[str, Any]) -> Any:
        algorithm, digest = descriptor["digest"].split(":")
        return self.json(f"blobs/{algorithm}/{digest}")

    def layer(self, descriptor: dict[str, Any]) -> tarfile.TarFile:
        algorithm, digest = descriptor["digest"].split(":")
        member = self.tar.extractfile(f"blobs/{algorithm}/{digest}")
        assert member is not None
        data = member.read()
        assert hashlib.sha256(data).hexdigest() == digest
        return tarfile.open(fileobj=io.BytesIO(data))

    def images(self) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
        """(platform, manifest, config) of each image of the archive's one index."""
        (top,) = self.json("index.json")["manifests"]
        assert top["annotations"]["org.opencontainers.image.ref.name"] == f"{IMAGE}:{__version__}"
        index = self.blob(top)
        assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
        found = []
        for descriptor in index["manifests"]:
            manifest = self.blob(descriptor)
            found.append((descriptor["platform"], manifest, self.blob(manifest["config"])))
        return found


@pytest.fixture(scope="module")
def archive() -> Iterator[Archive]:
    with tarfile.open(DIST / f"canaryd-{__version__}.oci.tar") as tar:
        yield Archive(tar)


@dist
def test_the_sums_verify_every_artifact():
    listed = (DIST / "SHA256SUMS").read_text().splitlines()
    names = sorted(line.split("  ", 1)[1] for line in listed)
    assert names == sorted(
        [
            f"flink_canaryd-{__version__}-py3-none-any.whl",
            f"flink_canaryd-{__version__}.tar.gz",
            f"canaryd-{__version__}.tgz",
            f"canaryd-{__version__}.oci.tar",
            f"canaryd-{__version__}.cdx.json",
        ]
    )
    assert sorted(p.name for p in DIST.iterdir()) == sorted([*names, "SHA256SUMS"])
    check = subprocess.run(
        ["sha256sum", "--strict", "-c", "SHA256SUMS"], cwd=DIST, capture_output=True
    )
    assert check.returncode == 0, check.stdout.decode()


@dist
def test_the_image_labels_say_what_it_is(archive):
    revision = _git("rev-parse", "HEAD").strip()
    images = archive.images()
    assert images
    for platform, _, config in images:
        labels = config["config"]["Labels"]
        assert labels["org.opencontainers.image.version"] == __version__
        assert labels["org.opencontainers.image.revision"] in (revision, f"{revision}-dirty")
        assert labels["org.opencontainers.image.source"] == SOURCE
        assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
        assert "io.buildah.version" not in labels  # nothing of the machine that built it
        assert config["architecture"] == platform["architecture"]
        assert config["config"]["User"] == "65532:65532"
        assert config["config"]["Entrypoint"] == ["canaryd"]


@dist
def test_the_image_has_no_date_but_the_commits(archive):
    """buildah's --timestamp: the config's dates and canaryd's layer's files are the
    commit's, and so are the archive's; nothing the build mounted (pip.conf) is left in a
    layer."""
    epoch = _epoch()
    assert {m.mtime for m in archive.tar.getmembers()} == {epoch}
    for _, manifest, config in archive.images():
        created = datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        assert config["created"] == config["history"][-1]["created"] == created
        top = archive.layer(manifest["layers"][-1])
        members = top.getmembers()
        assert any(m.name.endswith("bin/canaryd") for m in members)
        assert {m.mtime for m in members} == {epoch}
        for descriptor in manifest["layers"]:
            assert "etc/pip.conf" not in archive.layer(descriptor).getnames()


@dist
def test_the_sbom_lists_the_images_python_packages(archive):
    """Every distribution in the image's venv (its .dist-info directories, read from the
    layers), by name and version, and nothing else."""
    _, manifest, _ = archive.images()[0]
    installed = set()
    for descriptor in manifest["layers"]:
        for name in archive.layer(descriptor).getnames():
            found = re.fullmatch(
                r"\.?/?opt/canaryd/lib/python[\d.]+/site-packages/([^/]+)-([^-/]+)\.dist-info", name
            )
            if found:
                installed.add((_name(found[1]), found[2]))
    assert ("flink-canaryd", __version__) in installed
    assert {name for name, _ in installed} >= DEPENDENCIES
    sbom = json.loads((DIST / f"canaryd-{__version__}.cdx.json").read_text())
    assert sbom["bomFormat"] == "CycloneDX"
    listed = {(_name(c["name"]), c["version"]) for c in sbom["components"]}
    assert listed == installed, f"SBOM only: {listed - installed}; image only: {installed - listed}"


@dist
def test_the_chart_package_is_this_version_and_names_the_published_image():
    with tarfile.open(DIST / f"canaryd-{__version__}.tgz") as chart:
        assert {m.mtime for m in chart.getmembers()} == {_epoch()}
        meta = yaml.safe_load(chart.extractfile("canaryd/Chart.yaml").read())  # type: ignore[union-attr]
        values = yaml.safe_load(chart.extractfile("canaryd/values.yaml").read())  # type: ignore[union-attr]
    assert meta["version"] == meta["appVersion"] == __version__
    assert meta["home"] == SOURCE and meta["sources"] == [SOURCE]
    assert values["image"]["repository"] == IMAGE and values["image"]["tag"] == ""
    assert values["prometheusRule"]["runbookBaseURL"] == f"{SOURCE}/blob/v{__version__}"


@dist
def test_the_python_packages_are_flink_canaryd_with_the_canaryd_command():
    wheel = DIST / f"flink_canaryd-{__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zipped:
        info = f"flink_canaryd-{__version__}.dist-info"
        metadata = zipped.read(f"{info}/METADATA").decode()
        assert f"\nName: flink-canaryd\nVersion: {__version__}\n" in metadata
        assert "canaryd = canaryd.__main__:main" in zipped.read(f"{info}/entry_points.txt").decode()
        assert "canaryd/__init__.py" in zipped.namelist()
    sdist = DIST / f"flink_canaryd-{__version__}.tar.gz"
    assert sdist.read_bytes()[4:8] == b"\0\0\0\0"  # no date in gzip's header
    with tarfile.open(sdist) as tar:
        assert {m.mtime for m in tar.getmembers()} == {_epoch()}
        top = {name.split("/")[0] for name in tar.getnames()}
        assert top == {f"flink_canaryd-{__version__}"}, top  # as PyPI wants it
