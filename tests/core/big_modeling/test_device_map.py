"""Device maps: planned from budgets (auto, balanced, sequential) or given, and checked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream import infer_auto_device_map, init_empty_weights
from slipstream.big_modeling import (
    DeviceMapError,
    check_device_map,
    compute_module_sizes,
    dispatch_model,
    find_tied_parameters,
)
from slipstream.big_modeling.device_map import resolve_device_map
from tests.core.big_modeling.models import Stack, tiny_llama_config


@pytest.fixture
def empty_stack() -> Stack:
    with init_empty_weights():
        return Stack(width=32, depth=6)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_sizes_count_a_tied_weight_once(empty_stack):
    sizes = compute_module_sizes(empty_stack)
    assert sizes["head"] == 0, "the head's weight is the embedding's"
    assert sizes[""] == sum(p.numel() * 4 for p in empty_stack.parameters()) + 4
    assert compute_module_sizes(empty_stack, dtype=torch.bfloat16)["embed"] == 32 * 32 * 2
    assert find_tied_parameters(empty_stack) == [["embed.weight", "head.weight"]]


def test_everything_on_the_cpu_when_it_fits(empty_stack):
    assert infer_auto_device_map(empty_stack, {"cpu": "1GiB"}) == {"": "cpu"}


def test_a_small_cpu_budget_sends_the_rest_to_disk_keeping_room_for_one_block(empty_stack):
    sizes = compute_module_sizes(empty_stack)
    block = sizes["blocks.0"]
    budget = sizes["embed"] + 2 * block + block  # two blocks resident, one in flight
    plan = infer_auto_device_map(empty_stack, {"cpu": budget}, ["Block"])
    assert plan == {
        "embed": "cpu",
        "blocks.0": "cpu",
        "blocks.1": "cpu",
        "blocks.2": "disk",
        "blocks.3": "disk",
        "blocks.4": "disk",
        "blocks.5": "disk",
        "head": "disk",
        "scale": "disk",
    }
    resident = sum(sizes[k] for k, device in plan.items() if device == "cpu")
    assert resident + block <= budget


def test_blocks_are_split_unless_listed(empty_stack):
    sizes = compute_module_sizes(empty_stack)
    budget = sizes["embed"] + sizes["blocks.0"] + sizes["blocks.1.norm"] + sizes["blocks.1.up"]
    plan = infer_auto_device_map(empty_stack, {"cpu": budget})
    assert any(key.startswith("blocks.") and key.count(".") == 2 for key in plan), plan
    whole = infer_auto_device_map(empty_stack, {"cpu": budget}, ["Block"])
    assert all(key.count(".") <= 1 for key in whole), whole


def test_a_transformers_model_declares_its_own_blocks():
    transformers = pytest.importorskip("transformers")
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(tiny_llama_config())
    sizes = compute_module_sizes(model)
    plan = infer_auto_device_map(model, {"cpu": sizes[""] // 2})
    assert "disk" in plan.values()
    assert not any(k.startswith("model.layers.0.") for k in plan), "decoder layers stay whole"


def test_a_budget_that_cannot_hold_one_block_names_it(empty_stack):
    block = compute_module_sizes(empty_stack)["blocks.0"]
    with pytest.raises(DeviceMapError, match=r"cannot hold 'blocks\.\d' \(Block, .*at least"):
        infer_auto_device_map(empty_stack, {"cpu": block - 1}, ["Block"])


def test_an_unknown_block_class_is_an_error(empty_stack):
    with pytest.raises(DeviceMapError, match="no module of that class; its classes: Block"):
        infer_auto_device_map(empty_stack, {"cpu": 100}, ["Blok"])


def test_sequential_fills_gpu_0_first_and_balanced_spreads(two_gpus, empty_stack):
    total = compute_module_sizes(empty_stack)[""]
    budgets = {0: total, 1: total, "cpu": total}
    sequential = resolve_device_map(empty_stack, "sequential", budgets, ["Block"], None)
    assert sequential == {"": 0}
    for strategy in ("auto", "balanced"):
        balanced = resolve_device_map(empty_stack, strategy, budgets, ["Block"], None)
        assert set(balanced.values()) == {0, 1}, balanced
        assert balanced["embed"] == 0 and balanced["blocks.5"] == 1
    low = resolve_device_map(empty_stack, "balanced_low_0", budgets, ["Block"], None)
    assert low == {"": 1}, "GPU 1 holds all of it: GPU 0 stays free for generation"


def test_with_gpus_the_cpu_and_disk_come_after(two_gpus, empty_stack):
    sizes = compute_module_sizes(empty_stack)
    block = sizes["blocks.0"]
    budgets = {0: sizes["embed"] + 2 * block, 1: 2 * block, "cpu": 2 * block}
    plan = infer_auto_device_map(empty_stack, budgets, ["Block"])
    order = list(plan.values())
    assert order[0] == 0 and "cpu" in order and order[-1] == "disk"
    assert order == sorted(order, key=[0, 1, "cpu", "disk"].index), "devices in order"


def test_explicit_maps_are_checked(empty_stack):
    plan = {"embed": "cpu", "blocks": torch.device("cpu"), "head": "disk", "scale": "cpu"}
    assert check_device_map(empty_stack, plan)["blocks"] == "cpu"
    with pytest.warns(UserWarning, match=r"do not match any submodules.*'block' \(did you mean"):
        assert check_device_map(empty_stack, {"block": "cpu", "": "cpu"}) == {"": "cpu"}
    with pytest.raises(DeviceMapError, match=r"no device for 'scale', 'blocks'; add them"):
        check_device_map(empty_stack, {"embed": "cpu", "head": "cpu"})
    with pytest.raises(DeviceMapError, match=r"device_map\['head'\] names device 'gpu'"):
        check_device_map(empty_stack, {"": "cpu", "head": "gpu"})
    with pytest.raises(DeviceMapError, match="one of"):
        resolve_device_map(empty_stack, "fastest", None, None, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_a_map_may_plan_for_a_gpu_this_machine_lacks_but_not_place_weights_there(empty_stack):
    assert check_device_map(empty_stack, {"": "cpu", "embed": 0})["embed"] == 0
    with pytest.raises(DeviceMapError, match=r"device_map\['embed'\] names device 0"):
        check_device_map(empty_stack, {"": "cpu", "embed": 0}, must_exist=True)
    with pytest.raises(DeviceMapError, match=r"device_map\['embed'\] names device 0"):
        dispatch_model(empty_stack, {"": "cpu", "embed": 0})


def test_tensor_names_may_be_map_keys():
    model = nn.Sequential(nn.Linear(2, 2))
    assert check_device_map(model, {"0.weight": "cpu", "0.bias": "disk"}) == {
        "0.weight": "cpu",
        "0.bias": "disk",
    }


def test_buffers_of_offloaded_modules_that_cannot_fit_on_the_gpu_are_warned_about():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(4, 4), nn.Linear(4, 4))  # 24, 80, 80 B
    for layer in model[1:]:
        layer.register_buffer("stats", torch.zeros(32))  # 128 B each
    budget = {0: 250, "cpu": "1GB"}  # the first layer fits next to the largest block's room
    with pytest.warns(UserWarning, match=r"buffers of the offloaded modules \(256 ?B\) stay on 0"):
        plan = infer_auto_device_map(model, max_memory=budget)
    assert plan == {"0": 0, "1": "cpu", "2": "cpu"}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert infer_auto_device_map(model, max_memory=budget, offload_buffers=True) == plan
        # Nothing offloaded: a GPU is filled up, with no room kept for a block (Accelerate
        # keeps the largest layer's room on every GPU but the last all the same).
        assert infer_auto_device_map(model, max_memory={0: 300, 1: 300}) == {"0": 0, "1": 0, "2": 1}
