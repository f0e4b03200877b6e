"""Checkpoints shared by the big-model tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.core.big_modeling.models import Stack, tiny_llama_config


@pytest.fixture
def stack() -> Stack:
    torch.manual_seed(0)
    return Stack().eval()


@pytest.fixture
def stack_checkpoint(tmp_path: Path, stack: Stack) -> Path:
    """``stack`` saved by slipstream's save_weights in several shards (tied head stored once)."""
    from slipstream.checkpoint import save_weights

    folder = tmp_path / "stack"
    save_weights(stack.state_dict(), str(folder), max_shard_size="3KB")
    return folder


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path]:
    """A tiny random transformers Llama and its save_pretrained folder (several shards)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder, max_shard_size="200KB")
    return model, folder
