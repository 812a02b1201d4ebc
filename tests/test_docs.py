"""The README and docs/ as a reader meets them (issue 33): a short README for operators
whose statements hold, and the three documents it links to kept true by the code.

- README.md: at most 250 lines; its quick start gives `make demo` and `make test`; its
  measured figures are the ones docs/OPERATOR.md and docs/PERFORMANCE.md report.
- docs/CONFIGURATION.md: every flag of ``canaryd --help`` (the flag definitions in
  canaryd/config/__init__.py) with its environment variable and operator config key, and
  no flag canaryd does not have.
- docs/OPERATIONS.md: one runbook section per alert of config/monitoring, which each
  alert's ``runbook_url`` names.
- every link between the documents, every path of the repository and every `make`
  target they name exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from canaryd.config import KEY_DYNAMIC, OPTIONS, build_parser
from canaryd.kube import PROXY_VARIABLES

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "CONFIGURATION.md"
OPERATIONS = DOCS / "OPERATIONS.md"
DEVELOPMENT = DOCS / "DEVELOPMENT.md"
WRITTEN = [README, CONFIGURATION, OPERATIONS, DEVELOPMENT]
"""The documents issue 33 wrote or split out of the README (the others are reports)."""


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole heading line) up to the next heading of the
    same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    ends = [m.start() for m in re.finditer(rf"\n(#{{1,{level}}}) ", text[start:])]
    return text[start : start + ends[0]] if ends else text[start:]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped,
    spaces to dashes."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and re.match(r"#{1,6} ", line):
            found.add(slug(line.lstrip("#")))
    return found


# ------------------------------------------------------------------------- README


def test_the_readme_is_for_operators_and_short():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[:2] == ["## Does it fit you?", "## Quick start"], headings
    for wanted in (
        "## Run it beside your operator",
        "## Deploy",
        "## How it differs from the operator's built-in probe",
        "## Documentation",
    ):
        assert wanted in headings, wanted
    for doc in ("docs/CONFIGURATION.md", "docs/OPERATIONS.md", "docs/DEVELOPMENT.md"):
        assert f"]({doc})" in text, doc


def test_the_quick_start_gives_the_two_commands():
    quick = section(README.read_text(), "## Quick start")
    commands = re.findall(r"^\| `(make [a-z-]+)` \|", quick, flags=re.MULTILINE)
    assert commands == ["make demo", "make test"]


def test_the_readmes_measured_figures_are_the_reports():
    """'Measured' in the README means a figure a report of the repository holds."""
    text = " ".join(README.read_text().split())
    operator = " ".join((DOCS / "OPERATOR.md").read_text().split())
    performance = (DOCS / "PERFORMANCE.md").read_text()
    for figure in ("10.7 s", "10.6 s", "from 12 s and 14 s on"):
        assert figure in text, figure
    assert "wiped 10.7 s later" in operator and "back 10.6 s later" in operator
    assert "probe 500 from 12.1 s on" in operator and "probe 500 from 14.1 s on" in operator
    for canaries in ("1,000", "10,000"):
        # The figure of the latest make bench, whatever it is: the README must quote it.
        found = re.search(rf"\| {canaries} canaries: peak RSS \| (\d+) MB \|", performance)
        assert found, f"docs/PERFORMANCE.md has no peak RSS row at {canaries} canaries"
        assert f"{found.group(1)} MB at {canaries}" in text, (canaries, found.group(1))
    cpu = re.search(
        r"\| 10,000 canaries: daemon CPU, normalised to a 60 s cycle \| ([\d.]+)% of a core",
        performance,
    )
    assert cpu, "docs/PERFORMANCE.md has no CPU row at 10,000 canaries"
    assert f"{cpu.group(1)}% of a core at 10,000" in text, cpu.group(1)


def test_every_quoted_peak_resident_set_is_the_reports():
    """The peak resident sets are quoted beside the memory requests too (the chart, the
    manifests, the sidecar, the chart's test): each the figure of docs/PERFORMANCE.md."""
    performance = (DOCS / "PERFORMANCE.md").read_text()
    files = [README, *ROOT.glob("config/**/*.yaml"), *ROOT.glob("charts/**/*.yaml")]
    quoted = {
        path.relative_to(ROOT): re.findall(
            r"(\d+) MB at (1,000|10,000)\b", " ".join(path.read_text().replace("#", "").split())
        )
        for path in [*files, ROOT / "tests" / "test_chart.py"]
    }
    for canaries in ("1,000", "10,000"):
        found = re.search(rf"\| {canaries} canaries: peak RSS \| (\d+) MB \|", performance)
        assert found, f"docs/PERFORMANCE.md has no peak RSS row at {canaries} canaries"
        wanted = found.group(1)
        at = {str(path): mb for path, pairs in quoted.items() for mb, n in pairs if n == canaries}
        assert len(at) >= 5 and set(at.values()) == {wanted}, (canaries, wanted, at)


def test_the_flink_operator_release_is_one_everywhere():
    """The operator's release the docs and manifests name (its chart, its image, its
    source) is the one tests/operator/build.sh builds and make e2e-operator runs."""
    (pinned,) = re.findall(
        r"FLINK_OPERATOR_REF:-release-([\d.]+)", (ROOT / "tests/operator/build.sh").read_text()
    )
    files = [README, *DOCS.glob("*.md"), *ROOT.glob("config/**/*.yaml")]
    named = {
        (str(path.relative_to(ROOT)), version)
        for path in files
        for version in re.findall(
            r"(?:flink-kubernetes-operator[-:]|release[- ]|version: )(\d+\.\d+\.\d+)",
            path.read_text(),
        )
    }
    assert {v for _, v in named} == {pinned}, sorted(named)
    assert ("config/sidecar-example/operator-deployment.yaml", pinned) in named


def test_the_readmes_kustomize_step_works_as_pasted():
    """A block that cds into a directory applies a kustomization relative to it."""
    for doc in (README, OPERATIONS):
        text = doc.read_text()
        steps = re.findall(r"^    cd (\S+) && .*\n    kubectl apply -k (\S+)", text, re.M)
        assert steps, doc
        for directory, target in steps:
            assert (ROOT / directory / target / "kustomization.yaml").is_file(), (doc, target)


def test_the_charts_home_is_canaryds_repository_as_the_readme_names_it():
    (repository,) = set(re.findall(r"(https://github\.com/\w+/canaryd)//", README.read_text()))
    chart = yaml.safe_load((ROOT / "charts" / "canaryd" / "Chart.yaml").read_text())
    assert chart["home"] == repository and chart["sources"] == [repository], chart


# ---------------------------------------------------------------- CONFIGURATION


def documented_flags() -> dict[str, tuple[str, str, str]]:
    """The configuration table: flag -> (environment cell, key cell, default cell)."""
    table = section(CONFIGURATION.read_text(), "## Flags, environment and operator config keys")
    rows: dict[str, tuple[str, str, str]] = {}
    for line in table.splitlines():
        match = re.match(r"\| `(--[a-z-]+)[^`]*`[^|]*\|(.*)$", line)
        if match:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", match.group(2))]
            assert match.group(1) not in rows, f"{match.group(1)} listed twice"
            rows[match.group(1)] = (cells[0], cells[1], cells[2])
    return rows


def parser_flags() -> dict[str, str]:
    """canaryd's own flags and their help, --help and --version aside."""
    return {
        action.option_strings[0]: " ".join((action.help or "").split())
        for action in build_parser()._actions
        if action.option_strings and action.option_strings[0] not in ("-h", "--version")
    }


def test_every_flag_is_documented_and_every_documented_flag_exists():
    documented, flags = documented_flags(), parser_flags()
    assert set(documented) == set(flags), (
        f"undocumented: {sorted(set(flags) - set(documented))}; "
        f"stale: {sorted(set(documented) - set(flags))}"
    )


@pytest.mark.parametrize("flag", sorted(parser_flags()))
def test_each_flags_environment_key_and_default_are_the_ones_canaryd_reads(flag):
    help_text = parser_flags()[flag]
    env_cell, key_cell, default_cell = documented_flags()[flag]
    (env,) = re.findall(r"\[env ([A-Z_]+)\]", help_text)
    assert re.findall(r"`([A-Z_]+)`", env_cell) == [env], (flag, env_cell)
    keys = re.findall(r"(kubernetes\.operator\.[a-z.<>-]*[a-z>])", help_text)
    assert re.findall(r"`(kubernetes\.operator\.[a-z.<>-]*[a-z>])`", key_cell) == keys, flag
    default = re.search(r"\(default: ([^;)]*(?:\([^)]*\)[^;)]*)*)", help_text)
    assert default, flag
    words = re.findall(r"[\w./~:-]+", default.group(1))
    cell = default_cell.replace("`", "").lower()
    # The doc's default may say more (where it is set), never something else.
    missing = [w for w in words if w.lower() not in cell and w not in IGNORED_WORDS]
    assert not missing, (flag, default.group(1), default_cell)


IGNORED_WORDS = {"when", "in", "a", "the", "its", "is", "and", "else", "PORT", "as", "sets"}


def test_every_operator_config_key_and_environment_variable_read_is_documented():
    text = CONFIGURATION.read_text()
    keys = [KEY_DYNAMIC, *(row.key for row in OPTIONS.values() if row.key)]
    assert len(keys) >= 6
    for key in keys:
        assert f"`{key}" in text, key
    for variable in ("KUBERNETES_SERVICE_HOST", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        assert f"`{variable}`" in text, variable
    for variable in PROXY_VARIABLES:
        assert variable.upper() in text, variable
    assert "canaryd check" in OPERATIONS.read_text() and "canaryd --version" in README.read_text()


# ------------------------------------------------------------------- OPERATIONS


def alerts() -> dict[str, dict[str, str]]:
    rule = yaml.safe_load((ROOT / "config" / "monitoring" / "prometheusrule.yaml").read_text())
    return {
        r["alert"]: r.get("annotations", {})
        for group in rule["spec"]["groups"]
        for r in group["rules"]
        if "alert" in r
    }


def test_every_alert_has_a_runbook_section_its_runbook_url_names():
    found = alerts()
    assert len(found) >= 10
    text = OPERATIONS.read_text()
    runbook = section(text, "## Alerts: the runbook")
    sections = re.findall(r"^### (\w+)$", runbook, flags=re.MULTILINE)
    assert sorted(sections) == sorted(found), "one section per alert, no more"
    headings = anchors(OPERATIONS)
    runbook_yaml = ROOT / "config" / "monitoring" / "runbook.yaml"
    base = yaml.safe_load(runbook_yaml.read_text())["data"]["baseURL"]
    for name, annotated in found.items():
        url = annotated.get("runbook_url", "")
        path, _, anchor = url.partition("#")
        assert path == f"{base}/docs/OPERATIONS.md", (name, url)
        assert anchor in headings and anchor == slug(name), (name, url)
        body = section(runbook, f"### {name}")
        assert "fires when" in body and len(body.split()) > 20, name
        assert "docs/OPERATIONS.md" in annotated["description"], name


def test_the_alerts_unit_tests_expect_the_runbook_url():
    tests = yaml.safe_load((ROOT / "config" / "monitoring" / "alerts-test.yaml").read_text())
    urls = {name: a["runbook_url"] for name, a in alerts().items()}
    checked = 0
    for case in tests["tests"]:
        for alert in case.get("alert_rule_test", []):
            for expected in alert.get("exp_alerts", []):
                assert expected["exp_annotations"]["runbook_url"] == urls[alert["alertname"]]
                checked += 1
    assert checked >= 11


# ---------------------------------------------------------------- every document


@pytest.mark.parametrize("path", WRITTEN, ids=lambda p: p.name)
def test_every_link_resolves_to_a_file_and_a_heading(path):
    text = path.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        assert resolved.exists(), (path.name, target)
        if anchor:
            assert anchor in anchors(resolved), (path.name, target)


@pytest.mark.parametrize("path", WRITTEN, ids=lambda p: p.name)
def test_every_path_of_the_repository_named_exists(path):
    """A reader has the repository, not the project's shared folder."""
    text = path.read_text()
    assert "shared folder" not in text and "seed's" not in text
    named = set(
        re.findall(r"(?<![\w/.~])((?:config|docs|tests|canaryd|bench|charts)/[\w./-]*[\w/])", text)
    )
    not_paths = {"canaryd/canaryd"}  # the ServiceAccount's namespace/name
    missing = sorted(p for p in named - not_paths if not (ROOT / p).exists())
    assert not missing, missing


@pytest.mark.parametrize("path", WRITTEN, ids=lambda p: p.name)
def test_every_make_target_named_exists(path):
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", makefile, flags=re.MULTILINE))
    named = set(re.findall(r"`make ([a-z][a-z0-9-]*)", path.read_text()))
    assert named and named <= targets, sorted(named - targets)


def test_the_readme_names_the_paths_a_newcomer_starts_from():
    text = README.read_text()
    for wanted in ("docs/DESIGN.md", "config/helm/post-render", "config/samples"):
        assert wanted in text, wanted
    assert "--once`; otherwise" not in text  # make demo cannot pass --once
    assert ".venv/bin/canaryd" in text and "apply -n default -k config/samples" in text


def test_docs_node_md_shows_the_fixtures_table():
    """docs/NODE.md's table is generated from the fixture (python -m tests.node.restarts)."""
    from tests.node import restarts

    assert restarts.block(restarts.DOC.read_text()) == restarts.table(), (
        "docs/NODE.md's table is not the fixture's: run `python -m tests.node.restarts`"
    )
