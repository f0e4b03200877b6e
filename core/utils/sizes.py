"""Sizes in bytes: of dtypes, of models and their largest layers, written and read as text.

Example::

    convert_file_size_to_int("5GB")       # 5_000_000_000
    convert_bytes(3 * 2**30)              # '3.0 GB'
    dtype_byte_size(torch.bfloat16)       # 2
    total, (largest, names) = calculate_maximum_sizes(model)
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..big_modeling.budgets import declared_no_split
from ..big_modeling.tensors import compute_module_sizes
from ..checkpoint.serialization import parse_size

_BITS = re.compile(r"^\s*[\d.]+\s*[kmg]b\s*$", re.IGNORECASE)
_SUB_BYTE = re.compile(r"int([1-7])$")


def convert_file_size_to_int(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like ``"5GB"`` (10**9), ``"5GiB"`` (2**30);
    ``"5Gb"`` (lower-case b) counts bits.
    """
    try:
        value = parse_size(size)
    except ValueError:
        raise ValueError(
            f"size {size!r} is not in a valid format; use an integer for bytes, or a string "
            "with a unit such as '5.0GB'"
        ) from None
    if isinstance(size, str) and _BITS.match(size) and size.rstrip().endswith("b"):
        value //= 8
    if value < 0:
        raise ValueError(f"size {size!r} is negative")
    return value


def convert_bytes(size: float) -> str:
    """``size`` bytes in the largest unit below 1024 of it: ``'1.5 GB'`` (binary units)."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def dtype_byte_size(dtype: torch.dtype) -> float:
    """Bytes one element of ``dtype`` takes: 4 for float32, 1/8 for bool (a bit, as
    Accelerate counts it), 1/2 for a 4-bit integer."""
    if dtype == torch.bool:
        return 1 / 8
    sub_byte = _SUB_BYTE.search(str(dtype))
    if sub_byte is not None:
        return int(sub_byte.group(1)) / 8
    return dtype.itemsize


def get_max_layer_size(
    modules: Sequence[tuple[str, Any]],
    module_sizes: Mapping[str, int],
    no_split_module_classes: Sequence[str],
) -> tuple[int, list[str]]:
    """The largest layer among ``modules`` (named modules, or parameters) and its names.

    A layer is a module without children, a module whose class is in
    ``no_split_module_classes``, or a tensor; ``module_sizes`` is what
    :func:`~slipstream.utils.compute_module_sizes` returns.
    """
    largest, names = 0, []
    pending = list(modules)
    while pending:
        name, module = pending.pop(0)
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if children and type(module).__name__ not in no_split_module_classes:
            pending = [(f"{name}.{child}", value) for child, value in children] + pending
            continue
        size = module_sizes[name]
        if size > largest:
            largest, names = size, [name]
        elif size == largest:
            names.append(name)
    return largest, names


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """(total bytes of ``model``, (bytes of its largest layer, that layer's names)).

    Blocks a transformers model declares unsplittable (``_no_split_modules``) count whole.
    """
    sizes = compute_module_sizes(model)
    top = [
        *model.named_parameters(recurse=False),
        *model.named_children(),
        *model.named_buffers(recurse=False),
    ]
    return sizes[""], get_max_layer_size(top, sizes, sorted(declared_no_split(model)))
