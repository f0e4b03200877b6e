"""Per-process memory of the experts under expert parallelism vs without, on CPU processes.

The same mixture-of-experts model (``models.MoEBlocks``: a router and stacked experts per
block) is prepared by slipstream under each layout and trained for a few AdamW steps:

* ``ddp``      — 2 processes, ``Accelerator()`` (every process holds every expert);
* ``fsdp2``    — 2 processes, ``ParallelismConfig(dp_shard_size=2)`` (no expert parallelism);
* ``ep2``      — 2 processes, ``ParallelismConfig(dp_shard_size=2, ep_size=2)``;
* ``fsdp4``    — 4 processes, ``ParallelismConfig(dp_shard_size=4)``;
* ``ep2xdp2``  — 4 processes, ``ParallelismConfig(dp_shard_size=4, ep_size=2)``;
* ``ep4``      — 4 processes, ``ParallelismConfig(dp_shard_size=4, ep_size=4)``.

Three figures per process, for the expert weights only:

* **gathered**: the expert weights a process holds while an experts module computes (a
  forward pre-hook reads them after FSDP2 gathered its shards: whole tensors without expert
  parallelism, this process's experts with it) — the largest over the blocks; this is what
  expert parallelism divides by ep;
* **at rest**: the bytes of the storages of the expert parameters, their gradients and AdamW
  state after the last step (a DTensor's local part, FSDP2's padding included) — sharded
  over every data-parallel process with or without expert parallelism;
* **peak resident**: the whole process's peak above what it held before the model existed.

    python benchmarks/ep_memory.py           # 8 experts of 512 x 1024 x 2 per block
    python benchmarks/ep_memory.py --quick   # tiny model, 2-process layouts (smoke test)
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
import workers  # benchmarks/workers.py, beside this script
from models import MoEBlocks
from process_memory import reset_high_water_mark, status_mb, storage_bytes

# layout -> (processes, ParallelismConfig sizes or None for plain DDP)
LAYOUTS: dict[str, tuple[int, dict[str, int] | None]] = {
    "ddp": (2, None),
    "fsdp2": (2, {"dp_shard_size": 2}),
    "ep2": (2, {"dp_shard_size": 2, "ep_size": 2}),
    "fsdp4": (4, {"dp_shard_size": 4}),
    "ep2xdp2": (4, {"dp_shard_size": 4, "ep_size": 2}),
    "ep4": (4, {"dp_shard_size": 4, "ep_size": 4}),
}
BATCH, SEQUENCE, STEPS = 4, 16, 3


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def worker(layout: str, width: int, depth: int, experts: int) -> None:
    from slipstream import Accelerator, ParallelismConfig, gather_object

    sizes = LAYOUTS[layout][1]
    config = None
    if sizes is not None:
        config = ParallelismConfig(**sizes, ep_plan=["blocks.*.experts"])
    accelerator = Accelerator(parallelism_config=config)
    before_model = status_mb("VmRSS")
    torch.manual_seed(0)
    model = MoEBlocks(width, depth, experts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    gathered: list[int] = []

    def measure(module: torch.nn.Module, args: Any) -> None:
        # After FSDP2's own pre-forward hook (registered earlier): the gathered weights.
        gathered.append(
            sum(_local(p).numel() * p.element_size() for p in (module.w_in, module.w_out))
        )

    for block in accelerator.unwrap_model(model).blocks:
        block.experts.register_forward_pre_hook(measure)
    reset_high_water_mark()
    samples = [status_mb("VmRSS")]
    generator = torch.Generator().manual_seed(0)
    at_rest = 0
    for step in range(STEPS):
        x = torch.randn(BATCH, SEQUENCE, width, generator=generator)
        loss = F.mse_loss(model(x), x)
        samples.append(status_mb("VmRSS"))
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        samples.append(status_mb("VmRSS"))
        if step == STEPS - 1:
            named = dict(accelerator.unwrap_model(model).named_parameters())
            expert = [p for n, p in named.items() if ".experts." in n]
            tensors = [_local(p) for p in expert]
            tensors += [_local(p.grad) for p in expert if p.grad is not None]
            for p in expert:
                tensors += [_local(t) for t in optimizer.optimizer.state.get(p, {}).values()]
            at_rest = storage_bytes([t for t in tensors if t.dim() > 0])
        optimizer.zero_grad()
    peak = max(status_mb("VmHWM"), *samples)
    report = {
        "gathered": max(gathered),
        "at_rest": at_rest,
        "above_mb": peak - before_model,
    }
    reports = gather_object([report])
    if accelerator.is_main_process:
        for rank, line in enumerate(reports):
            workers.report({**line, "rank": rank})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", choices=sorted(LAYOUTS))
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.width, args.depth, args.experts)
        return
    layouts = ["ddp", "fsdp2", "ep2"] if args.quick else list(LAYOUTS)
    width, depth = (64, 2) if args.quick else (args.width, args.depth)
    results: dict[str, list[dict[str, Any]]] = {}
    for layout in layouts:
        arguments = ["--worker", layout, "--width", str(width), "--depth", str(depth),
                     "--experts", str(args.experts)]  # fmt: skip
        env = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # resident memory tracks live tensors
        reports = workers.run_workers(__file__, arguments, processes=LAYOUTS[layout][0], env=env)
        results[layout] = reports

    def largest(layout: str, key: str) -> float:
        return max(float(r[key]) for r in results[layout])

    expert_mb = 2 * args.experts * width * 2 * width * 4 / 1e6 * depth
    print(f"{depth} blocks of {args.experts} experts ({expert_mb:.1f} MB of fp32 expert weights)")
    for layout in layouts:
        print(
            f"{layout:8s} on {LAYOUTS[layout][0]} processes, per process: expert weights "
            f"gathered {largest(layout, 'gathered') / 1e6:.2f} MB (one block), at rest (weights+gradients+"
            f"AdamW) {largest(layout, 'at_rest') / 1e6:.2f} MB; peak resident "
            f"{largest(layout, 'above_mb'):.0f} MB above the process before the model"
        )
    for layout, base in (("ep2", "fsdp2"), ("ep2xdp2", "fsdp4"), ("ep4", "fsdp4"), ("ep2", "ddp")):
        if layout in results and base in results:
            gathered = largest(layout, "gathered") / largest(base, "gathered")
            rest = largest(layout, "at_rest") / largest(base, "at_rest")
            peak = largest(layout, "above_mb") / largest(base, "above_mb")
            print(
                f"{layout} vs {base} per-process expert weights gathered to compute: ratio "
                f"{gathered:.2f}x; at rest: {rest:.2f}x; peak resident: {peak:.2f}x"
            )


if __name__ == "__main__":
    main()
