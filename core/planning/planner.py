"""``slipstream.plan``: every layout a cluster allows for a model and a batch, its predicted
peak memory and step time, ranked; what would fit when nothing does.

Layouts: tp within a node (dividing the model's heads), pp up to the model's blocks, cp on
CUDA devices for long sequences, the rest data parallel (DDP, FSDP2, HSDP, ZeRO-1/2/3),
experts over ep of the shard group; the global batch split into micro-batches (gradient
accumulation, or a pipeline's micro-batches under 1F1B and interleaved 1F1B), with and
without full activation recomputation. Offload is tried when nothing fits without it.

Example::

    plan = slipstream.plan("llama3_8b.json", nodes=1, devices_per_node=8, device="H100",
                           global_batch=16, seq_len=8192)
    best = plan[0]
    accelerator = Accelerator(**best.accelerator_kwargs())
    print(plan.table())
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

from ..options.errors import ConfigError
from .calibration import load_calibration
from .hardware import Cluster, Device, parse_flops, parse_rate, parse_size, preset
from .layouts import Layout, divisors
from .memory import MemoryPrediction, predict_memory
from .model_source import ModelSource, resolve_model
from .profile import ModelProfile, profile_model
from .timing import TimePrediction, predict_time

if TYPE_CHECKING:
    from ..parallel.config import ParallelismConfig

_GiB = 1024**3
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


@dataclass
class Plan(Sequence[Candidate]):
    """The candidates that fit, fastest first (a sequence), and what the plan considered."""

    model: str
    profile: ModelProfile
    cluster: Cluster
    global_batch: int
    seq_len: int
    candidates: list[Candidate]
    considered: int
    #: When nothing fits: what would (one line each).
    suggestions: list[str]
    #: Notes on the figures (calibration used, assumptions).
    notes: list[str]
    #: The smallest candidates that do not fit (when none fits), for the table.
    closest: list[Candidate]

    @overload
    def __getitem__(self, index: int) -> Candidate: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Candidate]: ...
    def __getitem__(self, index: int | slice) -> Candidate | Sequence[Candidate]:
        return self.candidates[index]

    def __len__(self) -> int:
        return len(self.candidates)

    def __iter__(self) -> Iterator[Candidate]:
        return iter(self.candidates)

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def table(self, top: int = 10) -> str:
        from .report import format_plan

        return format_plan(self, top)


def _bucket_elements(profile: ModelProfile) -> int:
    return int(min(5e7, max(1e6, profile.parameter_count / 20)))


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


def _rank(candidates: list[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (c.time.seconds, c.memory.peak))


def build_cluster(
    nodes: int, devices_per_node: int, device: str | Device = "H100", *,
    device_memory: str | float | None = None, intra_bw: str | float | None = None,
    inter_bw: str | float | None = None, device_tflops: str | float | None = None,
    calibrated: bool = True,
) -> Cluster:  # fmt: skip
    """The cluster from a preset and the flags that override it."""
    chosen = preset(device) if isinstance(device, str) else device
    if calibrated:
        chosen = load_calibration(chosen, nodes * devices_per_node)
    changes: dict[str, Any] = {}
    if device_memory is not None:
        changes["memory"] = parse_size(str(device_memory))
    if intra_bw is not None:
        changes["intra_bw"] = parse_rate(str(intra_bw), "--intra_bw")
    if inter_bw is not None:
        changes["inter_bw"] = parse_rate(str(inter_bw), "--inter_bw")
    if device_tflops is not None:
        flops = parse_flops(str(device_tflops))
        changes.update(flops_bf16=flops, flops_fp32=flops)
    return Cluster(nodes, devices_per_node, dataclasses.replace(chosen, **changes))


def plan(
    model: str | ModelSource,
    *,
    nodes: int = 1,
    devices_per_node: int = 8,
    device: str | Device = "H100",
    device_memory: str | float | None = None,
    intra_bw: str | float | None = None,
    inter_bw: str | float | None = None,
    device_tflops: str | float | None = None,
    global_batch: int,
    seq_len: int,
    mixed_precision: str | None = None,
    calibrated: bool = True,
) -> Plan:
    """Rank the layouts of ``model`` on ``nodes x devices_per_node`` devices by predicted
    step time, keeping those whose predicted peak fits the device's memory.

    ``model``: a transformers config name or path, a ``config.json``, or ``module:callable``.
    Sizes as on the command line (``device_memory="80GB"``, ``intra_bw="900GB/s"``,
    ``device_tflops=989``). ``mixed_precision``: ``"bf16"`` on accelerators, ``"no"`` on CPU
    by default. Returns a :class:`Plan`: a sequence of :class:`Candidate`, fastest first::

        best = slipstream.plan("cfg.json", devices_per_node=4, device="CPU", global_batch=8,
                               seq_len=128)[0]
        ParallelismConfig(**best.parallelism)
    """
    if global_batch < 1 or seq_len < 1:
        raise ConfigError(
            f"--global_batch and --seq_len must be at least 1, got {global_batch} and {seq_len}"
        )
    cluster = build_cluster(nodes, devices_per_node, device, device_memory=device_memory,
                            intra_bw=intra_bw, inter_bw=inter_bw, device_tflops=device_tflops,
                            calibrated=calibrated)  # fmt: skip
    precision = mixed_precision or ("no" if cluster.device.name == "CPU" else "bf16")
    if precision not in ("no", "bf16", "fp16"):
        raise ConfigError(f"--mixed_precision must be no, bf16 or fp16, got {precision!r}")
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    profile = profile_model(source, seq_len, 2 if precision != "no" else 4)
    buckets = _bucket_elements(profile)
    evaluated = [evaluate(profile, layout, cluster, buckets)
                 for layout in enumerate_layouts(profile, cluster, global_batch, precision)]  # fmt: skip
    if not evaluated:
        raise ConfigError(
            f"no layout of {cluster.world_size} devices splits a global batch of "
            f"{global_batch} evenly (its data-parallel processes must divide it); use a "
            "--global_batch that a divisor of the device count divides"
        )
    notes = _notes(profile, cluster)
    fitting = _rank([c for c in evaluated if c.fits])
    suggestions: list[str] = []
    closest: list[Candidate] = []
    if not fitting:
        from .suggestions import what_would_fit

        closest = sorted(evaluated, key=lambda c: c.memory.peak)[:5]
        offloaded = [evaluate(profile, layout, cluster, buckets) for layout in
                     enumerate_layouts(profile, cluster, global_batch, precision, offload=True)]  # fmt: skip
        fitting = _rank([c for c in offloaded if c.fits])
        evaluated += offloaded
        suggestions = what_would_fit(profile, cluster, global_batch, precision, closest, fitting)
    return Plan(str(source.spec), profile, cluster, global_batch, seq_len, fitting,
                len(evaluated), suggestions, notes, closest)  # fmt: skip


def _notes(profile: ModelProfile, cluster: Cluster) -> list[str]:
    notes = []
    if not profile.traced:
        notes.append(
            f"{profile.name} takes inputs the planner cannot make up: activations and FLOPs "
            "are not included (give it an example_inputs(batch, seq_len) method)"
        )
    if cluster.device.name != "CPU" and cluster.device.efficiency == 0.45:
        notes.append("compute at 45% of the device's dense peak (typical MFU of a tuned step)")
    return notes
