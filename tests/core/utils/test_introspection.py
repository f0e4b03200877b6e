"""Looking inside models: wrappers removed, compiled modules found, dotted attributes."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from slipstream.precision.base import patch_forward_with
from slipstream.utils.introspection import (
    extract_model_from_parallel,
    get_pretty_name,
    has_compiled_regions,
    is_compiled_module,
    is_peft_model,
    model_has_dtensor,
    recursive_getattr,
)


def test_wrappers_are_removed():
    model = nn.Linear(2, 2)
    assert extract_model_from_parallel(nn.DataParallel(nn.DataParallel(model))) is model
    assert extract_model_from_parallel(model) is model


def test_torch_compile_wrapper_is_kept_unless_asked():
    model = nn.Linear(2, 2)
    compiled = torch.compile(nn.DataParallel(model))
    assert is_compiled_module(compiled) and not is_compiled_module(model)
    kept = extract_model_from_parallel(compiled)
    assert kept is compiled and kept._orig_mod is model
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model


def test_recursive_unwrapping_of_submodules():
    inner = nn.Linear(2, 2)
    outer = nn.Sequential(nn.DataParallel(inner), nn.ReLU())
    assert extract_model_from_parallel(outer, recursive=False)[0] is not inner
    assert extract_model_from_parallel(outer, recursive=True)[0] is inner


def test_the_mixed_precision_forward_patch_can_be_removed():
    model = nn.Linear(2, 2)
    patch_forward_with(model, torch.no_grad, convert_outputs_to_fp32=True)
    assert "forward" in model.__dict__
    assert "forward" in extract_model_from_parallel(model).__dict__
    assert "forward" not in extract_model_from_parallel(model, keep_fp32_wrapper=False).__dict__


def test_compiled_regions():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert not has_compiled_regions(model)
    model[0] = torch.compile(model[0])
    assert has_compiled_regions(model)
    assert not has_compiled_regions(nn.ReLU()), "a module without children has no regions"


def test_plain_models_are_neither_peft_nor_dtensor():
    assert not is_peft_model(nn.Linear(2, 2))
    assert not model_has_dtensor(nn.Linear(2, 2))


def test_recursive_getattr_and_pretty_names():
    model = nn.Sequential(nn.Linear(2, 3))
    assert recursive_getattr(model, "0.weight").shape == (3, 2)
    with pytest.raises(AttributeError):
        recursive_getattr(model, "0.missing")
    assert get_pretty_name(nn.Linear) == "Linear"
    assert get_pretty_name(model) == "Sequential"
    assert get_pretty_name(get_pretty_name) == "get_pretty_name"
    assert get_pretty_name(functools.partial(print)) == "partial"
