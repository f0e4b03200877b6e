"""Per-process memory of training with tensor parallelism vs DDP and FSDP2, on CPU processes.

The same model is prepared by slipstream under each layout and trained for a few AdamW steps:

* ``ddp``      — 2 processes, ``Accelerator()`` (every process holds everything);
* ``fsdp``     — 2 processes, ``ParallelismConfig(dp_shard_size=2)`` (FSDP2);
* ``tp2``      — 2 processes, ``ParallelismConfig(tp_size=2)``;
* ``fsdp4``    — 4 processes, ``ParallelismConfig(dp_shard_size=4)``;
* ``tp2xdp2``  — 4 processes, ``ParallelismConfig(dp_shard_size=2, tp_size=2)``.

Two figures per process. **Tensor bytes**: after the last optimizer step (parameters,
gradients and AdamW state all alive), the bytes of the storages behind this process's
parameters, gradients and optimizer state (a DTensor's local part, each storage counted
once, FSDP2's padding included); exact and free of noise, but blind to buffers a wrapper
keeps beside them (DDP's gradient buckets). **Resident memory**: the peak during training
above what the process held before the model existed, as ``sharded_memory.py`` measures it
(high-water mark reset after ``prepare``, plus samples); it sees everything, activations and
transient gathers included.

Models: ``mlp``, a stack of residual MLP blocks whose plan splits every block's ``up``
column-wise and ``down`` row-wise (all weights but the norms and ``down``'s bias), and
``llama``, a small transformers Llama with its own plan (the embedding by rows, attention
and MLP projections, and ``lm_head`` by columns; the norms replicated). Per-process DDP memory does not
depend on the number of processes, so the 4-process layouts are compared with the
2-process DDP run. Run:

    python benchmarks/tp_memory.py           # ~270 MB MLP stack and ~140 MB Llama
    python benchmarks/tp_memory.py --quick   # tiny MLP stack, 2-process layouts (smoke test)
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
import workers  # benchmarks/workers.py, beside this script
from models import Blocks, llama
from process_memory import reset_high_water_mark, status_mb, tensor_bytes

# layout -> (processes, ParallelismConfig sizes or None for plain DDP)
LAYOUTS: dict[str, tuple[int, dict[str, int] | None]] = {
    "ddp": (2, None),
    "fsdp": (2, {"dp_shard_size": 2}),
    "tp2": (2, {"tp_size": 2}),
    "fsdp4": (4, {"dp_shard_size": 4}),
    "tp2xdp2": (4, {"dp_shard_size": 2, "tp_size": 2}),
}
MLP_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
BATCH, SEQUENCE = 4, 16
STEPS = 3


def worker(layout: str, model_kind: str, width: int, depth: int, vocabulary: int) -> None:
    from slipstream import Accelerator, ParallelismConfig, gather_object

    sizes = LAYOUTS[layout][1]
    config = None
    if sizes is not None:
        plan = MLP_PLAN if model_kind == "mlp" and sizes.get("tp_size") else None
        config = ParallelismConfig(**sizes, tp_plan=plan)
    accelerator = Accelerator(parallelism_config=config)
    if model_kind == "llama":
        import transformers  # noqa: F401  (its import is not the model's memory)
    # What the process holds before the model exists (Python, torch, the libraries): the
    # model, its gradients and optimizer state are what a peak above this measures.
    before_model = status_mb("VmRSS")
    torch.manual_seed(0)
    model = (
        llama(width, depth, vocabulary, SEQUENCE) if model_kind == "llama" else Blocks(width, depth)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    reset_high_water_mark()
    samples = [status_mb("VmRSS")]
    # The same batch on every process: tensor-parallel peers must see the same samples, and
    # what the samples are does not change the memory.
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, int] = {}
    for step in range(STEPS):
        if model_kind == "llama":
            ids = torch.randint(0, vocabulary, (BATCH, SEQUENCE), generator=generator)
            loss = model(input_ids=ids, labels=ids).loss
        else:
            x = torch.randn(BATCH, SEQUENCE, width, generator=generator)
            loss = F.mse_loss(model(x), x)
        samples.append(status_mb("VmRSS"))
        accelerator.backward(loss)
        samples.append(status_mb("VmRSS"))
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        samples.append(status_mb("VmRSS"))
        if step == STEPS - 1:
            tensors = tensor_bytes(accelerator.unwrap_model(model), optimizer.optimizer)
        optimizer.zero_grad()
    # The kernel's high-water mark can miss short peaks; sampled values bound it too.
    peak = max(status_mb("VmHWM"), *samples)
    report = {"peak_mb": peak, "before_model_mb": before_model, "tensors": tensors}
    # One line from the main process: two ranks printing at once can interleave their output.
    reports = gather_object([report])
    if accelerator.is_main_process:
        for rank, line in enumerate(reports):
            workers.report({**line, "rank": rank})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", choices=sorted(LAYOUTS))
    parser.add_argument("--model", choices=("mlp", "llama"), default="mlp")
    parser.add_argument("--width", type=int)
    parser.add_argument("--depth", type=int)
    parser.add_argument("--vocabulary", type=int, default=8192)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model, args.width, args.depth, args.vocabulary)
        return
    # (model, width, depth, vocabulary, layouts)
    cases: list[tuple[str, int, int, int, list[str]]] = [
        ("mlp", 1024, 8, 0, list(LAYOUTS)),
    ]
    if importlib.util.find_spec("transformers"):
        cases.append(("llama", 512, 8, 8192, list(LAYOUTS)))
    if args.quick:
        cases = [("mlp", 64, 2, 0, ["ddp", "tp2"])]
    for model_kind, width, depth, vocabulary, layouts in cases:
        _measure(model_kind, width, depth, vocabulary, layouts)


def _measure(model_kind: str, width: int, depth: int, vocabulary: int, layouts: list[str]) -> None:
    results: dict[str, list[dict[str, Any]]] = {}
    for layout in layouts:
        arguments = ["--worker", layout, "--model", model_kind, "--width", str(width),
                     "--depth", str(depth), "--vocabulary", str(vocabulary)]  # fmt: skip
        # glibc keeps freed large blocks in its heap unless they are mmap'ed: without this,
        # resident memory measures the allocator's retention rather than live tensors.
        env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
        reports = workers.run_workers(__file__, arguments, processes=LAYOUTS[layout][0], env=env)
        results[layout] = sorted(reports, key=lambda r: r["rank"])

    def tensor_mb(layout: str) -> float:
        # The largest process: layouts can split unevenly (FSDP2 pads the last shard).
        return max(sum(r["tensors"].values()) for r in results[layout]) / 1e6

    def above_mb(layout: str) -> float:
        return max(r["peak_mb"] - r["before_model_mb"] for r in results[layout])

    weights = results["ddp"][0]["tensors"]["parameters"] / 1e6
    print(f"{model_kind}: {weights:.1f} MB of fp32 weights, AdamW, CPU processes")
    for layout in layouts:
        first = results[layout][0]
        parts = ", ".join(f"{name} {size / 1e6:.1f}" for name, size in first["tensors"].items())
        print(
            f"{model_kind:5s} {layout:8s} on {LAYOUTS[layout][0]} processes, per process: tensors "
            f"{tensor_mb(layout):.1f} MB (rank 0: {parts}); peak resident "
            f"{max(r['peak_mb'] for r in results[layout]):.0f} MB, {above_mb(layout):.0f} MB "
            "above the process before the model"
        )
    comparisons = [
        ("tp2", "ddp"),
        ("tp2", "fsdp"),
        ("tp2xdp2", "ddp"),
        ("tp2xdp2", "fsdp4"),
        ("fsdp", "ddp"),
        ("fsdp4", "ddp"),
    ]
    for layout, base in comparisons:
        if layout not in results or base not in results:
            continue
        print(
            f"{model_kind} {layout} vs {base} per-process tensors (parameters+gradients+"
            f"optimizer state): ratio {tensor_mb(layout) / tensor_mb(base):.2f}x"
        )
        print(
            f"{model_kind} {layout} vs {base} per-process peak resident memory above the "
            f"process before the model: ratio {above_mb(layout) / above_mb(base):.2f}x"
        )


if __name__ == "__main__":
    main()
