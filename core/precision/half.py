""" "True" half precision: the weights themselves are stored in bf16 or fp16.

Chosen explicitly with ``mixed_precision="bf16-true"`` or ``"fp16-true"``: half the memory
for weights, gradients and optimizer state, at the cost of fp32 master weights. Floating
inputs are cast to the weights' dtype; outputs come back in fp32 unless configured
otherwise. No loss scaling is applied.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from ..runtime.tree import map_tensors
from .base import Precision, patch_forward_with


class HalfPrecision(Precision):
    """Weights, activations and gradients in ``dtype``."""

    dtype: ClassVar[torch.dtype]

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype

    def _cast_inputs(self, inputs: Any) -> Any:
        return map_tensors(lambda t: t.to(self.dtype) if torch.is_floating_point(t) else t, inputs)

    def convert_model(self, model: nn.Module) -> nn.Module:
        model.to(self.dtype)  # in place: optimizers built earlier keep their parameters
        return patch_forward_with(
            model,
            self.autocast,
            self.convert_outputs_to_fp32,
            convert_inputs=self._cast_inputs,
        )


class BF16TruePrecision(HalfPrecision):
    mode: ClassVar[str] = "bf16-true"
    dtype: ClassVar[torch.dtype] = torch.bfloat16


class FP16TruePrecision(HalfPrecision):
    mode: ClassVar[str] = "fp16-true"
    dtype: ClassVar[torch.dtype] = torch.float16
