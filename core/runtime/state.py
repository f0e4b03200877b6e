"""ProcessState: this process's rank, world, device and process group, built once from the
launcher environment.

No shared-``__dict__`` singleton: a state is an ordinary object the Accelerator makes
*current*, so free functions (collectives, ``set_seed``) find it; or pass states around.

Example::

    state = ProcessState.from_environment()
    print(state.process_index, state.num_processes, state.device)
"""

from __future__ import annotations

import atexit
import enum
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from . import env
from .env import LaunchEnvironment, enable_flight_recorder, read_launch_environment
from .errors import guarded
from .process_exit import destroy_group_at_exit, watch_for_failure
from .xla import process_layout, rendezvous, wants_xla

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class DistributedType(str, enum.Enum):
    """How work is spread over processes (Accelerate's names, all of them, so scripts that
    compare against ``XLA`` or ``MULTI_NPU`` run; slipstream reports NO, MULTI_CPU,
    MULTI_GPU, FSDP, DEEPSPEED and XLA)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


#: How long a collective may wait for the other processes before failing (torch's default;
#: change it with ``InitProcessGroupKwargs(timeout=...)``).
DEFAULT_TIMEOUT = timedelta(minutes=30)
#: Collectives torch's Flight Recorder keeps per process (for hang reports; about 0.2 µs
#: per collective).
FLIGHT_RECORDER_ENTRIES = 2000


class JobMesh(Protocol):
    """What the state reads of the job's mesh (:class:`~slipstream.parallel.mesh.ParallelMesh`)."""

    mesh: DeviceMesh

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def data_parallel_rank(self) -> int: ...

    @property
    def data_parallel_mesh(self) -> DeviceMesh: ...

    def local_rank(self, dim: str) -> int: ...

    def submesh(self, dim: str) -> DeviceMesh | None: ...


class ProcessStateError(RuntimeError):
    """The process group cannot be formed as the environment describes."""


def select_device(local_rank: int, world_size: int, cpu: bool) -> torch.device:
    """``ACCELERATE_TORCH_DEVICE`` if set, else CUDA by local rank, MPS for one process, CPU."""
    if (override := env.device_override()) is not None:
        return torch.device(override)
    if not cpu and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    mps = getattr(torch.backends, "mps", None)
    if not cpu and world_size == 1 and mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for everything else."""
    return "nccl" if device.type == "cuda" else "gloo"


class ProcessState:
    """Where this process sits in the job. Build it with :meth:`from_environment`."""

    #: The active Accelerator's FSDP2 and DeepSpeed options (Accelerate's state members).
    fsdp_plugin: Any = None
    deepspeed_plugin: Any = None

    def __init__(
        self,
        *,
        process_index: int,
        num_processes: int,
        local_process_index: int,
        num_local_processes: int,
        device: torch.device,
        backend: str | None,
        owns_process_group: bool,
        debug: bool = False,
        launch: LaunchEnvironment | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        self.process_index = process_index
        self.num_processes = num_processes
        self.local_process_index = local_process_index
        self.num_local_processes = num_local_processes
        self.device = device
        self.backend = backend
        self.owns_process_group = owns_process_group
        self.debug = debug
        self.launch = launch if launch is not None else LaunchEnvironment()
        #: How long a collective waits for the others before failing (the group's timeout).
        self.timeout = timeout or DEFAULT_TIMEOUT
        #: The process group collectives on this state use (``None``: all processes).
        self.group: dist.ProcessGroup | None = None
        #: Global ranks of this state's processes, by index (``None``: the identity).
        self.global_ranks: list[int] | None = None
        #: The parallel layout (a ParallelismConfig) and the job's mesh, once
        #: ``slipstream.parallel.mesh.configure_parallelism`` has built them.
        self.parallelism: Any = None
        self.mesh: JobMesh | None = None
        self._data_parallel: ProcessState | None = None
        #: The job's distributed type as the active Accelerator's strategy reports it.
        self._reported_type: DistributedType | None = None

    @classmethod
    def from_environment(
        cls,
        *,
        cpu: bool | None = None,
        backend: str | None = None,
        timeout: timedelta | None = None,
        init_method: str | None = None,
        debug: bool | None = None,
        environ: Mapping[str, str] | None = None,
        launch: LaunchEnvironment | None = None,
    ) -> ProcessState:
        """Read the launcher variables and join (or adopt) the process group.

        With ``WORLD_SIZE > 1`` every rank joins one group (gloo on CPU, NCCL on CUDA); an
        already-initialised ``torch.distributed`` group is adopted as is. Frameworks that
        know the ranks themselves (the Lightning adapter) pass ``launch`` instead.
        """
        if launch is None:
            launch = read_launch_environment(environ)
        if cpu is None:
            cpu = bool(launch.launch_config.get("use_cpu", False))
        if debug is None:
            debug = launch.debug
        if wants_xla(launch.launch_config, bool(cpu)):  # torch_xla's PJRT places processes
            place = process_layout(launch.world_size, launch.local_rank, launch.local_world_size)
            return cls(**place, debug=bool(debug), launch=launch, timeout=timeout)
        rank, world = launch.rank, launch.world_size
        local_rank, local_world = launch.local_rank, launch.local_world_size
        owns = False
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            if launch.world_size > 1 and launch.world_size != world:
                raise ProcessStateError(
                    f"the existing process group has {world} processes but the launcher "
                    f"variables say WORLD_SIZE={launch.world_size}"
                )
            if launch.world_size == 1:
                local_rank, local_world = rank, world
        device = select_device(local_rank, world, cpu)
        if device.type == "cuda" and local_world > torch.cuda.device_count():
            raise ProcessStateError(
                f"{local_world} processes on this machine share {torch.cuda.device_count()} "
                "GPU(s), but each process needs a GPU of its own (NCCL refuses to share one): "
                f"start at most {torch.cuda.device_count()} processes per machine, or run on "
                "the CPU (slipstream launch --cpu, or Accelerator(cpu=True))"
            )
        if world > 1 and not dist.is_initialized():
            if not dist.is_available():
                raise ProcessStateError(
                    f"WORLD_SIZE={world} but this torch build has no torch.distributed"
                )
            backend = backend or default_backend(device)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            enable_flight_recorder(FLIGHT_RECORDER_ENTRIES)
            init_kwargs: dict[str, object] = {
                "backend": backend,
                "timeout": timeout or DEFAULT_TIMEOUT,
            }
            # Only the agent's store outlives an attempt (a worker's dies with it). Agents
            # count restarts each for itself: in an elastic job they differ between machines.
            if launch.restart_count and launch.agent_store and init_method is None:
                init_kwargs.update(
                    store=_attempt_store(launch, timeout), rank=rank, world_size=world
                )
            elif init_method is not None:
                init_kwargs.update(init_method=init_method, rank=rank, world_size=world)
            elif launch.needs_init_method:
                init_kwargs.update(
                    init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                    rank=rank,
                    world_size=world,
                )
            dist.init_process_group(**init_kwargs)  # type: ignore[arg-type]
            owns = True
            watch_for_failure()
            atexit.register(destroy_group_at_exit)
        elif world > 1:
            backend = dist.get_backend()
            if device.type == "cuda":
                torch.cuda.set_device(device)
        else:
            backend = None
        return cls(
            process_index=rank,
            num_processes=world,
            local_process_index=local_rank,
            num_local_processes=local_world,
            device=device,
            backend=backend,
            owns_process_group=owns,
            debug=bool(debug),
            launch=launch,
            timeout=timeout,
        )

    # -- who am I -------------------------------------------------------------------------
    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def device_distributed_type(self) -> DistributedType:
        """The data-parallel type the devices imply: NO, MULTI_CPU, MULTI_GPU or XLA."""
        if self.device.type == "xla":
            return DistributedType.XLA
        if self.num_processes == 1:
            return DistributedType.NO
        gpu = self.device.type == "cuda"
        return DistributedType.MULTI_GPU if gpu else DistributedType.MULTI_CPU

    @property
    def distributed_type(self) -> DistributedType:
        """How the job spreads work: the active Accelerator's strategy (FSDP, DEEPSPEED, ...)
        once there is one, else what the devices imply. Assignable, as Accelerate's."""
        return self._reported_type or self.device_distributed_type

    @distributed_type.setter
    def distributed_type(self, value: DistributedType | str) -> None:
        self._reported_type = DistributedType(value)

    # -- the parallel layout (arranged by slipstream.parallel.mesh.configure_parallelism) ----
    def set_layout(self, parallelism: Any, mesh: JobMesh) -> None:
        """Keep the job's parallel layout and mesh (views built for an earlier one go)."""
        if mesh is not self.mesh:
            self._data_parallel = None
        self.parallelism = parallelism
        self.mesh = mesh

    def ensure_process_group(self) -> None:
        """Form a one-member process group when running alone (FSDP2, DTensor and their
        checkpoints need a group even for one process)."""
        if self.num_processes == 1 and not dist.is_initialized():
            backend = default_backend(self.device)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The job's ``torch.distributed.DeviceMesh`` (``None`` without a parallel layout)."""
        return self.mesh.mesh if self.mesh is not None else None

    @property
    def data_parallel_size(self) -> int:
        """Processes that see different samples (all of them without a parallel layout)."""
        return self.mesh.data_parallel_size if self.mesh is not None else self.num_processes

    @property
    def data_parallel_index(self) -> int:
        """Which share of the data this process reads (``0..data_parallel_size-1``)."""
        return self.mesh.data_parallel_rank if self.mesh is not None else self.process_index

    @property
    def data_parallel(self) -> ProcessState:
        """This state seen over the data-parallel processes only: collectives on it gather
        and reduce over the processes that hold different samples. Itself without a
        parallel layout (or when every process holds different samples)."""
        if self.mesh is None or self.mesh.data_parallel_size == self.num_processes:
            return self
        view = self._data_parallel
        if view is None:
            mesh = self.mesh.data_parallel_mesh
            view = ProcessState(
                process_index=self.mesh.data_parallel_rank,
                num_processes=self.mesh.data_parallel_size,
                local_process_index=self.local_process_index,
                num_local_processes=self.num_local_processes,
                device=self.device,
                backend=self.backend,
                owns_process_group=False,
                launch=self.launch,
            )
            view.group = mesh.get_group()
            view.global_ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
            self._data_parallel = view
        view.debug = self.debug
        return view

    def global_rank(self, index: int) -> int:
        """The global rank of this state's process number ``index``."""
        return self.global_ranks[index] if self.global_ranks is not None else index

    # -- synchronisation ------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point."""
        if self.device.type == "xla":
            rendezvous("slipstream.wait_for_everyone")  # xm.rendezvous
        elif self.num_processes > 1:
            group = tuple(self.global_ranks) if self.global_ranks is not None else None
            with guarded("wait_for_everyone", self.process_index, None, group):
                if self.backend == "nccl":
                    dist.barrier(group=self.group, device_ids=[self.device.index or 0])
                else:
                    dist.barrier(group=self.group)

    def destroy(self) -> None:
        """Tear the process group down if this state created it."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_process_group = False
        self.mesh = None
        self._data_parallel = None

    def destroy_process_group(self) -> None:
        """Leave the process group (if this job formed it) and forget this state, so a
        later Accelerator or PartialState starts afresh (Accelerate's name)."""
        self.destroy()
        if _current is self:
            set_current_state(None)

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Accelerate's ``AcceleratorState._reset_state``: see :func:`reset_shared_state`."""
        reset_shared_state(reset_partial_state)

    def __repr__(self) -> str:
        where = f"process_index={self.process_index}, num_processes={self.num_processes}"
        local = f"local_process_index={self.local_process_index}, device={self.device}"
        return f"ProcessState({where}, {local}, backend={self.backend})"


def _attempt_store(launch: LaunchEnvironment, timeout: timedelta | None) -> dist.Store:
    """The launcher's store, with keys prefixed by the restart attempt.

    After an elastic restart torchrun hands the new workers the same store as the previous
    attempt; without a prefix of its own the new process group would read the dead
    processes' addresses and fail to connect.
    """
    server = dist.TCPStore(
        host_name=launch.master_addr or "127.0.0.1",
        port=int(launch.master_port or 0),
        world_size=launch.world_size,
        is_master=not launch.agent_store and launch.rank == 0,
        timeout=timeout or DEFAULT_TIMEOUT,
    )
    return dist.PrefixStore(f"slipstream/attempt_{launch.restart_count}/", server)


_current: ProcessState | None = None


def current_state() -> ProcessState:
    """The state set by the active Accelerator, or one built from the environment."""
    global _current
    if _current is None:
        _current = ProcessState.from_environment()
    return _current


def set_current_state(state: ProcessState | None) -> None:
    """Make ``state`` the one free functions use (``None`` forgets it)."""
    global _current
    _current = state


def has_current_state() -> bool:
    return _current is not None


def join_or_build_state(
    cpu: bool | None = None,
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    debug: bool | None = None,
) -> ProcessState:
    """The process's state: the current one (an earlier Accelerator's or PartialState's: a
    later one of the same job joins it) unless that runs on a GPU and the CPU is asked for
    (``cpu=True`` or the launcher's ``use_cpu``); otherwise a new one from the environment,
    made current. ``debug`` (when given) switches the collective checks on or off."""
    if has_current_state():
        state = current_state()
        wants_cpu = bool(cpu) or bool(state.launch.launch_config.get("use_cpu", False))
        if not wants_cpu or state.device.type == "cpu":
            if debug is not None:
                state.debug = debug
            return state
    state = ProcessState.from_environment(
        cpu=cpu or None, backend=backend, timeout=timeout, init_method=init_method, debug=debug
    )
    set_current_state(state)
    return state


#: Bumped by :func:`reset_shared_state`: Accelerators made before then refuse to prepare.
_generation = 0


def shared_state_generation() -> int:
    """How many times the shared state was reset in this process."""
    return _generation


def reset_shared_state(reset_partial_state: bool = False) -> None:
    """Start over as Accelerate's ``AcceleratorState._reset_state()`` does (notebooks and
    test suites call it between experiments): Accelerators created before it stop working
    (their ``prepare`` raises, instead of mixing old settings into a new run). The process
    group stays; with ``reset_partial_state`` this process's state is forgotten too, and the
    next Accelerator or PartialState builds a new one (adopting the existing group)."""
    global _generation
    _generation += 1
    if reset_partial_state:
        set_current_state(None)
