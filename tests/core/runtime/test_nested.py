"""Accelerate's helpers for nested batches keep each container's type and raise clear errors."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch

from slipstream.runtime.nested import (
    TensorInformation,
    concatenate,
    convert_outputs_to_fp32,
    convert_to_fp32,
    find_batch_size,
    get_data_structure,
    honor_type,
    ignorant_find_batch_size,
    initialize_tensors,
    is_namedtuple,
    is_tensor_information,
    is_torch_tensor,
    listify,
    merge_dicts,
    pad_input_tensors,
    recursively_apply,
    slice_tensors,
)

Pair = namedtuple("Pair", ["a", "b"])


@dataclass
class Batch:
    x: torch.Tensor
    label: str


def test_honor_type_and_is_namedtuple():
    assert honor_type(Pair(1, 2), iter([3, 4])) == Pair(3, 4)
    assert honor_type((1, 2), iter([3, 4])) == (3, 4)
    assert honor_type([1], iter([5])) == [5]
    assert is_namedtuple(Pair(1, 2)) and not is_namedtuple((1, 2))
    assert is_torch_tensor(torch.ones(1)) and not is_torch_tensor([1.0])


def test_recursively_apply_keeps_structure_and_passes_arguments():
    data = {"x": torch.ones(2), "pair": Pair(torch.zeros(1), "text"), "list": [torch.ones(1)]}
    out = recursively_apply(lambda t, k, scale=1: t * k * scale, data, 2, scale=3)
    assert torch.equal(out["x"], torch.full((2,), 6.0))
    assert isinstance(out["pair"], Pair) and out["pair"].b == "text"
    assert torch.equal(out["list"][0], torch.full((1,), 6.0))
    ordered = recursively_apply(lambda t: t + 1, OrderedDict(a=torch.zeros(1)))
    assert isinstance(ordered, OrderedDict)
    batch = recursively_apply(lambda t: t + 1, Batch(torch.zeros(1), "y"))
    assert torch.equal(batch.x, torch.ones(1)) and batch.label == "y"
    with pytest.raises(TypeError, match=r"Unsupported types \(<class 'str'>\)"):
        recursively_apply(lambda t: t, {"x": torch.ones(1), "y": "text"}, error_on_other_type=True)


def test_recursively_apply_with_a_test_type():
    out = recursively_apply(str.upper, ["a", ("b", 1)], test_type=lambda v: isinstance(v, str))
    assert out == ["A", ("B", 1)]


def test_data_structure_round_trip():
    data = {"x": torch.ones(2, 3), "y": [torch.zeros(4, dtype=torch.int64)]}
    structure = get_data_structure(data)
    assert structure["x"] == TensorInformation(torch.Size([2, 3]), torch.float32)
    assert is_tensor_information(structure["y"][0])
    empty = initialize_tensors(structure)
    assert empty["x"].shape == (2, 3) and empty["y"][0].dtype == torch.int64


def test_find_batch_size():
    assert find_batch_size({"x": [torch.ones(5, 2)], "y": torch.ones(3)}) == 5
    assert find_batch_size((torch.ones(7),)) == 7
    with pytest.raises(ValueError, match="empty list"):
        find_batch_size({"x": []})
    with pytest.raises(TypeError, match="got str"):
        find_batch_size(["text"])
    assert ignorant_find_batch_size([]) is None
    assert ignorant_find_batch_size([torch.ones(2)]) == 2


def test_listify_converts_bfloat16_too():
    data = {"x": torch.tensor([1.5, 2.0], dtype=torch.bfloat16), "y": (torch.tensor(3),)}
    assert listify(data) == {"x": [1.5, 2.0], "y": (3,)}


def test_slice_tensors():
    data = {"x": torch.arange(6).reshape(3, 2), "y": [torch.arange(3)]}
    out = slice_tensors(data, slice(1, 3))
    assert out["x"].tolist() == [[2, 3], [4, 5]] and out["y"][0].tolist() == [1, 2]


def test_concatenate_batches_of_the_same_structure():
    batches = [{"x": torch.ones(2, 3), "y": Pair(torch.zeros(2), torch.ones(2))}] * 3
    out = concatenate(batches)
    assert out["x"].shape == (6, 3) and isinstance(out["y"], Pair) and out["y"].a.shape == (6,)
    assert concatenate([torch.ones(2, 1), torch.ones(2, 2)], dim=1).shape == (2, 3)
    assert concatenate(["a"]) == "a"  # one batch of anything comes back as it is
    with pytest.raises(TypeError, match=r"can only concatenate tensors.*got 2 str values"):
        concatenate(["a", "b"])


def test_convert_to_fp32_only_touches_half_precision():
    data = [torch.ones(1, dtype=torch.float16), torch.ones(1, dtype=torch.bfloat16)]
    data += [torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.int64)]
    out = convert_to_fp32(data)
    assert [t.dtype for t in out] == [torch.float32, torch.float32, torch.float64, torch.int64]


def test_convert_outputs_to_fp32_wraps_a_forward():
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    original = model.forward
    model.forward = convert_outputs_to_fp32(model.forward)
    assert model(torch.ones(1, 2, dtype=torch.bfloat16)).dtype == torch.float32
    assert model.forward.__wrapped__ == original


@pytest.mark.parametrize(
    ("batch_size", "num_processes", "expected"), [(3, 4, 4), (5, 2, 6), (9, 4, 12), (8, 4, 8)]
)
def test_pad_input_tensors_to_a_multiple_of_the_processes(batch_size, num_processes, expected):
    data = {"x": torch.ones(batch_size, 2), "y": [torch.ones(batch_size)]}
    out = pad_input_tensors(data, batch_size, num_processes)
    assert out["x"].shape == (expected, 2) and out["y"][0].shape == (expected,)
    assert out["x"][batch_size:].abs().sum() == 0 and out["x"][:batch_size].sum() == 2 * batch_size


def test_pad_input_tensors_along_another_dim_and_refuses_other_leaves():
    assert pad_input_tensors(torch.ones(2, 3), 3, 2, dim=1).shape == (2, 4)
    with pytest.raises(TypeError, match=r"Unsupported types \(<class 'str'>\)"):
        pad_input_tensors({"x": "text"}, 3, 2)


def test_merge_dicts_merges_nested_dicts():
    destination = {"a": {"b": 1, "c": 2}, "d": 3}
    merged = merge_dicts({"a": {"b": 10, "e": {"f": 4}}, "g": 5}, destination)
    assert merged is destination
    assert merged == {"a": {"b": 10, "c": 2, "e": {"f": 4}}, "d": 3, "g": 5}
