"""Per-step time of a prepared pipeline-parallel training loop versus the same loop by hand.

The prepared loop is ``Accelerator(parallelism_config=ParallelismConfig(pp_size=2,
pp_schedule=..., pp_microbatches=4))``, ``prepare``, ``forward_backward``,
``clip_grad_norm_`` and the optimizer's ``step``. The hand-written one is what the
torch.distributed.pipelining documentation shows: the same ``nn.Sequential`` of MLP blocks
split by hand into the same stages (equal runs of blocks; process r holds stages r, r+p, ...
or, for the V-shaped schedules, r and 2p-1-r), a ``PipelineStage`` per local stage, the same
torch schedule with the same loss (``F.mse_loss``), the inputs passed where the first stage
runs and the targets where the last one does, AdamW over the local stages' parameters, and a
hand-written global gradient norm (the local squares summed, one all-reduce over the
pipeline, the same scaling as ``clip_grad_norm_``).

Measured as ``ddp_overhead.py`` and ``tp_overhead.py`` measure: the variants take turns in
the same processes, in each round (in a rotating order) one untimed warm-up step and then a
few steps each timed on its own; the hand-written loop runs as two identical copies, a step
is compared with each copy's step at the same position of the same round, and the median of
those per-step ratios (averaged over the two copies) is reported with a bootstrap 95%
interval and the main-thread CPU time per step above the hand-written loop's. The second
copy against the first ("control") is the noise floor. Every variant is rebuilt several
times in a shuffled order ("generations"); the final weights of every variant must equal
the hand-written loop's, and the gradient norms slipstream returns must match the
hand-written ones.

An informational variant locates a difference: ``torch+loss`` is the hand-written loop that
also hands every process the batch's mean loss, as ``forward_backward`` returns it (one
broadcast from the last stage; the hand-written loop has it on the last stage only), and
slipstream is compared with it too, paired the same way: the same work on both sides.

    python benchmarks/pp_overhead.py            # 1f1b: tiny and medium; interleaved_1f1b, zbv: tiny
    python benchmarks/pp_overhead.py --quick    # smoke test
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import workers  # benchmarks/workers.py, beside this script
from models import Block
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SIZES = {"tiny": (32, 4), "medium": (256, 8)}  # (width, blocks)
PP = 2  # processes, one pipeline over all of them
# A power of two: slipstream averages the micro-batches by dividing each loss by their number,
# torch's schedule (as written by hand here) by dividing the summed gradients; scaling by a
# power of two is exact, so both give the same gradients to the bit.
MICROBATCHES = 4
MICRO_BATCH = 4  # samples per micro-batch: 16 per step
# (schedule, size) -> (generations, rounds per generation, timed steps per round): many short
# paired rounds, as a step on shared cores jitters by tens of percent from one to the next.
ROUNDS = {
    ("1f1b", "tiny"): (8, 25, 3),
    ("1f1b", "medium"): (5, 12, 2),
    ("interleaved_1f1b", "tiny"): (5, 20, 3),
    ("zbv", "tiny"): (5, 20, 3),
}
WARMUP_STEPS = 1
# Above every gradient norm these models reach: both loops compute the norm and scale the
# gradients by the (exactly 1.0) coefficient, so the cost is the same as when clipping bites,
# and the weights of the two loops stay bitwise comparable (two correct ways of summing the
# norm round differently, which clipping would carry into the weights).
MAX_NORM = 1e6
# torch's schedules that hold one stage per process; the V-shaped ones place stages r and
# 2p-1-r on process r, the others r, r+p, ...
SINGLE_STAGE = ("gpipe", "1f1b")
V_SHAPED = ("zbv", "dualpipev")
SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def _model(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(blocks)])


def _data(width: int, steps: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    count = steps * MICROBATCHES * MICRO_BATCH
    return TensorDataset(
        torch.randn(count, width, generator=generator),
        torch.randn(count, width, generator=generator),
    )


def _stages_of(schedule: str, rank: int) -> list[int]:
    """The stage indices process ``rank`` holds (2 stages per process but for 1f1b/gpipe)."""
    if schedule in SINGLE_STAGE:
        return [rank]
    if schedule in V_SHAPED:
        return [rank, 2 * PP - 1 - rank]
    return [rank, rank + PP]


class HandWritten:
    """PipelineStage + a torch schedule + a hand-written global-norm clip."""

    name = "torch"

    def __init__(self, width: int, blocks: int, steps: int, schedule: str) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        rank = dist.get_rank()
        model = _model(width, blocks)
        local = _stages_of(schedule, rank)
        stages = 1 if schedule in SINGLE_STAGE else 2
        per_stage = blocks // (PP * stages)
        self.stages = []
        self.parameters: dict[str, nn.Parameter] = {}
        for index in local:
            first = index * per_stage
            submodule = model[first : first + per_stage]  # the same Block objects, same names
            self.parameters.update(
                (name, parameter)
                for name, parameter in model.named_parameters()
                if first <= int(name.split(".")[0]) < first + per_stage
            )
            self.stages.append(PipelineStage(submodule, index, PP * stages, torch.device("cpu")))
        self.holds_first = 0 in local
        self.holds_last = PP * stages - 1 in local
        self.last_rank = 0 if schedule in V_SHAPED else PP - 1  # where the last stage runs
        cls = getattr(schedules, SCHEDULE_CLASSES[schedule])
        self.schedule = cls(
            self.stages[0] if schedule in SINGLE_STAGE else self.stages,
            n_microbatches=MICROBATCHES,
            loss_fn=F.mse_loss,
        )
        self.optimizer = torch.optim.AdamW(self.parameters.values(), lr=1e-3)
        self.norms: list[torch.Tensor] = []
        self.loader = DataLoader(_data(width, steps), batch_size=MICROBATCHES * MICRO_BATCH)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        # As torch's examples: inputs where the first stage runs, targets where the last does.
        inputs = (x,) if self.holds_first else ()
        losses: list[torch.Tensor] | None = [] if self.holds_last else None
        self.schedule.step(*inputs, target=y if self.holds_last else None, losses=losses)

    def clip(self) -> torch.Tensor:
        grads = [p.grad for p in self.parameters.values() if p.grad is not None]
        norms = torch.stack(torch._foreach_norm(grads)).double()
        total = norms.square().sum()
        dist.all_reduce(total)  # the stages hold disjoint parameters: one sum over the pipeline
        norm = total.sqrt().float()
        torch._foreach_mul_(grads, torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0))
        return norm

    def step(self, batch: Any) -> None:
        x, y = batch
        self.optimizer.zero_grad()
        self.forward_backward(x, y)
        self.norms.append(self.clip())
        self.optimizer.step()

    def weights(self) -> dict[str, torch.Tensor]:
        """This process's parameters by their names in the whole model."""
        return {name: p.detach().clone() for name, p in self.parameters.items()}


class Control(HandWritten):
    """The hand-written loop again, as its own variant: its ratio to the first copy is the
    noise floor of the measurement (an A/A comparison)."""

    name = "control"


class HandWrittenWithLoss(HandWritten):
    """The hand-written loop that also gives every process the batch's mean loss, as
    ``forward_backward`` returns it."""

    name = "torch+loss"

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        inputs = (x,) if self.holds_first else ()
        losses: list[torch.Tensor] = []
        self.schedule.step(*inputs, target=y if self.holds_last else None, losses=losses)
        loss = torch.stack(losses).mean() if self.holds_last else torch.zeros(())
        dist.broadcast(loss, src=self.last_rank)


class Slipstream(HandWritten):
    name = "slipstream"

    def __init__(self, width: int, blocks: int, steps: int, schedule: str) -> None:
        from slipstream import Accelerator, ParallelismConfig

        self.accelerator = Accelerator(
            parallelism_config=ParallelismConfig(
                pp_size=PP, pp_schedule=schedule, pp_microbatches=MICROBATCHES
            )
        )
        model = _model(width, blocks)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(_data(width, steps), batch_size=MICROBATCHES * MICRO_BATCH)
        self.model, self.optimizer, self.loader = self.accelerator.prepare(model, optimizer, loader)
        self.norms = []

    def step(self, batch: Any) -> None:
        x, y = batch
        self.optimizer.zero_grad()
        self.accelerator.forward_backward(self.model, x, target=y, loss_fn=F.mse_loss)
        self.norms.append(self.accelerator.clip_grad_norm_(self.model.parameters(), MAX_NORM))
        self.optimizer.step()

    def weights(self) -> dict[str, torch.Tensor]:
        model = self.accelerator.unwrap_model(self.model)
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def _variants() -> list[type[HandWritten]]:
    return [HandWritten, Slipstream, Control, HandWrittenWithLoss]


def _generation(
    variants: list[type[HandWritten]],
    schedule: str,
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
    steps = rounds * (WARMUP_STEPS + timed)
    runs = [kind(width, blocks, steps, schedule) for kind in variants]
    workers.time_rounds(runs, rounds, timed, WARMUP_STEPS, wall, cpu)
    by_name = {run.name: run for run in runs}
    reference = by_name["torch"].weights()
    equal = {}
    for run in runs:
        if run.name == "torch":
            continue
        weights = run.weights()
        same = weights.keys() == reference.keys() and all(
            torch.equal(reference[name], weights[name]) for name in reference
        )
        equal[run.name] = workers.on_every_process(same)
    norm_difference = max(
        abs(float(a) - float(b)) / float(b)
        for a, b in zip(by_name["slipstream"].norms, by_name["torch"].norms, strict=True)
    )
    return equal, norm_difference


def worker(schedule: str, size: str, generations: int, rounds: int, timed: int) -> None:
    dist.init_process_group("gloo")
    wall, cpu, equal, differences = workers.run_generations(
        _variants(),
        generations,
        lambda order, wall, cpu: _generation(order, schedule, size, rounds, timed, wall, cpu),
    )
    norm_difference = max(differences)
    if dist.get_rank() == 0:
        workers.report(
            {
                "schedule": schedule,
                "size": size,
                **workers.paired_statistics(wall, cpu, timed),
                # The same work on both sides: the loss handed to every process.
                "vs_loss": workers.median_ratio(wall["slipstream"], [wall["torch+loss"]]),
                "vs_loss_interval": workers.median_ratio_interval(
                    wall["slipstream"], [wall["torch+loss"]], timed
                ),
                "weights_equal": equal,
                "norm_difference": norm_difference,
            }
        )
    dist.destroy_process_group()


def main() -> None:
    args = workers.case_arguments(__doc__.splitlines()[0], SCHEDULE_CLASSES, SIZES)
    if args.worker:
        worker(args.worker, args.size, args.generations, args.rounds, args.timed)
        return
    for schedule, size, processes, result in workers.run_cases(
        __file__, args, ROUNDS, ("1f1b", "tiny"), lambda schedule: PP
    ):
        label = f"pp2 {schedule} {size}"
        workers.print_step_ratios(label, result, 25)
        low, high = result["vs_loss_interval"]
        print(
            f"{label:25s} slipstream vs torch+loss (both hand every process the loss): ratio "
            f"{result['vs_loss']:.3f}x  (95% interval {low:.3f}-{high:.3f})"
        )
        print(
            f"{label:25s} {result['steps']} paired steps per variant on {processes} processes; "
            f"gradient norms: slipstream vs hand-written differ by at most "
            f"{result['norm_difference']:.1e} (relative)"
        )


if __name__ == "__main__":
    main()
