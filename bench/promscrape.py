"""canaryd's /metrics in a window: scraped before and after, read as deltas and as
histogram quantiles the way Prometheus estimates them."""

from __future__ import annotations

import re

import aiohttp
from measure import Results

METRIC_RE = re.compile(r"^(\w+)(?:\{([^}]*)\})? ([0-9.e+-]+|NaN|\+Inf)$")


async def scrape(url: str) -> dict[tuple[str, str], float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as response:
        text = await response.text()
    values: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        match = METRIC_RE.match(line)
        if match:
            values[(match.group(1), match.group(2) or "")] = float(match.group(3))
    return values


def requests_by_verb(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[str, float]:
    verbs: dict[str, float] = {}
    for (name, labels), value in after.items():
        if name == "canaryd_api_requests_total":
            verb = re.search(r'verb="([^"]+)"', labels)
            if verb:
                delta = value - before.get((name, labels), 0.0)
                verbs[verb.group(1)] = verbs.get(verb.group(1), 0.0) + delta
    return verbs


def metric_delta(
    before: dict[tuple[str, str], float],
    after: dict[tuple[str, str], float],
    name: str,
    labels: str = "",
) -> float:
    return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)


def lateness_p99(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> tuple[float, float]:
    """(p99 upper bound, count) of verdict lateness in the window, from the histogram."""
    name = "canaryd_verdict_lateness_seconds_bucket"
    buckets = sorted(
        (
            float(labels.split('"')[1]) if "+Inf" not in labels else float("inf"),
            value - before.get((n, labels), 0.0),
        )
        for (n, labels), value in after.items()
        if n == name
    )
    total = buckets[-1][1] if buckets else 0.0
    for bound, cumulative in buckets:
        if total and cumulative >= 0.99 * total:
            return bound, total
    return float("nan"), total


def stage_quantiles(
    before: dict[tuple[str, str], float],
    after: dict[tuple[str, str], float],
    stage: str,
    quantiles: tuple[float, ...] = (0.5, 0.99),
) -> tuple[list[float], float]:
    """Quantiles of a bump stage in the window, from canaryd_bump_duration_seconds
    (every kind), as Prometheus' histogram_quantile estimates them: linear within the
    bucket that holds the rank. Returns (quantiles in seconds, bumps)."""
    name = "canaryd_bump_duration_seconds_bucket"
    cumulative: dict[float, float] = {}
    for (n, labels), value in after.items():
        if n != name or f'stage="{stage}"' not in labels:
            continue
        bound = re.search(r'le="([^"]+)"', labels)
        assert bound is not None, labels
        le = float(bound.group(1))  # "+Inf" parses as inf
        cumulative[le] = cumulative.get(le, 0.0) + value - before.get((n, labels), 0.0)
    buckets = sorted(cumulative.items())
    total = buckets[-1][1] if buckets else 0.0
    found = []
    for q in quantiles:
        rank, lower, below = q * total, 0.0, 0.0
        estimate = float("nan")
        for bound, count in buckets:
            if total and count >= rank:
                if bound == float("inf"):
                    estimate = lower  # beyond the last finite bound: that bound
                else:
                    share = (rank - below) / (count - below) if count > below else 1.0
                    estimate = lower + (bound - lower) * share
                break
            lower, below = bound, count
        found.append(estimate)
    return found, total


def stage_rows(
    results: Results,
    label: str,
    before: dict[tuple[str, str], float],
    after: dict[tuple[str, str], float],
) -> None:
    """The bump stages' p50/p99 in the window (watch mode: answered and observed)."""
    for stage in ("answered", "observed", "reconciled"):
        (p50, p99), bumps = stage_quantiles(before, after, stage)
        if not bumps:
            results.add(
                f"{label}: bump stage {stage}, p50 / p99",
                "no samples (watch mode measures answered and observed)",
                "-",
                None,
            )
            continue
        results.add(
            f"{label}: bump stage {stage}, p50 / p99",
            f"{p50 * 1000:.1f} ms / {p99 * 1000:.1f} ms ({bumps:.0f} bumps)",
            "p99 <= 1 s (the SLO)" if stage == "observed" else "-",
            p99 <= 1.0 if stage == "observed" else None,
        )
