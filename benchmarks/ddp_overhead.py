"""Per-step time of a prepared DDP training loop versus the same loop written by hand.

Runs on 2 CPU processes (torchrun). Every variant trains the same model on the same global
batches; they run interleaved (a block of steps each, several rounds) and each variant's
per-step time is divided by the hand-written torch.distributed + DDP loop's in the same round
(the mean of two identical copies of it); the median of those ratios is reported. Hugging
Face Accelerate and Lightning Fabric are included when installed, and a second copy of the
hand-written loop ("control") shows how far two identical loops differ on this machine. The
final weights of the slipstream and hand-written runs must be equal.

    python benchmarks/ddp_overhead.py            # tiny and medium model
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
# (rounds, steps per block): many short paired rounds, as a 2-process step on 2 shared cores
# jitters by several percent from one block to the next.
ROUNDS = {"tiny": (61, 20), "medium": (25, 8)}
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

    def __init__(self, width: int, layers: int, steps: int) -> None:
        # cpu=True: without it Accelerate under torchrun on a machine with no GPU silently
        # trains each process alone (DistributedType.NO, no gradient all-reduce).
        self.accelerator = self.accelerator_class()(cpu=True)
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
        self.fabric._launched = True  # the processes exist already (torchrun)
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


def worker(size: str, rounds: int, block: int) -> None:
    dist.init_process_group("gloo")
    width, layers = SIZES[size]
    variants: list[type[HandWritten]] = [HandWritten, Slipstream, Control]
    if importlib.util.find_spec("accelerate"):
        variants.append(HFAccelerate)
    if importlib.util.find_spec("lightning"):
        variants.append(Fabric)
    runs = [kind(width, layers, rounds * block) for kind in variants]
    iterators = [iter(run.loader) for run in runs]
    times: dict[str, list[float]] = {run.name: [] for run in runs}
    order = list(range(len(runs)))
    for round_index in range(rounds):
        # Rotate which variant goes first so none always runs right after another.
        rotated = order[round_index % len(order) :] + order[: round_index % len(order)]
        for run, iterator in ((runs[i], iterators[i]) for i in rotated):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(block):
                run.step(next(iterator))
            dist.barrier()
            times[run.name].append((time.perf_counter() - start) / block)
    reference = runs[0].weights()
    equal = all(torch.equal(a, b) for a, b in zip(reference, runs[1].weights(), strict=True))
    differences = {
        run.name: max(
            (a - b).abs().max().item() for a, b in zip(reference, run.weights(), strict=True)
        )
        for run in runs[1:]
    }
    if dist.get_rank() == 0:
        medians = {name: statistics.median(values[1:] or values) for name, values in times.items()}
        # Each round's blocks run back to back, so the ratio within a round cancels the slow
        # drifts of a shared machine; the median over rounds is the reported ratio.
        # The hand-written time of a round is the mean of its two identical copies (halving
        # the baseline's own noise); the control is still reported against the first copy
        # alone, which shows how far two identical loops differ.
        first = times["torch"]
        both = [(a + b) / 2 for a, b in zip(first, times["control"], strict=True)]

        def ratio(values: list[float], base: list[float]) -> float:
            return statistics.median([v / b for v, b in zip(values, base, strict=True)][1:])

        ratios = {
            name: ratio(values, first if name == "control" else both)
            for name, values in times.items()
        }
        medians["torch (first copy)"] = medians["torch"]
        medians["torch"] = statistics.median(both[1:] or both)
        report = {
            "size": size,
            "medians": medians,
            "ratios": ratios,
            "weights_equal": equal,
            "max_diff": differences,
        }
        workers.report(report)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", choices=sorted(SIZES))
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--block", type=int)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.rounds, args.block)
        return
    for size in ["tiny"] if args.quick else list(SIZES):
        rounds, block = (2, 3) if args.quick else ROUNDS[size]
        rounds, block = args.rounds or rounds, args.block or block
        arguments = ["--worker", size, "--rounds", str(rounds), "--block", str(block)]
        result = workers.run_workers(__file__, arguments)[0]
        medians = result["medians"]
        for name, seconds in medians.items():
            if name in result["ratios"] and name != "torch":
                base = medians["torch (first copy)" if name == "control" else "torch"]
                diff = result["max_diff"][name]
                print(
                    f"{size:6s} {name:10s} step {seconds * 1e3:8.3f} ms vs torch "
                    f"{base * 1e3:8.3f} ms  ratio {result['ratios'][name]:.3f}x  (weights differ by {diff:.1e})"
                )
        print(
            f"{size:6s} final weights of slipstream and hand-written runs equal: {result['weights_equal']}"
        )


if __name__ == "__main__":
    main()
