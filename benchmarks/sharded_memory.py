"""Per-process peak memory of training with DDP, FSDP2 and DeepSpeed ZeRO-3, 2 CPU processes.

The model (~340 MB of fp32 weights; AdamW adds twice that in state) is built, prepared and
trained for a few steps under each strategy; each process reports the peak of its resident
memory during training (the high-water mark is reset after prepare(), so building the
full model before sharding is not counted), both absolute and above what the process held
before the model existed (Python, torch and the libraries: ~220 MB). The second is the
memory of model + gradients + optimizer state that sharding divides. Run:

    python benchmarks/sharded_memory.py           # ~340 MB model
    python benchmarks/sharded_memory.py --quick   # ~4 MB model (smoke test)
"""

from __future__ import annotations

import argparse
import os

import torch
import workers  # benchmarks/workers.py, beside this script
from process_memory import reset_high_water_mark
from torch import nn

STRATEGIES = ("ddp", "fsdp", "zero3")


def _high_water_mark_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _resident_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(strategy: str, width: int, layers: int) -> None:
    from slipstream import (
        Accelerator,
        DeepSpeedPlugin,
        FullyShardedDataParallelPlugin,
        gather_object,
    )

    plugins = {
        "fsdp": {
            "fsdp_plugin": FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"])
        },
        # DeepSpeed's defaults keep up to 1e9 gathered parameters alive (all of this model),
        # use 5e8-element buckets and run the optimizer step on sub-groups of 1e9 elements
        # (whose flattened gradients and AdamW temporaries are the step's transient peak);
        # bound them as one would for a model this size.
        "zero3": {
            "deepspeed_plugin": DeepSpeedPlugin(
                hf_ds_config={
                    "zero_optimization": {
                        "stage": 3,
                        "stage3_max_live_parameters": 1e6,
                        "stage3_max_reuse_distance": 1e6,
                        "stage3_prefetch_bucket_size": 1e6,
                        "stage3_param_persistence_threshold": 1e4,
                        "reduce_bucket_size": 1e6,
                        "sub_group_size": 4e6,
                    }
                }
            )
        },
    }
    accelerator = Accelerator(**plugins.get(strategy, {}))
    if strategy == "zero3":
        import deepspeed  # noqa: F401  (its libraries are not the model's memory)
    # What the process holds before the model exists (Python, torch, the libraries): the
    # model, its gradients and optimizer state are what a peak above this measures.
    before_model = _resident_mb()
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    reset_high_water_mark()
    baseline = _resident_mb()
    samples = [baseline]
    for _ in range(3):
        loss = model(torch.randn(8, width)).pow(2).mean()
        samples.append(_resident_mb())
        accelerator.backward(loss)
        samples.append(_resident_mb())
        optimizer.step()
        samples.append(_resident_mb())
        optimizer.zero_grad()
    # The kernel's high-water mark can miss short peaks; sampled values bound it too.
    peak = max(_high_water_mark_mb(), *samples)
    report = {"strategy": strategy, "peak_mb": peak, "before_model_mb": before_model}
    # One line from the main process: two ranks printing at once can interleave their output.
    reports = gather_object([report])
    if accelerator.is_main_process:
        for rank, line in enumerate(reports):
            workers.report({**line, "rank": rank})


def _has_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", choices=STRATEGIES)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=20)
    args = parser.parse_args()
    if args.quick:
        args.width, args.layers = 256, 16
    if args.worker:
        worker(args.worker, args.width, args.layers)
        return
    megabytes = args.width * (args.width + 1) * args.layers * 4 / 1e6
    peaks: dict[str, list[float]] = {}  # absolute per-rank peaks, MB
    above: dict[str, list[float]] = {}  # the same above each process's memory before the model
    strategies = [s for s in STRATEGIES if s != "zero3" or _has_deepspeed()]
    for strategy in strategies:
        arguments = ["--worker", strategy, "--width", str(args.width), "--layers", str(args.layers)]
        # glibc keeps freed large blocks in its heap unless they are mmap'ed: without this,
        # resident memory measures the allocator's retention rather than live tensors.
        env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
        env["TORCH_EXTENSIONS_DIR"] = os.environ.get(
            "TORCH_EXTENSIONS_DIR", os.path.join(os.getcwd(), ".torch_extensions")
        )
        reports = workers.run_workers(__file__, arguments, env=env)
        reports.sort(key=lambda r: r["rank"])
        peaks[strategy] = [r["peak_mb"] for r in reports]
        above[strategy] = [r["peak_mb"] - r["before_model_mb"] for r in reports]
    print(f"model: {megabytes:.0f} MB of fp32 weights, AdamW, 2 processes on CPU")
    for strategy in strategies:
        shown = ", ".join(
            f"{peak:.0f} MB ({extra:.0f} MB above the process before the model)"
            for peak, extra in zip(peaks[strategy], above[strategy], strict=True)
        )
        print(f"{strategy:6s} peak resident memory during training per rank: {shown}")
    for strategy in strategies[1:]:
        ratio = max(above[strategy]) / max(above["ddp"])
        print(
            f"{strategy} vs ddp per-rank peak of model+gradients+optimizer state: ratio {ratio:.2f}x"
        )
    for strategy in strategies[1:]:
        ratio = max(peaks[strategy]) / max(peaks["ddp"])
        print(f"{strategy} / ddp per-rank peak resident memory, absolute: ratio {ratio:.2f}x")


if __name__ == "__main__":
    main()
