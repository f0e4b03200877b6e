"""Saving a model dispatched with CPU and disk entries reads the offloaded weights back;
training an offloaded quantized model is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from slipstream import Accelerator, load_checkpoint_and_dispatch
from slipstream.big_modeling.offloaded_models import state_dict_with_offloaded


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def test_save_model_of_a_disk_offloaded_model_reads_the_weights_back(tmp_path: Path):
    """Regression: save_model failed with `Cannot copy out of meta tensor` when a device map
    had a "disk" entry (here saving into the very offload folder, as Accelerate's test does)."""
    accelerator = Accelerator()
    model, inputs = _model().eval(), torch.randn(5, 3)
    expected = model(inputs)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    accelerator.save_model(model, str(tmp_path))
    device_map = {"0": "cpu", "1": "disk", "2": "disk"}
    load_checkpoint_and_dispatch(
        model, str(tmp_path), device_map=device_map, offload_folder=str(tmp_path)
    )
    assert model[1].weight.device.type == "meta"  # offloaded between forwards
    state = state_dict_with_offloaded(model)
    assert all(torch.equal(state[k], reference[k]) for k in reference)
    accelerator.save_model(model, str(tmp_path))
    fresh = _model().eval()
    for parameter in fresh.parameters():
        parameter.data.zero_()
    load_checkpoint_and_dispatch(fresh, str(tmp_path))
    assert torch.equal(fresh(inputs), expected)


def test_an_offloaded_quantized_model_is_refused_when_prepared():
    model = nn.Linear(2, 2)
    model.is_loaded_in_8bit = True
    model.hf_device_map = {"": "cpu"}
    with pytest.raises(ValueError, match="cannot be trained with CPU or disk offload"):
        Accelerator().prepare(model)
