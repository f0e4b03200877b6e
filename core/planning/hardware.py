"""The machines a plan is for: device presets, sizes and bandwidths as users write them, and
the cluster (nodes x devices per node).

Figures are vendor data sheets (dense, without sparsity): memory in binary units (an
"80GB" H100 holds 80 GiB), FLOP/s and bandwidths in decimal ones (900 GB/s = 9e11 B/s).
``intra_bw`` is what one device sends to the others of its node per second (NVLink /
Infinity Fabric, one direction), ``inter_bw`` what it sends to other nodes (its NIC).

Example::

    cluster = Cluster(nodes=2, devices_per_node=8, device=preset("H100"))
    cluster.world_size, parse_size("80GB"), parse_rate("400Gb/s")
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from ..options.errors import ConfigError


@dataclass(frozen=True)
class Device:
    """One accelerator (or one CPU process) as the planner models it."""

    name: str
    memory: float  # bytes
    #: Dense matrix FLOP/s in bf16/fp16 and in fp32.
    flops_bf16: float
    flops_fp32: float
    intra_bw: float  # bytes/s
    inter_bw: float  # bytes/s
    #: Memory bandwidth (bytes/s): the optimizer's update is bound by it.
    memory_bw: float
    #: Fraction of the peak a training step's matrix products reach (before calibration).
    efficiency: float = 0.45
    #: Seconds each collective costs beyond its bytes (launch and synchronisation).
    latency: float = 20e-6
    #: Whether communication runs beside computation (GPU streams); on CPU processes it
    #: takes the same cores.
    overlaps: bool = True
    #: torch's AdamW uses its foreach kernels here (one temporary the size of all parameters)
    #: rather than one parameter at a time.
    foreach_optimizer: bool = True
    #: Bytes each process holds beyond its tensors (allocator slack, library buffers).
    runtime_overhead: float = 0.0
    #: Fraction of ``memory`` a plan may fill (the rest: CUDA context, fragmentation).
    usable: float = 0.95
    #: Which engines slipstream runs on this device ("all", or the XLA lane's "ddp").
    engines: str = "all"
    #: Freshly zeroed tensors cost nothing until written (the host's zero pages): the loss's
    #: gradient, zeros with one entry a row, then barely counts.
    lazy_zeros: bool = False
    #: Bytes DeepSpeed maps per process for its collectives here (its CPU shared-memory
    #: all-reduce: 2 x 32 MiB + 2 x 1 MiB, ops/csrc/cpu/comm/shm.cpp).
    deepspeed_workspace: float = 0.0

    def flops(self, mixed_precision: str) -> float:
        return self.flops_bf16 if mixed_precision in ("bf16", "fp16") else self.flops_fp32


_GiB = 1024**3
PRESETS = {
    "H100": Device("H100", 80 * _GiB, 989.4e12, 66.9e12, 450e9, 50e9, 3.35e12),
    "H200": Device("H200", 141 * _GiB, 989.4e12, 66.9e12, 450e9, 50e9, 4.8e12),
    "A100": Device("A100", 80 * _GiB, 312e12, 19.5e12, 300e9, 25e9, 2.0e12),
    "MI300": Device("MI300", 192 * _GiB, 1307.4e12, 163.4e12, 300e9, 50e9, 5.3e12),
    "TPU v5e": Device("TPU v5e", 16 * _GiB, 197e12, 197e12 / 4, 200e9, 25e9, 819e9, engines="ddp"),
    # One CPU process of this machine: the figures --verify calibrates (gloo over loopback,
    # one thread per process).
    "CPU": Device(
        "CPU",
        16 * _GiB,
        20e9,
        20e9,
        2e9,
        1e9,
        5e9,
        efficiency=1.0,
        latency=200e-6,
        overlaps=False,
        foreach_optimizer=False,
        runtime_overhead=8 * 1024**2,
        usable=1.0,
        lazy_zeros=True,
        deepspeed_workspace=66 * 1024**2,
    ),
}
_ALIASES = {"TPUV5E": "TPU v5e", "V5E": "TPU v5e", "MI300X": "MI300", "CPUS": "CPU"}


def preset(name: str) -> Device:
    """The preset for ``name`` (H100, H200, A100, MI300, TPU v5e, CPU; any case)."""
    key = re.sub(r"[\s_-]", "", name).upper()
    for known in PRESETS:
        if re.sub(r"[\s_-]", "", known).upper() == key:
            return PRESETS[known]
    if key in _ALIASES:
        return PRESETS[_ALIASES[key]]
    raise ConfigError(f"unknown --device {name!r}; presets: {', '.join(PRESETS)}")


_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_SIZE = re.compile(r"^\s*" + _NUMBER + r"\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_RATE = re.compile(r"^\s*" + _NUMBER + r"\s*([KMGT]?)([Bb])?(ps|/s)?\s*$")


def parse_size(text: str, flag: str = "--device_memory") -> float:
    """Bytes in ``text`` ("80GB", "80GiB", "512MB", "1e9"): binary units."""
    match = _SIZE.match(str(text))
    if not match:
        raise ConfigError(f"{flag} {text!r} is not a size; write e.g. 80GB or 512MB")
    value = float(match.group(1)) * 1024 ** "_KMGT".index(match.group(2).upper() or "_")
    if value <= 0:
        raise ConfigError(f"{flag} must be positive, got {text!r}")
    return value


def parse_rate(text: str, flag: str) -> float:
    """Bytes per second in ``text`` ("900GB/s", "400Gb/s": bits, "50e9"): decimal units."""
    match = _RATE.match(str(text))
    if not match:
        raise ConfigError(f"{flag} {text!r} is not a bandwidth; write e.g. 900GB/s or 400Gb/s")
    value = float(match.group(1)) * 1000 ** "_KMGT".index(match.group(2).upper() or "_")
    if match.group(3) == "b":  # bits
        value /= 8
    if value <= 0:
        raise ConfigError(f"{flag} must be positive, got {text!r}")
    return value


def parse_flops(text: str) -> float:
    """FLOP/s from ``--device_tflops`` (a number of TFLOP/s)."""
    try:
        value = float(text) * 1e12
    except ValueError:
        raise ConfigError(f"--device_tflops {text!r} is not a number (TFLOP/s)") from None
    if value <= 0:
        raise ConfigError(f"--device_tflops must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``devices_per_node`` devices each."""

    nodes: int
    devices_per_node: int
    device: Device

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ConfigError(
                f"--nodes and --devices_per_node must be at least 1, got {self.nodes} and "
                f"{self.devices_per_node}"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def with_device(self, **changes: Any) -> Cluster:
        return dataclasses.replace(self, device=dataclasses.replace(self.device, **changes))

    def bandwidth(self, stride: int, size: int) -> float:
        """Bytes/s per device for a group of ``size`` processes ``stride`` ranks apart: the
        NIC's when the group spans nodes, the node's links otherwise."""
        span = stride * (size - 1) + 1
        within = span <= self.devices_per_node and self.devices_per_node % (stride * size) == 0
        return self.device.intra_bw if within or self.nodes == 1 else self.device.inter_bw

    def describe(self) -> str:
        d = self.device
        return (
            f"{self.nodes} node(s) x {self.devices_per_node} {d.name} ({d.memory / _GiB:,.1f} "
            f"GiB, {_rate(d.flops_bf16)}/{_rate(d.flops_fp32)} bf16/fp32 at "
            f"{d.efficiency:.0%}, {d.intra_bw / 1e9:,.1f} GB/s in a node, "
            f"{d.inter_bw / 1e9:,.1f} GB/s between nodes)"
        )


def _rate(flops: float) -> str:
    return f"{flops / 1e12:,.0f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:,.1f} GFLOP/s"


def machine_memory() -> float:
    """Bytes of memory this machine has (``/proc/meminfo``; 64 GiB where it cannot tell)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return 64.0 * _GiB
