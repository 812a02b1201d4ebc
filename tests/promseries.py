"""Recorded /metrics scrapes of real canaryd runs as promtool unit tests.

A ``Recording`` (tests/kubelet.py) holds what Prometheus would have scraped on the
scaled clock. ``input_series`` turns it into promtool's input series with the time
scaled back to the shipped one: one step per scrape interval (the monitors' 30 s),
the value of the scrape of that tick, a staleness marker where Prometheus writes
one (a failed scrape, a series or a target that went away) and nothing where there
was no scrape. ``check_alerts`` then runs config/monitoring's rules over them with
promtool and asserts which alerts fire, and for whom, at given shipped times: a rule
that cannot fire on canaryd's real output fails.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import tempfile
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from canaryd.config.parse import parse_duration
from tests.kubelet import Recording, Scrape, Target

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "config" / "monitoring"
EVALUATION = 60.0
"""Rule evaluation interval (Prometheus' default global evaluation_interval, 1 m)."""


def promtool() -> str | None:
    """promtool on PATH, or Debian's (`apt-get download prometheus`, unpacked into
    .cache/promtool without installing anything); None when neither can be had."""
    found = shutil.which("promtool")
    if found:
        return found
    cached = ROOT / ".cache" / "promtool" / "usr" / "bin" / "promtool"
    if cached.exists():
        return str(cached)
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run(
            ["apt-get", "download", "prometheus"], cwd=tmp, capture_output=True, timeout=300
        )
        debs = list(Path(tmp).glob("prometheus_*.deb"))
        if got.returncode != 0 or not debs:
            return None
        target = cached.parents[2]
        target.mkdir(parents=True, exist_ok=True)  # dpkg-deb -x makes only the last level
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(target)], check=True)
    return str(cached) if cached.exists() else None


def rule_groups() -> dict[str, Any]:
    """The PrometheusRule's spec: what Prometheus loads as a rule file."""
    spec: dict[str, Any] = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]
    return spec


def rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups()["groups"] for rule in group["rules"]]


def alert_for(alert: str) -> float:
    """The alert's ``for:``, in seconds."""
    rule = next(r for r in rules() if r.get("alert") == alert)
    return parse_duration(rule.get("for", "0s"))


def names_the_rules_read() -> set[str]:
    return {
        name for rule in rules() for name in re.findall(r"\b(?:canaryd_\w+|up)\b", rule["expr"])
    }


# ---------------------------------------------------------------- series


SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


def _value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Inf" if value > 0 else "-Inf"
    return f"{value:.17g}"


def steps(recording: Recording) -> dict[Target, dict[int, Scrape]]:
    """Each target's scrapes by step (the tick they were stamped with)."""
    step = recording.scale(recording.interval)
    found: dict[Target, dict[int, Scrape]] = {}
    for scrape in recording.scrapes:
        found.setdefault(scrape.target, {})[round((scrape.at - recording.start) / step)] = scrape
    return found


def input_series(
    recording: Recording, names: Collection[str] | None = None
) -> list[dict[str, str]]:
    """promtool ``input_series``: every sample named in ``names`` (all when None), with
    its target's labels, and ``up`` per target, one value per scrape interval."""
    by_target = steps(recording)
    total = 1 + max((k for scrapes in by_target.values() for k in scrapes), default=0)
    series: dict[SeriesKey, list[str]] = {}

    def put(key: SeriesKey, k: int, token: str) -> None:
        values = series.setdefault(key, [])
        values += ["_"] * (k - len(values)) + [token]

    for target, scrapes in by_target.items():
        target_labels = dict(target.labels)
        up_key: SeriesKey = ("up", tuple(sorted(target_labels.items())))
        present: set[SeriesKey] = set()
        for k in range(total):
            scrape = scrapes.get(k)
            now: dict[SeriesKey, float] = {}
            if scrape is None:
                # No scrape at this tick: the pod not there yet, or deleted (its target
                # goes: Prometheus marks what it had scraped stale, once).
                if series.get(up_key, ["_"])[-1] not in ("_", "stale"):
                    put(up_key, k, "stale")
            else:
                put(up_key, k, "1" if scrape.ok else "0")
                for (name, labels), value in scrape.samples.items():
                    if names is None or name in names:
                        now[(name, tuple(sorted({**dict(labels), **target_labels}.items())))] = (
                            value
                        )
            for key in present - now.keys():
                put(key, k, "stale")  # a failed scrape, or a series the target dropped
            for key, value in now.items():
                put(key, k, _value(value))
            present = set(now)
    return [
        {
            "series": name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels) + "}",
            "values": " ".join(values + ["_"] * (total - len(values))),
        }
        for (name, labels), values in sorted(series.items())
    ]


# ---------------------------------------------------------------- checks


@dataclass(frozen=True)
class Expect:
    """At ``at`` (shipped seconds since the recording began), ``alert`` is in ``state``
    (firing or pending) for exactly these pods."""

    alert: str
    at: float
    pods: Collection[str]
    state: str = "firing"
    why: str = ""

    def test(self) -> dict[str, Any]:
        pods = sorted(self.pods)
        return {
            # PromQL comments: promtool prints the expression of a check that fails.
            "expr": (
                f"# {self.alert} {self.state} for {pods or 'nobody'} at {int(self.at)}s: "
                f"{self.why}\n"
                f'count by (pod) (ALERTS{{alertname="{self.alert}", alertstate="{self.state}"}})'
            ),
            "eval_time": f"{int(self.at)}s",
            "exp_samples": [{"labels": f'{{pod="{pod}"}}', "value": 1} for pod in pods],
        }


def on_grid(shipped: float, up: bool = False) -> float:
    """A rule evaluation time: ``shipped`` rounded down (or up) to the evaluation grid."""
    return (math.ceil if up else math.floor)(shipped / EVALUATION) * EVALUATION


def check_alerts(
    recording: Recording,
    expectations: Sequence[Expect],
    workdir: Path,
    tool: str,
    evaluation: float = EVALUATION,
) -> None:
    """Run the rules over the recording with promtool, evaluated every ``evaluation``
    shipped seconds; fail naming what did not hold."""
    rule_file = workdir / "canaryd-rules.yaml"
    rule_file.write_text(yaml.safe_dump(rule_groups()))
    names = names_the_rules_read()
    test = {
        "rule_files": [str(rule_file)],
        "evaluation_interval": f"{int(evaluation)}s",
        "tests": [
            {
                "interval": f"{int(recording.interval)}s",
                "input_series": input_series(recording, names),
                "promql_expr_test": [e.test() for e in expectations],
            }
        ],
    }
    test_file = workdir / "recorded-alerts-test.yaml"
    test_file.write_text(yaml.safe_dump(test, width=1000))
    ran = subprocess.run(
        [tool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, (
        f"promtool on the recorded scrapes ({test_file}):\n{ran.stdout}{ran.stderr}"
    )
