"""Running a lowered pipeline schedule (torch's list of actions, sends and receives
included) with little between the actions.

torch's action runner (``_PipelineScheduleRuntime._step_microbatches``) opens a profiler
range (``record_function``) around every action, whether a profiler runs or not: two
dispatcher calls per action, 30-90 µs on the CPUs measured, between every forward,
backward, send and receive of the step. This runner carries out the same actions through the
same ``PipelineStage`` methods, in the order given, and labels them for the profiler only
while one is recording. A receive is posted where its action stands in the list (with
receives.py, all at the start of the step) and waited on by the computation that needs
it. Sends are posted by one sender thread per process, in the order of the list: with the
receive already posted, gloo writes a send's data in the thread that posts it, and on the
CPUs measured that write (which also wakes the receiver's threads) took 7-15% of a step
when done between the actions; the computing thread now only hands the send over. Between
processes of one machine the transfers go through shared memory and Unix sockets instead
(local_transport.py: the computing thread writes and reads them itself, with a writer
thread per channel taking what the channel cannot take at once; after a stage's first
send in each direction, its outputs or input gradients are written without building
torch's ``P2POp``s, and after a micro-batch's first receive its buffers are posted the
same way). Sends are waited on at
the end of the step. A training step of positional tensors skips torch's generic ``step``
(``ActionRunner.train``): the batch and target are split as torch splits them. Every
microsecond of Python between two computations is idle time on the pipeline's critical
path, so the actions become calls once per action list (``_compile``), not an if-chain per
action and step.

Stages wrapped in FSDP (``UNSHARD``/``RESHARD`` actions do real work) and schedules with
custom action functions keep torch's runner.

Example::

    schedule._step_microbatches = ActionRunner(schedule)   # a _PipelineScheduleRuntime
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.autograd import profiler

_sender: tuple[int, ThreadPoolExecutor] | None = None


def _sending_thread() -> ThreadPoolExecutor:
    """This process's sender thread (made anew in a forked child, which has no threads)."""
    global _sender
    if _sender is None or _sender[0] != os.getpid():
        _sender = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="slipstream-pp-send"))
    return _sender[1]


class ActionRunner:
    """``_step_microbatches`` for a torch ``_PipelineScheduleRuntime``: its lowered actions
    for this process, run in order."""

    def __init__(self, schedule: Any) -> None:
        self.schedule = schedule
        #: The pipeline group's local channels (local_transport.py), when its
        #: ``PipelineRuntime`` found every process on this machine; gloo otherwise.
        self.channels: Any = None
        #: Over the channels: how many outputs (or input gradients) a stage has, and which
        #: of them each of its sends carries to which process (see _Step._write), learned
        #: on its first send.
        self.routes: dict[tuple[bool, int], tuple[int, list[tuple[int, int]]]] = {}
        #: Over the channels: the receive buffers of a stage's micro-batch and the process
        #: each comes from (see _Step._receive), learned on its first receive.
        self.receive_routes: dict[tuple[bool, int, int], _ReceiveRoute] = {}
        # This process's actions as calls, made once (see _compile), and what they came from.
        self._calls: list[tuple[Any, Callable[..., None], Any, int]] = []
        self._compiled_from: Any = None
        #: This process's stages by index (made with the calls).
        self.stages: dict[int, Any] = {}

    @staticmethod
    def applies_to(schedule: Any) -> bool:
        """Whether this runner can run ``schedule`` (no FSDP stages, no custom actions)."""
        from torch.distributed.fsdp import FSDPModule

        if schedule._comp_type_to_function_map:
            return False
        return not any(
            isinstance(module, FSDPModule)
            for stage in schedule._stages
            for module in stage.submod.modules()
        )

    def splits(self, target: Any) -> bool:
        """Whether :meth:`train` splits ``target`` as torch's ``step`` would: a plain
        tensor (or none) that divides into the micro-batches; anything else goes to torch's
        ``step``, whose splitting of other targets differs between torch versions."""
        return target is None or splits_plainly(target, self.schedule._n_microbatches)

    def train(self, args: tuple[Any, ...], target: Any) -> None:
        """A training step of the whole batch: what torch's ``schedule.step(*args,
        target=target, return_outputs=False)`` does for a target :meth:`splits` takes (split
        with ``tensor_split``, as torch does), without its generic per-step checks and walks,
        which run before the first forward, on the pipeline's critical path. (Pinned to
        torch's ``step`` by the pipeline tests, which compare the two bitwise.)"""
        schedule = self.schedule
        needs_grad = schedule._has_backward and getattr(
            schedule, "_backward_requires_autograd", True
        )  # fmt: skip
        if needs_grad and not torch.is_grad_enabled():
            raise RuntimeError(
                "a pipeline training step needs gradients: it cannot run under "
                "torch.no_grad() (evaluate with the model in eval mode instead)"
            )
        for stage in schedule._stages:
            stage.has_backward = schedule._has_backward
            stage.clear_runtime_states()
        arg_mbs, kwarg_mbs = schedule._split_inputs(args, {})
        count = schedule._n_microbatches
        target_mbs = None if target is None else list(torch.tensor_split(target, count))
        self(arg_mbs, kwarg_mbs, target_mbs, return_outputs=False)

    def __call__(
        self,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        schedule = self.schedule
        args, kwargs = schedule._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        schedule._initialize_stages(args[0], kwargs[0], first_target, loss_kwargs)
        if self.channels is not None:
            self.channels.check_drained()
        actions = schedule.pipeline_order_with_comms[schedule.rank]
        if actions is not self._compiled_from:
            self._calls, self._compiled_from = _compile(actions, schedule._stages), actions
            self.stages = {stage.stage_index: stage for stage in schedule._stages}
        step = _Step(schedule, args, kwargs, target_mbs, return_outputs, loss_kwargs, self)
        for action, call, stage, chunk in self._calls:
            if profiler._is_profiler_enabled:
                with torch.profiler.record_function(f"PP:{action}"):
                    call(step, stage, chunk)
            else:
                call(step, stage, chunk)
        # Long done, as a rule; waited on so that no buffer is reused while it is sent.
        step.helpers._wait_batch_p2p(
            step.backlogs + [work for posted in step.sends for work in posted.result()]
        )
        schedule._update_losses(schedule._stages, losses)


class _Step:
    """One step's state: received and sent transfers, backward counts per stage."""

    def __init__(
        self,
        schedule: Any,
        args: list[Any],
        kwargs: list[Any],
        targets: list[Any] | None,
        return_outputs: bool,
        loss_kwargs: dict[str, Any] | None,
        runner: ActionRunner,
    ) -> None:
        # Over local sockets (local_transport.py) sends are written by this thread; over
        # gloo they are handed to the sender thread. (Built before every step's first
        # action, on its critical path: only what changes per step is made here.)
        channels = runner.channels
        self.local = channels is not None
        self.channels, self.routes, self.receive_routes = (
            channels, runner.routes, runner.receive_routes
        )  # fmt: skip
        self.helpers = _schedules()  # torch's _batch_p2p and _wait_batch_p2p
        self.post = channels.post if self.local else self.helpers._batch_p2p
        self.schedule, self.stages = schedule, runner.stages
        self.args, self.kwargs, self.targets = args, kwargs, targets
        self.return_outputs, self.loss_kwargs = return_outputs, loss_kwargs
        self.receives: dict[tuple[str, int, int], list[Any]] = {}
        self.sends: list[Future[list[Any]]] = []  # over gloo, posted by the sender thread
        self.backlogs: list[Any] = []  # over the channels: what a socket did not take at once
        self.backwards: dict[int, int] = {}

    def reduce_grad(self, stage: Any, chunk: int) -> None:
        stage.perform_reduce_grad(self.schedule._n_microbatches if self.schedule.scale_grads else 1)

    def receive_forward(self, stage: Any, chunk: int) -> None:
        self.receives["F", stage.stage_index, chunk] = self._receive(stage, True, chunk)

    def receive_backward(self, stage: Any, chunk: int) -> None:
        self.receives["B", stage.stage_index, chunk] = self._receive(stage, False, chunk)

    def send_forward(self, stage: Any, chunk: int) -> None:
        self._send(stage, True, chunk)

    def send_backward(self, stage: Any, chunk: int) -> None:
        self._send(stage, False, chunk)

    def full_backward(self, stage: Any, chunk: int) -> None:
        self._backward(stage, chunk, full=True)

    def backward_input(self, stage: Any, chunk: int) -> None:
        self._backward(stage, chunk, full=False)

    def backward_weight(self, stage: Any, chunk: int) -> None:
        stage.backward_weight_one_chunk(chunk, last_backward=self._last_backward(stage))

    def _last_backward(self, stage: Any) -> bool:
        """Count a backward that accumulates ``stage``'s weight gradients; whether it is
        the step's last one."""
        count = self.backwards[stage.stage_index] = self.backwards.get(stage.stage_index, 0) + 1
        return count == self.schedule._n_microbatches

    def _send(self, stage: Any, forward: bool, chunk: int) -> None:
        """Send ``chunk``'s outputs (``forward``) or input gradients to the stages that
        take them."""
        if self.local:  # written now, without blocking (the rest by the socket's writer)
            self.backlogs += self._write(stage, forward, chunk)
            return
        sender = _sending_thread()
        self.sends.append(sender.submit(self.post, _send_ops(stage, forward, chunk)))

    def _write(self, stage: Any, forward: bool, chunk: int) -> list[Any]:
        """:meth:`_send` over the local channels; what is left to wait on.

        torch's ``get_fwd_send_ops``/``get_bwd_send_ops`` build a ``P2POp`` per tensor,
        with its checks and logging: 25-40 µs a send where it runs, between two
        computations, on the critical path whenever the peer waits. A stage's first send
        in each direction goes through them, and which of the values each op carried to
        which process is kept; later sends write those values directly (the same bytes,
        in the same order), unless one of them is not a plain tensor this time.
        """
        values = stage.fwd_cache[chunk][0] if forward else stage.bwd_cache.get(chunk, ())
        key = (forward, stage.stage_index)
        count, route = self.routes.get(key, (0, []))
        if route and len(values) == count:
            # (Loops, not generators: this runs cold, where each frame costs microseconds.)
            plain = True
            for i, _ in route:
                plain = plain and type(values[i]) is torch.Tensor
            if plain:
                if not forward:
                    del stage.bwd_cache[chunk]  # consumed, as torch's get_bwd_send_ops does
                channels, backlogs = self.channels.channels, []
                for i, peer in route:
                    backlog = channels[peer].send(values[i])
                    if backlog is not None:
                        backlogs.append(backlog)
                return backlogs
        ops = _send_ops(stage, forward, chunk)
        if ops and key not in self.routes:  # (none: e.g. a forward-only step's, learned later)
            self.routes[key] = (len(values), _route(values, ops))
        return list(self.post(ops))

    def _receive(self, stage: Any, forward: bool, chunk: int) -> list[Any]:
        """Post the receives of ``chunk``'s inputs (``forward``) or output gradients; what
        to wait on.

        Over the local channels a posted receive is only a note of the buffer to read into
        (local_transport.py), but torch's ``get_fwd_recv_ops``/``get_bwd_recv_ops`` build a
        ``P2POp`` per buffer, resolving its peer's rank through the process group: with
        every receive posted when the step starts, ~50 µs before the first forward on the
        CPUs measured. A micro-batch's first receive goes through them and its buffers, their
        channels and places in memory are kept; later steps post the same buffers directly while the stage still
        holds them (torch makes new ones when it sets a stage up anew).
        """
        infos = (stage.args_recv_info if forward else stage.grad_recv_info).get(chunk)
        key = (forward, stage.stage_index, chunk)
        known = self.receive_routes.get(key)
        if known is not None and self.local and known.matches(infos, stage.has_backward):
            return [channel.receive(buffer, place) for channel, buffer, place in known.posts]
        ops = stage.get_fwd_recv_ops(chunk) if forward else stage.get_bwd_recv_ops(chunk)
        posted = list(self.post(ops))
        if self.local:
            route = _ReceiveRoute.of(infos, stage.has_backward, posted)
            if route is not None:
                self.receive_routes[key] = route
        return posted

    def _wait(self, key: tuple[str, int, int]) -> None:
        if key not in self.receives:
            raise RuntimeError(f"pipeline action {key} runs before its receive was posted")
        works = self.receives.pop(key)
        if self.local:
            for work in works:
                work.wait()
        else:
            self.helpers._wait_batch_p2p(works)

    def forward(self, stage: Any, chunk: int) -> None:
        index = stage.stage_index
        if not stage.is_first and index - 1 not in self.stages:
            self._wait(("F", index, chunk))
        output = stage.forward_one_chunk(
            chunk, self.args[chunk], self.kwargs[chunk], save_forward_output=self.return_outputs
        )
        self.schedule._maybe_compute_loss(stage, output, self.targets, chunk, self.loss_kwargs)
        if index + 1 in self.stages:  # the next stage runs here: handed over, not sent
            self.stages[index + 1].set_local_fwd_input(output, chunk)

    def _backward(self, stage: Any, chunk: int, full: bool) -> None:
        index = stage.stage_index
        if not stage.is_last and index + 1 not in self.stages:
            self._wait(("B", index, chunk))
        loss = self.schedule._maybe_get_loss(stage, chunk)
        last = self._last_backward(stage) if full else False
        stage.backward_one_chunk(chunk, loss=loss, full_backward=full, last_backward=last)
        if index - 1 in self.stages and stage.has_backward:  # the previous stage runs here
            self.stages[index - 1].set_local_bwd_input(stage.get_local_bwd_output(chunk), chunk)


class _ReceiveRoute:
    """A micro-batch's receives over the local channels, as torch's receive ops posted
    them: each one's channel, buffer (held by one of the stage's ``_RecvInfo``s) and place
    in memory."""

    __slots__ = ("has_backward", "held", "infos", "posts")

    def __init__(
        self, infos: Any, has_backward: bool, posts: list[tuple[Any, torch.Tensor, tuple[int, int]]]
    ) -> None:
        self.infos, self.has_backward = infos, has_backward
        #: (channel, buffer, (address, length)) of each receive, in order
        #: (local_transport.py).
        self.posts = posts
        #: What every info held when learned (None too: torch posts nothing for those).
        self.held = [getattr(info, "buffer", None) for info in infos or ()]

    @classmethod
    def of(cls, infos: Any, has_backward: bool, posted: list[Any]) -> _ReceiveRoute | None:
        """From the receives torch's ops ``posted`` for the stage's ``infos``; None where
        one's buffer is not a plain tensor one of the infos holds."""
        held = {
            id(info.buffer)
            for info in infos or ()
            if type(getattr(info, "buffer", None)) is torch.Tensor
        }
        if any(id(work.tensor) not in held for work in posted):
            return None
        posts = [(work.channel, work.tensor, (work.address, work.nbytes)) for work in posted]
        return cls(infos, has_backward, posts)

    def matches(self, infos: Any, has_backward: bool) -> bool:
        """Whether the stage still receives into these buffers (the same infos object,
        each holding what it held)."""
        return (
            infos is self.infos
            and has_backward == self.has_backward
            and all(info.buffer is held for info, held in zip(infos or (), self.held, strict=True))
        )


def splits_plainly(value: Any, count: int) -> bool:
    """Whether torch splits ``value`` into ``count`` micro-batches as ``tensor_split`` along
    its first dimension does (the same views): a plain tensor with that many rows, not a
    leaf that needs gradients (torch keeps its pieces' gradients), with torch's debug
    masking off."""
    return (
        type(value) is torch.Tensor
        and value.dim() > 0
        and value.shape[0] >= count
        and not (value.requires_grad and value.is_leaf)
        and not getattr(_microbatch(), "_debug_mask_minibatches", False)
    )


@functools.cache
def _microbatch() -> Any:
    """torch's micro-batch splitting module (its debug switch is read per step)."""
    from torch.distributed.pipelining import microbatch

    return microbatch


@functools.cache
def _schedules() -> Any:
    """torch's schedules module (imported once: a ``from`` import of a package's module
    goes through importlib's Python on every call)."""
    from torch.distributed.pipelining import schedules

    return schedules


def _send_ops(stage: Any, forward: bool, chunk: int) -> list[Any]:
    """torch's ``P2POp``s sending ``chunk``'s outputs (``forward``) or input gradients."""
    return stage.get_fwd_send_ops(chunk) if forward else stage.get_bwd_send_ops(chunk)


def _compile(
    actions: list[Any], stages: list[Any]
) -> list[tuple[Any, Callable[..., None], Any, int]]:
    """(action, ``_Step`` method, stage, micro-batch) for each action to run, in order:
    looked up once, not per action and step (between two computations, where every
    microsecond of Python is idle time). An overlapped forward-backward pair runs its two
    actions' calls; ``UNSHARD``/``RESHARD`` do nothing without FSDP."""
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    methods: dict[Any, Callable[..., None]] = {
        Kind.FORWARD: _Step.forward,
        Kind.FULL_BACKWARD: _Step.full_backward,
        Kind.BACKWARD_INPUT: _Step.backward_input,
        Kind.BACKWARD_WEIGHT: _Step.backward_weight,
        Kind.SEND_F: _Step.send_forward,
        Kind.SEND_B: _Step.send_backward,
        Kind.RECV_F: _Step.receive_forward,
        Kind.RECV_B: _Step.receive_backward,
        Kind.REDUCE_GRAD: _Step.reduce_grad,
    }
    by_index = {stage.stage_index: stage for stage in stages}
    calls: list[tuple[Any, Callable[..., None], Any, int]] = []
    for action in actions:
        kind = action.computation_type
        if kind == Kind.OVERLAP_F_B:  # one call (and profiler range) running both
            calls.append((action, _run_calls, _compile(action.sub_actions, stages), -1))
        elif kind not in (Kind.UNSHARD, Kind.RESHARD):
            if kind not in methods:
                raise ValueError(f"the pipeline runner cannot run action {action}")
            calls.append(
                (action, methods[kind], by_index[action.stage_index], action.microbatch_index)
            )
    return calls


def _run_calls(step: _Step, calls: list[tuple[Any, Callable[..., None], Any, int]], _: int) -> None:
    for _action, call, stage, chunk in calls:
        call(step, stage, chunk)


def _route(values: Any, ops: list[Any]) -> list[tuple[int, int]]:
    """(position in ``values``, peer) of each of torch's send ``ops`` for a stage's outputs
    or input gradients, in order: each op's tensor is a value or a detached view of all of
    it. Empty (torch's ops are used every time) where that cannot be told: an op that
    carries anything else (a zero gradient made for a missing one, a DTensor's local
    part), or values that share memory."""
    plain = [i for i, value in enumerate(values) if type(value) is torch.Tensor]
    where = {values[i].data_ptr(): i for i in plain}
    if len(where) != len(plain):
        return []
    route = []
    for op in ops:
        i = where.get(op.tensor.data_ptr())
        if i is None or op.tensor.shape != values[i].shape or op.tensor.dtype != values[i].dtype:
            return []
        route.append((i, op.peer))
    return route
