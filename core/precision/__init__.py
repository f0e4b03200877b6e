"""Mixed-precision modes, one class each.

``"no"`` (fp32), ``"bf16"`` and ``"fp16"`` (autocast; fp16 with loss scaling), ``"fp8"``
(torchao on supporting GPUs), and the explicit "true" half modes ``"bf16-true"`` and
``"fp16-true"`` whose weights are stored in half precision. Lightning's spellings
(``"bf16-mixed"``, ``"16-mixed"``, ``"16-true"``, ``"32"``) are accepted too.

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
from .fp8 import FP8Precision, fp8_unavailable_reason
from .half import BF16TruePrecision, FP16TruePrecision, HalfPrecision

_CLASSES: dict[str, type[Precision]] = {
    "no": Precision,
    "fp16": FP16Precision,
    "bf16": BF16Precision,
    "fp8": FP8Precision,
    "bf16-true": BF16TruePrecision,
    "fp16-true": FP16TruePrecision,
}
_ALIASES = {
    None: "no",
    "fp32": "no",
    "32": "no",
    "32-true": "no",
    "bf16-mixed": "bf16",
    "16-mixed": "fp16",
    "fp16-mixed": "fp16",
    "16": "fp16",
    "16-true": "fp16-true",
}
MIXED_PRECISION_MODES = tuple(_CLASSES)


def canonical_mode(mode: Any) -> str:
    """The canonical name of a precision spelling; ValueError for unknown ones."""
    name = _ALIASES.get(mode, mode) if mode is None else str(mode).lower()
    name = _ALIASES.get(name, name)
    if name not in _CLASSES:
        raise ValueError(
            f"unknown mixed_precision {mode!r}; choose one of {', '.join(MIXED_PRECISION_MODES)}"
        )
    return name


def make_precision(mode: Any, device: torch.device, **options: Any) -> Precision:
    """The Precision object for ``mode`` on ``device``; a clear error for unknown modes."""
    name = canonical_mode(mode)
    if name != "fp16":
        options.pop("scaler_kwargs", None)
    return _CLASSES[name](device, **options)


__all__ = [
    "MIXED_PRECISION_MODES",
    "AutocastPrecision",
    "BF16Precision",
    "BF16TruePrecision",
    "FP8Precision",
    "FP16Precision",
    "FP16TruePrecision",
    "HalfPrecision",
    "Precision",
    "canonical_mode",
    "fp8_unavailable_reason",
    "make_precision",
    "restore_forward",
]
