"""Small option objects passed to the Accelerator (same names as Accelerate's).

Example::

    accelerator = Accelerator(
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True),
                         InitProcessGroupKwargs(timeout=timedelta(minutes=5))],
        dataloader_config=DataLoaderConfiguration(split_batches=True),
    )
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any


class KwargsHandler:
    """Base of the option objects: :meth:`to_kwargs` returns only non-default values."""

    def to_kwargs(self) -> dict[str, Any]:
        default = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != getattr(default, f.name)
        }


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Options forwarded to ``torch.nn.parallel.DistributedDataParallel``."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


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
    """

    split_batches: bool = False
    even_batches: bool = True
    non_blocking: bool = False
    dispatch_batches: bool | None = None


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
class TorchDynamoPlugin:
    """``torch.compile`` settings: ``backend`` ("inductor", "aot_eager", ... or "no"),
    ``mode``, ``fullgraph``, ``dynamic`` and backend ``options``."""

    backend: str = "no"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict[str, Any] | None = None


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
