"""``slipstream plan --verify``: run layouts for a few steps on this machine's CPU, compare the
predicted peak memory and step time with what the processes measured, and fit the time
model's constants to this machine (saved for later plans).

A plan for a larger cluster is checked scaled down: the same layout shape (the same sizes,
engine, micro-batches, schedule and recomputation) on as many CPU processes, in fp32, with
fewer decoder layers. Predictions for the check are made for what runs: the scaled model,
on CPU processes of this machine.

Example::

    checks = check_layouts(source, [Layout(dp_shard=4, micro_batch=2)], seq_len=128, layers=4)
    checks, constants = calibrate(checks, cluster)
    print(format_checks(checks))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..options.errors import ConfigError
from .calibration import Constants, fit, save_calibration
from .candidates import bucket_elements
from .hardware import Cluster, machine_memory
from .layouts import Layout
from .memory import predict_memory
from .model_source import ModelSource
from .profile import ModelProfile, profile_model
from .timing import predict_time
from .verify_runs import MeasuredRun, run_layout

_MiB = 1024**2
#: More processes than this are not started on one machine to check a plan.
MAX_PROCESSES = 16


@dataclass(frozen=True)
class Check:
    """One layout: predicted against measured."""

    layout: Layout
    predicted_mib: float
    measured_mib: float
    predicted_seconds: float
    measured_seconds: float
    features: tuple[float, float, float, float]
    #: After calibration (None before).
    calibrated_seconds: float | None = None
    phase: str = ""

    @property
    def memory_ratio(self) -> float:
        return self.predicted_mib / self.measured_mib

    @property
    def time_ratio(self) -> float:
        seconds = self.calibrated_seconds or self.predicted_seconds
        return seconds / self.measured_seconds


def cpu_cluster(processes: int, calibrated: bool = True) -> Cluster:
    """``processes`` CPU processes of this machine (its calibration, if saved)."""
    from .planner import build_cluster

    memory = machine_memory() / processes
    cluster = build_cluster(1, processes, "CPU", calibrated=calibrated)
    return cluster.with_device(memory=memory)


def scaled_layers(source: ModelSource, layouts: Sequence[Layout], wanted: int | None) -> int | None:
    """Decoder layers of the copy that runs: ``wanted``, else the model's own up to 4 (at
    least two per pipeline stage)."""
    if source.layers is None:
        return None
    stages = max(layout.pp * layout.pp_stages_per_rank for layout in layouts)
    layers = wanted if wanted is not None else min(source.layers, 4)
    return max(layers, 2 * stages) if stages > 1 else max(1, layers)


def check_layouts(
    source: ModelSource,
    layouts: Sequence[Layout],
    *,
    seq_len: int,
    layers: int | None,
    steps: int = 3,
    profile: ModelProfile | None = None,
    calibrated: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[Check]:
    """Predict and run each layout (fp32 on CPU processes); one :class:`Check` each
    (``calibrated``: predict with this machine's saved constants, if any)."""
    processes = {layout.world_size for layout in layouts}
    if max(processes) > MAX_PROCESSES:
        raise ConfigError(
            f"--verify would start {max(processes)} processes on this machine; it checks "
            f"layouts of at most {MAX_PROCESSES} (plan for fewer devices to check the shape)"
        )
    profile = profile or profile_model(source.scaled(layers), seq_len, compute_bytes=4)
    checks = []
    for layout in layouts:
        layout = dataclasses.replace(layout, mixed_precision="no", offload="none")
        cluster = cpu_cluster(layout.world_size, calibrated)
        buckets = bucket_elements(profile)
        memory = predict_memory(profile, layout, cluster.device, buckets)
        limit = cluster.device.memory * 0.8
        if memory.peak > limit:
            raise ConfigError(
                f"--verify: {layout.describe()} would need {memory.peak / _MiB:,.0f} MiB per "
                f"process x {layout.world_size} on this machine; use --verify_layers fewer, or "
                "check a smaller configuration of the model"
            )
        time = predict_time(profile, layout, cluster)
        if progress is not None:
            progress(f"checking {layout.describe()} on {layout.world_size} CPU processes ...")
        run: MeasuredRun = run_layout(source, layout, layers=layers, seq_len=seq_len,
                                      steps=steps, bucket_elements=buckets,
                                      wrap_classes=profile.block_classes)  # fmt: skip
        checks.append(
            Check(
                layout,
                memory.peak / _MiB,
                run.peak_mib,
                time.seconds,
                run.step_seconds,
                time.features,
                phase=memory.phase,
            )
        )
    return checks


def calibrate(
    checks: Sequence[Check], cluster: Cluster, save: bool = True
) -> tuple[list[Check], Constants]:
    """Fit the time model to the measured steps; the checks with their calibrated times."""
    features = [check.features for check in checks]
    seconds = [check.measured_seconds for check in checks]
    if len(checks) < 4:  # too few points for four constants: only the compute rate
        features = [(f[0], 0.0, 0.0, 0.0) for f in features]
    constants = fit(features, seconds)
    calibrated = [
        dataclasses.replace(check, calibrated_seconds=sum(
            c * x for c, x in zip(dataclasses.astuple(constants), check.features, strict=True)))
        for check in checks
    ]  # fmt: skip
    if save:
        save_calibration(cluster.device, constants, max(c.layout.world_size for c in checks))
    return calibrated, constants


def format_checks(checks: Sequence[Check]) -> str:
    """The predicted-vs-measured table."""
    rows = [["layout", "memory pred", "measured", "ratio", "step pred", "measured", "ratio"]]
    for c in checks:
        seconds = c.calibrated_seconds if c.calibrated_seconds is not None else c.predicted_seconds
        rows.append([
            c.layout.describe() + f" (mb {c.layout.micro_batch} x {c.layout.microbatches})",
            f"{c.predicted_mib:,.0f} MiB", f"{c.measured_mib:,.0f} MiB", f"{c.memory_ratio:.3f}",
            f"{seconds:.3f} s", f"{c.measured_seconds:.3f} s", f"{c.time_ratio:.3f}",
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]  # fmt: skip
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def fastest_agreement(checks: Sequence[Check]) -> tuple[Check, Check, float]:
    """The layout predicted fastest, the one measured fastest, and how much slower (measured)
    the first is than the second (1.0: the same layout or as fast)."""
    predicted = min(checks, key=lambda c: c.calibrated_seconds or c.predicted_seconds)
    measured = min(checks, key=lambda c: c.measured_seconds)
    return predicted, measured, predicted.measured_seconds / measured.measured_seconds
