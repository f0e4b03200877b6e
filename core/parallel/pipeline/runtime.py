"""Running a model split into pipeline stages: schedules, the one-call training step, and
forward-only evaluation.

Under pipeline parallelism a process holds one stage (or a few, for interleaved schedules)
and forward and backward of the micro-batches interleave inside a torch.distributed
pipelining schedule, so ``loss = loss_fn(model(x), y); loss.backward()`` cannot work as
written. ``accelerator.forward_backward(model, x, target=y, loss_fn=...)`` runs the
schedule and returns the batch's mean loss on every process; calling the prepared model in
evaluation runs the forward-only schedule and hands every process the last stage's outputs.

Example::

    runtime = PipelineRuntime(stages, pp_group, plan, holders)
    loss = runtime.train(inputs, target, loss_fn)         # same value on every stage
    outputs = runtime.evaluate(inputs)                     # last stage's outputs, everywhere
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config_values import PIPELINE_SCHEDULES, schedule_name
from ..errors import ParallelismConfigError
from .local_transport import local_channels
from .receives import posts_without_blocking, with_early_receives
from .runner import ActionRunner, splits_plainly

#: Schedules that run one stage per process; the others run several ("virtual" stages).
SINGLE_STAGE = ("gpipe", "1f1b")
#: Schedules that place stages in a V (process r: stages r and 2p-1-r), not in a loop.
V_SHAPED = ("zbv", "dualpipev")


@dataclass(frozen=True)
class PipelinePlan:
    """The resolved pipeline options."""

    schedule: str
    microbatches: int
    stages_per_rank: int
    pp: int

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stage indices process ``pp_rank`` of the pipeline holds, in order."""
        if self.schedule in V_SHAPED:
            return [pp_rank, self.num_stages - 1 - pp_rank]
        return [pp_rank + k * self.pp for k in range(self.stages_per_rank)]

    def rank_of(self, stage_index: int) -> int:
        """The process of the pipeline that holds stage ``stage_index``."""
        return next(r for r in range(self.pp) if stage_index in self.stages_of(r))


def resolve_plan(
    pp: int, schedule: str, microbatches: int | None, stages_per_rank: int | None
) -> PipelinePlan:
    """Fill in defaults and check the pipeline options."""
    name = schedule_name(schedule)
    single = name in SINGLE_STAGE
    per_rank = stages_per_rank or (1 if single else 2)
    if single and per_rank != 1:
        raise ParallelismConfigError(
            f"pp_schedule={name!r} runs one stage per process, but pp_stages_per_rank="
            f"{per_rank}; use one of {', '.join(n for n in PIPELINE_SCHEDULES if n not in SINGLE_STAGE)} "
            "for several"
        )
    if name in V_SHAPED and per_rank != 2:
        raise ParallelismConfigError(
            f"pp_schedule={name!r} places exactly 2 stages on each process; set "
            "pp_stages_per_rank=2 (or leave it unset)"
        )
    if not single and per_rank < 2:
        raise ParallelismConfigError(
            f"pp_schedule={name!r} interleaves several stages per process; set "
            "pp_stages_per_rank >= 2 (or leave it unset), or use 'gpipe' / '1f1b'"
        )
    count = microbatches or per_rank * pp
    if count < 1:
        raise ParallelismConfigError(f"pp_microbatches must be at least 1, got {count}")
    if name == "interleaved_1f1b" and count % pp:
        raise ParallelismConfigError(
            f"pp_schedule='interleaved_1f1b' needs pp_microbatches to be a multiple of "
            f"pp_size={pp}, got {count}"
        )
    return PipelinePlan(name, count, per_rank, pp)


def _schedule_class(name: str) -> Any:
    from torch.distributed.pipelining import schedules

    return getattr(schedules, PIPELINE_SCHEDULES[name])


class PipelineRuntime:
    """The stages this process runs, their schedule and the pipeline's process group."""

    def __init__(
        self, stages: list[Any], group: Any, plan: PipelinePlan, early_receives: bool = True
    ) -> None:
        self.stages = stages
        self.group = group
        self.plan = plan
        self.holds_last = any(stage.stage_index == plan.num_stages - 1 for stage in stages)
        # Which process of the pipeline group holds the last stage (the loss and outputs).
        self.last_rank = plan.rank_of(plan.num_stages - 1)
        world: Any = group if group is not None else dist.group.WORLD
        self._last_global_rank = dist.get_global_rank(world, self.last_rank)
        self._loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
        self._reported: list[torch.Tensor] = []  # this step's micro-batch losses, unscaled
        self._scale: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss
        # Over gloo every receive of a step is posted when it starts (see receives.py).
        self.early_receives = early_receives and posts_without_blocking(group, stages)
        self.channels: Any = None  # local_transport.py's, when every process is here
        self.local_transport = True
        self.schedule = self._new_schedule()
        self._connect_locally()
        self._signature: Any = None

    def _new_schedule(self) -> Any:
        cls = _schedule_class(self.plan.schedule)
        stages: Any = self.stages if self.plan.schedule not in SINGLE_STAGE else self.stages[0]
        # Gradients are averaged over micro-batches through the loss (see _loss), not by
        # torch's scale_grads: that divides every .grad after the step, which would also
        # shrink the gradients accumulated by earlier steps of a gradient-accumulation cycle.
        schedule = cls(
            stages,
            n_microbatches=self.plan.microbatches,
            loss_fn=self._loss,
            scale_grads=False,
        )
        if self.early_receives:
            schedule = with_early_receives(
                schedule, self.plan.schedule, self.stages, self.plan.microbatches, self._loss
            )
            if isinstance(schedule._step_microbatches, ActionRunner):
                schedule._step_microbatches.channels = self.channels
        schedule._split_inputs = _SplitPlainTensors(schedule, self.plan.microbatches)
        return schedule

    def _connect_locally(self) -> None:
        """Between processes on one machine the runner's transfers go through shared memory
        and Unix sockets rather than gloo (local_transport.py): decided and connected
        together by every process of the pipeline (a collective; the schedule may later be
        rebuilt on some processes only, and keeps the channels)."""
        if "gloo" not in str(dist.get_backend(self.group)):  # (the same on every process)
            self.channels = None
            return
        runner = self.schedule._step_microbatches
        wanted = isinstance(runner, ActionRunner) and self.early_receives and self.local_transport
        self.channels = local_channels(self.group, wanted)
        if isinstance(runner, ActionRunner):
            runner.channels = self.channels

    def set_early_receives(self, enabled: bool, local_transport: bool = True) -> None:
        """Post each step's receives when it starts (over gloo; the default) or run torch's
        schedule as it is; with ``local_transport=False`` the runner's transfers stay on
        gloo even when every process runs here (both for comparisons). A collective."""
        self.early_receives = enabled and posts_without_blocking(self.group, self.stages)
        self.local_transport = local_transport
        self.schedule = self._new_schedule()
        self._connect_locally()

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self._loss_fn is not None
        loss = self._loss_fn(output, target)
        self._reported.append(loss.detach())
        return self._scale(loss) / self.plan.microbatches

    def _check_batch(self, inputs: tuple[Any, ...]) -> None:
        # The stages size their send/receive buffers from the first micro-batch: a batch
        # of another shape (the last of an epoch, say) needs the schedule set up anew.
        signature = tuple([(t.shape, t.dtype) for t in inputs if isinstance(t, torch.Tensor)])
        if signature == self._signature:  # (every step but the first, as a rule)
            return
        if signature and not signature[0][0]:
            raise ValueError(
                "under pipeline parallelism the first input must have a batch dimension to "
                "split into micro-batches; got a 0-dim tensor"
            )
        if signature and signature[0][0][0] % self.plan.microbatches:
            raise ValueError(
                f"a batch of {signature[0][0][0]} samples does not split into "
                f"pp_microbatches={self.plan.microbatches} equal micro-batches; make the "
                "per-process batch size a multiple of the number of micro-batches (a smaller "
                "last batch too, or use drop_last=True)"
            )
        if self._signature is not None:
            self.schedule = self._new_schedule()
        self._signature = signature

    def train(
        self,
        inputs: tuple[Any, ...],
        target: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        scale: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Forward and backward of one batch; the batch's mean loss on every process.

        ``scale`` turns a micro-batch loss into what is back-propagated (accumulation
        averaging, fp16 loss scaling).
        """
        self._check_batch(inputs)
        self._loss_fn, self._scale, self._reported = loss_fn, scale, []
        runner = self.schedule._step_microbatches
        if isinstance(runner, ActionRunner) and runner.splits(target):
            runner.train(inputs, target)
        else:
            # The last stage's outputs are not kept (nor joined into one) where torch allows.
            options = {"return_outputs": False} if _step_takes_return_outputs() else {}
            self.schedule.step(*inputs, target=target, **options)
        return self._agreed_loss(inputs)

    def evaluate(
        self,
        inputs: tuple[Any, ...],
        target: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward only; every process of the pipeline gets the last stage's outputs (and,
        with a ``target`` and ``loss_fn``, the batch's mean loss)."""
        self._check_batch(inputs)
        if target is not None and loss_fn is not None:
            self._loss_fn, self._scale, self._reported = loss_fn, lambda loss: loss, []
            output = self.schedule.eval(*inputs, target=target)
            return self._broadcast_output(output), self._agreed_loss(inputs)
        if self.plan.schedule in V_SHAPED:  # torch's V schedules cannot run forward only
            return self._broadcast_output(self._forward_in_order(inputs)), None
        # torch computes a loss whenever the schedule has a loss function: none here.
        saved, self.schedule._loss_fn = self.schedule._loss_fn, None
        try:
            output = self.schedule.eval(*inputs)
        finally:
            self.schedule._loss_fn = saved
        return self._broadcast_output(output), None

    def _forward_in_order(self, inputs: tuple[Any, ...]) -> Any:
        """The whole batch through the stages one after the other (no micro-batches)."""
        here = dist.get_rank(self.group)
        modules = {stage.stage_index: stage.submod for stage in self.stages}
        value: tuple[Any, ...] = inputs
        for index in range(self.plan.num_stages):
            if self.plan.rank_of(index) != here:
                if index > 0 and self.plan.rank_of(index - 1) == here:
                    dist.send_object_list(
                        [value], group_dst=self.plan.rank_of(index), group=self.group
                    )
                continue
            if index > 0 and self.plan.rank_of(index - 1) != here:
                received: list[Any] = [None]
                dist.recv_object_list(
                    received, group_src=self.plan.rank_of(index - 1), group=self.group
                )
                value = received[0]
            with torch.no_grad():
                value = (modules[index](*value),)
        return value[0] if self.holds_last else None

    def _agreed_loss(self, inputs: tuple[Any, ...]) -> torch.Tensor:
        # At the end of every step, on the pipeline's critical path: no torch call that
        # does nothing (each costs ~10-40 µs there, with the caches cold).
        first = inputs[0] if inputs else None
        device = (
            first.device
            if type(first) is torch.Tensor
            else next((t.device for t in inputs if isinstance(t, torch.Tensor)), _CPU)
        )
        if self.holds_last:
            # The last micro-batches' losses: when the schedule sets itself up it also
            # calls the loss on made-up outputs to learn the gradient shapes.
            real = self._reported[-self.plan.microbatches :]
            if any(loss.dtype != torch.float32 or loss.dim() for loss in real):
                real = [loss.float() for loss in real]  # (a mean over all their elements)
            loss = torch.stack(real).mean()
            if loss.device != device:
                loss = loss.to(device)
        else:
            loss = torch.zeros((), device=device)
        if self.channels is None:
            dist.broadcast(loss, group_src=self.last_rank, group=self.group)
            return loss
        # Over the local sockets: the holder writes it at once (a gloo broadcast waits for
        # both processes' I/O threads, ~1 ms at the end of every step on the 2-core machine).
        if self.holds_last:
            for peer in self.channels.channels:
                backlog = self.channels.send(peer, loss)
                if backlog is not None:
                    backlog.wait()
        else:
            self.channels.receive(self._last_global_rank, loss).wait()
        return loss

    def _broadcast_output(self, output: Any) -> Any:
        description: list[Any] = [None]
        if self.holds_last:
            tensor = output if isinstance(output, torch.Tensor) else output[0]
            description = [(tuple(tensor.shape), tensor.dtype)]
        dist.broadcast_object_list(description, group_src=self.last_rank, group=self.group)
        shape, dtype = description[0]
        if self.holds_last:
            tensor = tensor.detach().contiguous()
        else:
            device = self.stages[0].device
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, group_src=self.last_rank, group=self.group)
        return tensor


_CPU = torch.device("cpu")


@functools.cache
def _step_takes_return_outputs() -> bool:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    return "return_outputs" in inspect.signature(_PipelineSchedule.step).parameters


class _SplitPlainTensors:
    """A schedule's ``_split_inputs`` for positional plain tensors: each split along its
    first dimension into views, as torch's ``split_args_kwargs_into_chunks`` splits them
    with its default chunk specs, without its walks over the argument trees (~0.15 ms a
    step on the CPUs measured, before the first stage's first forward). Anything else
    (keyword arguments, chunk specs, other types, leaf tensors that need gradients) goes
    to torch's."""

    def __init__(self, schedule: Any, microbatches: int) -> None:
        self.schedule, self.microbatches = schedule, microbatches
        self.split = schedule._split_inputs  # torch's

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        count = self.microbatches
        if (
            not args
            or kwargs
            or getattr(self.schedule, "_args_chunk_spec", None) is not None
            or not all(splits_plainly(arg, count) for arg in args)
        ):
            return self.split(args, kwargs)
        pieces = [torch.tensor_split(arg, count) for arg in args]
        return [tuple(piece[i] for piece in pieces) for i in range(count)], [
            {} for _ in range(count)
        ]
