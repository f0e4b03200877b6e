"""The constants of the time model measured on this machine: ``--verify`` fits them to the
step times it measured and saves them in the user's cache
(``~/.cache/slipstream/plan_calibration.json``, beside the saved configuration); later plans for the same device read them.

The step time of a layout is modelled as ``a F + b V + k C + o M`` (F: FLOPs over the
pipeline's busy fraction, V: collective bytes over the preset's bandwidth, C: collective
calls, M: bytes the optimizer moves); the fit is a non-negative least squares on relative
errors. ``1 / a`` becomes the device's FLOP/s (at efficiency 1), ``b`` scales its
bandwidths, ``k`` is the latency per call, ``1 / o`` its memory bandwidth.

Example::

    constants = fit([run.features for run in runs], [run.seconds for run in runs])
    save_calibration(device, constants, processes=4)
    device = load_calibration(preset("CPU"), processes=4)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..runtime.env import default_config_file
from .hardware import Device

FILE_NAME = "plan_calibration.json"


@dataclass(frozen=True)
class Constants:
    """Fitted coefficients of the step-time model (see the module docstring)."""

    seconds_per_flop: float
    bandwidth_scale: float
    latency: float
    seconds_per_byte_moved: float

    def apply(self, device: Device) -> Device:
        """``device`` with these constants in place of its preset figures."""
        rate = 1.0 / self.seconds_per_flop if self.seconds_per_flop > 0 else device.flops_fp32
        scale = 1.0 / self.bandwidth_scale if self.bandwidth_scale > 0 else 1e6
        memory_bw = 1.0 / self.seconds_per_byte_moved if self.seconds_per_byte_moved > 0 else 1e15
        return dataclasses.replace(
            device, flops_bf16=rate, flops_fp32=rate, efficiency=1.0,
            intra_bw=device.intra_bw * scale, inter_bw=device.inter_bw * scale,
            latency=max(0.0, self.latency), memory_bw=memory_bw,
        )  # fmt: skip


def _solve(rows: list[list[float]], targets: list[float]) -> list[float] | None:
    import torch

    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(targets, dtype=torch.float64).unsqueeze(1)
    try:
        solution = torch.linalg.lstsq(a, b).solution.squeeze(1)
    except RuntimeError:
        return None
    return [float(x) for x in solution]


def fit(features: Sequence[Sequence[float]], seconds: Sequence[float]) -> Constants:
    """Non-negative least squares of ``seconds`` on ``features`` (relative errors): every
    subset of the coefficients is tried, the best feasible kept (four of them: 15 solves)."""
    if not features or len(features) != len(seconds):
        raise ValueError("calibration needs one measured time per layout")
    width = len(features[0])
    scales = [max(abs(row[j]) for row in features) or 1.0 for j in range(width)]
    best: tuple[float, list[float]] | None = None
    for size in range(1, width + 1):
        for chosen in itertools.combinations(range(width), size):
            rows = [
                [row[j] / scales[j] / t for j in chosen]
                for row, t in zip(features, seconds, strict=True)
            ]
            solution = _solve(rows, [1.0] * len(seconds))
            if solution is None or min(solution) < 0:
                continue
            coefficients = [0.0] * width
            for j, value in zip(chosen, solution, strict=True):
                coefficients[j] = value / scales[j]
            error = sum(
                (sum(c * x for c, x in zip(coefficients, row, strict=True)) / t - 1.0) ** 2
                for row, t in zip(features, seconds, strict=True)
            )
            if best is None or error < best[0]:
                best = (error, coefficients)
    if best is None:
        raise ValueError("the measured step times do not fit the time model")
    return Constants(*best[1])


def calibration_file() -> str:
    """Beside slipstream's saved configuration: ``~/.cache/slipstream`` (``$XDG_CACHE_HOME``),
    or the folder ``$SLIPSTREAM_CONFIG_FILE`` names."""
    return str(default_config_file().parent / FILE_NAME)


def _read() -> dict[str, Any]:
    try:
        with open(calibration_file()) as handle:
            data = json.load(handle)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def save_calibration(device: Device, constants: Constants, processes: int) -> str:
    """Keep ``constants`` for ``device`` (measured with ``processes`` processes)."""
    data = _read()
    data[device.name] = {**dataclasses.asdict(constants), "processes": processes}
    path = calibration_file()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = path + ".tmp"
    with open(temporary, "w") as handle:
        json.dump(data, handle, indent=2)
    os.replace(temporary, path)
    return path


def load_calibration(device: Device, processes: int) -> Device:
    """``device`` with this machine's saved constants, if any. CPU processes share the
    machine's cores: rates measured with N processes are scaled to ``processes``."""
    entry = _read().get(device.name)
    if not isinstance(entry, dict):
        return device
    try:
        constants = Constants(
            float(entry["seconds_per_flop"]), float(entry["bandwidth_scale"]),
            float(entry["latency"]), float(entry["seconds_per_byte_moved"]),
        )  # fmt: skip
        measured_with = int(entry.get("processes", processes))
    except (KeyError, TypeError, ValueError):
        return device
    calibrated = constants.apply(device)
    if device.name == "CPU" and measured_with != processes:
        cores = os.cpu_count() or 1
        share = (min(cores, processes) / processes) / (min(cores, measured_with) / measured_with)
        calibrated = dataclasses.replace(
            calibrated, flops_bf16=calibrated.flops_bf16 * share,
            flops_fp32=calibrated.flops_fp32 * share, memory_bw=calibrated.memory_bw * share,
        )  # fmt: skip
    return dataclasses.replace(calibrated, name=device.name)


def is_calibrated(device: Device) -> bool:
    return isinstance(_read().get(device.name), dict)
