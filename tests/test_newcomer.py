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


def test_the_readme_stands_alone_every_path_it_names_is_in_the_repository():
    """A reader has the repository, not the project's shared folder: every file or
    directory of it the README names exists, and nothing points outside it."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    assert "shared folder" not in readme and "seed's" not in readme
    named = set(
        re.findall(r"(?<![\w/.])((?:config|docs|tests|canaryd|bench)/[\w./-]*[\w/])", readme)
    )
    assert {"docs/DESIGN.md", "config/helm/post-render", "config/samples"} <= named, named
    not_paths = {"canaryd/canaryd"}  # the ServiceAccount's namespace/name
    missing = sorted(p for p in named - not_paths if not (root / p).exists())
    assert not missing, missing
    assert "--once`; otherwise" not in readme  # make demo cannot pass --once
    assert ".venv/bin/canaryd" in readme and "apply -n default -k config/samples" in readme
