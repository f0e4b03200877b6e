"""Start-up costs: importing slipstream (and its Accelerator) vs ``import torch``,
``slipstream --help`` vs ``import torch``, and ``slipstream launch -n 2`` vs plain
``torchrun`` from start to the first training step. Variants alternate which goes first;
the ratio is the median of the per-repetition ratios.

    python benchmarks/startup.py
    python benchmarks/startup.py --quick
"""

from __future__ import annotations

import argparse
import functools
import os
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


def _seconds(command: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def _first_step(command: list[str], marker: str) -> float:
    start = time.time()
    subprocess.run(
        [*command, marker],
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    with open(marker) as handle:
        return float(handle.read()) - start


def _compare(
    ours: Callable[[], float], theirs: Callable[[], float], repeats: int
) -> tuple[float, float, float]:
    """Medians of both and the median of per-repetition ratios; which runs first alternates."""
    pairs = []
    for repetition in range(repeats):
        if repetition % 2:
            b, a = theirs(), ours()
        else:
            a, b = ours(), theirs()
        pairs.append((a, b))
    return (
        statistics.median(a for a, _ in pairs),
        statistics.median(b for _, b in pairs),
        statistics.median(a / b for a, b in pairs),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    python = sys.executable
    pairs = {
        "import slipstream vs import torch": (
            [python, "-c", "import slipstream"],
            [python, "-c", "import torch"],
        ),
        "from slipstream import Accelerator vs import torch": (
            [python, "-c", "from slipstream import Accelerator"],
            [python, "-c", "import torch"],
        ),
        "slipstream --help vs import torch": (
            [python, "-m", "slipstream.cli", "--help"],
            [python, "-c", "import torch"],
        ),
    }
    for label, (ours, theirs) in pairs.items():
        a, b, ratio = _compare(
            functools.partial(_seconds, ours), functools.partial(_seconds, theirs), repeats
        )
        print(f"{label:52s} {a:6.3f}s vs {b:6.3f}s  ratio {ratio:.3f}x")
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "first_step.py")
        with open(script, "w") as handle:
            handle.write(FIRST_STEP)
        marker = os.path.join(folder, "marker")
        launchers = {
            "slipstream": [python, "-m", "slipstream.cli", "launch", "-n", "2", "--cpu", script],
            "torchrun": [
                python,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--standalone",
                script,
            ],
        }
        a, b, ratio = _compare(
            functools.partial(_first_step, launchers["slipstream"], marker),
            functools.partial(_first_step, launchers["torchrun"], marker),
            repeats,
        )
        label = "launch -n 2: start to first step vs torchrun"
        print(f"{label:52s} {a:6.3f}s vs {b:6.3f}s  ratio {ratio:.3f}x")


if __name__ == "__main__":
    main()
