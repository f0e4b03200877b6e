"""Naming, sizing and replacing a model's tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.big_modeling import named_module_tensors, set_module_tensor_to_device
from slipstream.big_modeling.tensors import resolve_dtype, tie_groups
from tests.core.big_modeling.models import Stack


def test_set_module_tensor_keeps_class_and_converts_to_the_current_dtype():
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)
    set_module_tensor_to_device(
        model, "0.weight", "cpu", value=torch.ones(2, 2, dtype=torch.float64)
    )
    assert isinstance(model[0].weight, nn.Parameter) and not model[0].weight.requires_grad
    assert model[0].weight.dtype == torch.float32, "the model's dtype wins without dtype="
    set_module_tensor_to_device(model, "0.bias", "cpu", value=torch.ones(2), dtype="bf16")
    assert model[0].bias.dtype == torch.bfloat16
    set_module_tensor_to_device(model, "0.weight", "meta")
    assert [n for n, t in model.state_dict().items() if t.is_meta] == ["0.weight"]


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "0.weight",
            torch.ones(3, 3),
            r'shape torch.Size\(\[3, 3\]\) in "weight" \(which has shape torch.Size\(\[2, 2\]\)\)',
        ),
        (
            "0.scale",
            None,
            r"no parameter or buffer '0.scale' \(Linear at 0 holds \['bias', 'weight'\]\)",
        ),
        ("9.weight", None, "has no submodule '9'"),
    ],
)
def test_bad_names_and_shapes_are_named(name, value, message):
    with pytest.raises((ValueError, KeyError), match=message):
        set_module_tensor_to_device(nn.Sequential(nn.Linear(2, 2)), name, "cpu", value=value)


def test_a_meta_tensor_cannot_move_without_a_value():
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="has no data"):
        set_module_tensor_to_device(model, "weight", "cpu")


def test_ties_and_names():
    model = Stack()
    assert tie_groups(model)["head.weight"] == ("embed.weight", "head.weight")
    assert [n for n, _ in named_module_tensors(model)] == ["scale"]
    assert len(list(named_module_tensors(model, recurse=True))) == len(list(model.parameters())) + 1
    with pytest.raises(ValueError, match="not a torch dtype"):
        resolve_dtype("float33")
