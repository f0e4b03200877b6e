"""Start-up costs: importing slipstream (and its Accelerator) vs ``import torch``,
``slipstream --help`` vs
``import torch``, and ``slipstream launch -n 2`` vs plain ``torchrun`` from start to the
first training step. Variants alternate, several repetitions, medians compared.

    python benchmarks/startup.py
    python benchmarks/startup.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
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
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        for _ in range(repeats):
            times["ours"].append(_seconds(ours))
            times["theirs"].append(_seconds(theirs))
        a, b = statistics.median(times["ours"]), statistics.median(times["theirs"])
        print(f"{label:52s} {a:6.3f}s vs {b:6.3f}s  ratio {a / b:.3f}x")
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
        times = {name: [] for name in launchers}
        for _ in range(repeats):
            for name, command in launchers.items():
                times[name].append(_first_step(command, marker))
        a, b = statistics.median(times["slipstream"]), statistics.median(times["torchrun"])
        label = "launch -n 2: start to first step vs torchrun"
        print(f"{label:52s} {a:6.3f}s vs {b:6.3f}s  ratio {a / b:.3f}x")


if __name__ == "__main__":
    main()
