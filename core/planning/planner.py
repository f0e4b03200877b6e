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
from typing import Any

from ..options.errors import ConfigError
from .calibration import load_calibration
from .candidates import Candidate, bucket_elements, enumerate_layouts, evaluate, rank
from .hardware import (
    Cluster,
    Device,
    machine_memory,
    parse_flops,
    parse_rate,
    parse_size,
    preset,
)
from .model_source import ModelSource, resolve_model
from .profile import ModelProfile, profile_model
from .report import Plan

__all__ = ["Candidate", "Plan", "build_cluster", "plan"]


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
    if chosen.name == "CPU":  # processes of this machine share its memory
        changes["memory"] = machine_memory() / devices_per_node
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
    buckets = bucket_elements(profile)
    evaluated = [evaluate(profile, layout, cluster, buckets)
                 for layout in enumerate_layouts(profile, cluster, global_batch, precision)]  # fmt: skip
    if not evaluated:
        raise ConfigError(
            f"no layout of {cluster.world_size} devices splits a global batch of "
            f"{global_batch} evenly (its data-parallel processes must divide it); use a "
            "--global_batch that a divisor of the device count divides"
        )
    notes = _notes(profile, cluster)
    fitting = rank([c for c in evaluated if c.fits])
    suggestions: list[str] = []
    closest: list[Candidate] = []
    if not fitting:
        from .suggestions import what_would_fit

        closest = sorted(evaluated, key=lambda c: c.memory.peak)[:5]
        offloaded = [evaluate(profile, layout, cluster, buckets) for layout in
                     enumerate_layouts(profile, cluster, global_batch, precision, offload=True)]  # fmt: skip
        fitting = rank([c for c in offloaded if c.fits])
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
