"""Run a benchmark script's worker on several local processes and collect its reports.

A worker prints each report as one ``BENCH {json}`` line (from one process only: two
processes printing at once can interleave their lines); :func:`run_workers` starts the
script under torchrun and returns the parsed reports. :func:`median_ratio` and
:func:`median_ratio_interval` are the paired step-time statistics of the overhead scripts.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from typing import Any

_PREFIX = "BENCH "


def report(data: dict[str, Any]) -> None:
    """Print one report line for :func:`run_workers` to collect."""
    print(_PREFIX + json.dumps(data), flush=True)


def run_workers(
    script: str, arguments: list[str], processes: int = 2, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run ``script arguments`` on ``processes`` processes; the reports they printed.

    Exits with the workers' stderr when they reported nothing.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
               str(processes), "--standalone", script, *arguments]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    reports = [
        json.loads(line[len(_PREFIX) :])
        for line in done.stdout.splitlines()
        if line.startswith(_PREFIX)
    ]
    if not reports:
        name = os.path.basename(script)
        raise SystemExit(f"{name} {' '.join(arguments)} failed:\n{done.stderr[-3000:]}")
    return reports


def median_ratio(values: list[float], bases: list[list[float]]) -> float:
    """Median per-step ratio against each baseline (paired step by step), averaged."""
    return statistics.fmean(
        statistics.median([v / b for v, b in zip(values, base, strict=True)]) for base in bases
    )


def median_ratio_interval(
    values: list[float], bases: list[list[float]], timed: int, draws: int = 300
) -> tuple[float, float]:
    """95% bootstrap interval of :func:`median_ratio`, resampling whole rounds of ``timed``
    steps (the steps of one round share its conditions)."""
    rounds = range(0, len(values), timed)
    pick = random.Random(1)
    estimates = []
    for _ in range(draws):
        chosen = [i + j for i in pick.choices(rounds, k=len(rounds)) for j in range(timed)]
        estimates.append(
            median_ratio([values[i] for i in chosen], [[base[i] for i in chosen] for base in bases])
        )
    estimates.sort()
    return estimates[int(0.025 * draws)], estimates[int(0.975 * draws) - 1]
