"""Small parts of the Accelerator's surface Accelerate's code uses: settable accumulation
and sync flags, unwrapping DataParallel and torch.compile wrappers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream import Accelerator, GradientState


def test_accumulation_steps_and_sync_gradients_can_be_set():
    accelerator = Accelerator()
    accelerator.gradient_accumulation_steps = 4
    assert GradientState().num_steps == 4 == accelerator.step_state.cycle_length
    accelerator.sync_gradients = False
    assert GradientState().sync_gradients is False
    with pytest.raises(ValueError, match="must be an integer >= 1, got 0"):
        accelerator.gradient_accumulation_steps = 0


def test_unwrap_removes_dataparallel_and_compile_unless_asked_to_keep_compile():
    model = nn.Linear(2, 2)
    wrapped = torch.compile(nn.DataParallel(model))
    accelerator = Accelerator()
    assert accelerator.unwrap_model(wrapped) is model
    kept = accelerator.unwrap_model(wrapped, keep_torch_compile=True)
    assert kept._orig_mod is model and wrapped._orig_mod.module is model  # not changed
    assert accelerator.unwrap_model(model, keep_torch_compile=True) is model


def test_accelerates_device_variable_chooses_the_device(monkeypatch):
    from slipstream.runtime.state import select_device

    assert select_device(0, 1, cpu=True) == torch.device("cpu")
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu:3")
    assert select_device(0, 1, cpu=True) == torch.device("cpu", 3)
