"""Per-process memory of training with pipeline parallelism vs one process holding the whole model.

The same model is prepared by slipstream under each layout and trained for a few AdamW
steps with ``accelerator.forward_backward`` (the call that works with and without a
pipeline):

* ``single`` — 1 process, ``Accelerator()``: the whole model, its gradients and AdamW state;
* ``pp2``    — 2 processes, ``ParallelismConfig(pp_size=2)`` (1F1B, 4 micro-batches);
* ``pp4``    — 4 processes, ``ParallelismConfig(pp_size=4)`` (1F1B, 4 micro-batches).

Under pipeline parallelism alone nothing is sharded or replicated: each process keeps only
its stage's parameters, and so only its gradients and optimizer state, so the target is
about 1/P of the single process. Two figures per process, as ``tp_memory.py`` measures them.
**Tensor bytes**: after the last optimizer step, the bytes of the storages behind this
process's parameters, gradients and AdamW state (each storage counted once); exact and free
of noise. **Resident memory**: the peak during training above what the process held before
the model existed (high-water mark reset after ``prepare``, plus samples); it also sees the
activations of the micro-batches in flight and the send/receive buffers. Every process
builds the whole model before ``prepare`` keeps its stages (a script can build it on the
meta device instead), so the resident peak is measured from after ``prepare``.

Models: ``mlp``, an ``nn.Sequential`` of 8 residual MLP blocks (split by parameter count
into equal stages), and ``llama``, a small transformers Llama split by its own pipeline
plan (the embedding rides with the first stage's layers, the final norm and ``lm_head``
with the last's). The figure for a layout is its largest process. Run:

    python benchmarks/pp_memory.py           # ~270 MB MLP stack and ~140 MB Llama
    python benchmarks/pp_memory.py --quick   # tiny MLP stack, single and pp2 (smoke test)
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
import workers  # benchmarks/workers.py, beside this script
from models import Block, llama
from process_memory import reset_high_water_mark, status_mb, tensor_bytes
from torch import nn

# layout -> processes (all of them one pipeline; 1: no pipeline)
LAYOUTS = {"single": 1, "pp2": 2, "pp4": 4}
MICROBATCHES = 4
BATCH, SEQUENCE = 8, 16  # 8 samples per step: 4 micro-batches of 2
STEPS = 3


def worker(layout: str, model_kind: str, width: int, depth: int, vocabulary: int) -> None:
    from slipstream import Accelerator, ParallelismConfig, gather_object

    processes = LAYOUTS[layout]
    config = None
    if processes > 1:
        config = ParallelismConfig(
            pp_size=processes, pp_schedule="1f1b", pp_microbatches=MICROBATCHES
        )
    accelerator = Accelerator(parallelism_config=config)
    if model_kind == "llama":
        import transformers  # noqa: F401  (its import is not the model's memory)
    # What the process holds before the model exists (Python, torch, the libraries).
    before_model = status_mb("VmRSS")
    torch.manual_seed(0)
    if model_kind == "llama":
        model = llama(width, depth, vocabulary, SEQUENCE)
    else:
        model = nn.Sequential(*[Block(width) for _ in range(depth)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    reset_high_water_mark()
    samples = [status_mb("VmRSS")]
    # The same batch on every process: a pipeline's processes all see the batch (the first
    # stage its inputs, the last its targets).
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, int] = {}
    for step in range(STEPS):
        if model_kind == "llama":
            ids = torch.randint(0, vocabulary, (BATCH, SEQUENCE), generator=generator)
            accelerator.forward_backward(model, {"input_ids": ids, "labels": ids})
        else:
            x = torch.randn(BATCH, SEQUENCE, width, generator=generator)
            accelerator.forward_backward(model, x, target=x, loss_fn=F.mse_loss)
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
        cases = [("mlp", 64, 4, 0, ["single", "pp2"])]
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
        reports = workers.run_workers(__file__, arguments, processes=LAYOUTS[layout], env=env)
        results[layout] = sorted(reports, key=lambda r: r["rank"])

    def tensor_mb(layout: str, part: str | None = None) -> float:
        # The largest process: the first and last stages also hold the embedding and head.
        return (
            max(
                sum(r["tensors"].values()) if part is None else r["tensors"][part]
                for r in results[layout]
            )
            / 1e6
        )

    def above_mb(layout: str) -> float:
        return max(r["peak_mb"] - r["before_model_mb"] for r in results[layout])

    print(
        f"{model_kind}: {tensor_mb('single', 'parameters'):.1f} MB of fp32 weights, AdamW, "
        "CPU processes"
    )
    for layout in layouts:
        ranks = "; ".join(
            f"{r['rank']}: {sum(r['tensors'].values()) / 1e6:.1f}" for r in results[layout]
        )
        print(
            f"{model_kind:5s} {layout:6s} on {LAYOUTS[layout]} process(es): tensors per "
            f"process {ranks} MB; peak resident {max(r['peak_mb'] for r in results[layout]):.0f}"
            f" MB, {above_mb(layout):.0f} MB above the process before the model"
        )
    for layout in layouts:
        if layout == "single":
            continue
        parameters = tensor_mb(layout, "parameters") / tensor_mb("single", "parameters")
        print(
            f"{model_kind} {layout} vs single per-process tensors (parameters+gradients+"
            f"optimizer state): ratio {tensor_mb(layout) / tensor_mb('single'):.3f}x "
            f"(parameters alone {parameters:.3f}; 1/{LAYOUTS[layout]} = {1 / LAYOUTS[layout]:.3f})"
        )
        print(
            f"{model_kind} {layout} vs single per-process peak resident memory above the "
            f"process before the model: ratio {above_mb(layout) / above_mb('single'):.2f}x"
        )


if __name__ == "__main__":
    main()
