"""Mixed-precision modes: ``"no"``, ``"fp16"``, ``"bf16"`` (and ``"fp8"`` where supported).

Example::

    precision = make_precision("bf16", torch.device("cpu"))
    with precision.autocast():
        loss = model(x).sum()
"""

from __future__ import annotations

from typing import Any

import torch

from .autocast import AutocastPrecision, BF16Precision, FP16Precision
from .base import Precision, restore_forward

MIXED_PRECISION_MODES = ("no", "fp16", "bf16", "fp8")

_CLASSES: dict[str, type[Precision]] = {
    "no": Precision,
    "fp16": FP16Precision,
    "bf16": BF16Precision,
}


def make_precision(mode: str | None, device: torch.device, **options: Any) -> Precision:
    """The Precision object for ``mode`` on ``device``; a clear error for unknown modes."""
    mode = "no" if mode in (None, "fp32") else str(mode).lower()
    if mode not in MIXED_PRECISION_MODES:
        raise ValueError(
            f"unknown mixed_precision {mode!r}; choose one of {', '.join(MIXED_PRECISION_MODES)}"
        )
    if mode == "fp8":
        raise NotImplementedError(
            "mixed_precision='fp8' is not supported by this version of slipstream yet; "
            "use mixed_precision='bf16'"
        )
    return _CLASSES[mode](device, **options)


__all__ = [
    "MIXED_PRECISION_MODES",
    "AutocastPrecision",
    "BF16Precision",
    "FP16Precision",
    "Precision",
    "make_precision",
    "restore_forward",
]
