"""Semi-synchronous training over the replica groups (LocalSGD, streaming DiLoCo): each
group takes its optimizer steps (the *inner* steps) alone, and the groups meet every
``sync_every // fragments`` of them.

A fault-tolerant "step" (a quorum, a vote, one ``manager.current_step()``) is here an
*interval* of that many inner steps:

1. it opens with the quorum, as a per-step one does (a restarted group copies a peer's
   state then; the loaders deal the interval's samples over the quorum), and the state the
   interval starts from is kept: the weights (where they differ from the last synced ones),
   the inner optimizers' and the schedulers' states, the step count and the RNGs;
2. the inner steps run without any exchange between the groups (a group's own DDP or FSDP2
   collectives still run);
3. at its end one fragment of the weights (all of them without streaming; fragment
   ``syncs % fragments`` with it) is averaged over the quorum — LocalSGD averages the
   weights, DiLoCo the change since the last sync (the pseudo-gradient), which an outer
   optimizer applies to the last synced weights — in flat buffers through the groups'
   process group, started ``fragment_sync_delay`` inner steps early so that it overlaps
   them; then the groups vote. A discarded interval leaves no trace (the weights,
   optimizers, schedulers, step count and data position go back to its start), as a
   discarded step does.

A checkpoint taken inside an interval holds the state the interval started from (the one
every group shares); a job resumed from it redoes the interval. torchft's own
``torchft.local_sgd`` classes are not used: they ask for the quorum at the sync, after the
interval's samples were drawn, and a discarded sync keeps the inner steps' other effects.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed import AllreduceOptions, ReduceOp

from ..checkpoint.rng import capture_rng_states, restore_rng_states
from ..optim.step import StepState
from ..options.errors import ConfigError
from ..options.fault_tolerance import SemiSyncKwargs
from . import recovery


class Controller(Protocol):
    """What the intervals use of their :class:`~slipstream.fault_tolerance.FaultTolerance`."""

    models: list[nn.Module]
    optimizers: list[Any]
    schedulers: list[Any]
    step_state: StepState | None
    manager: Any

    @property
    def pg(self) -> Any: ...

    def current_step(self) -> int: ...

    def begin_step(self) -> None: ...

    def vote(self) -> bool: ...


#: The largest flat buffer of one all-reduce (bytes).
BUCKET_BYTES = 16 * 1024 * 1024


class _Fragment:
    """Parameters synced together: their local parts, their last synced ("global") values
    and the flat buffers their all-reduce goes through."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.locals = [recovery.local(p).detach() for p in params]
        self.globals = [t.clone() for t in self.locals]
        #: Inner steps since this fragment was last synced.
        self.steps_since_sync = 0
        self.flats: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = [t for t in self.locals]  # replaced below
        kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for index, tensor in enumerate(self.locals):
            kinds.setdefault((tensor.dtype, tensor.device), []).append(index)
        for (dtype, device), indices in kinds.items():
            chunk: list[int] = []
            size = 0
            for position, index in enumerate(indices):
                chunk.append(index)
                size += self.locals[index].numel() * self.locals[index].element_size()
                if size >= BUCKET_BYTES or position == len(indices) - 1:
                    flat = torch.empty(
                        sum(self.locals[i].numel() for i in chunk), dtype=dtype, device=device
                    )
                    offset = 0
                    for i in chunk:
                        count = self.locals[i].numel()
                        self.views[i] = flat[offset : offset + count].view(self.locals[i].shape)
                        offset += count
                    self.flats.append(flat)
                    chunk, size = [], 0
        self.works: list[Any] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.locals)


def split(params: list[nn.Parameter], parts: int) -> list[list[nn.Parameter]]:
    """``params`` in order, cut into ``parts`` runs of about equal size (each parameter goes
    to the run its middle element falls in)."""
    sizes = [p.numel() for p in params]
    total = max(1, sum(sizes))
    runs: list[list[nn.Parameter]] = [[] for _ in range(parts)]
    before = 0
    for param, size in zip(params, sizes, strict=True):
        runs[min(parts - 1, (2 * before + size) * parts // (2 * total))].append(param)
        before += size
    return runs


class _Start:
    """What an interval started from, for a discarded interval and for checkpoints."""

    def __init__(self, sync: SemiSynchronous, *, weights: bool = False) -> None:
        controller = sync.controller
        keep = weights or not sync.weights_are_global
        self.weights = [t.clone() for t in sync.locals] if keep else None
        self.optimizers = [recovery.optimizer_state(o.optimizer) for o in controller.optimizers]
        self.schedulers = [copy.deepcopy(s.state_dict()) for s in controller.schedulers]
        state = controller.step_state
        self.optimizer_steps = state.optimizer_steps if state is not None else 0
        self.rng = capture_rng_states()
        self.fragment_steps = [f.steps_since_sync for f in sync.fragments]

    def weights_of(self, sync: SemiSynchronous) -> list[torch.Tensor]:
        return self.weights if self.weights is not None else sync.globals

    def restore(self, sync: SemiSynchronous, *, rng: bool) -> None:
        controller = sync.controller
        with torch.no_grad():
            for local, start in zip(sync.locals, self.weights_of(sync), strict=True):
                local.copy_(start)
        for optimizer, state in zip(controller.optimizers, self.optimizers, strict=True):
            recovery.load_optimizer_state(optimizer.optimizer, copy.copy(state))
        for scheduler, state in zip(controller.schedulers, self.schedulers, strict=True):
            scheduler.load_state_dict(copy.deepcopy(state))
        if controller.step_state is not None:
            controller.step_state.optimizer_steps = self.optimizer_steps
        for fragment, steps in zip(sync.fragments, self.fragment_steps, strict=True):
            fragment.steps_since_sync = steps
        if rng:
            restore_rng_states(self.rng)


class SemiSynchronous:
    """The intervals of one replica group's semi-synchronous training (see the module
    docstring); driven by its :class:`~slipstream.fault_tolerance.FaultTolerance`."""

    def __init__(self, options: SemiSyncKwargs, controller: Controller) -> None:
        self.options = options
        self.controller = controller
        self.every = options.steps_between_syncs
        self.delay = options.fragment_sync_delay
        self.alpha = float(options.fragment_update_alpha)
        self.fragments: list[_Fragment] = []
        self.outer: torch.optim.Optimizer | None = None
        self._key: tuple[int, ...] = ()
        #: Inner steps taken in the open interval.
        self.inner_steps = 0
        self._start: _Start | None = None
        self._sending: list[_Fragment] = []
        self._participants = 1
        #: Bytes this process sent to the other groups' all-reduces (ring estimate).
        self.bytes_synced = 0

    # -- layout -----------------------------------------------------------------------------
    @property
    def locals(self) -> list[torch.Tensor]:
        return [t for f in self.fragments for t in f.locals]

    @property
    def globals(self) -> list[torch.Tensor]:
        return [t for f in self.fragments for t in f.globals]

    @property
    def weights_are_global(self) -> bool:
        """Whether an interval always starts from the last synced weights (one fragment, no
        share of the local weights kept), so they need no copy of their own."""
        return len(self.fragments) == 1 and self.alpha == 0.0

    def build(self, models: list[nn.Module]) -> None:
        """The fragments and the outer optimizer, from the weights as they are (the last
        synced ones); again when the prepared models changed."""
        key = tuple(id(m) for m in models)
        if key == self._key and self.fragments:
            return
        unique: dict[int, nn.Parameter] = {}
        for model in models:
            for param in model.parameters():
                if param.requires_grad:
                    unique.setdefault(id(param), param)
        params = list(unique.values())
        count = self.options.fragments
        runs = split(params, count)
        if any(not run for run in runs):
            raise ConfigError(
                f"SemiSyncKwargs(fragments={count}): the model's {len(params)} trainable "
                "parameters do not make that many fragments of about equal size; use fewer "
                "fragments"
            )
        self._key = key
        self.fragments = [_Fragment(run) for run in runs]
        self.outer = self._outer_optimizer() if self.options.method == "diloco" else None

    def _outer_optimizer(self) -> torch.optim.Optimizer:
        made = self.options.outer_optimizer
        if made is not None:
            optimizer: torch.optim.Optimizer = made(self.globals)
            return optimizer
        momentum = float(self.options.outer_momentum)
        return torch.optim.SGD(
            self.globals,
            lr=float(self.options.outer_lr),
            momentum=momentum,
            nesterov=bool(self.options.outer_nesterov) and momentum > 0,
        )

    @property
    def fragment_index(self) -> int:
        """The fragment the open interval syncs: they take turns by committed syncs."""
        return int(self.controller.current_step()) % len(self.fragments)

    # -- an interval ------------------------------------------------------------------------
    def open(self) -> None:
        """The interval opened (its quorum is known, a healed group holds its peer's state):
        keep what it starts from."""
        self.build(self.controller.models)
        self.inner_steps = 0
        self._sending = []
        self._participants = max(1, int(self.controller.manager.num_participants()))
        self._start = _Start(self)

    def after_inner_step(self) -> bool | None:
        """An inner step was taken: ``None`` while the interval goes on, else whether its
        sync was committed (the controller voted)."""
        self.inner_steps += 1
        for fragment in self.fragments:
            fragment.steps_since_sync += 1
        if self.inner_steps == self.every - self.delay:
            self._send([self.fragments[self.fragment_index]])
        if self.inner_steps < self.every:
            return None
        return self._finish()

    def _send(self, fragments: list[_Fragment]) -> None:
        """Start the all-reduce of ``fragments``: their pseudo-gradients (DiLoCo) or
        weights (LocalSGD) summed over the quorum."""
        manager = self.controller.manager
        diloco = self.options.method == "diloco"
        with torch.no_grad():
            for fragment in fragments:
                for start, local, view in zip(
                    fragment.globals, fragment.locals, fragment.views, strict=True
                ):
                    if diloco:
                        torch.sub(start, local, out=view)
                    else:
                        view.copy_(local)
        self._sending = fragments
        participating = manager.is_participating()
        options = AllreduceOptions()
        options.reduceOp = ReduceOp(ReduceOp.SUM)
        for fragment in fragments:
            fragment.works = []
            for flat in fragment.flats:
                if manager.errored():
                    return
                if not participating:
                    flat.zero_()
                try:
                    fragment.works.append(self.controller.pg.allreduce([flat], options))
                except Exception as error:  # a peer died: the interval is discarded at the vote
                    manager.report_error(error)
                    return
                self.bytes_synced += _ring_bytes(flat, self._participants)

    def _wait(self) -> bool:
        """Wait for the all-reduces in flight; whether they all went through."""
        manager = self.controller.manager
        for fragment in self._sending:
            for work in fragment.works:
                try:
                    work.wait()
                except Exception as error:  # a peer died: the interval is discarded
                    manager.report_error(error)
            fragment.works = []
        return not manager.errored()

    def _finish(self) -> bool:
        """End the open interval: wait for its all-reduce, vote, apply it or go back."""
        fragments = self._sending
        if self._wait():
            for fragment in fragments:
                for flat in fragment.flats:
                    flat.div_(self._participants)
        commit = self.controller.vote()
        if commit:
            self._apply(fragments)
        else:
            self.discard()
        self._sending = []
        self.inner_steps = 0
        self._start = None
        return commit

    def _apply(self, fragments: list[_Fragment]) -> None:
        with torch.no_grad():
            if self.outer is None:  # LocalSGD: the average is the new weights
                for fragment in fragments:
                    for start, local, view in zip(
                        fragment.globals, fragment.locals, fragment.views, strict=True
                    ):
                        local.copy_(view)
                        start.copy_(view)
                    fragment.steps_since_sync = 0
                return
            for fragment in fragments:
                for start, view in zip(fragment.globals, fragment.views, strict=True):
                    start.grad = view
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
            for fragment in fragments:
                for start, local in zip(fragment.globals, fragment.locals, strict=True):
                    if self.alpha:
                        local.copy_(torch.lerp(start, local, self.alpha))
                    else:
                        local.copy_(start)
                fragment.steps_since_sync = 0

    def discard(self) -> None:
        """Back to the state the open interval started from (its sync was voted down)."""
        if self._start is not None:
            self._start.restore(self, rng=False)
        for optimizer in self.controller.optimizers:
            optimizer.step_was_skipped = True  # a prepared scheduler does not step after it

    def synchronize(self, tries: int = 3) -> None:
        """Sync every fragment that trained since its last sync, now (closing the open
        interval early), so that every group holds the same weights: the last synced
        ones. A discarded sync (a peer died) is tried again with the next quorum."""
        for _ in range(tries):
            behind = [f for f in self.fragments if f.steps_since_sync > 0]
            if not behind:
                with torch.no_grad():  # (they differ only by fragment_update_alpha's share)
                    for local, start in zip(self.locals, self.globals, strict=True):
                        local.copy_(start)
                return
            self._wait()  # a fragment's early all-reduce still in flight: superseded
            self.controller.begin_step()
            self._send(behind)
            self._finish()
        raise RuntimeError(
            f"semi-synchronous training: the final sync was discarded {tries} times (replica "
            "groups kept failing); the groups' weights differ"
        )

    # -- checkpoints and recovery -----------------------------------------------------------
    @contextlib.contextmanager
    def interval_start(self) -> Iterator[None]:
        """Inside an interval that took steps: the state it started from, put in place for a
        checkpoint (and the current state put back after)."""
        start = self._start
        if start is None or self.inner_steps == 0:
            yield
            return
        current = _Start(self, weights=True)
        start.restore(self, rng=True)
        try:
            yield
        finally:
            current.restore(self, rng=True)

    def state_dict(self) -> dict[str, Any]:
        """The last synced weights, the outer optimizer and the turn of the fragments (a
        checkpoint's and a rejoining peer's; the model itself travels apart)."""
        self.build(self.controller.models)
        outer = self.outer
        return {
            "method": self.options.method,
            "globals": [recovery.local(t).detach().clone() for t in self.globals],
            "outer": recovery.optimizer_state(outer) if outer is not None else None,
            "steps_since_sync": [f.steps_since_sync for f in self.fragments],
            "syncs": int(self.controller.current_step()),
        }

    def load_state_dict(self, state: dict[str, Any], *, step: bool = True) -> None:
        """Load :meth:`state_dict`'s; ``step``: also the job's count of syncs (a checkpoint;
        a peer's state comes with it)."""
        self.build(self.controller.models)
        if state.get("method") != self.options.method:
            raise RuntimeError(
                f"semi-synchronous training: the state was saved with "
                f"{state.get('method')!r}, this job runs {self.options.method!r}"
            )
        saved = state["globals"]
        if [tuple(t.shape) for t in saved] != [tuple(t.shape) for t in self.globals]:
            raise RuntimeError(
                "semi-synchronous training: the saved last-synced weights do not fit this "
                "model (another model, or another number of processes per replica group)"
            )
        with torch.no_grad():
            for target, value in zip(self.globals, saved, strict=True):
                target.copy_(value)
        if self.outer is not None and state.get("outer") is not None:
            recovery.load_optimizer_state(self.outer, state["outer"])
        for fragment, steps in zip(self.fragments, state["steps_since_sync"], strict=True):
            fragment.steps_since_sync = int(steps)
        if step:
            self.controller.manager.load_state_dict(
                {"step": int(state["syncs"]), "batches_committed": 0}
            )


def _ring_bytes(flat: torch.Tensor, participants: int) -> int:
    """What a ring all-reduce of ``flat`` sends from each process: 2 (n - 1) / n of it."""
    if participants <= 1:
        return 0
    return 2 * (participants - 1) * flat.numel() * flat.element_size() // participants
