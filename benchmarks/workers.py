"""Run a benchmark script's worker on several local processes and collect its reports.

A worker prints each report as one ``BENCH {json}`` line (from one process only: two
processes printing at once can interleave their lines); :func:`run_workers` starts the
script on local processes and returns the parsed reports. The overhead scripts time their variants
with :func:`run_generations` and :func:`time_rounds` and report :func:`paired_statistics`
(built on :func:`median_ratio` and :func:`median_ratio_interval`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
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
    stdout, stderr = _launch([sys.executable, script, *arguments], processes, env or {})
    reports = [
        json.loads(line[len(_PREFIX) :]) for line in stdout.splitlines() if line.startswith(_PREFIX)
    ]
    if not reports:
        name = os.path.basename(script)
        raise SystemExit(f"{name} {' '.join(arguments)} failed:\n{stderr[-3000:]}")
    return reports


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(command: list[str], processes: int, env: dict[str, str]) -> tuple[str, str]:
    """Start ``processes`` ranks of ``command`` with the variables torchrun would set (no
    agent process: the variants compared are the training steps, not the launcher — see
    startup.py for that); when one rank fails, stop the others. Returns stdout (every
    rank's) and stderr."""
    port = str(_free_port())
    ranks = []
    with tempfile.TemporaryDirectory() as folder:
        for rank in range(processes):
            variables = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(processes),
                "LOCAL_WORLD_SIZE": str(processes),
                **env,
            }
            out = open(os.path.join(folder, f"{rank}.out"), "w+")  # noqa: SIM115
            err = open(os.path.join(folder, f"{rank}.err"), "w+")  # noqa: SIM115
            ranks.append(
                (subprocess.Popen(command, stdout=out, stderr=err, env=variables), out, err)
            )
        while any([p.poll() is None for p, _, _ in ranks]):  # a list: poll every rank
            if any(p.returncode not in (None, 0) for p, _, _ in ranks):
                for p, _, _ in ranks:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.05)
        texts = []
        for p, out, err in ranks:
            p.wait()
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
            out.close()
            err.close()
    return "".join(o for o, _ in texts), "".join(e for _, e in texts)


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


# -- paired step timing (the overhead scripts) ------------------------------------------------
# A variant is an object with a ``name``, a ``loader`` and a ``step(batch)``; every generation
# builds each variant afresh, and every round runs each of them (rotating which goes first)
# for ``warmup`` untimed and ``timed`` timed steps.


def time_rounds(
    runs: list[Any],
    rounds: int,
    timed: int,
    warmup: int,
    wall: dict[str, list[float]],
    cpu: dict[str, list[float]],
) -> None:
    """Run the rounds, appending each timed step's wall and main-thread CPU seconds."""
    import time

    import torch.distributed as dist

    iterators = [iter(run.loader) for run in runs]
    for round_index in range(rounds):
        # Rotate which variant goes first so none always runs right after another.
        shift = round_index % len(runs)
        for index in list(range(shift, len(runs))) + list(range(shift)):
            run, iterator = runs[index], iterators[index]
            dist.barrier()
            for _ in range(warmup):
                run.step(next(iterator))
            for _ in range(timed):
                batch = next(iterator)
                start, start_cpu = time.perf_counter(), time.thread_time()
                run.step(batch)
                cpu[run.name].append(time.thread_time() - start_cpu)
                wall[run.name].append(time.perf_counter() - start)


def on_every_process(same: bool) -> bool:
    """Whether ``same`` holds on every process (a MIN all-reduce)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor(int(same))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def run_generations(
    variants: list[Any],
    generations: int,
    generation: Callable[[list[Any], dict[str, list[float]], dict[str, list[float]]], Any],
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, bool], list[Any]]:
    """Run ``generation(order, wall, cpu)`` ``generations`` times; it returns
    ``(weights equal per variant name, anything else)``. Returns the step times, whether
    each variant (all but the first, the reference) always ended equal, and the extras."""
    import gc

    wall: dict[str, list[float]] = {kind.name: [] for kind in variants}
    cpu: dict[str, list[float]] = {kind.name: [] for kind in variants}
    equal = {kind.name: True for kind in variants[1:]}
    extras = []
    shuffle = random.Random(0)  # the same order on every rank
    for _ in range(generations):
        # A fresh set of objects each generation, built (and rotated) in a different order,
        # so that no variant keeps a lucky or unlucky memory layout or neighbour all run.
        order = list(variants)
        shuffle.shuffle(order)
        same, extra = generation(order, wall, cpu)
        for name, value in same.items():
            equal[name] = equal[name] and value
        extras.append(extra)
        gc.collect()
    return wall, cpu, equal, extras


def paired_statistics(
    wall: dict[str, list[float]], cpu: dict[str, list[float]], timed: int
) -> dict[str, Any]:
    """The report's step statistics. Step i of a variant is compared with step i of the
    hand-written loop ("torch") in the same round, against each of its two identical copies
    ("torch" and "control") separately (a mean of two steps would not be distributed like
    one step), and the two median ratios are averaged; the control is compared with the
    first copy alone, which shows how far two identical loops differ on this machine.
    ``cpu_extra_us`` is the main-thread CPU time per step above the hand-written loop's:
    the work the library itself adds, without the waiting on the other process."""

    def bases(name: str, measured: dict[str, list[float]]) -> list[list[float]]:
        if name == "control":
            return [measured["torch"]]
        return [measured["torch"], measured["control"]]

    return {
        "steps": len(wall["torch"]),
        "medians": {name: statistics.median(values) for name, values in wall.items()},
        "ratios": {name: median_ratio(values, bases(name, wall)) for name, values in wall.items()},
        "intervals": {
            name: median_ratio_interval(values, bases(name, wall), timed)
            for name, values in wall.items()
        },
        "cpu_extra_us": {
            name: 1e6
            * statistics.fmean(
                statistics.median([v - b for v, b in zip(values, base, strict=True)])
                for base in bases(name, cpu)
            )
            for name, values in cpu.items()
        },
    }


def print_step_ratios(label: str, result: dict[str, Any], width: int) -> None:
    """One line per variant of a paired benchmark: its median step against plain torch's, the
    ratio with its 95% interval, the extra CPU time per step and whether weights matched."""
    medians = result["medians"]
    for name, ratio in result["ratios"].items():
        if name == "torch":
            continue
        same = "equal" if result["weights_equal"][name] else "DIFFERENT"
        low, high = result["intervals"][name]
        print(
            f"{label:{width}s} {name:10s} step {medians[name] * 1e3:8.3f} ms vs torch "
            f"{medians['torch'] * 1e3:8.3f} ms  ratio {ratio:.3f}x  (95% interval "
            f"{low:.3f}-{high:.3f}; {result['cpu_extra_us'][name]:+.0f} us CPU per step; "
            f"weights {same})"
        )


def case_arguments(
    description: str, cases: Iterable[str], sizes: Iterable[str]
) -> argparse.Namespace:
    """The command line of a benchmark timed case by case (a layout or schedule, and a model
    size): ``--quick``, the worker's ``--worker CASE --size SIZE`` and round overrides."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", choices=sorted(cases))
    parser.add_argument("--size", choices=sorted(sizes))
    parser.add_argument("--generations", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--timed", type=int, help="timed steps per variant and round")
    return parser.parse_args()


def run_cases(
    script: str,
    args: argparse.Namespace,
    rounds: Mapping[tuple[str, str], tuple[int, int, int]],
    quick: tuple[str, str],
    processes: Callable[[str], int],
) -> Iterator[tuple[str, str, int, dict[str, Any]]]:
    """Run ``script``'s worker for each (case, size) of ``rounds`` (only ``quick`` with
    ``--quick``); yields the case, the size, its process count and rank 0's report."""
    for case, size in [quick] if args.quick else list(rounds):
        generations, rounds_, timed = (1, 2, 2) if args.quick else rounds[case, size]
        arguments = ["--worker", case, "--size", size,
                     "--generations", str(args.generations or generations),
                     "--rounds", str(args.rounds or rounds_),
                     "--timed", str(args.timed or timed)]  # fmt: skip
        count = processes(case)
        yield case, size, count, run_workers(script, arguments, processes=count)[0]
