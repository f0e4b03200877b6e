"""Model factories for the estimate-memory tests, named as MODEL arguments, e.g.
``tests.core.cli.model_factories:make_small``."""

from __future__ import annotations

import torch
from torch import nn

NOT_CALLABLE = 3


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)  # buffers: running mean, var, count


class Net(nn.Module):
    """embed 6*16+16 = 112, each block 16*16+16 + 2*16 = 304, head 16+1 = 17."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.blocks = nn.ModuleList([Block(16), Block(16)])
        self.head = nn.Linear(16, 1)


class RootParameter(nn.Module):
    """A parameter held by the root itself (1000) beside a small child (2*2+2 = 6)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(1000))
        self.child = nn.Linear(2, 2)


def make_small() -> nn.Module:
    """N = (10*10 + 10) + (10*5 + 5) = 110 + 55 = 165."""
    return nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 5))


def make_frozen() -> nn.Module:
    """The small model with its first layer (110 parameters) frozen: 55 trainable."""
    model = make_small()
    model[0].requires_grad_(False)
    return model


def make_tied() -> nn.Module:
    """Two layers sharing one weight: 10*10 + 10 + 10 = 120 distinct parameters."""
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    model[1].weight = model[0].weight
    return model


def make_huge() -> nn.Module:
    """50000*50000 + 50000 parameters: 10 GB in fp32 if it were ever materialised."""
    return nn.Linear(50000, 50000)


def make_net() -> nn.Module:
    return Net()


def make_root_parameter() -> nn.Module:
    return RootParameter()


def make_number() -> int:
    return 42


def make_broken() -> nn.Module:
    raise RuntimeError("checkpoint not found\nsecond line")


def make_tiny_qwen3_moe() -> nn.Module:
    """A tiny transformers Qwen3-MoE (4 experts per layer, its own ep plan): embed 32x8 =
    256; per layer attention 4 * 8x8 + q/k norms 8 = 264, experts 4 x (8x8 + 8x4) = 384,
    router 4x8 = 32, two norms 16 (696); norm 8; lm_head 256. N = 1,912, experts 768."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        moe_intermediate_size=4,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return transformers.Qwen3MoeForCausalLM(config)
