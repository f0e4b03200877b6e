"""Per-step time of a prepared expert-parallel training loop versus the same loop by hand.

The prepared loop is ``Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=P,
ep_size=2, ep_plan=["blocks.*.experts"]))``, ``prepare``, ``backward``, ``clip_grad_norm_``
and the optimizer's ``step``. The hand-written one is what a torchtitan user writes: the
same DeviceMesh (``init_device_mesh``, the shard dimension unflattened into efsdp x ep), each
experts module's stacked weights split along the experts as DTensors on the ep mesh, its
forward replaced by a hand-written dispatch (sort the (token, expert) pairs, exchange the
counts, ``all_to_all_single`` the rows with ``torch.distributed.nn``'s differentiable
collective, run the module's own forward on the local experts, send the results back,
weight and sum), FSDP2 ``fully_shard`` on each experts module over efsdp (gradients divided
by all data-parallel processes), on each block and on the root over dp_shard, and a
hand-written global-norm clip (one all-reduce of the local squares). Both train a stack of
mixture-of-experts blocks (``models.MoEBlocks``, top-2 of the experts) with AdamW on the same
batches.

Measured as ``tp_overhead.py`` measures: the variants take turns in the same processes; the
hand-written loop runs as two identical copies and the second against the first
("control") is the noise floor (an A/A comparison); the ratio is the median of per-step
ratios with a bootstrap 95% interval. The final weights of every variant must equal the
hand-written loop's.

Layouts: ``ep2`` (2 processes: dp_shard=2, ep=2, so each expert whole on one process) and
``ep2xdp2`` (4 processes: dp_shard=4, ep=2, each expert FSDP-sharded over 2; 4 processes on
a 2-core machine are oversubscribed, so its figures are noisier).

    python benchmarks/ep_overhead.py            # ep2: tiny and medium; ep2xdp2: tiny
    python benchmarks/ep_overhead.py --quick    # smoke test
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import workers  # benchmarks/workers.py, beside this script
from models import MoEBlocks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tp_overhead import PER_REPLICA_BATCH, ContiguousShard, GlobalNormClip

SIZES = {"tiny": (32, 2, 4), "medium": (256, 4, 8)}  # (width, blocks, experts)
# layout -> (processes, dp_shard, ep)
LAYOUTS = {"ep2": (2, 2, 2), "ep2xdp2": (4, 4, 2)}
ROUNDS = {
    ("ep2", "tiny"): (6, 25, 3),
    ("ep2", "medium"): (4, 12, 2),
    ("ep2xdp2", "tiny"): (3, 12, 3),
}
WARMUP_STEPS = 1
SEQUENCE = 8
MAX_NORM = 1e6  # computed and applied, never binding: the weights stay comparable


def _model(width: int, blocks: int, experts: int) -> MoEBlocks:
    torch.manual_seed(0)
    return MoEBlocks(width, blocks, experts)


def _data(width: int, steps: int, replicas: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    count = steps * replicas * PER_REPLICA_BATCH
    return TensorDataset(
        torch.randn(count, SEQUENCE, width, generator=generator),
        torch.randn(count, SEQUENCE, width, generator=generator),
    )


def _local_parts(model: nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [
        (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()
    ]


_MESHES: dict[tuple[int, int], Any] = {}


def _meshes(dp_shard: int, ep: int) -> Any:
    """(dp_shard mesh, efsdp mesh, ep mesh), built once per process like a script's."""
    from torch.distributed.device_mesh import init_device_mesh

    if (dp_shard, ep) not in _MESHES:
        mesh = init_device_mesh("cpu", (1, dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))
        both = mesh["dp_replicate", "dp_shard"]._unflatten(
            "dp_shard", (dp_shard // ep, ep), ("efsdp", "ep")
        )
        _MESHES[dp_shard, ep] = (mesh["dp_shard"], both["efsdp"], both["ep"])
    return _MESHES[dp_shard, ep]


def _hand_written_dispatch(experts: nn.Module, ep_mesh: Any) -> None:
    """Split ``experts``'s stacked weights over ``ep_mesh`` and route its calls by hand."""
    from torch.distributed.nn.functional import all_to_all_single
    from torch.distributed.tensor import DTensor, Shard

    group, processes = ep_mesh.get_group(), ep_mesh.size()
    total = experts.num_experts
    local = total // processes
    first = ep_mesh.get_local_rank() * local
    for name in ("w_in", "w_out"):
        weight = getattr(experts, name)
        part = weight.detach()[first : first + local].clone()
        split = DTensor.from_local(part, ep_mesh, [Shard(0)], run_check=False)
        experts.register_parameter(name, nn.Parameter(split))
    own_forward = type(experts).forward

    def forward(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        slots = index.shape[-1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        send_counts = torch.bincount(flat, minlength=total).view(processes, local)
        receive_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(receive_counts, send_counts, group=group)
        sizes = torch.stack([send_counts.sum(1), receive_counts.sum(1)]).tolist()
        rows = x[order // slots]
        received = rows.new_empty((sum(sizes[1]), rows.shape[1]))
        received = all_to_all_single(received, rows, sizes[1], sizes[0], group=group)
        expert = torch.arange(local).repeat(processes).repeat_interleave(receive_counts.reshape(-1))
        saved = {n: experts._parameters[n] for n in ("w_in", "w_out")}
        experts._parameters.update({n: w.to_local() for n, w in saved.items()})
        experts.num_experts = local
        try:
            out = own_forward(experts, received, expert[:, None], received.new_ones(len(expert), 1))
        finally:
            experts._parameters.update(saved)
            experts.num_experts = total
        back = out.new_empty((len(order), out.shape[1]))
        back = all_to_all_single(back, out, sizes[0], sizes[1], group=group)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        pairs = back[inverse].view(*weights.shape, -1)
        return (pairs * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)

    experts.forward = forward


class HandWritten:
    """DTensor-split experts + a hand-written all_to_all dispatch + fully_shard + clip."""

    name = "torch"

    def __init__(self, width: int, blocks: int, experts: int, steps: int, dp_shard: int, ep: int):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        shard_mesh, efsdp_mesh, ep_mesh = _meshes(dp_shard, ep)
        model = _model(width, blocks, experts)
        efsdp = efsdp_mesh.size()

        def placement(weight: torch.Tensor) -> Shard:
            return Shard(0) if (weight.shape[0] // ep) % efsdp == 0 else Shard(1)

        for block in model.blocks:
            _hand_written_dispatch(block.experts, ep_mesh)
            unit = fully_shard(block.experts, mesh=efsdp_mesh, shard_placement_fn=placement)
            unit.set_gradient_divide_factor(float(dp_shard))
            if efsdp > 1:
                unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            fully_shard(block, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.clip = GlobalNormClip(list(model.parameters()))
        data = _data(width, steps, dp_shard)
        sampler = ContiguousShard(len(data), shard_mesh.get_local_rank(), dp_shard)
        self.loader = DataLoader(data, batch_size=PER_REPLICA_BATCH, sampler=sampler)

    def step(self, batch: Any) -> None:
        x, y = batch
        self.optimizer.zero_grad()
        F.mse_loss(self.model(x), y).backward()
        self.clip(MAX_NORM)
        self.optimizer.step()

    def weights(self) -> list[torch.Tensor]:
        return _local_parts(self.model)


class Control(HandWritten):
    """The hand-written loop again: its ratio to the first copy is the noise floor."""

    name = "control"


class Slipstream(HandWritten):
    name = "slipstream"

    def __init__(self, width: int, blocks: int, experts: int, steps: int, dp_shard: int, ep: int):
        from slipstream import Accelerator, ParallelismConfig

        config = ParallelismConfig(dp_shard_size=dp_shard, ep_size=ep, ep_plan=["blocks.*.experts"])
        self.accelerator = Accelerator(parallelism_config=config)
        model = _model(width, blocks, experts)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(_data(width, steps, dp_shard), batch_size=PER_REPLICA_BATCH)
        self.model, self.optimizer, self.loader = self.accelerator.prepare(model, optimizer, loader)

    def step(self, batch: Any) -> None:
        x, y = batch
        self.optimizer.zero_grad()
        self.accelerator.backward(F.mse_loss(self.model(x), y))
        self.accelerator.clip_grad_norm_(self.model.parameters(), MAX_NORM)
        self.optimizer.step()

    def weights(self) -> list[torch.Tensor]:
        return _local_parts(self.accelerator.unwrap_model(self.model))


def _generation(
    variants: list[type[HandWritten]],
    layout: str,
    size: str,
    rounds: int,
    timed: int,
    wall: dict[str, list[float]],
    cpu: dict[str, list[float]],
) -> tuple[dict[str, bool], None]:
    width, blocks, experts = SIZES[size]
    _, dp_shard, ep = LAYOUTS[layout]
    steps = rounds * (WARMUP_STEPS + timed)
    runs = [kind(width, blocks, experts, steps, dp_shard, ep) for kind in variants]
    workers.time_rounds(runs, rounds, timed, WARMUP_STEPS, wall, cpu)
    reference = next(run for run in runs if run.name == "torch").weights()
    equal = {}
    for run in runs:
        if run.name != "torch":
            same = all(torch.equal(a, b) for a, b in zip(reference, run.weights(), strict=True))
            equal[run.name] = workers.on_every_process(same)
    return equal, None


def worker(layout: str, size: str, generations: int, rounds: int, timed: int) -> None:
    dist.init_process_group("gloo")
    wall, cpu, equal, _ = workers.run_generations(
        [HandWritten, Slipstream, Control],
        generations,
        lambda order, wall, cpu: _generation(order, layout, size, rounds, timed, wall, cpu),
    )
    if dist.get_rank() == 0:
        statistics = workers.paired_statistics(wall, cpu, timed)
        workers.report({"layout": layout, "size": size, **statistics, "weights_equal": equal})
    dist.destroy_process_group()


def main() -> None:
    args = workers.case_arguments(__doc__.splitlines()[0], LAYOUTS, SIZES)
    if args.worker:
        worker(args.worker, args.size, args.generations, args.rounds, args.timed)
        return
    for layout, size, processes, result in workers.run_cases(
        __file__, args, ROUNDS, ("ep2", "tiny"), lambda layout: LAYOUTS[layout][0]
    ):
        label = f"{layout} {size}"
        workers.print_step_ratios(label, result, 14)
        print(f"{label:14s} {result['steps']} paired steps per variant on {processes} processes")


if __name__ == "__main__":
    main()
