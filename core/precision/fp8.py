"""fp8 training through torchao's float8 linear layers, on GPUs that support fp8.

Linear layers whose dimensions are multiples of 16 run their matmuls in float8 (dynamic
scaling); everything else runs under bf16 autocast. There is no silent fallback: without
torchao, or without a GPU of compute capability 8.9+ (Ada, Hopper or newer), construction
fails with a message saying what is missing.
"""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar

import torch
from torch import nn

from .autocast import BF16Precision

MIN_CAPABILITY = (8, 9)


def fp8_unavailable_reason(device: torch.device) -> str | None:
    """Why fp8 cannot run on ``device`` here, or None when it can."""
    if importlib.util.find_spec("torchao") is None:
        return "fp8 needs torchao: pip install torchao"
    if device.type != "cuda" or not torch.cuda.is_available():
        return (
            f"fp8 needs a CUDA GPU with compute capability {MIN_CAPABILITY[0]}."
            f"{MIN_CAPABILITY[1]}+ (Ada, Hopper or newer); this process runs on {device}"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (
            f"fp8 needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+; "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}"
        )
    return None


def _fp8_eligible(module: nn.Module, _name: str) -> bool:
    if isinstance(module, nn.Linear):
        return module.in_features % 16 == 0 and module.out_features % 16 == 0
    return True


class FP8Precision(BF16Precision):
    """torchao float8 linears inside bf16 autocast."""

    mode: ClassVar[str] = "fp8"

    def __init__(self, device: torch.device, **options: Any) -> None:
        reason = fp8_unavailable_reason(device)
        if reason is not None:
            raise ValueError(
                f"mixed_precision='fp8' is not available: {reason}. Use 'bf16' instead."
            )
        super().__init__(device, **options)

    def convert_model(self, model: nn.Module) -> nn.Module:
        from torchao.float8 import convert_to_float8_training

        model = convert_to_float8_training(model, module_filter_fn=_fp8_eligible)
        return super().convert_model(model)
