"""Sharded checkpoints scale with processes: FSDP2 ``save_state`` with SHARDED_STATE_DICT
writes one part per process, in parallel, without gathering to the main process.

The same model (~340 MB fp32 + AdamW state) is saved by 1 and by 2 CPU processes; each
process reports the bytes it wrote and the time the save took (median of repetitions).

    python benchmarks/sharded_save.py
    python benchmarks/sharded_save.py --quick
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import workers  # benchmarks/workers.py, beside this script
from torch import nn


def _folder_bytes(folder: str, rank: int) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            if name.startswith(f"__{rank}_"):  # torch.distributed.checkpoint's per-rank files
                total += os.path.getsize(os.path.join(root, name))
    return total


def worker(width: int, layers: int, repeats: int, folder: str, kind: str) -> None:
    from slipstream import Accelerator, FullyShardedDataParallelPlugin, gather_object

    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["Linear"], state_dict_type=kind
    )
    accelerator = Accelerator(fsdp_plugin=plugin)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(4, width)).sum())
    optimizer.step()
    times = []
    for index in range(repeats):
        target = os.path.join(folder, f"ckpt_{index}")
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        accelerator.save_state(target)
        times.append(time.perf_counter() - start)
        written = (
            _folder_bytes(target, accelerator.process_index) if kind.startswith("SHARDED") else 0
        )
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(target)
    report = {"seconds": statistics.median(times), "bytes": written}
    # One writer: two ranks printing at once can interleave their lines.
    reports = gather_object([report])
    if accelerator.is_main_process:
        for rank, line in enumerate(reports):
            workers.report({**line, "rank": rank})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", default="")
    parser.add_argument("--kind", default="SHARDED_STATE_DICT")
    args = parser.parse_args()
    if args.worker:
        worker(args.width, args.layers, args.repeats, args.folder, args.kind)
        return
    width, layers, repeats = (256, 8, 2) if args.quick else (args.width, args.layers, args.repeats)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for processes, kind in (
            (1, "SHARDED_STATE_DICT"),
            (2, "SHARDED_STATE_DICT"),
            (2, "FULL_STATE_DICT"),
        ):
            arguments = ["--worker", "--width", str(width), "--layers", str(layers),
                         "--repeats", str(repeats), "--folder", folder, "--kind", kind]  # fmt: skip
            results[(processes, kind)] = workers.run_workers(__file__, arguments, processes)
    one, two = results[(1, "SHARDED_STATE_DICT")][0], results[(2, "SHARDED_STATE_DICT")]
    full = max(r["seconds"] for r in results[(2, "FULL_STATE_DICT")])
    per_process = max(r["bytes"] for r in two) / 1e6
    slowest = max(r["seconds"] for r in two)
    print(
        f"1 process writes {one['bytes'] / 1e6:.0f} MB in {one['seconds']:.3f}s; "
        f"2 processes write {per_process:.0f} MB each in {slowest:.3f}s"
    )
    print(
        f"sharded save_state, 2 processes vs 1: {slowest:.3f}s vs {one['seconds']:.3f}s  "
        f"ratio {slowest / one['seconds']:.3f}x"
    )
    print(
        f"2 processes: sharded vs full (gathered) save_state: {slowest:.3f}s vs {full:.3f}s  "
        f"ratio {slowest / full:.3f}x"
    )


if __name__ == "__main__":
    main()
