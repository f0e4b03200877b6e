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
