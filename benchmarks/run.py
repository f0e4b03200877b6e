"""Run every benchmark and write a report: a table on stdout, ``results/report.md`` and a
chart of the ratios against their targets, ``results/ratios.png``.

    python benchmarks/run.py            # full sizes (about 25 minutes on 2 cores)
    python benchmarks/run.py --quick    # smoke test of every script
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = [
    "ddp_overhead.py",
    "diagnostics_overhead.py",
    "tp_overhead.py",
    "pp_overhead.py",
    "pp_bubble.py",
    "ep_overhead.py",
    "fault_tolerance.py",
    "trainer_overhead.py",
    "startup.py",
    "gather_metrics.py",
    "checkpoint_io.py",
    "sharded_memory.py",
    "tp_memory.py",
    "pp_memory.py",
    "ep_memory.py",
    "plan_accuracy.py",
    "sharded_save.py",
    "stream_reads.py",
    "big_model.py",
]
# (script, pattern in one of its result lines, target ratio: at most) — from the performance
# and N-D parallelism issues. Patterns only apply to their own script's lines: "slipstream
# step" means a different target in ddp_overhead.py than in tp_overhead.py.
TARGETS = [
    ("ddp_overhead.py", r"slipstream step", 1.01),
    # slipstream's Python alone: the same loop with DDP's all-reduce over gloo.
    ("ddp_overhead.py", r"slipstream \(gloo\) step", 1.01),
    ("tp_overhead.py", r"slipstream step", 1.02),
    ("pp_overhead.py", r"slipstream step", 1.02),
    ("ep_overhead.py", r"slipstream step", 1.02),
    # torchft's quorum and commit vote cost a fixed ~2 ms a step: within the A/A noise on a
    # ~50 ms step, not on a 4 ms one (the tiny line has no target).
    ("fault_tolerance.py", r"^medium fault-tolerant", 1.05),
    # transformers' Trainer: at least as many steps per second on slipstream as on Accelerate.
    ("trainer_overhead.py", r"Trainer on slipstream", 1.0),
    ("startup.py", r"import torch, slipstream", 1.05),
    ("startup.py", r"from slipstream import Accelerator", 1.05),
    ("startup.py", r"slipstream --help", 1.05),
    # Launch to the first step against torchrun of the same step written by hand, 2-32 processes.
    ("startup.py", r"launch -n\s*\d+", 1.05),
    ("gather_metrics.py", r"gather_for_metrics", 1.10),
    ("checkpoint_io.py", r"save_state vs torch.save", 1.10),
    ("checkpoint_io.py", r"load_state vs torch.load", 1.10),
    ("checkpoint_io.py", r"save_model", 1.10),
    ("sharded_memory.py", r"fsdp vs ddp", 0.60),
    ("sharded_memory.py", r"zero3 vs ddp", 0.60),
    # About 1/P, as for FSDP2: tensor parallelism over 2 processes, and over 2 x 2 sharding.
    ("tp_memory.py", r"\btp2 vs ddp", 0.60),
    ("tp_memory.py", r"\btp2xdp2 vs ddp", 0.35),
    # A pipeline stage's parameters, gradients and optimizer state: about 1/P of the model.
    ("pp_memory.py", r"\bpp2 vs single per-process tensors", 0.60),
    ("pp_memory.py", r"\bpp4 vs single per-process tensors", 0.35),
    # The expert weights a process gathers to compute: about 1/ep of FSDP2's (all experts).
    ("ep_memory.py", r"\bep2 vs fsdp2 .* gathered", 0.55),
    ("ep_memory.py", r"\bep2xdp2 vs fsdp4 .* gathered", 0.55),
    ("ep_memory.py", r"\bep4 vs fsdp4 .* gathered", 0.30),
    # slipstream plan: every predicted peak within 15% of the measured one; after calibration
    # the layout predicted fastest measured within 10% of the fastest.
    ("plan_accuracy.py", r"largest memory error", 1.15),
    ("plan_accuracy.py", r"predicted fastest after calibration", 1.10),
    ("sharded_save.py", r"sharded vs full", 1.0),
    # Streams read in parts, or by the main process alone: each sample read once in total.
    ("stream_reads.py", r"^sharded", 1.0),
    ("stream_reads.py", r"^dispatched", 1.0),
    # Offloaded inference holds about its budget plus one block, never the whole model.
    ("big_model.py", r"vs budget \+ largest block", 1.10),
]
RATIO = re.compile(r"ratio ([0-9.]+)x")


def target_for(script: str, line: str) -> float | None:
    for owner, pattern, target in TARGETS:
        if owner == script and re.search(pattern, line):
            return target
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows: list[tuple[str, str, float, float | None]] = []
    for script in SCRIPTS:
        command = [sys.executable, str(HERE / script), *(["--quick"] if args.quick else [])]
        done = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent)
        if done.returncode:
            raise SystemExit(f"{script} failed:\n{done.stderr[-3000:]}")
        for line in done.stdout.splitlines():
            match = RATIO.search(line)
            if match:
                rows.append((script, line.strip(), float(match.group(1)), target_for(script, line)))
    print(f"{'benchmark':18s} {'ratio':>7s} {'target':>7s}  result")
    for script, line, ratio, target in rows:
        shown = f"<={target:.2f}" if target is not None else "-"
        print(f"{script:18s} {ratio:7.3f} {shown:>7s}  {line}")
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    _write_report(results / "report.md", rows, args.quick)
    try:
        _write_chart(results / "ratios.png", rows)
    except ImportError:
        print("matplotlib is not installed: no chart written")
    print(f"report: {results / 'report.md'}")


def _write_report(
    path: Path, rows: list[tuple[str, str, float, float | None]], quick: bool
) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# slipstream benchmarks",
        "",
        f"{stamp}, {platform.platform()}, {os.cpu_count()} CPU cores"
        + (" (quick mode: sizes too small to read ratios from)" if quick else ""),
        "",
        "| script | measurement | ratio | target |",
        "|---|---|---|---|",
    ]
    for script, line, ratio, target in rows:
        goal = f"<= {target:.2f}" if target is not None else "report only"
        lines.append(f"| {script} | {line.replace('|', '/')} | {ratio:.3f} | {goal} |")
    path.write_text("\n".join(lines) + "\n")


def _write_chart(path: Path, rows: list[tuple[str, str, float, float | None]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # "tiny   slipstream step    1.889 ms vs torch ..." -> "tiny slipstream step"
    labels = [
        re.split(r" [0-9.]+ ?m?s\b| ratio", " ".join(line.split()))[0].rstrip(":")[:60]
        for _, line, _, _ in rows
    ]
    ratios = [ratio for _, _, ratio, _ in rows]
    figure, axes = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    positions = list(range(len(rows)))
    axes.barh(positions, ratios, color="#4c72b0")
    for position, (_, _, _, target) in zip(positions, rows, strict=True):
        if target is not None:
            axes.plot(
                [target, target], [position - 0.4, position + 0.4], color="#c44e52", linewidth=2
            )
    axes.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    axes.set_yticks(positions, labels, fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("slipstream / baseline (red: target, at most)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
