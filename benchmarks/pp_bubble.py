"""Idle fraction ("bubble") of a pipeline-parallel training step, per schedule, against theory.

Each process runs its stages of a prepared pipeline (``ParallelismConfig(pp_size=p,
pp_schedule=..., pp_microbatches=m)``, ``accelerator.forward_backward``) on a stack of equal
MLP blocks split into equal stages. Every compute action the schedule runs is timed where it
runs: the stage's ``forward_one_chunk`` (a micro-batch's forward), ``backward_one_chunk``
(its full backward, or the input-gradient half in the zero-bubble schedules) and
``backward_weight_one_chunk`` (the weight-gradient half), plus the last stage's loss and the
final gradient scaling, by wrapping those methods of this process's ``PipelineStage`` objects
and schedule. A step is the interval between two barriers around ``forward_backward``, so
every process's step has the same length; a process is **busy** while one of its actions
runs and idle otherwise, and the step's idle fraction is ``1 - busy / step`` averaged over
the processes (the fraction of processor time the pipeline leaves unused).

Two references, both computed from the order in which the actions actually ran on each
process (recorded in the same steps) and the dependencies between stages (a micro-batch's
forward needs the previous stage's, its backward the next stage's backward, a weight
gradient its input gradient), with no time for communication:

* **theory** — every forward, input-gradient and weight-gradient action takes one unit (a
  full backward two): the schedule's own bubble as the papers state it. For ``gpipe`` and
  ``1f1b`` it is (p-1)/(m+p-1), for ``interleaved_1f1b`` and ``looped_bfs`` with v stages
  per process (p-1)/(v*m+p-1); both closed forms are printed beside it as a check. The
  zero-bubble schedules have no simple closed form for small m.
* **ideal here** — the same, with each action taking its measured median time: what is left
  when only the real costs are unequal (a backward takes about twice a forward, the first
  stage's backward computes no input gradient, the last stage adds the loss).
* **its own steps** — the same again, step by step, with each action taking the time it
  took in that step: the step's critical path runs through whichever instances were slow
  (a micro-batch's action varies by 10-20% from step to step on the CPUs measured), which
  medians smooth away, so "ideal here" is a little below what any runtime could reach with
  those compute times. Printed as the median over steps of the step's idle fraction less
  its own ideal.

What the measured idle fraction holds beyond "ideal here" is what the pipeline machinery
adds (beyond "its own steps", with the actions' variation taken out). Part of the idle time is **waiting on other stages**: blocked in the schedule's
point-to-point waits before the process's last action, and everything after that action
(the loss handed to every process, the closing barrier) — the bubble itself, transfer
latency and the other stages' delays. The rest is the process's own time between actions:
the schedule's Python, posting sends and receives, splitting the batch. The printed ratio is
the step against the step theory allows for the same compute, (1 - theory) / (1 - idle):
1.00 would be a pipeline that loses nothing but its schedule's bubble.

Each schedule is measured three ways in one run, rotated round by round: **slipstream**
(over gloo its receives are posted when the step starts and its own action runner carries
out the schedule: core/parallel/pipeline/receives.py, runner.py), **torch schedule**
(slipstream running torch's schedule as it is, ``PipelineRuntime.set_early_receives(False)``:
what slipstream did before) and **torch loop** (the hand-written loop: the same blocks split
by hand, a ``PipelineStage`` per local stage and torch's schedule class); with
``--variants`` also **slipstream over gloo** (its runner with the transfers on gloo, not
the local transport of shared-memory rings and Unix sockets: local_transport.py). Their final
gradients are the same bits (tests/core/parallel/test_pipeline_receives.py); only where the
idle time goes differs.

On 2 processes on the 2-core machine each process has a core of its own (OMP_NUM_THREADS=1)
and these are the headline figures. With 4 processes on 2 cores, whenever more than two
processes compute at once they share the cores: their actions stretch in wall time (the
"stretch" column: wall time over the thread's CPU time within the actions), which counts as
busy, so the measured idle fraction is not the schedule's; read those rows as a smoke test.

    python benchmarks/pp_bubble.py            # pp2 (m=4, 8) and pp4 (m=8), every schedule
    python benchmarks/pp_bubble.py --quick    # smoke test: pp2, m=4, three schedules
    python benchmarks/pp_bubble.py --cases 2x4 --schedules 1f1b,zbv --rounds 5 --timed 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import workers  # benchmarks/workers.py, beside this script
from models import Block
from torch import nn

from slipstream.parallel.config_values import PIPELINE_SCHEDULES as PIPELINE_CLASSES

# What each schedule is measured as: slipstream (over gloo its receives are posted when the
# step starts, and between processes of one machine its runner's transfers use shared memory),
# slipstream running torch's schedule as it is ("before"), and the hand-written torch loop.
VARIANTS = ("slipstream", "torch schedule", "torch loop")
#: Measured only when asked for (--variants): slipstream's runner with its transfers on gloo
#: rather than the local transport (what it did before that transport).
EXTRA_VARIANTS = ("slipstream over gloo",)
SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zb",
    "zbv",
    "dualpipev",
)
# Eight equal blocks: every layout used here (2 or 4 processes, 1 or 2 stages each) splits
# them into equal stages, so theory's equal-stage assumption holds.
WIDTH, BLOCKS = 256, 8
# Samples per micro-batch, the same for every m: each action costs the same whatever m is.
MICRO_BATCH = 64
# (processes, micro-batches) -> (rounds, timed steps per schedule and round)
CASES = {(2, 4): (4, 3), (2, 8): (4, 2), (4, 8): (3, 2)}
WARMUP_STEPS = 1
# Units of "theory": forward, input gradient, weight gradient one each, a full backward both.
UNIT_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, "L": 0.0, "R": 0.0}


# An action as recorded: (kind, stage index, micro-batch, end time, wall seconds, thread CPU
# seconds). Kinds: F forward, B full backward, I input gradient, W weight gradient, L the last
# stage's loss (folded into its forward), R the final gradient scaling (no dependencies).
Action = tuple[str, int, int, float, float, float]


class Recorder:
    """Times this process's pipeline actions by wrapping its stages' and schedule's methods,
    and the schedule's blocking point-to-point waits."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.waits: list[tuple[float, float]] = []  # (start, end) of each blocking wait
        self.schedule: Any = None

    def _timed(self, kind: Callable[..., str], stage: int, method: Callable[..., Any]) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                end, cpu = time.perf_counter(), time.thread_time() - start_cpu
                chunk = args[0] if args and isinstance(args[0], int) else -1
                self.actions.append((kind(*args, **kwargs), stage, chunk, end, end - start, cpu))

        return timed

    def instrument(self, stages: list[Any]) -> None:
        def backward_kind(*args: Any, full_backward: bool = True, **kwargs: Any) -> str:
            return "B" if full_backward else "I"

        for stage in stages:
            index = stage.stage_index
            stage.forward_one_chunk = self._timed(
                lambda *a, **k: "F", index, stage.forward_one_chunk
            )
            stage.backward_one_chunk = self._timed(backward_kind, index, stage.backward_one_chunk)
            stage.backward_weight_one_chunk = self._timed(
                lambda *a, **k: "W", index, stage.backward_weight_one_chunk
            )
            stage.perform_reduce_grad = self._timed(
                lambda *a, **k: "R", index, stage.perform_reduce_grad
            )

    def instrument_loss(self, schedule: Any) -> None:
        """Time the last stage's loss (the schedule computes it between actions)."""
        self.schedule = schedule
        compute_loss = schedule._maybe_compute_loss

        def timed_loss(stage: Any, output: Any, targets: Any, chunk: int, *rest: Any) -> Any:
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return compute_loss(stage, output, targets, chunk, *rest)
            finally:
                if stage.is_last:
                    end, cpu = time.perf_counter(), time.thread_time() - start_cpu
                    self.actions.append(("L", stage.stage_index, chunk, end, end - start, cpu))

        schedule._maybe_compute_loss = timed_loss

    def waiting(self, step_end: float) -> float:
        """Seconds this process waited on other stages in a step ending at ``step_end``: its
        blocking point-to-point waits before its last action ended, and everything after
        (the loss handed to every process, the closing barrier), where the process only
        waits for the others to finish."""
        last = max(end for _, _, _, end, _, _ in self.actions)
        blocked = sum(min(end, last) - start for start, end in self.waits if start < last)
        return blocked + (step_end - last)


def _instrument_waits(active: list[Recorder | None]) -> None:
    """Time the schedules' blocking point-to-point waits (a private helper of torch's
    schedules: if it is gone, only the waiting after the last action is counted)."""
    from torch.distributed.pipelining import schedules

    wait = getattr(schedules, "_wait_batch_p2p", None)
    if wait is None:
        return

    def timed_wait(work: Any) -> None:
        start = time.perf_counter()
        try:
            wait(work)
        finally:
            recorder = active[0]
            if recorder is not None:
                recorder.waits.append((start, time.perf_counter()))

    schedules._wait_batch_p2p = timed_wait


def _dependencies(kind: str, stage: int, chunk: int, stages: int) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", stage - 1, chunk)] if stage > 0 else []
    if kind in ("B", "I"):  # needs its own forward and the next stage's input gradient
        return [("F", stage, chunk)] + ([("G", stage + 1, chunk)] if stage < stages - 1 else [])
    if kind == "W":
        return [("I", stage, chunk)]
    return []


def simulate(
    orders: list[list[tuple[str, int, int]]], cost: Callable[[str, int, int], float], stages: int
) -> float:
    """Idle fraction of running each process's actions in their recorded order, each
    starting as soon as its process is free and its dependencies are done (no transfer
    time): the processes' unused share of the makespan."""
    finished: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(orders)
    busy = [0.0] * len(orders)
    position = [0] * len(orders)
    moved = True
    while moved:
        moved = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                kind, stage, chunk = order[position[rank]]
                needs = _dependencies(kind, stage, chunk, stages)
                if any(need not in finished for need in needs):
                    break
                start = max([clock[rank]] + [finished[need] for need in needs])
                clock[rank] = start + cost(kind, stage, chunk)
                busy[rank] += cost(kind, stage, chunk)
                finished[kind, stage, chunk] = clock[rank]
                if kind in ("B", "I"):  # the input gradient the previous stage waits for
                    finished["G", stage, chunk] = clock[rank]
                position[rank] += 1
                moved = True
    if any(p < len(order) for p, order in zip(position, orders, strict=True)):
        raise RuntimeError("the recorded action orders deadlock: a dependency is missing")
    makespan = max(clock)
    return 1.0 - sum(busy) / (len(orders) * makespan)


def _order(actions: list[Action]) -> list[tuple[str, int, int]]:
    """A process's compute actions in the order they ran, the loss folded into its forward."""
    return [(kind, stage, chunk) for kind, stage, chunk, *_ in actions if kind != "L"]


def closed_form(schedule: str, pp: int, microbatches: int, per_rank: int) -> float | None:
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (microbatches + pp - 1)
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return (pp - 1) / (per_rank * microbatches + pp - 1)
    return None


class HandWritten:
    """The hand-written torch loop: the same blocks split by hand into the same stages, a
    ``PipelineStage`` per local stage and torch's schedule class, inputs where the first
    stage runs and targets where the last does."""

    def __init__(self, schedule: str, pp: int, microbatches: int, per_rank: int) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        from slipstream.parallel.pipeline.runtime import resolve_plan

        self.plan = resolve_plan(pp, schedule, microbatches, per_rank)
        torch.manual_seed(0)
        model = nn.Sequential(*[Block(WIDTH) for _ in range(BLOCKS)])
        per_stage = BLOCKS // self.plan.num_stages
        local = self.plan.stages_of(dist.get_rank())
        self.stages = [
            PipelineStage(model[i * per_stage : (i + 1) * per_stage], i, self.plan.num_stages,
                          torch.device("cpu"))
            for i in local
        ]  # fmt: skip
        self.holds_first, self.holds_last = 0 in local, self.plan.num_stages - 1 in local
        cls = getattr(schedules, PIPELINE_CLASSES[schedule])
        single = schedule in ("gpipe", "1f1b")
        self.schedule = cls(self.stages[0] if single else self.stages,
                            n_microbatches=microbatches, loss_fn=F.mse_loss)  # fmt: skip
        parameters = [p for stage in self.stages for p in stage.submod.parameters()]
        self.optimizer = torch.optim.AdamW(parameters, lr=1e-4)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        inputs = (x,) if self.holds_first else ()
        self.schedule.step(*inputs, target=y if self.holds_last else None)


def _variant(
    variant: str, schedule: str, pp: int, microbatches: int
) -> tuple[Callable[[torch.Tensor, torch.Tensor], Any], torch.optim.Optimizer, Any]:
    """(forward and backward of a batch, the optimizer, what holds ``stages``/``schedule``/
    ``plan``) for one variant of one schedule."""
    from slipstream import Accelerator, ParallelismConfig
    from slipstream.parallel.pipeline import pipeline_of

    if variant == "torch loop":
        per_rank = 1 if schedule in ("gpipe", "1f1b") else 2
        hand = HandWritten(schedule, pp, microbatches, per_rank)
        return hand.forward_backward, hand.optimizer, hand
    config = ParallelismConfig(pp_size=pp, pp_schedule=schedule, pp_microbatches=microbatches)
    accelerator = Accelerator(parallelism_config=config)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(WIDTH) for _ in range(BLOCKS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    runtime = pipeline_of(accelerator.unwrap_model(model))
    assert runtime is not None
    # "before": torch's schedule as it is (receives posted just before their action).
    runtime.set_early_receives(
        variant in ("slipstream", "slipstream over gloo"), local_transport=variant == "slipstream"
    )

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> Any:
        return accelerator.forward_backward(model, x, target=y, loss_fn=F.mse_loss)

    return forward_backward, optimizer, runtime


def worker(
    pp: int,
    microbatches: int,
    schedules: list[str],
    rounds: int,
    timed: int,
    micro_batch: int,
    variants: list[str],
) -> None:
    dist.init_process_group("gloo")
    active: list[Recorder | None] = [None]
    _instrument_waits(active)
    runs: dict[tuple[str, str], tuple[Any, torch.optim.Optimizer, Recorder, Any]] = {}
    for schedule in schedules:
        for variant in variants:
            forward_backward, optimizer, holder = _variant(variant, schedule, pp, microbatches)
            recorder = Recorder()
            recorder.instrument(holder.stages)
            runs[schedule, variant] = (forward_backward, optimizer, recorder, holder)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(micro_batch * microbatches, WIDTH, generator=generator)
    y = torch.randn(micro_batch * microbatches, WIDTH, generator=generator)
    keys = list(runs)
    # Per run and timed step: (step seconds, busy seconds, busy CPU seconds, waiting).
    steps: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {k: [] for k in keys}
    # Per run: each timed step's actions, as they ran.
    actions: dict[tuple[str, str], list[list[Action]]] = {k: [] for k in keys}
    for round_index in range(rounds):
        # Rotated each round, so that no variant always runs first (or after another).
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            forward_backward, trainer, recorder, holder = runs[key]
            for step in range(WARMUP_STEPS + timed):
                if holder.schedule is not recorder.schedule:  # built anew by the runtime
                    recorder.instrument_loss(holder.schedule)
                recorder.actions, recorder.waits = [], []
                dist.barrier()
                active[0] = recorder
                start = time.perf_counter()
                forward_backward(x, y)
                dist.barrier()  # the step ends for every process when the last one is done
                end = time.perf_counter()
                active[0] = None
                trainer.step()
                trainer.zero_grad()
                if step < WARMUP_STEPS:  # the first steps also set up the stages' buffers
                    continue
                busy = sum(wall for *_, wall, _ in recorder.actions)
                cpu = sum(cpu for *_, cpu in recorder.actions)
                steps[key].append((end - start, busy, cpu, recorder.waiting(end)))
                actions[key].append(recorder.actions)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.gather_object((steps, actions), gathered if dist.get_rank() == 0 else None)
    if dist.get_rank() == 0:
        for key in keys:
            per_rank = runs[key][3].plan.stages_per_rank
            result = _summary(key[0], pp, microbatches, per_rank, [g[0][key] for g in gathered],
                              [g[1][key] for g in gathered])  # fmt: skip
            workers.report({**result, "variant": key[1]})
    dist.destroy_process_group()


def _summary(
    schedule: str,
    pp: int,
    microbatches: int,
    per_rank: int,
    steps: list[list[tuple[float, float, float, float]]],
    actions: list[list[list[Action]]],
) -> dict[str, Any]:
    """One schedule's figures from every process's records (``actions``: per process, each
    timed step's)."""
    count = len(steps[0])
    # Per step: the processes' mean idle share of the step (their steps have one length).
    idle = [statistics.fmean(1 - rank[i][1] / rank[i][0] for rank in steps) for i in range(count)]
    waiting = [statistics.fmean(rank[i][3] / rank[i][0] for rank in steps) for i in range(count)]
    step_seconds = [statistics.fmean(rank[i][0] for rank in steps) for i in range(count)]
    stretch = statistics.fmean(
        sum(s[1] for s in rank) / max(1e-12, sum(s[2] for s in rank)) for rank in steps
    )
    # The measured median time of each (kind, stage); the loss is part of the forward.
    durations: dict[tuple[str, int], list[float]] = {}
    for rank in actions:
        for step in rank:
            for kind, stage, _, _, wall, _ in step:
                durations.setdefault((kind, stage), []).append(wall)
    median = {key: statistics.median(values) for key, values in durations.items()}

    def measured(kind: str, stage: int, chunk: int) -> float:
        extra = median.get(("L", stage), 0.0) if kind == "F" else 0.0
        return median[kind, stage] + extra

    stages = pp * per_rank
    orders = [_order(rank[-1]) for rank in actions]
    # Step by step, each action with the time it took in that step ("its own steps").
    own_ideal = []
    for i in range(count):
        took = {
            (kind, stage, chunk): wall for rank in actions for kind, stage, chunk, _, wall, _ in rank[i]
        }  # fmt: skip

        def in_this_step(kind: str, stage: int, chunk: int, took: Any = took) -> float:
            extra = took.get(("L", stage, chunk), 0.0) if kind == "F" else 0.0
            return float(took[kind, stage, chunk] + extra)

        own_ideal.append(simulate([_order(rank[i]) for rank in actions], in_this_step, stages))
    return {
        "schedule": schedule,
        "pp": pp,
        "microbatches": microbatches,
        "per_rank": per_rank,
        "steps": count,
        "step_ms": 1e3 * statistics.median(step_seconds),
        "idle": statistics.median(idle),
        "idle_range": (min(idle), max(idle)),
        "waiting": statistics.median(waiting),
        "stretch": stretch,
        "theory": simulate(orders, lambda kind, stage, chunk: UNIT_COST[kind], stages),
        "closed_form": closed_form(schedule, pp, microbatches, per_rank),
        "ideal_here": simulate(orders, measured, stages),
        "own_steps_ideal": statistics.median(own_ideal),
        "over_own_steps": statistics.median(a - b for a, b in zip(idle, own_ideal, strict=True)),
        "forward_ms": 1e3 * statistics.median(v for (k, _), v in median.items() if k == "F"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", type=int, help="pipeline processes")
    parser.add_argument("--microbatches", type=int)
    parser.add_argument("--schedules")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--timed", type=int)
    parser.add_argument("--micro-batch", type=int, default=MICRO_BATCH)
    parser.add_argument("--cases", help="processes x micro-batches, e.g. 2x4,2x8")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS + EXTRA_VARIANTS)}"
    )
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.microbatches, args.schedules.split(","), args.rounds, args.timed,
               args.micro_batch, args.variants.split(","))  # fmt: skip
        return
    cases = {(2, 4): (1, 2)} if args.quick else CASES
    if args.cases:
        chosen = [tuple(int(n) for n in case.split("x")) for case in args.cases.split(",")]
        cases = {case: CASES.get(case, (3, 2)) for case in chosen}  # type: ignore[misc]
    schedules = ["gpipe", "1f1b", "zbv"] if args.quick else list(SCHEDULES)
    schedules = args.schedules.split(",") if args.schedules else schedules
    print(
        f"{BLOCKS} MLP blocks {WIDTH} wide in equal stages, {args.micro_batch} samples per "
        "micro-batch; idle = the processes' unused share of the step"
    )
    for (pp, microbatches), (rounds, timed) in cases.items():
        arguments = ["--worker", str(pp), "--microbatches", str(microbatches),
                     "--schedules", ",".join(schedules), "--rounds", str(args.rounds or rounds),
                     "--timed", str(args.timed or timed),
                     "--micro-batch", str(args.micro_batch), "--variants", args.variants]  # fmt: skip
        results = workers.run_workers(__file__, arguments, processes=pp)
        for schedule in schedules:
            for result in results:
                if result["schedule"] == schedule:
                    _print(result)


def _print(result: dict[str, Any]) -> None:
    label = f"pp{result['pp']} m={result['microbatches']} {result['schedule']} {result['variant']}"
    closed = result["closed_form"]
    formula = f" (closed form {closed:.3f})" if closed is not None else ""
    low, high = result["idle_range"]
    # The step against the step theory allows for the same compute: busy / (1 - theory).
    ratio = (1 - result["theory"]) / (1 - result["idle"])
    print(
        f"{label:42s} idle {result['idle']:.3f} ({low:.3f}-{high:.3f}), "
        f"{result['idle'] - result['ideal_here']:+.3f} over ideal here "
        f"({result['over_own_steps']:+.3f} over its own steps'); theory "
        f"{result['theory']:.3f}{formula}, ideal here {result['ideal_here']:.3f} "
        f"(its own steps {result['own_steps_ideal']:.3f}); waiting on "
        f"other stages {result['waiting']:.3f}; stretch {result['stretch']:.2f}; "
        f"{result['step_ms']:.1f} ms steps, forward {result['forward_ms']:.2f} ms, "
        f"{result['steps']} steps; step vs theory's for the same compute: ratio {ratio:.2f}x"
    )


if __name__ == "__main__":
    main()
