"""Sizes in bytes: of dtypes, of models and their largest layers, as text and back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.big_modeling import compute_module_sizes
from slipstream.utils.sizes import (
    calculate_maximum_sizes,
    convert_bytes,
    convert_file_size_to_int,
    dtype_byte_size,
    get_max_layer_size,
)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (123, 123),
        ("5GB", 5 * 10**9),
        ("5GiB", 5 * 2**30),
        ("1.5MB", 1_500_000),
        ("2KiB", 2048),
        ("8Gb", 10**9),  # lower-case b: bits
        ("16kb", 2000),
    ],
)
def test_convert_file_size_to_int(size, expected):
    assert convert_file_size_to_int(size) == expected


@pytest.mark.parametrize("size", ["five GB", "5XB", -3])
def test_convert_file_size_to_int_refuses_bad_sizes(size):
    with pytest.raises(ValueError, match=f"size {size!r}"):
        convert_file_size_to_int(size)


@pytest.mark.parametrize(
    ("size", "text"),
    [(512, "512 bytes"), (1536, "1.5 KB"), (3 * 2**30, "3.0 GB"), (2**50 * 2, "2.0 PB")],
)
def test_convert_bytes(size, text):
    assert convert_bytes(size) == text


def test_dtype_byte_size():
    assert dtype_byte_size(torch.float32) == 4
    assert dtype_byte_size(torch.bfloat16) == 2
    assert dtype_byte_size(torch.int64) == 8
    assert dtype_byte_size(torch.bool) == 1 / 8
    assert dtype_byte_size(torch.float8_e4m3fn) == 1
    if hasattr(torch, "int4"):
        assert dtype_byte_size(torch.int4) == 1 / 2


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width, bias=False)
        self.outer = nn.Linear(width, 1, bias=False)


class Model(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 6, bias=False)  # 12 floats
        self.block = Block(4)  # 16 + 4 floats, never split
        self.register_buffer("scale", torch.ones(3))


def test_largest_layer_counts_unsplittable_blocks_whole():
    model = Model()
    total, (largest, names) = calculate_maximum_sizes(model)
    assert total == (12 + 20 + 3) * 4
    assert (largest, names) == (20 * 4, ["block"])


def test_get_max_layer_size_splits_other_modules_and_reports_ties():
    model = Model()
    sizes = compute_module_sizes(model)
    largest, names = get_max_layer_size(list(model.named_children()), sizes, [])
    assert (largest, names) == (16 * 4, ["block.inner"])
    two = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    assert get_max_layer_size(list(two.named_children()), compute_module_sizes(two), []) == (
        36,
        ["0", "1"],
    )
