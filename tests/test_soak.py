"""The reliability soak: about 100 cycles here (`make test-slow`), 1,000 with `make soak`."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.soak import Soak, SoakConfig

CYCLES = int(os.environ.get("CANARYD_SOAK_CYCLES", "100"))


def write_report(path: Path, report: object) -> None:
    path.write_text(json.dumps(asdict(report), indent=2))  # type: ignore[call-overload]


@pytest.mark.slow
@pytest.mark.timeout(CYCLES * 2 + 120)
async def test_soak_survives_faults_and_detects_every_stuck_period(kube, kubeconfig):
    config = SoakConfig(cycles=CYCLES)
    report = await Soak(kube, config).run(kubeconfig)
    print("\n" + "\n".join(report.lines()))
    if target := os.environ.get("CANARYD_SOAK_REPORT"):
        write_report(Path(target), report)
    budget = 2.5 * config.cycle
    assert report.false_unhealthy_polls == 0
    assert report.false_unhealthy_verdicts == 0
    assert report.stuck_periods, "no stuck period was played"
    for period in report.stuck_periods:
        assert period["detected_in"] <= budget, period
        assert period["healed_in"] <= budget, period
    assert report.min_bumps >= CYCLES // 2  # every canary kept being bumped
    assert report.labels_expected > 0 and report.labels_missing == 0
    assert report.unscheduled_polls == 0, report.unscheduled[:10]
    # A leak grows at every step; what canaryd holds at a given moment (heap entries,
    # requests in flight, failing subjects) differs from moment to moment by tens of
    # KiB, up or down. A leak of the smallest tracked object (56 B) per canary and cycle
    # over the traced cycles is the scale: the check fails on growth at both steps that
    # adds up to half of it (each measurement is the least of four moments a cycle
    # apart, tests/soak.py).
    traced_cycles = CYCLES - (CYCLES // 2 + 5) + 3
    leak_kib = config.canaries * traced_cycles * 56 / 1024
    first = report.traced_kib_late - report.traced_kib_mid
    second = report.traced_kib_end - report.traced_kib_late
    assert not (first > 0 and second > 0 and first + second > leak_kib / 2), (
        f"canaryd's traced memory grew {first:.0f} then {second:.0f} KiB over "
        f"{traced_cycles} cycles (a leak of 56 B per canary-cycle is {leak_kib:.0f} KiB)",
        report.traced_growth,
    )
