"""Restarts per scenario under the real kubelet and under tests/kubelet.py's simulation.

tests/fixtures/node-restarts.json holds, per scenario, topology and container, the
restarts the real kubelet made (``make e2e-node``, read from pod status) and the ones
the simulation makes (``make test-slow``, tests/test_kubelet.py), and why they differ where
they do. Each side checks its own figures against it: tests/test_e2e_node.py its
measurements (``real``, within ``real_bounds`` where a count depends on timing),
tests/test_kubelet.py the simulation's (``sim``, within ``sim_bounds``). The table of
docs/NODE.md is generated from it:

    python -m tests.node.restarts      # rewrites the table in docs/NODE.md

and ``make test`` fails when the table and the fixture differ.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "node-restarts.json"
DOC = ROOT / "docs" / "NODE.md"
BEGIN = (
    "<!-- restarts table: generated from tests/fixtures/node-restarts.json"
    " by `python -m tests.node.restarts` -->"
)
END = "<!-- end of the generated table -->"


def load() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(FIXTURE.read_text())
    return data


def rows() -> list[dict[str, Any]]:
    return list(load()["rows"])


def row(scenario: str, topology: str, container: str) -> dict[str, Any]:
    for found in rows():
        if (found["scenario"], found["topology"], found["container"]) == (
            scenario,
            topology,
            container,
        ):
            return found
    raise AssertionError(f"no row for {scenario!r} / {topology} / {container} in {FIXTURE}")


def bounds(found: dict[str, Any], side: str) -> tuple[int, int]:
    """The accepted range of a side's count: ``<side>_bounds``, else exactly ``<side>``."""
    low, high = found.get(f"{side}_bounds") or (found[side], found[side])
    return int(low), int(high)


def within(found: dict[str, Any], side: str, count: int) -> bool:
    low, high = bounds(found, side)
    return low <= count <= high


def _count(found: dict[str, Any], side: str) -> str:
    value = found.get(side)
    if value is None:
        return "not run"
    why = found.get(f"{side}_why")
    return f"{value} ({why})" if why else str(value)


def table(data: dict[str, Any] | None = None) -> str:
    data = data or load()
    lines = [
        "| topology | scenario | container | real kubelet | simulation | |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for found in data["rows"]:
        lines.append(
            f"| {found['topology']} | {found['scenario']} | {found['container']} "
            f"| {_count(found, 'real')} | {_count(found, 'sim')} "
            f"| {found.get('difference') or 'same'} |"
        )
    return "\n".join(lines)


def block(text: str) -> str:
    """The generated table as it stands in a document."""
    match = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    assert match, f"no generated table between {BEGIN!r} and {END!r}"
    return match.group(1).rstrip("\n")


def write(doc: Path = DOC) -> None:
    text = doc.read_text()
    start = text.index(BEGIN)
    end = text.index(END, start) + len(END)
    doc.write_text(f"{text[:start]}{BEGIN}\n{table()}\n{END}{text[end:]}")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else DOC)
