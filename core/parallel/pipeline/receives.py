"""Pipeline schedules whose receives are posted when the step starts, for gloo.

Over gloo a point-to-point transfer is a rendezvous: a send posted before the peer has
posted the matching receive only announces itself, and the data moves when the receiver's
announcement reaches the sender's I/O thread. torch's schedules post each receive just
before the action that needs it (``Schedule1F1B`` even fuses it with a send and waits on
both), so the sender has usually moved on to its next action by then, and the data waits
for its I/O thread to be scheduled beside that computation: on 2 loaded CPU processes a
backward's input gradient reached the previous stage 5.4-5.5 ms after its send was posted.
Posted early, the receive is known to the sender, whose send writes the data at once (in
a trace at a similar load the wait ended 0.14-0.24 ms after the send was posted).

Posting on gloo never blocks; only waits do. So every receive of the step is posted at its
start, in the order torch's schedule posts them (gloo matches the sends and receives of a
pair in order, so each receive gets the same message as before), and every wait stays
where torch's schedule has it: each wait still needs only what it needed before (no new
deadlock), the computation and its order are torch's, and gradients are bitwise the same. The receive buffers are per
micro-batch and untouched before their action. Other backends keep torch's schedule: NCCL
runs a pair's operations in the order they are posted, so a receive posted early would
hold back the sends behind it.

The multi-stage schedules already run from a list of actions with the sends and receives
in it (``pipeline_order_with_comms``); their receives move to the front. GPipe and 1F1B run
a hand-written loop, so they become torch's ``_PipelineScheduleRuntime`` with the same
computation order, lowered to sends and receives by torch and then reordered. Either runs
through slipstream's ``ActionRunner`` (runner.py: no profiler range around every action
unless a profiler records) when its stages are not FSDP-wrapped.

Example::

    schedule = with_early_receives(Schedule1F1B(stage, 4, loss_fn=loss), "1f1b", [stage], 4, loss)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .runner import ActionRunner


def posts_without_blocking(group: Any, stages: list[Any]) -> bool:
    """Whether this pipeline's transfers run over gloo (CPU stages on a gloo group)."""
    if any(torch.device(stage.device).type != "cpu" for stage in stages):
        return False
    backend = str(dist.get_backend(group))
    return backend == "gloo" or "cpu:gloo" in backend


def compute_order(name: str, stage: int, stages: int, microbatches: int) -> list[Any]:
    """The forwards and full backwards a GPipe or 1F1B stage runs, in the order torch's
    loop runs them (1F1B: ``stages - stage`` forwards, then a backward and a forward in
    turn, then the remaining backwards)."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    forward, backward = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    if name == "gpipe":
        return [_Action(stage, forward, i) for i in range(microbatches)] + [
            _Action(stage, backward, i) for i in range(microbatches)
        ]
    warmup = min(microbatches, stages - stage)
    order = [_Action(stage, forward, i) for i in range(warmup)]
    for index in range(microbatches):
        order.append(_Action(stage, backward, index))
        if warmup + index < microbatches:
            order.append(_Action(stage, forward, warmup + index))
    return order


def _receives_first(actions: list[Any]) -> list[Any]:
    from torch.distributed.pipelining.schedules import _ComputationType

    kinds = (_ComputationType.RECV_F, _ComputationType.RECV_B)
    receives = [action for action in actions if action.computation_type in kinds]
    return receives + [action for action in actions if action.computation_type not in kinds]


def with_early_receives(
    schedule: Any,
    name: str,
    stages: list[Any],
    microbatches: int,
    loss_fn: Callable[..., torch.Tensor],
) -> Any:
    """``schedule`` (torch's, for schedule ``name``) with every receive posted at the
    start of the step: the same schedule reordered, or for GPipe and 1F1B torch's action
    runner over the same computation order."""
    from torch.distributed.pipelining import schedules

    if not isinstance(schedule, schedules._PipelineScheduleRuntime):
        stage = stages[0]
        orders = {
            index: compute_order(name, index, stage.num_stages, microbatches)
            for index in range(stage.num_stages)
        }
        schedule = schedules._PipelineScheduleRuntime(
            stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False
        )
        schedule._prepare_schedule_with_comms(orders)
    lowered = schedule.pipeline_order_with_comms
    lowered[schedule.rank] = _receives_first(lowered[schedule.rank])
    if ActionRunner.applies_to(schedule):
        schedule._step_microbatches = ActionRunner(schedule)
    return schedule
