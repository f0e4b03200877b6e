"""The layouts a cluster allows for a model and a batch, and one layout evaluated: its
predicted memory and time, and whether it fits (see :mod:`.planner`).

Example::

    for layout in enumerate_layouts(profile, cluster, global_batch=16, mixed_precision="bf16"):
        candidate = evaluate(profile, layout, cluster)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .hardware import Cluster
from .layouts import Layout, divisors
from .memory import MemoryPrediction, predict_memory
from .profile import ModelProfile
from .timing import TimePrediction, predict_time

if TYPE_CHECKING:
    from ..parallel.config import ParallelismConfig

MAX_PIPELINE = 16
CUDA_DEVICES = ("H100", "H200", "A100")


@dataclass(frozen=True)
class Candidate:
    """A layout with its predicted memory and time."""

    layout: Layout
    memory: MemoryPrediction
    time: TimePrediction
    fits: bool
    #: DeepSpeed bucket elements the layout's config sets (ZeRO layouts).
    buckets: int = 0
    #: The model's block classes (FSDP's units when options are given).
    wrap_classes: tuple[str, ...] = ()

    @property
    def parallelism(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~slipstream.ParallelismConfig`."""
        return self.layout.parallelism

    def parallelism_config(self) -> ParallelismConfig | None:
        return self.layout.parallelism_config()

    def accelerator_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~slipstream.Accelerator` that run this layout."""
        return self.layout.accelerator_kwargs(self.buckets or None, self.wrap_classes)

    def describe(self) -> str:
        return self.layout.describe()


def bucket_elements(profile: ModelProfile) -> int:
    """DeepSpeed bucket elements the planner's configs set: a twentieth of the model, within
    DeepSpeed's usual range."""
    elements = int(min(5e7, max(1e6, profile.parameter_count / 20)))
    return elements - elements % 1024  # DeepSpeed aligns its buckets


def _batches(layout: Layout, per_rank: int, pipeline_schedules: Sequence[str],
             blocks: int) -> Iterator[Layout]:  # fmt: skip
    if layout.pp == 1:
        for micro in divisors(per_rank):
            yield dataclasses.replace(layout, micro_batch=micro, accumulation=per_rank // micro)
        return
    for count in divisors(per_rank):
        if count < layout.pp:
            continue
        micro = per_rank // count
        for schedule in pipeline_schedules:
            chunks = 2 if schedule == "interleaved_1f1b" else 1
            if chunks > 1 and (count % layout.pp or blocks < 2 * layout.pp):
                continue
            yield dataclasses.replace(layout, micro_batch=micro, pp_microbatches=count,
                                      pp_schedule=schedule, pp_stages_per_rank=chunks)  # fmt: skip


def enumerate_layouts(
    profile: ModelProfile, cluster: Cluster, global_batch: int, mixed_precision: str,
    offload: bool = False,
) -> Iterator[Layout]:  # fmt: skip
    """Every layout the cluster allows for the model and the global batch."""
    world = cluster.world_size
    device = cluster.device
    blocks = profile.blocks
    only_ddp = device.engines == "ddp"
    cps = [1]
    if device.name in CUDA_DEVICES and profile.seq_len >= 16384:
        cps = [cp for cp in (1, 2, 4, 8) if profile.seq_len % (2 * cp) == 0]
    for tp in divisors(world):
        if tp > cluster.devices_per_node or cluster.devices_per_node % tp or (tp > 1 and only_ddp):
            continue
        if not profile.tp_allowed(tp):
            continue
        for pp in divisors(world // tp):
            if pp > 1 and (only_ddp or pp > min(MAX_PIPELINE, blocks) or not profile.stages(pp)):
                continue
            for cp in cps:
                if (world // (tp * pp)) % cp:
                    continue
                data = world // (tp * pp * cp)
                if global_batch % data:
                    continue
                per_rank = global_batch // data
                for base in _data_parallel(profile, tp, pp, cp, data, only_ddp, offload):
                    layout = dataclasses.replace(base, mixed_precision=mixed_precision)
                    yield from _batches(layout, per_rank, ("1f1b", "interleaved_1f1b"), blocks)


def _data_parallel(profile: ModelProfile, tp: int, pp: int, cp: int, data: int,
                   only_ddp: bool, offload: bool) -> Iterator[Layout]:  # fmt: skip
    offloads = ("optimizer", "all") if offload else ("none",)
    model_parallel = tp * pp * cp > 1
    if not model_parallel and not offload:
        yield Layout(dp_replicate=data, engine="ddp")
    if only_ddp:
        return
    if not model_parallel:
        for stage in (1, 2, 3):
            for where in offloads:
                if where == "all" and stage < 3:
                    continue
                yield Layout(dp_shard=data, engine=f"zero{stage}", offload=where)
    for replicate in divisors(data):
        shard = data // replicate
        if shard * cp == 1 and not model_parallel:
            continue  # FSDP2 over replicas alone is DDP
        for ep in divisors(shard * cp):
            if not profile.ep_allowed(ep):
                continue
            for recompute in ("none", "full"):
                for where in ("all",) if offload else ("none",):
                    yield Layout(dp_replicate=replicate, dp_shard=shard, tp=tp, pp=pp, cp=cp,
                                 ep=ep, recompute=recompute, offload=where)  # fmt: skip


def evaluate(
    profile: ModelProfile, layout: Layout, cluster: Cluster, buckets: int = 0
) -> Candidate:
    """Predict one layout's memory and time on the cluster."""
    memory = predict_memory(profile, layout, cluster.device, buckets)
    time = predict_time(profile, layout, cluster)
    fits = memory.peak <= cluster.device.memory * cluster.device.usable
    zero = layout.engine.startswith("zero")
    return Candidate(layout, memory, time, fits, buckets if zero else 0, profile.block_classes)


def rank(candidates: list[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (c.time.seconds, c.memory.peak))
