"""Small option objects passed to the Accelerator (same names as Accelerate's).

Example::

    accelerator = Accelerator(
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True),
                         InitProcessGroupKwargs(timeout=timedelta(minutes=5))],
        dataloader_config=DataLoaderConfiguration(split_batches=True),
    )
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class KwargsHandler:
    """Base of the option objects: :meth:`to_kwargs` returns only non-default values."""

    def to_kwargs(self) -> dict[str, Any]:
        default = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != getattr(default, f.name)
        }


class DDPCommunicationHookType(str, enum.Enum):
    """How DDP compresses gradients on the wire (``DistributedDataParallelKwargs.comm_hook``).

    ``fp16``/``bf16`` send gradients in half precision; ``power_sgd`` and
    ``batched_power_sgd`` send low-rank approximations (``comm_state_option`` sets their
    ``matrix_approximation_rank`` etc.).
    """

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Options forwarded to ``torch.nn.parallel.DistributedDataParallel``, and the
    gradient-communication hook to register on it (``comm_hook``, optionally wrapped by
    ``comm_wrapper`` to cast PowerSGD's traffic to fp16/bf16; ``comm_state_option`` are the
    hook's state options). Without a hook, CPU processes on one machine average their
    gradients through shared memory (``shared_memory_all_reduce=False`` keeps gloo's).

    Example::

        DistributedDataParallelKwargs(comm_hook="power_sgd",
                                      comm_state_option={"matrix_approximation_rank": 2})
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = field(default_factory=dict)
    #: slipstream's: CPU processes on one machine (x86-64 Linux) average the gradients
    #: through shared memory instead of gloo's loopback TCP (the same sums; a tiny model's
    #: step about 3 times faster). Used only where no ``comm_hook`` is set; False keeps gloo.
    shared_memory_all_reduce: bool = True

    def __post_init__(self) -> None:
        self.comm_hook = _hook_type(self.comm_hook, "comm_hook")
        self.comm_wrapper = _hook_type(self.comm_wrapper, "comm_wrapper")
        wrappers = (DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16)
        if self.comm_wrapper not in (*wrappers, DDPCommunicationHookType.BF16):
            raise ValueError(
                f"comm_wrapper={self.comm_wrapper.value!r}: a wrapper casts another hook's "
                "traffic, so it is 'no', 'fp16' or 'bf16'"
            )
        if self.comm_wrapper is not DDPCommunicationHookType.NO and self.comm_hook not in (
            DDPCommunicationHookType.POWER_SGD,
            DDPCommunicationHookType.BATCHED_POWER_SGD,
        ):
            raise ValueError(
                "comm_wrapper wraps a PowerSGD hook: set comm_hook='power_sgd' or "
                f"'batched_power_sgd' (got comm_hook={self.comm_hook.value!r})"
            )

    def ddp_options(self) -> dict[str, Any]:
        """The non-default options of ``DistributedDataParallel`` itself (no hook fields)."""
        hook_fields = ("comm_hook", "comm_wrapper", "comm_state_option", "shared_memory_all_reduce")
        return {k: v for k, v in self.to_kwargs().items() if k not in hook_fields}


def _hook_type(value: DDPCommunicationHookType | str, name: str) -> DDPCommunicationHookType:
    try:
        return DDPCommunicationHookType(str(getattr(value, "value", value)).lower())
    except ValueError:
        choices = ", ".join(repr(t.value) for t in DDPCommunicationHookType)
        raise ValueError(f"{name}={value!r} is not one of {choices}") from None


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Options for ``torch.distributed.init_process_group`` (backend, timeout)."""

    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | None = None


@dataclass
class DataLoaderConfiguration:
    """How prepared dataloaders shard data.

    ``split_batches``: split each batch across processes instead of giving every process a
    batch of the script's size. ``even_batches``: complete the final global batch with
    samples from the start so every process takes the same number of steps.
    ``non_blocking``: asynchronous host-to-device copies (with pinned memory).
    ``dispatch_batches``: for an ``IterableDataset`` that cannot shard itself, the main
    process reads each global batch and sends every process its slice (instead of every
    process reading the whole stream).
    ``data_seed``: the seed of the shuffle (default: ``torch.initial_seed()``, so
    ``set_seed`` decides it, as in Accelerate). ``use_seedable_sampler``: accepted for Accelerate scripts;
    slipstream's shuffles are always seeded alike on every process (exact resume needs it).
    ``use_stateful_dataloader``: prepared loaders are torchdata ``StatefulDataLoader``s and
    a dataset with ``state_dict``/``load_state_dict`` resumes from its saved state instead
    of re-reading the batches already consumed (needs ``pip install torchdata``).
    """

    split_batches: bool = False
    even_batches: bool = True
    non_blocking: bool = False
    dispatch_batches: bool | None = None
    use_seedable_sampler: bool = True
    data_seed: int | None = None
    use_stateful_dataloader: bool = False


@dataclass
class AutocastKwargs(KwargsHandler):
    """How prepared models run under autocast.

    ``convert_outputs_to_fp32``: cast half-precision outputs of a prepared model's forward
    back to fp32 (so losses are computed in fp32).
    """

    enabled: bool = True
    cache_enabled: bool | None = None
    convert_outputs_to_fp32: bool = True


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Options of the fp16 loss scaler (``torch.amp.GradScaler``)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Gradient accumulation in full (``Accelerator(gradient_accumulation_plugin=...)``).

    ``num_steps``: micro-batches per optimizer step. ``sync_with_dataloader``: the end of a
    dataloader also ends the accumulation cycle (else cycles run across epochs).
    ``sync_each_batch``: synchronise gradients on every micro-batch (more communication,
    but no unsynchronised gradient buffers: less memory under FSDP).
    ``adjust_scheduler``: accepted for Accelerate scripts; prepared schedulers never step
    between optimizer steps, so there is nothing to adjust.
    ``average_short_cycles``: ``backward`` always divides the loss by ``num_steps``, as
    Accelerate and Lightning do, so the short final cycle of an epoch (fewer micro-batches
    than ``num_steps``) makes a smaller update; ``True`` divides that cycle's losses by the
    micro-batches it really has, so every optimizer step is the update of one batch of the
    micro-batches it saw (the exact mean).

    Example::

        Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4))
        GradientAccumulationPlugin(num_steps=4, average_short_cycles=True)   # exact means
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
    average_short_cycles: bool = False


ProfilerActivity = str  # "cpu", "cuda", "xpu", ...


@dataclass
class ProfileKwargs(KwargsHandler):
    """Settings of :meth:`Accelerator.profile` (a ``torch.profiler.profile``).

    ``activities``: ``["cpu", "cuda"]`` etc. (default: what torch picks). ``schedule_option``:
    keyword arguments of ``torch.profiler.schedule`` (``wait``, ``warmup``, ``active``, ...).
    ``output_trace_dir``: each process writes its Chrome trace there on exit
    (``profile_{N}.json``, N the process index).

    Example::

        with accelerator.profile(ProfileKwargs(activities=["cpu"], record_shapes=True)) as prof:
            train_step()
        print(prof.key_averages().table(sort_by="cpu_time_total"))
    """

    activities: list[ProfilerActivity] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable[..., Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> torch.profiler.profile:
        """The configured (not yet started) profiler."""
        import torch

        members = torch.profiler.ProfilerActivity.__members__
        kinds = {name.lower(): kind for name, kind in members.items()}
        activities = None
        if self.activities is not None:
            unknown = [a for a in self.activities if str(a).lower() not in kinds]
            if unknown:
                raise ValueError(
                    f"unknown profiler activities {unknown}; choose from {sorted(kinds)}"
                )
            activities = [kinds[str(a).lower()] for a in self.activities]
        schedule = (
            torch.profiler.schedule(**self.schedule_option)
            if self.schedule_option is not None
            else None
        )
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


@dataclass
class ProjectConfiguration:
    """Where a run keeps its checkpoints and logs.

    With ``automatic_checkpoint_naming``, ``save_state()`` writes
    ``{project_dir}/checkpoints/checkpoint_{N}`` (N counting up, also across restarts) and
    keeps the newest ``total_limit`` of them; ``load_state()`` loads the newest complete one.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None and self.total_limit < 1:
            raise ValueError(f"total_limit must be >= 1 (or None), got {self.total_limit}")

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir
