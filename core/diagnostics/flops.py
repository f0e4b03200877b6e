"""Model FLOPs per training step and the peak FLOP/s of devices, for model FLOPs utilisation
(MFU: the FLOPs the model needs per second over what the hardware could do).

* transformers models (a ``config`` with layers, heads and a hidden size): the usual
  formula, forward and backward, ``6 N`` per token (``N``: the weights of the model's
  linear layers, the matmuls) plus attention, ``12 L H d T`` per token (``L`` layers, ``H``
  query heads of size ``d``, ``T`` tokens per sequence; the whole score matrix, as torch's
  ``FlopCounterMode`` counts it);
* any other model: counted once, by running one real training step under torch's
  ``FlopCounterMode``;
* peaks: a table of dense matrix throughput for known accelerators (bf16/fp16 tensor cores,
  TF32, plain fp32), or the user's figure; none for CPUs (measure one with
  :func:`measure_peak_flops`, or pass it).

Example::

    per_token = transformer_flops_per_token(model, sequence_length=2048)
    peak = peak_flops(torch.device("cuda"), "bf16")     # 989.4e12 on an H100 SXM / H200
    mfu = per_token * tokens_per_second / (peak * num_gpus)
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

#: Dense peak FLOP/s per device: (bf16/fp16 tensor cores, TF32, fp32). Matched in order
#: against the device name (more specific names first). Vendor data sheets, without
#: sparsity.
PEAKS: list[tuple[tuple[str, ...], tuple[float, float, float]]] = [
    (("H100", "PCIE"), (756.0e12, 378.0e12, 51.2e12)),
    (("H100", "NVL"), (835.0e12, 417.5e12, 60.0e12)),
    (("H100",), (989.4e12, 494.7e12, 66.9e12)),
    (("H200",), (989.4e12, 494.7e12, 66.9e12)),
    (("GH200",), (989.4e12, 494.7e12, 66.9e12)),
    (("H800",), (989.4e12, 494.7e12, 66.9e12)),
    (("B200",), (2250.0e12, 1100.0e12, 80.0e12)),
    (("B100",), (1750.0e12, 875.0e12, 60.0e12)),
    (("A100",), (312.0e12, 156.0e12, 19.5e12)),
    (("A800",), (312.0e12, 156.0e12, 19.5e12)),
    (("L40S",), (362.1e12, 183.0e12, 91.6e12)),
    (("L4",), (121.0e12, 60.0e12, 30.3e12)),
    (("A10G",), (70.0e12, 35.0e12, 31.2e12)),
    (("A10",), (125.0e12, 62.5e12, 31.2e12)),
    (("V100",), (125.0e12, 15.7e12, 15.7e12)),
    (("MI300X",), (1307.4e12, 653.7e12, 163.4e12)),
    (("MI325X",), (1307.4e12, 653.7e12, 163.4e12)),
    (("MI250X",), (383.0e12, 95.7e12, 95.7e12)),
    (("MI250",), (362.1e12, 90.5e12, 90.5e12)),
]


def peak_for_name(name: str, precision: str = "bf16") -> float | None:
    """The table's peak for a device called ``name`` at ``precision`` (``"bf16"``,
    ``"fp16"``, ``"tf32"`` or ``"fp32"``), or ``None`` for a device it does not know.

    Example::

        peak_for_name("NVIDIA H200", "bf16")   # 989.4e12
    """
    upper = name.upper()
    column = {"bf16": 0, "fp16": 0, "tf32": 1, "fp32": 2}.get(precision.lower().split("-")[0])
    if column is None:
        column = 0  # fp8 and others: the bf16 figure (the conservative reading of MFU)
    for words, peaks in PEAKS:
        if all(word in upper for word in words):
            return peaks[column]
    return None


def peak_flops(device: torch.device, mixed_precision: str = "no") -> float | None:
    """The dense peak of ``device`` for training at ``mixed_precision`` (fp32 matmuls use
    TF32 where torch allows it); ``None`` for CPUs and unknown devices."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    if mixed_precision in ("bf16", "fp16", "bf16-true", "fp16-true", "fp8"):
        precision = "bf16"
    else:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return peak_for_name(name, precision)


def measure_peak_flops(
    device: torch.device | str = "cpu", size: int = 1024, seconds: float = 0.5
) -> float:
    """FLOP/s of repeated fp32 ``size x size`` matmuls on ``device``: a practical peak for
    CPUs, which have no table entry."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    torch.mm(a, b)  # warm-up
    runs, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        runs += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * size**3 * runs / elapsed


def _config_value(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def linear_weights(model: nn.Module) -> int:
    """Weights of the model's ``nn.Linear`` layers (whole tensors, also when sharded)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def transformer_flops_per_token(model: nn.Module, sequence_length: int) -> int | None:
    """Training FLOPs (forward + backward) per token of a transformers model, or ``None``
    when ``model`` has no transformers-style ``config``.

    ``6 N + 12 L H d T``: see the module docstring.
    """
    config = getattr(model, "config", None)
    if config is None:
        return None
    config = getattr(config, "text_config", None) or config
    layers = _config_value(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _config_value(config, "num_attention_heads", "n_head")
    hidden = _config_value(config, "hidden_size", "n_embd", "d_model")
    if layers is None or heads is None or hidden is None:
        return None
    head_dim = _config_value(config, "head_dim") or hidden // heads
    return 6 * linear_weights(model) + 12 * layers * heads * head_dim * sequence_length


class StepFlopCounter:
    """Counts the FLOPs of one training step with ``FlopCounterMode``: :meth:`start` before
    its first forward, :meth:`stop` after it (the mode counts matrix products only, so the
    optimizer's update adds nothing)."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self._mode = FlopCounterMode(display=False)
        self.active = False

    def start(self) -> None:
        self._mode.__enter__()
        self.active = True

    def stop(self) -> int:
        self._mode.__exit__(None, None, None)
        self.active = False
        return int(self._mode.get_total_flops())
