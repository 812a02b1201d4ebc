"""What a newcomer meets first: --help, the JSON body, the metrics (issue 12)."""

from __future__ import annotations

import json

from canaryd import metrics
from canaryd.config import build_parser
from canaryd.registry import CanaryState
from tests.harness import create_canary, running_daemon


def test_help_shows_every_default_and_describes_every_flag():
    text = build_parser().format_help()
    for wanted in (
        "(default: 1 min",
        "(default: 8085)",
        "(default: 0.0.0.0)",
        "(default: 5 min)",
        "(default: json)",
        "(default: info)",
        "(default: all namespaces)",
        "(default: flink.apache.org/canary)",
        "(default: flinkdeployments,flinksessionjobs)",
        "one JSON object a line",
        "least severe level logged",
    ):
        assert wanted in " ".join(text.split()), wanted


async def test_the_json_says_which_bump_the_reason_is_about(kube, kubeconfig):
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        await run.until(
            lambda: run.tracked().bumped_generation is not None, "a bump waiting to be judged"
        )
        _, text = await run.get("/healthz", Accept="application/json")
        (entry,) = json.loads(text)["canaries"]
        assert f"generation {entry['judgedGeneration']} observed" in entry["reason"]
        assert entry["pendingGeneration"] == entry["bumpedGeneration"]
        assert entry["judgedGeneration"] < entry["pendingGeneration"]


async def test_watched_namespaces_counts_all_namespaces_when_all_are_watched(kube, kubeconfig):
    for name in ("a", "b", "c"):
        kube.create_namespace(name)
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_tracked()
        await run.until(lambda: metrics.WATCHED_NAMESPACES._value.get() == 4, "4 namespaces")
        kube.delete(kube.types["namespaces"], None, "c")
        await run.until(lambda: metrics.WATCHED_NAMESPACES._value.get() == 3, "3 namespaces")


def test_no_module_over_550_lines_and_no_class_over_350():
    """Issue 44's house rules, kept as the code changes: a module a newcomer reads in one
    sitting, a class whose whole can be held in mind (canaryd/testing is test tooling)."""
    import ast
    from pathlib import Path

    import canaryd

    too_long = []
    package = Path(canaryd.__file__).parent
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] == "testing":
            continue
        text = path.read_text()
        if (lines := len(text.splitlines())) > 550:
            too_long.append(f"{path.name}: {lines} lines")
        classes = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef)]
        for node in classes:
            if (size := (node.end_lineno or node.lineno) - node.lineno + 1) > 350:
                too_long.append(f"{path.name}: class {node.name}, {size} lines")
    assert not too_long, too_long
