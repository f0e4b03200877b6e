"""Hooks around forward: attach, chain, remove; offloaded weights loaded and released."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.big_modeling import (
    AlignDevicesHook,
    ModelHook,
    OffloadedWeightsLoader,
    add_hook_to_module,
    has_offloaded_params,
    remove_hook_from_module,
)


class Doubler(ModelHook):
    def pre_forward(self, module, *args, **kwargs):
        return tuple(a * 2 for a in args), kwargs


class AddOne(ModelHook):
    def post_forward(self, module, output):
        return output + 1


def test_hooks_wrap_the_forward_chain_and_come_off():
    layer = nn.Identity()
    add_hook_to_module(layer, Doubler())
    assert torch.equal(layer(torch.ones(2)), torch.full((2,), 2.0))
    add_hook_to_module(layer, AddOne(), append=True)
    assert torch.equal(layer(torch.ones(2)), torch.full((2,), 3.0))
    add_hook_to_module(layer, AddOne())  # replaces the chain
    assert torch.equal(layer(torch.ones(2)), torch.full((2,), 2.0))
    remove_hook_from_module(layer)
    assert torch.equal(layer(torch.ones(2)), torch.ones(2))
    assert not {"forward", "_hf_hook", "_old_forward"} & set(layer.__dict__)


def test_removing_keeps_a_forward_set_on_the_instance():
    layer = nn.Identity()
    layer.forward = lambda x: x * 10  # set before any hook
    add_hook_to_module(layer, AddOne())
    assert layer(torch.ones(1)).item() == 11
    remove_hook_from_module(layer)
    assert layer(torch.ones(1)).item() == 10


def test_offloaded_weights_exist_only_during_the_forward_even_when_it_raises():
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    expected = layer(torch.ones(1, 3)).detach()
    original = {k: v.clone() for k, v in layer.state_dict().items()}
    weights = OffloadedWeightsLoader(state_dict=original)
    assert not has_offloaded_params(layer)
    add_hook_to_module(layer, AlignDevicesHook("cpu", offload=True, weights_map=weights))
    assert has_offloaded_params(layer)
    assert layer.weight.is_meta and isinstance(layer.weight, nn.Parameter)
    assert torch.equal(layer(torch.ones(1, 3)), expected)
    assert layer.weight.is_meta and layer.bias.is_meta
    with pytest.raises(RuntimeError):
        layer(torch.ones(1, 4))
    assert layer.weight.is_meta, "released after a failing forward too"
    remove_hook_from_module(layer)
    assert torch.equal(layer.weight, original["weight"]), "detaching puts the weights back"


def test_a_hook_without_a_weights_map_keeps_the_module_weights_in_ram():
    layer = nn.Linear(3, 2)
    before = layer.weight.detach().clone()
    add_hook_to_module(layer, AlignDevicesHook("cpu", offload=True))
    assert layer.weight.is_meta
    remove_hook_from_module(layer)
    assert torch.equal(layer.weight, before), "detaching restores the weights"


def test_tied_weights_of_one_module_are_loaded_once():
    shared = nn.Parameter(torch.randn(4, 4))
    module = nn.Module()
    module.a = shared
    module.b = shared
    module.forward = lambda: module.a is module.b  # type: ignore[method-assign]
    weights = OffloadedWeightsLoader(state_dict={"a": shared.detach(), "b": shared.detach()})
    add_hook_to_module(module, AlignDevicesHook("cpu", offload=True, weights_map=weights))
    assert module() is True


def test_inputs_move_to_the_execution_device_except_skip_keys():
    seen = {}

    class Probe(nn.Module):
        def forward(self, x, cache=None):
            seen["x"], seen["cache"] = x.device, cache
            return x.shape

    probe = Probe()
    add_hook_to_module(probe, AlignDevicesHook("meta", skip_keys="cache"))
    cache = {"keys": torch.zeros(1)}
    assert probe(torch.ones(3), cache=cache) == (3,)
    assert seen["x"].type == "meta", "moved to the execution device"
    assert seen["cache"] is cache and cache["keys"].device.type == "cpu", "left alone"
