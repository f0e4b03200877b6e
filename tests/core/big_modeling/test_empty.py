"""init_empty_weights / init_on_device: models built without memory."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from slipstream import init_empty_weights, init_on_device
from tests.core.big_modeling.models import Stack, tiny_llama_config


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc (Linux)")
def test_a_model_built_empty_holds_no_storage():
    before = _resident_bytes()
    with init_empty_weights():
        # 40 layers of 4096 x 4096: 2.7 GB of fp32 weights if they were allocated.
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(40)])
    grown = _resident_bytes() - before
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) * 4 > 2.6e9
    assert grown < 100e6, f"building the empty model took {grown / 1e6:.0f} MB"
    assert isinstance(model[0].weight, nn.Parameter) and model[0].weight.requires_grad


def test_buffers_are_real_unless_included():
    with init_empty_weights():
        model = Stack()
    assert not model.scale.is_meta and model.scale.item() == 0.5
    assert all(p.is_meta for p in model.parameters())
    assert model.head.weight is model.embed.weight, "ties survive"
    with init_empty_weights(include_buffers=True):
        model = Stack()
    assert model.scale.is_meta


def test_registration_is_restored_even_after_an_error():
    original = nn.Module.register_parameter
    with pytest.raises(RuntimeError, match="boom"), init_empty_weights():
        raise RuntimeError("boom")
    assert nn.Module.register_parameter is original
    assert not nn.Linear(2, 2).weight.is_meta


def test_init_on_device_places_parameters():
    with init_on_device("cpu"):
        layer = nn.Linear(3, 3)
    assert layer.weight.device.type == "cpu"
    with init_on_device(torch.device("meta"), include_buffers=True):
        norm = nn.BatchNorm1d(3)
    assert norm.weight.is_meta and norm.running_mean.is_meta


def test_a_transformers_model_keeps_its_computed_buffers():
    transformers = pytest.importorskip("transformers")
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True))
    assert all(p.is_meta for p in model.parameters())
    assert not model.model.rotary_emb.inv_freq.is_meta
    assert model.lm_head.weight is model.model.embed_tokens.weight
