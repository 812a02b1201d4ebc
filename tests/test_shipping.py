"""Issue 33, what a platform team asks of a project before deploying it: a licence, a
changelog, a version to ask about (in /metrics and the start-up line), and no quiet
mismatches between what canaryd is told and what it does."""

from __future__ import annotations

import platform
import re
import tomllib
from pathlib import Path
from typing import Any

from canaryd import __version__
from tests.harness import json_lines, json_logs, running_daemon

ROOT = Path(__file__).resolve().parents[1]


def events(records: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") == name]


# ---------------------------------------------------------------- versioned


def test_the_licence_is_the_apache_2_text_pyproject_names():
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == (
        "Apache-2.0"
    )
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License")
    for phrase in (
        "Version 2.0, January 2004",
        "http://www.apache.org/licenses/",
        "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
        "1. Definitions.",
        "9. Accepting Warranty or Additional Liability.",
        "END OF TERMS AND CONDITIONS",
        "APPENDIX: How to apply the Apache License to your work.",
    ):
        assert phrase in text, phrase
    # All nine sections, in order: the full text, not a summary.
    sections = [int(n) for n in re.findall(r"^\s*(\d)\. [A-Z]", text, re.M)]
    assert sections == list(range(1, 10)), sections


def test_the_changelog_keeps_a_changelog_with_an_unreleased_section():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog")
    assert "keepachangelog.com" in text and "semver.org" in text
    headings = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert headings[0] == "Unreleased", headings
    assert __version__ in text, f"the changelog does not name the version {__version__}"
    unreleased = text.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
    kinds = re.findall(r"^### (\w+)", unreleased, re.M)
    known = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
    assert kinds and set(kinds) <= known, kinds
    assert re.search(r"^- \S", unreleased, re.M), "an Unreleased section with no entry"


async def test_metrics_show_the_build_and_the_process(kube, kubeconfig):
    async with running_daemon(kube, kubeconfig) as run:
        status, text = await run.get("/metrics")
    assert status == 200
    build = (
        f'canaryd_build_info{{python="{platform.python_version()}",version="{__version__}"}} 1.0'
    )
    assert build in text, [line for line in text.splitlines() if "build_info" in line]
    for series in (
        "process_resident_memory_bytes",
        "process_start_time_seconds",
        "process_cpu_seconds_total",
        "process_open_fds",
    ):
        assert re.search(rf"^{series} \d", text, re.M), series


async def test_the_start_up_line_names_the_version(kube, kubeconfig, capsys):
    with json_logs("info"):
        async with running_daemon(kube, kubeconfig) as run:
            await run.until(lambda: run.daemon.watcher is not None, "the watcher")
        records = json_lines(capsys.readouterr().err)
    (started,) = events(records, "canaryd_started")
    assert started["version"] == __version__, started
    assert started["python"] == platform.python_version(), started
