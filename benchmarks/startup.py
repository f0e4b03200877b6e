"""Start-up costs: importing slipstream (and its Accelerator) vs ``import torch``,
``slipstream --help`` vs ``import torch``, and launch to the first training step of a tiny
DDP model on N CPU processes: ``slipstream launch -n N`` of a slipstream script against
``torchrun`` of the same step written by hand (``init_process_group`` + DDP), with
``torchrun`` of the slipstream script between them (what the launcher adds and what the
script's slipstream parts add, apart). Variants alternate which goes first; the ratio is
the median of the per-repetition ratios.

    python benchmarks/startup.py                      # launch on 2 processes
    python benchmarks/startup.py --processes 2 8 32   # launch at scale (no import rows)
    python benchmarks/startup.py --quick              # one repetition (smoke test)

With ``--quick`` each row runs once, one ``import torch`` timing serves all three import
rows (two fewer interpreters started), and the launches start one process each (every code
path, four fewer interpreters than at 2).
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

FIRST_STEP = """
import os, sys, time
import torch
from torch import nn
from slipstream import Accelerator
accelerator = Accelerator()
model = accelerator.prepare(nn.Linear(4, 4))
accelerator.backward(model(torch.ones(2, 4)).sum())
if accelerator.is_main_process:
    with open(sys.argv[1], "w") as handle:
        handle.write(str(time.time()))
"""

HAND_WRITTEN_FIRST_STEP = """
import os, sys, time
import torch
import torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
model(torch.ones(2, 4)).sum().backward()
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as handle:
        handle.write(str(time.time()))
# (a rank leaving while the others still finish the all-reduce would fail them)
dist.barrier()
dist.destroy_process_group()
"""


def _seconds(command: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=env)
    return time.perf_counter() - start


#: CPU seconds (user + system) of each launch command's whole process tree, per run.
CPU_SECONDS: dict[tuple[str, ...], list[float]] = {}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _first_step(command: list[str], marker: str) -> float:
    cpu = _children_cpu()
    start = time.time()
    done = subprocess.run(
        [*command, marker],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    # (every process of the tree was waited for by its parent, so its CPU time is counted)
    CPU_SECONDS.setdefault(tuple(command), []).append(_children_cpu() - cpu)
    with open(marker) as handle:
        return float(handle.read()) - start


def _compare(
    ours: Callable[[], float], theirs: Callable[[], float], repeats: int
) -> tuple[float, float, float]:
    """Medians of both and the median of per-repetition ratios; which runs first alternates."""
    a, b, ratio = _compare_all([ours, theirs], repeats)
    return a, b, ratio


def _compare_all(variants: list[Callable[[], float]], repeats: int) -> tuple[float, ...]:
    """Median time of each variant, then the median per-repetition ratio of each to the last;
    the order rotates from one repetition to the next."""
    times: list[list[float]] = [[] for _ in variants]
    for repetition in range(repeats):
        shift = repetition % len(variants)
        for index in [*range(shift, len(variants)), *range(shift)]:
            times[index].append(variants[index]())
    medians = [statistics.median(values) for values in times]
    ratios = [
        statistics.median(a / b for a, b in zip(values, times[-1], strict=True))
        for values in times[:-1]
    ]
    return (*medians, *ratios)


def launch_at_scale(processes: list[int], repeats: int) -> None:
    python = sys.executable
    with tempfile.TemporaryDirectory() as folder:
        scripts = {}
        for name, text in [("slipstream", FIRST_STEP), ("hand", HAND_WRITTEN_FIRST_STEP)]:
            scripts[name] = os.path.join(folder, f"first_step_{name}.py")
            with open(scripts[name], "w") as handle:
                handle.write(text)
        marker = os.path.join(folder, "marker")
        for count in processes:
            torchrun = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(count),
                        "--standalone"]  # fmt: skip
            variants = [
                [python, "-m", "slipstream.cli", "launch", "-n", str(count), "--cpu",
                 scripts["slipstream"]],
                [*torchrun, scripts["slipstream"]],
                [*torchrun, scripts["hand"]],
            ]  # fmt: skip
            ours, mixed, hand, ratio, mixed_ratio = _compare_all(
                [functools.partial(_first_step, command, marker) for command in variants],
                repeats,
            )
            cpu = [statistics.median(CPU_SECONDS[tuple(c)]) / count for c in variants]
            print(
                f"launch -n {count:<3d} to first step: slipstream {ours:6.2f}s, torchrun + "
                f"slipstream script {mixed:6.2f}s, torchrun + hand-written {hand:6.2f}s  "
                f"ratio {ratio:.3f}x (torchrun + slipstream script {mixed_ratio:.3f}x); CPU "
                f"per process {cpu[0]:.2f} / {cpu[1]:.2f} / {cpu[2]:.2f} s"
            )


def compile_bytecode() -> None:
    """Write slipstream's bytecode caches, as installing a wheel does: a checkout installed
    in editable mode under ``PYTHONDONTWRITEBYTECODE=1`` would otherwise compile its ~90
    modules from source in every process (~0.3 s of CPU each), which torch, installed,
    never does."""
    import compileall

    for package in ("slipstream", "slipstream.integrations"):
        for folder in _package_folders(package):
            compileall.compile_dir(folder, quiet=1)


def _package_folders(name: str) -> list[str]:
    """The folders of package ``name``, found without importing it or its parents (which
    would import torch in this process, ~2 s of CPU that no row measures)."""
    parent = name.rpartition(".")[0]
    path = _package_folders(parent) if parent else None
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(name, path) if find_spec is not None else None
        if spec is not None:
            return list(spec.submodule_search_locations or [])
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="one repetition, one import-torch timing for every row"
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--processes", type=int, nargs="+", help="launch only, at these process counts"
    )
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    compile_bytecode()
    if args.processes:
        launch_at_scale(args.processes, repeats)
        return
    python = sys.executable
    torch_alone = functools.partial(_seconds, [python, "-c", "import torch"])
    if args.quick:  # its one timing serves every row
        torch_alone = functools.cache(torch_alone)
    rows = {
        "import slipstream vs import torch": [python, "-c", "import slipstream"],
        "from slipstream import Accelerator vs import torch": [
            python,
            "-c",
            "from slipstream import Accelerator",
        ],
        "slipstream --help vs import torch": [python, "-m", "slipstream.cli", "--help"],
    }
    for label, ours in rows.items():
        a, b, ratio = _compare(functools.partial(_seconds, ours), torch_alone, repeats)
        print(f"{label:52s} {a:6.3f}s vs {b:6.3f}s  ratio {ratio:.3f}x")
    launch_at_scale([1] if args.quick else [2], repeats)


if __name__ == "__main__":
    main()
