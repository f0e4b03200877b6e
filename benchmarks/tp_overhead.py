"""Per-step time of a prepared tensor-parallel training loop versus the same loop by hand.

The prepared loop is ``Accelerator(parallelism_config=ParallelismConfig(tp_size=2, ...))``,
``prepare``, ``backward``, ``clip_grad_norm_`` and the optimizer's ``step``; the hand-written
one builds the same DeviceMesh with ``init_device_mesh``, splits the model with DTensor's
``parallelize_module`` (the same plan: each block's ``up`` column-wise, ``down`` row-wise),
shards it with FSDP2 ``fully_shard`` over the data-parallel dimension when that has more
than one process (each block, then the root, as slipstream does for a model that names its
blocks in ``_no_split_modules``; with one process both loops stay TP-only, as torchtitan) and
clips with a hand-written global gradient norm (one all-reduce of the weighted sum of local
squares). Both train a stack of MLP blocks with AdamW on the same batches.

Measured as ``ddp_overhead.py`` measures: the variants take turns in the same processes, in
each round (in a rotating order) one untimed warm-up step and then a few steps each timed on
its own; the hand-written loop runs as two identical copies, a step is compared with each
copy's step at the same position of the same round, and the median of those per-step ratios
(averaged over the two copies) is reported with a bootstrap 95% interval and the main-thread
CPU time per step above the hand-written loop's. The second copy against the first
("control") is the noise floor. Every variant is rebuilt several times in a shuffled order
("generations"); the final weights of every variant must equal the hand-written loop's, and
the gradient norms slipstream returns must match the hand-written ones.

Layouts: ``tp2`` (2 processes; the mesh is dp_shard=1 x tp=2: tensor parallelism only) and
``tp2xdp2`` (4 processes, FSDP2 over dp_shard=2 around tensor parallelism; 4 processes on a
2-core machine are oversubscribed, so this layout's figures are noisier). An informational
variant locates a difference: ``hand-clip`` is the prepared loop clipping with the
hand-written function instead of ``accelerator.clip_grad_norm_`` (what everything but the
clip costs).

    python benchmarks/tp_overhead.py            # tp2: tiny and medium model; tp2xdp2: tiny
    python benchmarks/tp_overhead.py --quick    # smoke test
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import workers  # benchmarks/workers.py, beside this script
from models import Blocks
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

SIZES = {"tiny": (32, 2), "medium": (512, 4)}  # (width, blocks)
# layout -> (processes, dp_shard, tp)
LAYOUTS = {"tp2": (2, 1, 2), "tp2xdp2": (4, 2, 2)}
# (layout, size) -> (generations, rounds per generation, timed steps per round): many short
# paired rounds, as a step on shared cores jitters by tens of percent from one to the next.
ROUNDS = {
    ("tp2", "tiny"): (8, 30, 3),
    ("tp2", "medium"): (5, 12, 2),
    ("tp2xdp2", "tiny"): (4, 15, 3),
}
WARMUP_STEPS = 1
PER_REPLICA_BATCH = 16  # samples per data-parallel rank and step
PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
# Above every gradient norm these models reach: both loops compute the norm and scale the
# gradients by the (exactly 1.0) coefficient, so the cost is the same as when clipping bites,
# and the weights of the two loops stay bitwise comparable (two correct ways of summing the
# norm round differently, which clipping would carry into the weights).
MAX_NORM = 1e6


def _model(width: int, blocks: int) -> Blocks:
    torch.manual_seed(0)
    return Blocks(width, blocks)


def _data(width: int, steps: int, replicas: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    count = steps * replicas * PER_REPLICA_BATCH
    return TensorDataset(
        torch.randn(count, width, generator=generator),
        torch.randn(count, width, generator=generator),
    )


class ContiguousShard(Sampler[int]):
    """Replica r takes the r-th contiguous batch of every global batch (slipstream's layout)."""

    def __init__(self, length: int, rank: int, replicas: int) -> None:
        per_step = replicas * PER_REPLICA_BATCH
        self.indices = [
            i
            for start in range(0, length, per_step)
            for i in range(start + rank * PER_REPLICA_BATCH, start + (rank + 1) * PER_REPLICA_BATCH)
        ]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _local_parts(model: nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [
        (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()
    ]


_MESHES: dict[tuple[int, int], Any] = {}


def _mesh(dp_shard: int, tp: int) -> Any:
    """The hand-written loops' mesh (dp_shard, tp), built once per process like a script's."""
    from torch.distributed.device_mesh import init_device_mesh

    if (dp_shard, tp) not in _MESHES:
        _MESHES[dp_shard, tp] = init_device_mesh(
            "cpu", (dp_shard, tp), mesh_dim_names=("dp_shard", "tp")
        )
    return _MESHES[dp_shard, tp]


def _copies(tensor: torch.Tensor, world: int) -> int:
    """How many processes hold each element of ``tensor``'s local part: those along the mesh
    dimensions it is replicated over, times the processes outside its mesh (with TP and data
    parallelism only, they hold the same values: a norm's weight, sharded by FSDP2 over
    dp_shard alone, is the same in every TP rank)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return world
    mesh = tensor.device_mesh
    copies = world // mesh.size()
    for size, placement in zip(mesh.shape, tensor.placements, strict=True):
        if placement.is_replicate():
            copies *= size
    return copies


class GlobalNormClip:
    """A hand-written ``clip_grad_norm_`` for gradients split over several meshes: the
    weighted squares of the local parts, summed by one all-reduce over all processes."""

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        # 1 / (processes holding each element): summed over all processes, the weighted local
        # squares are the squared norm of the full gradients.
        world = dist.get_world_size()
        self.parameters = parameters
        self.weights = torch.tensor(
            [1.0 / _copies(p, world) for p in parameters], dtype=torch.float64
        )

    def __call__(self, max_norm: float) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        grads = [
            g.to_local() if isinstance(g, DTensor) else g
            for g in (p.grad for p in self.parameters)
            if g is not None
        ]
        norms = torch.stack(torch._foreach_norm(grads)).double()
        total = (norms.square() * self.weights).sum()
        dist.all_reduce(total)
        norm = total.sqrt().float()
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm


class HandWritten:
    """parallelize_module + fully_shard + a hand-written global-norm clip."""

    name = "torch"

    def __init__(self, width: int, blocks: int, steps: int, dp_shard: int, tp: int) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = _mesh(dp_shard, tp)
        model = _model(width, blocks)
        parallelize_module(
            model,
            mesh["tp"],
            {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()},
        )
        if dp_shard > 1:  # nothing to shard over one process
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp_shard"])
            fully_shard(model, mesh=mesh["dp_shard"])
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.clip = GlobalNormClip(list(model.parameters()))
        self.norms: list[torch.Tensor] = []
        replica = mesh["dp_shard"].get_local_rank()
        data = _data(width, steps, dp_shard)
        self.loader = DataLoader(
            data,
            batch_size=PER_REPLICA_BATCH,
            sampler=ContiguousShard(len(data), replica, dp_shard),
        )

    def step(self, batch: Any) -> None:
        x, y = batch
        self.optimizer.zero_grad()
        F.mse_loss(self.model(x), y).backward()
        self.norms.append(self.clip(MAX_NORM))
        self.optimizer.step()

    def weights(self) -> list[torch.Tensor]:
        """This process's part of every parameter (the variants split them alike)."""
        return _local_parts(self.model)


class Control(HandWritten):
    """The hand-written loop again, as its own variant: its ratio to the first copy is the
    noise floor of the measurement (an A/A comparison)."""

    name = "control"


class Slipstream(HandWritten):
    name = "slipstream"

    def __init__(self, width: int, blocks: int, steps: int, dp_shard: int, tp: int) -> None:
        from slipstream import Accelerator, ParallelismConfig

        self.accelerator = Accelerator(
            parallelism_config=ParallelismConfig(dp_shard_size=dp_shard, tp_size=tp, tp_plan=PLAN)
        )
        model = _model(width, blocks)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(_data(width, steps, dp_shard), batch_size=PER_REPLICA_BATCH)
        self.model, self.optimizer, self.loader = self.accelerator.prepare(model, optimizer, loader)
        self.norms = []

    def step(self, batch: Any) -> None:
        x, y = batch
        self.optimizer.zero_grad()
        self.accelerator.backward(F.mse_loss(self.model(x), y))
        self.norms.append(self.accelerator.clip_grad_norm_(self.model.parameters(), MAX_NORM))
        self.optimizer.step()

    def weights(self) -> list[torch.Tensor]:
        return _local_parts(self.accelerator.unwrap_model(self.model))


class SlipstreamHandClip(Slipstream):
    """The prepared loop clipping with the hand-written function instead of
    ``accelerator.clip_grad_norm_``: what the rest of the prepared loop costs."""

    name = "hand-clip"

    def __init__(self, width: int, blocks: int, steps: int, dp_shard: int, tp: int) -> None:
        super().__init__(width, blocks, steps, dp_shard, tp)
        self.clip = GlobalNormClip(list(self.model.parameters()))

    def step(self, batch: Any) -> None:
        x, y = batch
        self.optimizer.zero_grad()
        self.accelerator.backward(F.mse_loss(self.model(x), y))
        self.norms.append(self.clip(MAX_NORM))
        self.optimizer.step()


def _variants() -> list[type[HandWritten]]:
    return [HandWritten, Slipstream, Control, SlipstreamHandClip]


def _generation(
    variants: list[type[HandWritten]],
    layout: str,
    size: str,
    rounds: int,
    timed: int,
    wall: dict[str, list[float]],
    cpu: dict[str, list[float]],
) -> tuple[dict[str, bool], float]:
    """Build every variant afresh and run the rounds; whether each ended with the
    hand-written loop's weights on every process, and the largest relative difference
    between slipstream's gradient norms and the hand-written loop's."""
    width, blocks = SIZES[size]
    _, dp_shard, tp = LAYOUTS[layout]
    steps = rounds * (WARMUP_STEPS + timed)
    runs = [kind(width, blocks, steps, dp_shard, tp) for kind in variants]
    workers.time_rounds(runs, rounds, timed, WARMUP_STEPS, wall, cpu)
    by_name = {run.name: run for run in runs}
    reference = by_name["torch"].weights()
    equal = {}
    for run in runs:
        if run.name == "torch":
            continue
        same = all(torch.equal(a, b) for a, b in zip(reference, run.weights(), strict=True))
        equal[run.name] = workers.on_every_process(same)
    norm_difference = max(
        abs(float(a) - float(b)) / float(b)
        for a, b in zip(by_name["slipstream"].norms, by_name["torch"].norms, strict=True)
    )
    return equal, norm_difference


def worker(layout: str, size: str, generations: int, rounds: int, timed: int) -> None:
    dist.init_process_group("gloo")
    wall, cpu, equal, differences = workers.run_generations(
        _variants(),
        generations,
        lambda order, wall, cpu: _generation(order, layout, size, rounds, timed, wall, cpu),
    )
    norm_difference = max(differences)
    if dist.get_rank() == 0:
        workers.report(
            {
                "layout": layout,
                "size": size,
                **workers.paired_statistics(wall, cpu, timed),
                "weights_equal": equal,
                "norm_difference": norm_difference,
            }
        )
    dist.destroy_process_group()


def main() -> None:
    args = workers.case_arguments(__doc__.splitlines()[0], LAYOUTS, SIZES)
    if args.worker:
        worker(args.worker, args.size, args.generations, args.rounds, args.timed)
        return
    for layout, size, processes, result in workers.run_cases(
        __file__, args, ROUNDS, ("tp2", "tiny"), lambda layout: LAYOUTS[layout][0]
    ):
        label = f"{layout} {size}"
        workers.print_step_ratios(label, result, 14)
        print(
            f"{label:14s} {result['steps']} paired steps per variant on {processes} processes; "
            f"gradient norms: slipstream vs hand-written differ by at most "
            f"{result['norm_difference']:.1e} (relative)"
        )


if __name__ == "__main__":
    main()
