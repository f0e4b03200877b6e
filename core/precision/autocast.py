"""bf16 and fp16 mixed precision with ``torch.autocast`` (fp16 adds a GradScaler)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from .base import Precision, patch_forward_with


class AutocastPrecision(Precision):
    """Weights stay fp32; matmuls and convolutions run in ``dtype`` under autocast."""

    dtype: ClassVar[torch.dtype]

    def __init__(self, device: torch.device, **options: Any) -> None:
        super().__init__(device, **options)
        available = getattr(torch.amp.autocast_mode, "is_autocast_available", None)
        if available is not None and not available(device.type):
            raise ValueError(
                f"mixed_precision={self.mode!r} needs autocast, which torch does not support on "
                f"device type {device.type!r}; use mixed_precision='no'"
            )

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype

    @contextlib.contextmanager
    def autocast(self, enabled: bool = True, cache_enabled: bool | None = None) -> Iterator[None]:
        kwargs: dict[str, Any] = {"dtype": self.dtype, "enabled": enabled and self.autocast_enabled}
        cache = self.cache_enabled if cache_enabled is None else cache_enabled
        if cache is not None:
            kwargs["cache_enabled"] = cache
        with torch.autocast(self.device.type, **kwargs):
            yield

    def convert_model(self, model: nn.Module) -> nn.Module:
        return patch_forward_with(model, self.autocast, self.convert_outputs_to_fp32)


class BF16Precision(AutocastPrecision):
    """bf16 autocast; no loss scaling is needed (bf16 has fp32's exponent range)."""

    mode: ClassVar[str] = "bf16"
    dtype: ClassVar[torch.dtype] = torch.bfloat16


class FP16Precision(AutocastPrecision):
    """fp16 autocast with a dynamic loss scale; steps whose gradients overflow are skipped."""

    mode: ClassVar[str] = "fp16"
    dtype: ClassVar[torch.dtype] = torch.float16

    def __init__(
        self,
        device: torch.device,
        *,
        scaler_kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(device, **options)
        self._scaler = torch.amp.GradScaler(device.type, **(scaler_kwargs or {}))

    @property
    def scaler(self) -> torch.amp.GradScaler:
        return self._scaler

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self._scaler.scale(loss)
