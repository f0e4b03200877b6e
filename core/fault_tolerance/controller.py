"""The fault-tolerance controller of one Accelerator: a torchft ``Manager`` for this
process's replica group and the step it drives.

A step here is one optimizer step of the whole job:

1. it opens (``begin_step``) when the first of these happens: a fault-tolerant loader
   hands out a batch, ``optimizer.zero_grad()``, ``accelerator.backward()``. The quorum
   of live replica groups is known then; a group that is behind (restarted) copies the
   state of a healthy peer before its forward pass. The quorum of a step is asked for in
   the background as soon as the previous step's vote is in (it overlaps that step's
   optimizer step and whatever the script does until the next batch); only the first
   step's is asked for here;
2. the gradients are averaged over the quorum through the groups' process group, in
   buckets, started during backward where a group is one process (gradients.py; not
   torchft's DDP wrapper, whose comm hook crashes the survivor when a peer dies during the
   all-reduce);
3. before the optimizer steps, every group votes; the step is applied only if every
   group of the quorum got through it, else it is discarded everywhere (the optimizers,
   schedulers and step counters do not move, and the data position goes back). The vote
   is cast on the protocol thread as soon as the gradients are averaged (it overlaps
   whatever runs until the optimizer step asks for it), and the next quorum right after.

In semi-synchronous training (LocalSGD, DiLoCo: semi_sync.py) a step is an interval of
optimizer steps, and what is averaged at its end is the weights or their change.

A healthy peer hands a rejoining group its state as it is when the peer's next step opens
(torchft's state-dict lock is held from the vote until then), so a background quorum never
copies a half-applied optimizer step.
"""

from __future__ import annotations

import atexit
import contextlib
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import torch
from torch import nn

from ..callbacks.base import Callback
from ..optim.step import StepState
from ..options.fault_tolerance import FaultToleranceKwargs, SemiSyncKwargs
from ..runtime.events import announce
from ..runtime.state import ProcessState
from . import recovery, reporting
from .gradients import GradientAverager
from .quorum import QuorumThread
from .semi_sync import SemiSynchronous

if TYPE_CHECKING:
    from ..optim.optimizer import AcceleratedOptimizer
    from ..optim.scheduler import AcceleratedScheduler
    from .data import FaultTolerantDataLoader


def import_torchft() -> Any:
    """torchft, or an error saying how to install it."""
    try:
        import torchft
    except ImportError as error:
        raise ImportError(
            "fault_tolerance=FaultToleranceKwargs(...) needs torchft: "
            "pip install 'slipstream[fault-tolerance]' (or pip install torchft>=0.2)"
        ) from error
    return torchft


def _before_exit(action: Any) -> None:
    """Run ``action`` when the main thread ends, before the interpreter stops its thread
    pools (torchft's manager submits a quorum asked for in the background to one: after
    that stop the submission fails, and the other groups wait for this group's half of
    that quorum until their quorum timeout). Plain ``atexit`` where that hook is missing."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(action)
        return
    try:
        register(action)
    except RuntimeError:  # the interpreter is stopping already
        atexit.register(action)


class FaultTolerance:
    """One replica group's membership in a fault-tolerant job (see the module docstring)."""

    def __init__(
        self,
        options: FaultToleranceKwargs,
        state: ProcessState,
        *,
        lighthouse: str,
        replica_id: str,
        groups: int,
        finished_file: str | None = None,
    ) -> None:
        self.options = options
        self.state = state
        self.lighthouse = lighthouse
        self.replica_id = replica_id
        self.replica_groups = groups
        self.models: list[nn.Module] = []
        self.optimizers: list[AcceleratedOptimizer] = []
        self.schedulers: list[AcceleratedScheduler] = []
        self.loaders: list[FaultTolerantDataLoader] = []
        self.step_state: StepState | None = None
        self._custom_objects: list[Any] = []
        self.step_open = False
        self._commit: bool | None = None
        #: The launcher's mark that a replica group finished the training.
        self.finished_file = finished_file
        self._first_quorum = True
        #: Steps applied and discarded by this group; recoveries from a peer.
        self.steps_committed = 0
        self.steps_discarded = 0
        self.recoveries = 0
        #: Restarted after another group had finished the training, so it stopped.
        self.stopped_finished = False
        #: Seconds the last step waited for its quorum (a survivor waits here for a dead
        #: peer to time out).
        self.last_quorum_seconds = 0.0
        #: A peer's state received by the last quorum, loaded when the step opens.
        self._received: dict[str, Any] | None = None
        #: Whether the next step's quorum was asked for in the background, and whether the
        #: open step's vote was (before it, as soon as the gradients were averaged).
        self._quorum_asked = False
        self._voting = False
        self.manager = self._build_manager()
        self._quorum_thread = QuorumThread(self.manager)
        self.gradients = GradientAverager(
            self.manager, self._pg, overlap=self.state.num_processes == 1
        )
        #: Semi-synchronous training (LocalSGD, DiLoCo): a step is an interval of inner steps.
        semi = options.semi_sync
        self.semi_sync = SemiSynchronous(semi, self) if isinstance(semi, SemiSyncKwargs) else None

    @property
    def pg(self) -> Any:
        """The replica groups' process group (torchft's, reconfigured by every quorum)."""
        return self._pg

    # -- the torchft manager ----------------------------------------------------------------
    def _build_manager(self) -> Any:
        import_torchft()
        from torch.distributed import TCPStore
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo

        timeout = timedelta(seconds=self.options.timeout)
        host = urlparse(self.lighthouse).hostname or ""
        local = host in ("127.0.0.1", "localhost", "::1")
        advertised = "127.0.0.1" if local else socket.gethostname()
        # The group's own store (the manager's rendezvous with its group), hosted by the
        # group's first process; a restarted group gets a fresh one.
        port = 0
        self._store: Any = None
        self._pg: Any = None
        if self.state.process_index == 0:
            self._store = TCPStore(advertised, 0, is_master=True, wait_for_workers=False)
            port = int(self._store.port)
        if self.state.num_processes > 1:
            import torch.distributed as dist

            shared = [advertised, port]
            dist.broadcast_object_list(shared, src=0)
            advertised, port = str(shared[0]), int(str(shared[1]))
        self._pg = ProcessGroupGloo(timeout=timeout)
        manager = Manager(
            pg=self._pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=self.options.min_replicas,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=self.options.quorum_timeout),
            connect_timeout=timeout,
            rank=self.state.process_index,
            world_size=self.state.num_processes,
            store_addr=advertised,
            store_port=port,
            lighthouse_addr=self.lighthouse,
            replica_id=self.replica_id,
            hostname=advertised,
        )
        manager.register_state_dict_fn("slipstream", self._receive_state, self._state)
        reporting.quiet_torchft()
        reporting.quiet_checkpoint_server(manager)
        _before_exit(self.shutdown)
        return manager

    def shutdown(self) -> None:
        """Leave the job: stop the manager's servers (also at interpreter exit)."""
        manager, self.manager = self.manager, None
        if manager is not None:
            if self.state.process_index == 0:
                reporting.leave_summary(
                    self.replica_id,
                    self.state.launch.restart_count,
                    self._step_count(int(manager.current_step())),
                    self.steps_committed,
                    self.steps_discarded,
                    self.recoveries,
                    self.stopped_finished,
                    unit="sync" if self.semi_sync is not None else "step",
                )
            if self._voting:  # (the vote locks the state first)
                self._voting = False
                with contextlib.suppress(Exception):
                    self._quorum_thread.vote()
            manager.allow_state_dict_read()  # a peer may be copying our state
            if self._quorum_asked:
                # Let the quorum asked for in the background finish (the other groups asked
                # for it too): a manager stopped under it leaves it to time out.
                self._quorum_asked = False
                self._quorum_thread.wait(self.options.timeout, quiet=True)
            manager.shutdown(wait=False)
        self.gradients.remove()

    def attach(self, accelerator: Any) -> None:
        """Follow ``accelerator``'s prepared objects and run inside its training step."""
        self.models = accelerator._models
        self.optimizers = accelerator._optimizers
        self.schedulers = accelerator._schedulers
        self.step_state = accelerator.step_state
        self._custom_objects = accelerator._custom_objects
        if self.semi_sync is not None:
            # The last synced weights and the outer optimizer travel with save_state.
            self._custom_objects.append(self.semi_sync)
            accelerator.callbacks.callbacks.insert(0, SemiSyncHooks(self))
        else:
            accelerator.callbacks.callbacks.insert(0, FaultToleranceHooks(self))

    def prepare_loader(
        self, loader: Any, device: torch.device | None, seed: int | None
    ) -> FaultTolerantDataLoader:
        """A loader dealing ``loader``'s samples over the quorum (saved by ``save_state``)."""
        from .data import FaultTolerantDataLoader

        prepared = FaultTolerantDataLoader(loader, self, device=device, seed=seed)
        self.loaders.append(prepared)
        self._custom_objects.append(prepared)
        return prepared

    def current_step(self) -> int:
        """Steps committed by the job (``manager.current_step()``): the step count that
        survives failures and rejoins (syncs, in semi-synchronous training)."""
        return int(self.manager.current_step()) if self.manager is not None else 0

    def _step_count(self, committed: int | None = None) -> int:
        """The step the lines say: the optimizer's (inner) steps in semi-synchronous
        training, else the job's committed steps (``committed``, else the manager's)."""
        if self.semi_sync is not None and self.step_state is not None:
            return int(self.step_state.optimizer_steps)
        return self.current_step() if committed is None else committed

    # -- the step ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Open the next step: its quorum (no-op while one is open)."""
        if self.step_open or self.manager is None:
            return
        first, self._first_quorum = self._first_quorum, False
        steps = self.step_state.optimizer_steps if self.step_state is not None else 0
        if first and steps != self.current_step() and self.semi_sync is None:
            # The script loaded a checkpoint (load_state) before training: the job's step
            # count starts there (a group with a later step still heals this one).
            self.manager.load_state_dict({"step": steps, "batches_committed": 0})
        started = time.perf_counter()
        # The state is final now: a peer may copy it (see the module docstring).
        self.manager.allow_state_dict_read()
        if self._quorum_asked:
            self._quorum_asked = False
            self._quorum_thread.wait()
        else:
            self.manager.start_quorum()
        self.last_quorum_seconds = time.perf_counter() - started
        received, self._received = self._received, None
        if received is not None:  # healed from a peer: its state is ours now
            self._load_state(received)
            self.recoveries += 1
            life = self.state.launch.restart_count
            if self.state.process_index == 0 and (life > 0 or self.current_step() > 0):
                reporting.rejoined(
                    self.replica_id,
                    life,
                    self._step_count(),
                    received.get("replica_id"),
                    self.last_quorum_seconds,
                )
        self.step_open = True
        self._commit = None
        if self.semi_sync is not None:
            self.semi_sync.open()
        else:
            self.gradients.build(self.models)
        if first and self.state.launch.restart_count > 0 and self.replica_groups > 1:
            self._check_rejoined()

    def _ask_next_quorum(self) -> None:
        """Ask for the next step's quorum in the background (the vote of this one is in).
        Peers may not copy this group's state until the next step opens."""
        if self.manager is None:
            return
        self.manager.disallow_state_dict_read()
        self._quorum_thread.ask()
        self._quorum_asked = True

    def _check_rejoined(self) -> None:
        """A restarted group found no live peer: either the job is over (another group
        finished the training: stop) or every other group is down (go on from this
        group's own state, which is the checkpoint the script loaded, if any)."""
        if int(self.manager.num_participants()) > 1:
            return
        finished = [bool(self.finished_file) and Path(str(self.finished_file)).exists()]
        if self.state.num_processes > 1:  # the whole group decides alike
            import torch.distributed as dist

            dist.broadcast_object_list(finished, src=0)
        speaks = self.state.process_index == 0
        self.stopped_finished = bool(finished[0])
        if finished[0]:
            if speaks:
                announce(
                    f"replica group {self.replica_id} restarted after another group finished "
                    "the training; nothing is left to do, so it stops here (exit 0)"
                )
            self.shutdown()
            raise SystemExit(0)
        if speaks:
            announce(
                f"replica group {self.replica_id} restarted and found no live replica group "
                f"to recover from; it goes on alone from step {self.current_step()} (its own "
                "state: the checkpoint the script loaded with load_state, else its initial "
                "weights)"
            )

    def data_coordinates(self) -> tuple[int, int]:
        """``(index, count)`` of this process among the data-parallel processes of the
        current quorum (replica groups times the data-parallel processes of a group)."""
        view = self.state.data_parallel
        if self.manager is None or not self.step_open:
            return view.process_index, view.num_processes * self.replica_groups
        rank = self.manager.participating_rank()
        participants = max(1, int(self.manager.num_participants()))
        return (rank or 0) * view.num_processes + view.process_index, (
            participants * view.num_processes
        )

    def before_backward(self, sync_gradients: bool) -> None:
        """Before a backward: open the step; the one that ends the step's accumulation
        starts the gradients' all-reduce as backward produces them."""
        self.begin_step()
        if sync_gradients and self.manager is not None and self.semi_sync is None:
            self.gradients.arm()

    def allreduce_gradients(self) -> None:
        """Average every gradient (the local shard of sharded ones) over the quorum."""
        if self.manager is None or self.semi_sync is not None:
            return
        self.begin_step()
        self.gradients.finish()
        # The vote, then the next quorum, on the protocol thread: the vote overlaps what
        # runs until the optimizer step asks for it (should_commit).
        self._quorum_thread.ask(vote_first=True)
        self._quorum_asked = self._voting = True

    def should_commit(self) -> bool:
        """Every group's vote on the open step (asked once per step; later calls repeat
        the answer). A discarded step puts the loaders' positions back."""
        if self._commit is not None:
            return self._commit
        if self.manager is None:
            return True
        self.begin_step()
        return self.vote()

    def vote(self) -> bool:
        """Every group's vote on the open step; closes it (and asks for the next quorum)."""
        if self._voting:  # asked for on the protocol thread, the next quorum after it
            self._voting = False
            commit = self._quorum_thread.vote()
        else:
            commit = bool(self.manager.should_commit())
            self._ask_next_quorum()
        self._commit = commit
        self.step_open = False
        for loader in self.loaders:
            loader.finish_step(commit)
        if commit:
            self.steps_committed += 1
        else:
            self.steps_discarded += 1
        return commit

    def after_inner_step(self) -> None:
        """Semi-synchronous training: an optimizer step was taken (the interval's sync, and
        its vote, come after the last)."""
        if self.semi_sync is None or self.manager is None:
            return
        self.begin_step()
        self.semi_sync.after_inner_step()

    def synchronize(self) -> None:
        """Semi-synchronous training: sync whatever the groups trained since their last
        sync, now, so every group holds the same weights (call it after the training loop;
        ``accelerator.end_training()`` does). No-op with per-step fault tolerance.

        Example::

            accelerator.fault_tolerance.synchronize()
        """
        if self.semi_sync is not None and self.manager is not None:
            self.semi_sync.synchronize()

    def checkpoint_view(self) -> Any:
        """A context in which the training objects hold what a checkpoint must: in
        semi-synchronous training, the state the open interval started from."""
        if self.semi_sync is None:
            return contextlib.nullcontext()
        return self.semi_sync.interval_start()

    # -- what a rejoining group copies ------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return recovery.group_state(self)

    def _receive_state(self, state: dict[str, Any]) -> None:
        # Called by the quorum (maybe in the background): loaded when the step opens.
        self._received = state

    def _load_state(self, state: dict[str, Any]) -> None:
        recovery.load_group_state(self, state)


class FaultToleranceHooks(Callback):
    """Ties the controller into the Accelerator's training step (the first callback)."""

    def __init__(self, controller: FaultTolerance) -> None:
        self.controller = controller

    def on_before_zero_grad(self, accelerator: Any, optimizer: Any) -> None:
        self.controller.begin_step()

    def on_before_backward(self, accelerator: Any, loss: Any) -> None:
        self.controller.before_backward(accelerator.step_state.sync_gradients)

    def on_after_backward(self, accelerator: Any) -> None:
        if accelerator.step_state.sync_gradients:
            self.controller.allreduce_gradients()

    def on_before_optimizer_step(self, accelerator: Any, optimizer: Any) -> None:
        if not self.controller.should_commit():
            accelerator.coordinator.skip_step = True


class SemiSyncHooks(Callback):
    """The controller in semi-synchronous training: no exchange around backward; after
    each optimizer step the interval counts it (and syncs at its end)."""

    def __init__(self, controller: FaultTolerance) -> None:
        self.controller = controller

    def on_before_zero_grad(self, accelerator: Any, optimizer: Any) -> None:
        self.controller.begin_step()

    def on_before_backward(self, accelerator: Any, loss: Any) -> None:
        self.controller.begin_step()

    def on_after_optimizer_step(self, accelerator: Any, optimizer: Any) -> None:
        # Once per step, after its last optimizer (the step is closed), unless it was skipped.
        if not accelerator.coordinator.pending and not optimizer.step_was_skipped:
            self.controller.after_inner_step()

    def on_train_end(self, accelerator: Any) -> None:
        self.controller.synchronize()
