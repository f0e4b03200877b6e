"""Per-step time of a prepared DDP training loop versus the same loop written by hand.

Runs on 2 CPU processes. Every variant trains the same model on the same global
batches. They take turns in one process: in each round every variant (in a rotating order)
runs one untimed warm-up step and then a few timed steps, each timed on its own. The
hand-written loop runs as two identical copies; a step is compared with each copy's step at
the same position of the same round, and the median of those per-step ratios (the mean over
the two copies) is reported with a bootstrap 95% interval and the main-thread CPU time per
step above the hand-written loop's. The second copy against the first ("control") shows how
far two identical loops differ on this machine. Hugging Face Accelerate and Lightning Fabric
are included when installed. Every variant is built afresh several times ("generations", in
a shuffled order); the final weights of every variant must equal the hand-written loop's in
every generation.

Why the warm-up step: the first step after a *different* library's loop ran is slower for
every library (Python re-adapts its specialised bytecode to the other objects, caches are
cold): in a real run one loop runs alone, so that switching cost is not part of its step.

On CPU processes slipstream averages DDP's gradients through shared memory
(slipstream.runtime.shared_memory_all_reduce); "slipstream (gloo)" is the same loop with
DDP's own all-reduce over gloo, as the hand-written loop's: slipstream's Python alone. The
all-reduce itself is timed apart first, alternately over gloo and through shared memory
(the same tensor, 8 KB to 24 MB, each call after a barrier; medians).

    python benchmarks/ddp_overhead.py            # the all-reduce, tiny and medium model
    python benchmarks/ddp_overhead.py --size tiny
    python benchmarks/ddp_overhead.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import workers  # benchmarks/workers.py, beside this script
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

SIZES = {"tiny": (32, 2), "medium": (1024, 6)}  # (width, layers)
# (generations, rounds per generation, timed steps per round): many short paired rounds, as a
# 2-process step on 2 shared cores jitters by tens of percent from one step to the next.
ROUNDS = {"tiny": (12, 100, 3), "medium": (6, 20, 2)}
WARMUP_STEPS = 1
PER_PROCESS_BATCH = 16


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _data(width: int, steps: int, world: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    count = steps * world * PER_PROCESS_BATCH
    return TensorDataset(
        torch.randn(count, width, generator=generator),
        torch.randn(count, width, generator=generator),
    )


class ContiguousShard(Sampler[int]):
    """Rank r takes the r-th contiguous batch of every global batch (slipstream's layout)."""

    def __init__(self, length: int, rank: int, world: int) -> None:
        self.indices = [
            i
            for start in range(0, length, world * PER_PROCESS_BATCH)
            for i in range(start + rank * PER_PROCESS_BATCH, start + (rank + 1) * PER_PROCESS_BATCH)
        ]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class HandWritten:
    name = "torch"

    def __init__(self, width: int, layers: int, steps: int) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.model = nn.parallel.DistributedDataParallel(_model(width, layers))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        data = _data(width, steps, world)
        self.loader = DataLoader(
            data, batch_size=PER_PROCESS_BATCH, sampler=ContiguousShard(len(data), rank, world)
        )

    def step(self, batch: Any) -> None:
        x, y = batch
        self.optimizer.zero_grad()
        F.mse_loss(self.model(x), y).backward()
        self.optimizer.step()

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.module.parameters()]


class Control(HandWritten):
    """The hand-written loop again, as its own variant: its ratio to the first copy is the
    noise floor of the measurement (an A/A comparison)."""

    name = "control"


class Slipstream(HandWritten):
    name = "slipstream"

    @staticmethod
    def accelerator_class() -> Any:
        from slipstream import Accelerator

        return Accelerator

    @staticmethod
    def kwargs_handlers() -> list[Any]:
        return []

    def __init__(self, width: int, layers: int, steps: int) -> None:
        # cpu=True: without it Accelerate on a machine with no GPU silently
        # trains each process alone (DistributedType.NO, no gradient all-reduce).
        self.accelerator = self.accelerator_class()(
            cpu=True, kwargs_handlers=self.kwargs_handlers()
        )
        model = _model(width, layers)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        loader = DataLoader(
            _data(width, steps, dist.get_world_size()), batch_size=PER_PROCESS_BATCH
        )
        self.model, self.optimizer, self.loader = self.accelerator.prepare(model, optimizer, loader)

    def step(self, batch: Any) -> None:
        x, y = batch
        self.optimizer.zero_grad()
        self.accelerator.backward(F.mse_loss(self.model(x), y))
        self.optimizer.step()

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.accelerator.unwrap_model(self.model).parameters()]


class SlipstreamGloo(Slipstream):
    """slipstream with DDP's own all-reduce over gloo (its shared-memory one turned off): the
    cost of slipstream's Python alone, on the same communication as the hand-written loop."""

    name = "slipstream (gloo)"

    @staticmethod
    def kwargs_handlers() -> list[Any]:
        from slipstream import DistributedDataParallelKwargs

        return [DistributedDataParallelKwargs(shared_memory_all_reduce=False)]


class HFAccelerate(Slipstream):
    name = "accelerate"

    @staticmethod
    def accelerator_class() -> Any:
        from accelerate import Accelerator

        return Accelerator


class Fabric(Slipstream):
    name = "fabric"

    def __init__(self, width: int, layers: int, steps: int) -> None:
        from lightning.fabric import Fabric as LightningFabric

        self.fabric = LightningFabric(
            accelerator="cpu", devices=dist.get_world_size(), strategy="ddp"
        )
        self.fabric._launched = True  # the processes exist already (started by workers.py)
        model = _model(width, layers)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.model, self.optimizer = self.fabric.setup(model, optimizer)
        rank, world = dist.get_rank(), dist.get_world_size()
        data = _data(width, steps, world)
        loader = DataLoader(
            data, batch_size=PER_PROCESS_BATCH, sampler=ContiguousShard(len(data), rank, world)
        )
        self.loader = self.fabric.setup_dataloaders(loader, use_distributed_sampler=False)

    def step(self, batch: Any) -> None:
        x, y = batch
        self.optimizer.zero_grad()
        self.fabric.backward(F.mse_loss(self.model(x), y))
        self.optimizer.step()

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.module.parameters()]


def _variants() -> list[type[HandWritten]]:
    variants: list[type[HandWritten]] = [HandWritten, Slipstream, SlipstreamGloo, Control]
    if importlib.util.find_spec("accelerate"):
        variants.append(HFAccelerate)
    if importlib.util.find_spec("lightning"):
        variants.append(Fabric)
    return variants


def _generation(
    variants: list[type[HandWritten]],
    size: str,
    rounds: int,
    timed: int,
    wall: dict[str, list[float]],
    cpu: dict[str, list[float]],
) -> tuple[dict[str, bool], None]:
    """Build every variant afresh and run the rounds; whether each ended with the
    hand-written loop's weights."""
    width, layers = SIZES[size]
    runs = [kind(width, layers, rounds * (WARMUP_STEPS + timed)) for kind in variants]
    workers.time_rounds(runs, rounds, timed, WARMUP_STEPS, wall, cpu)
    reference = next(run for run in runs if run.name == "torch").weights()
    equal = {
        run.name: all(torch.equal(a, b) for a, b in zip(reference, run.weights(), strict=True))
        for run in runs
        if run.name != "torch"
    }
    return equal, None


def worker(size: str, generations: int, rounds: int, timed: int) -> None:
    dist.init_process_group("gloo")
    wall, cpu, equal, _ = workers.run_generations(
        _variants(),
        generations,
        lambda order, wall, cpu: _generation(order, size, rounds, timed, wall, cpu),
    )
    if dist.get_rank() == 0:
        workers.report(
            {"size": size, **workers.paired_statistics(wall, cpu, timed), "weights_equal": equal}
        )
    dist.destroy_process_group()


#: (bytes, calls divided by): the larger sizes take many times longer per call.
ALL_REDUCE_SIZES = ((8 << 10, 1), (2 << 20, 10), (24 << 20, 30))


def all_reduce_worker(calls: int) -> None:
    """Median time of one all-reduce over gloo and through shared memory, per size."""
    from slipstream.runtime.shared_memory_all_reduce import shared_memory_all_reduce

    dist.init_process_group("gloo")
    reducer = shared_memory_all_reduce()
    if reducer is None:
        raise SystemExit("the shared-memory all-reduce is not possible here (x86-64 Linux only)")
    rows = []
    for nbytes, fewer in ALL_REDUCE_SIZES:
        tensor = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(dist.get_rank()))
        by_gloo, shared = tensor.clone(), tensor.clone()
        dist.all_reduce(by_gloo)
        reducer.all_reduce(shared)
        times: dict[str, list[float]] = {"gloo": [], "shared memory": []}
        for _ in range(max(3, calls // fewer)):
            for name, run in (("gloo", dist.all_reduce), ("shared memory", reducer.all_reduce)):
                dist.barrier()
                start = time.perf_counter()
                run(tensor)
                times[name].append(time.perf_counter() - start)
        rows.append(
            {
                "bytes": nbytes,
                "gloo": statistics.median(times["gloo"]),
                "shared": statistics.median(times["shared memory"]),
                "equal": bool(torch.equal(by_gloo, shared)),
            }
        )
    if dist.get_rank() == 0:
        workers.report({"rows": rows})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", choices=[*sorted(SIZES), "all_reduce"])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--generations", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--timed", type=int, help="timed steps per variant and round")
    parser.add_argument("--size", choices=[*SIZES, "all"], default="all")
    args = parser.parse_args()
    if args.worker == "all_reduce":
        all_reduce_worker(args.calls)
        return
    if args.worker:
        worker(args.worker, args.generations, args.rounds, args.timed)
        return
    calls = ["--calls", "20"] if args.quick else []
    for row in workers.run_workers(__file__, ["--worker", "all_reduce", *calls])[0]["rows"]:
        print(
            f"all_reduce {row['bytes']:>9d} B: shared memory {row['shared'] * 1e6:8.1f} us vs "
            f"gloo {row['gloo'] * 1e6:8.1f} us  ratio {row['shared'] / row['gloo']:.3f}x  "
            f"(sums {'equal' if row['equal'] else 'DIFFER'})"
        )
    sizes = list(SIZES) if args.size == "all" else [args.size]
    for size in ["tiny"] if args.quick else sizes:
        generations, rounds, timed = (1, 2, 2) if args.quick else ROUNDS[size]
        arguments = ["--worker", size,
                     "--generations", str(args.generations or generations),
                     "--rounds", str(args.rounds or rounds),
                     "--timed", str(args.timed or timed)]  # fmt: skip
        result = workers.run_workers(__file__, arguments)[0]
        workers.print_step_ratios(size, result, 6)
        print(f"{size:6s} {result['steps']} paired steps per variant")


if __name__ == "__main__":
    main()
