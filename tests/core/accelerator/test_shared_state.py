"""Accelerate's shared-state names on 2 CPU processes: AcceleratorState, GradientState,
_reset_state, destroy_process_group and the job's distributed type."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from slipstream import (
    Accelerator,
    AcceleratorState,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradientState,
    PartialState,
)
from tests.distributed import run_distributed


def _states() -> dict:
    accelerator = Accelerator(mixed_precision="bf16")
    state = AcceleratorState()
    seen = {
        "type": state.distributed_type.value,
        "precision": state.mixed_precision,
        "ranks": (state.process_index, state.num_processes),
        "shared": AcceleratorState._shared_state != {},
        "partial_shared": PartialState._shared_state != {},
        "repr": repr(state),
    }
    accelerator.state._reset_state()  # what Accelerate's scripts call between experiments
    seen["shared_after_reset"] = AcceleratorState._shared_state != {}
    seen["partial_after_reset"] = PartialState._shared_state != {}
    try:
        accelerator.prepare(nn.Linear(1, 1))
        seen["stale"] = "prepared"
    except AttributeError as error:
        seen["stale"] = str(error)
    fresh = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    fresh.prepare(nn.Linear(2, 2))
    seen["fsdp_type"] = AcceleratorState().distributed_type.value
    seen["same_group"] = fresh.state is accelerator.state
    fresh.state.distributed_type = DistributedType.MULTI_CPU  # assignable, as in Accelerate
    seen["assigned"] = PartialState().distributed_type.value
    AcceleratorState._reset_state(reset_partial_state=True)
    seen["partial_after_full_reset"] = PartialState._shared_state != {}
    rebuilt = Accelerator()
    seen["rebuilt_ranks"] = (rebuilt.process_index, rebuilt.num_processes)
    seen["rebuilt_new_state"] = rebuilt.state is not accelerator.state
    return seen


def test_accelerator_state_reports_the_accelerator_and_resets_like_accelerate():
    for rank, seen in enumerate(run_distributed(_states)):
        assert seen["type"] == "MULTI_CPU" and seen["precision"] == "bf16"
        assert seen["ranks"] == (rank, 2)
        assert seen["shared"] and seen["partial_shared"]
        assert "AcceleratorState(distributed_type=MULTI_CPU" in seen["repr"]
        assert not seen["shared_after_reset"], "the accelerator-level state is gone"
        assert seen["partial_after_reset"], "the process group stays"
        assert "`AcceleratorState` object has no attribute" in seen["stale"]
        assert "This happens if `AcceleratorState._reset_state()`" in seen["stale"]
        assert seen["fsdp_type"] == "FSDP" and seen["same_group"]
        assert seen["assigned"] == "MULTI_CPU"
        assert not seen["partial_after_full_reset"]
        assert seen["rebuilt_ranks"] == (rank, 2) and seen["rebuilt_new_state"]


def _gradient_state() -> dict:
    accelerator = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    model = accelerator.prepare(nn.Linear(1, 1))
    outer, inner = accelerator.prepare(DataLoader(range(8), batch_size=1), DataLoader(range(4)))
    gradient_state = accelerator.gradient_state
    seen: dict = {"before": gradient_state.active_dataloader, "steps": gradient_state.num_steps}
    trace = []
    for i, _ in enumerate(outer):
        with accelerator.accumulate(model):
            trace.append(
                (
                    gradient_state.active_dataloader is outer,
                    gradient_state.end_of_dataloader,
                    gradient_state.sync_gradients,
                )
            )
        if i == 1:
            inner_ends = [gradient_state.end_of_dataloader for _ in inner]
            seen["inner_active"] = [gradient_state.active_dataloader is inner for _ in inner]
            seen["inner_ends"] = inner_ends
            seen["back_to_outer"] = gradient_state.active_dataloader is outer
    seen["after"] = gradient_state.active_dataloader
    seen["trace"] = trace
    seen["standalone_steps"] = GradientState().num_steps
    GradientState._reset_state()  # accepted; each Accelerator has its own
    return seen


def test_gradient_state_follows_the_loaders_being_iterated():
    seen = run_distributed(_gradient_state)[0]
    assert seen["before"] is None and seen["after"] is None and seen["steps"] == 2
    # 8 samples on 2 processes: 4 batches each; accumulation syncs every second one.
    assert seen["trace"] == [
        (True, False, False),
        (True, False, True),
        (True, False, False),
        (True, True, True),
    ]
    assert seen["inner_active"] == [True, True] and seen["inner_ends"] == [False, True]
    assert seen["back_to_outer"] and seen["standalone_steps"] == 2


def _destroy() -> tuple[bool, bool]:
    import torch.distributed as dist

    accelerator = Accelerator()
    accelerator.state.destroy_process_group()
    return dist.is_initialized(), PartialState._shared_state != {}


def test_destroy_process_group_on_the_state_leaves_the_group():
    assert run_distributed(_destroy) == [(False, False), (False, False)]


def test_every_accelerate_distributed_type_is_a_member():
    # Scripts compare against members slipstream never reports (XLA, MULTI_NPU, ...).
    for name in ("XLA", "MULTI_NPU", "MULTI_XPU", "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON"):
        assert DistributedType[name].value == name
    state = PartialState()
    with pytest.raises(ValueError):
        state.state.distributed_type = "NOT_A_TYPE"


def test_a_loop_that_accumulates_itself_sets_the_sync_step():
    # transformers' Trainer: accumulation plugin num_steps=1, the loop says which
    # micro-step synchronises; the optimizer steps only on those.
    accelerator = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1))
    model = nn.Linear(2, 1)
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=1.0))
    state = accelerator.gradient_state
    assert state.plugin_kwargs == {
        "num_steps": 1,
        "adjust_scheduler": True,
        "sync_with_dataloader": True,
        "sync_each_batch": False,
    }
    before = model.weight.detach().clone()
    model(torch.ones(1, 2)).sum().backward()
    state._set_sync_gradients(False)
    optimizer.step()
    assert accelerator.sync_gradients is False and torch.equal(model.weight, before)
    state._set_sync_gradients(True)
    optimizer.step()
    assert not torch.equal(model.weight, before) and accelerator.step == 1
